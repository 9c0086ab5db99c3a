"""Causal self-attention by XLA or by the Pallas splash kernel, chosen per platform (--attention).

XLA's attention on TPU materialises every [T, T] score matrix in HBM, forward and backward; the splash
kernel (jax.experimental.pallas.ops.tpu.splash_attention) streams blocks of keys through VMEM and never
writes the scores out. `resolve` picks it for TPU devices, judged by the devices the step is compiled for
(an ahead-of-time plan from a laptop plans the TPU path). Elsewhere the same kernel can run through Pallas'
interpreter: slow, exact, for checking it on CPU.

The kernel works on one example's [heads, T, head_dim]; `splash` vmaps it over the batch inside a
shard_map that follows the mesh rules: batch over `data`, heads and kv heads over `model` (kv heads that do not
divide over it copied once for each query head; XLA's attention copies them only until they divide, kv_copies).
Masks are by position index: causal, optionally a sliding window, optionally packed segments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trainer.common.config import UsageError, check_splash
from trainer.common.mesh import fitted_spec

CHOICES = ("auto", "xla", "splash", "resident")
XLA, SPLASH, INTERPRET = "xla", "splash", "splash-interpret"  # resolved implementations
RESIDENT, RESIDENT_INTERPRET = "resident", "resident-interpret"  # trainer/kernels/resident_attention.py
LANES = 128  # the kernel's blocks are multiples of this on TPU
MAX_BLOCK = 512


def _why_not_resident(heads: tuple[int, int] | None, seq_len: int, block: int) -> str | None:
    """None when the resident kernel takes a model's attention, else why not (in words)."""
    if heads is None:
        return "this model's attention (windows, soft-capping, packed rows) is splash's or XLA's"
    from trainer.kernels import resident_attention
    return resident_attention.supports(*heads, seq_len, block)


def check(name: str, seq_len: int, heads: tuple[int, int] | None = None, block: int = 256) -> None:
    """--attention against the model, whatever the devices: a UsageError naming what is wrong and what to use.
    heads: (heads, head_dim) of a model the resident kernel can take (GPT-2's plain causal attention); None for
    one it cannot (Gemma's windows, soft-capping and packed rows)."""
    if name not in CHOICES:
        raise UsageError(f"--attention {name}: choose one of {', '.join(CHOICES)}")
    if name == "resident":
        why_not = _why_not_resident(heads, seq_len, block)
        if why_not:
            raise UsageError(f"--attention resident: {why_not} (use --attention splash or xla)")
    if name == "splash" and seq_len % LANES:
        raise UsageError(f"--attention splash: the kernel works on blocks of {LANES} positions; --seq-len "
                         f"{seq_len} is not a multiple of {LANES} (use --attention xla, or such a length)")


def resolve(name: str, platform: str, seq_len: int, device_kind: str = "",
            heads: tuple[int, int] | None = None, block: int = 256) -> str:
    """--attention for a step compiled for `platform` devices (`check`ed first): xla, splash (the TPU kernel),
    resident (ours, trainer/kernels/resident_attention.py), or either kernel through Pallas' interpreter off TPU
    (-interpret). auto: on TPU, when the sequence is a whole number of kernel blocks, what the chip measured
    faster (trainer/common/chip_choices.py), else xla."""
    from trainer.common import chip_choices
    check(name, seq_len, heads, block)
    if name == "auto":
        if platform != "tpu" or seq_len % LANES:
            return XLA
        row = chip_choices.for_kind(device_kind)[0]
        pick = row.attention
        if pick == "resident" and heads and heads[1] in row.resident_head_dims \
                and _why_not_resident(heads, seq_len, block) is None:
            return RESIDENT
        return XLA if pick == "xla" else SPLASH
    if name == "resident":
        return RESIDENT if platform == "tpu" else RESIDENT_INTERPRET
    if name == "splash":
        return SPLASH if platform == "tpu" else INTERPRET
    return XLA


