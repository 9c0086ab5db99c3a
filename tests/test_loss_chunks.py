"""The chunked output layer + loss against the full [B, T, V] logits, --remat against none, and a gpt2-tiny run
whose losses match today's (full logits, no remat) step for step.

On 8 emulated devices: loss and gradients (hidden states and table) of xent.chunked equal jax.grad of
gpt2.loss_fn on full logits, padding masked, on meshes 8x1 and 4x2 (vocab over `model`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from trainer.pretrain import train as loop
from trainer.common import mesh as mesh_lib
from trainer.common.config import PRESETS, Config
from trainer.models import gpt2, xent


def full(x, table, targets, vocab_size):
    return gpt2.loss_fn(xent.logits(x, table, vocab_size), targets)


@pytest.mark.parametrize("shape", [(8, 1), (4, 2)])
@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_chunked_loss_and_gradients_equal_the_full_logits(shape, chunk):
    mesh = mesh_lib.make_mesh({"data": shape[0], "model": shape[1]})
    rng = np.random.default_rng(0)
    b, t, d, vocab, padded = 8, 16, 32, 1000, 1024
    x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    table = jnp.asarray(0.3 * rng.standard_normal((padded, d)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, P("data")), put(table, P("model")), put(targets, P("data")))
    with jax.set_mesh(mesh):
        want, wg = jax.jit(jax.value_and_grad(full, argnums=(0, 1)), static_argnums=3)(*args, vocab)
        got, g = jax.jit(jax.value_and_grad(xent.chunked, argnums=(0, 1)), static_argnums=(3, 4))(*args, chunk, vocab)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for a, w in zip(g, wg):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-6)
    assert not np.asarray(g[1])[vocab:].any()  # padding rows never learn


def test_a_chunk_that_does_not_divide_the_sequence_takes_the_largest_divisor_below_it():
    assert [xent.chunk_of(c, 12) for c in (0, 5, 6, 7, 12, 100)] == [12, 4, 6, 6, 12, 12]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 12, 8)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 16, (2, 12)), jnp.int32)
    np.testing.assert_allclose(float(xent.chunked(x, table, targets, 5)), float(full(x, table, targets, 16)),
                               rtol=1e-6)


VOCAB = 2048  # gpt2-tiny's layers with a smaller vocabulary: the 50k output layer would be most of the test's time


def _tiny(**train):
    model, t = PRESETS["gpt2-tiny"]
    return Config("gpt2-tiny", dataclasses.replace(model, vocab_size=VOCAB),
                  dataclasses.replace(t, ckpt_dir="/unused", dtype="float32", attention="xla", **train))


def _run(cfg: Config, batches: np.ndarray, devices: int) -> list[float]:
    steps = loop.Steps(cfg, mesh_lib.make_mesh({"data": devices, "model": 1}, jax.devices()[:devices]))
    steps.compile()
    params, opt = steps.init()
    out = []
    for i, local in enumerate(batches, start=1):
        params, opt, rec = steps.step(params, opt, local, i)
        out.append(float(rec["loss"]))
    return out


def test_gpt2_tiny_trains_as_with_the_full_logits():
    """20 steps: today's path (all logits at once, nothing recomputed) against chunks of 32 positions with
    every layer recomputed (full remat), on the same batches from the same initial weights. The replicated
    output layer (what a large batch takes); the vocab-parallel one's chunks are checked in
    tests/test_vocab_parallel.py."""
    vocab_parallel, devices = "off", 1
    model, _ = PRESETS["gpt2-tiny"]
    rng = np.random.default_rng(0)
    # Skewed token frequencies: something to learn in 20 steps, so that the losses move.
    batches = np.minimum(rng.geometric(0.02, (20, 8, model.seq_len + 1)), VOCAB - 1).astype(np.int32)
    today = _run(_tiny(loss_chunk=0, remat="none", vocab_parallel=vocab_parallel), batches, devices)
    new = _run(_tiny(loss_chunk=32, remat="full", vocab_parallel=vocab_parallel), batches, devices)
    assert today[-1] < today[0] - 0.5  # it trains (the comparison is not between two flat lines)
    np.testing.assert_allclose(new, today, atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", ["dots", "full"])
def test_remat_policies_give_the_same_loss_and_gradients(policy):
    """What the backward pass recomputes changes memory, not the numbers (no mesh, f32, one tiny block)."""
    from flax import nnx
    from trainer.common.config import ModelConfig
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=256, dropout=0.1)
    graphdef, params = nnx.split(gpt2.GPT2(cfg, nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 17)), jnp.int32)

    def loss(params, remat):
        return nnx.merge(graphdef, params).loss(tokens, dropout_key=jax.random.key(1), remat=remat)
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (want, wg), (got, g) = grad(params, "none"), grad(params, policy)
    assert float(got) == pytest.approx(float(want), abs=1e-6)
    for a, w in zip(jax.tree.leaves(g), jax.tree.leaves(wg)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 4])
def test_the_tied_table_per_batch_shard_gives_the_same_loss_and_gradients(chunk):
    """On a mesh that splits the batch 4 ways, `loss` hands the lookup and the output layer the table once per
    batch shard (xent.per_shard), so its two gradients are added before the one reduction over the batch; the
    loss and every gradient equal those off a mesh (one table, its uses' gradients added after)."""
    from flax import nnx
    from trainer.common.config import ModelConfig
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=250, dropout=0.0)
    graphdef, params = nnx.split(gpt2.GPT2(cfg, nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 250, (8, 17)), jnp.int32)

    def loss(params, tokens, table_grads="once"):
        return nnx.merge(graphdef, params).loss(tokens, loss_chunk=chunk, table_grads=table_grads)
    want, wg = jax.jit(jax.value_and_grad(loss))(params, tokens)
    mesh = mesh_lib.make_mesh({"data": 4, "model": 2}, jax.devices()[:8])
    with jax.set_mesh(mesh):
        assert xent.batch_shards(8) == 4
        text = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).as_text()
        assert "(tensor<1x256x32xf32>) -> tensor<4x256x32xf32>" in text  # the table broadcast to per-shard copies
        one = jax.jit(jax.value_and_grad(loss), static_argnums=2).lower(params, tokens, "per-use").as_text()
        assert "(tensor<1x256x32xf32>) -> tensor<4x256x32xf32>" not in one  # --table-grads per-use: one table
        got, g = jax.jit(jax.value_and_grad(loss))(params, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    assert float(got) == pytest.approx(float(want), abs=1e-6)
    for a, w in zip(jax.tree.leaves(g), jax.tree.leaves(wg)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-6)


def test_narrow_logits_keep_the_loss_and_gradients_close():
    """--logits compute: each chunk's logits written in the compute dtype (bf16 here), the softmax in f32 from
    them: the loss and gradients stay close to f32 logits' (bf16's 8 bits of mantissa), and differ from them."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.bfloat16)
    table = jnp.asarray(rng.normal(size=(300, 32)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 250, (2, 16)), jnp.int32)
    grad = jax.jit(jax.value_and_grad(xent.chunked, argnums=(0, 1)), static_argnums=(3, 4, 5, 6))
    (wide, (wx, wt)), (narrow, (nx, nt)) = grad(x, table, targets, 4, 250, None, False), grad(x, table, targets, 4,
                                                                                               250, None, True)
    assert float(narrow) != float(wide) and float(narrow) == pytest.approx(float(wide), rel=1e-2)
    np.testing.assert_allclose(np.asarray(nt), np.asarray(wt), atol=2e-3)
    np.testing.assert_allclose(np.asarray(nx, np.float32), np.asarray(wx, np.float32), atol=2e-3)
