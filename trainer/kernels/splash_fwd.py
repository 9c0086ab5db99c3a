"""The splash kernel's forward pass with its running statistics kept in VMEM and a compact log-sum-exp.

The splash forward of jax's Pallas ops (`sa.flash_attention_kernel`, run by `sa._splash_attention_forward`)
declares its running max, running sum and f32 output accumulator as outputs (each written back to HBM once per
example: for gpt2-124m's [12, 1024, 64] heads, 12.6 MB a layer per 8 examples, never read), and writes the
log-sum-exp the backward pass needs as [heads, T, 128] f32, each value repeated over the 128 lanes, then keeps
lane 0 with a copy that reads the whole array: 50 MB written and 50 MB read a layer for 0.4 MB of data.

`attend` runs the same kernel body in a pallas_call of its own: the three accumulators are scratch (VMEM
only), and at the last block of keys the log-sum-exp block [bq, 128] is transposed and its first 8 rows written
as [heads, 8, T] (8 sublanes: the smallest TPU tile, the layout the backward kernels read it in). The backward
pass is splash's own (`sa._splash_attention_bwd`), given lse[:, 0]: the same numbers as splash's, in fewer
bytes. Segment ids, soft-capping and local masks go through unchanged; MQA and attention sinks are not used by
our models and are refused.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sa

LANES, SUBLANES = sa.NUM_LANES, sa.NUM_SUBLANES


def _kernel(*refs, grid_width: int, segmented: bool, masked: bool, sequenced: bool, **body):
    """Our pallas_call's refs -> splash's kernel body's, in its order; then the compact log-sum-exp."""
    data_next, block_mask, mask_next, q, k, v, *rest = refs
    qseg, kvseg = (rest.pop(0), rest.pop(0)) if segmented else (None, None)
    mask = rest.pop(0) if masked else None
    q_sequence = rest.pop(0) if sequenced else None
    o, lse, m_scratch, l_scratch, o_scratch, lse_scratch = rest
    sa.flash_attention_kernel(data_next, block_mask, mask_next, q, k, v, qseg, kvseg, None, mask, q_sequence,
                              m_scratch, l_scratch, o_scratch, o, lse_scratch, grid_width=grid_width, **body)

    @pl.when(pl.program_id(2) == grid_width - 1)
    def _():
        lse[...] = lse_scratch[...].T[:SUBLANES]  # [bq, lanes] of one value per row -> [8, bq]


