"""GPT-2 in Flax NNX, with logical sharding names on every parameter and activation.

Parameters are f32 (master weights); `dtype` is the compute dtype. Each Param carries `axes` metadata
(logical names, mapped to the mesh by trainer.common.mesh.RULES), which `param_shardings` turns into the
NamedShardings the params are created and kept with. Dropout draws from an explicit key so the jitted
step can derive it from (seed, step) on global arrays.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.common.config import ModelConfig
from trainer.common.mesh import RULES, constrain, sharding
from trainer.models import attention as attention_lib
from trainer.models import remat as remat_lib
from trainer.models import vocab_parallel as vocab_parallel_lib
from trainer.kernels import xent_kernel
from trainer.models import xent

normal = jax.nn.initializers.normal


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, jnp.float32), axes=axes)


def _drop_below(rate: float) -> int:
    """keep_masks drops a 16-bit uniform below this: rate rounded to 1/65536."""
    return round(rate * 65536)


def keep_prob(rate: float) -> float:
    """The exact keep probability of keep_masks."""
    return 1.0 - _drop_below(rate) / 65536


def keep_masks(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """Dropout keep-masks (True with probability keep_prob(rate)) from 16-bit uniforms, two per 32-bit
    random word: half the RNG work of jax.random.bernoulli, which is most of dropout's cost on CPU.
    Values depend on (key, shape) only, not on how the result is sharded (threefry is partitionable)."""
    half = -(-shape[-1] // 2)
    bits = jax.random.bits(key, (*shape[:-1], half), jnp.uint32)
    u16 = jnp.concatenate([bits & 0xFFFF, bits >> 16], axis=-1)[..., : shape[-1]]
    return u16 >= _drop_below(rate)


def dropout(x: jax.Array, rate: float, keep: jax.Array | None) -> jax.Array:
    if keep is None:
        return x
    return jnp.where(keep, x / keep_prob(rate), 0).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.scale = _param(rngs, jax.nn.initializers.ones, (d,), ("embed",))
        self.bias = _param(rngs, jax.nn.initializers.zeros, (d,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in f32 whatever the compute dtype.
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...] + self.bias[...]
        return y.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, hd = cfg.d_model, cfg.n_head, cfg.head_dim
        # q/k/v kept as a separate axis so sharding heads over `model` never splits across q, k and v.
        self.qkv_kernel = _param(rngs, normal(0.02), (d, 3, h, hd), ("embed", None, "heads", "head_dim"))
        self.qkv_bias = _param(rngs, jax.nn.initializers.zeros, (3, h, hd), (None, "heads", "head_dim"))
        out_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: residual projections scaled by depth
        self.out_kernel = _param(rngs, normal(out_std), (h, hd, d), ("heads", "head_dim", "embed"))
        self.out_bias = _param(rngs, jax.nn.initializers.zeros, (d,), ("embed",))

    def __call__(self, x: jax.Array, attention: str = attention_lib.XLA,
                 kernel: attention_lib.Kernel = attention_lib.Kernel()) -> jax.Array:
        dt = x.dtype
        if attention in (attention_lib.RESIDENT, attention_lib.RESIDENT_INTERPRET):
            return self._resident(x, kernel.resident_block, attention == attention_lib.RESIDENT_INTERPRET)
        qkv = jnp.einsum("btd,dkhe->kbthe", x, self.qkv_kernel[...].astype(dt))
        qkv = qkv + self.qkv_bias[...].astype(dt)[:, None, None]
        q, k, v = (constrain(t, ("batch", "seq", "heads", "head_dim")) for t in qkv)
        if attention == attention_lib.XLA:
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:  # the kernel does not scale q itself
            y = attention_lib.splash(q * jnp.asarray(q.shape[-1] ** -0.5, dt), k, v,
                                     interpret=attention == attention_lib.INTERPRET, kernel=kernel)
        y = constrain(y, ("batch", "seq", "heads", "head_dim"))
        out = jnp.einsum("bthe,hed->btd", y, self.out_kernel[...].astype(dt)) + self.out_bias[...].astype(dt)
        return constrain(out, ("batch", "seq", "embed"))

    def _resident(self, x: jax.Array, block: int, interpret: bool) -> jax.Array:
        """The same attention with q, k, v and its output as [B, T, H * head_dim], the resident kernel's layout:
        the weights are reshaped instead of the activations (on TPU [.., H, 64] and [.., H * 64] are tiled
        differently, and a reshape between them is a copy of the whole activation)."""
        dt = x.dtype
        d, _, h, hd = self.qkv_kernel.shape
        qkv = jnp.einsum("btd,dkf->kbtf", x, self.qkv_kernel[...].astype(dt).reshape(d, 3, h * hd))
        qkv = qkv + self.qkv_bias[...].astype(dt).reshape(3, 1, 1, h * hd)
        q, k, v = (constrain(t, ("batch", "seq", "heads")) for t in qkv)
        # The kernel does not scale q itself (1/8 at head_dim 64: exact in bf16).
        y = attention_lib.resident(q * jnp.asarray(hd ** -0.5, dt), k, v, hd, block=block, interpret=interpret)
        y = constrain(y, ("batch", "seq", "heads"))
        out = jnp.einsum("btf,fd->btd", y, self.out_kernel[...].astype(dt).reshape(h * hd, d))
        return constrain(out + self.out_bias[...].astype(dt), ("batch", "seq", "embed"))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.ff
        self.fc_kernel = _param(rngs, normal(0.02), (d, f), ("embed", "mlp"))
        self.fc_bias = _param(rngs, jax.nn.initializers.zeros, (f,), ("mlp",))
        self.proj_kernel = _param(rngs, normal(0.02 / math.sqrt(2 * cfg.n_layer)), (f, d), ("mlp", "embed"))
        self.proj_bias = _param(rngs, jax.nn.initializers.zeros, (d,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        h = x @ self.fc_kernel[...].astype(dt) + self.fc_bias[...].astype(dt)
        h = constrain(jax.nn.gelu(h, approximate=True), ("batch", "seq", "mlp"))
        out = h @ self.proj_kernel[...].astype(dt) + self.proj_bias[...].astype(dt)
        return constrain(out, ("batch", "seq", "embed"))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.rate = cfg.dropout
        self.ln1 = LayerNorm(cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.d_model, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, keep: tuple[jax.Array | None, jax.Array | None],
                 attention: str = attention_lib.XLA, kernel: attention_lib.Kernel = attention_lib.Kernel()) -> jax.Array:
        x = x + dropout(self.attn(self.ln1(x), attention, kernel), self.rate, keep[0])
        return x + dropout(self.mlp(self.ln2(x)), self.rate, keep[1])


class GPT2(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = _param(rngs, normal(0.02), (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"))
        self.wpe = _param(rngs, normal(0.01), (cfg.seq_len, cfg.d_model), ("seq", "embed"))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.d_model, rngs)

    def hidden(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None, dtype=jnp.float32,
               vocab_parallel: bool = False, attention: str = attention_lib.XLA, remat: str = "none",
               table: jax.Array | None = None, kernel: attention_lib.Kernel = attention_lib.Kernel()) -> jax.Array:
        """int tokens [B, T] -> final hidden states [B, T, D] (after ln_f), in the compute dtype.

        vocab_parallel: the table is sharded as vocab_parallel.TABLE (look up by its shard_map).
        table: the embedding to look up in (default wte; `loss` passes xent.per_shard's copies of it).
        attention: a resolved implementation (attention.resolve); kernel: how splash runs (attention.Kernel);
        remat: a policy of trainer/models/remat.py.
        """
        cfg = self.cfg
        b, t = tokens.shape
        keep = [None] * (2 * cfg.n_layer + 1)
        if dropout_key is not None and cfg.dropout > 0:
            # Every dropout mask of the step in one draw: one RNG kernel to compile instead of 2L+1.
            masks = keep_masks(dropout_key, cfg.dropout, (len(keep), b, t, cfg.d_model))
            keep = list(constrain(masks, (None, "batch", "seq", "embed")))
        wte = self.wte[...] if table is None else table
        x = vocab_parallel_lib.lookup(wte, tokens) if vocab_parallel else xent.lookup(wte, tokens)
        x = x + self.wpe[...][:t]
        x = constrain(dropout(x, cfg.dropout, keep[-1]).astype(dtype), ("batch", "seq", "embed"))
        for i, block in enumerate(self.blocks):
            x = remat_lib.layer(block, remat, attention=attention, kernel=kernel)(x, (keep[2 * i], keep[2 * i + 1]))
        return self.ln_f(x)

    def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None,
                 dtype=jnp.float32) -> jax.Array:
        """int tokens [B, T] -> f32 logits [B, T, padded_vocab], padded entries at -inf-ish."""
        # Tied embeddings; f32 logits whatever the compute dtype (the loss is f32); padding rows exist for
        # speed only and are never predicted.
        x = self.hidden(tokens, dropout_key=dropout_key, dtype=dtype)
        return xent.logits(x, self.wte[...], self.cfg.vocab_size)

    def loss(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None, dtype=jnp.float32,
             vocab_parallel: bool = False, loss_chunk: int = 0, attention: str = attention_lib.XLA,
             remat: str = "none", table_grads: str = "once", logits: str = "float32",
             kernel: attention_lib.Kernel = attention_lib.Kernel(),
             loss_kernel: xent_kernel.Kernel | None = None) -> jax.Array:
        """Mean next-token cross-entropy (f32) of int tokens [B, T+1]: inputs [:, :-1], targets [:, 1:].

        loss_chunk: sequence positions whose logits are computed at once (0: all of them, as [B, T, V]).
        table_grads: "once" (the table once per batch shard, xent.per_shard) or "per-use" (one table).
        logits: "float32", or "compute": the chunked loss's logits written in the compute dtype.
        loss_kernel: the output layer and loss as xent_kernel's Pallas kernels (no logit in HBM), where one
        device's tokens and the table tile into their blocks; None (or shapes that do not tile): XLA's, chunked."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if vocab_parallel:
            x = self.hidden(inputs, dropout_key=dropout_key, dtype=dtype, vocab_parallel=True, attention=attention,
                            remat=remat, kernel=kernel)
            return vocab_parallel_lib.xent(x, self.wte[...], targets, self.cfg.vocab_size, loss_chunk)
        # The tied table once per batch shard: its lookup's and output layer's gradients are added on each
        # device and reduced over the batch once (over DCN too, on several slices), not once per use.
        shards = xent.batch_shards(inputs.shape[0]) if table_grads == "once" else 1
        table = xent.per_shard(self.wte[...], shards) if shards > 1 else self.wte[...]
        x = self.hidden(inputs, dropout_key=dropout_key, dtype=dtype, attention=attention, remat=remat, table=table,
                        kernel=kernel)
        if loss_kernel is not None and xent_kernel.fits(x.shape, table.shape, loss_kernel):
            return xent_kernel.loss(x, table, targets, self.cfg.vocab_size, loss_kernel)
        if loss_chunk:
            return xent.chunked(x, table, targets, loss_chunk, self.cfg.vocab_size, None, logits == "compute")
        return loss_fn(xent.logits(x, table, self.cfg.vocab_size), targets)


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in f32."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def abstract(cfg: ModelConfig):
    """(graphdef, abstract param state) without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: GPT2(cfg, nnx.Rngs(0))))


def param_shardings(cfg: ModelConfig, mesh, rules: dict = RULES) -> dict:
    """Pure-dict tree of NamedShardings, one per parameter, from its logical `axes` through `rules`."""
    _, state = abstract(cfg)
    return nnx.to_pure_dict(state, extract_fn=lambda v: sharding(mesh, v.get_metadata().get("axes"), rules))


def param_axes(cfg: ModelConfig) -> dict:
    """Pure-dict tree of each parameter's logical axes (tuples are leaves only via is_leaf)."""
    _, state = abstract(cfg)
    return nnx.to_pure_dict(state, extract_fn=lambda v: v.get_metadata().get("axes"))


def init_params(cfg: ModelConfig, seed: int, mesh, rules: dict = RULES) -> dict:
    """f32 params as a pure dict, created directly in their shardings (no host copy, no replication)."""
    def init():
        return nnx.to_pure_dict(nnx.state(GPT2(cfg, nnx.Rngs(seed)), nnx.Param))
    return jax.jit(init, out_shardings=param_shardings(cfg, mesh, rules))()


def count_params(params: dict) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
