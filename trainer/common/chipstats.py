"""Each host's chips, sampled into the run's metrics: every TPUCTL_CHIP_SAMPLE_S seconds (default 60) a thread reads
this host's duty cycle and HBM from libtpu's runtime metrics service (`hoststat.chips`, tpu-info's client), and the
next logged step carries the sample in this process's record (metrics.jsonl `hosts[p].chips`), so `report` can draw
chip use over the run. Where the service does not answer (CPU hosts, local mode) nothing is sampled: the report
says "no TPU", never a made-up figure.
"""
from __future__ import annotations

import os
import threading
import time

from trainer.common import hoststat

ENV = "TPUCTL_CHIP_SAMPLE_S"


class Sampler:
    def __init__(self, every_s: float | None = None):
        self.every_s = float(os.environ.get(ENV) or 60.0) if every_s is None else every_s
        self._latest: dict | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.no_tpu = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="chip-sampler")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            got = hoststat.chips()
            if got == hoststat.NO_TPU:  # no service here: it does not appear later in a run
                self.no_tpu = True
                return
            with self._lock:
                self._latest = {"t": time.time(), "chips": got}
            if self._done.wait(self.every_s):
                return

    def take(self) -> dict | None:
        """The sample taken since the last take, if any."""
        with self._lock:
            s, self._latest = self._latest, None
        return s

    def close(self) -> None:
        self._done.set()


def over_run(records: list[dict]) -> dict[int, list[dict]]:
    """process -> [{t, step, chips}] from metrics.jsonl records (those with a sample)."""
    out: dict[int, list[dict]] = {}
    for r in sorted((r for r in records if r.get("hosts")), key=lambda r: r["step"]):
        for p, h in enumerate(r["hosts"]):
            if h and h.get("chips"):
                out.setdefault(p, []).append({"t": h["chips"]["t"], "step": r["step"], "chips": h["chips"]["chips"]})
    return out
