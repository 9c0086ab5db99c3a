"""`python -m trainer pretrain` on the chip, in this process, as a user types it (the chip takes one process):
- the defaults: gpt2-124m at batch 16 with no other flag but the run's length, its tok/s the median of the logged
  windows that hold steps alone (not the first, which compiles, nor one that a checkpoint's save or an evaluation
  fell in: those are their own figures);
- the same with `--attention splash`, on the same data and seed: its losses beside the default's, within noise;
- a checkpoint's stall: `--log-every 1 --ckpt-every 50`, every step's time, the steps right after each (async)
  save against the median step;
- a run straight through and one stopped at its checkpoint and resumed, whose final parameters must be equal bit
  for bit (steps 4 to 6 read the restored optimizer moments), with the same losses logged (2 layers: quick)."""
from __future__ import annotations

import json
import os
import statistics
import time

import jax
import numpy as np

from bench.tpu.common import Row, Settings, say

STEPS, HALF = 6, 3
LONG = 200          # the default's run and splash's beside it
STALL_STEPS, STALL_EVERY, AFTER = 160, 50, 3   # saves at 50, 100, 150; the 3 steps after each
STALL_GOAL = 0.10   # no step after a save more than 10% slower than the median step


def _size(s: Settings) -> list[str]:
    return ["--n-layer", "1", "--n-head", "2", "--d-model", "128", "--seq-len", "128"] if s.quick else []


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