def _forward(info, q, k, v, segment_ids, *, block_sizes, mask_value, softcap, mask_function, interpret):
    """(out [H, T, hd], lse [H, T]) as sa._splash_attention_forward(save_residuals=True) gives them."""
    heads, t, hd = q.shape
    hd_v, kv_heads = v.shape[-1], k.shape[0]
    per_kv = heads // kv_heads
    bq, bkv, bkv_compute = block_sizes.block_q, block_sizes.block_kv, block_sizes.block_kv_compute
    lq, lk, lv = block_sizes.q_layout, block_sizes.k_layout, block_sizes.v_layout

    def nxt(h, i, j, data_next, block_mask, mask_next=None):
        return sa._next_nonzero(h, i, j, data_next, block_mask, mask_next)

    def kv_map(layout):
        return lambda h, i, j, *pre: sa.from_head_minor((sa._div(h, per_kv), nxt(h, i, j, *pre)[0], 0), layout)

    specs = [pl.BlockSpec(sa.from_head_minor((None, bq, hd), lq), lambda h, i, j, *_: sa.from_head_minor((h, i, 0), lq)),
             pl.BlockSpec(sa.from_head_minor((None, bkv, hd), lk), kv_map(lk)),
             pl.BlockSpec(sa.from_head_minor((None, bkv, hd_v), lv), kv_map(lv))]
    args = [q if lq == sa.QKVLayout.HEAD_DIM_MINOR else q.swapaxes(-1, -2),
            k if lk == sa.QKVLayout.HEAD_DIM_MINOR else k.swapaxes(-1, -2),
            v if lv == sa.QKVLayout.HEAD_DIM_MINOR else v.swapaxes(-1, -2)]
    if segment_ids is not None:
        specs += [pl.BlockSpec((bq, LANES), lambda h, i, j, *_: (i, 0)),
                  pl.BlockSpec((SUBLANES, bkv), lambda h, i, j, *pre: (0, nxt(h, i, j, *pre)[0]))]
        args += [jax.lax.broadcast_in_dim(segment_ids.q, (t, LANES), (0,)),
                 jax.lax.broadcast_in_dim(segment_ids.kv, (SUBLANES, k.shape[1]), (1,))]
    if info.partial_mask_blocks is not None:
        specs.append(pl.BlockSpec((None, bq, bkv), lambda h, i, j, *pre: (nxt(h, i, j, *pre)[1], 0, 0)))
        args.append(info.partial_mask_blocks)
    if info.q_sequence is not None:
        specs.append(pl.BlockSpec((bq, LANES), lambda h, i, j, *_: (i, 0)))
        args.append(jax.lax.broadcast_in_dim(info.q_sequence, (t, LANES), (0,)))
    grid_width = info.data_next.shape[-1] if info.data_next is not None else k.shape[1] // bkv
    kernel = partial(_kernel, grid_width=grid_width, segmented=segment_ids is not None,
                     masked=info.partial_mask_blocks is not None, sequenced=info.q_sequence is not None,
                     mask_value=mask_value, bq=bq, bkv=bkv, bkv_compute=bkv_compute, head_dim_v=hd_v,
                     q_layout=lq, k_layout=lk, v_layout=lv, attn_logits_soft_cap=softcap, mask_function=mask_function)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, in_specs=specs, grid=(heads, t // bq, grid_width),
            out_specs=[pl.BlockSpec((None, bq, hd_v), lambda h, i, j, *_: (h, i, 0)),
                       pl.BlockSpec((None, SUBLANES, bq), lambda h, i, j, *_: (h, 0, i))],
            scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, hd_v), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=[jax.ShapeDtypeStruct((heads, t, hd_v), q.dtype),
                   jax.ShapeDtypeStruct((heads, SUBLANES, t), jnp.float32)],
        name="splash_mha_fwd_compact_lse", interpret=interpret,
    )(info.data_next, info.block_mask, info.mask_next, *args)
    return out, lse[:, 0]


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attend(fwd_info, dq_info, dkv_info, q, k, v, static, segment_ids=None):
    return _forward(fwd_info, q, k, v, segment_ids, **static.forward)[0]


def _attend_fwd(fwd_info, dq_info, dkv_info, q, k, v, static, segment_ids=None):
    out, lse = _forward(fwd_info, q, k, v, segment_ids, **static.forward)
    return out, (q, k, v, segment_ids, None, out, lse, dq_info, dkv_info)


def _attend_bwd(static, res, do):
    grads = sa._splash_attention_bwd(False, static.forward["mask_value"], False, static.forward["block_sizes"], None,
                                     static.forward["mask_function"], static.forward["softcap"],
                                     static.forward["interpret"], res, do)
    _, dq_info, dkv_info, dq, dk, dv, _, _ = grads
    return None, None, None, dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


class _Static:
    """The kernel's settings, hashable by identity (a nondiff argument of the custom VJP)."""

    def __init__(self, **forward):
        self.forward = forward


def attend(kernel: sa.SplashAttentionKernel):
    """A callable (q, k, v, segment_ids=None) -> out, computing what `kernel` (sa.make_splash_mha's, MHA, no
    sinks) computes, with the compact forward above."""
    kw = kernel.kwargs
    if kw["is_mqa"]:
        raise ValueError("splash_fwd: MQA kernels are not supported (our models pass every kv head)")
    static = _Static(block_sizes=kw["block_sizes"], mask_value=kw["mask_value"], softcap=kw["attn_logits_soft_cap"],
                     mask_function=kw["mask_function"], interpret=kw["interpret"])
    infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
    collapse = lambda i: i if i is None or i.partial_mask_blocks is None else i._replace(  # noqa: E731
        partial_mask_blocks=i.partial_mask_blocks.reshape(-1, *i.partial_mask_blocks.shape[-2:]))
    infos = tuple(collapse(i) for i in infos)

    def run(q, k, v, segment_ids=None):
        return _attend(*infos, q, k, v, static, segment_ids)
    return run
