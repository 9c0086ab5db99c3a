"""The launch bench: `tpuctl run` on a local slice of 1, 4, 16 real sshd hosts (orchestrator.jobs.runner.run_job).

Per host count: push+install time of this checkout's bundle (a cold dependency layer installed from the
machine's already-filled wheelhouse, so no download is timed, then a second run whose unchanged bundle
skips the install), and the time from the run's start to the first training step (gpt2-tiny over
N processes x 8/N devices; for 16 hosts a small command that needs no venv instead of the trainer).
Needs root and openssh-server, like the local slice itself.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP1 = re.compile(r"step\s+1/\d+")


class _Clock(io.TextIOBase):
    """The run's terminal output, kept, with the time the first line matching a pattern arrived."""

    def __init__(self, pattern: re.Pattern, t0: float):
        self.pattern, self.t0, self.hit, self.buf = pattern, t0, None, []
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            self.buf.append(s)
            if self.hit is None and self.pattern.search(s):
                self.hit = time.monotonic() - self.t0
        return len(s)

    def text(self) -> str:
        return "".join(self.buf)


def _push_summary(push: dict) -> str:
    """{worker: 'deps=installed app=installed ...' | 'cached'} -> 'deps installed on 1/4, app on 4/4'."""
    n = len(push)
    if all(v == "cached" for v in push.values()):
        return f"install skipped on {n}/{n}"
    deps = sum("deps=installed" in v for v in push.values())
    app = sum("app=installed" in v for v in push.values())
    return f"dependency layer installed by {deps}/{n}, app by {app}/{n}"


def _wheelhouse_root() -> Path:
    """The machine's wheelhouse: the tests' (already filled here) unless TPUCTL_BENCH_WHEELHOUSE says."""
    env = os.environ.get("TPUCTL_BENCH_WHEELHOUSE")
    if env:
        return Path(env)
    from bench import test_cache
    return test_cache() / "wheelhouse"


def bench(host_counts=(1, 4, 16), trainer_max_hosts: int = 4, say=print) -> None:
    from infra.local_slice import LocalSlice
    from orchestrator.jobs import bundle as B
    from orchestrator.jobs import launch as L
    from orchestrator.access.hosts import InstallOptions, SshConfig
    from orchestrator.jobs.runner import RunFailed, run_job
    from trainer.pretrain import prepare

    if os.geteuid() != 0 or not os.access("/usr/sbin/sshd", os.X_OK):
        say("[6] launch bench: skipped (needs root and /usr/sbin/sshd for the local slice)")
        return
    tmp = Path(tempfile.mkdtemp(prefix="tpuctl-bench-launch-", dir="/tmp"))
    try:
        t0 = time.monotonic()
        bundle = B.build(ROOT, cache_dir=tmp / "bundles")
        wh_root = _wheelhouse_root()
        cold_wh = not (wh_root / bundle.deps_hash[:16] / ".complete").exists()
        wh = B.fill_wheelhouse(bundle, wh_root, log=lambda m: say(f"    {m}"))
        corpus = sorted(prepare.default_corpus())[:2]  # two plays: enough tokens for a few steps
        tok_dir = tmp / "tok"
        prepare.prepare([str(p) for p in corpus], str(tok_dir))
        say(f"    bundle {bundle.short} built, wheelhouse {'filled now (download)' if cold_wh else 'already filled'}"
            f", data prepared: {time.monotonic() - t0:.0f} s")
        for n in host_counts:
            sl = LocalSlice.start(f"bench{n}", n, tmp / "slices", wheelhouse=wh_root, keep=(str(tmp),))
            try:
                workers = [L.Worker(h.index, h.ip) for h in sl.hosts]
                ssh = SshConfig(user=sl.ssh_user, key=sl.ssh_key, port=sl.hosts[0].port)
                # A cold dependency layer and uv cache per host count (the wheels themselves are local).
                install = InstallOptions(wheelhouse=str(wh), uv_cache=str(tmp / f"uv-{n}"), python=sl.python)
                layout = L.HostLayout(deps_root=str(tmp / f"deps-{n}"))
                trainer = n <= trainer_max_hosts
                if trainer:
                    argv = ["python", "-m", "trainer", "pretrain", "--preset", "gpt2-tiny",
                            "--emulate-devices", str(8 // n), "--mesh", "data=8,model=1", "--steps", "2",
                            "--data", str(tok_dir), "--ckpt-dir", str(tmp / f"ckpt-{n}"), "--ckpt-every", "0",
                            "--eval-every", "0", "--eval-batches", "1", "--log-every", "1"]
                    what, pattern = "first training step", STEP1
                else:
                    argv = ["python3", "-c", "import socket; print('hello from', socket.gethostname())"]
                    what, pattern = "first output of a small command", re.compile(r"hello from")
                rows = []
                for attempt in ("cold install", "unchanged bundle"):
                    if trainer:
                        shutil.rmtree(tmp / f"ckpt-{n}", ignore_errors=True)
                    t1 = time.monotonic()
                    out = _Clock(pattern, t1)
                    try:
                        r = run_job(workers, L.LaunchSpec(argv, distributed=trainer), ssh=ssh,
                                    run_dir=tmp / f"run-{n}-{len(rows)}", bundle=bundle, install=install,
                                    layout=layout, out=out)
                    except RunFailed as e:
                        tail = "\n".join(out.text().splitlines()[-15:])
                        say(f"[6] {n} host(s): the run failed ({e}); last lines:\n{tail}")
                        break
                    rows.append((attempt, r.timings, out.hit, time.monotonic() - t1, r.push))
                for attempt, tm, hit, total, push in rows:
                    state = _push_summary(push)
                    say(f"[6] {n:2d} host(s), {attempt:16s}: preflight {tm.get('preflight_s', 0):5.1f} s, "
                        f"push+install {tm.get('push_s', 0):5.1f} s ({state}), run -> {what} "
                        f"{hit if hit is not None else float('nan'):5.1f} s, whole run {total:5.1f} s")
            finally:
                sl.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    from bench.devices import emulate
    emulate(8)
    counts = tuple(int(a) for a in sys.argv[1:]) or (1, 4, 16)
    bench(counts)
