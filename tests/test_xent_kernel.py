"""The output layer and loss as Pallas kernels (trainer/kernels/xent_kernel.py) against the full [B, T, V] logits.

On CPU the kernels run through Pallas' interpreter, which executes the kernel bodies block by block as the TPU
would (the grid, the blocks, the scratch carried across vocabulary blocks). Their HBM traffic, which the TPU
compiler takes from the kernels' cost estimates, is checked against a count of the block fetches their grids
make; the compiled TPU step's own figures are in tests/test_plan.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from trainer.common import mesh as mesh_lib
from trainer.common.config import UsageError
from trainer.kernels import xent_kernel as xk
from trainer.models import gpt2, xent

# blocks small enough that every kernel runs several grid steps on both axes at these sizes
SMALL = xk.Kernel(xk.Blocks(tokens=64, vocab=128, grad_vocab=128, grad_tokens=128), interpret=True)


def full(x, table, targets, vocab_size):
    return gpt2.loss_fn(xent.logits(x, table, vocab_size), targets)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_loss_and_gradients_equal_the_full_logits(dtype):
    """Padded vocabulary (rows past vocab_size never predicted, their gradient zero), several blocks of tokens and
    of table rows: the loss and both gradients equal autodiff through the full f32 logits; in bf16 within its
    rounding (the softmax enters each matmul in the compute dtype, as in XLA's loss)."""
    rng = np.random.default_rng(0)
    b, t, d, vocab, padded = 2, 128, 128, 700, 768
    x = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
    table = jnp.asarray(0.3 * rng.standard_normal((padded, d)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    p = xk.plan(b * t, padded, d, SMALL.blocks)
    assert (p.n // p.bn, p.v // p.bv, p.v // p.gv, p.n // p.gn) == (4, 6, 6, 2)
    want, (wx, wt) = jax.jit(jax.value_and_grad(full, argnums=(0, 1)), static_argnums=3)(x, table, targets, vocab)
    got, (gx, gt) = jax.jit(jax.value_and_grad(xk.loss, argnums=(0, 1)), static_argnums=(3, 4))(
        x, table, targets, vocab, SMALL)
    tol = 1e-5 if dtype == jnp.float32 else 1e-3
    assert float(got) == pytest.approx(float(want), rel=tol)
    assert gx.dtype == dtype and gt.dtype == jnp.float32
    scale = float(jnp.max(jnp.abs(wt)))
    np.testing.assert_allclose(np.asarray(gt), np.asarray(wt), atol=tol * scale * 10)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(wx, np.float32),
                               atol=tol * float(jnp.max(jnp.abs(wx.astype(jnp.float32)))) * 10)
    assert not np.asarray(gt)[vocab:].any()  # padding rows never learn
    # the cotangent scales both gradients (the loss times 3)
    _, (gx3, gt3) = jax.jit(jax.value_and_grad(lambda *a: 3 * xk.loss(*a), argnums=(0, 1)), static_argnums=(3, 4))(
        x, table, targets, vocab, SMALL)
    np.testing.assert_allclose(np.asarray(gt3), 3 * np.asarray(gt), rtol=1e-5, atol=1e-7)


def test_gpt2_loss_through_the_kernels_on_a_mesh_equals_xlas():
    """gpt2.loss with the kernels, on a mesh that splits the batch 4 ways (the table once per batch shard,
    xent.per_shard: each device's kernels see their own tokens and add the table's gradient locally): the loss
    and every parameter's gradient equal XLA's chunked loss's off a mesh."""
    from flax import nnx
    from trainer.common.config import ModelConfig
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=128, seq_len=64, vocab_size=250, dropout=0.0)
    graphdef, params = nnx.split(gpt2.GPT2(cfg, nnx.Rngs(0)))
    assert cfg.padded_vocab == 256
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 250, (8, 65)), jnp.int32)

    def loss(params, tokens, kernel):
        return nnx.merge(graphdef, params).loss(tokens, loss_chunk=16, loss_kernel=kernel)
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)
    want, wg = grad(params, tokens, None)
    mesh = mesh_lib.make_mesh({"data": 4, "model": 2}, jax.devices()[:8])
    with jax.set_mesh(mesh):
        assert xk.fits((8, 64, 128), (4, 256, 128), SMALL)
        text = str(jax.make_jaxpr(jax.value_and_grad(loss), static_argnums=2)(params, tokens, SMALL))
        got, g = grad(params, jax.device_put(tokens, NamedSharding(mesh, P("data"))), SMALL)
    assert "xent_softmax_table" in text and "xent_table_grad" in text  # the kernels, not XLA's loss
    assert float(got) == pytest.approx(float(want), abs=1e-5)
    for a, w in zip(jax.tree.leaves(g), jax.tree.leaves(wg)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-6)


