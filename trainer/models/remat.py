"""--remat: which activations of a transformer layer the backward pass keeps, and which it recomputes.

none keeps everything autodiff saves (fastest, most memory); dots keeps the outputs of the weight matmuls
(no batch dimension: attention's [T, T] products are recomputed) and recomputes the elementwise work in
between; full keeps only each layer's input and recomputes the whole layer (one more forward pass).
"""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def check(name: str) -> None:
    if name not in POLICIES:
        raise ValueError(f"--remat {name}: choose one of {', '.join(POLICIES)}")


def layer(module: nnx.Module, policy: str, **static) -> Callable:
    """args -> module(*args, **static) under jax.checkpoint with the named policy (plain for none).
    args are arrays (or None); static: the call's non-array settings."""
    check(policy)
    if policy == "none":
        return lambda *args: module(*args, **static)
    graphdef, state = nnx.split(module)
    call = jax.checkpoint(lambda state, *args: nnx.merge(graphdef, state)(*args, **static), policy=POLICIES[policy])
    return lambda *args: call(state, *args)
