"""Step variants built from the trainer's own model and optimizer, to measure what makes a step faster.

Not used by `make bench` by default (`python -m bench --variants` runs them): each variant changes one
thing against a baseline pure-function step (params and optimizer state as pure dicts, jitted once, batch
sharded over `data`, dropout on, f32), so a difference in step time is that one thing's effect.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trainer import mesh as tmesh, optim
from trainer.config import ModelConfig, TrainConfig
from trainer.models import gpt2


@dataclass(frozen=True)
class Variant:
    name: str
    vocab_multiple: int = 128  # 1 = unpadded 50257
    donate: bool = True
    dtype: str = "float32"
    loss: str = "logsumexp"  # or "optax" (optax.softmax_cross_entropy_with_integer_labels)
    dropout: bool = True


class VariantTrainer:
    def __init__(self, v: Variant, model: ModelConfig, train: TrainConfig, devices=None):
        self.v = v
        devices = devices if devices is not None else jax.devices()
        self.cfg = dataclasses.replace(model, vocab_multiple=v.vocab_multiple,
                                       dropout=model.dropout if v.dropout else 0.0)
        self.mesh = tmesh.make_mesh({"data": len(devices), "model": 1})
        with jax.set_mesh(self.mesh):
            self.params = gpt2.init_params(self.cfg, 0, self.mesh)
        self.tx = optim.make(train)
        self.opt = jax.jit(self.tx.init)(self.params)
        self.batch_sharding = tmesh.sharding(self.mesh, ("batch", None))
        graphdef, _ = gpt2.abstract(self.cfg)
        dtype = jnp.bfloat16 if v.dtype == "bfloat16" else jnp.float32
        cfg, tx, use_optax = self.cfg, self.tx, v.loss == "optax"

        def loss_of(params, x, y, key):
            model = nnx.merge(graphdef, params)
            logits = model(x, dropout_key=key if cfg.dropout else None, dtype=dtype)
            if use_optax:
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return gpt2.loss_fn(logits, y)

        def step(params, opt, x, y, step_no):
            key = jax.random.fold_in(jax.random.key(0), step_no)
            loss, grads = jax.value_and_grad(loss_of)(params, x, y, key)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, loss

        self._step = jax.jit(step, donate_argnums=(0, 1) if v.donate else ())
        self.n = 0

    def n_params(self) -> int:
        return gpt2.count_params(self.params)

    def step(self, x, y) -> None:
        with jax.set_mesh(self.mesh):
            xb, yb = jax.device_put((x, y), self.batch_sharding)
            self.params, self.opt, loss = self._step(self.params, self.opt, xb, yb, self.n)
        self.n += 1
        loss.block_until_ready()