def _fetched(grid, blocks, itemsizes, outputs: bool) -> float:
    """Bytes the pipeline moves for these blocks over the grid, walked step by step in order: an input block is
    fetched when its index differs from the previous step's; an output block is written back when its index
    changes, and at the end."""
    steps = [(a, b) for a in range(grid[0]) for b in range(grid[1])]
    total = 0.0
    for (shape, index), size in zip(blocks, itemsizes):
        last = None
        for s in steps:
            now = index(*s)
            if now != last:
                total += float(np.prod(shape)) * size
            last = now
    return total


@pytest.mark.parametrize("shape", [(8192, 50304, 768), (512, 1024, 128), (1024, 384, 256), (256, 50304, 128)])
@pytest.mark.parametrize("kernel", [xk.Kernel(), xk.SMALL], ids=["default", "small-vmem"])
def test_the_cost_estimates_are_the_blocks_the_grids_fetch(shape, kernel):
    """What each kernel declares to the compiler (xk.traffic) equals the bytes its grid's block fetches and
    write-backs move, counted step by step from the index maps the kernels are built with; one-block grids
    included (a block that never moves is fetched once). The softmax kernel reads the table once per block of
    tokens; the gradient kernel the tokens once per block of table rows."""
    n, v, d = shape
    p = xk.plan(n, v, d, kernel.blocks)
    assert p is not None
    cost = xk.traffic(p, 2)
    grid, ins, outs = xk.softmax_grid(p)
    softmax = _fetched(grid, ins, [2, 2], False) + _fetched(grid, outs, [4, 4], True)
    grid, ins, outs = xk.grad_grid(p)
    grad = _fetched(grid, ins, [2, 2, 4, 4], False) + _fetched(grid, outs, [4], True)
    assert cost["softmax_bytes"] == softmax and cost["grad_bytes"] == grad
    assert cost["softmax_flops"] == cost["grad_flops"] == 4.0 * n * v * d  # the logits' matmul and one more each
    if shape == (8192, 50304, 768) and kernel == xk.Kernel():
        # gpt2-124m, 8 x 1024 tokens per device: 0.91 GB in all, against 1.65 GB for one f32 copy of the logits
        assert (p.bn, p.bv, p.gv, p.gn) == (2048, 384, 2096, 512)
        assert softmax + grad < 0.95e9 < 4 * n * v  # n x v x 4 bytes: the logits in f32, once


def test_blocks_follow_the_chip_and_the_shapes():
    assert xk.resolve("auto", "cpu") is None and xk.resolve("xla", "tpu", "TPU v5 lite") is None
    # auto on TPU: what the chip measured faster (trainer/common/chip_choices.py): XLA's loss on v5e, and on the
    # kinds not measured, which take v5e's row
    assert xk.resolve("auto", "tpu", "TPU v5 lite") is None and xk.resolve("auto", "tpu", "TPU v4") is None
    assert xk.resolve("pallas", "tpu", "TPU v5 lite") == xk.Kernel()
    assert xk.resolve("pallas", "tpu", "TPU v4") == xk.SMALL  # 16 MiB of VMEM
    assert xk.resolve("pallas", "cpu").interpret
    with pytest.raises(UsageError, match="--loss-kernel fast: choose one of auto, xla, pallas"):
        xk.resolve("fast", "tpu")
    assert xk.divisor(50304, 512, 128) == 384 and xk.divisor(50304, 2560, 16) == 2096
    assert xk.plan(8192, 50304, 100) is None  # a hidden size that is not whole lanes: XLA's loss instead
    assert not xk.fits((3, 64, 128), (256, 128), SMALL)  # 192 tokens: no block of 128 lanes divides them
