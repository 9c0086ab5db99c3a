"""Bound the time from a checkpoint bucket going away to the trainer's exit.

A checkpoint operation is bounded by its own deadline (checkpoint.StorageDeadline), but that clock starts when the
operation does: a bucket that dies during an async save, or while metrics.jsonl is rewritten, is noticed only
when the next operation's deadline runs out, seconds later than TPUCTL_STORAGE_TIMEOUT_S after the bucket went
away. This watch asks the bucket a cheap question (list one object under the run's prefix, google-cloud-storage)
every PROBE_S seconds while the run is saving to it, and stops the run once no answer has come for the budget less
a wait between probes, a probe's own timeout and the exit's slack: the exit then falls within the budget of the
last moment the bucket was known to answer, which is no later than the moment it went away.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

PROBE_S = 2.0          # between two questions
PROBE_TIMEOUT_S = 5.0  # one question's own bound (google-cloud-storage's timeout; no retries: the watch retries)
EXIT_SLACK_S = 2.0     # printing the line and exiting


class BucketWatch:
    def __init__(self, bucket: str, prefix: str, budget_s: float, on_silent: Callable[[float], None]):
        self.bucket, self.prefix, self.on_silent = bucket, prefix, on_silent
        # The silence is checked after each probe: once it reaches the limit, the run exits within the limit plus
        # one wait between probes, one probe that hangs to its timeout, and the exit's slack.
        self.limit = max(PROBE_S, budget_s - PROBE_S - PROBE_TIMEOUT_S - EXIT_SLACK_S)
        self.last_ok = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpuctl-bucket-watch", daemon=True)

    def start(self) -> "BucketWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _probe(self, client) -> bool:
        """Did the bucket answer? Listing one object needs only the permission checkpoints need anyway (a
        bucket's metadata would need storage.buckets.get, which object-only roles lack); any 4xx is an answer."""
        from google.api_core import exceptions as gx
        try:
            list(client.list_blobs(self.bucket, prefix=self.prefix, max_results=1, timeout=PROBE_TIMEOUT_S,
                                   retry=None))
            return True
        except gx.GoogleAPICallError as e:
            return e.code is not None and int(e.code) < 500
        except Exception:  # refused, reset, timed out: no answer
            return False

    def _run(self) -> None:
        try:
            from google.cloud import storage
            client = storage.Client()
        except Exception:  # no client here (no credentials): the operations' own deadlines still hold
            return
        while not self._stop.is_set():
            if self._probe(client):
                self.last_ok = time.monotonic()
            elif time.monotonic() - self.last_ok >= self.limit and not self._stop.is_set():
                self.on_silent(time.monotonic() - self.last_ok)
                return
            self._stop.wait(PROBE_S)
