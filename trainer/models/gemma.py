"""Gemma 2 and Gemma 3 (text) in Flax NNX, sharded by the same logical-axis rules as GPT-2 (trainer/common/mesh.py).

What differs between generations is one row of FAMILIES; the sizes (layers, widths, heads, kv heads,
vocab) come from a checkpoint's array shapes (GemmaConfig.from_shapes) or from the named-size table
SIZES, which also lets a caller build the model from abstract shapes without any weights.

Parameter layout = Kaggle's flax layout (so a checkpoint restores without reshuffling):
embed [V, D], q [H, D, hd], kv [2, K, D, hd], o [H, hd, D], gating [2, F, D] (gate, up), linear [F, D],
RMSNorm scales [D] (and [hd] for Gemma 3's QK-norm), applied as x * (1 + scale).
The D dimension of every matrix is sharded over `data` (fsdp) and heads / mlp / vocab over `model`;
a dimension that a mesh axis does not divide (one kv head on model=2) stays whole (mesh.fitted_spec).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.common.mesh import RULES, fitted_spec
from trainer.models import attention as attention_lib
from trainer.models import remat as remat_lib
from trainer.models import xent
from trainer.models.gpt2 import loss_fn

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
    qk_norm: bool                   # RMSNorm on q and k per head (Gemma 3)


FAMILIES: dict[str, Family] = {
    "gemma2": Family("gemma2", (LOCAL, GLOBAL), 4096, 10_000, 10_000, 50.0, 30.0, False),
    "gemma3": Family("gemma3", (LOCAL,) * 5 + (GLOBAL,), 512, 10_000, 1_000_000, None, None, True),
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

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def layer_types(self) -> tuple[str, ...]:
        p = self.fam.pattern
        return tuple(p[i % len(p)] for i in range(self.n_layers))

    @classmethod
    def from_shapes(cls, family: str, shapes: dict[str, tuple[int, ...]], **overrides) -> "GemmaConfig":
        """Sizes from our-layout parameter shapes ({'embed': (V, D), 'layers.0.q': (H, D, hd), ...}).

        The constants shapes cannot tell (window, query scalar, RoPE scale) come from the named size
        with the same shapes if there is one, else the family's defaults; `overrides` win over both."""
        v, d = shapes["embed"]
        h, _, hd = shapes["layers.0.q"]
        k = shapes["layers.0.kv"][1]
        f = shapes["layers.0.linear"][0]
        n = sum(1 for name in shapes if name.startswith("layers.") and name.endswith(".q"))
        dims = dict(vocab=v, d_model=d, n_layers=n, n_heads=h, n_kv_heads=k, head_dim=hd, ff=f)
        named = next((c for c in SIZES.values() if c.family == family and all(
            getattr(c, key) == val for key, val in dims.items() if key != "vocab")), None)
        base = dict(sliding_window=FAMILIES[family].sliding_window, query_pre_attn_scalar=float(hd))
        if named:
            base = dict(sliding_window=named.sliding_window, query_pre_attn_scalar=named.query_pre_attn_scalar,
                        global_rope_scale=named.global_rope_scale)
        return cls(family=family, **dims, **{**base, **overrides})


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
}


