"""Gemma 2, 3 and 4 (text) in Flax NNX, sharded by the same logical-axis rules as GPT-2 (trainer/common/mesh.py).

What differs between generations is one row of FAMILIES; the sizes (layers, widths, heads, kv heads,
vocab) come from a checkpoint's array shapes (GemmaConfig.from_shapes) or from the named-size table
SIZES, which also lets a caller build the model from abstract shapes without any weights.

Parameter layout = Kaggle's flax layout (so a checkpoint restores without reshuffling):
embed [V, D], q [H, D, hd], kv [2, K, D, hd], o [H, hd, D], gating [2, F, D] (gate, up), linear [F, D],
RMSNorm scales [D] (and [hd] for the QK-norm of Gemma 3 and 4), applied as x * (1 + scale) (Gemma 2, 3) or
x * scale (Gemma 4).
The D dimension of every matrix is sharded over `data` (fsdp) and heads / mlp / vocab over `model` (Gemma 4's
per-layer table: its P columns over every device, its rows whole);
a dimension that a mesh axis does not divide (one kv head on model=2) stays whole, and the D dimension takes
that axis too (mesh.fitted_spec).

Gemma 4 adds, each a field of GemmaConfig that is off for the older families:
- global layers with their own head width and kv heads (global_head_dim, global_kv_heads), rotating only a
  quarter of each head (Family.global_rope_fraction), and on the larger sizes one projection for k and v
  (k_eq_v_global: kv is [1, K, D, hd] there); values RMS-normalised without a scale; no query scaling
  (query_pre_attn_scalar 1);
- the E sizes' kv sharing (the last kv_shared_layers layers attend over the keys and values of the last
  earlier layer of their kind; their own kv parameters are kept as the checkpoint holds them, unused) with a
  wider MLP there (shared_ff), and per-layer embeddings (per_layer_dim P: a [V, L, P] table plus a projection
  of the embedded token, one [P] input per layer, gated into the residual after the MLP);
- 26B-A4B's routed experts beside the dense MLP (trainer/models/moe.py), each branch with its own norms;
- a learned scalar per layer on its output (skip_scale).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.common.config import UsageError
from trainer.common.mesh import RULES, fitted_spec
from trainer.models import attention as attention_lib
from trainer.models import moe as moe_lib
from trainer.models import remat as remat_lib
from trainer.models import xent
from trainer.models.gpt2 import loss_fn

# The residual stream between the layers [B, T, D]: its positions split over `model` (the rules' residual_seq), so
# a device holds 1/model of its rows' residuals, not all of them, and more `model` never grows it (sequence
# parallelism: the projections gather it, the output projections reduce-scatter back).
RESIDUAL = ("batch", "residual_seq", "embed")
# Attention's scores [B, T, kv heads, query heads per kv head, S] (fitted_spec gives `model` to the first that
# it divides: the kv heads, with copies where they would not divide (attention.kv_copies), or a single kv head's
# query heads; the positions stay whole).
SCORES = ("batch", "seq", "kv_heads", "heads", None)
K_MASK = -2.3819763e38  # what Google's implementation writes into masked attention logits
LOCAL, GLOBAL = "local", "global"


@dataclasses.dataclass(frozen=True)
class Family:
    """Constants of one Gemma generation: everything that is not an array shape."""
    name: str
    pattern: tuple[str, ...]        # attention type per layer, repeated over the depth
    sliding_window: int             # keys a local layer sees, itself included
    local_rope_base: int
    global_rope_base: int
    attn_softcap: float | None      # tanh soft-capping of attention logits
    final_softcap: float | None     # ... and of the output logits
    qk_norm: bool                   # RMSNorm on q and k per head (Gemma 3, 4)
    norm_plus_one: bool = True      # RMSNorm scales applied as 1 + scale (Gemma 2, 3) or as they are (Gemma 4)
    v_norm: bool = False            # values RMS-normalised per head, without a scale (Gemma 4)
    global_rope_fraction: float = 1.0  # share of a global head's dims that RoPE rotates (the rest keep position 0)


FAMILIES: dict[str, Family] = {
    "gemma2": Family("gemma2", (LOCAL, GLOBAL), 4096, 10_000, 10_000, 50.0, 30.0, False),
    "gemma3": Family("gemma3", (LOCAL,) * 5 + (GLOBAL,), 512, 10_000, 1_000_000, None, None, True),
    "gemma4": Family("gemma4", (LOCAL,) * 5 + (GLOBAL,), 1024, 10_000, 1_000_000, None, 30.0, True,
                     norm_plus_one=False, v_norm=True, global_rope_fraction=0.25),
}


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    family: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ff: int
    sliding_window: int
    query_pre_attn_scalar: float    # q is scaled by its inverse square root
    global_rope_scale: float = 1.0  # linear RoPE position scaling of global layers (Gemma 3 4b and up)
    # Gemma 4 (module docstring); the defaults are the older families'.
    pattern: tuple[str, ...] = ()   # attention types repeated over the depth (empty: the family's)
    global_head_dim: int = 0        # head width of global layers (0: head_dim)
    global_kv_heads: int = 0        # kv heads of global layers (0: n_kv_heads)
    k_eq_v_global: bool = False     # global layers project k once and use it as v too
    kv_shared_layers: int = 0       # the last N layers reuse an earlier layer's keys and values
    shared_ff: int = 0              # MLP width of those layers (0: ff)
    per_layer_dim: int = 0          # per-layer embedding width P (0: none)
    n_experts: int = 0              # routed experts beside the dense MLP (0: none)
    top_k: int = 0                  # experts per token
    expert_ff: int = 0              # each expert's MLP width
    # Not the checkpoint's: how a run bounds each device's rows under expert parallelism, as a multiple of the
    # even share (trainer/models/moe.py; 0: dropless). Sampling keeps 0; a LoRA run sets --expert-capacity.
    expert_capacity: float = 0.0

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def layer_types(self) -> tuple[str, ...]:
        p = self.pattern or self.fam.pattern
        return tuple(p[i % len(p)] for i in range(self.n_layers))

    def attn_dims(self, i: int) -> tuple[int, int, int]:
        """(kv heads, head width, 1 if k is v else 2) of layer i."""
        if self.layer_types[i] == GLOBAL:
            return (self.global_kv_heads or self.n_kv_heads, self.global_head_dim or self.head_dim,
                    1 if self.k_eq_v_global else 2)
        return self.n_kv_heads, self.head_dim, 2

    def ff_of(self, i: int) -> int:
        return self.shared_ff or self.ff if self.kv_source(i) != i else self.ff

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends over: itself, or for the last kv_shared_layers
        layers the last earlier layer of the same attention type."""
        first = self.n_layers - self.kv_shared_layers
        if i < first:
            return i
        kind = self.layer_types[i]
        sources = [j for j in range(first) if self.layer_types[j] == kind]
        if not sources:
            raise UsageError(f"kv_shared_layers {self.kv_shared_layers} of {self.n_layers}: layer {i} ({kind}) has no "
                             f"earlier {kind} layer to share keys and values with")
        return sources[-1]

    @property
    def kv_origins(self) -> frozenset[int]:
        return frozenset(self.kv_source(i) for i in range(self.n_layers) if self.kv_source(i) != i)

    @classmethod
    def from_shapes(cls, family: str, shapes: dict[str, tuple[int, ...]], **overrides) -> "GemmaConfig":
        """Sizes from our-layout parameter shapes ({'embed': (V, D), 'layers.0.q': (H, D, hd), ...}; for Gemma 4
        every layer's q, kv and linear, and ple_embed / layers.0.experts_gating where present).

        The constants shapes cannot tell (window, query scalar, RoPE scale; Gemma 4's kv sharing and experts
        per token) come from the named size with the same shapes if there is one, else the family's defaults;
        `overrides` win over both."""
        v, d = shapes["embed"]
        h, _, hd = shapes["layers.0.q"]
        k = shapes["layers.0.kv"][1]
        f = shapes["layers.0.linear"][0]
        n = sum(1 for name in shapes if name.startswith("layers.") and name.endswith(".q"))
        dims: dict[str, Any] = dict(vocab=v, d_model=d, n_layers=n, n_heads=h, n_kv_heads=k, head_dim=hd, ff=f)
        if family == "gemma4":
            dims.update(_gemma4_dims(shapes, n))
        named = next((c for c in SIZES.values() if c.family == family and all(
            getattr(c, key) == val for key, val in dims.items() if key != "vocab")), None)
        rest = [fl.name for fl in dataclasses.fields(cls) if fl.name not in dims and fl.name != "family"]
        if named:
            base = {key: getattr(named, key) for key in rest}
        else:
            base = dict(sliding_window=FAMILIES[family].sliding_window,
                        query_pre_attn_scalar=1.0 if family == "gemma4" else float(hd))
            if dims.get("n_experts"):
                base["top_k"] = 8
        return cls(family=family, **{**base, **dims, **overrides})


