"""`make bench` section [14]: what `--profile START:END` costs the steps outside its window.

The real trainer (`python -m trainer pretrain`, a small GPT-2 on the embedded plays, 2 emulated CPU devices) runs the same steps
three ways, alternated round by round so that load from other processes hits each alike:
- off: no profiler server (TPUCTL_PROFILER_PORT=0), no window;
- server: the profiler server every training process starts, no window (what every run pays);
- profiled: the server and `--profile` over a few steps in the middle.
Each run logs every step; the figure is the median step_time_s (metrics.jsonl, the loop's own clock) of the
steps outside the window (step 1 and the window left out), and the ratios to `off`. The window's own steps are
shown beside them: that is where the profiler's cost belongs.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--n-layer", "2", "--n-head", "2", "--d-model", "64", "--seq-len", "64", "--batch-size", "8",
         "--warmup-steps", "2", "--decay-steps", "100"]


def _run(ckpt: str, steps: int, window: str | None, server: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCTL_", "XLA_FLAGS"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TPUCTL_PROFILER_PORT="9999" if server else "0")
    argv = [sys.executable, "-m", "trainer", "pretrain", *MODEL, "--emulate-devices", "2", "--steps", str(steps),
            "--log-every", "1", "--ckpt-every", "0", "--eval-every", "0", "--eval-batches", "1", "--ckpt-dir", ckpt]
    if window:
        argv += ["--profile", window]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"bench [14]: the trainer exited {p.returncode}:\n{p.stderr[-3000:]}")
    return [json.loads(ln) for ln in Path(ckpt, "metrics.jsonl").read_text().splitlines() if ln.strip()]


def main(say=print, quick: bool = False) -> dict:
    steps, start, end = (8, 3, 5) if quick else (40, 15, 20)
    rounds = 1 if quick else 2
    window = f"{start}:{end}"
    order = ["off", "profiled"] if quick else ["off", "server", "profiled"]  # --quick: two runs only
    outside: dict[str, list[float]] = {k: [] for k in order}
    inside: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tpuctl-bench-profile-") as tmp:
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                recs = _run(os.path.join(tmp, f"{name}{r}"), steps, window if name == "profiled" else None,
                            server=name != "off")
                outside[name] += [x["step_time_s"] for x in recs if x["step"] > 1 and not start <= x["step"] < end]
                if name == "profiled":
                    inside += [x["step_time_s"] for x in recs if start <= x["step"] < end]
                    traces = list(Path(tmp, f"{name}{r}").glob("profiles/*/plugins/profile/*/*.xplane.pb"))
                    if not traces:
                        raise RuntimeError("bench [14]: the profiled run left no trace")
    med = {k: statistics.median(v) for k, v in outside.items()}
    say(f"[14] step time outside the --profile {window} window, median of {len(outside['off'])} steps "
        f"({rounds} round(s) of {steps} steps each, step 1 left out): "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items()))
    say("     ratio to off: " + ", ".join(f"{k} {v / med['off']:.2f}x" for k, v in med.items() if k != "off")
        + f"; inside the window {statistics.median(inside) * 1e3:.1f} ms "
        f"({statistics.median(inside) / med['off']:.2f}x, the trace's own cost)")
    return {"outside_ms": {k: v * 1e3 for k, v in med.items()}, "inside_ms": statistics.median(inside) * 1e3}


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
