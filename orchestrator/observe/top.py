"""`tpuctl top NAME`: one row per host of the live run (step, step time, tokens/s, each chip's duty cycle and
HBM, host CPU and memory) and the straggler named, refreshed every 2 s; `--once` one table, `--json` one
snapshot.

Each host's row is what `python -m trainer hoststat` measured there, beside the trainer (docs/CONTRACTS.md);
chips show "no TPU" where libtpu's metrics service does not answer (CPU hosts), never a made-up number.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Callable, TextIO

from orchestrator.access.reach import SshFlags
from orchestrator.observe.live import LiveRun, open_live

INTERVAL_S = 2.0
HOSTSTAT = ["-m", "trainer", "hoststat"]
NO_TPU = "no TPU"


def snapshot(live: LiveRun, timeout: float = 60.0) -> dict:
    """Every host's figures now, and the straggler (docs/verbs.md `top --json`)."""
    rows, straggler = [], None
    for i, b in enumerate(live.beside(HOSTSTAT, timeout)):
        stat = None
        if b.rc == 0:
            try:
                stat = json.loads(b.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                b.error = "hoststat printed no JSON"
        row = {"worker": b.worker, "host": None, "process": i, "step": None, "step_time_s": None,
               "tokens_per_s": None, "cpu_pct": None, "mem_used_bytes": None, "mem_total_bytes": None,
               "chips": None, "error": None}
        if stat is None:
            row["error"] = b.error or f"exit {b.rc}"
        else:
            row.update({k: stat.get(k) for k in row if k in stat and k != "worker"})
            if straggler is None and stat.get("straggler"):
                straggler = stat["straggler"]
        rows.append(row)
    if straggler is not None:
        p = straggler["process"]
        straggler = {"worker": rows[p]["worker"] if p < len(rows) else f"process {p}", **straggler}
    return {"name": live.name, "run_id": live.run_id, "time": time.time(), "hosts": rows, "straggler": straggler}


def _gib(n) -> str:
    return f"{n / 2**30:.1f}"


def _chips(chips) -> str:
    if chips is None:
        return "?"
    if chips == NO_TPU or isinstance(chips, str):
        return str(chips)
    return "  ".join(f"{c['device']}:{c['duty_cycle_pct']:.1f}% {_gib(c['hbm_used_bytes'])}/"
                     f"{_gib(c['hbm_total_bytes'])}G" for c in chips)


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render(snap: dict) -> str:
    """The table `top` shows: a title, one row per host, the straggler line."""
    head = ["WORKER", "STEP", "STEP TIME", "TOK/S", "CPU", "MEM GiB", "CHIPS (duty, HBM used/total)"]
    rows = []
    for r in snap["hosts"]:
        if r.get("error"):
            rows.append([r["worker"], "-", "-", "-", "-", "-", f"not answering: {r['error']}"])
            continue
        mem = "-" if r.get("mem_used_bytes") is None else f"{_gib(r['mem_used_bytes'])}/{_gib(r['mem_total_bytes'])}"
        rows.append([r["worker"], _num(r.get("step"), "d"),
                     "-" if r.get("step_time_s") is None else f"{r['step_time_s'] * 1000:.0f} ms",
                     _num(r.get("tokens_per_s"), ",.0f"), "-" if r.get("cpu_pct") is None else f"{r['cpu_pct']:.0f}%",
                     mem, _chips(r.get("chips"))])
    widths = [max(len(str(x[c])) for x in [head, *rows]) for c in range(len(head))]
    lines = [f"run {snap['run_id']} on {snap['name']}  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}",
             ""]
    lines += ["  ".join(str(x[c]).ljust(widths[c]) for c in range(len(head))).rstrip() for x in [head, *rows]]
    s = snap.get("straggler")
    if s:
        cause = "input (waiting for its batch)" if s.get("input_bound") else \
            "stalled (the process itself not running)" if s.get("stalled") else "not its input"
        lines.append(f"\nstraggler: {s['worker']} (process {s['process']}), {s['lag_s'] * 1000:.0f} ms late in "
                     f"{s['steps']} of the last {s['of']} logged steps; cause: {cause}")
    else:
        lines.append("\nstraggler: none (no host late by over 20 ms on average in the recent steps)")
    return "\n".join(lines)


def top(name: str, flags: SshFlags = SshFlags(), *, out: TextIO = sys.stdout, as_json: bool = False,
        once: bool = False, interval: float = INTERVAL_S, note: Callable[[str], None] = lambda m: None,
        refreshes: int | None = None) -> dict:
    """`tpuctl top`: --json prints one snapshot, --once one table; else the table every `interval` seconds
    until Ctrl-C (or `refreshes` tables). Returns the last snapshot."""
    with open_live(name, flags, note) as live:
        live.needs_trainer("top", "its step, step time, tokens/s, chips or straggler: they come from the trainer's "
                                  "own progress lines and metrics, and hoststat runs in its environment")
        n = 0
        while True:
            t0 = time.monotonic()
            snap = snapshot(live)
            if as_json:
                out.write(json.dumps(snap) + "\n")
                return snap
            if not once and out.isatty():
                out.write("\x1b[H\x1b[2J")  # redraw in place
            out.write(render(snap) + "\n")
            out.flush()
            n += 1
            if once or (refreshes is not None and n >= refreshes):
                return snap
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
