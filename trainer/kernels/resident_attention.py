"""Causal attention with one example's whole sequence, for 128 lanes of heads, resident in VMEM.

Splash (attention.splash) takes [heads, T, head_dim] and a grid step per (head, block of queries, block of keys).
At GPT-2's shapes (head_dim 64, T 1024) that costs three ways: q, k and v are transposed into that layout and
back (their 64-wide rows padded to the TPU's 128 lanes), every grid step pays a fixed overhead, so only large
blocks are fast, and a large block computes the masked half of the causal diagonal (at blocks of 1024, twice
the causal work).

Here q, k and v stay [B, T, H * head_dim] as the qkv projection writes them (gpt2.Attention computes them so for
this kernel), and one grid step takes one
example's whole sequence of 128 lanes: two heads of 64 (or one of 128), T x 128 values each, 256 KB in bf16 at
T 1024. Inside the step, the blocks of the causal triangle are walked in unrolled loops: query block i reads key
blocks j <= i only, and only the diagonal block is masked, so blocks of 256 compute 1.25x the causal work, with
a grid step per (example, pair of heads). Each head's matmuls take all 128 lanes with the other head's lanes
zeroed (`_lanes`): the MXU is 128 deep and wide, so a 64-wide operand costs a full pass either way, and a select
costs less than moving lanes. The output is written as [B, T, H * head_dim], the layout the output projection
reads.

The backward pass is one kernel per (example, pair of heads), in splash's transposed orientation (scores as
[keys, queries], so the log-sum-exp and the output's row sums are rows [1, block]): for each key block j and
query block i >= j, p = exp(s - lse) is recomputed and dv_j, dk_j and dq_i are added to in VMEM; dq's whole
sequence stays in a VMEM accumulator, so nothing partial goes to HBM. The log-sum-exp is written by the forward
pass as [heads, 8, T] f32 (8 sublanes: the smallest tile).

q comes already scaled (as splash's). Masks: causal only (GPT-2); no segments, windows or soft-capping.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES, SUBLANES = 128, 8
NT = (((1,), (1,)), ((), ()))  # a @ b.T
MAX_BLOCKS = 8  # query blocks per sequence: the loops are unrolled, (n + 1) * n / 2 block pairs per head
# The unrolled loops' intermediates grow with T x block: the TPU compiler (libtpu 0.0.42.1, v5e) fits 1024 x 512
# and 2048 x 256 in its default 16 MiB of scoped VMEM, and refuses 2048 x 512 (76 MB).
MAX_SEQ_X_BLOCK = 1024 * 512


def supports(heads: int, head_dim: int, seq_len: int, block: int) -> str | None:
    """None when the kernel takes this attention, else why not (in words)."""
    if LANES % head_dim or head_dim < 8:
        return f"head_dim {head_dim} does not divide the TPU's {LANES} lanes"
    if heads % (LANES // head_dim):
        return f"{heads} heads of {head_dim} do not fill whole groups of {LANES} lanes"
    blk = block_of(seq_len, block)
    if blk % LANES or seq_len // blk > MAX_BLOCKS:
        return (f"seq_len {seq_len} is not at most {MAX_BLOCKS} blocks of a multiple of {LANES} positions "
                f"(block {block})")
    if seq_len * blk > MAX_SEQ_X_BLOCK:
        return (f"seq_len {seq_len} in blocks of {blk} needs more VMEM than the compiler's default limit "
                f"(at most {MAX_SEQ_X_BLOCK // seq_len} positions a block at this length)")
    return None


def block_of(seq_len: int, block: int) -> int:
    """The block used: block when it divides seq_len, else seq_len itself when it is at most block."""
    return block if seq_len % block == 0 else seq_len


def _lanes(x: jax.Array, head: int, head_dim: int) -> jax.Array:
    """x [rows, 128] with every lane outside head `head`'s head_dim lanes zeroed."""
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where((lane >= head * head_dim) & (lane < (head + 1) * head_dim), x, jnp.zeros_like(x))


