"""Next-token cross-entropy of a tied output layer, computed a chunk of sequence positions at a time.

The full output layer of a step is [B, T, V] f32 logits (for GPT-2's 50k vocabulary and 8 x 1024 tokens per
device, 1.65 GB a copy), and autodiff keeps it for the backward pass. Here the positions are split into
chunks of `chunk`; a scan computes each chunk's logits, its log-sum-exp and target logit, and drops them.
The chunk body is under `jax.checkpoint` with nothing saved: the backward pass recomputes one chunk's logits
at a time (one extra output matmul per chunk) and the [V, D] gradient accumulates in the scan's carry. So at
most one chunk's logits are alive at once, forward or backward.

Numerically the same loss and gradients as `gpt2.loss_fn` on the full logits (tests compare them); only
the order of the final sum over tokens differs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.common.mesh import fitted_spec


def _constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fitted_spec(axes, x.shape, dict(mesh.shape)))


def logits(x: jax.Array, table: jax.Array, vocab_size: int | None = None, softcap: float | None = None) -> jax.Array:
    """f32 logits x @ table.T of hidden states [B, T, D] in the compute dtype (the table cast to it); rows at
    and past vocab_size are padding (never predicted: -1e9); softcap: tanh soft-capping (Gemma)."""
    out = jnp.einsum("btd,vd->btv", x, table.astype(x.dtype), preferred_element_type=jnp.float32)
    out = _constrain(out, ("batch", "seq", "vocab"))
    if softcap is not None:
        out = jnp.tanh(out / softcap) * softcap
    if vocab_size is not None and vocab_size != table.shape[0]:
        out = jnp.where(jnp.arange(table.shape[0]) < vocab_size, out, -1e9)
    return out


def token_xent(lg: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy [B, T] (f32) of logits [B, T, V]."""
    logz = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, targets[..., None], axis=-1)[..., 0]
    return logz - picked


def chunk_of(chunk: int, seq_len: int) -> int:
    """The chunk length used for sequences of seq_len: the whole sequence when chunk is 0 or >= seq_len, else
    the largest divisor of seq_len not above chunk (chunks are equal: one scan body)."""
    if chunk <= 0 or chunk >= seq_len:
        return seq_len
    return max(c for c in range(1, chunk + 1) if seq_len % c == 0)


def chunked(x: jax.Array, table: jax.Array, targets: jax.Array, chunk: int, vocab_size: int | None = None,
            softcap: float | None = None) -> jax.Array:
    """Mean cross-entropy (f32) of hidden states x [B, T, D] against int targets [B, T], never holding more
    than one chunk of positions' logits (chunk_of(chunk, T) of them)."""
    b, t, d = x.shape
    c = chunk_of(chunk, t)
    n = t // c
    # [n, B, c, D]: the batch stays on its devices, each scan step takes one block of positions.
    xs = _constrain(x.reshape(b, n, c, d).swapaxes(0, 1), (None, "batch", "seq", "embed"))
    ts = _constrain(targets.reshape(b, n, c).swapaxes(0, 1), (None, "batch", "seq"))

    @jax.checkpoint  # nothing saved: the chunk's logits are recomputed in the backward pass, not kept
    def body_sum(table, xc, tc):
        return jnp.sum(token_xent(logits(xc, table, vocab_size, softcap), tc))

    def step(total, xt):
        return total + body_sum(table, *xt), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (xs, ts))
    return total / (b * t)