def _records(ckpt_dir: str) -> list[dict]:
    with open(os.path.join(ckpt_dir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f]


def steady(recs: list[dict]) -> tuple[float | None, list[dict]]:
    """(the median tok/s of the logged windows that hold steps alone, those windows): not the first window (it
    holds the compile), nor one with time left out (a save, the profiler: `left_out_s`), nor one that ends in an
    evaluation (`val_loss`: logged after the window's time is taken, but its first step then waits on it)."""
    after_eval = {i + 1 for i, r in enumerate(recs) if "val_loss" in r}
    clean = [r for i, r in enumerate(recs) if i > 0 and "left_out_s" not in r and i not in after_eval
             and r.get("tokens_per_s")]
    return (statistics.median(r["tokens_per_s"] for r in clean) if clean else None), clean


def stall(recs: list[dict], every: int, after: int) -> dict:
    """Each step's time around the saves of a `--log-every 1` run: {median_s, worst: the slowest step among the
    `after` steps that follow each save over the median step, by_save: {save step: [those ratios]}}."""
    times = {r["step"]: r["step_time_s"] for r in recs if "step_time_s" in r}
    saves = [s for s in times if s % every == 0 and s != max(times)]
    near = {s + k for s in saves for k in range(1, after + 1)}
    median = statistics.median(t for s, t in times.items() if s > 2 and s not in near)
    by_save = {s: [times[s + k] / median for k in range(1, after + 1) if s + k in times] for s in saves}
    worst = max((x for v in by_save.values() for x in v), default=None)
    return {"median_s": median, "worst": worst, "by_save": by_save}


def within_noise(a: list[float], b: list[float]) -> dict:
    """Two loss curves of the same data and seed: the mean difference over their second half against the loss's
    own step-to-step noise there (the spread of b's successive differences, over sqrt 2)."""
    n = len(b) // 2
    diff = [x - y for x, y in zip(a[n:], b[n:])]
    steps = [y2 - y1 for y1, y2 in zip(b[n:], b[n + 1:])]
    noise = (statistics.pstdev(steps) / 2 ** 0.5) if len(steps) > 1 else 0.0
    mean = statistics.fmean(diff) if diff else 0.0
    # a floor of 1e-4 of the loss: two curves equal but for the last bits of f32 have no noise to compare with
    floor = 1e-4 * abs(statistics.fmean(b[n:])) if b[n:] else 0.0
    return {"mean_diff": mean, "max_abs_diff": max((abs(x) for x in diff), default=0.0), "noise": noise,
            "ok": abs(mean) <= max(noise, floor)}


def defaults(s: Settings):
    """The default run and splash's beside it: two rows."""
    base = ["pretrain", "--preset", "gpt2-124m", *_size(s), "--batch-size", "4" if s.quick else "16",
            "--steps", str(20 if s.quick else LONG)]
    runs = {}
    for label, extra in (("defaults", []), ("--attention splash", ["--attention", "splash"])):
        name = f"pretrain gpt2-124m, batch {base[base.index('--batch-size') + 1]}, {label}"
        if not s.wants(name):
            continue
        ckpt = os.path.join(s.out, "cli-" + ("default" if not extra else "splash"))
        t0 = time.perf_counter()
        code = python_m_trainer([*base, *extra, "--ckpt-dir", ckpt])
        took = time.perf_counter() - t0
        if code:
            yield Row("cli", name, ok=False, note=f"exit code {code}")
            continue
        recs = _records(ckpt)
        tps, clean = steady(recs)
        from trainer.common import config as config_lib, metrics
        m = config_lib.PRESETS["gpt2-124m"][0]
        mfu = tps * metrics.flops_per_token(m) / (s.peak * jax.device_count()) if s.peak and tps and not s.quick \
            else None
        runs[label] = [r["loss"] for r in recs]
        row = Row("cli", name, tokens_per_s=tps, mfu=mfu, step_s=(int(base[base.index("--batch-size") + 1]) * (
            128 if s.quick else m.seq_len) / tps) if tps else None,
                  note=f"median of {len(clean)} of {len(recs)} logged windows (the first, and any with a save or "
                       f"an evaluation in it, left out); {took:.0f} s in all",
                  figures={"losses": runs[label], "steps": [r["step"] for r in recs],
                           "windows_tokens_per_s": [r.get("tokens_per_s") for r in recs], "wall_s": took})
        if label != "defaults" and "defaults" in runs:
            cmp = within_noise(runs["defaults"], runs[label])
            row.ok = cmp["ok"]
            row.figures["against_defaults"] = cmp
            row.note += (f"; the defaults' losses over the second half differ from these by {cmp['mean_diff']:+.4f} "
                         f"on average (max {cmp['max_abs_diff']:.4f}), the loss's own noise {cmp['noise']:.4f}")
        yield row


def save_stall(s: Settings):
    every = 5 if s.quick else STALL_EVERY
    name = f"checkpoint stall: --log-every 1 --ckpt-every {every}, batch {4 if s.quick else 16}"
    if not s.wants(name):
        return
    ckpt = os.path.join(s.out, "cli-stall")
    code = python_m_trainer(["pretrain", "--preset", "gpt2-124m", *_size(s), "--batch-size", "4" if s.quick else "16",
                             "--steps", str(16 if s.quick else STALL_STEPS), "--log-every", "1",
                             "--ckpt-every", str(every), "--ckpt-dir", ckpt])
    if code:
        yield Row("cli", name, ok=False, note=f"exit code {code}")
        return
    recs = _records(ckpt)
    got = stall(recs, every, AFTER)
    saves_s = [r["left_out_s"]["checkpoint"] for r in recs if "checkpoint" in r.get("left_out_s", {})]
    worst = got["worst"]
    yield Row("cli", name, step_s=got["median_s"], ok=None if s.quick else (worst is not None and
                                                                            worst <= 1 + STALL_GOAL),
              note=(f"the {AFTER} steps after each save: at worst {worst - 1:+.0%} against the median step; "
                    if worst else "") + f"each save held the loop {', '.join(f'{x:.2f}' for x in saves_s)} s "
                                        f"(left out of the windows)",
              figures={**got, "save_s": saves_s, "step_times": {r["step"]: r.get("step_time_s") for r in recs}})


def _state(ckpt_dir: str, step: int):
    from trainer.pretrain import sample
    return sample.load(ckpt_dir, step)[1]


def resume(s: Settings):
    name = f"pretrain {STEPS} steps; stopped at {HALF}, resumed"
    if not s.wants(name):
        return
    flags = ["pretrain", "--preset", "gpt2-124m", *(_size(s) or ["--n-layer", "2"]), "--batch-size", "8",
             "--log-every", "1", "--eval-every", "0", "--ckpt-every", str(HALF), "--dropout", "0.1"]
    straight, resumed = os.path.join(s.out, "cli-straight"), os.path.join(s.out, "cli-resumed")
    t0 = time.perf_counter()
    codes = [python_m_trainer([*flags, "--steps", str(STEPS), "--ckpt-dir", straight]),
             python_m_trainer([*flags, "--steps", str(HALF), "--ckpt-dir", resumed]),
             python_m_trainer([*flags, "--steps", str(STEPS), "--ckpt-dir", resumed])]
    took = time.perf_counter() - t0
    if codes != [0, 0, 0]:
        yield Row("cli", name, ok=False, note=f"exit codes {codes}")
        return
    a, b = _state(straight, STEPS), _state(resumed, STEPS)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    same = len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
    losses = [[r["loss"] for r in _records(d)] for d in (straight, resumed)]
    same_losses = losses[0] == losses[1]
    yield Row("cli", name, ok=same and same_losses,
              note=f"{len(la)} arrays {'equal' if same else 'DIFFER'} bit for bit, losses "
                   f"{'equal' if same_losses else 'DIFFER'}; {took:.0f} s for the three runs",
              figures={"losses": losses, "leaves": len(la)})


def run(s: Settings):
    for part in (defaults, save_stall, resume):
        say(f"  {part.__name__} ...")
        yield from part(s)
