"""A trace of two default gpt2-124m steps on the chip (jax.profiler, to a file: a TPU host may allow no socket, so
no profiler server), and its summary by trainer/experiments/profiles.py where xprof is installed. A TPU host
without xprof keeps the trace for `python -m bench.tpu --summarize DIR` on a machine with it."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

import jax

from bench.tpu.common import Row, Settings, block

TRACE = "profile-gpt2-124m-b8.xplane.pb"


def run(s: Settings) -> list[Row]:
    from bench.tpu.steps import trainer
    tr, one = trainer(s, 8, prefix="profile-")
    block(one())
    tmp = tempfile.mkdtemp(prefix="tpuctl-check-trace-")
    try:
        with jax.profiler.trace(tmp):
            for n in (2, 3):
                with jax.profiler.StepTraceAnnotation("train", step_num=n):
                    block(one())
        found = sorted(glob.glob(os.path.join(tmp, "plugins", "profile", "*", "*.xplane.pb")))
        if not found:
            return [Row("profile", "trace of 2 steps, batch 8", ok=False, note="the profiler wrote no trace")]
        dest = os.path.join(s.out, TRACE)
        shutil.copyfile(found[-1], dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [summarize(dest)]


def summarize(path: str) -> Row:
    from trainer.common.config import UsageError
    from trainer.experiments import profiles
    try:
        h = profiles.summarize(path, "chip")
    except UsageError as e:
        return Row("profile", "trace of 2 steps, batch 8", ok=None,
                   note=f"kept at {path}; not summarized here ({e}): `python -m bench.tpu --summarize DIR`")
    cats = ", ".join(f"{k} {100 * v:.1f}%" for k, v in list(h["categories"].items())[:4])
    dev = h.get("device_step_s") or h["mean"]["step_s"]
    return Row("profile", "trace of 2 steps, batch 8", step_s=dev, ok=h["hardware"] not in ("unknown",),
               note=f"{h['hardware']}: device step {dev * 1e3:.1f} ms; {cats}",
               figures={"summary": {k: h[k] for k in ("hardware", "device_step_s", "mean", "categories")},
                        "top_ops": h["top_ops"][:5], "trace": path})
