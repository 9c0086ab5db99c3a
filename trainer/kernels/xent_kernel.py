"""The tied output layer and its cross-entropy as two Pallas TPU kernels that never write a logit to HBM.

The XLA loss (xent.chunked) writes each chunk's [tokens, V] f32 logits to HBM and reads them back two or three
times: for GPT-2's 50k vocabulary and 8 x 1024 tokens per device that is 1.65 GB a pass, most of the output
layer's bytes. Here the logits live only in VMEM, a block of tokens by a block of the vocabulary at a time:

- `_softmax_kernel` (grid: token blocks x vocab blocks) streams the table past each block of tokens, as flash
  attention streams keys and values past queries (the table is both): a running max and sum of exponentials and
  the softmax-weighted sum of table rows. Out: each token's log-sum-exp and softmax(logits) @ table.
- `_table_grad_kernel` (grid: vocab blocks x token blocks) computes the logits again, transposed, for one block
  of table rows against every block of tokens: d loss / d logits = softmax - onehot(target), from the log-sum-exp,
  times the tokens' hidden states, summed into that block's rows of the table's gradient.

What is left is cheap and done by XLA: the target's logit and the onehot's share of dx are the target's table
row (a gather of [tokens, D]), as in xent._one_pass.

The logits are computed twice (8 N V D FLOPs against the XLA loss's 6 N V D); the table is read once per block
of tokens by the first kernel and the hidden states once per block of table rows by the second. `traffic` counts
those reads from the grids, and each kernel hands its count to the compiler as its cost estimate: the TPU
compiler counts no byte and no FLOP of a Pallas kernel without one.

Off TPU the kernels run through Pallas' interpreter (slow, exact: for checks). Numerically they are the XLA
loss's: f32 logits and statistics, the softmax rounded to the compute dtype before each matmul that reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

LANES, SUBLANES = 128, 16  # a block's minor dimension is whole lanes; its second-minor whole bf16 sublane pairs
CHOICES = ("auto", "xla", "pallas")


@dataclass(frozen=True)
class Blocks:
    """Block sizes, each the largest divisor of its dimension not above the cap (and a multiple of what the TPU
    tiles need). Larger token blocks read the table fewer times in the softmax kernel; larger vocabulary blocks
    read the hidden states fewer times in the table's gradient kernel; both hold more VMEM."""
    tokens: int = 2048        # softmax kernel: tokens per block
    vocab: int = 512          # softmax kernel: table rows per block (lanes of the logits block)
    grad_vocab: int = 2560    # table's gradient kernel: table rows per block
    grad_tokens: int = 512    # table's gradient kernel: tokens per block (lanes of the transposed logits block)


@dataclass(frozen=True)
class Kernel:
    """How the kernels run: their blocks, the VMEM they may use, and whether through Pallas' interpreter."""
    blocks: Blocks = Blocks()
    vmem_limit: int = 48 * 2 ** 20
    interpret: bool = False


# Chips whose TensorCore has 16 MiB of VMEM (libtpu for v4: "Used 36.88M of 16.00M vmem" with the default
# blocks): smaller blocks, which read the table and the hidden states more often (gpt2-124m's output layer and
# loss on v4: 3.9 GB per device and step, against 1.4 GB with the default blocks on v5e and v6e).
SMALL_VMEM = ("TPU v2", "TPU v3", "TPU v4")
SMALL = Kernel(Blocks(tokens=512, vocab=384, grad_vocab=384, grad_tokens=512), vmem_limit=16 * 2 ** 20)


def resolve(name: str, platform: str, device_kind: str = "") -> Kernel | None:
    """--loss-kernel for a step compiled for `platform` devices of `device_kind`: the kernels' settings, or None
    for the XLA loss (xent.chunked, --loss-chunk). auto: on TPU what the chip measured faster
    (trainer/common/chip_choices.py), XLA elsewhere; pallas off TPU runs them through Pallas' interpreter (slow,
    for checks)."""
    from trainer.common import chip_choices
    from trainer.common.config import UsageError
    if name not in CHOICES:
        raise UsageError(f"--loss-kernel {name}: choose one of {', '.join(CHOICES)}")
    if name == "auto":
        name = chip_choices.for_kind(device_kind)[0].loss_kernel if platform == "tpu" else "xla"
    if name == "xla":
        return None
    if platform != "tpu":
        return Kernel(interpret=True)
    return SMALL if device_kind.startswith(SMALL_VMEM) else Kernel()


