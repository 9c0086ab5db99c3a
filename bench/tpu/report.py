"""The chip check's table and verdicts from its rows (plain dicts: a run's JSON reads back the same)."""
from __future__ import annotations

PLAN_TOLERANCE = 0.15  # the plan's step within 15% of the chip's
SPEEDUP_GOAL = 1.9     # ours against the seed's tok/s at batch 16
LORA_MFU_GOAL = 0.70   # each LoRA row's MFU


def _find(rows, section, name):
    return next((r for r in rows if r["section"] == section and r["name"] == name), None)


def calibrate(rows: list[dict]) -> dict | None:
    """This run's rates by class (trainer/common/calibration.Rates' fields) from the classes section, and the
    elementwise rate from the default batch-16 step: its time left after the other classes' at their rates,
    against its elementwise bytes. None without both."""
    from bench.tpu import classes
    from bench.tpu.common import Row
    measured = classes.rates([Row(**r) for r in rows if r["section"] == "classes"])
    ref = _find(rows, "steps", "ours, batch 16") or _find(rows, "steps", "ours, batch 8")
    need = ("matmul_flops_s", "attention_flops_s", "loss_kernel_flops_s")
    if not ref or not ref.get("step_s") or "work" not in ref["figures"] or any(k not in measured for k in need):
        return None
    from trainer.common import calibration
    rates = calibration.Rates(measured["matmul_flops_s"], measured["attention_flops_s"],
                              measured["loss_kernel_flops_s"], 0.0, source="this run")
    w = ref["figures"]["work"]
    known = calibration.estimate(w, rates)["step_s"]
    rest = ref["step_s"] - known
    other = w["other_bytes"] / rest if rest > 0 and w.get("other_bytes") else 0.0
    return {**measured, "other_bytes_s": other, "other_from": ref["name"]}


def _replan(about: dict, rows: list[dict]) -> None:
    """Each row's plan time from its work at trainer/common/calibration.py's rates as they are now (a record read
    back is priced by the current table, not by the one it was taken with)."""
    from trainer.common import calibration, chips
    kind = about.get("device_kind", "")
    rates = calibration.for_kind(kind, chips.PEAK_FLOPS.get(kind), chips.HBM_BYTES_S.get(kind))
    for r in rows:
        if rates is not None and "work" in (r.get("figures") or {}):
            r["plan_s"] = calibration.estimate(r["figures"]["work"], rates)["step_s"]


def build(about: dict, rows: list[dict], failed: dict) -> dict:
    from trainer.common import calibration
    _replan(about, rows)
    summary = {}
    ours, seed = _find(rows, "steps", "ours, batch 16"), _find(rows, "steps", "seed, batch 16")
    if ours and seed and ours.get("tokens_per_s") and seed.get("tokens_per_s"):
        summary["ours_over_seed_b16"] = ours["tokens_per_s"] / seed["tokens_per_s"]
    lora = [r for r in rows if r["section"] == "lora" and r.get("tokens_per_s")]
    peers = {r["name"]: r for r in lora if (r.get("figures") or {}).get("peer")}
    summary["lora_mfu"] = {r["name"]: r["mfu"] for r in lora if r.get("mfu") and r["name"] not in peers}
    summary["lora_over_peer"] = {}
    for pname, p in peers.items():
        mine = next((r for r in lora if r["name"] not in peers and pname.startswith("tunix ")
                     and r["name"] == pname[len("tunix "):].split(" (")[0]), None)
        if mine:
            summary["lora_over_peer"][mine["name"]] = mine["tokens_per_s"] / p["tokens_per_s"]
    checks = [r for r in rows if r.get("ok") is not None]
    summary["checks_passed"] = sum(1 for r in checks if r["ok"])
    summary["checks"] = len(checks)
    cal = calibrate(rows)
    summary["calibration_this_run"] = cal
    errors = {}
    own = calibration.Rates(cal["matmul_flops_s"], cal["attention_flops_s"], cal["loss_kernel_flops_s"],
                            cal["other_bytes_s"], source="this run") if cal and cal.get("other_bytes_s") else None
    for r in rows:
        if r.get("plan_s") and r.get("step_s"):
            errors[r["name"]] = {"table": r["plan_s"] / r["step_s"] - 1}
            if own is not None and "work" in r["figures"]:
                est = calibration.estimate(r["figures"]["work"], own)["step_s"]
                errors[r["name"]]["this_run"] = est / r["step_s"] - 1
    summary["plan_errors"] = errors
    return {"about": about, "rows": rows, "failed": failed, "summary": summary}