def _causal(s: jax.Array, queries_in_rows: bool) -> jax.Array:
    """A diagonal block's scores with every key after its query at -inf."""
    r, c = (lax.broadcasted_iota(jnp.int32, s.shape, d) for d in (0, 1))
    return jnp.where(r >= c if queries_in_rows else c >= r, s, -jnp.inf)


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, head_dim: int, blk: int, n: int):
    for i in range(n):
        rows = slice(i * blk, (i + 1) * blk)
        q = q_ref[rows, :]
        out = jnp.zeros((blk, LANES), jnp.float32)
        for h in range(LANES // head_dim):
            qh = _lanes(q, h, head_dim)
            m = jnp.full((blk, 1), -jnp.inf, jnp.float32)
            l = jnp.zeros((blk, 1), jnp.float32)
            acc = jnp.zeros((blk, LANES), jnp.float32)
            for j in range(i + 1):
                cols = slice(j * blk, (j + 1) * blk)
                s = lax.dot_general(qh, k_ref[cols, :], NT, preferred_element_type=jnp.float32)
                if j == i:
                    s = _causal(s, queries_in_rows=True)
                m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
                p = jnp.exp(s - m_new)
                corr = jnp.exp(m - m_new)
                l = corr * l + jnp.sum(p, axis=1, keepdims=True)
                v = _lanes(v_ref[cols, :], h, head_dim)
                acc = corr * acc + lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
                m = m_new
            out = out + acc * (1.0 / l)  # acc is zero outside head h's lanes
            lse = jnp.broadcast_to(m + jnp.log(l), (blk, LANES))
            lse_ref[h, :, rows] = lse.T[:SUBLANES]
        o_ref[rows, :] = out.astype(o_ref.dtype)


def _bwd_kernel(q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dq_ref, dk_ref, dv_ref, dq_acc, delta_ref, *,
                head_dim: int, blk: int, n: int):
    g = LANES // head_dim
    for i in range(n):  # each head's row sums of do * o: [1, block] rows, as the log-sum-exp
        rows = slice(i * blk, (i + 1) * blk)
        prod = do_ref[rows, :].astype(jnp.float32) * o_ref[rows, :].astype(jnp.float32)
        for h in range(g):
            d = jnp.sum(_lanes(prod, h, head_dim), axis=1, keepdims=True)
            delta_ref[h, :, rows] = jnp.broadcast_to(d, (blk, LANES)).T[:SUBLANES]
    dq_acc[...] = jnp.zeros_like(dq_acc)
    for j in range(n):
        cols = slice(j * blk, (j + 1) * blk)
        k, v = k_ref[cols, :], v_ref[cols, :]
        dk = jnp.zeros((blk, LANES), jnp.float32)
        dv = jnp.zeros((blk, LANES), jnp.float32)
        for h in range(g):
            kh = _lanes(k, h, head_dim)
            for i in range(j, n):
                rows = slice(i * blk, (i + 1) * blk)
                qh = _lanes(q_ref[rows, :], h, head_dim)
                doh = _lanes(do_ref[rows, :], h, head_dim)
                st = lax.dot_general(k, qh, NT, preferred_element_type=jnp.float32)  # [keys, queries]
                if i == j:
                    st = _causal(st, queries_in_rows=False)
                pt = jnp.exp(st - lse_ref[h, :1, rows])
                dv = dv + lax.dot(pt.astype(doh.dtype), doh, preferred_element_type=jnp.float32)
                dpt = lax.dot_general(v, doh, NT, preferred_element_type=jnp.float32)
                dst = pt * (dpt - delta_ref[h, :1, rows])
                dk = dk + lax.dot(dst.astype(qh.dtype), qh, preferred_element_type=jnp.float32)
                dq_acc[rows, :] += lax.dot(dst.T.astype(kh.dtype), kh, preferred_element_type=jnp.float32)
        dk_ref[cols, :] = dk.astype(dk_ref.dtype)
        dv_ref[cols, :] = dv.astype(dv_ref.dtype)
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def _specs(t: int, head_dim: int):
    seq = pl.BlockSpec((None, t, LANES), lambda b, g: (b, 0, g))
    lse = pl.BlockSpec((None, None, LANES // head_dim, SUBLANES, t), lambda b, g: (b, g, 0, 0, 0))
    return seq, lse


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


def _forward(q, k, v, head_dim: int, blk: int, interpret: bool):
    b, t, width = q.shape
    groups, g = width // LANES, LANES // head_dim
    seq, lse = _specs(t, head_dim)
    return pl.pallas_call(
        partial(_fwd_kernel, head_dim=head_dim, blk=blk, n=t // blk),
        grid=(b, groups), in_specs=[seq, seq, seq], out_specs=[seq, lse],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, groups, g, SUBLANES, t), jnp.float32)],
        compiler_params=_params(), name="resident_attention_fwd", interpret=interpret,
    )(q, k, v)


def _backward(q, k, v, o, do, lse_rows, head_dim: int, blk: int, interpret: bool):
    b, t, width = q.shape
    groups, g = width // LANES, LANES // head_dim
    seq, lse = _specs(t, head_dim)
    return pl.pallas_call(
        partial(_bwd_kernel, head_dim=head_dim, blk=blk, n=t // blk),
        grid=(b, groups), in_specs=[seq, seq, seq, seq, seq, lse], out_specs=[seq, seq, seq],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)],
        scratch_shapes=[pltpu.VMEM((t, LANES), jnp.float32), pltpu.VMEM((g, SUBLANES, t), jnp.float32)],
        compiler_params=_params(), name="resident_attention_bwd", interpret=interpret,
    )(q, k, v, o, do, lse_rows)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attend(q, k, v, head_dim: int, blk: int, interpret: bool):
    return _forward(q, k, v, head_dim, blk, interpret)[0]


def _attend_fwd(q, k, v, head_dim, blk, interpret):
    o, lse = _forward(q, k, v, head_dim, blk, interpret)
    return o, (q, k, v, o, lse)


def _attend_bwd(head_dim, blk, interpret, res, do):
    q, k, v, o, lse = res
    return _backward(q, k, v, o, do.astype(o.dtype), lse, head_dim, blk, interpret)


_attend.defvjp(_attend_fwd, _attend_bwd)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, head_dim: int | None = None, block: int = 256,
           interpret: bool = False) -> jax.Array:
    """Causal attention of q (already scaled) over k, v on one device's arrays (attention.resident places it on a
    mesh): [B, T, H, hd] -> [B, T, H, hd], or in the qkv projection's own layout [B, T, H * head_dim] ->
    [B, T, H * head_dim] (no relayout on either side: the TPU tiles [.., H, 64] and [.., H * 64] differently).
    `supports` says which shapes it takes."""
    if q.ndim == 4:
        b, t, h, hd = q.shape
        flat = [a.reshape(b, t, h * hd) for a in (q, k, v)]
        return attend(*flat, head_dim=hd, block=block, interpret=interpret).reshape(b, t, h, hd)
    b, t, width = q.shape
    if head_dim is None or width % head_dim:
        raise ValueError(f"resident attention: [B, T, {width}] needs the head_dim its {width} lanes are made of")
    why = supports(width // head_dim, head_dim, t, block)
    if why:
        raise ValueError(f"resident attention: {why}")
    return _attend(q, k, v, head_dim, block_of(t, block), interpret)
