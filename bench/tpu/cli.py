"""A short `python -m trainer pretrain` on the chip, in this process, as a user runs it: a run straight through
and a run stopped at its checkpoint and resumed, whose final parameters must be equal bit for bit (steps 4 to 6
read the restored optimizer moments: a moment restored wrong changes them), with the same losses logged."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from bench.tpu.common import Row, Settings

STEPS, HALF = 6, 3


def _flags(s: Settings) -> list[str]:
    size = ["--n-layer", "1", "--n-head", "2", "--d-model", "128", "--seq-len", "128"] if s.quick else \
        ["--n-layer", "2"]
    return ["pretrain", "--preset", "gpt2-124m", *size, "--batch-size", "8", "--log-every", "1", "--eval-every", "0",
            "--ckpt-every", str(HALF), "--dropout", "0.1"]


def _state(ckpt_dir: str, step: int):
    from trainer.pretrain import sample
    return sample.load(ckpt_dir, step)[1]


def python_m_trainer(argv: list[str]) -> int:
    """`python -m trainer ARGV` in this process (the chip takes one process at a time), run as the command line
    runs it: its __main__ module, its exit code."""
    import runpy
    import sys
    saved = sys.argv
    sys.argv = ["python -m trainer", *argv]
    try:
        runpy.run_module("trainer", run_name="__main__", alter_sys=False)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def run(s: Settings) -> list[Row]:
    straight, resumed = os.path.join(s.out, "cli-straight"), os.path.join(s.out, "cli-resumed")
    t0 = time.perf_counter()
    codes = [python_m_trainer([*_flags(s), "--steps", str(STEPS), "--ckpt-dir", straight]),
             python_m_trainer([*_flags(s), "--steps", str(HALF), "--ckpt-dir", resumed]),
             python_m_trainer([*_flags(s), "--steps", str(STEPS), "--ckpt-dir", resumed])]
    took = time.perf_counter() - t0
    if codes != [0, 0, 0]:
        return [Row("cli", "pretrain, checkpoint, resume", ok=False, note=f"exit codes {codes}")]
    a, b = _state(straight, STEPS), _state(resumed, STEPS)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    same = len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
    losses = [[json.loads(ln)["loss"] for ln in open(os.path.join(d, "metrics.jsonl"))] for d in (straight, resumed)]
    same_losses = losses[0] == losses[1]
    recs = [json.loads(ln) for ln in open(os.path.join(straight, "metrics.jsonl"))]
    peak_mfu = max((r.get("mfu") or 0.0) for r in recs)
    return [Row("cli", f"pretrain {STEPS} steps; stopped at {HALF}, resumed", ok=same and same_losses,
                tokens_per_s=recs[-1].get("tokens_per_s"), mfu=recs[-1].get("mfu"),
                note=f"{len(la)} arrays {'equal' if same else 'DIFFER'} bit for bit, losses "
                     f"{'equal' if same_losses else 'DIFFER'}; highest logged MFU {100 * peak_mfu:.1f}%; "
                     f"{took:.0f} s for the three runs",
                figures={"losses": losses, "leaves": len(la), "peak_logged_mfu": peak_mfu})]
