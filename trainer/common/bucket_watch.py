"""Bound the time from a checkpoint bucket going away to the trainer's exit.

A checkpoint operation is bounded by its own deadline (checkpoint.StorageDeadline), but that clock starts when the
operation does: a bucket that dies during an async save, or while metrics.jsonl is rewritten, is noticed only
when the next operation's deadline runs out, seconds later than TPUCTL_STORAGE_TIMEOUT_S after the bucket went
away. This watch asks the bucket a cheap question (its metadata, google-cloud-storage) every PROBE_S seconds
while the run is saving to it, and stops the run once no answer has come for the budget less the probe's own
time: the exit then falls within the budget of the last moment the bucket was known to answer, which is no later
than the moment it went away.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

PROBE_S = 2.0          # between two questions
PROBE_TIMEOUT_S = 5.0  # one question's own bound (google-cloud-storage's timeout; no retries: the watch retries)
EXIT_SLACK_S = 2.0     # printing the line and exiting


class BucketWatch:
    def __init__(self, bucket: str, budget_s: float, on_silent: Callable[[float], None]):
        self.bucket, self.on_silent = bucket, on_silent
        self.limit = max(PROBE_S, budget_s - PROBE_TIMEOUT_S - EXIT_SLACK_S)
        self.last_ok = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpuctl-bucket-watch", daemon=True)

    def start(self) -> "BucketWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _probe(self, client) -> bool:
        try:
            client.bucket(self.bucket).reload(timeout=PROBE_TIMEOUT_S, retry=None)
            return True
        except Exception:  # refused, timed out, 5xx, or the bucket deleted: no answer for a checkpoint
            return False

    def _run(self) -> None:
        from google.cloud import storage
        client = storage.Client()
        while not self._stop.is_set():
            if self._probe(client):
                self.last_ok = time.monotonic()
            elif time.monotonic() - self.last_ok >= self.limit and not self._stop.is_set():
                self.on_silent(time.monotonic() - self.last_ok)
                return
            self._stop.wait(PROBE_S)
