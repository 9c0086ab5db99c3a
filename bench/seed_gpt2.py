"""The GPT-2 of the article this project started from (and the notebook it links), rebuilt for comparison only.

Same architecture and train step as the article: nnx.MultiHeadAttention with a (T, T) causal mask built on
every call, LayerNorm(eps=1e-6), Linear+gelu MLP, token+position embeddings, output through the tied token
embedding (`attend`) to the 50257 vocab, a nested @nnx.jit loss_fn under an @nnx.jit train_step that also
updates an nnx Average metric, optax adamw with cosine decay, and a batch put on NamedSharding(mesh,
P('batch', None)) every step. Nothing that changes its speed is fixed, including its two known mistakes:
the model is called with training=False (dropout never runs) and the `nnx.with_partitioning` annotations
are never applied (the model is built outside any mesh). Only API drift is adapted: flax 0.12's
`nnx.Optimizer(..., wrt=nnx.Param)` / `update(model, grads)`, and an Auto-axis mesh (jax 0.10's default
Explicit axes reject the embedding gather; the article was written when Auto was the default), and eager
sharding off while the model is built (flax 0.12 otherwise applies the annotations and demands a mesh).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclass(frozen=True)
class SeedConfig:
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    seq_len: int = 256
    batch_size: int = 16
    vocab_size: int = 50257  # tokenizer.n_vocab in the notebook
    dropout_rate: float = 0.1
    lr: float = 5e-4
    weight_decay: float = 1e-1
    max_steps: int = 600000 * 12 // 72
    dtype: object = jnp.float32  # the bench compares f32 on CPU (the notebook used bf16 on TPU)
    param_dtype: object = jnp.float32


def _part(init, names):
    return nnx.with_partitioning(init, names)


def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, dropout_rate, dtype, param_dtype, rngs: nnx.Rngs):
        ln = lambda: nnx.LayerNorm(
            epsilon=1e-6, num_features=embed_dim,
            scale_init=_part(nnx.initializers.ones_init(), ("model",)),
            bias_init=_part(nnx.initializers.zeros_init(), ("model",)),
            dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        lin = lambda i, o: nnx.Linear(
            in_features=i, out_features=o,
            kernel_init=_part(nnx.initializers.xavier_uniform(), (None, "model")),
            bias_init=_part(nnx.initializers.zeros_init(), ("model",)),
            dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layer_norm1 = ln()
        self.mha = nnx.MultiHeadAttention(
            num_heads=num_heads, in_features=embed_dim,
            kernel_init=_part(nnx.initializers.xavier_uniform(), (None, "model")),
            bias_init=_part(nnx.initializers.zeros_init(), ("model",)),
            dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=dropout_rate)
        self.layer_norm2 = ln()
        self.linear1 = lin(embed_dim, ff_dim)
        self.linear2 = lin(ff_dim, embed_dim)
        self.dropout2 = nnx.Dropout(rate=dropout_rate)

    def __call__(self, inputs, training: bool = False):
        bs, seq_len, emb_sz = inputs.shape
        attention_output = self.mha(
            inputs_q=self.layer_norm1(inputs), mask=causal_attention_mask(seq_len), decode=False)
        x = inputs + self.dropout1(attention_output, deterministic=not training)
        mlp_output = self.linear1(self.layer_norm2(x))
        mlp_output = nnx.gelu(mlp_output)
        mlp_output = self.linear2(mlp_output)
        mlp_output = self.dropout2(mlp_output, deterministic=not training)
        return x + mlp_output


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, seqlen, vocab_size, embed_dim, dtype, param_dtype, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=seqlen, features=embed_dim, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        return self.token_emb, self.token_emb(x) + self.pos_emb(positions)


class GPT2(nnx.Module):
    def __init__(self, cfg: SeedConfig, rngs: nnx.Rngs):
        self.embedding_layer = TokenAndPositionEmbedding(cfg.seq_len, cfg.vocab_size, cfg.d_model,
                                                         cfg.dtype, cfg.param_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(rate=cfg.dropout_rate)
        self.transformer_blocks = nnx.List([
            TransformerBlock(cfg.d_model, cfg.n_head, 4 * cfg.d_model, cfg.dropout_rate,
                             cfg.dtype, cfg.param_dtype, rngs=rngs)
            for _ in range(cfg.n_layer)])
        self.layer_norm = nnx.LayerNorm(
            epsilon=1e-6, num_features=cfg.d_model,
            scale_init=_part(nnx.initializers.ones_init(), ("model",)),
            bias_init=_part(nnx.initializers.zeros_init(), ("model",)),
            dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        token_embedding, x = self.embedding_layer(inputs)
        x = self.dropout(x, deterministic=not training)
        for transformer_block in self.transformer_blocks:
            x = transformer_block(x, training=training)
        x = self.layer_norm(x)
        return token_embedding.attend(x)  # weights tying


@nnx.jit
def loss_fn(model, batch):
    logits = model(batch[0])  # the article's call: training=False, so its dropout never runs
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


@nnx.jit
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, metrics, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, lables=batch[1])
    optimizer.update(model, grads)


class SeedTrainer:
    """The notebook's objects and loop body: `step(x, y)` does one device_put + train_step, then waits."""

    def __init__(self, cfg: SeedConfig, devices=None):
        self.cfg = cfg
        devices = devices if devices is not None else jax.devices()
        n = len(devices)
        self.mesh = jax.make_mesh((n, 1), ("batch", "model"), devices=devices,
                                  axis_types=(jax.sharding.AxisType.Auto,) * 2)
        # flax 0.12 would apply the annotations eagerly (and demand a mesh); the article's flax did not.
        with nnx.use_eager_sharding(False):
            self.model = GPT2(cfg, rngs=nnx.Rngs(0))
        schedule = optax.cosine_decay_schedule(init_value=cfg.lr, decay_steps=cfg.max_steps)
        tx = optax.chain(optax.adamw(learning_rate=schedule, weight_decay=cfg.weight_decay))
        self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
        self.metrics = nnx.metrics.Average("loss")
        self.sharding = NamedSharding(self.mesh, P("batch", None))

    def n_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self.model, nnx.Param)))

    def step(self, x, y) -> None:
        train_step(self.model, self.optimizer, self.metrics, jax.device_put((x, y), self.sharding))
        jax.block_until_ready(nnx.state(self.optimizer))

    def loss(self) -> float:
        return float(self.metrics.compute())
