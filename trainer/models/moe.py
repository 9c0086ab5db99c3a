"""Gemma 4's routed experts (26B-A4B): a router picks top_k of n experts per token, each a gated-GELU MLP.

The router reads the layer's normalised input again normalised without a scale, times router_scale / sqrt(D);
its softmax over all experts, renormalised over the chosen top_k, weighs their outputs, each also scaled by its
per_expert_scale. Tokens are sorted by expert and run through jax.lax.ragged_dot (one group per expert), so an
expert computes only the rows routed to it: the cost is top_k experts per token, not n.

Expert parallelism: the experts' dimension carries the logical axis `expert` (trainer/common/mesh.py RULES), so
on a mesh whose expert axes divide n each device keeps n / shards experts whole and reads only those. The tokens
travel to them (`parallel`): inside a shard_map each device routes its own tokens, the tokens and their routing
are all-gathered over the expert axes, each device runs the rows routed to its experts, and the outputs are
reduce-scattered back to the devices the tokens came from. A device's rows are a static buffer: dropless needs
the worst case (every routed token on one device's experts: `shards` times the even share), so a run may bound
it at `capacity` times the even share (GemmaConfig.expert_capacity); a device's assignments beyond it, in
expert order, are dropped (their weighted output left out of the token's sum). capacity 0 is dropless. Where
the expert axes do not divide n (or there is no mesh), every device holds every expert (`replicated`).
Beside its output, a layer's experts count what they dropped (`Drops`): a run's step sums them over its layers
and logs the fraction of its assignments dropped (trainer/finetune/train.py).

Parameters (our layout, Kaggle's flax one): router [D, E], router_scale [D], expert_scale [E],
experts_gating [E, 2, Fe, D] (gate, up), experts_linear [E, Fe, D].
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trainer.common.mesh import fitted_spec

# adapter(name, input rows [N, in], output rows [N, out], group_sizes [E]) -> output rows: an expert's LoRA
Adapter = Callable[[str, jax.Array, jax.Array, jax.Array], jax.Array]
# int32 [2]: (assignments dropped, assignments routed) of a layer's experts (every device's, over the step's tokens),
# or summed over layers
Drops = jax.Array
EXPERT = "expert"                       # the experts' logical axis
TOKENS = ("batch", "residual_seq", None)  # the experts' input [B, T, D] as the layer holds it (gemma.RESIDUAL)


def route(x: jax.Array, router: jax.Array, router_scale: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] f32, expert ids [N, k]) for rows x [N, D]."""
    xf = x.astype(jnp.float32)
    r = (x * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + 1e-6).astype(x.dtype))
    r = r * jax.lax.rsqrt(jnp.asarray(x.shape[-1], x.dtype)) * router_scale.astype(x.dtype)
    logits = (r @ router.astype(x.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    _, ids = jax.lax.top_k(logits, top_k)  # exact (the reference's approx_max_k is exact off TPU)
    chosen = jnp.take_along_axis(probs, ids, axis=-1)
    total = jnp.sum(chosen, axis=-1, keepdims=True)
    return chosen / jnp.where(total > 0, total, 1.0), ids


def expert_axes(n_experts: int, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes the experts' dimension is split over (empty: every device holds every expert)."""
    m = fitted_spec((EXPERT,), (n_experts,), mesh_shape)[0]
    return (m,) if isinstance(m, str) else tuple(m or ())


def capacity_rows(n_rows: int, top_k: int, n_experts: int, shards: int, capacity: float) -> int:
    """The rows one device's experts take of n_rows gathered tokens: the worst case (each token's top_k on this
    device's experts, at most one assignment an expert) when capacity is 0, else capacity x the even share
    (n_rows x top_k / shards), rounded up to a multiple of 8 and never above the worst case."""
    worst = n_rows * min(top_k, n_experts // shards)
    if capacity <= 0:
        return worst
    return min(worst, 8 * math.ceil(capacity * n_rows * top_k / shards / 8))


def _mlp(rows: jax.Array, gating: jax.Array, linear: jax.Array, groups: jax.Array, ad: Adapter,
         ad_groups: jax.Array, row_weights: jax.Array | None = None) -> jax.Array:
    """The experts' gated-GELU MLP on rows [N, D] grouped by expert (groups [E'] over gating's E' experts;
    ad_groups: the same rows' groups over the adapters' experts) -> [N, D], each row times row_weights [N] when
    given (applied to the hidden rows, [N, Fe], before the down projection and its adapter: both are linear in
    them, and the hidden rows are a quarter of the output's width).
    Gate and up are one ragged dot (two dots over the weights as stored, contracted on D, gave the backward a
    second [N, D] gradient of the rows and their sum; padding each half to a multiple of 128 lanes, so the split
    is a slice, moved a relayout copy of the stacked experts into the scan on v4: docs/gemma.md)."""
    dt = rows.dtype
    n_exp, _, fe, d = gating.shape
    w_in = gating.astype(dt).transpose(0, 3, 1, 2).reshape(n_exp, d, 2 * fe)  # [E, D, 2 Fe]: gate | up
    gu = jax.lax.ragged_dot(rows, w_in, group_sizes=groups).reshape(-1, 2, fe)
    gate = ad("expert_gate", rows, gu[:, 0], ad_groups)
    up = ad("expert_up", rows, gu[:, 1], ad_groups)
    hid = jax.nn.gelu(gate, approximate=True) * up
    if row_weights is not None:
        hid = hid * row_weights[:, None].astype(dt)
    return ad("expert_down", hid, jax.lax.ragged_dot(hid, linear.astype(dt), group_sizes=groups), ad_groups)


def no_drops() -> Drops:
    return jnp.zeros(2, jnp.int32)


def experts(x: jax.Array, p: dict[str, jax.Array], top_k: int, adapter: Adapter | None = None,
            capacity: float = 0.0) -> tuple[jax.Array, Drops]:
    """(the experts' weighted sum for x [B, T, D] (compute dtype) -> [B, T, D], what they dropped). p: the layer's
    router and expert parameters by our names. Expert parallel under a mesh whose expert axes divide the experts
    (module docstring), capacity bounding each device's rows there; else every expert on every device, nothing
    dropped (counted as none of none)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else expert_axes(p["experts_gating"].shape[0], dict(mesh.shape))
    if not axes:
        return replicated(x, p, top_k, adapter), no_drops()
    return parallel(x, p, top_k, adapter, capacity, axes, dict(mesh.shape))


def replicated(x: jax.Array, p: dict[str, jax.Array], top_k: int, adapter: Adapter | None = None) -> jax.Array:
    """Every expert on this device: all of x's rows sorted by expert, no row dropped."""
    b, t, d = x.shape
    dt = x.dtype
    rows = x.reshape(b * t, d)
    weights, ids = route(rows, p["router"], p["router_scale"], top_k)
    n_exp = p["experts_gating"].shape[0]
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids)
    sorted_x = rows[order // top_k]  # each token once per chosen expert, grouped by expert
    groups = jnp.bincount(flat_ids, length=n_exp).astype(jnp.int32)
    ad = adapter or (lambda name, inp, y, g: y)
    out = _mlp(sorted_x, p["experts_gating"], p["experts_linear"], groups, ad, groups)
    out = out * p["expert_scale"].astype(dt)[jnp.sort(flat_ids)][:, None]
    back = jnp.zeros_like(out).at[order].set(out).reshape(b * t, top_k, d)  # token-major again
    return jnp.einsum("nkd,nk->nd", back, weights.astype(dt)).reshape(b, t, d)


def parallel(x: jax.Array, p: dict[str, jax.Array], top_k: int, adapter: Adapter | None, capacity: float,
             axes: tuple[str, ...], mesh_shape: dict[str, int]) -> tuple[jax.Array, Drops]:
    """Expert parallel over the mesh axes `axes` (module docstring) -> (output, Drops). The adapters the hook
    closes over enter whole (small: rank x (D + Fe) a expert), their rows grouped over all n experts with zeros
    elsewhere."""
    n_exp = p["experts_gating"].shape[0]
    shards = math.prod(mesh_shape[a] for a in axes)
    x_spec = fitted_spec(TOKENS, x.shape, mesh_shape)
    split = {a for s in x_spec for a in ((s,) if isinstance(s, str) else (s or ()))}
    gather = tuple(a for a in axes if a in split)    # the token rows differ along these: gathered, scattered back
    repeat = tuple(a for a in axes if a not in split)  # ... and are the same along these: outputs summed
    # the counts of dropped assignments differ along the expert axes (each device its experts' share of the
    # gathered tokens) and the axes the tokens split over (each its own tokens): summed over those; along any other
    # (dcn on one slice) every device holds the same counts
    counted = tuple(a for a in mesh_shape if a in axes or a in split)
    ad = adapter or (lambda name, inp, y, g: y)
    e_spec = P(axes)

    def body(xl, router, router_scale, expert_scale, gating, linear):
        b, t, d = xl.shape
        dt = xl.dtype
        rows = xl.reshape(b * t, d)
        weights, ids = route(rows, router, router_scale, top_k)
        if gather:
            rows, weights, ids = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (rows, weights, ids))
        n_local = gating.shape[0]
        first = jax.lax.axis_index(axes) * n_local
        local = ids.reshape(-1) - first
        key = jnp.where((local >= 0) & (local < n_local), local, n_local)  # n_local: another device's expert
        cap = capacity_rows(rows.shape[0], top_k, n_exp, shards, capacity)
        pick = jnp.argsort(key, stable=True)[:cap]  # this device's assignments first, by expert
        routed = jnp.cumsum(jnp.bincount(key, length=n_local + 1)[:n_local])  # this device's assignments, by expert
        ends = jnp.minimum(routed, cap)
        # counted from the routing alone (integers, no gradient): the output's numerics are untouched
        drops = jax.lax.psum(jnp.stack([routed[-1] - ends[-1], routed[-1]]).astype(jnp.int32), counted)
        groups = jnp.diff(ends, prepend=0).astype(jnp.int32)  # rows beyond the capacity dropped
        all_groups = jax.lax.dynamic_update_slice(jnp.zeros(n_exp, jnp.int32), groups, (first,))
        scale = jnp.take(expert_scale, first + jnp.minimum(key[pick], n_local - 1)).astype(jnp.float32)
        w = jnp.where(jnp.arange(cap) < ends[-1], weights.reshape(-1)[pick] * scale, 0.0)
        out = _mlp(rows[pick // top_k], gating, linear, groups, ad, all_groups, w)  # weighted rows
        # summed in the compute dtype: an f32 sum doubled the bytes of the step's largest buffers ([rows, D])
        total = jnp.zeros((rows.shape[0], d), dt).at[pick // top_k].add(out)
        if gather:
            total = jax.lax.psum_scatter(total, gather, scatter_dimension=0, tiled=True)
        if repeat:
            total = jax.lax.psum(total, repeat)
        return total.reshape(b, t, d), drops

    return jax.shard_map(body, in_specs=(x_spec, P(), P(), P(), e_spec, e_spec), out_specs=(x_spec, P()))(
        x, p["router"], p["router_scale"], p["expert_scale"], p["experts_gating"], p["experts_linear"])


def describe(n_experts: int, top_k: int, mesh_shape: dict[str, int], tokens: int, capacity: float) -> dict:
    """How a step places the experts and bounds their rows, for a plan: tokens = what one expert-parallel group
    gathers a layer (a slice's tokens of the step)."""
    axes = expert_axes(n_experts, mesh_shape)
    if not axes:
        return {"parallel_over": "", "per_device": n_experts, "note": "every expert on every device (the expert "
                "axes do not divide the experts): each device gathers every expert, nothing dropped"}
    shards = math.prod(mesh_shape[a] for a in axes)
    rows = capacity_rows(tokens, top_k, n_experts, shards, capacity)
    even = tokens * top_k / shards
    bound = ("dropless (--expert-capacity 0: a buffer of the worst case)" if capacity <= 0 else
             f"at most {rows:,} rows a device a layer (--expert-capacity {capacity:g} x the even share of "
             f"{even:,.0f}); a device's assignments beyond it are dropped" + (
                 ": none can be here, the bound is the worst case" if rows >= tokens * min(top_k, n_experts // shards)
                 else ""))
    over = ",".join(a for a in axes if mesh_shape[a] > 1) or ",".join(axes)
    return {"parallel_over": over, "per_device": n_experts // shards, "capacity": capacity,
            "rows_per_device": rows, "even_share": even,
            "note": f"expert parallel over {over}: {n_experts // shards} of {n_experts} experts a device, "
                    f"{tokens:,} tokens gathered to them a layer; {bound}"}
