"""AdamW with linear warmup + cosine decay, global-norm clipping, and a weight-decay mask.

The schedule's length is --decay-steps, never --steps: stopping at 40 and resuming to 80 follows the
same learning rates as a straight run to 80. Weight decay only on matmul kernels (not biases,
LayerNorm, or the embeddings).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from trainer.common import mesh as mesh_lib
from trainer.common.config import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
    """lr at optimizer update `count` (0-based): (count+1)/warmup ramp, then cosine to lr*min_lr_ratio."""
    def lr(count):
        c = jnp.asarray(count, jnp.float32)
        warm = t.lr * (c + 1) / max(t.warmup_steps, 1)
        frac = jnp.clip((c - t.warmup_steps) / max(t.decay_steps - t.warmup_steps, 1), 0.0, 1.0)
        cos = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
        return jnp.where(c < t.warmup_steps, warm, cos)
    return lr


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: str(getattr(path[-1], "key", "")).endswith("kernel"),
                                            params)


def make(t: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(schedule(t), b1=t.beta1, b2=t.beta2, eps=1e-8, weight_decay=t.weight_decay, mask=decay_mask),
    )


def split_shardings(abstract_params, param_shardings):
    """ZeRO-1: each parameter's sharding with the data axis added (trainer.common.mesh.split_state): what its
    optimizer moments are kept in, and its gradient constrained to before the update."""
    return jax.tree.map(lambda a, s: mesh_lib.split_state(s, a.shape), abstract_params, param_shardings)


def state_shardings(tx: optax.GradientTransformation, abstract_params, param_shardings, replicated,
                    split: bool = False):
    """Optimizer-state shardings: a moment mirrors its parameter's sharding (split: with the data axis added,
    ZeRO-1, `split_shardings`); scalars are replicated.

    Matched by key path: an optimizer leaf whose path ends with a parameter's path takes its sharding.
    """
    if split:
        param_shardings = split_shardings(abstract_params, param_shardings)
    table = {tuple(path): s for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}
    abstract_state = jax.eval_shape(tx.init, abstract_params)

    def pick(path, leaf):
        path = tuple(path)
        for i in range(len(path)):
            s = table.get(path[i:])
            if s is not None:
                return s
        return replicated
    return jax.tree_util.tree_map_with_path(pick, abstract_state)
