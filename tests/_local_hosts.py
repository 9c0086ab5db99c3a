"""Helpers for tests on a local slice (real sshd hosts): start/stop, SSH, what runs on each host."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _skips import needs_setup
from infra.local_slice import SSHD, LocalSlice, ns_members
from orchestrator.access.hosts import SshConfig
from orchestrator.jobs.launch import Worker

# The wheelhouse, uv cache and dependency layers are a machine-wide cache (as $TPUCTL_HOME/wheelhouse is for
# users): filled once per dependency list, then reused by every test run on this machine. So are the XLA compile
# caches: jax/ for trainer processes here (conftest.py), wheelhouse/xla-cache for the local slices' hosts.
TEST_CACHE = Path(os.environ["TPUCTL_TEST_CACHE"])  # conftest.py sets it


# Local hosts need root (namespaces) and openssh-server (`make setup` installs it); CI has both, and there a
# missing one fails the tests (tests/_skips.py).
needs_hosts = needs_setup(os.geteuid() != 0 or not os.access(SSHD, os.X_OK),
                          "a local slice needs root (its hosts' namespaces; CI runs as root) and /usr/sbin/sshd "
                          "(openssh-server: `make sys-deps`)")


def start(name: str, n: int, base: Path) -> LocalSlice:
    return LocalSlice.start(name, n, base, wheelhouse=TEST_CACHE / "wheelhouse")


def workers(s: LocalSlice) -> list[Worker]:
    return [Worker(h.index, h.ip) for h in s.hosts]


def ssh_config(s: LocalSlice) -> SshConfig:
    return SshConfig(user=s.ssh_user, key=s.ssh_key, port=s.hosts[0].port)


def ssh(s: LocalSlice, i: int, command: str, check: bool = True) -> subprocess.CompletedProcess:
    h = s.hosts[i]
    return subprocess.run(["ssh", "-i", s.ssh_key, "-p", str(h.port), "-o", "StrictHostKeyChecking=no",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
                           f"{s.ssh_user}@{h.ip}", command],
                          capture_output=True, text=True, timeout=60, check=check, stdin=subprocess.DEVNULL)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def host_processes(s: LocalSlice, i: int) -> list[tuple[int, str]]:
    """Everything alive in host i's PID namespace except its sshd listener (PID 1 there)."""
    h = s.hosts[i]
    return [(p, cmdline(p)) for p in ns_members(h.pidns, h.init_pid) if p != h.init_pid]


def wait_idle(s: LocalSlice, timeout: float = 15.0) -> dict[int, list[tuple[int, str]]]:
    """Wait until no host runs anything but sshd's listener; returns what is left (empty when clean).

    SSH sessions take a moment to end after their command does, so this polls instead of checking once.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = {i: host_processes(s, i) for i in range(len(s.hosts))}
        left = {i: p for i, p in left.items() if p}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@contextlib.contextmanager
def local_mode(home: Path, mp: pytest.MonkeyPatch):
    """Local mode in a private TPUCTL_HOME with no ambient project or endpoint: its own TPU API stand-in, started
    here; on the way out every recorded slice is downed, every local slice stopped and the stand-in killed.
    Yields the environment a `tpuctl` subprocess should get."""
    from infra.local_slice import LocalSlice
    from orchestrator import state
    from orchestrator.provider import local as local_provider
    mp.setenv("TPUCTL_HOME", str(home))
    mp.setenv("TPUCTL_POLL_S", "0.05")
    mp.setenv("CLOUDSDK_CONFIG", str(home / "gcloud"))
    for var in ("GOOGLE_CLOUD_PROJECT", "TPUCTL_PROJECT", "CLOUDSDK_CORE_PROJECT", "TPUCTL_TPU_API_ENDPOINT"):
        mp.delenv(var, raising=False)
    url = local_provider.api_url()
    info = json.loads((home / "local" / "fake_tpu_api.json").read_text())
    try:
        yield dict(os.environ), url
    finally:
        for name in list(state.records()):
            subprocess.run([sys.executable, "-m", "orchestrator.cli", "down", name, "--local"],
                           capture_output=True, timeout=120, env=dict(os.environ))
        for s in LocalSlice.ls():
            s.stop()
        os.kill(info["pid"], signal.SIGKILL)
        try:
            os.waitpid(info["pid"], 0)
        except ChildProcessError:
            pass
