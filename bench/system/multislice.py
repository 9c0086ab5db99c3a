"""Multislice's bench: the step time of one job on 2 slices (dcn=2 x data=4) against 1 slice (data=8) with the same
8 devices, processes and global batch. Two trainer processes of 4 emulated CPU devices each, joined by
jax.distributed on loopback, with (2 slices) or without (1 slice) the MEGASCALE_* environment `tpuctl run` gives a
multislice job's hosts; the configurations alternate, and each step time is the median of a run's steps after its
first few. On CPU this shows the cost of the extra mesh axis (the hierarchical gradient reduction), not of a
data-center network.

    python -m bench.system.multislice
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS, SKIP = 16, 4  # timed: the steps after the first SKIP (compile, caches)
# --vocab-parallel off in both: its auto choice differs (on for one slice, never across slices) and would be what
# the ratio measures instead of the mesh.
ARGS = ["pretrain", "--preset", "gpt2-tiny", "--seq-len", "64", "--batch-size", "16", "--vocab-parallel", "off",
        "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0", "--steps", str(STEPS)]
CONFIGS = (("1 slice, data=8,model=1", 1, "data=8,model=1"), ("2 slices x data=4,model=1", 2, "data=4,model=1"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp: Path, data: str, slices: int, mesh: str, tag: str) -> float:
    """One 2-process run; the median step time of its steps after SKIP."""
    port, ckpt = _port(), tmp / tag
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCTL_", "MEGASCALE_")) and k != "XLA_FLAGS"}
    procs = []
    for i in range(2):
        env = {**base, "JAX_PLATFORMS": "cpu", "TPUCTL_EMULATE_DEVICES": "4", "TPUCTL_CACHE": str(tmp / "cache"),
               "TPUCTL_COORDINATOR": f"127.0.0.1:{port}", "TPUCTL_NUM_PROCESSES": "2", "TPUCTL_PROCESS_ID": str(i),
               "TPUCTL_HEARTBEAT_TIMEOUT_S": "60", "TPUCTL_INIT_TIMEOUT_S": "300"}
        if slices > 1:
            env.update(MEGASCALE_COORDINATOR_ADDRESS="127.0.0.1", MEGASCALE_NUM_SLICES=str(slices),
                       MEGASCALE_SLICE_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer", *ARGS, "--mesh", mesh, "--data", data,
                                       "--ckpt-dir", str(ckpt)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=1200)[1] for p in procs]
    finally:
        for p in procs:  # the other one of a pair whose partner failed or hung
            p.kill()
            p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{tag} failed: {errs[0][-800:]}")
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] > SKIP)


def main(say=print, rounds: int = 2) -> dict:
    say(f"[13] gpt2-tiny (seq 64, global batch 16), {STEPS} steps, 2 processes x 4 CPU devices: one slice vs two "
        "slices of the same devices; median step time after step "
        f"{SKIP}, {rounds} alternated round(s)")
    with tempfile.TemporaryDirectory(prefix="tpuctl-bench-ms-") as d:
        tmp = Path(d)
        data = str(tmp / "data")
        prep = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--out", data], capture_output=True,
                              text=True, timeout=600)
        if prep.returncode:
            say(f"  prepare failed: {prep.stderr[-500:]}")
            return {}
        times: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
        for r in range(rounds):
            for name, slices, mesh in CONFIGS:
                try:
                    times[name].append(_run(tmp, data, slices, mesh, f"r{r}-{slices}"))
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # e.g. gloo's 30 s set-up on a loaded machine
                    say(f"  round {r + 1}, {name}: failed ({str(e).splitlines()[-1][:200]}); not counted")
    if not all(times.values()):
        say("  no comparison: a configuration never completed")
        return {}
    out = {name: statistics.median(ts) for name, ts in times.items()}
    (one, t1), (two, t2) = out.items()
    say(f"  {one}: {t1 * 1e3:.1f} ms/step; {two}: {t2 * 1e3:.1f} ms/step; 2 slices / 1 slice = {t2 / t1:.2f}x "
        "(CPU: the extra axis, not DCN)")
    return out


if __name__ == "__main__":
    main()