def param_layout(cfg: GemmaConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Flat name -> (shape, logical axes) of every parameter."""
    v, d, h, k, hd, f = cfg.vocab, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ff
    out = {"embed": ((v, d), ("vocab", "fsdp")), "final_norm": ((d,), (None,))}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update({
            p + "q": ((h, d, hd), ("heads", "fsdp", "head_dim")),
            p + "kv": ((2, k, d, hd), (None, "kv_heads", "fsdp", "head_dim")),
            p + "o": ((h, hd, d), ("heads", "head_dim", "fsdp")),
            p + "gating": ((2, f, d), (None, "mlp", "fsdp")),
            p + "linear": ((f, d), ("mlp", "fsdp")),
        })
        for norm in ("pre_attn_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm"):
            out[p + norm] = ((d,), (None,))
        if cfg.fam.qk_norm:
            out[p + "q_norm"] = ((hd,), (None,))
            out[p + "k_norm"] = ((hd,), (None,))
    return out


def count_params(cfg: GemmaConfig) -> int:
    return sum(math.prod(shape) for shape, _ in param_layout(cfg).values())


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


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)  # statistics in f32 whatever the compute dtype
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + 1e-6)
    return (y * (1 + scale.astype(jnp.float32))).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, base: int, scale: float = 1.0) -> jax.Array:
    """Rotary embedding of x [B, T, N, hd] at int positions [B, T] (halves rotated, as Gemma does)."""
    hd = x.shape[-1]
    timescale = base ** (2 * jnp.arange(hd // 2) / hd)
    angle = positions[..., None] / timescale / scale
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def _p(rngs: nnx.Rngs | None, shape, axes, init_std: float) -> nnx.Param:
    if rngs is None or init_std == 0:  # abstract / to be loaded, or a norm scale (applied as 1 + scale)
        val = jnp.zeros(shape, jnp.float32)
    else:
        val = init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(val, axes=axes)


class Layer(nnx.Module):
    def __init__(self, cfg: GemmaConfig, i: int, rngs: nnx.Rngs | None):
        lay = param_layout(cfg)
        for name in ("q", "kv", "o", "gating", "linear", "pre_attn_norm", "post_attn_norm", "pre_ffw_norm",
                     "post_ffw_norm") + (("q_norm", "k_norm") if cfg.fam.qk_norm else ()):
            shape, axes = lay[f"layers.{i}.{name}"]
            setattr(self, name, _p(rngs, shape, axes, 0.0 if name.endswith("norm") else 0.02))
        self.cfg = cfg
        self.kind = cfg.layer_types[i]

    def attention(self, x, positions, cache, cache_index, segment_ids=None, adapter=None, impl=attention_lib.XLA):
        cfg, fam, dt = self.cfg, self.cfg.fam, x.dtype
        ad = adapter or (lambda name, inp, y: y)
        q = ad("q", x, jnp.einsum("btd,ndh->btnh", x, self.q[...].astype(dt)))
        k, v = jnp.einsum("bsd,ckdh->cbskh", x, self.kv[...].astype(dt))
        k, v = ad("k", x, k), ad("v", x, v)
        if fam.qk_norm:
            q, k = rms_norm(q, self.q_norm[...]), rms_norm(k, self.k_norm[...])
        local = self.kind == LOCAL
        base = fam.local_rope_base if local else fam.global_rope_base
        scale = 1.0 if local else cfg.global_rope_scale
        q = rope(q, positions, base, scale) * jnp.asarray(cfg.query_pre_attn_scalar ** -0.5, dt)
        k = rope(k, positions, base, scale)
        q = _constrain(q, ("batch", "seq", "heads", "head_dim"))
        if cache is not None:  # write this call's keys/values at cache_index, attend over the whole cache
            k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, cache_index, 0, 0))
            v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, cache_index, 0, 0))
            cache = {"k": k, "v": v}
            k, v = k.astype(dt), v.astype(dt)
            key_pos = jnp.arange(k.shape[1])[None, :]
        else:
            key_pos = positions
        k = _constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = _constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        if cache is None and impl != attention_lib.XLA:  # training: positions 0..T-1 (or per packed example)
            enc = attention_lib.splash(q, k, v, window=cfg.sliding_window if local else None,
                                       softcap=fam.attn_softcap, segment_ids=segment_ids,
                                       interpret=impl == attention_lib.INTERPRET)
            out = ad("o", enc, jnp.einsum("btnh,nhd->btd", enc, self.o[...].astype(dt)))
            return _constrain(out, ("batch", "seq", "embed")), cache
        b, t, h, hd = q.shape
        groups = h // cfg.n_kv_heads
        qg = q.reshape(b, t, cfg.n_kv_heads, groups, hd)
        logits = jnp.einsum("btkgh,bskh->btkgs", qg, k, preferred_element_type=jnp.float32)
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
        return _constrain(out, ("batch", "seq", "embed")), cache

    def mlp(self, x, adapter=None):
        dt = x.dtype
        ad = adapter or (lambda name, inp, y: y)
        gate, up = jnp.einsum("btd,cfd->cbtf", x, self.gating[...].astype(dt))
        gate, up = ad("gate", x, gate), ad("up", x, up)
        hid = _constrain(jax.nn.gelu(gate, approximate=True) * up, ("batch", "seq", "mlp"))
        return _constrain(ad("down", hid, hid @ self.linear[...].astype(dt)), ("batch", "seq", "embed"))

    def __call__(self, x, positions, cache=None, cache_index=None, segment_ids=None, adapter=None,
                 attention=attention_lib.XLA):
        a, cache = self.attention(rms_norm(x, self.pre_attn_norm[...]), positions, cache, cache_index,
                                  segment_ids, adapter, attention)
        x = x + rms_norm(a, self.post_attn_norm[...])
        h = self.mlp(rms_norm(x, self.pre_ffw_norm[...]), adapter)
        return x + rms_norm(h, self.post_ffw_norm[...]), cache


class Gemma(nnx.Module):
    def __init__(self, cfg: GemmaConfig, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        lay = param_layout(cfg)
        self.embed = _p(rngs, *lay["embed"], 0.02)
        self.layers = nnx.List([Layer(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.final_norm = _p(rngs, *lay["final_norm"], 0.0)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, cache: list | None = None,
                 cache_index: jax.Array | int = 0, *, dtype=jnp.float32, segment_ids: jax.Array | None = None,
                 adapter=None, attention: str = attention_lib.XLA, remat: str = "none",
                 logits: bool = True) -> tuple[jax.Array, list | None]:
        """int tokens [B, T] -> (f32 logits [B, T, V], updated cache or None).

        Without a cache the tokens attend to each other (positions default to 0..T-1). With one (from
        init_cache) they are written at cache_index..cache_index+T-1 and attend to everything before.
        segment_ids [B, T] (no cache): tokens attend only to tokens of the same id (packed examples).
        adapter(layer, projection, input, output) -> output: a low-rank update (trainer/models/lora.py)
        added to the projections q, k, v, o, gate, up, down.
        attention (no cache): a resolved implementation (attention.resolve); the splash kernel masks by
        index (causal, the local layers' window, segment_ids), which is what positions 0..T-1 per example mean.
        remat (no cache): a policy of trainer/models/remat.py for each layer.
        logits=False: the final hidden states [B, T, D] instead of logits (a chunked loss computes those)."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t)[None] + cache_index, (b, t))
        emb = self.embed[...]
        x = jnp.take(emb, tokens, axis=0).astype(dtype) * jnp.asarray(math.sqrt(self.cfg.d_model), dtype)
        x = _constrain(x, ("batch", "seq", "embed"))
        new_cache = [] if cache is not None else None
        for i, layer in enumerate(self.layers):
            ad = None if adapter is None else functools.partial(adapter, i)
            if cache is None:
                x = _remat_layer(layer, remat, positions, segment_ids, ad, attention)(x)
                continue
            x, c = layer(x, positions, cache[i], cache_index, segment_ids, ad)
            new_cache.append(c)
        x = rms_norm(x, self.final_norm[...])
        if not logits:
            return x, new_cache
        return xent.logits(x, emb, softcap=self.cfg.fam.final_softcap), new_cache


def _remat_layer(layer: Layer, policy: str, positions, segment_ids, adapter, attention: str):
    """x -> the layer's output (no cache), under the remat policy; the other inputs are closed over."""
    if policy == "none":
        return lambda x: layer(x, positions, None, None, segment_ids, adapter, attention)[0]
    remat_lib.check(policy)
    graphdef, state = nnx.split(layer)
    call = jax.checkpoint(lambda state, x: nnx.merge(graphdef, state)(x, positions, None, None, segment_ids, adapter,
                                                                      attention)[0],
                          policy=remat_lib.POLICIES[policy])
    return lambda x: call(state, x)


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


def init_cache(cfg: GemmaConfig, batch: int, length: int, dtype=jnp.float32) -> list[dict[str, jax.Array]]:
    shape = (batch, length, cfg.n_kv_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.n_layers)]


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


def random_params(cfg: GemmaConfig, seed: int = 0) -> dict[str, jax.Array]:
    """Flat f32 random params (tests, benchmarks): normal(0.02) matrices, small random norm scales."""
    key = jax.random.key(seed)
    out = {}
    for i, (name, (shape, _)) in enumerate(param_layout(cfg).items()):
        std = 0.1 if len(shape) == 1 else 0.5 / math.sqrt(shape[-1] if name != "embed" else shape[1])
        out[name] = std * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    return out
