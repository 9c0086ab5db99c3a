"""The tied embedding's two uses, with its vocabulary sharded over EVERY device of the mesh.

With data parallelism alone each device holds the whole [V, D] table: every step all-reduces its full
gradient and every device runs the same optimizer update on it, and each device's output matmul has a
small contraction (its share of the tokens) and a huge output. Here device i of n holds vocab rows
[i*V/n, (i+1)*V/n) instead. The activations are moved, not the table:
- lookup: every device gathers the ids of the global batch, looks up the rows it holds (zeros elsewhere)
  and a reduce-scatter sums those partial embeddings back to each device's batch share;
- output + loss: every device gathers the final hidden states of the global batch ([B, T, D], small
  next to [V, D] while B*T < V), computes logits for its vocab slice, and the softmax statistics of the
  slices are combined with one all-gather of three numbers per token. The gradients are computed in the
  same pass (a custom VJP): [B, T, V] logits are never kept for a backward pass, the table's gradient
  stays on its device, and the hidden states' gradient is reduce-scattered.

Numerically the same cross-entropy as `gpt2.loss_fn` on full logits (tests compare them).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trainer.common import scans
from trainer.common.mesh import VOCAB_PARALLEL_RULES
from trainer.models.xent import chunk_of

# The axes come from the sharding rules (trainer/common/mesh.py), written once there: the batch's axis, and the vocab
# rows over every axis, the batch's first (data-major).
# The batch's axes are (dcn, data): collectives over DATA run over both (dcn has size 1 on one slice).
DATA = VOCAB_PARALLEL_RULES["batch"]
_DATA_AXES = DATA if isinstance(DATA, tuple) else (DATA,)
ALL = tuple(VOCAB_PARALLEL_RULES["vocab"])
MODEL = next(a for a in ALL if a not in _DATA_AXES)
assert ALL == (*_DATA_AXES, MODEL), ALL
TABLE = P(ALL, None)
ACTS = P(DATA, None, None)
IDS = P(DATA, None)
NEG = -1e30  # the padding rows' logit bias: finite, so that a slice of padding only gives no inf - inf


def _shard_start(rows: int) -> jax.Array:
    """First vocab id of this device's slice (inside shard_map)."""
    return (jax.lax.axis_index(DATA) * jax.lax.axis_size(MODEL) + jax.lax.axis_index(MODEL)) * rows


