"""Each process's own record of a logged step, and the straggler they name.

In a synchronous step every process waits for the slowest one, so every process measures the same step time;
the slow one is the one that dispatches its steps last. At each logged step every process records when it
dispatched the step (`dispatch_t`, its own wall clock, time.time()) and how long it waited for its input batch
before that (`input_wait_s`). Process 0 gathers them through the coordination service (no device collective)
into the step's metrics.jsonl record as `hosts`, a list indexed by process id (null: a process whose record did
not arrive in time). Every process also prints its own on its `TPUCTL_PROGRESS` line (docs/CONTRACTS.md).

Jax-free but for `gather` (the report reads `straggler` without jax).
"""
from __future__ import annotations

import json
import statistics
import threading
import time

KEY = "tpuctl_steptimes"
GATHER_TIMEOUT_S = 30.0
# The straggler is late by more than this on average over the recent logged steps, beyond the other processes'
# median (hosts' clocks agree to a few ms under NTP; a stall shorter than StallClock's min_s is not counted).
MARGIN_S = 0.02
RECENT = 10


class StallClock:
    """A daemon thread that sleeps `tick_s` at a time and adds up how much later than asked it woke, where that is
    over `min_s`: the time this process was not running. A thread waiting in a collective sleeps in the kernel and
    leaves this thread free to tick; a stopped or starved process stops it too."""

    def __init__(self, tick_s: float = 0.01, min_s: float = 0.05):
        self.tick_s, self.min_s = tick_s, min_s
        self._stalled, self._lock, self._stop = 0.0, threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpuctl-stall-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            late = now - last - self.tick_s
            if late > self.min_s:
                with self._lock:
                    self._stalled += late
            last = now

    def take(self) -> float:
        """Seconds stalled since the previous take()."""
        with self._lock:
            out, self._stalled = self._stalled, 0.0
        return out

    def close(self) -> None:
        self._stop.set()


def gather(step: int, mine: dict, timeout_s: float = GATHER_TIMEOUT_S) -> list[dict | None]:
    """Every process's record of `step` on process 0 (others get []). One process: [mine]."""
    import jax
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None or jax.process_count() < 2:
        return [mine]
    key = f"{KEY}/{step}/"
    client.key_value_set(key + str(jax.process_index()), json.dumps(mine), allow_overwrite=True)
    if jax.process_index() != 0:
        return []
    out: list[dict | None] = []
    for p in range(jax.process_count()):
        try:
            out.append(json.loads(client.blocking_key_value_get(key + str(p), int(timeout_s * 1000))))
            client.key_value_delete(key + str(p))
        except Exception:  # noqa: BLE001 - its heartbeat stops the job if it is gone; the record is just missing
            out.append(None)
    return out


def _beyond_others(values: list[float | None]) -> list[float | None]:
    """Each value minus the median of the other processes' (None stays None)."""
    known = [(p, v) for p, v in enumerate(values) if v is not None]
    out: list[float | None] = [None] * len(values)
    for p, v in known:
        others = [w for q, w in known if q != p]
        if others:
            out[p] = v - statistics.median(others)
    return out


def lags(hosts: list[dict | None]) -> list[float | None]:
    """Each process's dispatch time after the other processes' median, in seconds (None: no record)."""
    return _beyond_others([h.get("dispatch_t") if h else None for h in hosts])


def stalls(hosts: list[dict | None]) -> list[float | None]:
    """Each process's stall beyond the other processes' median, in seconds (None: no record)."""
    return _beyond_others([(h.get("stalled_s") or 0.0) if h else None for h in hosts])


def straggler(records: list[dict], recent: int = RECENT, margin_s: float = MARGIN_S) -> dict | None:
    """From metrics.jsonl records (those with `hosts` from 2+ processes and no trace started or stopped, the last
    `recent`): the process most late
    on average, where that average is over margin_s. A process's lateness at a step is the later of its dispatch
    after the other processes' median and its stall beyond theirs (0 if neither). Returns {process, lag_s (its
    median lateness over the steps it was late by over margin_s), steps (how many), of (out of), input_bound (its
    input wait there was at least half of that), stalled (its stalls were)}, or None."""
    # A step whose interval held a trace's start or stop (--profile) is left out: each host pays its own.
    rows = [r for r in records if len([h for h in (r.get("hosts") or []) if h]) >= 2
            and not any(h and h.get("profiler_s") for h in r["hosts"])][-recent:]
    if not rows:
        return None
    late: dict[int, list[tuple[float, float, float]]] = {}
    for r in rows:
        for p, (lg, st) in enumerate(zip(lags(r["hosts"]), stalls(r["hosts"]))):
            if lg is not None:
                late.setdefault(p, []).append((max(lg, st, 0.0), r["hosts"][p].get("input_wait_s") or 0.0, st))
    p, seen = max(late.items(), key=lambda kv: sum(x[0] for x in kv[1]))
    if sum(x[0] for x in seen) / len(rows) <= margin_s:
        return None
    hits = [x for x in seen if x[0] > margin_s]
    lag, wait, stall = (statistics.median(h[i] for h in hits) for i in range(3))
    return {"process": p, "lag_s": lag, "steps": len(hits), "of": len(rows), "input_bound": wait >= 0.5 * lag,
            "stalled": stall >= 0.5 * lag}
