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
import time
from pathlib import Path

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


def _wait(what, fn, timeout=120.0, every=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := fn():
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def test_max_restarts_is_one_budget_across_controllers_that_die_mid_recovery(env, tmp_path):
    """A managed job with --max-restarts 1. Its first controller (the real `python -m orchestrator.jobs.controller`)
    sees the slice preempted, begins the recreate and is SIGKILLed before the slice is back (the stand-in's delete
    is slowed so the kill lands there). The second controller takes the job from the bucket and finishes that
    recreate as the same restart (1/1, not 2), runs the command again, and at the next preemption fails the job:
    its budget is the job's, spent by the first controller. The recovery the first controller watched is in the
    record, and the stretch nobody watched is recovery too, in goodput."""
    from infra import gcs
    from orchestrator.jobs.store import LIVE, JobStore, new_job_id
    environ, ctl = env
    node = _up("sup-j", environ)
    emu = gcs.start(buckets=("sup-jobs",))  # recorded in the machine dir: the controllers reach this one
    cenv = {**environ, **emu.env}
    jid, controllers = new_job_id(), []
    with pytest.MonkeyPatch.context() as mp:
        for k, v in emu.env.items():
            mp.setenv(k, v)
        store = JobStore("sup-jobs")
        rec = state.lookup("sup-j")
        spec = {"id": jid, "name": "sup-j", "slice_name": "sup-j", "kind": "run", "submitted": time.time(),
                "command": ["sh", "-c", "echo ready; sleep 300"], "project": rec.project, "zone": rec.zone,
                "bucket": "sup-jobs", "total_steps": None, "price_per_hour": 0.0, "secrets": {},
                "opts": {"raw": True, "max_restarts": 1, "on_preemption": "recreate"}}
        store.put_slice(jid, rec.to_json())
        store.put_spec(jid, spec)
        runs = Path(environ["TPUCTL_HOME"]) / "runs" / "sup-j"

        def controller():
            with open(tmp_path / f"ctl{len(controllers)}.log", "w") as log:
                p = subprocess.Popen([sys.executable, "-m", "orchestrator.jobs.controller", "--bucket", "sup-jobs",
                                      "--project", rec.project, "--zone", rec.zone, "--provider", "local",
                                      "--poll-s", "0.5"], env=cenv, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            controllers.append(p)
            return p

        def ready_run(seen):  # a run dir not seen before where both hosts said ready
            for d in runs.glob("*") if runs.is_dir() else []:
                if d.name not in seen and all((d / f"w{i}.log").exists() and "ready" in (d / f"w{i}.log").read_text()
                                              for i in (0, 1)):
                    return d.name
            return None

        try:
            first = controller()
            run1 = _wait("the first run", lambda: ready_run(set()))
            # The preempted node takes 9 s to go (the recreate waits on it): room for the record of the recovery
            # so far (written at the controller's next sync, within 3 s) and the kill, on a loaded machine.
            ctl.config(deleting_s=9)
            ctl.preempt(node)
            _wait("the restart begun, and written as it goes", lambda: (s := store.state(jid) or {}).get(
                "restart_pending") and s["attempts"][-1]["outcome"] == "recovering")
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            assert _creates(ctl, node) == 1  # it died before the recreate's create
            st = store.state(jid)
            assert st["state"] == "RECOVERING" and st["recoveries"] == 1, st
            ctl.config(deleting_s=0.1)
            controller()
            _wait("the second run", lambda: ready_run({run1}), timeout=180)
            ctl.preempt(node)
            st = _wait("the job's end", lambda: (s := store.state(jid)) and s["state"] not in LIVE and s)
            log = store.logs(jid)["controller.log"].decode()
        finally:
            for p in controllers:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            from orchestrator.provider.local import stop_service
            stop_service("compute")  # the controllers' instance look-ups started it
            emu.stop()
    assert st["state"] == "FAILED" and "1 restart(s) used of --max-restarts 1" in st["message"], (st, log)
    assert st["recoveries"] == 1 and not st["restart_pending"], st
    assert "recreating sup-j (1/1, the same restart)" in log and "(2/1" not in log, log
    assert _creates(ctl, node) == 2  # the first and the one recreate: no third slice
    first_a, cut, second_a = st["attempts"]
    assert first_a["outcome"] == second_a["outcome"] == "preempted", st["attempts"]
    # The recovery the first controller watched until it died: in the record, as lost time.
    assert cut["outcome"] == "unfinished" and cut["recover_s"] > 0 and cut["run_id"] is None, cut
    # From the first controller's last write to the second's first attempt: the slice was being recovered.
    assert second_a["unwatched"] == "recovering" and second_a["unwatched_s"] > 0, second_a
    g = st["goodput"]
    assert g["restarts"] == 1 and g["unwatched_s"] == second_a["unwatched_s"], g
    assert g["lost_to_preemptions_s"] >= second_a["unwatched_s"] + cut["recover_s"], g
    # What is left unaccounted is the bookkeeping between writes: a few syncs (3 s each) of the two controllers, and
    # far less than the stretch nobody watched when the machine is quiet; on a loaded one the syncs are the bound
    # (5.2 and 5.7 s seen at a load of 4-13, against unwatched stretches of 5.1 and 2.4 s).
    assert 0 <= g["unaccounted_s"] < max(second_a["unwatched_s"] / 2, 3 * 3.0), g