@dataclass(frozen=True)
class Kernel:
    """How the splash kernel runs (not what it computes: every choice gives the same attention).

    layout: how q, k and v lie in HBM for the kernel. "head-minor" is [T, head_dim] per head: on TPU the minor
    dimension is padded to 128 lanes, so a head_dim of 64 (GPT-2's) doubles every q, k, v, and their copies into
    that layout; "seq-minor" is [head_dim, T], no padding. bwd: "split" computes dq and dk/dv in two backward
    kernels, each reading q, k, v and the output's gradient; "fused" in one. block: the largest block of
    positions the kernel takes at once (a divisor of T is used): larger blocks read k and v fewer times, and
    compute more of the masked scores of the causal diagonal. fwd: "compact" runs the forward pass through
    trainer/kernels/splash_fwd.py (its accumulators in VMEM, the log-sum-exp written as [heads, 8, T]), "splash"
    as splash's own (which writes them to HBM, the log-sum-exp 128 times over).
    """
    layout: str = "head-minor"
    bwd: str = "split"
    block: int = MAX_BLOCK
    fwd: str = "splash"
    resident_block: int = 256  # the resident kernel's block of positions (resident_attention.py)

    def check(self) -> None:
        check_splash(self.layout, self.bwd, self.block, self.fwd)


def _kernel(heads: int, t: int, window: int | None, softcap: float | None, interpret: bool,
            kernel: Kernel = Kernel()):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    if window is None or window >= t:
        mask = sa.CausalMask((t, t))
    else:  # a query sees itself and the window - 1 keys before it
        mask = sa.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    blk = math.gcd(t, kernel.block)
    layout = sa.QKVLayout.SEQ_MINOR if kernel.layout == "seq-minor" else sa.QKVLayout.HEAD_DIM_MINOR
    dq = {"use_fused_bwd_kernel": True} if kernel.bwd == "fused" else {"block_q_dq": blk, "block_kv_dq": blk}
    sizes = sa.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                          block_kv_dkv_compute=blk, q_layout=layout, k_layout=layout, v_layout=layout, **dq)
    made = sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              attn_logits_soft_cap=softcap, interpret=interpret)
    if kernel.fwd == "compact":
        from trainer.kernels import splash_fwd
        return splash_fwd.attend(made)
    return made


def kv_copies(heads: int, kv_heads: int, mesh_shape: dict[str, int] | None = None) -> int:
    """How many copies of each kv head grouped-query attention takes, so that the mesh axes that split the query
    heads (the rules' `heads`) split the kv heads too, each device holding only the kv heads its query heads read.

    Query head j reads kv head j // (heads / kv_heads), and the rules split the query heads into contiguous runs,
    one a device. When the kv heads do not divide over those devices (2 kv heads, model=4 or 8), `kv_heads` stays
    whole on every device while the scores split by query heads, and XLA reshuffles (or rematerialises) the
    query heads to match them. r copies of each kv head (r = n / gcd(kv_heads, n) over n devices) give
    lcm(kv_heads, n) kv heads, which split over the n devices in the query heads' runs: a device then holds
    kv_heads / gcd(kv_heads, n) kv heads (one, where kv_heads divides n), never more than the kv_heads it held
    whole, and fewer than a copy for each of its query heads (r = heads / kv_heads). 1 where no copies are
    needed: the query heads are whole on each device, the kv heads already split, or a single kv head (every
    device needs it, and holds it once either way). mesh_shape: default the mesh the step is traced under."""
    if mesh_shape is None:
        mesh = jax.sharding.get_abstract_mesh()
        mesh_shape = {} if mesh.empty else dict(mesh.shape)
    spec = fitted_spec(("heads",), (heads,), mesh_shape)[0]
    names = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    n = math.prod(mesh_shape.get(a, 1) for a in names)
    if kv_heads == 1 or kv_heads % n == 0:
        return 1
    return n // math.gcd(kv_heads, n)


