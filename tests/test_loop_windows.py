"""A logged window's tokens/s and MFU count only work that finished within it: no window can claim more than the
device can do, also when the profiler's start (left out of step times) falls while steps are still running.

The device here is a worker thread that runs the dispatched steps in order, each for DEVICE_S, and whose results
are waited for as jax's are (block_until_ready, float): the loop's own accounting, on a device whose time per step
is known exactly. A loaded machine can only make a step slower than DEVICE_S, never faster."""
from __future__ import annotations

import json
import re
import queue
import threading
import time

import jax
import numpy as np

from trainer.common import checkpoint, loop, metrics, profiling

DEVICE_S = 0.25


class _Device:
    def __init__(self):
        self.work: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            done = self.work.get()
            time.sleep(DEVICE_S)
            done.set()

    def dispatch(self) -> "_Result":
        r = _Result()
        self.work.put(r.done)
        return r


class _Result:
    """A dispatched step's output: ready once the device has run it (as a jax.Array is)."""

    def __init__(self):
        self.done = threading.Event()

    def block_until_ready(self):
        self.done.wait()
        return self

    def __float__(self):
        self.done.wait()
        return 1.0


def test_no_window_exceeds_the_device_s_own_rate_when_a_slow_profiler_start_overlaps_running_steps(
        tmp_path, monkeypatch):
    slow_start = 2 * DEVICE_S  # a TPU profiler's start takes about a step or more; dispatched steps run meanwhile
    real_start = jax.profiler.start_trace

    def start_trace(*a, **kw):
        time.sleep(slow_start)
        return real_start(*a, **kw)
    monkeypatch.setattr(jax.profiler, "start_trace", start_trace)
    device = _Device()

    def step(state, local, n):
        out = device.dispatch()  # not waited for: the loop decides when to wait
        # a step's own scalar beside loss, lr and grad_norm (lora's expert_dropped) is logged too
        return out, {"loss": out, "lr": 0.1, "grad_norm": 1.0, "expert_dropped": np.float32(0.25)}
    tokens = 1000
    peak = tokens / DEVICE_S / jax.device_count()  # MFU 100% is exactly one step per DEVICE_S
    job = loop.Job(ckpt_dir=str(tmp_path), total=8, log_every=4, eval_every=0, ckpt_every=0, tokens_per_step=tokens,
                   step=step, evaluate=lambda state: None, save=lambda ckpt, n, state: None,
                   flops_per_token=1.0, peak_flops=peak,
                   profile=profiling.parse_window("3:5"))  # begins with step 2 in flight (logged: 1, 4, 8)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), keep=1)
    assert loop.run(job, ckpt, (device.dispatch(),), 0,
                    ((n, np.zeros(1)) for n in range(1, 9))) == 0
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 4, 8] and all(r["expert_dropped"] == 0.25 for r in recs)
    for r in recs[1:]:
        assert r["mfu"] <= 1.0 and r["step_time_s"] >= DEVICE_S, r
    profiled = recs[1]
    assert profiled["left_out_s"]["profiler"] >= slow_start, profiled  # named as what it is
    line = metrics.progress(profiled, 8)
    assert re.search(r"\| profiler \d+\.\d\d s left out", line), line  # its own time, however long it took here
    assert "| experts dropped 25.00%" in line
    assert (tmp_path / "profiles").is_dir()  # the trace was really taken
