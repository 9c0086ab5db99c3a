"""`tpuctl run` across a spot preemption, on slices from `up --local` (real sshd hosts, the TPU API stand-in).

A preemption here is what the cloud does: the node goes PREEMPTED (the stand-in's control call) and its VMs die
(the test SIGKILLs the hosts' namespaces, or the stand-in stops them as it preempts the node). The raw command learns
it is on its second attempt from a marker in a directory every host shares (outside /root and /tmp).
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from _local_hosts import local_mode, needs_hosts
from infra.fake_tpu_api import FakeControl
from infra.local_slice import LocalSlice
from orchestrator import state

pytestmark = [needs_hosts, pytest.mark.e2e]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private TPUCTL_HOME with its own stand-in; stopped (and every slice downed) at the end."""
    home = tmp_path_factory.mktemp("suphome")
    with pytest.MonkeyPatch.context() as mp, local_mode(home, mp) as (environ, url):
        yield environ, FakeControl(url)


@pytest.fixture
def marker():
    d = tempfile.mkdtemp(prefix="tpuctl-sup-", dir="/var/tmp")  # shared by every local host
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _up(name, environ):
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", name, "--local", "-a", "v4-16"],
                       capture_output=True, text=True, timeout=120, env=environ)
    assert r.returncode == 0, r.stderr
    return state.lookup(name).node


def _creates(ctl, node):
    return sum(1 for c in ctl.state()["create_calls"] if str(c).count(node.rsplit("/", 1)[-1]))


def _second_attempt_cmd(marker):
    """First attempt: mark, say ready, sleep (to be preempted). Second attempt: succeed."""
    m = f"{marker}/first-$TPUCTL_PROCESS_ID"
    return ["sh", "-c", f"if [ -e {m} ]; then echo second attempt; else touch {m}; echo ready; sleep 300; fi"]


def _run_until_ready(name, environ, argv, flags=()):
    """Start `tpuctl run NAME --raw` and return (process, output so far) once every worker said ready."""
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.run_verbs", "run", name, "--local", *flags, "--raw",
                          "--", *argv], env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    guard = threading.Timer(90, os.killpg, (p.pid, signal.SIGKILL))  # never wait on a hung run
    guard.start()
    seen, out = set(), []
    for line in p.stdout:
        out.append(line)
        if line.rstrip().endswith("] ready"):
            seen.add(line[:4])
        if len(seen) == 2:
            break
    guard.cancel()
    assert len(seen) == 2, "".join(out)
    return p, out


def _finish(p, out):
    try:
        rest = p.communicate(timeout=180)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, "".join(out) + rest


def test_a_preempted_slice_is_recreated_and_the_command_runs_again(env, marker):
    environ, ctl = env
    node = _up("sup-a", environ)
    p, out = _run_until_ready("sup-a", environ, _second_attempt_cmd(marker))
    try:
        ctl.preempt(node)
        assert LocalSlice.load("sup-a") is None  # the VMs died with the preemption: the stand-in stopped them
    finally:
        rc, text = _finish(p, out)
    assert rc == 0, text
    assert "VM was preempted; recreating sup-a (1/3)" in text, text
    assert text.count("] second attempt") == 2, text
    assert "done on 2 host(s)" in text
    assert _creates(ctl, node) == 2
    s = LocalSlice.load("sup-a")
    assert s is not None and all(s.alive())  # the fresh hosts, ready for the next run


def test_a_crash_on_a_ready_slice_is_not_retried(env):
    environ, ctl = env
    node = _up("sup-b", environ)
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.run_verbs", "run", "sup-b", "--local", "--raw", "--",
                        "sh", "-c", "exit $((TPUCTL_PROCESS_ID * 3))"],
                       capture_output=True, text=True, timeout=120, env=environ)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "worker w1" in r.stderr and "exit 3" in r.stderr, r.stderr
    assert "recreating" not in r.stdout + r.stderr
    assert _creates(ctl, node) == 1


def test_on_preemption_fail_stops_and_says_how_to_recreate(env, marker):
    """The stand-in stops the node's hosts when it preempts it, as the cloud kills the VMs: the run sees its
    hosts go and finds the slice lost."""
    environ, ctl = env
    node = _up("sup-c", environ)
    p, out = _run_until_ready("sup-c", environ, _second_attempt_cmd(marker), ["--on-preemption", "fail"])
    try:
        ctl.preempt(node)
    finally:
        rc, text = _finish(p, out)
    assert rc == 1, text
    assert "was preempted (--on-preemption fail): `tpuctl down sup-c` and `tpuctl up sup-c ...` again" in text, text
    assert "second attempt" not in text and _creates(ctl, node) == 1


def test_max_restarts_bounds_the_recreations(env, marker):
    environ, ctl = env
    node = _up("sup-d", environ)
    p, out = _run_until_ready("sup-d", environ, _second_attempt_cmd(marker), ["--max-restarts", "0"])
    ctl.config(suspend_s=60)  # the service has not started deleting the terminated node yet
    try:
        ctl.preempt(node, "TERMINATED")
    finally:
        rc, text = _finish(p, out)
        ctl.config(suspend_s=0)
    assert rc == 1, text
    assert "was terminated; not recreating sup-d: 0 restart(s) used of --max-restarts 0" in text, text
    assert "second attempt" not in text and _creates(ctl, node) == 1


def test_a_slice_preempted_between_runs_is_recreated_by_the_next_run(env):
    """Under a queued resource: QR SUSPENDING -> SUSPENDED, node DELETING -> gone; `run` recreates and goes on."""
    environ, ctl = env
    node = _up("sup-e", environ)
    ctl.preempt(node)
    for _ in range(200):
        s = ctl.state()
        if not any(n["name"] == node for n in s["nodes"]):
            break
    qr = [q for q in ctl.state()["queued_resources"] if q["name"].endswith("/sup-e")][0]
    assert qr["state"]["state"] == "SUSPENDED" and qr["history"][-2:] == ["SUSPENDING", "SUSPENDED"]
    assert [g["history"] for g in ctl.state()["gone"] if g["name"] == node][-1][-2:] == ["PREEMPTED", "DELETING"]
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.run_verbs", "run", "sup-e", "--local", "--raw", "--",
                        "echo", "after"], capture_output=True, text=True, timeout=120, env=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sup-e's VMs were preempted before this run; recreating sup-e (1/3)" in r.stdout + r.stderr
    assert (r.stdout + r.stderr).count("] after") == 2 and _creates(ctl, node) == 2