def copies_before(impl: str, heads: int, kv_heads: int) -> int:
    """The copies of each kv head a step makes before attending by `impl` (repeated adjacent, so query head j
    still reads a copy of its own kv head), under the mesh the step is traced under: kv_copies on XLA's path (the
    CPU mesh's, decoding's); none before the splash kernel (the TPU step), which copies inside `splash` (fewer
    copies made before it held gemma4-31b at data=1,model=8 on v5litepod-8 at 17.34 GiB where its own took 15.08,
    the TPU compiler's count)."""
    return kv_copies(heads, kv_heads) if impl == XLA else 1


def splash(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None, softcap: float | None = None,
           segment_ids: jax.Array | None = None, interpret: bool = False, kernel: Kernel = Kernel()) -> jax.Array:
    """Causal attention of q [B, T, H, hd] (already scaled) over k, v [B, T, K, hd] (K divides H; query
    head h reads kv head h // (H / K)) -> [B, T, H, hd]. window: keys a query sees, itself included;
    softcap: tanh soft-capping of the scores; segment_ids [B, T]: attend only within the same id; kernel: how
    the kernel runs (Kernel)."""
    b, t, h, hd = q.shape
    kh = k.shape[2]
    mesh = jax.sharding.get_abstract_mesh()
    shape = {} if mesh.empty else dict(mesh.shape)
    if 1 < kh < h and kh % shape.get("model", 1):
        # kv heads the model axis does not split, beside query heads it does: give each query head its own
        # copy, so that every device holds the kv heads of its query heads (copies_before says why not fewer)
        k, v = (jnp.repeat(a, h // kh, axis=2) for a in (k, v))
    qt, kt, vt = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # [B, heads, T, hd]

    def local(q, k, v, seg=None):
        run = _kernel(q.shape[1], t, window, softcap, interpret, kernel)
        if seg is None:
            return jax.vmap(run)(q, k, v)
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
        return jax.vmap(lambda q, k, v, s: run(q, k, v, segment_ids=SegmentIds(s, s)))(q, k, v, seg)

    args = (qt, kt, vt) + (() if segment_ids is None else (segment_ids,))
    if mesh.empty:
        out = local(*args)
    else:
        names = ("batch", "heads", "seq", "head_dim"), ("batch", "kv_heads", "seq", "head_dim")
        qs = fitted_spec(names[0], qt.shape, shape)
        kvs = fitted_spec(names[1], kt.shape, shape) if qs[1] is not None else P(qs[0])
        specs = (qs, kvs, kvs) + (() if segment_ids is None else (P(qs[0]),))
        out = jax.shard_map(local, in_specs=specs, out_specs=qs, check_vma=False)(*args)
    return out.transpose(0, 2, 1, 3)


def resident(q: jax.Array, k: jax.Array, v: jax.Array, head_dim: int, *, block: int = 256,
             interpret: bool = False) -> jax.Array:
    """Causal attention of q [B, T, H * head_dim] (already scaled) over k, v of the same shape, in that layout, by
    the resident kernel (trainer/kernels/resident_attention.py), in a shard_map that follows the mesh rules: batch
    over `data`, heads over `model` when each device then holds whole groups of 128 lanes of heads (else every
    device takes every head)."""
    from trainer.kernels import resident_attention
    run = lambda q, k, v: resident_attention.attend(q, k, v, head_dim=head_dim, block=block,  # noqa: E731
                                                   interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(q, k, v)
    shape = dict(mesh.shape)
    spec = fitted_spec(("batch", "seq", "heads"), q.shape, shape)
    if spec[2] is not None:
        split = math.prod(shape[a] for a in (spec[2] if isinstance(spec[2], tuple) else (spec[2],)))
        heads = q.shape[2] // head_dim
        if heads % split or resident_attention.supports(heads // split, head_dim, q.shape[1], block):
            spec = P(spec[0], spec[1], None)
    return jax.shard_map(run, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
