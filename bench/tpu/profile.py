"""A trace of two default gpt2-124m steps on the chip (jax.profiler, to a file: a TPU host may allow no socket, so
no profiler server), and its summary by trainer/experiments/profiles.py where xprof is installed. A TPU host
without xprof keeps the trace for `python -m bench.tpu --summarize DIR` on a machine with it."""
from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

import jax

from bench.tpu.common import Row, Settings, block

TRACE = "profile-gpt2-124m-b8.xplane.pb"


def run(s: Settings) -> list[Row]:
    from bench.tpu.steps import trainer
    tr, one = trainer(s, 8, prefix="profile-")
    block(one())
    dest = trace_steps(one, os.path.join(s.out, TRACE))
    if dest is None:
        return [Row("profile", "trace of 2 steps, batch 8", ok=False, note="the profiler wrote no trace")]
    return [summarize(dest)]


def trace_steps(one, dest: str) -> str | None:
    """A trace of two calls of one() (each a step, compiled and run before) written to dest; None when the
    profiler wrote none."""
    tmp = tempfile.mkdtemp(prefix="tpuctl-check-trace-")
    try:
        with jax.profiler.trace(tmp):
            for n in (2, 3):
                with jax.profiler.StepTraceAnnotation("train", step_num=n):
                    block(one())
        found = sorted(glob.glob(os.path.join(tmp, "plugins", "profile", "*", "*.xplane.pb")))
        if not found:
            return None
        shutil.copyfile(found[-1], dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def row_trace(out: str, name: str) -> str:
    """Where a row's own trace goes (`--trace`): named by the row, so `--summarize` finds it again."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return os.path.join(out, f"trace-{slug}.xplane.pb")


def summarize_ops(path: str, top: int = 10) -> dict:
    """A row's trace read where xprof is installed: the device step, the op categories' shares and the top ops
    (each with its share of op time and achieved FLOP/s); {"error": why} where it cannot be read here."""
    from trainer.common.config import UsageError
    from trainer.experiments import profiles
    try:
        h = profiles.summarize(path, "chip")
    except UsageError as e:
        return {"error": str(e)}
    return {"device_step_s": h.get("device_step_s"), "categories": dict(list(h["categories"].items())[:6]),
            "top_ops": [{k: o.get(k) for k in ("op", "category", "self_s", "share", "flop_s", "name")}
                        for o in h["top_ops"][:top]]}


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


def describe_ops(name: str, h: dict) -> str:
    """summarize_ops' figures as lines of text: the device step, the categories, the top ops (as a run's report
    gives them, with each op's jax name)."""
    from trainer.experiments import profiles
    if "error" in h:
        return f"{name}: trace not read here ({h['error']})"
    step = h.get("device_step_s")
    return "\n".join([f"{name}: device step {step * 1e3:.1f} ms" if step else f"{name}:",
                      *([profiles.category_line(h["categories"])] if h["categories"] else []),
                      *profiles.top_op_lines(h["top_ops"], names=True)])
