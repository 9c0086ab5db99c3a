"""Sweep dirs as the trainer and the sweep leave them, written directly: for report tests that need no training."""
from __future__ import annotations

import dataclasses
import json
import math

from trainer.experiments import sweep
from trainer.common.config import PRESETS, Config

BASE = ["pretrain", "--preset", "gpt2-tiny", "--steps", "4"]


def fake_trial(root, name, n_layer, lr, losses, status="done"):
    """A trial dir as the trainer leaves it (config.json, metrics.jsonl) plus the sweep's trial.json."""
    m, t = PRESETS["gpt2-tiny"]
    cfg = Config("gpt2-tiny", dataclasses.replace(m, n_layer=n_layer),
                 dataclasses.replace(t, lr=lr, steps=len(losses) * 10, ckpt_dir=str(root / name)))
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(cfg.to_json())
    recs = [{"step": 10 * (i + 1), "loss": l, "tokens_per_s": 1000.0 + i, "mfu": None, "lr": lr,
             **({"val_loss": l + 0.1} if i == len(losses) - 1 else {})} for i, l in enumerate(losses)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    sweep.record(str(d), status, 0 if status == "done" else 1, "" if status == "done" else "exit code 1: boom", 12.5)
    return cfg


def lr_sweep(root):
    """A 2 x 3 sweep of n_layer x lr: the larger model reaches a lower loss, lr 0.003 is best for both, one
    trial failed. Returns (root, trial names)."""
    axes = {"n_layer": [1, 2], "lr": [0.001, 0.003, 0.01]}
    names = []
    for nl in axes["n_layer"]:
        for lr in axes["lr"]:
            names.append(sweep.trial_name({"n_layer": nl, "lr": lr}))
            final = 6.0 - 0.5 * nl + abs(math.log10(lr / 0.003))
            fake_trial(root, names[-1], nl, lr, [9.0, 7.5, final],
                       status="failed" if (nl, lr) == (2, 0.01) else "done")
    (root / sweep.SWEEP_JSON).write_text(json.dumps({**sweep.Sweep(str(root), "grid", axes, BASE, []).record(),
                                                     "trials": names}))
    return root, names