def _local_rows(ids: jax.Array, start: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(row of each id in this device's slice, clipped into range; whether the slice holds that id)."""
    rel = ids - start
    return jnp.clip(rel, 0, rows - 1), (rel >= 0) & (rel < rows)


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids]: [V, D] sharded as TABLE, int [B, T] sharded over data -> [B, T, D] sharded over data."""
    def local(table, ids):
        ids = jax.lax.all_gather(ids, DATA, tiled=True)  # the global batch's ids: B*T int32, small
        rel, mine = _local_rows(ids, _shard_start(table.shape[0]), table.shape[0])
        rows = jnp.where(mine[..., None], jnp.take(table, rel, axis=0), 0)
        rows = jax.lax.psum_scatter(rows, DATA, scatter_dimension=0, tiled=True)
        return jax.lax.psum(rows, MODEL)
    return jax.shard_map(local, in_specs=(TABLE, IDS), out_specs=ACTS)(table, ids)


def _over_chunks(fn, x, per_token: tuple, chunk: int, with_grads: bool, summed: tuple = ()):
    """Inside shard_map: fn over chunks of sequence positions (chunk 0: all at once), so one chunk's logits exist
    at a time. fn(x [b, c, D], *per_token's [b, c, ...]) -> the chunk's loss, or with grads (loss, dx [b, c, D],
    *grads summed over the chunks, of the shapes `summed`); the losses add up, each chunk's dx is its own."""
    b, t, d = x.shape
    c = chunk_of(chunk, t)
    if c == t:
        return fn(x, *per_token)
    split = lambda a: a.reshape(b, t // c, c, *a.shape[2:]).swapaxes(0, 1)  # noqa: E731  [chunks, b, c, ...]
    xs = (split(x), *(split(a) for a in per_token))
    if not with_grads:
        def loss_only(acc, xt):
            return acc + fn(*xt), None
        return scans.scan(loss_only, jnp.zeros((), jnp.float32), xs)[0]

    def body(carry, xt):
        lc, dx, *grads = fn(*xt)
        return (carry[0] + lc, *(acc + g for acc, g in zip(carry[1:], grads))), dx
    zero = (jnp.zeros((), jnp.float32), *(jnp.zeros(shape, jnp.float32) for shape in summed))
    (loss, *grads), dxs = scans.scan(body, zero, xs)
    return (loss, dxs.swapaxes(0, 1).reshape(b, t, d), *grads)


def _local_xent(x, table, targets, vocab_size: int, with_grads: bool, chunk: int):
    """Inside shard_map: mean cross-entropy of the global batch, and optionally (dx, dtable) for it, a chunk
    of sequence positions at a time (0: all at once): [V/n_dev, tokens] logits of one chunk at a time; the
    table's gradient accumulates over the chunks."""
    n_total = x.shape[0] * x.shape[1] * jax.lax.axis_size(DATA)
    return _over_chunks(lambda xc, tc: _chunk_xent(xc, table, tc, vocab_size, with_grads, n_total), x, (targets,),
                        chunk, with_grads, (table.shape,))


def _chunk_xent(x, table, targets, vocab_size: int, with_grads: bool, n_total: int):
    """Inside shard_map: the summed cross-entropy of the global batch's tokens at these positions, divided by
    n_total (the whole batch's tokens), and optionally (dx, dtable) of that.

    Layouts are chosen for the matmuls (measured, bench/peers/explore.py): logits [vocab slice, tokens] from
    table @ x^T with x^T materialised (an [N, D] operand read transposed is ~1.4x slower on XLA:CPU), the
    x gradient as table^T @ dlogits = [D, N]. The only full passes over the logits are one max and one
    exp; the target logit, the one-hot part of the gradient and the softmax's per-token scale are
    applied on [tokens, D]-sized arrays instead.
    """
    b, t, d = x.shape
    rows_here = table.shape[0]
    dt = x.dtype
    # [D, N]: hidden states of the global batch, transposed locally (small) before the gather.
    xs_t = jax.lax.all_gather(x.reshape(b * t, d).T, DATA, axis=1, tiled=True)
    xs = xs_t.T  # [N, D]
    ts = jax.lax.all_gather(targets, DATA, tiled=True).reshape(-1)
    n = n_total
    w = table.astype(dt)
    start = _shard_start(rows_here)
    # Padding rows of the table exist for speed only. Their logits get a -1e30 bias through an extra
    # contraction row (table | bias) . (x | 1), so that the max and the exp pass need no mask: XLA
    # materialises a [V/n_dev, N] broadcast for a masked reduction. 8 rows keep K a multiple of 8.
    bias = jnp.where(start + jnp.arange(rows_here) < vocab_size, 0.0, NEG).astype(dt)
    w_aug = jnp.concatenate([w, bias[:, None], jnp.zeros((rows_here, 7), dt)], axis=1)
    x_aug = jnp.concatenate([xs_t, jnp.ones((1, ts.shape[0]), dt), jnp.zeros((7, ts.shape[0]), dt)], axis=0)
    logits = jnp.einsum("vd,dn->vn", w_aug, x_aug, preferred_element_type=jnp.float32)  # [V/n_dev, N]
    m = jnp.max(logits, axis=0)  # a slice of padding only: ~NEG, and exp(m - top) = 0 drops it below
    e = jnp.exp(logits - m)
    rel, mine = _local_rows(ts, start, rows_here)
    target_rows = jnp.take(w, rel, axis=0)  # [N, D]: the target's embedding, where this slice holds it
    picked = jnp.where(mine, jnp.sum(target_rows.astype(jnp.float32) * xs.astype(jnp.float32), -1), 0.0)
    if with_grads:
        # table^T @ e is needed for dx anyway: a ones column appended to the table makes the same matmul
        # give the softmax denominator too (one read of e fewer than a separate sum).
        # The [D + 8, V/n_dev] operand is built transposed (small): XLA:CPU gives YNNPACK only dots whose lhs
        # contracts its last dim, and its own GEMM took ~1/3 of this function's time on this one.
        e = e.astype(dt)
        ones = jnp.concatenate([jnp.ones((1, rows_here), dt), jnp.zeros((7, rows_here), dt)], axis=0)
        acc = jnp.einsum("dv,vn->dn", jnp.concatenate([w.T, ones], axis=0), e, preferred_element_type=jnp.float32)
        dx_t, e_sum = acc[:d], acc[d]
    else:
        e_sum = e.sum(0)
    stats = jax.lax.all_gather(jnp.stack([m, e_sum, picked]), ALL)  # [n_dev, 3, N]: one collective
    top = stats[:, 0].max(0)
    total = (stats[:, 1] * jnp.exp(stats[:, 0] - top)).sum(0)
    loss = jnp.sum(top + jnp.log(total) - stats[:, 2].sum(0)) / n
    if not with_grads:
        return loss
    # d loss / d logits[v, i] = (softmax[v, i] - onehot[v, i]) / n = e[v, i] * scale[i] - onehot / n.
    scale = jnp.exp(m - top) / (total * n)
    onehot_x = jnp.where(mine[:, None], xs.astype(jnp.float32), 0.0) / n
    dx_t = dx_t * scale
    dx_t = dx_t - jnp.where(mine, target_rows.T.astype(jnp.float32), 0.0) / n
    dx_t = jax.lax.psum(jax.lax.psum_scatter(dx_t, DATA, scatter_dimension=1, tiled=True), MODEL)
    dx = dx_t.T.reshape(b, t, d)
    dtable = jnp.einsum("vn,nd->vd", e, (xs * scale[:, None].astype(dt)), preferred_element_type=jnp.float32)
    dtable = dtable.at[rel].add(-onehot_x)
    return loss, dx.astype(x.dtype), dtable


def _specs(with_grads: bool):
    return dict(in_specs=(ACTS, TABLE, IDS), out_specs=(P(), ACTS, TABLE) if with_grads else P(),
                check_vma=False)  # the loss is computed identically on every device


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def xent(x: jax.Array, table: jax.Array, targets: jax.Array, vocab_size: int, chunk: int = 0) -> jax.Array:
    """Mean next-token cross-entropy (f32) of logits x @ table.T, vocab columns >= vocab_size excluded.

    x [B, T, D] sharded over data, table [V, D] sharded as TABLE, targets int [B, T] sharded over data.
    chunk: sequence positions whose logits are computed at once (0: all of them).
    """
    f = partial(_local_xent, vocab_size=vocab_size, with_grads=False, chunk=chunk)
    return jax.shard_map(f, **_specs(False))(x, table, targets)


def _xent_fwd(x, table, targets, vocab_size, chunk):
    f = partial(_local_xent, vocab_size=vocab_size, with_grads=True, chunk=chunk)
    loss, dx, dtable = jax.shard_map(f, **_specs(True))(x, table, targets)
    return loss, (dx, dtable)


def _xent_bwd(vocab_size, chunk, res, g):
    dx, dtable = res
    return (dx * g.astype(dx.dtype), dtable * g, None)


xent.defvjp(_xent_fwd, _xent_bwd)


# ---- a frozen tied table's loss (LoRA) -------------------------------------------------------------------------
# The same layout (TABLE, ACTS) for a table that gets no gradient: each device computes the logits of its vocab
# rows for the global batch's tokens of one chunk of positions, soft-capped where the model caps them; the softmax's
# max, sum and the target's logit are combined over the shards in one all-gather of three numbers per token; the
# hidden states' gradient, (softmax - onehot) x weight per shard times the shard's rows, is reduce-scattered back to
# each device's rows. Nothing of size [V, D] beyond a device's own rows exists, and no table gradient is formed.


def _frozen_chunk(x, table, targets, weights, softcap: float | None, with_grads: bool):
    """Inside shard_map, one chunk of positions: (sum over the global batch's tokens of weight x cross-entropy,
    and with grads d sum / d x [b, c, D] of this device's rows)."""
    b, c, d = x.shape
    xg = jax.lax.all_gather(x, DATA, axis=0, tiled=True)  # [B, c, D]: the global batch's hidden states, small
    tg = jax.lax.all_gather(targets, DATA, axis=0, tiled=True).reshape(-1)
    wg = jax.lax.all_gather(weights, DATA, axis=0, tiled=True).reshape(-1)
    rows_here = table.shape[0]
    w = table.astype(x.dtype)
    z = jnp.einsum("nd,vd->nv", xg.reshape(-1, d), w, preferred_element_type=jnp.float32)  # [N, V/n_dev]
    capped = jnp.tanh(z / softcap) if softcap is not None else None
    lg = capped * softcap if softcap is not None else z
    rel, mine = _local_rows(tg, _shard_start(rows_here), rows_here)
    target = (jnp.arange(rows_here) == rel[:, None]) & mine[:, None]
    m = jnp.max(lg, axis=-1)
    e_sum = jnp.sum(jnp.exp(lg - m[:, None]), axis=-1)
    picked = jnp.sum(jnp.where(target, lg, 0.0), axis=-1)  # one term on the shard that holds the target, else 0
    stats = jax.lax.all_gather(jnp.stack([m, e_sum, picked]), ALL)  # [n_dev, 3, N]: one collective
    top = stats[:, 0].max(0)
    logz = top + jnp.log((stats[:, 1] * jnp.exp(stats[:, 0] - top)).sum(0))
    loss = jnp.sum((logz - stats[:, 2].sum(0)) * wg)
    if not with_grads:
        return loss
    # d loss / d logits = (softmax - onehot) x the token's weight, through the soft-cap; in the compute dtype for
    # the matmul, as xent.chunked does.
    dz = jnp.exp(lg - logz[:, None])
    dz = jnp.where(target, dz - 1.0, dz) * wg[:, None]
    if softcap is not None:
        dz = dz * (1.0 - jnp.square(capped))
    dx = jnp.einsum("nv,vd->nd", dz.astype(x.dtype), w, preferred_element_type=jnp.float32).reshape(-1, c, d)
    dx = jax.lax.psum(jax.lax.psum_scatter(dx, DATA, scatter_dimension=0, tiled=True), MODEL)
    return loss, dx.astype(x.dtype)


def _local_frozen(x, table, targets, weights, softcap: float | None, chunk: int, with_grads: bool):
    return _over_chunks(lambda xc, tc, wc: _frozen_chunk(xc, table, tc, wc, softcap, with_grads), x,
                        (targets, weights), chunk, with_grads)


def _frozen_specs(with_grads: bool):
    return dict(in_specs=(ACTS, TABLE, IDS, IDS), out_specs=(P(), ACTS) if with_grads else P(),
                check_vma=False)  # the loss is computed identically on every device


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def frozen_xent(x: jax.Array, table: jax.Array, targets: jax.Array, weights: jax.Array,
                softcap: float | None = None, chunk: int = 0) -> jax.Array:
    """Sum over tokens of weight x cross-entropy (f32) of the logits x @ table.T, soft-capped (tanh, Gemma) when
    softcap is given: xent.chunked(..., weights=weights, table_grads=False) with the table sharded by its rows.
    x [B, T, D] sharded over data, table [V, D] sharded as TABLE (every row a real token: no padding), targets
    int [B, T] and weights f32 [B, T] sharded over data. chunk: positions whose logits exist at once (0: all).
    The table and the weights get no gradient."""
    f = partial(_local_frozen, softcap=softcap, chunk=chunk, with_grads=False)
    return jax.shard_map(f, **_frozen_specs(False))(x, table, targets, weights)


def _frozen_fwd(x, table, targets, weights, softcap, chunk):
    f = partial(_local_frozen, softcap=softcap, chunk=chunk, with_grads=True)
    loss, dx = jax.shard_map(f, **_frozen_specs(True))(x, table, targets, weights)
    return loss, (dx, table, weights)


def _frozen_bwd(softcap, chunk, res, g):
    dx, table, weights = res
    return (dx * g.astype(dx.dtype), jnp.zeros_like(table), None, jnp.zeros_like(weights))


frozen_xent.defvjp(_frozen_fwd, _frozen_bwd)


def fits_mesh(vocab: int, mesh) -> bool:
    """Whether a frozen tied table goes by its rows on `mesh`: they split evenly over its devices (more than one),
    on one slice (on several, each chunk's gathers of hidden states would cross DCN; the table then stays as the
    model's rules shard it, gathered over a slice's devices only)."""
    n = mesh.devices.size
    return n > 1 and vocab % n == 0 and dict(mesh.shape).get("dcn", 1) == 1
