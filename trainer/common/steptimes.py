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

KEY = "tpuctl_steptimes"
GATHER_TIMEOUT_S = 30.0
# A process is the straggler when it dispatched last in more than half of the recent logged steps, each time at
# least this long after the median process (clocks of hosts agree to a few ms under NTP).
MARGIN_S = 0.02
RECENT = 10


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


def lags(hosts: list[dict | None]) -> list[float | None]:
    """Each process's dispatch time after the median process's, in seconds (None: no record)."""
    ts = [h["dispatch_t"] for h in hosts if h and h.get("dispatch_t") is not None]
    if not ts:
        return [None] * len(hosts)
    mid = statistics.median(ts)
    return [None if not h or h.get("dispatch_t") is None else h["dispatch_t"] - mid for h in hosts]


def straggler(records: list[dict], recent: int = RECENT, margin_s: float = MARGIN_S) -> dict | None:
    """From metrics.jsonl records (those with `hosts` from 2+ processes, the last `recent`): the process that
    dispatched last in most of them by more than margin_s after the median, as {process, lag_s (median of its
    lags there), steps (how many), of (out of), input_bound (its input wait was most of its lag)}; or None."""
    rows = [r for r in records if len([h for h in (r.get("hosts") or []) if h]) >= 2][-recent:]
    if not rows:
        return None
    late: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        lag = lags(r["hosts"])
        known = [(lg, p) for p, lg in enumerate(lag) if lg is not None]
        worst, p = max(known)
        if worst > margin_s:
            late.setdefault(p, []).append((worst, r["hosts"][p].get("input_wait_s") or 0.0))
    if not late:
        return None
    p, hits = max(late.items(), key=lambda kv: len(kv[1]))
    if len(hits) * 2 <= len(rows):
        return None
    lag = statistics.median(h[0] for h in hits)
    wait = statistics.median(h[1] for h in hits)
    return {"process": p, "lag_s": lag, "steps": len(hits), "of": len(rows), "input_bound": wait >= 0.5 * lag}