def _gemma4_dims(shapes: dict[str, tuple[int, ...]], n: int) -> dict[str, Any]:
    """What Gemma 4's shapes tell beyond the common sizes: where the global layers are (their heads are
    wider), their kv heads and k=v projection, the kv-shared layers' wider MLP, per-layer embeddings, experts."""
    out: dict[str, Any] = {}
    widths = [shapes[f"layers.{i}.q"][2] for i in range(n)]
    g = next((i for i, w in enumerate(widths) if w != widths[0]), None)
    if g is not None:
        c, kg, _, hdg = shapes[f"layers.{g}.kv"]
        pattern = (LOCAL,) * g + (GLOBAL,)
        out.update(global_head_dim=hdg, k_eq_v_global=c == 1)
        if pattern != FAMILIES["gemma4"].pattern:  # written the way SIZES writes it, so a named size matches
            out["pattern"] = pattern
        if kg != shapes["layers.0.kv"][1]:
            out["global_kv_heads"] = kg
    ffs = [shapes[f"layers.{i}.linear"][0] for i in range(n) if f"layers.{i}.linear" in shapes]
    if len(ffs) == n and ffs[-1] != ffs[0]:
        out.update(shared_ff=ffs[-1], kv_shared_layers=sum(1 for x in ffs if x == ffs[-1]))
    if "ple_embed" in shapes:
        out["per_layer_dim"] = shapes["ple_embed"][2]
    if "layers.0.experts_gating" in shapes:
        e, _, fe, _ = shapes["layers.0.experts_gating"]
        out.update(n_experts=e, expert_ff=fe)
    return out


def _size(family, vocab, d, layers, heads, kv, hd, ff, window, scalar=None, rope_scale=1.0) -> GemmaConfig:
    return GemmaConfig(family, vocab, d, layers, heads, kv, hd, ff, window,
                       float(scalar or hd), rope_scale)