def divisor(n: int, cap: int, multiple: int) -> int | None:
    """The largest divisor of n that is a multiple of `multiple` and at most cap (None if there is none)."""
    best = None
    for d in range(multiple, min(n, cap) + 1, multiple):
        if n % d == 0:
            best = d
    return best


@dataclass(frozen=True)
class Plan:
    """The blocks used for one call: n tokens, a [v, d] table."""
    n: int
    v: int
    d: int
    bn: int
    bv: int
    gv: int
    gn: int


def plan(n: int, v: int, d: int, blocks: Blocks = Blocks()) -> Plan | None:
    """The blocks for n tokens against a [v, d] table, or None where the shapes do not tile (the XLA loss then)."""
    if d % LANES:
        return None
    bn, bv = divisor(n, blocks.tokens, SUBLANES), divisor(v, blocks.vocab, LANES)
    gv, gn = divisor(v, blocks.grad_vocab, SUBLANES), divisor(n, blocks.grad_tokens, LANES)
    if None in (bn, bv, gv, gn):
        return None
    return Plan(n, v, d, bn, bv, gv, gn)


def traffic(p: Plan, itemsize: int = 2) -> dict[str, float]:
    """HBM bytes and FLOPs of the two kernels, from their grids: Pallas fetches an input block when its index
    differs from the previous grid step's (so a block that stays put is fetched once) and writes an output block
    back when its index changes and at the end. itemsize: the hidden states' and table's (the compute dtype's)."""
    f32 = 4
    token_blocks, vocab_blocks = p.n // p.bn, p.v // p.bv
    grad_vocab_blocks, grad_token_blocks = p.v // p.gv, p.n // p.gn
    # the table once per token block, unless it is one block (then it stays put across token blocks)
    table_reads = 1 if vocab_blocks == 1 else token_blocks
    softmax = (p.n * p.d * itemsize + table_reads * p.v * p.d * itemsize
               + p.n * LANES * f32 + p.n * p.d * f32)     # out: log-sum-exp (a lane row each), softmax @ table
    # the tokens (with their log-sum-exp and target rows, a sublane tile high) once per block of table rows
    token_reads = 1 if grad_token_blocks == 1 else grad_vocab_blocks
    grad = (p.v * p.d * itemsize + token_reads * p.n * (p.d * itemsize + 2 * SUBLANES * f32)
            + p.v * p.d * f32)                            # out: the table's gradient
    mm = 2.0 * p.n * p.v * p.d
    return {"softmax_bytes": float(softmax), "grad_bytes": float(grad), "softmax_flops": 2 * mm,
            "grad_flops": 2 * mm, "transcendentals": float(p.n * p.v)}


def _softmax_kernel(x_ref, w_ref, lse_ref, sw_ref, m_sc, l_sc, acc_sc, *, vocab_size: int, v: int, bv: int,
                    d: int):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    w = w_ref[...]
    z = jax.lax.dot_general(x_ref[...], w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if vocab_size < v:  # the table's padding rows: never predicted
        col = j * bv + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        z = jnp.where(col < vocab_size, z, -1e30)
    m_prev = m_sc[...]
    m_next = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))        # [bn, LANES], every lane the same
    e = jnp.exp(z - _lanes(m_next, bv))
    alpha = jnp.exp(m_prev - m_next)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(e, axis=1, keepdims=True)
    m_sc[...] = m_next
    acc_sc[...] = _lanes(alpha, d) * acc_sc[...] + jnp.dot(e.astype(w.dtype), w, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])
        sw_ref[...] = acc_sc[...] / _lanes(l_sc[...], d)


