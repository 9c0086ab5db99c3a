"""One host's live figures for `tpuctl top`: `python -m trainer hoststat`, run beside the host's trainer.

Everything comes from where it is measured, never estimated:
- the step, its time and tokens/s: this process's own `TPUCTL_PROGRESS` lines in the run's host log (hostwrap's
  `beside` names the log in TPUCTL_RUN_LOG);
- the straggler: `steptimes.straggler` over the run's `metrics.jsonl` (every process's record of each logged
  step, which only the shared --ckpt-dir holds; one host alone cannot tell who is late);
- host CPU (over SAMPLE_S) and memory: /proc;
- each chip's duty cycle and HBM: libtpu's RuntimeMetricService, read by `tpu-info`'s client on the ports of
  TPU_RUNTIME_METRICS_PORTS; where none answers, "no TPU" (CPU hosts, local mode), never a made-up number.

Jax-free: it runs while the trainer holds the devices.
"""
from __future__ import annotations

import json
import os
import socket
import time

from trainer.common import steptimes

NO_TPU = "no TPU"
PROGRESS = "TPUCTL_PROGRESS "
LOG_ENV = "TPUCTL_RUN_LOG"
METRICS_PORTS_ENV = "TPU_RUNTIME_METRICS_PORTS"
TAIL_BYTES = 256 * 1024   # enough for well over RECENT progress lines and metrics.jsonl records
SAMPLE_S = 0.25


def _tail(f, size: int | None) -> str:
    if size is not None and size > TAIL_BYTES:
        f.seek(size - TAIL_BYTES)
        data = f.read()
        data = data[data.find(b"\n") + 1:]  # the first line may be cut
    else:
        data = f.read()
    return data.decode("utf-8", "replace")


def progress(log: str, recent: int = steptimes.RECENT) -> list[dict]:
    """This process's last `recent` progress records from the host log: {step, dispatch_t, input_wait_s,
    stalled_s, step_time_s, tokens_per_s?} (fields as floats; the first word is the step)."""
    try:
        with open(log, "rb") as f:
            text = _tail(f, os.path.getsize(log))
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if not line.startswith(PROGRESS):
            continue
        rec = {}
        for word in line[len(PROGRESS):].split():
            k, _, v = word.partition("=")
            try:
                rec[k] = int(v) if k == "step" else float(v)
            except ValueError:
                pass
        if "step" in rec:
            out.append(rec)
    return out[-recent:]


def run_records(ckpt_dir: str | None, recent: int = steptimes.RECENT) -> list[dict]:
    """The last metrics.jsonl records of the run (local or gs://); [] when there is none yet."""
    if not ckpt_dir:
        return []
    from trainer.pretrain import storage
    path = storage.join(ckpt_dir, "metrics.jsonl")
    try:
        with storage.open(path, "rb") as f:
            text = _tail(f, storage.size(path))
    except (OSError, FileNotFoundError):
        return []
    recs = []
    for line in text.splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            pass
    return recs[-4 * recent:]


def cpu_mem() -> dict:
    """Host CPU busy % over SAMPLE_S (all cores) and memory in use (total - available), from /proc."""
    def ticks():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # all, idle + iowait
    out: dict = {}
    try:
        t0, i0 = ticks()
        time.sleep(SAMPLE_S)
        t1, i1 = ticks()
        out["cpu_pct"] = round(100.0 * (1 - (i1 - i0) / max(t1 - t0, 1)), 1)
    except (OSError, ValueError, IndexError):
        out["cpu_pct"] = None
    try:
        mem = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                mem[k] = int(v.split()[0]) * 1024
        out["mem_used_bytes"] = mem["MemTotal"] - mem["MemAvailable"]
        out["mem_total_bytes"] = mem["MemTotal"]
    except (OSError, ValueError, KeyError):
        out["mem_used_bytes"] = out["mem_total_bytes"] = None
    return out


def chips(ports: str | None = None) -> list[dict] | str:
    """Each chip's duty cycle and HBM from libtpu's metrics service (tpu-info's client), on the first port of
    TPU_RUNTIME_METRICS_PORTS that answers; "no TPU" when none does or tpu-info is not installed."""
    ports = os.environ.get(METRICS_PORTS_ENV, "") if ports is None else ports
    try:
        import grpc
        from tpu_info import device, metrics
    except ImportError:
        return NO_TPU
    chip_type, _ = device.get_local_chips()
    for port in [p.strip() for p in ports.split(",") if p.strip()]:
        addr = f"localhost:{port}"
        try:
            # tpu-info's own choice: with the chip known its duty cycle is spread over the chip's cores; without
            # one (nothing on the PCI bus says which) the service's per-device answer is taken as it is.
            usage = metrics.get_chip_usage(chip_type, addr=addr) if chip_type else \
                metrics.get_chip_usage_new(chip_type, addr=addr)
        except grpc.RpcError:
            continue
        if usage:
            return [{"device": u.device_id, "duty_cycle_pct": u.duty_cycle_pct, "hbm_used_bytes": u.memory_usage,
                     "hbm_total_bytes": u.total_memory} for u in usage]
    return NO_TPU


def snapshot(log: str | None, ckpt_dir: str | None, process: int) -> dict:
    """One host's figures (the JSON line `hoststat` prints; docs/CONTRACTS.md)."""
    mine = progress(log) if log else []
    last = mine[-1] if mine else {}
    records = run_records(ckpt_dir)
    tokens = last.get("tokens_per_s")
    if tokens is None and last:  # a trainer whose progress lines do not carry it: the run's record of that step
        tokens = next((r.get("tokens_per_s") for r in reversed(records) if r.get("step") == last["step"]), None)
    return {"host": socket.gethostname(), "process": process, "run_id": os.environ.get("TPUCTL_RUN_ID"),
            "step": last.get("step"), "step_time_s": last.get("step_time_s"), "tokens_per_s": tokens,
            **cpu_mem(), "chips": chips(), "straggler": steptimes.straggler(records) if records else None,
            "time": time.time()}
