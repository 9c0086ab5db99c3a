"""`tpuctl profile NAME --steps N`: a trace of N steps of the live run from every host at once, without
restarting it.

On every host, beside the trainer (hostwrap `beside`, through the run's SSH connections, proxies included):
first `python -m trainer hoststat` for the step time (the trainer's own progress lines), then
`python -m trainer capture` for N+1 step times, which asks the trainer's profiler server for a trace as
TensorBoard's "capture profile" does and writes it into the run's CKPT_DIR/profiles/RUN_ID/ under one session
shared by all hosts. A host whose server does not answer is named; the others' traces are kept.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.access.reach import SshFlags
from orchestrator.observe.live import open_live
from orchestrator.observe.top import HOSTSTAT
from orchestrator.spec import UserError

CAPTURED = re.compile(r"^captured (\d+) ms into (\S+)$", re.M)


@dataclass
class Profiled:
    run_id: str
    session: str
    duration_ms: int
    traces: dict[str, str] = field(default_factory=dict)   # worker -> the trace's path on the run's storage
    failed: dict[str, str] = field(default_factory=dict)   # worker -> why
    # worker -> its trace read by trainer/experiments/profiles.py (device step, split, categories, top ops), or
    # {"error": why it could not be read here}
    summaries: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "session": self.session, "duration_ms": self.duration_ms,
                "traces": self.traces, "failed": self.failed, "summaries": self.summaries}


def summarize(res: Profiled) -> None:
    """Each captured trace read here, each host's from a folder of its own (profiles.tool): a host's summary
    is its own, whatever else its session folder holds. A trace that cannot be read (no xprof here, storage out
    of reach) says why; the capture stands either way."""
    from trainer.experiments import profiles
    for w, path in sorted(res.traces.items()):
        try:
            h = profiles.summarize(path, w)
            if not h["steps"] and h["hardware"] == "unknown":
                res.summaries[w] = {"error": f"xprof found no device and no step in {path}"}
                continue
            res.summaries[w] = {k: h[k] for k in ("host", "hardware", "source", "steps", "mean", "device_step_s",
                                                  "categories", "collectives", "top_ops")}
        except Exception as e:  # noqa: BLE001 - one unreadable trace is named; the others are still read
            res.summaries[w] = {"error": str(e).splitlines()[0][:300] if str(e) else type(e).__name__}


def profile(name: str, steps: int, flags: SshFlags = SshFlags(),
            note: Callable[[str], None] = lambda m: None) -> Profiled:
    if steps < 1:
        raise UserError(f"--steps {steps}: profile at least 1 step")
    with open_live(name, flags, note) as live:
        live.needs_trainer("profile", "a trace of it: the trace comes from the trainer's profiler server, which "
                                      "this command does not serve (jax.profiler in your own script can)")
        times = []
        for b in live.beside(HOSTSTAT, timeout=60):
            try:
                t = json.loads(b.stdout.strip().splitlines()[-1]).get("step_time_s") if b.rc == 0 else None
            except (ValueError, IndexError):
                t = None
            if t:
                times.append(t)
        if not times:
            raise UserError(f"the run on {name} has not logged a step yet (no step time to size the trace by): "
                            "try again once it has")
        # One step more than asked: the window starts anywhere inside a step, and N whole steps must fit.
        duration_ms = max(1, math.ceil((steps + 1) * max(times) * 1000))
        session = "live_" + time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime())
        note(f"tracing {steps} step(s) of run {live.run_id} on {len(live.hosts.workers)} host(s) "
             f"({duration_ms} ms)")
        res = Profiled(live.run_id, session, duration_ms)
        args = ["-m", "trainer", "capture", "--duration-ms", str(duration_ms), "--session", session]
        for b in live.beside(args, timeout=duration_ms / 1000 + 120):
            m = CAPTURED.search(b.stdout)
            if b.rc == 0 and m:
                res.traces[b.worker] = m.group(2)
            else:
                res.failed[b.worker] = b.error or f"exit {b.rc}"
        return res


def where(res: Profiled) -> str:
    """Where the traces are, in words, and how to open them."""
    lines = [f"{w}: {p}" for w, p in sorted(res.traces.items())]
    lines += [f"{w}: no trace: {why}" for w, why in sorted(res.failed.items())]
    if res.traces:
        folder = next(iter(res.traces.values())).split("/plugins/profile/")[0]
        lines.append(f"session {res.session} in {folder}: `tensorboard --logdir {folder}` (profile plugin: xprof) "
                     "opens it")
    read = [h for h in res.summaries.values() if "error" not in h]
    if read:
        from trainer.experiments import profiles
        lines.append(profiles.describe({"run": res.run_id, "session": res.session, "window": None, "hosts": read}))
    lines += [f"{w}: trace not summarized here: {h['error']}" for w, h in sorted(res.summaries.items())
              if "error" in h]
    return "\n".join(lines)
