"""Where a profiled window's time went, per host, read with xprof's own converters (not a trace parser of ours).

Each host's `<host>.xplane.pb` under `CKPT_DIR/profiles/RUN_ID/plugins/profile/<session>/` (trainer/common/
profiling.py) goes through `xprof.convert.raw_to_tool_data.xspace_to_tool_data`:
- On TPU and GPU, xprof's `overview_page` splits each step into device compute, device collectives (and
  device-to-device) and the rest (host compute, input, launch, idle); `hlo_stats` gives every HLO op's self
  time and category, from which the top ops and the collectives by kind (all-reduce, all-gather,
  reduce-scatter, all-to-all) come.
- On the CPU backend (local mode) xprof has no device planes: `overview_page` still gives each step's time
  (the trainer's step annotations), but its device columns and `hlo_stats` are empty. There the split comes
  from xprof's `trace_viewer` events of the XLA:CPU ops (each carries `hlo_op` and `device_ordinal`): per
  device, the time covered by compute ops, by collective ops (not under a compute op), and the rest of the step
  (host, input, idle); averaged over the process's devices.
Every figure here comes from the trace. The compiler's plan (`tpuctl plan`) is another source, named as such by
the report.

Jax-free; xprof is imported when a profile is read (the `profile` extra of pyproject.toml).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile

from trainer.common.config import UsageError

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
OTHER_COLLECTIVES = ("collective-permute", "collective-broadcast", "send", "recv")
TOP = 10


def kind_of(op: str, category: str = "") -> str | None:
    """The collective an HLO op (or xprof category) is, or None for compute: 'all-reduce.3',
    'all-gather-start', 'reduce-scatter-done.1' -> their kind; other collectives -> 'other collective'."""
    for name in (category or "", op or ""):
        base = re.sub(r"(-start|-done)?(\.\d+)*$", "", name.strip().lower().replace("_", "-"))
        if base in COLLECTIVES:
            return base
        if base in OTHER_COLLECTIVES:
            return "other collective"
    return None


# --- finding them ------------------------------------------------------------------------------------

def sessions(ckpt_dir: str) -> list[dict]:
    """Every profiled window under --ckpt-dir: [{run, session, dir, hosts: {host: path}}], oldest run first."""
    from etils import epath
    root = epath.Path(ckpt_dir) / "profiles"
    if not root.exists():
        return []
    out = []
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        base = run / "plugins" / "profile"
        if not base.exists():
            continue
        for s in sorted(p for p in base.iterdir() if p.is_dir()):
            hosts = {f.name[:-len(".xplane.pb")]: str(f) for f in sorted(s.iterdir()) if f.name.endswith(".xplane.pb")}
            if hosts:
                out.append({"run": run.name, "session": s.name, "dir": str(s), "hosts": hosts})
    return out


def window_of(session: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"steps_(\d+)_(\d+)", session)
    return (int(m.group(1)), int(m.group(2))) if m else None


# --- xprof -------------------------------------------------------------------------------------------

def _xprof():
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        raise UsageError("reading profiles needs xprof: pip install 'tpuctl[profile]' (make setup installs it)") \
            from None
    return raw_to_tool_data


@contextlib.contextmanager
def _quiet():
    """xprof's native library logs through its own copy of TSL's logging, which reads TF_CPP_MIN_LOG_LEVEL when the
    library loads: INFO lines for every tool it serves, and an ERROR line for tools it serves by another route ("No
    UnifiedProfileProcessor registered for tool: trace_viewer") that are not errors at all. While it loads the
    level is 3 (fatal only), then put back for anything else that reads it. A real failure still reaches
    us: as the converter's exception, or as no data."""
    old = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
        else:
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = old


def tool(path: str, name: str):
    """xprof's `name` tool for one .xplane.pb, as parsed JSON.

    The file is converted from a folder of its own (a link to it, or a local copy of a gs:// file): xprof writes
    `ALL_HOSTS.op_stats_v2.pb` beside the file it converts and answers every later conversion of any file in that
    folder from it, so with several hosts' traces in one session folder (our layout) every host would read the
    first one's figures."""
    with _quiet():
        convert = _xprof()
    tmp = tempfile.mkdtemp(prefix="tpuctl-xplane-")
    try:
        local = os.path.join(tmp, os.path.basename(path))
        if "://" in path:
            from etils import epath
            with open(local, "wb") as f:
                f.write(epath.Path(path).read_bytes())
        else:
            os.symlink(os.path.abspath(path), local)
        data, _ = convert.xspace_to_tool_data([local], name, {})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not data:
        return None
    return json.loads(data.decode() if isinstance(data, bytes) else data)


def _table(t: dict) -> list[dict]:
    """A gviz DataTable (cols + rows) as dicts keyed by column id."""
    ids = [c["id"] for c in t.get("cols", [])]
    return [{k: (c or {}).get("v") for k, c in zip(ids, r.get("c", []))} for r in t.get("rows", [])]


def _overview(path: str) -> tuple[str, dict, list[dict]]:
    """(hardware type, the step table's properties, its per-step rows) of xprof's overview_page. The step table
    is the one with a `stepnum` column: on TPU its columns are tcComputeTimeMs, tcIdleTimeMs, tcInfeedTimeMs, ...
    and its properties carry active_steptime_ms_average; elsewhere deviceComputeTimeMs, ..., stepTimeMs."""
    tables = tool(path, "overview_page") or []
    hardware = next(((t.get("p") or {}).get("hardware_type") for t in tables
                     if (t.get("p") or {}).get("hardware_type")), "")
    for t in tables:
        ids = {c["id"] for c in t.get("cols", [])}
        if "stepnum" in ids and ({"stepTimeMs", "tcComputeTimeMs"} & ids):
            return hardware, t.get("p") or {}, _table(t)
    return hardware, {}, []


def _step_of(label) -> int | None:
    m = re.search(r"(\d+)\s*$", str(label or ""))
    return int(m.group(1)) if m else None


# --- one host ---------------------------------------------------------------------------------------

MEAN_KEYS = ("step_s", "compute_s", "collective_s", "input_s", "idle_s")


def summarize(path: str, host: str = "") -> dict:
    """One host's trace: {host, hardware, source, steps: [{step, step_s, compute_s, collective_s, input_s,
    idle_s}], mean (the same, averaged over the steps), device_step_s (TPU: xprof's active step, the device's
    time per step; else None), categories ({xprof op category: share of op time}), collectives ({kind: s per
    step}), top_ops ([{op, category, self_s (per step), share, flop_s (achieved FLOP/s, where xprof has it)}])}."""
    hardware, props, rows = _overview(path)
    if rows and "tcComputeTimeMs" in rows[0]:
        out = _tpu_split(path, props, rows)
    elif hardware and hardware != "CPU_ONLY":
        out = _device_split(path, rows)
    else:
        out = _cpu_split(path, rows)
    n = max(1, len(out["steps"]))
    for st in out["steps"]:
        st.setdefault("input_s", 0.0)
    out["mean"] = {k: sum(st[k] for st in out["steps"]) / n for k in MEAN_KEYS}
    out.setdefault("device_step_s", None)
    out.setdefault("categories", {})
    out.update(host=host or os.path.basename(path)[:-len(".xplane.pb")], hardware=hardware or "unknown")
    return out


def _s(row: dict, ms_column: str) -> float:
    return float(row.get(ms_column) or 0.0) / 1e3


def _hlo_ops(path: str) -> list[dict]:
    stats = tool(path, "hlo_stats") or {}
    return _table(stats if isinstance(stats, dict) else (stats[0] if stats else {}))


def _op_tables(ops: list[dict], n_steps: int) -> dict:
    """From hlo_stats' rows (every op of the trace, each with its self time in µs): the collectives by kind and
    the top ops, per step, and each category's share of all op time (as hlo_stats' own percentages add up)."""
    n = max(1, n_steps)
    total = sum(float(o.get("total_self_time") or 0.0) for o in ops) or 1.0
    by_kind: dict[str, float] = {}
    categories: dict[str, float] = {}
    top = []
    for o in sorted(ops, key=lambda o: -float(o.get("total_self_time") or 0.0)):
        us = float(o.get("total_self_time") or 0.0)
        category = o.get("category") or ""
        categories[category] = categories.get(category, 0.0) + us / total
        kind = kind_of(o.get("hlo_op_name") or "", category)
        if kind:
            by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e6 / n
        if len(top) < TOP:
            rate = float(o.get("model_flop_rate") or 0.0)  # GFLOP/s, 0 where the op does no counted work
            top.append({"op": o.get("hlo_op_name"), "category": category, "self_s": us / 1e6 / n,
                        "share": us / total, "flop_s": rate * 1e9 if rate > 0 else None,
                        "name": o.get("tf_op_name") or ""})
    return {"collectives": by_kind, "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "top_ops": top}


_TPU_INPUT = ("tcInfeedTimeMs", "scv0InfeedTimeMs", "tcOutfeedTimeMs", "hostTransferTimeMs")


def _tpu_split(path: str, props: dict, rows: list[dict]) -> dict:
    """TPU: xprof's step table (the TensorCore's compute, input and idle per step), its active step (the device's
    own time per step, the overview's active_steptime_ms_average) and hlo_stats' ops. The collectives run on
    the TensorCore too: their share of its compute comes from hlo_stats."""
    ops = _op_tables(_hlo_ops(path), len(rows))
    coll_per_step = sum(ops["collectives"].values())
    steps = []
    for r in rows:
        m = re.search(r"Step time = ([0-9.]+) ms", str(r.get("tooltip") or ""))
        busy = _s(r, "tcComputeTimeMs") + _s(r, "scv0ComputeTimeMs")
        inp = sum(_s(r, c) for c in _TPU_INPUT)
        idle = _s(r, "tcIdleTimeMs")
        step_s = float(m.group(1)) / 1e3 if m else busy + inp + idle
        coll = min(busy, coll_per_step)
        steps.append({"step": _step_of(r.get("stepnum")), "step_s": step_s, "compute_s": busy - coll,
                      "collective_s": coll, "input_s": inp, "idle_s": max(0.0, step_s - busy - inp)})
    active = str(props.get("active_steptime_ms_average") or "").strip()
    device_step = float(active) / 1e3 if active else (
        sum(st["compute_s"] + st["collective_s"] for st in steps) / max(1, len(steps)))
    return {"source": "xprof overview_page (TPU step table, active step) and hlo_stats (ops)", "steps": steps,
            "device_step_s": device_step, **ops}


def _device_split(path: str, rows: list[dict]) -> dict:
    """GPU: xprof's own step breakdown and HLO op statistics."""
    steps = []
    for r in rows:
        step_s, compute = _s(r, "stepTimeMs"), _s(r, "deviceComputeTimeMs")
        coll = _s(r, "deviceCollectivesTimeMs") + _s(r, "deviceToDeviceTimeMs")
        inp = _s(r, "infeedTimeMs") + _s(r, "outfeedTimeMs")
        steps.append({"step": _step_of(r.get("stepnum")), "step_s": step_s, "compute_s": compute,
                      "collective_s": coll, "input_s": inp, "idle_s": max(0.0, step_s - compute - coll - inp)})
    return {"source": "xprof overview_page (step breakdown) and hlo_stats (ops)", "steps": steps,
            **_op_tables(_hlo_ops(path), len(steps))}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _minus(iv: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """iv without cut (both unions)."""
    out = []
    for a, b in iv:
        pieces = [(a, b)]
        for c, d in cut:
            pieces = [q for p, r in pieces for q in ((p, min(r, c)), (max(p, d), r)) if q[1] > q[0]]
        out += pieces
    return out


def _cpu_split(path: str, rows: list[dict]) -> dict:
    """XLA:CPU: the op events of xprof's trace_viewer inside each annotated step, per device."""
    trace = tool(path, "trace_viewer") or {}
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = sorted((e for e in events if "step_num" in (e.get("args") or {})), key=lambda e: e["ts"])
    ops = [e for e in events if "hlo_op" in (e.get("args") or {}) and "device_ordinal" in e["args"]]
    xprof_step_s = {_step_of(r.get("stepnum")): float(r.get("stepTimeMs") or 0.0) / 1e3 for r in rows}
    steps, per_op, by_kind = [], {}, {}
    for m in marks:
        t0, t1 = m["ts"], m["ts"] + m["dur"]
        step = _step_of(m["args"].get("step_num"))
        devices: dict[str, dict[str, list]] = {}
        for e in ops:
            a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
            if b <= a:
                continue
            kind = kind_of(e["args"]["hlo_op"])
            d = devices.setdefault(e["args"]["device_ordinal"], {"compute": [], "collective": []})
            d["collective" if kind else "compute"].append((a, b))
            per_op.setdefault(e["args"]["hlo_op"], [kind, 0.0])[1] += (b - a) / 1e6
            if kind:
                by_kind[kind] = by_kind.get(kind, 0.0) + (b - a) / 1e6
        step_s = xprof_step_s.get(step) or m["dur"] / 1e6
        n_dev = max(1, len(devices))
        compute = coll = 0.0
        for d in devices.values():
            c = _union(d["compute"])
            compute += _length(c) / 1e6 / n_dev
            coll += _length(_minus(_union(d["collective"]), c)) / 1e6 / n_dev
        steps.append({"step": step, "step_s": step_s, "compute_s": compute, "collective_s": coll,
                      "idle_s": max(0.0, step_s - compute - coll)})
    n, n_dev = max(1, len(steps)), max(1, len({e["args"]["device_ordinal"] for e in ops}))
    total = sum(v for _, v in per_op.values()) or 1.0
    top = [{"op": op, "category": kind or "compute", "self_s": s / n / n_dev, "share": s / total}
           for op, (kind, s) in sorted(per_op.items(), key=lambda kv: -kv[1][1])[:TOP]]
    return {"source": "xprof overview_page (step times) and trace_viewer (XLA:CPU ops per device)", "steps": steps,
            "collectives": {k: v / n / n_dev for k, v in by_kind.items()}, "top_ops": top}


# --- a run's windows, as text -----------------------------------------------------------------------

def summarize_run(ckpt_dir: str) -> list[dict]:
    """Every profiled window of the run: [{run, session, window, hosts: [summarize(...)]}]."""
    return [{"run": s["run"], "session": s["session"], "window": window_of(s["session"]),
             "hosts": [summarize(p, h) for h, p in s["hosts"].items()]} for s in sessions(ckpt_dir)]


def _t(s: float) -> str:
    """Seconds for people: ms from 1 ms up, else µs."""
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def describe(win: dict) -> str:
    """One window as report text: per host the split of its mean step, its op categories and collectives, its
    top ops (with their achieved FLOP/s where xprof has them)."""
    w = win["window"]
    head = (f"run {win['run']}, steps {w[0]} to {w[1] - 1}" if w else f"run {win['run']}, session {win['session']}")
    lines = [head]
    for h in win["hosts"]:
        m = h["mean"]

        def pct(v: float, step: float = m["step_s"]) -> str:
            return f"{100 * v / step:.0f}%" if step else "-"
        device = (f"device step {_t(h['device_step_s'])} (xprof's active step); " if h.get("device_step_s") else "")
        lines.append(f"{h['host']} ({h['hardware']}): {device}step {_t(m['step_s'])} = compute {_t(m['compute_s'])} "
                     f"({pct(m['compute_s'])}) + collectives {_t(m['collective_s'])} ({pct(m['collective_s'])}) + "
                     f"input {_t(m.get('input_s', 0.0))} ({pct(m.get('input_s', 0.0))}) + "
                     f"host/idle {_t(m['idle_s'])} ({pct(m['idle_s'])}), mean of {len(h['steps'])} step(s)")
        if h.get("categories"):
            lines.append(category_line(h["categories"]))
        if h["collectives"]:
            lines.append("  collectives per step: " + ", ".join(
                f"{k} {_t(v)}" for k, v in sorted(h["collectives"].items(), key=lambda kv: -kv[1])))
        lines += top_op_lines(h["top_ops"])
        lines.append(f"  source: {h['source']}")
    return "\n".join(lines)


def category_line(categories: dict) -> str:
    """summarize's op categories as a report line: the six largest shares of op time."""
    return "  op time by category: " + ", ".join(
        f"{k or '?'} {100 * v:.1f}%" for k, v in list(categories.items())[:6] if v >= 0.001)


def top_op_lines(ops: list[dict], names: bool = False) -> list[str]:
    """summarize's top ops as report lines, each with its achieved FLOP/s where xprof has it; names: each followed
    by its jax op name (which says what in the model it computes)."""
    lines = []
    for i, op in enumerate(ops, 1):
        rate = f", {op['flop_s'] / 1e12:.0f} TFLOP/s" if (op.get("flop_s") or 0) >= 0.5e12 else ""
        lines.append(f"  {i:>2}. {op['op']} [{op['category']}] {_t(op['self_s'])}/step, "
                     f"{100 * op['share']:.1f}% of op time{rate}" + (f"  {op.get('name') or ''}" if names else ""))
    return lines