def _f(v, fmt, scale=1.0):
    return "" if v is None else format(v * scale, fmt)


HEAD = f"{'row':58s} {'tok/s':>9s} {'MFU':>6s} {'step ms':>8s} {'plan ms':>8s} {'plan':>6s} {'HBM GiB':>7s} " \
       f"{'compile s':>9s} {'check':>5s}  note"


def row_line(r: dict) -> str:
    """One row of the table (printed as each row is measured, and in the table at the end)."""
    err = r["plan_s"] / r["step_s"] - 1 if r.get("plan_s") and r.get("step_s") else None
    return (f"{r['name'][:58]:58s} {_f(r.get('tokens_per_s'), ',.0f'):>9s} "
            f"{_f(r.get('mfu'), '.1f', 100):>6s} {_f(r.get('step_s'), '.1f', 1e3):>8s} "
            f"{_f(r.get('plan_s'), '.1f', 1e3):>8s} {_f(err, '+.0%') if err is not None else '':>6s} "
            f"{_f(r.get('hbm_bytes'), '.2f', 2 ** -30):>7s} {_f(r.get('compile_s'), '.1f'):>9s} "
            f"{'' if r.get('ok') is None else ('ok' if r['ok'] else 'FAIL'):>5s}  {r.get('note', '')}")


def render(data: dict) -> str:
    a = data["about"]
    lines = [f"tpu-check on {a.get('devices')} x {a.get('device_kind')} ({a.get('backend')}), "
             + ", ".join(f"{k} {v}" for k, v in a.get("versions", {}).items()) + f", {a.get('date')}"
             + (" (--quick: figures mean nothing)" if a.get("quick") else "")]
    section = None
    for r in data["rows"]:
        if r["section"] != section:
            section = r["section"]
            lines += ["", f"[{section}]", HEAD]
        lines.append(row_line(r))
    s = data["summary"]
    lines.append("")
    for name, x in s.get("lora_over_peer", {}).items():
        lines.append(f"ours / tunix's PeftTrainer with qwix LoRA, {name}: {x:.2f}x tok/s")
    for name, m in s.get("lora_mfu", {}).items():
        lines.append(f"LoRA MFU, {name}: {m:.1%} ({'at or above' if m >= LORA_MFU_GOAL else 'BELOW'} "
                     f"{LORA_MFU_GOAL:.0%})")
    if "ours_over_seed_b16" in s:
        x = s["ours_over_seed_b16"]
        lines.append(f"ours / seed at batch 16: {x:.2f}x tok/s ({'at or above' if x >= SPEEDUP_GOAL else 'BELOW'} "
                     f"{SPEEDUP_GOAL}x)")
    lines.append(f"checks: {s['checks_passed']} of {s['checks']} passed")
    if s.get("plan_errors"):
        worst = max(abs(e["table"]) for e in s["plan_errors"].values())
        lines.append(f"plan (trainer/common/calibration.py's rates) against the chip: worst {worst:.0%} "
                     f"({'within' if worst <= PLAN_TOLERANCE else 'OUTSIDE'} ±{PLAN_TOLERANCE:.0%})")
        if any("this_run" in e for e in s["plan_errors"].values()):
            worst = max(abs(e["this_run"]) for e in s["plan_errors"].values() if "this_run" in e)
            lines.append(f"plan at this run's own rates: worst {worst:.0%}")
    cal = s.get("calibration_this_run")
    if cal:
        att = ", ".join(f"head_dim {d}: {r / 1e12:.1f}" for d, r in sorted(cal["attention_flops_s"].items(),
                                                                         key=lambda kv: int(kv[0])))
        lines.append(f"this run's rates: matmul {cal['matmul_flops_s'] / 1e12:.1f} TFLOP/s, splash ({att}) TFLOP/s, "
                     f"loss kernels {cal['loss_kernel_flops_s'] / 1e12:.1f} TFLOP/s, elementwise "
                     f"{cal['other_bytes_s'] / 1e9:.0f} GB/s of counted bytes (from {cal['other_from']}), HBM "
                     f"{cal.get('hbm_bytes_s', 0) / 1e9:.0f} GB/s")
    for name, why in data.get("failed", {}).items():
        lines.append(f"section {name} FAILED: {why}")
    return "\n".join(lines)