# Google's published sizes (the flax checkpoints' shapes; Hugging Face copies drop the vocab padding).
SIZES: dict[str, GemmaConfig] = {
    "gemma2-2b": _size("gemma2", 256128, 2304, 26, 8, 4, 256, 9216, 4096),
    "gemma2-9b": _size("gemma2", 256128, 3584, 42, 16, 8, 256, 14336, 4096),
    "gemma2-27b": _size("gemma2", 256128, 4608, 46, 32, 16, 128, 36864, 4096, scalar=4608 // 32),
    "gemma3-270m": _size("gemma3", 262144, 640, 18, 4, 1, 256, 2048, 512),
    "gemma3-1b": _size("gemma3", 262144, 1152, 26, 4, 1, 256, 6912, 512),
    "gemma3-4b": _size("gemma3", 262144, 2560, 34, 8, 4, 256, 10240, 1024, rope_scale=8.0),
    "gemma3-12b": _size("gemma3", 262144, 3840, 48, 16, 8, 256, 15360, 1024, rope_scale=8.0),
    "gemma3-27b": _size("gemma3", 262144, 5376, 62, 32, 16, 128, 21504, 1024, scalar=5376 // 32,
                        rope_scale=8.0),
    # Gemma 4: global layers' heads are 512 wide; no query scaling (the QK-norm sets the scale).
    "gemma4-e2b": dataclasses.replace(
        _size("gemma4", 262144, 1536, 35, 8, 1, 256, 6144, 512, scalar=1), pattern=(LOCAL,) * 4 + (GLOBAL,),
        global_head_dim=512, kv_shared_layers=20, shared_ff=12288, per_layer_dim=256),
    "gemma4-e4b": dataclasses.replace(
        _size("gemma4", 262144, 2560, 42, 8, 2, 256, 10240, 512, scalar=1),
        global_head_dim=512, kv_shared_layers=18, per_layer_dim=256),
    "gemma4-31b": dataclasses.replace(
        _size("gemma4", 262144, 5376, 60, 32, 16, 256, 21504, 1024, scalar=1),
        global_head_dim=512, global_kv_heads=4, k_eq_v_global=True),
    "gemma4-26b-a4b": dataclasses.replace(
        _size("gemma4", 262144, 2816, 30, 16, 8, 256, 2112, 1024, scalar=1),
        global_head_dim=512, global_kv_heads=2, k_eq_v_global=True, n_experts=128, top_k=8, expert_ff=704),
}


_BLOCK_NORMS = ("pre_attn_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm")
_MOE_NORMS = ("post_mlp_norm", "pre_moe_norm", "post_moe_norm")  # the dense branch's own, the experts' two


def param_layout(cfg: GemmaConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Flat name -> (shape, logical axes) of every parameter."""
    v, d, h = cfg.vocab, cfg.d_model, cfg.n_heads
    out = {"embed": ((v, d), ("vocab", "fsdp")), "final_norm": ((d,), (None,))}
    if cfg.per_layer_dim:
        pd, n = cfg.per_layer_dim, cfg.n_layers
        # the per-layer table by its P columns over every device (fitted_spec gives fsdp `model` too), its rows
        # whole: its lookup is then the same program on every mesh. With its rows over `model`, the TPU compiler
        # copied a device's share into a row-major layout for the gather, P padded to 128 lanes: on E4B at
        # data=4,model=2 (P 64 a device) a 1.5 GiB copy of a 672 MiB shard (libtpu 0.0.42.1)
        out.update({"ple_embed": ((v, n, pd), (None, None, "fsdp")),
                    "ple_in": ((d, n, pd), ("fsdp", None, None)), "ple_in_norm": ((pd,), (None,))})
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        k, hd, c = cfg.attn_dims(i)
        f = cfg.ff_of(i)
        out.update({
            p + "q": ((h, d, hd), ("heads", "fsdp", "head_dim")),
            p + "kv": ((c, k, d, hd), (None, "kv_heads", "fsdp", "head_dim")),
            p + "o": ((h, hd, d), ("heads", "head_dim", "fsdp")),
            p + "gating": ((2, f, d), (None, "mlp", "fsdp")),
            p + "linear": ((f, d), ("mlp", "fsdp")),
        })
        for norm in _BLOCK_NORMS + (_MOE_NORMS if cfg.n_experts else ()):
            out[p + norm] = ((d,), (None,))
        if cfg.fam.qk_norm:
            out[p + "q_norm"] = ((hd,), (None,))
            out[p + "k_norm"] = ((hd,), (None,))
        if cfg.n_experts:
            e, fe = cfg.n_experts, cfg.expert_ff
            out.update({
                p + "router": ((d, e), ("fsdp", None)), p + "router_scale": ((d,), (None,)),
                p + "expert_scale": ((e,), (None,)),
                p + "experts_gating": ((e, 2, fe, d), ("expert", None, "mlp", "fsdp")),
                p + "experts_linear": ((e, fe, d), ("expert", "mlp", "fsdp")),
            })
        if cfg.per_layer_dim:
            pd = cfg.per_layer_dim
            out.update({p + "ple_gate": ((d, pd), ("fsdp", None)), p + "ple_proj": ((pd, d), (None, "fsdp")),
                        p + "ple_norm": ((d,), (None,))})
        if cfg.family == "gemma4":
            out[p + "skip_scale"] = ((1,), (None,))
    return out


def _is_scale(cfg: GemmaConfig, name: str) -> bool:
    """A multiplier applied as it is (Gemma 4's norm scales, skip_scale, the router's and experts' scales),
    whose neutral value is 1 rather than 0."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.endswith("_scale") or (leaf.endswith("norm") and not cfg.fam.norm_plus_one)


def _routed(name: str) -> bool:
    """A routed expert's stacked weights (the experts' MLP), not the dense layers'."""
    return name.rsplit(".", 1)[-1].startswith("experts_")


def count_params(cfg: GemmaConfig) -> int:
    return sum(math.prod(shape) for shape, _ in param_layout(cfg).values())


def matmul_params(cfg: GemmaConfig) -> float:
    """Weights a token is multiplied by on its way through (the tied embedding once, as the output layer): not
    the per-layer embedding table (a lookup), nor the kv of layers that attend over another's (unused), and of
    the experts top_k in n_experts."""
    total = 0.0
    for name, (shape, _) in param_layout(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if len(shape) < 2 or name == "ple_embed" or (leaf == "kv" and cfg.kv_source(int(name.split(".")[1])) !=
                                                     int(name.split(".")[1])):
            continue
        share = cfg.top_k / cfg.n_experts if _routed(name) else 1.0
        total += share * math.prod(shape)
    return total


def expert_matmul_params(cfg: GemmaConfig) -> float:
    """Of matmul_params, the routed experts' (top_k of them a token): what the grouped matmuls (jax.lax.ragged_dot)
    multiply a token by, priced at their own rate in a plan (trainer/common/calibration.py)."""
    return sum(cfg.top_k / cfg.n_experts * math.prod(shape) for name, (shape, _) in param_layout(cfg).items()
               if _routed(name)) if cfg.n_experts else 0.0


def gathered_share(cfg: GemmaConfig, experts_split: bool) -> float:
    """Of count_params, the share a step gathers whole over `data` for its matmuls: the layers' weights, not the
    embedding tables (the tied one held by its vocab rows, the per-layer one read by a lookup), nor the experts
    where expert parallelism keeps each on its own devices (experts_split)."""
    gathered = sum(math.prod(shape) for name, (shape, _) in param_layout(cfg).items()
                   if name.startswith("layers.") and not (experts_split and _routed(name)))
    return gathered / count_params(cfg)


def attention_width(cfg: GemmaConfig) -> int:
    """Sum over layers of heads x head width: what attention's scores and mixing cost per query and key."""
    return sum(cfg.n_heads * cfg.attn_dims(i)[1] for i in range(cfg.n_layers))


def shardings(cfg: GemmaConfig, mesh, rules: dict = RULES) -> dict[str, jax.sharding.NamedSharding]:
    """Flat name -> NamedSharding from the logical axes through `rules` (dims the mesh does not divide
    stay whole)."""
    return {name: jax.sharding.NamedSharding(mesh, fitted_spec(axes, shape, dict(mesh.shape), rules))
            for name, (shape, axes) in param_layout(cfg).items()}


def _constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fitted_spec(axes, x.shape, dict(mesh.shape)))


def rms_norm(x: jax.Array, scale: jax.Array | None, plus_one: bool = True) -> jax.Array:
    """x / rms(x) times (1 + scale), or times scale (plus_one=False), or alone (scale None)."""
    xf = x.astype(jnp.float32)  # statistics in f32 whatever the compute dtype
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + 1e-6)
    if scale is not None:
        y = y * (scale.astype(jnp.float32) + (1 if plus_one else 0))
    return y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, base: int, scale: float = 1.0, fraction: float = 1.0) -> jax.Array:
    """Rotary embedding of x [B, T, N, hd] at int positions [B, T] (halves rotated, as Gemma does); only the
    first fraction of the hd/2 frequency pairs rotate (Gemma 4's global layers), the others stay as they are."""
    hd = x.shape[-1]
    idx = jnp.arange(hd // 2)
    timescale = jnp.where(idx < int(fraction * hd // 2), base ** (2 * idx / hd), jnp.inf)
    angle = positions[..., None] / timescale / scale
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def _p(rngs: nnx.Rngs | None, shape, axes, init_std: float, one: bool = False) -> nnx.Param:
    if one:  # a multiplier applied as it is (_is_scale)
        val = jnp.ones(shape, jnp.float32)
    elif rngs is None or init_std == 0:  # abstract / to be loaded, or a norm scale (applied as 1 + scale)
        val = jnp.zeros(shape, jnp.float32)
    else:
        val = init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(val, axes=axes)


class Layer(nnx.Module):
    def __init__(self, cfg: GemmaConfig, i: int, rngs: nnx.Rngs | None):
        prefix = f"layers.{i}."
        for name, (shape, axes) in param_layout(cfg).items():
            if name.startswith(prefix):
                leaf = name[len(prefix):]
                setattr(self, leaf, _p(rngs, shape, axes, 0.0 if len(shape) == 1 else 0.02, _is_scale(cfg, name)))
        self.cfg = cfg
        self.kind = cfg.layer_types[i]
        self.shares_kv = cfg.kv_source(i) != i

    def norm(self, x, name):
        return rms_norm(x, getattr(self, name)[...], self.cfg.fam.norm_plus_one)

    def attention(self, x, positions, cache, cache_index, segment_ids=None, adapter=None, impl=attention_lib.XLA,
                  shared=None):
        """-> (output, updated cache, (k, v) as attended over). shared: the (k, v) of the layer this one
        takes them from (kv sharing), over positions 0.. of the cache when there is one."""
        cfg, fam, dt = self.cfg, self.cfg.fam, x.dtype
        ad = adapter or (lambda name, inp, y: y)
        local = self.kind == LOCAL
        base = fam.local_rope_base if local else fam.global_rope_base
        scale = 1.0 if local else cfg.global_rope_scale
        frac = 1.0 if local else fam.global_rope_fraction
        q = ad("q", x, jnp.einsum("btd,ndh->btnh", x, self.q[...].astype(dt)))
        if fam.qk_norm:
            q = self.norm(q, "q_norm")
        q = rope(q, positions, base, scale, frac) * jnp.asarray(cfg.query_pre_attn_scalar ** -0.5, dt)
        q = _constrain(q, ("batch", "seq", "heads", "head_dim"))
        if shared is not None:
            k, v = shared
            key_pos = jnp.arange(k.shape[1])[None, :] if cache_index is not None else positions
        else:
            kv = ad("kv", x, jnp.einsum("bsd,ckdh->cbskh", x, self.kv[...].astype(dt)))  # k, v stacked
            k = ad("k", x, kv[0])
            v = ad("v", x, kv[1]) if kv.shape[0] == 2 else k  # k_eq_v: one projection, the same adapter
            if fam.v_norm:
                v = rms_norm(v, None)
            if fam.qk_norm:
                k = self.norm(k, "k_norm")
            k = rope(k, positions, base, scale, frac)
            if cache is not None:  # write this call's keys/values at cache_index, attend over the whole cache
                k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, cache_index, 0, 0))
                v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, cache_index, 0, 0))
                cache = {"k": k, "v": v}
                k, v = k.astype(dt), v.astype(dt)
                key_pos = jnp.arange(k.shape[1])[None, :]
            else:
                key_pos = positions
        kv_axes = ("batch", "seq", "kv_heads", "head_dim")
        path = attention_lib.XLA if cache_index is not None else impl  # decoding attends by XLA
        copies = attention_lib.copies_before(path, q.shape[2], k.shape[2])
        if copies > 1:
            # copies of the kv heads where `model` splits the query heads and not the kv heads
            # (attention.kv_copies), so both split alike: XLA's grouped-query product, without them, was
            # rematerialised whole over `model`. They are made where the keys are split by position like the
            # residual stream, and then go over to the heads' split (one all-to-all, the copies of a device's
            # positions out to the devices of their heads): never a device holding every row's whole kv heads
            # (XLA cannot go from positions split to kv heads split part-way, and gathers them whole). The
            # kv-shared layers read the copies as they are.
            by_position = ("batch", "residual_seq", "kv_heads", "head_dim")
            k, v = (jnp.repeat(_constrain(a, by_position), copies, axis=2) for a in (k, v))
            k, v = _constrain(k, by_position), _constrain(v, by_position)
        k, v = _constrain(k, kv_axes), _constrain(v, kv_axes)
        if path != attention_lib.XLA:  # training: positions 0..T-1 (or per packed example)
            enc = attention_lib.splash(q, k, v, window=cfg.sliding_window if local else None,
                                       softcap=fam.attn_softcap, segment_ids=segment_ids,
                                       interpret=path == attention_lib.INTERPRET)
            out = ad("o", enc, jnp.einsum("btnh,nhd->btd", enc, self.o[...].astype(dt)))
            return _constrain(out, RESIDUAL), cache, (k, v)
        b, t, h, hd = q.shape
        n_kv = k.shape[2]
        qg = q.reshape(b, t, n_kv, h // n_kv, hd)
        logits = jnp.einsum("btkgh,bskh->btkgs", qg, k, preferred_element_type=jnp.float32)
        # over `model` by kv heads (or their copies), or where there is one kv head by its query heads
        logits = _constrain(logits, SCORES)
        logits = softcap(logits, fam.attn_softcap)
        qp, kp = positions[:, :, None], key_pos[:, None, :]
        mask = kp <= qp
        if local:
            mask &= kp > qp - cfg.sliding_window
        if segment_ids is not None:  # packed rows: a token attends only within its own example
            mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
        logits = jnp.where(mask[:, :, None, None, :], logits, K_MASK)
        probs = jax.nn.softmax(logits, axis=-1).astype(dt)
        enc = jnp.einsum("btkgs,bskh->btkgh", probs, v).reshape(b, t, h, hd)
        out = ad("o", enc, jnp.einsum("btnh,nhd->btd", enc, self.o[...].astype(dt)))
        return _constrain(out, RESIDUAL), cache, (k, v)

    def mlp(self, x, adapter=None):
        dt = x.dtype
        ad = adapter or (lambda name, inp, y: y)
        gate, up = ad("gating", x, jnp.einsum("btd,cfd->cbtf", x, self.gating[...].astype(dt)))  # stacked
        gate, up = ad("gate", x, gate), ad("up", x, up)
        hid = _constrain(jax.nn.gelu(gate, approximate=True) * up, ("batch", "seq", "mlp"))
        return _constrain(ad("down", hid, hid @ self.linear[...].astype(dt)), RESIDUAL)

    def experts(self, x, adapter=None) -> tuple[jax.Array, moe_lib.Drops]:
        names = ("router", "router_scale", "expert_scale", "experts_gating", "experts_linear")
        out, drops = moe_lib.experts(x, {n: getattr(self, n)[...] for n in names}, self.cfg.top_k, adapter,
                                     self.cfg.expert_capacity)
        return _constrain(out, RESIDUAL), drops

    def __call__(self, x, positions, cache=None, cache_index=None, segment_ids=None, adapter=None,
                 attention=attention_lib.XLA, per_layer=None, shared=None):
        """-> (x, updated cache, this layer's (k, v)). per_layer [B, T, P]: this layer's per-layer input."""
        return self.forward(x, positions, cache, cache_index, segment_ids, adapter, attention, per_layer, shared)[:3]

    def forward(self, x, positions, cache=None, cache_index=None, segment_ids=None, adapter=None,
                attention=attention_lib.XLA, per_layer=None, shared=None):
        """__call__ and what its experts dropped: (x, updated cache, (k, v), moe.Drops: none without experts)."""
        drops = moe_lib.no_drops()
        a, cache, kv = self.attention(self.norm(x, "pre_attn_norm"), positions, cache, cache_index, segment_ids,
                                      adapter, attention, shared)
        x = x + self.norm(a, "post_attn_norm")
        h = self.mlp(self.norm(x, "pre_ffw_norm"), adapter)
        if self.cfg.n_experts:
            e, drops = self.experts(self.norm(x, "pre_moe_norm"), adapter)
            h = self.norm(h, "post_mlp_norm") + self.norm(e, "post_moe_norm")
        x = x + self.norm(h, "post_ffw_norm")
        if per_layer is not None:
            dt = x.dtype
            g = jax.nn.gelu(x @ self.ple_gate[...].astype(dt), approximate=True) * per_layer
            x = x + self.norm(g @ self.ple_proj[...].astype(dt), "ple_norm")
        if self.cfg.family == "gemma4":
            x = x * self.skip_scale[...].astype(x.dtype)
        return x, cache, kv, drops


class Gemma(nnx.Module):
    def __init__(self, cfg: GemmaConfig, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        lay = param_layout(cfg)
        self.embed = _p(rngs, *lay["embed"], 0.02)
        if cfg.per_layer_dim:
            self.ple_embed = _p(rngs, *lay["ple_embed"], 0.02)
            self.ple_in = _p(rngs, *lay["ple_in"], 0.02)
            self.ple_in_norm = _p(rngs, *lay["ple_in_norm"], 0.0, one=True)
        self.layers = nnx.List([Layer(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.final_norm = _p(rngs, *lay["final_norm"], 0.0, _is_scale(cfg, "final_norm"))

    def per_layer_inputs(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
        """Gemma 4's per-layer inputs [B, T, L, P]: the token's row of the per-layer table (times sqrt(P)) and
        a projection of its embedding x (times 1/sqrt(D), normalised), averaged in the root-mean-square sense."""
        return per_layer_inputs(self.cfg, self.ple_in[...], self.ple_in_norm[...], self.ple_embed[...], tokens, x)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, cache: list | None = None,
                 cache_index: jax.Array | int = 0, *, dtype=jnp.float32, segment_ids: jax.Array | None = None,
                 adapter=None, attention: str = attention_lib.XLA, remat: str = "none",
                 logits: bool = True, lookup=None) -> tuple[jax.Array, list | None]:
        """int tokens [B, T] -> (f32 logits [B, T, V], updated cache or None): `forward` without its count of what
        the experts dropped."""
        return self.forward(tokens, positions, cache, cache_index, dtype=dtype, segment_ids=segment_ids,
                            adapter=adapter, attention=attention, remat=remat, logits=logits, lookup=lookup)[:2]

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None, cache: list | None = None,
                cache_index: jax.Array | int = 0, *, dtype=jnp.float32, segment_ids: jax.Array | None = None,
                adapter=None, attention: str = attention_lib.XLA, remat: str = "none",
                logits: bool = True, lookup=None) -> tuple[jax.Array, list | None, moe_lib.Drops]:
        """int tokens [B, T] -> (f32 logits [B, T, V], updated cache or None, moe.Drops summed over the layers).

        Without a cache the tokens attend to each other (positions default to 0..T-1). With one (from
        init_cache) they are written at cache_index..cache_index+T-1 and attend to everything before.
        segment_ids [B, T] (no cache): tokens attend only to tokens of the same id (packed examples).
        adapter(layer, projection, input, output) -> output: a low-rank update (trainer/models/lora.py)
        added to the projections q, k, v, o, gate, up, down (and the experts', with a 5th argument: the
        rows per expert); it is also offered the stacked outputs of k and v ("kv") and of gate and up
        ("gating") before they are split, and returns them as they are unless it adapts them there.
        attention (no cache): a resolved implementation (attention.resolve); the splash kernel masks by
        index (causal, the local layers' window, segment_ids), which is what positions 0..T-1 per example mean.
        remat (no cache): a policy of trainer/models/remat.py for each layer.
        logits=False: the final hidden states [B, T, D] instead of logits (a chunked loss computes those).
        lookup: the embedding lookup, as `hidden` takes it."""
        cfg = self.cfg
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t)[None] + cache_index, (b, t))
        emb = self.embed[...]
        x = embed(cfg, emb, tokens, dtype, lookup)
        ple = self.per_layer_inputs(tokens, x) if cfg.per_layer_dim else None
        new_cache = [] if cache is not None else None
        kvs: dict[int, tuple] = {}  # the (k, v) of layers that later layers share
        drops = moe_lib.no_drops()
        for i, layer in enumerate(self.layers):
            ad = None if adapter is None else functools.partial(adapter, i)
            per_layer = None if ple is None else ple[:, :, i]
            shared = kvs.get(cfg.kv_source(i)) if layer.shares_kv else None
            if cache is None:
                x, kv, dropped = _remat_layer(layer, remat, positions, segment_ids, ad, attention)(x, per_layer,
                                                                                                  shared)
            else:
                x, c, kv, dropped = layer.forward(x, positions, cache[i], cache_index, segment_ids, ad,
                                                  per_layer=per_layer, shared=shared)
                new_cache.append(c)
            drops = drops + dropped
            if i in cfg.kv_origins:
                kvs[i] = kv
        x = rms_norm(x, self.final_norm[...], cfg.fam.norm_plus_one)
        if not logits:
            return x, new_cache, drops
        return xent.logits(x, emb, softcap=cfg.fam.final_softcap), new_cache, drops


def embed(cfg: GemmaConfig, table: jax.Array, tokens: jax.Array, dtype, lookup=None) -> jax.Array:
    """The residual stream's input [B, T, D]: the tokens' rows of the tied table (by `lookup(table, tokens)`, a
    take by default) times sqrt(D), in dtype."""
    rows = jnp.take(table, tokens, axis=0) if lookup is None else lookup(table, tokens)
    return _constrain(rows.astype(dtype) * jnp.asarray(math.sqrt(cfg.d_model), dtype), RESIDUAL)


def per_layer_inputs(cfg: GemmaConfig, ple_in, ple_in_norm, ple_embed, tokens: jax.Array, x: jax.Array) -> jax.Array:
    """Gemma.per_layer_inputs from its three tables."""
    dt = x.dtype
    proj = jnp.einsum("btd,dnp->btnp", x, ple_in.astype(dt) * jnp.asarray(cfg.d_model ** -0.5, dt))
    proj = rms_norm(proj, ple_in_norm, cfg.fam.norm_plus_one)
    table = jnp.take(ple_embed, tokens, axis=0).astype(dt)
    return (proj + table * jnp.asarray(math.sqrt(cfg.per_layer_dim), dt)) * jnp.asarray(0.5 ** 0.5, dt)


def _train_forward(lay: Layer, x, per_layer, shared, positions, segment_ids, adapter, attention: str):
    """A layer's training forward (no cache) -> (its output, its kv, what its experts dropped)."""
    out, _, kv, drops = lay.forward(x, positions, None, None, segment_ids, adapter, attention, per_layer, shared)
    return out, kv, drops


def _remat_layer(layer: Layer, policy: str, positions, segment_ids, adapter, attention: str):
    """(x, per-layer input, shared kv) -> (the layer's output, its kv, what its experts dropped) (no cache), under
    the remat policy; the other inputs are closed over."""
    def run(lay, x, per_layer, shared):
        return _train_forward(lay, x, per_layer, shared, positions, segment_ids, adapter, attention)
    if policy == "none":
        return lambda x, per_layer, shared: run(layer, x, per_layer, shared)
    remat_lib.check(policy)
    graphdef, state = nnx.split(layer)
    call = jax.checkpoint(lambda state, *args: run(nnx.merge(graphdef, state), *args),
                          policy=remat_lib.POLICIES[policy])
    return lambda x, per_layer, shared: call(state, x, per_layer, shared)


# The experts' weights stay the scans' slices, although expert parallelism gathers none of them: sliced inside
# the call (the rest not), gemma4-26b-a4b on v5litepod-8 held 4.84 GiB of temporaries against 2.91 for 4% fewer
# bytes a step, the compiler keeping the stacked experts laid out again for the grouped matmul.
_SLICED_BY_SCANS = ("experts_gating", "experts_linear")


def sliced_in_call_by_mesh(remat: str) -> bool:
    """Whether a scanned step's layers take their weights sliced inside the rematerialised call: on one device.
    The scans' own slices of the stacked weights are copies (the outer scan's of a period's run, forward and
    backward; the inner one's in the backward): on one device a copy of whole layers each (gemma4-e2b at 1 row
    of 512 on a v5e chip: 67 GB a step, 46 sliced inside, by the compiler's count), on a slice of the shards the
    layer then gathers. Sliced inside there, the compiler gathers the whole stacked arrays once instead
    (gemma4-31b on v5litepod-8: 9.43 GiB of temporaries against 5.28), so a slice keeps the scans' slices."""
    mesh = jax.sharding.get_abstract_mesh()
    return remat != "none" and (mesh.empty or mesh.size == 1)


def _remat_sliced(graphdef, abstract_state, policy: str, given: dict, stacked: dict, at, positions, segment_ids,
                  adapter, attention: str):
    """_remat_layer for a scanned layer: its weights the arrays given (the scans' slices) and the stacked
    [groups, run length, ...] arrays sliced at (group, index in the run) inside the call, which the backward pass
    then slices again rather than keep."""
    def run(given, stacked, at, x, per_layer, shared):
        g, k = at
        sliced = {leaf: jax.lax.dynamic_slice(a, (g, k) + (0,) * (a.ndim - 2), (1, 1) + a.shape[2:])
                  .reshape(a.shape[2:]) for leaf, a in stacked.items()}
        return _train_forward(_layer_from(graphdef, abstract_state, {**given, **sliced}), x, per_layer, shared,
                              positions, segment_ids, adapter, attention)
    remat_lib.check(policy)
    call = jax.checkpoint(run, policy=remat_lib.POLICIES[policy])
    return lambda x, per_layer, shared: call(given, stacked, at, x, per_layer, shared)


def loss(cfg: GemmaConfig, params: dict[str, jax.Array], tokens: jax.Array, dtype=jnp.float32, *,
         attention: str = attention_lib.XLA, remat: str = "none", loss_chunk: int = 0) -> jax.Array:
    """Mean next-token cross-entropy (f32) of int tokens [B, T+1] under flat params: what a train step
    differentiates (also on abstract shapes, e.g. to compile a step for a slice ahead of time).
    loss_chunk: sequence positions whose logits exist at once (0: all [B, T, V])."""
    model = from_flat(cfg, params)
    x, _ = model(tokens[:, :-1], dtype=dtype, attention=attention, remat=remat, logits=False)
    if loss_chunk:
        return xent.chunked(x, params["embed"], tokens[:, 1:], loss_chunk, softcap=cfg.fam.final_softcap)
    return loss_fn(xent.logits(x, params["embed"], softcap=cfg.fam.final_softcap), tokens[:, 1:])


def init_cache(cfg: GemmaConfig, batch: int, length: int, dtype=jnp.float32) -> list[dict[str, jax.Array] | None]:
    """Per layer {k, v} [B, length, K, hd] (None for a layer that attends over another's)."""
    out = []
    for i in range(cfg.n_layers):
        k, hd, _ = cfg.attn_dims(i)
        shape = (batch, length, k, hd)
        out.append(None if cfg.kv_source(i) != i else {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)})
    return out


def abstract(cfg: GemmaConfig):
    """(graphdef, abstract param state) without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: Gemma(cfg)))


def to_state(flat: dict[str, Any]) -> dict:
    """Flat name -> array ('layers.3.q') into the model's nested pure-dict state."""
    out: dict = {}
    for name, val in flat.items():
        *path, leaf = name.split(".")
        node = out
        for key in path:
            node = node.setdefault(int(key) if key.isdigit() else key, {})
        node[leaf] = val
    return out


def from_flat(cfg: GemmaConfig, flat: dict[str, jax.Array]) -> Gemma:
    """A Gemma module holding these arrays (flat names as in param_layout)."""
    graphdef, state = abstract(cfg)
    nnx.replace_by_pure_dict(state, to_state(flat))
    return nnx.merge(graphdef, state)


def random_params(cfg: GemmaConfig, seed: int = 0, dtype=jnp.float32, shardings: dict | None = None,
                  stacked: bool = False) -> dict[str, jax.Array]:
    """Flat random params (tests, benchmarks): normal matrices scaled by their input width, small random
    norm scales (around 1 where a scale is applied as it is). With shardings (name -> sharding), each array is
    drawn in `dtype` where the rules place it, never whole on one device or the host (a real size's base).
    stacked: in stacked_layout's names, each stacked array drawn in place (other values than the flat draw's).

    One compiled program per distinct (shape, placement), each called with its array's key: a real size has
    hundreds of arrays but a dozen shapes. The TPU compiler's time grows with a program's outputs (~0.4 s each on
    a TPU host: 97-162 s for gemma2-2b's or gemma4-e2b's base as one program), and a program per array costs
    as much again."""
    key = jax.random.key(seed)
    layout = stacked_layout(cfg) if stacked else param_layout(cfg)
    out = {}
    for i, (name, (shape, _)) in enumerate(layout.items()):
        groups = tuple(shape[:2]) if name.startswith(SCANNED) else ()  # [groups, run length, ...]
        one = shape[2:] if groups else shape
        leaf = name.rsplit(".", 1)[-1]
        fan_in = {"embed": one[-1], "ple_embed": one[-1], "ple_in": one[0], "ple_gate": one[0],
                  "router": one[0]}.get(leaf, one[-1])
        std = 0.1 if len(one) == 1 else 0.5 / math.sqrt(fan_in)
        sh = None if shardings is None else shardings[name]
        out[name] = _drawer(tuple(shape), jnp.dtype(dtype), sh)(
            jax.random.fold_in(key, i), jnp.float32(std), jnp.float32(1.0 if _is_scale(cfg, name) else 0.0))
    return out


@functools.lru_cache(maxsize=None)
def _drawer(shape: tuple[int, ...], dtype, sharding):
    """(key, std, offset) -> std * normal(shape) + offset in dtype, placed by sharding: one compiled program for
    every array of this shape and placement (a stacked array is drawn whole: a key per group under vmap made each
    program ~8 s to compile on a TPU host, 278 s for gemma4-e2b's stacked base)."""
    def draw(key, std, offset):
        return (std.astype(dtype) * jax.random.normal(key, shape, dtype) + offset.astype(dtype)).astype(dtype)
    return jax.jit(draw, out_shardings=sharding)


# ---- the layers in a scan ---------------------------------------------------------------------------------
# A train step over the layers one by one is a program as long as the model: the TPU compiler takes minutes over
# a Gemma 4 step (its buffers too: it keeps each layer's gathered weights for the backward pass). The step runs
# the layers as scans instead: a run of whole periods of the attention pattern whose layers have the same shapes
# (a segment: the E sizes' kv-shared layers are one of their own) is one lax.scan over the periods, and inside a
# period each run of consecutive layers of one kind (Gemma 4's five local layers, then its global one) is a scan
# of its own over those layers. The compiler so generates code for one layer of each kind per segment, not for a
# whole period, and a device gathers one layer's weights at a time. The weights come stacked
# ("scan.S.R.LEAF": run R of the period in segment S, [groups, run length, ...], both stacked dims whole on every
# device, `stack`). The layers outside any segment (a depth that is not whole periods) keep their flat names and
# run one by one.

SCANNED = "scan."


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int   # its first layer
    groups: int  # periods of the pattern it scans over
    period: int  # layers per period
    runs: tuple[tuple[int, int], ...] = ()  # (first position, length): the period's runs of layers of one kind

    def layer(self, g: int, j: int) -> int:
        return self.start + g * self.period + j


def _runs(pattern: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for j, kind in enumerate(pattern):
        if out and pattern[out[-1][0]] == kind:
            out[-1][1] += 1
        else:
            out.append([j, 1])
    return tuple((a, n) for a, n in out)


def segments(cfg: GemmaConfig, min_groups: int = 2) -> list[Segment]:
    """The scanned runs of layers: within the layers that own their kv and within those that share (their MLP
    width and kv sources differ), as many whole periods as there are, when at least min_groups."""
    pattern = cfg.pattern or cfg.fam.pattern
    p = len(pattern)
    first_shared = cfg.n_layers - cfg.kv_shared_layers
    out = []
    for a, b in ((0, first_shared), (first_shared, cfg.n_layers)):
        g = (b - a) // p
        if g >= min_groups:
            out.append(Segment(a, g, p, _runs(pattern)))
    return out


def _scanned_layers(cfg: GemmaConfig) -> dict[int, tuple[int, int, int, int]]:
    """Layer -> (segment, group, run, index in the run) for every layer that runs in a scan."""
    return {seg.layer(g, j0 + k): (s, g, r, k) for s, seg in enumerate(segments(cfg))
            for g in range(seg.groups) for r, (j0, n) in enumerate(seg.runs) for k in range(n)}


def stacked_layout(cfg: GemmaConfig, flat: dict | None = None
                   ) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """A per-layer layout (flat: name 'layers.I.LEAF' -> (shape, logical axes); param_layout's by default, or the
    LoRA adapters') with the scanned layers' arrays stacked: 'scan.S.R.LEAF' [groups, run length, ...] (the stacked
    dims unsharded); every other name as `flat` has it."""
    flat = param_layout(cfg) if flat is None else flat
    where = _scanned_layers(cfg)
    segs = segments(cfg)
    out = {}
    for name, (shape, axes) in flat.items():
        if not name.startswith("layers."):
            out[name] = (shape, axes)
            continue
        _, i, leaf = name.split(".", 2)
        if int(i) not in where:
            out[name] = (shape, axes)
            continue
        s, g, r, k = where[int(i)]
        if g == 0 and k == 0:
            out[f"{SCANNED}{s}.{r}.{leaf}"] = ((segs[s].groups, segs[s].runs[r][1], *shape), (None, None, *axes))
    return out


def stacked_shardings(cfg: GemmaConfig, mesh, rules: dict = RULES) -> dict[str, jax.sharding.NamedSharding]:
    return {name: jax.sharding.NamedSharding(mesh, fitted_spec(axes, shape, dict(mesh.shape), rules))
            for name, (shape, axes) in stacked_layout(cfg).items()}


def _members(cfg: GemmaConfig, names=None) -> dict[str, list[list[str]]]:
    """Stacked name -> the flat names it stacks (members), for the flat names given (param_layout's by default)."""
    where = _scanned_layers(cfg)
    out: dict[str, list[list[str]]] = {}
    for name in (param_layout(cfg) if names is None else names):
        if name.startswith("layers.") and int(name.split(".")[1]) in where:
            _, i, leaf = name.split(".", 2)
            s, _, r, _ = where[int(i)]
            key = f"{SCANNED}{s}.{r}.{leaf}"
            if key not in out:
                out[key] = members(cfg, key)
    return out


def members(cfg: GemmaConfig, stacked_name: str) -> list[list[str]]:
    """The flat names a stacked name ('scan.S.R.LEAF') stacks, [group][index in the run]."""
    _, s, r, leaf = stacked_name.split(".", 3)
    seg = segments(cfg)[int(s)]
    j0, n = seg.runs[int(r)]
    return [[f"layers.{seg.layer(g, j0 + k)}.{leaf}" for k in range(n)] for g in range(seg.groups)]


def stack(cfg: GemmaConfig, flat: dict[str, jax.Array], shardings: dict | None = None,
          free: bool = False) -> dict[str, jax.Array]:
    """Flat arrays ('layers.I.LEAF': the base's, or the adapters') -> stacked_layout's names, each stacked array
    placed by `shardings` when given. free: delete each flat array once it is stacked, so a base is never held
    twice over (a loaded one)."""
    scanned = _scanned_layers(cfg)
    out = {n: a for n, a in flat.items() if not n.startswith("layers.") or int(n.split(".")[1]) not in scanned}
    for name, parts in _members(cfg, flat).items():
        arrays = [flat[p] for row in parts for p in row]
        groups, n = len(parts), len(parts[0])
        together = lambda *xs: jnp.stack(xs).reshape(groups, n, *xs[0].shape)  # noqa: E731
        sh = None if shardings is None else shardings[name]
        out[name] = jax.jit(together, out_shardings=sh)(*arrays) if sh is not None else together(*arrays)
        if free:
            for a in arrays:
                if isinstance(a, jax.Array):
                    a.delete()
    return out


def unstack(cfg: GemmaConfig, stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """stacked_layout's names -> the flat ones (inside a jit: slices)."""
    out = {n: a for n, a in stacked.items() if not n.startswith(SCANNED)}
    for name, a in stacked.items():
        if name.startswith(SCANNED):
            for g, row in enumerate(members(cfg, name)):
                for k, flat in enumerate(row):
                    out[flat] = a[g, k]
    return out


def is_stacked(params: dict) -> bool:
    return any(n.startswith(SCANNED) for n in params)


def _layer_state(cfg: GemmaConfig, i: int):
    """(graphdef, abstract state) of layer i alone: a scan body builds the layer from one layer's slices."""
    return nnx.split(nnx.eval_shape(lambda: Layer(cfg, i, None)))


def _layer_from(graphdef, abstract_state, leaves: dict[str, jax.Array]) -> Layer:
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, leaves)
    return nnx.merge(graphdef, state)


# make_adapter(layer index (an int, or traced inside a scan), that layer's adapter arrays by their names after
# 'layers.I.') -> adapter(projection, input, output[, rows per expert]) -> output
MakeAdapter = Any


def hidden(cfg: GemmaConfig, params: dict[str, jax.Array], tokens: jax.Array, positions: jax.Array | None = None,
           **kw) -> jax.Array:
    """hidden_counted's hidden states alone."""
    return hidden_counted(cfg, params, tokens, positions, **kw)[0]


def hidden_counted(cfg: GemmaConfig, params: dict[str, jax.Array], tokens: jax.Array,
                   positions: jax.Array | None = None, *, dtype=jnp.float32, segment_ids: jax.Array | None = None,
                   adapters: dict | None = None, make_adapter: MakeAdapter = None, attention: str = attention_lib.XLA,
                   remat: str = "none", unroll: int | bool = 1, lookup=None,
                   sliced_in_call: bool | None = None) -> tuple[jax.Array, moe_lib.Drops]:
    """(the final hidden states [B, T, D] (normalised), moe.Drops summed over the layers: the scans carry the sum)
    of int tokens [B, T], from stacked params (stacked_layout),
    the segments' layers in scans: the training forward of Gemma.__call__ (no cache) with its numerics.
    adapters: LoRA's arrays, a scanned run's as the train state holds them ('scan.S.R.REST', lora.stacked_layout)
    or per layer ('layers.I.REST', stacked here like the weights), each layer's handed to make_adapter.
    unroll: the scans' unroll (True: written out, e.g. a twin for counting).
    lookup(table, tokens) -> rows: the embedding lookup (default a take; vocab_parallel.lookup for a table
    sharded by its rows).
    sliced_in_call: whether the scanned layers take their weights sliced from the stacked arrays inside the
    rematerialised call (None: by the mesh, sliced_in_call_by_mesh)."""
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    x = embed(cfg, params["embed"], tokens, dtype, lookup)
    ple = None if not cfg.per_layer_dim else per_layer_inputs(cfg, params["ple_in"], params["ple_in_norm"],
                                                               params["ple_embed"], tokens, x)
    adapters = adapters or {}
    segs = {seg.start: (s, seg) for s, seg in enumerate(segments(cfg))}
    kvs: dict[int, tuple] = {}
    drops = moe_lib.no_drops()
    inside = sliced_in_call_by_mesh(remat) if sliced_in_call is None else sliced_in_call and remat != "none"
    i = 0

    def layer_adapters(idx: int) -> dict:
        prefix = f"layers.{idx}."
        return {n[len(prefix):]: a for n, a in adapters.items() if n.startswith(prefix)}

    def adapter_of(idx, arrays):
        return None if make_adapter is None else make_adapter(idx, arrays)

    while i < cfg.n_layers:
        if i not in segs:  # a layer on its own, as Gemma.__call__ runs it
            graphdef, abstract_state = _layer_state(cfg, i)
            prefix = f"layers.{i}."
            layer = _layer_from(graphdef, abstract_state,
                                {n[len(prefix):]: a for n, a in params.items() if n.startswith(prefix)})
            shared = kvs.get(cfg.kv_source(i)) if layer.shares_kv else None
            per_layer = None if ple is None else ple[:, :, i]
            x, kv, dropped = _remat_layer(layer, remat, positions, segment_ids, adapter_of(i, layer_adapters(i)),
                                          attention)(x, per_layer, shared)
            drops = drops + dropped
            if i in cfg.kv_origins:
                kvs[i] = kv
            i += 1
            continue
        s, seg = segs[i]
        x, carried, dropped = _scan_segment(cfg, s, seg, params, x, ple, positions, segment_ids, kvs, adapters,
                                            adapter_of, attention, remat, unroll, inside)
        drops = drops + dropped
        kvs.update(carried)
        i = seg.start + seg.groups * seg.period
    return rms_norm(x, params["final_norm"], cfg.fam.norm_plus_one), drops


def _scan_segment(cfg, s, seg: Segment, params, x, ple, positions, segment_ids, kvs, adapters, adapter_of,
                  attention, remat, unroll, inside: bool = False):
    """One segment's layers as a scan over its periods, each period's runs of one kind a scan over their layers
    -> (x, {layer: its (k, v)} of the last period's kv origins, carried out of the loops, moe.Drops summed over
    its layers: carried too). inside: the layers' weights (but the experts') sliced from the stacked arrays inside
    the rematerialised call, not handed in by the scans (sliced_in_call_by_mesh says when)."""
    p, n = seg.period, seg.groups
    defs = [_layer_state(cfg, seg.layer(0, j0)) for j0, _ in seg.runs]
    weights = {r: {} for r in range(len(seg.runs))}  # each run's stacked arrays the scans slice
    whole = {r: {} for r in range(len(seg.runs))}  # ... and those sliced inside the call
    for name, a in params.items():
        if name.startswith(f"{SCANNED}{s}."):
            _, _, r, leaf = name.split(".", 3)
            (whole if inside and leaf not in _SLICED_BY_SCANS else weights)[int(r)][leaf] = a
    # the adapters of each run, [groups, run length, ...] like the weights: as the train state holds them
    # (lora.stacked_layout), or stacked here from per-layer arrays
    ads = {r: {} for r in range(len(seg.runs))}
    for name, a in adapters.items():
        if name.startswith(f"{SCANNED}{s}."):
            _, _, r, leaf = name.split(".", 3)
            ads[int(r)][leaf] = a
    for r, (j0, m) in enumerate(seg.runs):
        if ads[r]:
            continue
        names: dict[str, list] = {}
        for g in range(n):
            for k in range(m):
                prefix = f"layers.{seg.layer(g, j0 + k)}."
                for nm, a in adapters.items():
                    if nm.startswith(prefix):
                        names.setdefault(nm[len(prefix):], []).append(a)
        ads[r] = {key: jnp.stack(v).reshape(n, m, *v[0].shape) for key, v in names.items()}
    per_layer = None
    if ple is not None:  # [B, T, L, P] -> [groups, B, T, period, P]
        part = ple[:, :, seg.start:seg.start + n * p]
        per_layer = jnp.moveaxis(part.reshape(*part.shape[:2], n, p, part.shape[-1]), 2, 0)
    # the runs whose last layer (in the last period) is a kv origin: their scans carry out their last (k, v)
    origins = {r: seg.layer(n - 1, j0 + m - 1) for r, (j0, m) in enumerate(seg.runs)
               if seg.layer(n - 1, j0 + m - 1) in cfg.kv_origins}
    for r, (j0, m) in enumerate(seg.runs):
        if any(seg.layer(n - 1, j0 + k) in cfg.kv_origins for k in range(m - 1)):
            raise AssertionError(f"segment {s} run {r}: a kv origin that is not the last layer of its kind")
    b, t, _ = x.shape
    # a carried (k, v) as attention returns them: [B, T, kv heads (with the copies made before attending), head
    # width] each, in the compute dtype
    def kv_shape(i):
        k, hd, _ = cfg.attn_dims(i)
        return b, t, k * attention_lib.copies_before(attention, cfg.n_heads, k), hd
    zeros_kv = {r: (jnp.zeros(kv_shape(origins[r]), x.dtype),) * 2 for r in origins}

    def run_layers(r, x, w, ad, g, pl):
        """Run r of period g: its layers one after the other (a scan over them when there are several)."""
        j0, m = seg.runs[r]
        graphdef, abstract_state = defs[r]
        src = cfg.kv_source(seg.layer(0, j0))
        shares = cfg.kv_source(seg.layer(0, j0)) != seg.layer(0, j0)
        shared = kvs.get(src) if shares else None

        def one(x, wk, adk, k, plk):
            idx = seg.start + g * p + j0 + k
            if whole[r]:
                return _remat_sliced(graphdef, abstract_state, remat, wk, whole[r], (g, k), positions, segment_ids,
                                     adapter_of(idx, adk), attention)(x, plk, shared)
            layer = _layer_from(graphdef, abstract_state, wk)
            return _remat_layer(layer, remat, positions, segment_ids, adapter_of(idx, adk), attention)(
                x, plk, shared)

        pls = None if pl is None else jnp.moveaxis(pl[:, :, j0:j0 + m], 2, 0)  # [run length, B, T, P]

        # a scan even over a run of one layer: its weights then enter the layer as the scan's own slices of the
        # outer scan's, which the backward pass slices again from the stacked base; a slice taken here (w[0])
        # was a value of the outer scan's body that the backward needs, which jax keeps for it stacked over the
        # periods: a copy of the run's stacked weights (gemma4-31b on v4-8: 2.5 GiB a device, its global layers')
        def body(carry, xs):
            x, _, drops = carry
            wk, adk, k, plk = xs
            x, kv, dropped = one(x, wk, adk, k, plk)
            return (x, kv if r in origins else None, drops + dropped), None

        (x, kv, drops), _ = jax.lax.scan(body, (x, zeros_kv.get(r), moe_lib.no_drops()),
                                         (w, ad, jnp.arange(m, dtype=jnp.int32), pls), unroll=unroll)
        return x, kv, drops

    def body(carry, xs):
        x, _, drops = carry
        w, ad, g, pl = xs
        out_kv = {}
        for r in range(len(seg.runs)):
            x, kv, dropped = run_layers(r, x, w[r], ad[r], g, pl)
            drops = drops + dropped
            if r in origins:
                out_kv[r] = kv
        return (x, out_kv, drops), None

    (x, kv, drops), _ = jax.lax.scan(body, (x, zeros_kv, moe_lib.no_drops()),
                                     (weights, ads, jnp.arange(n, dtype=jnp.int32), per_layer), unroll=unroll)
    return x, {origins[r]: kv[r] for r in origins}, drops
