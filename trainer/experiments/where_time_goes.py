"""The report's "where the time goes" section of one run: the profile summary of each profiled window (from the
trace, trainer/experiments/profiles.py), per-host step time over the run with the straggler named (from each
process's own records in metrics.jsonl, trainer/common/steptimes.py), and the compiler's expected step time
beside the measured one when a plan is given (`tpuctl plan --json`). Each figure names its source.

Jax-free.
"""
from __future__ import annotations

import json
import statistics

from trainer.common import chipstats, steptimes
from trainer.common.config import UsageError


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


def host_step_times(records: list[dict]) -> dict[int, list[tuple[int, float]]]:
    """process -> [(step, its own step time)]: the time between its dispatches of two logged steps, over the
    steps between them, on its own clock."""
    out: dict[int, list[tuple[int, float]]] = {}
    prev: dict[int, tuple[int, float]] = {}
    for r in sorted((r for r in records if r.get("hosts")), key=lambda r: r["step"]):
        for p, h in enumerate(r["hosts"]):
            if not h or h.get("dispatch_t") is None:
                continue
            if p in prev and r["step"] > prev[p][0]:
                out.setdefault(p, []).append((r["step"], (h["dispatch_t"] - prev[p][1]) / (r["step"] - prev[p][0])))
            prev[p] = (r["step"], h["dispatch_t"])
    return out


def read_plan(path: str | None) -> dict | None:
    """A `tpuctl plan --json` object (local or gs://), or None."""
    if not path:
        return None
    from etils import epath
    p = epath.Path(path)
    if not p.exists():
        raise UsageError(f"--plan {path} does not exist (write one with "
                         "`tpuctl plan -a TYPE --json -- CMD ... > FILE`)")
    try:
        return json.loads(p.read_text())
    except ValueError:
        raise UsageError(f"--plan {path} is not JSON: pass the output of `tpuctl plan --json`") from None


def section(ckpt_dir: str, records: list[dict], plan: dict | None = None, read_profiles: bool = True) -> dict:
    """{"text": the section, "windows": the profile summaries, "straggler": ..., "hosts": per-host step times}."""
    lines = []
    windows = []
    if read_profiles:
        from trainer.experiments import profiles
        try:
            windows = profiles.summarize_run(ckpt_dir)
        except UsageError as e:  # no xprof here: the rest of the report still stands
            found = profiles.sessions(ckpt_dir)
            lines.append(f"{len(found)} profiled window(s) under {ckpt_dir}/profiles, not read: {e}")
            windows = []
        for w in windows:
            lines.append("From the trace (xprof, per host; each host's source named below):")
            lines.append(profiles.describe(w))
    if not windows and not lines:
        lines.append("No profile: `--profile START:END` on pretrain or lora traces those steps on every host.")
    times = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float))]
    measured = statistics.median(times[1:] or times) if times else None
    if measured is not None:
        lines.append(f"Measured by the training loop (metrics.jsonl, wall clock of process 0): median step "
                     f"{measured * 1e3:.1f} ms over {len(times)} logged step(s), the first left out.")
    timing = (plan or {}).get("timing") or {}
    if timing.get("step_s_at_peak"):
        lines.append(f"Expected by the compiler's plan (tpuctl plan, {plan.get('accelerator', '?')}): "
                     f"{timing['step_s_at_peak'] * 1e3:.1f} ms at the chips' peak, {timing['step_s_at_mfu'] * 1e3:.1f} "
                     f"ms at {100 * timing.get('mfu_assumed', 0):.0f}% MFU"
                     + (f" (measured / plan at that MFU: {measured / timing['step_s_at_mfu']:.2f}x)" if measured
                        else ""))
    elif plan is not None:
        lines.append("The plan gives no step time (compiled for CPU devices: no peak to divide by).")
    per_host = host_step_times(records)
    strag = steptimes.straggler(records)
    if len(per_host) > 1:
        med = {p: statistics.median(v for _, v in xs) for p, xs in per_host.items()}
        lines.append("Per host, from each host's own dispatch times (metrics.jsonl hosts): median step " + ", ".join(
            f"process {p} {t * 1e3:.1f} ms" for p, t in sorted(med.items())))
        if strag:
            cause = ("its input batch (it waited for it)" if strag["input_bound"] else
                     "the host itself: it was not running (stopped, descheduled or paused)" if strag["stalled"] else
                     "late dispatches, not its input and not a stall")
            lines.append(f"Straggler: process {strag['process']}, late in {strag['steps']} of the last {strag['of']} "
                         f"logged steps by {_ms(strag['lag_s'])} (median) beyond the other hosts; cause: {cause}")
        else:
            lines.append("No straggler: no host was late on average over the last logged steps by more than "
                         f"{_ms(steptimes.MARGIN_S)} beyond the other hosts (dispatch or stall).")
    chips = chipstats.over_run(records)
    if not chips:
        lines.append("Chips: no TPU (no host's libtpu metrics service answered: CPU hosts record no chip use).")
    for p, samples in sorted(chips.items()):
        duty = [c["duty_cycle_pct"] for s_ in samples for c in s_["chips"] if c.get("duty_cycle_pct") is not None]
        hbm = [(c["hbm_used_bytes"], c["hbm_total_bytes"]) for s_ in samples for c in s_["chips"]
               if c.get("hbm_total_bytes")]
        text = f"Chips of process {p} (libtpu's runtime metrics, sampled {len(samples)} time(s) from step " \
               f"{samples[0]['step']} to {samples[-1]['step']}):"
        if duty:
            text += f" duty cycle median {statistics.median(duty):.0f}%, min {min(duty):.0f}%"
        if hbm:
            used, total = max(hbm)
            text += f"; HBM at most {used / 2**30:.2f} of {total / 2**30:.2f} GiB per chip"
        lines.append(text)
    return {"text": "\n".join(lines), "windows": windows, "straggler": strag,
            "hosts": {str(p): xs for p, xs in per_host.items()},
            "chips": {str(p): xs for p, xs in chips.items()}}
