"""Gemma 4's routed experts (26B-A4B): a router picks top_k of n experts per token, each a gated-GELU MLP.

The router reads the layer's normalised input again normalised without a scale, times router_scale / sqrt(D);
its softmax over all experts, renormalised over the chosen top_k, weighs their outputs, each also scaled by its
per_expert_scale. Tokens are sorted by expert and run through jax.lax.ragged_dot (one group per expert), so an
expert computes only the rows routed to it: the cost is top_k experts per token, not n.

Parameters (our layout, Kaggle's flax one): router [D, E], router_scale [D], expert_scale [E],
experts_gating [E, 2, Fe, D] (gate, up), experts_linear [E, Fe, D].
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# adapter(name, input rows [N, in], output rows [N, out], group_sizes [E]) -> output rows: an expert's LoRA
Adapter = Callable[[str, jax.Array, jax.Array, jax.Array], jax.Array]


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


def experts(x: jax.Array, p: dict[str, jax.Array], top_k: int, adapter: Adapter | None = None) -> jax.Array:
    """The experts' weighted sum for x [B, T, D] (compute dtype) -> [B, T, D]. p: the layer's router and expert
    parameters by our names."""
    b, t, d = x.shape
    dt = x.dtype
    rows = x.reshape(b * t, d)
    weights, ids = route(rows, p["router"], p["router_scale"], top_k)
    gating, linear = p["experts_gating"], p["experts_linear"]
    n_exp, _, fe, _ = gating.shape
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids)
    sorted_x = rows[order // top_k]  # each token once per chosen expert, grouped by expert
    groups = jnp.bincount(flat_ids, length=n_exp).astype(jnp.int32)
    ad = adapter or (lambda name, inp, y, g: y)
    w_in = gating.astype(dt).transpose(0, 3, 1, 2).reshape(n_exp, d, 2 * fe)  # [E, D, 2 Fe]: gate | up
    gu = jax.lax.ragged_dot(sorted_x, w_in, group_sizes=groups).reshape(-1, 2, fe)
    gate = ad("expert_gate", sorted_x, gu[:, 0], groups)
    up = ad("expert_up", sorted_x, gu[:, 1], groups)
    hid = jax.nn.gelu(gate, approximate=True) * up
    out = ad("expert_down", hid, jax.lax.ragged_dot(hid, linear.astype(dt), group_sizes=groups), groups)
    out = out * p["expert_scale"].astype(dt)[jnp.sort(flat_ids)][:, None]
    back = jnp.zeros_like(out).at[order].set(out).reshape(b * t, top_k, d)  # token-major again
    return jnp.einsum("nkd,nk->nd", back, weights.astype(dt)).reshape(b, t, d)
