"""Next-token cross-entropy of a tied output layer, computed a chunk of sequence positions at a time.

The full output layer of a step is [B, T, V] f32 logits (for GPT-2's 50k vocabulary and 8 x 1024 tokens per
device, 1.65 GB a copy), and autodiff keeps it for the backward pass. Here the positions are split into
chunks of `chunk`, and the gradients are computed in the same pass as the loss (a custom VJP): for each chunk a
scan computes its logits, their log-sum-exp and target logit, d loss / d logits = (softmax - onehot) / N, the
chunk's hidden-state gradient and its share of the table's gradient, and drops the logits. So at most one
chunk's logits are alive at once, the logits are computed once (no recompute in a backward pass: the same three
output-layer matmuls per token as the full logits' forward and backward), and the backward pass only scales the
saved gradients by the loss's cotangent. Without soft-capping (GPT-2) each chunk's f32 logits are read twice
after their matmul writes them (`_one_pass`): by the dx matmul, which also yields the softmax's sum, and by the
table's gradient.

The table's gradient accumulates in the carry per batch shard ([shards, V, D], each device adding only its own
rows' contribution): summed over the shards once after the loop, not all-reduced every chunk. Given the table
once per batch shard (`per_shard`: a tied embedding's lookup uses the same copies), that sum is left to the
copies' transpose, so the lookup's gradient is added to it on each device first and the table's gradient is
reduced over the batch once per step, not once per use (across slices: once over DCN).

Numerically the same loss and gradients as `gpt2.loss_fn` on the full logits (tests compare them); only
the order of the final sum over tokens differs.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from trainer.common import scans
from trainer.common.mesh import RULES, fitted_spec


def _constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fitted_spec(axes, x.shape, dict(mesh.shape)))


def per_shard(table: jax.Array, shards: int) -> jax.Array:
    """The table [V, D] once per batch shard, [shards, V, D] with axis 0 over the batch's mesh axes: each device
    holds its own shard's copy (the replicated table's bytes, nothing sent). Every use of the copies on a device
    (a tied embedding's lookup and output layer: `lookup`, `logits`, `chunked`) adds its gradient there, and the
    broadcast's transpose reduces the sum over the batch once."""
    return _constrain(jnp.broadcast_to(table[None], (shards, *table.shape)), ("batch", "vocab", "embed"))


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """table[tokens] for int tokens [B, T]: from a table [V, D], or per batch shard from per_shard's copies."""
    if table.ndim == 2:
        return jnp.take(table, tokens, axis=0)
    s, (b, t) = table.shape[0], tokens.shape
    rows = jax.vmap(lambda w, ids: jnp.take(w, ids, axis=0))(table, tokens.reshape(s, b // s, t))
    return rows.reshape(b, t, table.shape[-1])


def _matmul_out(x: jax.Array, w: jax.Array, out=jnp.float32) -> jax.Array:
    """x [B, T, D] @ w.T in `out`: w [V, D], or per batch shard [s, V, D] (x's rows split into s blocks)."""
    if w.ndim == 2:
        return jnp.einsum("btd,vd->btv", x, w, preferred_element_type=out)
    s, (b, t, d) = w.shape[0], x.shape
    out = jnp.einsum("sbtd,svd->sbtv", x.reshape(s, b // s, t, d), w, preferred_element_type=out)
    return out.reshape(b, t, w.shape[1])


def _matmul_in(dz: jax.Array, w: jax.Array) -> jax.Array:
    """f32 dz [B, T, V] @ w: w [V, D], or per batch shard [s, V, D]."""
    if w.ndim == 2:
        return jnp.einsum("btv,vd->btd", dz, w, preferred_element_type=jnp.float32)
    s, (b, t, v) = w.shape[0], dz.shape
    out = jnp.einsum("sbtv,svd->sbtd", dz.reshape(s, b // s, t, v), w, preferred_element_type=jnp.float32)
    return out.reshape(b, t, w.shape[2])


def logits(x: jax.Array, table: jax.Array, vocab_size: int | None = None, softcap: float | None = None) -> jax.Array:
    """f32 logits x @ table.T of hidden states [B, T, D] in the compute dtype (the table cast to it; [V, D] or
    per_shard's copies); rows at and past vocab_size are padding (never predicted: -1e9); softcap: tanh
    soft-capping (Gemma)."""
    out = _matmul_out(x, table.astype(x.dtype))
    out = _constrain(out, ("batch", "seq", "vocab"))
    if softcap is not None:
        out = jnp.tanh(out / softcap) * softcap
    v = table.shape[-2]
    if vocab_size is not None and vocab_size != v:
        out = jnp.where(jnp.arange(v) < vocab_size, out, -1e9)
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


def batch_shards(batch: int) -> int:
    """How many ways the mesh splits the batch (the "batch" rule's axes), when they divide it; 1 off a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    axes = RULES["batch"] if isinstance(RULES["batch"], tuple) else (RULES["batch"],)
    n = math.prod(dict(mesh.shape).get(a, 1) for a in axes)
    return n if batch % n == 0 else 1


def _one_pass(xc, tc, wc, w, w1, logits_of, scale):
    """One chunk's summed loss, d loss / d logits (compute dtype) and dx, reading its f32 logits three times:
    written by their matmul (which also takes each row's max), read by the dx matmul and by the table's gradient.

    Softmax's sum comes out of the dx matmul: e = exp(logits - max) times the table with a column of ones (w1)
    is [e @ table, sum(e)], so dx = (e @ table) / sum(e) - table[target], all over the token count, and no pass
    of its own sums the exponentials. The target's logit is x . table[target] (a gather of table rows, not of
    logits). e enters the matmul in the compute dtype, as d loss / d logits always did: on TPU the sum of a
    row's exponentials is rounded per term to bf16 (8 bits; errors of either sign, ~1e-3 of a token's loss at
    worst), in f32 elsewhere. wc: each position's weight [B, c] or None; scale: _scale's."""
    lg = logits_of(xc)
    top = jnp.max(lg, axis=-1)
    r = _matmul_in(jnp.exp(lg - top[..., None]).astype(xc.dtype), w1)
    d = xc.shape[-1]
    norm = r[..., d]
    rows = lookup(w, tc)
    dxc = ((r[..., :d] / norm[..., None] - rows) * scale).astype(xc.dtype)
    logz = top + jnp.log(norm)
    picked = jnp.einsum("btd,btd->bt", xc, rows, preferred_element_type=jnp.float32)
    # d loss / d logits = (softmax - onehot) / total; padding columns get exp(-1e9 - logz) = 0.
    dz = jnp.exp(lg - logz[..., None])
    dz = jnp.where(jnp.arange(lg.shape[-1]) == tc[..., None], dz - 1.0, dz) * scale
    return _weighted_sum(logz - picked, wc), dz.astype(xc.dtype), dxc


def _weighted_sum(ce: jax.Array, wc: jax.Array | None) -> jax.Array:
    return jnp.sum(ce if wc is None else ce * wc)


def _scale(wc: jax.Array | None, total: int):
    """What d loss / d logits of each position is multiplied by: its weight (1 without weights) over the count."""
    return (1.0 if wc is None else wc[..., None]) / total


def _chunks(x, table, targets, chunk: int, vocab_size: int | None, softcap: float | None, grads: bool,
            narrow: bool = False, weights: jax.Array | None = None, table_grads: bool = True):
    """The summed-then-averaged loss over chunks of positions, and with grads its (dx, dtable). narrow: each
    chunk's logits written in the compute dtype (the softmax still computed in f32 from them). weights [B, T]:
    the loss is the weighted sum instead (not averaged). table_grads=False: dtable is None (a frozen table: its
    gradient is neither accumulated nor held)."""
    b, t, d = x.shape
    c = chunk_of(chunk, t)
    n, total = t // c, (b * t if weights is None else 1)
    # [n, B, c, D]: the batch stays on its devices, each scan step takes one block of positions.
    xs = _constrain(x.reshape(b, n, c, d).swapaxes(0, 1), (None, "batch", "seq", "embed"))
    ts = _constrain(targets.reshape(b, n, c).swapaxes(0, 1), (None, "batch", "seq"))
    ws = None if weights is None else _constrain(weights.reshape(b, n, c).swapaxes(0, 1), (None, "batch", "seq"))
    w = table.astype(x.dtype)
    shared = table.ndim == 3  # per_shard's copies: their gradient stays per shard
    s, v = (table.shape[0] if shared else batch_shards(b)), table.shape[-2]

    def logits_of(xc):
        """A chunk's f32 logits (softcap not applied), padding columns at -1e9."""
        z = _constrain(_matmul_out(xc, w, x.dtype if narrow else jnp.float32), ("batch", "seq", "vocab"))
        z = z.astype(jnp.float32)  # a no-op, or a convert fused into each reader of the narrow logits
        return z if vocab_size is None or vocab_size == v else jnp.where(jnp.arange(v) < vocab_size, z, -1e9)

    def chunk_loss(xc, tc, wc):
        z = logits_of(xc)
        capped = jnp.tanh(z / softcap) if softcap is not None else None
        lg = capped * softcap if softcap is not None else z
        # The row's max comes out of the logits' matmul (fused into it); one more pass over the logits takes
        # the sum of exponentials and the target's logit together. A gather of the target (take_along_axis)
        # would be a pass of its own: the TPU compiler keeps it apart from the reduction.
        top = jnp.max(lg, axis=-1)
        logz = top + jnp.log(jnp.sum(jnp.exp(lg - top[..., None]), axis=-1))
        picked = jnp.sum(jnp.where(jnp.arange(v) == tc[..., None], lg, 0.0), axis=-1)  # one term: exact
        return _weighted_sum(logz - picked, wc), lg, logz, capped

    if not grads:
        def step(acc, xt):
            return acc + chunk_loss(*xt)[0], None
        loss, _ = scans.scan(step, jnp.zeros((), jnp.float32), (xs, ts, ws))
        return loss / total

    def step(carry, xt):
        acc, dtable = carry
        xc, tc, wc = xt
        if softcap is None:
            lc, dz, dxc = _one_pass(xc, tc, wc, w, w1, logits_of, _scale(wc, total))
        else:
            lc, lg, logz, capped = chunk_loss(xc, tc, wc)
            # d loss / d logits = (softmax - onehot) / total; padding columns get exp(-1e9 - logz) = 0.
            dz = jnp.exp(lg - logz[..., None])
            dz = jnp.where(jnp.arange(v) == tc[..., None], dz - 1.0, dz) * _scale(wc, total)
            dz = (dz * (1.0 - jnp.square(capped))).astype(x.dtype)
            dxc = _matmul_in(dz, w).astype(x.dtype)
        if not table_grads:
            return (acc + lc, dtable), dxc
        # Each batch shard's contribution to the table's gradient stays on its devices: [s, V, D].
        dzs = dz.reshape(s, dz.shape[0] // s, *dz.shape[1:])
        xcs = xc.reshape(s, xc.shape[0] // s, *xc.shape[1:])
        part = jnp.einsum("sbtv,sbtd->svd", dzs, xcs, preferred_element_type=jnp.float32)
        return (acc + lc, dtable + _constrain(part, ("batch", "vocab", "embed"))), dxc

    # The table with a column of ones: one matmul gives a chunk's unnormalised dx and its softmax's sum.
    w1 = jnp.concatenate([w, jnp.ones((*w.shape[:-1], 1), w.dtype)], axis=-1) if softcap is None else None
    zero = (jnp.zeros((), jnp.float32),
            _constrain(jnp.zeros((s, *table.shape[-2:]), jnp.float32), ("batch", "vocab", "embed"))
            if table_grads else None)
    (loss, dtable), dxs = scans.scan(step, zero, (xs, ts, ws))
    dx = dxs.swapaxes(0, 1).reshape(b, t, d)
    if not table_grads:
        return loss / total, dx, None
    return loss / total, dx, (dtable if shared else dtable.sum(0)).astype(table.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 8))
def chunked(x: jax.Array, table: jax.Array, targets: jax.Array, chunk: int, vocab_size: int | None = None,
            softcap: float | None = None, narrow: bool = False, weights: jax.Array | None = None,
            table_grads: bool = True) -> jax.Array:
    """Mean cross-entropy (f32) of hidden states x [B, T, D] against int targets [B, T], never holding more
    than one chunk of positions' logits (chunk_of(chunk, T) of them); its gradients come from the same pass.
    table: [V, D], or per_shard's copies [s, V, D] (their gradient left per shard). narrow: the logits in the
    compute dtype (_chunks). weights [B, T] (f32): the weighted sum of the positions' cross-entropies instead
    of the mean (LoRA's loss mask; the caller divides). table_grads=False: a frozen table (LoRA's base): its
    gradient is zero, never computed."""
    return _chunks(x, table, targets, chunk, vocab_size, softcap, grads=False, narrow=narrow, weights=weights)


def _chunked_fwd(x, table, targets, chunk, vocab_size, softcap, narrow, weights, table_grads):
    loss, dx, dtable = _chunks(x, table, targets, chunk, vocab_size, softcap, grads=True, narrow=narrow,
                               weights=weights, table_grads=table_grads)
    return loss, (dx, dtable, table)


def _chunked_bwd(chunk, vocab_size, softcap, narrow, table_grads, res, g):
    dx, dtable, table = res
    dtable = dtable * g if table_grads else jnp.zeros_like(table)
    return (dx * g).astype(dx.dtype), dtable, None, None


chunked.defvjp(_chunked_fwd, _chunked_bwd)
