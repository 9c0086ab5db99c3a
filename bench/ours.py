"""Our trainer's own train step (trainer.pretrain.train.Steps), driven one step at a time for timing."""
from __future__ import annotations

import dataclasses

import jax

from trainer.common import checkpoint
from trainer.pretrain import train as loop
from trainer.common.config import PRESETS, Config, validate
from trainer.models import gpt2


def config(preset: str, ckpt_dir: str, *, model: dict | None = None, train: dict | None = None) -> Config:
    """A preset with overrides, validated like the command line does."""
    m, t = PRESETS[preset]
    cfg = Config(preset, dataclasses.replace(m, **(model or {})),
                 dataclasses.replace(t, ckpt_dir=ckpt_dir, **(train or {})))
    validate(cfg)
    return cfg


class OursTrainer:
    """`step(tokens)` runs one compiled train step on a [B, T+1] token batch and waits for all of it."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.mesh = loop.setup_mesh(cfg)
        self.steps = loop.Steps(cfg, self.mesh)
        self.compile_s = self.steps.compile()
        self.params, self.opt = self.steps.init()
        self.n = 0
        self.ckpt: checkpoint.Checkpointer | None = None

    def n_params(self) -> int:
        return gpt2.count_params(self.params)

    def step(self, tokens) -> float:
        self.n += 1
        self.params, self.opt, out = self.steps.step(self.params, self.opt, tokens, self.n)
        jax.block_until_ready((self.params, self.opt, out))
        return float(out["loss"])

    def save(self) -> None:
        """What the loop does at a --ckpt-every step: start an async Orbax save of params + optimizer."""
        if self.ckpt is None:
            self.ckpt = checkpoint.Checkpointer(self.cfg.train.ckpt_dir, self.cfg.train.keep)
        self.ckpt.save(self.n, self.params, self.opt, self.cfg)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