def _table_grad_kernel(w_ref, x_ref, lse_ref, t_ref, dw_ref, *, vocab_size: int, v: int, gv: int,
                       scale: float):
    j, i = pl.program_id(0), pl.program_id(1)
    w = w_ref[...]
    zt = jax.lax.dot_general(w, x_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    row = j * gv + jax.lax.broadcasted_iota(jnp.int32, zt.shape, 0)        # [gv, gn]: the table's rows
    dz = jnp.exp(zt - lse_ref[0:1, :]) - jnp.where(row == t_ref[0:1, :], 1.0, 0.0)
    if vocab_size < v:
        dz = jnp.where(row < vocab_size, dz, 0.0)
    part = jnp.dot(dz.astype(w.dtype), x_ref[...], preferred_element_type=jnp.float32)

    @pl.when(i == 0)
    def _():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

    dw_ref[...] += part

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        dw_ref[...] *= scale


def _lanes(a: jax.Array, width: int) -> jax.Array:
    """[rows, LANES] (every lane the same) -> [rows, width]."""
    if width == LANES:
        return a
    if width % LANES == 0:
        return jnp.tile(a, (1, width // LANES))
    return jnp.broadcast_to(a[:, :1], (a.shape[0], width))


def _params(k: Kernel):
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=k.vmem_limit)


def softmax_grid(p: Plan):
    """The softmax kernel's grid and blocks: (grid, inputs [x, table], outputs [log-sum-exp, softmax @ table]),
    each block (shape, index map)."""
    return ((p.n // p.bn, p.v // p.bv),
            [((p.bn, p.d), lambda i, j: (i, 0)), ((p.bv, p.d), lambda i, j: (j, 0))],
            [((p.bn, LANES), lambda i, j: (i, 0)), ((p.bn, p.d), lambda i, j: (i, 0))])


def grad_grid(p: Plan):
    """The table's gradient kernel's grid and blocks: (grid, inputs [table, x, log-sum-exp rows, target rows],
    outputs [the table's gradient]), each block (shape, index map)."""
    return ((p.v // p.gv, p.n // p.gn),
            [((p.gv, p.d), lambda j, i: (j, 0)), ((p.gn, p.d), lambda j, i: (i, 0)),
             ((SUBLANES, p.gn), lambda j, i: (0, i)), ((SUBLANES, p.gn), lambda j, i: (0, i))],
            [((p.gv, p.d), lambda j, i: (j, 0))])


def _specs(blocks):
    return [pl.BlockSpec(shape, index) for shape, index in blocks]


def softmax_table(x: jax.Array, w: jax.Array, vocab_size: int, p: Plan, k: Kernel):
    """x [n, d], w [v, d] (the compute dtype) -> (log-sum-exp [n] f32, softmax(x @ w.T) @ w [n, d] f32)."""
    cost = traffic(p, x.dtype.itemsize)
    grid, ins, outs = softmax_grid(p)
    lse, sw = pl.pallas_call(
        partial(_softmax_kernel, vocab_size=vocab_size, v=p.v, bv=p.bv, d=p.d),
        grid=grid, in_specs=_specs(ins), out_specs=_specs(outs),
        out_shape=[jax.ShapeDtypeStruct((p.n, LANES), jnp.float32), jax.ShapeDtypeStruct((p.n, p.d), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((p.bn, LANES), jnp.float32), pltpu.VMEM((p.bn, LANES), jnp.float32),
                        pltpu.VMEM((p.bn, p.d), jnp.float32)],
        compiler_params=_params(k), interpret=k.interpret, name="xent_softmax_table",
        cost_estimate=pl.CostEstimate(flops=int(cost["softmax_flops"]), transcendentals=int(cost["transcendentals"]),
                                      bytes_accessed=int(cost["softmax_bytes"])),
    )(x, w)
    return lse[:, 0], sw


def table_grad(x: jax.Array, w: jax.Array, lse: jax.Array, targets: jax.Array, vocab_size: int, scale: float,
               p: Plan, k: Kernel) -> jax.Array:
    """d (scale * summed loss) / d table [v, d] f32: (softmax - onehot(targets)).T @ x, per block of table rows."""
    cost = traffic(p, x.dtype.itemsize)
    # The log-sum-exps and targets as rows, one block of tokens in each grid step's lanes (a sublane tile high).
    rows = lambda a: jax.lax.broadcast_in_dim(a, (SUBLANES, p.n), (1,))  # noqa: E731
    grid, ins, outs = grad_grid(p)
    return pl.pallas_call(
        partial(_table_grad_kernel, vocab_size=vocab_size, v=p.v, gv=p.gv, scale=scale),
        grid=grid, in_specs=_specs(ins), out_specs=_specs(outs)[0],
        out_shape=jax.ShapeDtypeStruct((p.v, p.d), jnp.float32),
        compiler_params=_params(k), interpret=k.interpret, name="xent_table_grad",
        cost_estimate=pl.CostEstimate(flops=int(cost["grad_flops"]), transcendentals=int(cost["transcendentals"]),
                                      bytes_accessed=int(cost["grad_bytes"])),
    )(w, x, rows(lse), rows(targets.astype(jnp.int32)))


def _local(x, w, targets, vocab_size: int, total: int, k: Kernel):
    """One device's tokens: x [b, t, d], w [v, d] (compute dtype), targets [b, t] -> (summed loss, dx [b, t, d] in
    x's dtype, d loss / d w [v, d] f32), the loss being the mean over `total` tokens of every device."""
    b, t, d = x.shape
    n, v = b * t, w.shape[0]
    p = plan(n, v, d, k.blocks)
    xf, tf = x.reshape(n, d), targets.reshape(n)
    lse, sw = softmax_table(xf, w, vocab_size, p, k)
    rows = jnp.take(w, tf, axis=0)
    picked = jnp.einsum("nd,nd->n", xf, rows, preferred_element_type=jnp.float32)
    dx = ((sw - rows.astype(jnp.float32)) / total).astype(x.dtype).reshape(b, t, d)
    dw = table_grad(xf, w, lse, tf, vocab_size, 1.0 / total, p, k)
    return jnp.sum(lse - picked), dx, dw


def fits(x_shape: tuple[int, ...], table_shape: tuple[int, ...], k: Kernel) -> bool:
    """Whether one device's share of the tokens and the table tile into the kernels' blocks."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else math.prod(dict(mesh.shape).get(a, 1) for a in _batch_axes(mesh))
    b, t, d = x_shape
    return b % shards == 0 and plan(b // shards * t, table_shape[-2], d, k.blocks) is not None


def _batch_axes(mesh) -> tuple[str, ...]:
    from trainer.common.mesh import RULES
    axes = RULES["batch"] if isinstance(RULES["batch"], tuple) else (RULES["batch"],)
    return tuple(a for a in axes if a in dict(mesh.shape))


def _loss_and_grads(x, table, targets, vocab_size: int, k: Kernel):
    """(mean loss, dx, dtable) of hidden states x [B, T, D] against a table [V, D], or per batch shard [s, V, D]
    (xent.per_shard: its gradient left per shard for the copies' transpose to sum)."""
    b, t, d = x.shape
    total = b * t
    w = table.astype(x.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        loss, dx, dw = _local(x, w if w.ndim == 2 else w[0], targets, vocab_size, total, k)
        return loss / total, dx, (dw if table.ndim == 2 else dw[None]).astype(table.dtype)
    axes = _batch_axes(mesh)
    batch = P(axes or None)
    shared = table.ndim == 3

    def local(x, w, targets):
        loss, dx, dw = _local(x, w[0] if shared else w, targets, vocab_size, total, k)
        loss = jax.lax.psum(loss, axes) if axes else loss
        if shared:
            return loss, dx, dw[None]
        return loss, dx, (jax.lax.psum(dw, axes) if axes else dw)

    loss, dx, dw = jax.shard_map(local, in_specs=(batch, batch if shared else P(), batch),
                                 out_specs=(P(), batch, batch if shared else P()), check_vma=False)(x, w, targets)
    return loss / total, dx, dw.astype(table.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def loss(x: jax.Array, table: jax.Array, targets: jax.Array, vocab_size: int, k: Kernel = Kernel()) -> jax.Array:
    """Mean cross-entropy (f32) of hidden states x [B, T, D] (the compute dtype) through the tied table [V, D] or
    xent.per_shard's [s, V, D], against int targets [B, T]; rows at and past vocab_size are never predicted. Its
    gradients come from the same kernels (computed with the loss, scaled by the cotangent after)."""
    return _loss_and_grads(x, table, targets, vocab_size, k)[0]


def _loss_fwd(x, table, targets, vocab_size, k):
    value, dx, dtable = _loss_and_grads(x, table, targets, vocab_size, k)
    return value, (dx, dtable)


def _loss_bwd(vocab_size, k, res, g):
    dx, dtable = res
    return (dx * g).astype(dx.dtype), dtable * g, None


loss.defvjp(_loss_fwd, _loss_bwd)
