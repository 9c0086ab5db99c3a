"""`run` over real SSH on a local slice: fail fast, SIGKILL, secrets, quoting, push once per hash, Ctrl-C, ssh/logs.

Most commands here are small python3 one-liners run by the host's own python3 under tpuctl's wrapper
(no bundle): they exercise exactly the launch, watch and stop paths the trainer takes.
"""
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from _local_hosts import cmdline, host_processes, ssh, ssh_config, start, wait_idle, workers, needs_hosts
from infra import gcs
from orchestrator.jobs import bundle as B
from orchestrator.cli import run_verbs as cli_run
from orchestrator.access.hosts import HostError
from orchestrator.cli.app import cli as cli_main
from orchestrator.jobs.launch import LaunchSpec
from orchestrator.jobs.runner import RunFailed, Watch, run_job, shared_install

pytestmark = needs_hosts

ROOT = Path(__file__).resolve().parents[1]
ID = "int(os.environ['TPUCTL_PROCESS_ID'])"


@pytest.fixture(scope="module")
def sl(tmp_path_factory):
    s = start("runs", 3, tmp_path_factory.mktemp("slices"))
    yield s
    s.stop()


@pytest.fixture
def clean(sl):
    yield
    assert wait_idle(sl) == {}, "processes left on the hosts"


def py(code: str) -> list[str]:
    return ["python3", "-c", "import os, sys, time, json\n" + code]


def _run(sl, argv, tmp_path, **kw):
    """run_job with LaunchSpec's and Watch's fields given as keywords too."""
    out = io.StringIO()
    spec = LaunchSpec(argv, **{k: kw.pop(k) for k in list(kw) if k in LaunchSpec.__dataclass_fields__})
    watch = Watch(**{k: kw.pop(k) for k in list(kw) if k in Watch.__dataclass_fields__})
    try:
        r = run_job(workers(sl), spec, ssh=ssh_config(sl), run_dir=tmp_path / "run", out=out, watch=watch, **kw)
    except RunFailed as e:
        return e, out.getvalue()
    return r, out.getvalue()


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()
    return t, box


def _wait_logs(run_dir: Path, n: int, marker: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((run_dir / f"w{i}.log").exists() and marker in (run_dir / f"w{i}.log").read_text() for i in range(n)):
            return
        time.sleep(0.05)
    raise AssertionError(f"not every host printed {marker!r}")


def test_first_failure_stops_every_other_host_and_names_the_worker(sl, tmp_path, clean):
    e, out = _run(sl, py(f"i = {ID}; print('hello from', i, flush=True)\n"
                         "if i == 1: time.sleep(1); print('w1 gives up', flush=True); sys.exit(3)\n"
                         "time.sleep(300)"), tmp_path)
    assert isinstance(e, RunFailed)
    r = e.result
    assert r.failed_worker == 1 and r.exit_codes[1] == 3 and r.returncode == 3
    assert r.exit_codes[0] != 0 and r.exit_codes[2] != 0  # stopped, not finished
    assert "worker w1" in str(e) and "FAILED: worker w1" in out
    assert re.search(r"---- w1 .*last \d+ lines ----\n(\[w1\] .*\n)*\[w1\] w1 gives up", out)
    for i in range(3):
        assert f"[w{i}] hello from {i}" in out
        assert f"hello from {i}" in (tmp_path / "run" / f"w{i}.log").read_text()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["failed_worker"] == 1


def test_a_trainer_killed_with_sigkill_fails_the_run_and_nothing_is_left(sl, tmp_path, clean):
    run_id = "kill-" + uuid.uuid4().hex[:6]
    t, box = _in_thread(lambda: _run(sl, py("print('ready', flush=True); time.sleep(300)"), tmp_path, run_id=run_id))
    _wait_logs(tmp_path / "run", 3, "ready")
    pidfile = Path(sl.hosts[2].home) / ".tpuctl-host" / "run" / f"{run_id}.pid"
    pgid = json.loads(pidfile.read_text())["pgid"]
    ssh(sl, 2, f"kill -KILL {pgid}")  # as the kernel's OOM killer (or a user) would, on that host
    # The other hosts sleep 300 s: a run that ends well before that was ended by the kill, however loaded the
    # machine (the outcome below says so too).
    t.join(200)
    assert not t.is_alive()
    e, out = box["r"]
    assert isinstance(e, RunFailed) and e.result.failed_worker == 2 and e.result.exit_codes[2] == 137
    assert "killed by SIGKILL" in str(e) and "FAILED: worker w2" in out


def test_a_preemption_exit_lets_the_other_hosts_finish_saving(sl, tmp_path, clean):
    """Exit 42 (saved a checkpoint on a preemption notice) is not a crash: the other hosts are saving the same
    step, so they are given time to finish instead of being killed."""
    e, out = _run(sl, py(f"i = {ID}; time.sleep(0.2 + 1.0 * i); print('saved', i, flush=True); sys.exit(42)"),
                  tmp_path)
    assert isinstance(e, RunFailed) and e.result.exit_codes == {0: 42, 1: 42, 2: 42} and e.result.returncode == 42
    assert "waiting for the other hosts to save" in out and all(f"[w{i}] saved {i}" in out for i in range(3))
    assert "preemption" in str(e) and "preempted: every host saved a checkpoint" in out and "FAILED" not in out


def test_secret_env_reaches_the_trainer_but_no_argv_log_or_record(sl, tmp_path, clean):
    secret = "s3cr3t-" + uuid.uuid4().hex
    seen_in_argv = []
    t, box = _in_thread(lambda: _run(
        sl, py("v = os.environ['TPUCTL_TEST_SECRET']\n"
               "print('sha', __import__('hashlib').sha256(v.encode()).hexdigest(), flush=True)\n"
               "print('oops I print it:', v, flush=True)\nprint('ready', flush=True); time.sleep(2)"),
        tmp_path, secret_env={"TPUCTL_TEST_SECRET": secret}, env={"VISIBLE": "yes"}))
    _wait_logs(tmp_path / "run", 3, "ready")
    for p in Path("/proc").iterdir():  # every process on the machine, hosts included, while it runs
        if p.name.isdigit() and secret in cmdline(int(p.name)):
            seen_in_argv.append(cmdline(int(p.name)))
    t.join(60)
    r, out = box["r"]
    assert r.ok and seen_in_argv == []
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert out.count(f"sha {digest}") == 3 and secret not in out and "oops I print it: ***" in out
    for f in (tmp_path / "run").iterdir():
        assert secret not in f.read_text(), f
    assert "TPUCTL_TEST_SECRET" in (tmp_path / "run" / "run.json").read_text()  # the name only
    for h in sl.hosts:  # the host side: its 0600 file is gone, its log masked
        for f in Path(h.home).rglob("*"):
            if f.is_file() and f.stat().st_size < 10**7:
                assert secret.encode() not in f.read_bytes(), f
        assert not list((Path(h.home) / ".tpuctl-host" / "run").glob("*.secrets"))



def test_a_multi_line_secret_is_masked_as_is_and_escaped_and_run_files_are_private(sl, tmp_path, clean):
    """A key file's JSON as a secret, printed whole, JSON-escaped and as repr: none of its lines (>= 6 chars)
    reaches the terminal, the run's files or the hosts' logs; the run's files are 0600 in 0700 dirs."""
    import stat
    tag = uuid.uuid4().hex
    secret = '{\n  "type": "service_account",\n  "private_key": "-----BEGIN-' + tag + '-----"\n}'
    run_dir = tmp_path / "runs" / "sl" / "r1"
    out = io.StringIO()
    r = run_job(workers(sl), LaunchSpec(py("v = os.environ['MULTI']\nprint(v)\nprint(json.dumps(v))\n"
                                           "print(repr(v))\nprint(json.dumps({'key': v}))")),
                ssh=ssh_config(sl), run_dir=run_dir, out=out, secret_env={"MULTI": secret})
    assert r.ok
    text = out.getvalue()
    assert tag not in text and '"service_account"' not in text and "***" in text, text
    files = [f for f in run_dir.iterdir()]
    for f in files:
        assert tag not in f.read_text(), f
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    for d in (run_dir, run_dir.parent, run_dir.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for h in sl.hosts:
        logs = Path(h.home) / ".tpuctl-host" / "logs"
        for f in logs.glob("*.log"):
            assert tag.encode() not in f.read_bytes(), f
        mine = logs / f"{r.run_id}.log"
        assert mine.exists() and stat.S_IMODE(mine.stat().st_mode) == 0o600

def test_nasty_arguments_and_env_values_arrive_unchanged_and_run_nothing(sl, tmp_path, clean):
    nasty = "a b 'q' \"dq\" $(touch /tmp/PWNED1) `touch /tmp/PWNED2`; touch /tmp/PWNED3 && echo $HOME *"
    r, out = _run(sl, [*py("print('ARGS', json.dumps([sys.argv[1:], os.environ['NASTY']]))"), nasty, ";", "|",
                       "--x=" + nasty], tmp_path, env={"NASTY": nasty})
    assert r.ok
    got = [json.loads(line.split("ARGS ", 1)[1]) for line in out.splitlines() if "ARGS " in line]
    assert got == [[[nasty, ";", "|", "--x=" + nasty], nasty]] * 3
    for i in range(3):
        assert ssh(sl, i, "ls /tmp ~ | grep -c PWNED || true").stdout.strip() == "0"


def _project_copy(dst: Path) -> Path:
    for name in ("pyproject.toml", "Makefile", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for pkg in ("orchestrator", "trainer", "infra"):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_push_installs_once_per_hash_and_a_code_change_keeps_the_dependency_layer(sl, tmp_path, clean):
    proj = _project_copy(tmp_path)
    # An empty dependency list keeps this test fast; the e2e test installs the real jax stack the same way.
    small = lambda: dataclasses.replace(B.build(proj, cache_dir=tmp_path / "bundles"), requirements=[], no_deps=[])  # noqa: E731
    b1 = small()
    install, layout = shared_install(sl.wheelhouse, b1, python=sl.python)
    argv = ["python", "-c", "import orchestrator.jobs.launch as m, sys; print('FROM', m.__file__, sys.version_info[:2])"]
    r1, out1 = _run(sl, argv, tmp_path / "1", bundle=b1, install=install, layout=layout)
    assert r1.ok and all("app=installed" in v for v in r1.push.values()), r1.push
    assert out1.count(f".tpuctl-host/app/{b1.short}/orchestrator/jobs/launch.py (3, 11)") == 3
    r2, out2 = _run(sl, argv, tmp_path / "2", bundle=small(), install=install, layout=layout)
    assert r2.ok and r2.push == {0: "cached", 1: "cached", 2: "cached"} and "install skipped" in out2
    with open(proj / "orchestrator" / "launch.py", "a") as f:
        f.write("\n# changed\n")
    b3 = small()
    assert b3.short != b1.short
    r3, out3 = _run(sl, argv, tmp_path / "3", bundle=b3, install=install, layout=layout)
    assert r3.ok and all("deps=cached app=installed" in v for v in r3.push.values()), r3.push
    assert out3.count(f".tpuctl-host/app/{b3.short}/") == 3


def test_workdir_ships_with_the_bundle_and_the_command_runs_in_it(sl, tmp_path, clean):
    wd = tmp_path / "mycode"
    (wd / "pkg").mkdir(parents=True)
    (wd / "pkg" / "__init__.py").write_text("GREETING = 'hi from my package'\n")
    (wd / "main.py").write_text("import os, pkg\nprint(pkg.GREETING, os.getcwd().endswith('tpuctl_workdir'))\n")
    b = dataclasses.replace(B.build(workdir=wd, cache_dir=tmp_path / "bundles"), requirements=[], no_deps=[])
    install, layout = shared_install(sl.wheelhouse, b, python=sl.python)
    r, out = _run(sl, ["python", "main.py"], tmp_path, bundle=b, install=install, layout=layout)
    assert r.ok and out.count("hi from my package True") == 3, out


def _cli_env(sl, tmp_path):
    return {**os.environ, "TPUCTL_HOME": str(tmp_path / "home")}


def _cli_flags(sl):
    return ["--hosts", ",".join(h.ip for h in sl.hosts), "--ssh-user", sl.ssh_user, "--ssh-key", sl.ssh_key,
            "--ssh-port", str(sl.hosts[0].port)]


def _sleeping_run(sl, tmp_path) -> subprocess.Popen:
    """`tpuctl run` of a long sleep on all 3 hosts, in its own session, returned once every host said ready."""
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.run_verbs", "run", "runs", *_cli_flags(sl), "--raw", "--",
                          *py("print('ready', flush=True); time.sleep(300)")],
                         env=_cli_env(sl, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    seen = set()
    for line in p.stdout:
        m = re.match(r"\[w(\d)\] ready", line)
        if m:
            seen.add(m.group(1))
        if len(seen) == 3:
            return p
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    raise AssertionError(f"the run ended before every host was ready (exit {p.returncode})")


def test_ctrl_c_stops_every_host_and_logs_shows_the_run(sl, tmp_path, clean):
    """Also, while that run (a --raw script, not the trainer) goes: `top` and `profile` say in one line that it
    is not a trainer run and what they cannot show of it, and run nothing beside it."""
    from orchestrator.cli.observe_verbs import profile, top
    p = _sleeping_run(sl, tmp_path)
    try:
        for verb, cannot in ((top, "top cannot show its step, step time, tokens/s, chips or straggler"),
                             (profile, "profile cannot show a trace of it")):
            res = CliRunner().invoke(verb, ["runs", *_cli_flags(sl)], env=_cli_env(sl, tmp_path))
            assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1, res.output
            assert "is not a trainer run (`tpuctl run runs -- pretrain|lora ...`; this one is --raw or a script)" \
                in res.output and cannot in res.output, res.output
        # nothing ran beside it: each host has the run's own processes only
        assert not [c for i in range(3) for _, c in host_processes(sl, i) if "beside" in c or "hoststat" in c]
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, rest
    assert "interrupted" in rest
    assert wait_idle(sl) == {}
    res = CliRunner().invoke(cli_run.logs, ["runs", "--worker", "1"], env={"TPUCTL_HOME": str(tmp_path / "home")})
    assert res.exit_code == 0 and res.output.strip().splitlines()[0] == "ready"
    res = CliRunner().invoke(cli_run.logs, ["runs"], env={"TPUCTL_HOME": str(tmp_path / "home")})
    assert sorted(res.output.split()) == sorted(["[w0]", "[w1]", "[w2]", "ready", "ready", "ready"])
    res = CliRunner().invoke(cli_run.logs, ["runs", "--follow", "--worker", "2"],
                             env={"TPUCTL_HOME": str(tmp_path / "home")})  # the run is over: follow ends
    assert res.exit_code == 0 and res.output.strip() == "ready"
    res = CliRunner().invoke(cli_run.logs, ["nothing"], env={"TPUCTL_HOME": str(tmp_path / "home")})
    assert res.exit_code == 1 and "no runs of nothing yet" in res.output


def test_a_killed_tpuctl_leaves_the_run_going_and_attach_and_cancel_reach_it(sl, tmp_path, clean):
    """No Ctrl-C handler runs when tpuctl is SIGKILLed (or the laptop sleeps): the run belongs to the hosts and
    goes on. Another command is refused with the way to the run; the same command follows it instead of starting a
    second one; `cancel` from anywhere stops every host, and the follower says it was cancelled."""
    p = _sleeping_run(sl, tmp_path)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(1)
    assert all(any("time.sleep(300)" in c for _, c in host_processes(sl, i)) for i in range(3))
    env = _cli_env(sl, tmp_path)
    other = CliRunner().invoke(cli_run.run, ["runs", *_cli_flags(sl), "--raw", "--", "true"], env=env)
    assert other.exit_code == 1 and "a tpuctl run is still going on these hosts" in other.output, other.output
    assert "`tpuctl attach runs` follows it, `tpuctl cancel runs` stops it" in other.output
    again = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.run_verbs", "run", "runs", *_cli_flags(sl),
                              "--raw", "--", *py("print('ready', flush=True); time.sleep(300)")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        for line in again.stdout:
            seen.append(line)
            if sum(1 for ln in seen if re.match(r"\[w\d\] ready", ln)) == 3:
                break
        assert "of this same command is still going on the hosts: following it" in "".join(seen), seen
        assert sum(1 for c in (cmdline(pid) for i in range(3) for pid, _ in host_processes(sl, i))
                   if "time.sleep(300)" in c and "hostwrap" not in c) == 3  # one run, not two
        # cancel returns once every host's run has stopped (SIGTERM, SIGKILL after its grace), else it fails
        # naming what is left; the hosts are seen empty below
        res = CliRunner().invoke(cli_run.cancel, ["runs", *_cli_flags(sl)], env=env)
        assert res.exit_code == 0 and "stopped run" in res.output, res.output
        rest = again.communicate(timeout=60)[0]
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    assert again.returncode == 130 and "cancelled" in rest, rest
    assert wait_idle(sl) == {}
    for verb in (cli_run.cancel, cli_run.attach):
        res = CliRunner().invoke(verb, ["runs", *_cli_flags(sl)], env=env)
        assert res.exit_code == 1 and "no tpuctl run is going on the hosts of runs" in res.output, res.output


def test_a_run_that_ended_unwatched_is_read_from_the_hosts_not_run_again(sl, tmp_path, clean, monkeypatch):
    """A managed job's new controller follows the run its record names (RunOptions.follow_run): one that ended
    while no controller watched is not run again; its end is read from each host's exit file, under its own run
    id, as success or as the failure it was. Another command's run of that id is not followed."""
    from orchestrator.access.reach import SshFlags
    from orchestrator.jobs import attached, controller
    from orchestrator.jobs.runner import live_runs
    from orchestrator.access.hosts import Hosts
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    flags = SshFlags(hosts=",".join(h.ip for h in sl.hosts), ssh_user=sl.ssh_user, ssh_key=sl.ssh_key,
                     ssh_port=sl.hosts[0].port)
    ok = py(f"print('ran', {ID}, flush=True)")
    # w1 fails after the others have ended: every exit code is the host's own, none a stop's
    bad = py(f"print('ran', {ID}, flush=True); {ID} == 1 and (time.sleep(1), sys.exit(3))")
    first = attached.run("runs", ok, flags, attached.RunOptions(raw=True, plan=False), out=io.StringIO())
    failed = pytest.raises(RunFailed, attached.run, "runs", bad, flags, attached.RunOptions(raw=True, plan=False),
                           out=io.StringIO()).value.result
    with Hosts(workers(sl), ssh_config(sl)) as h:
        known = sorted(live_runs(h))
    for cmd, prev in ((ok, first), (bad, failed)):
        out = io.StringIO()
        try:
            again = attached.run("runs", cmd, flags,
                                 attached.RunOptions(raw=True, plan=False, follow_run=prev.run_id), out=out)
        except RunFailed as e:
            again = e.result
        assert f"run {prev.run_id} of this same command ended on the hosts while nobody followed it" in out.getvalue()
        assert controller._ENDED.search(out.getvalue()).group(1) == prev.run_id  # the job's record takes it up
        assert again.run_id == prev.run_id and again.exit_codes == prev.exit_codes, (again, out.getvalue())
        assert again.returncode == prev.returncode and again.failed_worker == prev.failed_worker
    assert failed.exit_codes == {0: 0, 1: 3, 2: 0} and failed.failed_worker == 1, failed.exit_codes
    with Hosts(workers(sl), ssh_config(sl)) as h:
        assert sorted(live_runs(h)) == known  # no rerun on any host
    # another command with that run id in its record (a sweep's next trial) runs anew: it is not that run
    out = io.StringIO()
    other = attached.run("runs", py("print('other')"), flags,
                         attached.RunOptions(raw=True, plan=False, follow_run=first.run_id), out=out)
    assert other.run_id != first.run_id and "nobody followed" not in out.getvalue(), out.getvalue()


def test_a_job_cancelled_while_no_controller_was_alive_is_stopped_on_the_hosts(sl, tmp_path, clean, monkeypatch):
    """A managed job's controller died (SIGKILL: its run goes on, on every host), then `tpuctl cancel` recorded
    the cancel with no controller to act on it. The next controller to take the job stops the run on every host
    (within cancel's 30 s) before the job reads CANCELLED."""
    from orchestrator import provider
    from orchestrator.access.reach import SshFlags
    from orchestrator.jobs import controller_vm as V
    from orchestrator.jobs.controller import Controller, JobRunner
    from orchestrator.jobs.store import JobStore, initial_state, new_job_id
    from orchestrator.state import SliceRecord
    p = _sleeping_run(sl, tmp_path)  # the run a controller followed ...
    os.killpg(p.pid, signal.SIGKILL)  # ... until it died
    p.wait()
    emu = gcs.start(home=tmp_path / "cloud", buckets=("cancel-b",), record=False)
    try:
        for k, v in {**emu.env, "TPUCTL_HOME": str(tmp_path / "home")}.items():
            monkeypatch.setenv(k, v)
        store, jid = JobStore("cancel-b"), new_job_id()
        spec = {"id": jid, "name": "runs", "slice_name": "runs", "submitted": time.time(), "opts": {}}
        store.put_slice(jid, SliceRecord(name="runs", project="p", zone="us-central1-a", accelerator="v4-24",
                                         node="projects/p/locations/us-central1-a/nodes/runs",
                                         status="ready").to_json())
        store.put_spec(jid, spec)
        store.put_state(jid, {**initial_state(spec), "state": "RUNNING", "started": time.time()})
        store.request_cancel(jid, down=False)  # `tpuctl cancel JOB` with no controller alive
        assert all(any("time.sleep(300)" in c for _, c in host_processes(sl, i)) for i in range(3))
        where = V.Where("p", "us-central1-a", "cancel-b", provider.GCP, endpoint="http://127.0.0.1:9")
        ctl = Controller(store, where, provider.get(provider.GCP), flags=SshFlags(
            hosts=",".join(h.ip for h in sl.hosts), ssh_user=sl.ssh_user, ssh_key=sl.ssh_key,
            ssh_port=sl.hosts[0].port))
        runner = JobRunner(ctl, jid)
        runner.start()
        runner.join(200)  # well before the hosts' 300 s sleep ends by itself: the cancel ended the run
        assert not runner.is_alive()
        assert not any("time.sleep(300)" in c for i in range(3) for _, c in host_processes(sl, i))
        st = store.state(jid)
        assert st["state"] == "CANCELLED" and st["message"] == "cancelled", st
        assert "cancel:" not in runner.log.data().decode(), runner.log.data().decode()  # the stop did not fail
    finally:
        emu.stop()


def test_ssh_runs_on_one_or_all_workers(sl, tmp_path, clean):
    run = lambda *a: CliRunner().invoke(cli_run.ssh, ["runs", *_cli_flags(sl), *a], env=_cli_env(sl, tmp_path))  # noqa: E731
    res = run("--worker", "all", "--", "hostname")
    assert res.exit_code == 0 and sorted(res.output.splitlines()) == [f"[w{i}] runs-w{i}" for i in range(3)]
    res = run("--worker", "2", "--", "echo", "a b", "$(hostname)")
    assert res.exit_code == 0 and res.output.strip() == "[w2] a b $(hostname)"
    res = run("--worker", "all", "--", "test $(hostname) = runs-w0")
    assert res.exit_code == 1 and "w1 exited 1" in res.output and "w0" not in res.output.split("Error:")[1]
    res = run("--worker", "7", "--", "true")
    assert res.exit_code == 1 and "pick 0..2 or all" in res.output


def test_run_refuses_bad_input_before_touching_a_host(sl, tmp_path, monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    run = lambda *a: CliRunner().invoke(cli_run.run, ["runs", *_cli_flags(sl), *a], env=_cli_env(sl, tmp_path))  # noqa: E731
    res = run("--secret-env", "NOT_SET_ANYWHERE", "--", "pretrain")
    assert res.exit_code == 1 and "NOT_SET_ANYWHERE is not set in your environment" in res.output
    res = run("--env", "NOEQUALS", "--", "pretrain")
    assert res.exit_code == 1 and "is not K=V" in res.output
    assert not (tmp_path / "home" / "runs").exists()


def test_an_unknown_option_before_the_command_is_tpuctls_one_line_error(tmp_path):
    """Options before `--` (or before COMMAND) are the verb's own: a retired or mistyped one is named, with the
    option meant where there is one, and is never handed to the trainer as the start of its command line."""
    env = {"TPUCTL_HOME": str(tmp_path / "home")}
    cases = [(["run", "s", "--api-endpoint", "http://x", "--", "pretrain"], "--api-endpoint", None),
             (["run", "s", "--env", "A=-x", "--kil-stale", "--", "pretrain"], "--kil-stale", "--kill-stale"),
             (["ssh", "s", "--workr", "1", "--", "ls"], "--workr", "--worker"),
             (["sweep", "s", "--sett", "d_model=1,2", "--", "pretrain"], "--sett", "--set"),
             (["plan", "-a", "v4-8", "--stpes", "3", "--", "pretrain"], "--stpes", "--steps")]
    for argv, bad, meant in cases:
        res = CliRunner().invoke(cli_main, argv, env=env)
        lines = res.output.strip().splitlines()
        assert res.exit_code == 1 and len(lines) == 1, res.output
        assert lines[0].startswith(f"Error: tpuctl {argv[0]}: no such option {bad}"), res.output
        assert (f"did you mean {meant}?" in lines[0]) == bool(meant) and "invalid choice" not in lines[0]
    # The trainer's own options after `--`, and a value that looks like an option, are not ours to judge.
    res = CliRunner().invoke(cli_main, ["run", "s", "--env", "A=1", "--heartbeat-timeout", "-1", "--", "--x"],
                             env=env)
    assert "no such option" not in res.output
    assert not (tmp_path / "home" / "runs").exists()


@pytest.fixture
def api_home(tmp_path, monkeypatch):
    """A TPUCTL_HOME of its own with the local TPU API stand-in running (stopped, with the GCS emulator, after)."""
    from orchestrator.provider import local as local_provider
    home = tmp_path / "home"
    monkeypatch.setenv("TPUCTL_HOME", str(home))
    monkeypatch.setenv("TPUCTL_POLL_S", "0.05")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    for var in ("GOOGLE_CLOUD_PROJECT", "TPUCTL_PROJECT", "CLOUDSDK_CORE_PROJECT", "TPUCTL_TPU_API_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    local_provider.api_url()
    info = json.loads((home / "local" / "fake_tpu_api.json").read_text())
    yield home, info["url"]
    gcs.stop(home)
    os.kill(info["pid"], signal.SIGKILL)
    try:
        os.waitpid(info["pid"], 0)
    except ChildProcessError:
        pass


def _up(*args) -> subprocess.CompletedProcess:
    up = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", *args], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ))
    assert up.returncode == 0, up.stderr
    return up


def test_run_by_slice_name_through_the_tpu_api_stand_in(api_home):
    """`tpuctl up --local` starts the slice's hosts (real sshd) and the TPU API stand-in reports them as its
    workers; `run NAME --local` finds them by name, with SSH settings from the local slice's record; `down`
    stops the hosts."""
    from infra.local_slice import LocalSlice
    home, _ = api_home
    s = None
    try:
        _up("byname", "--local", "-a", "v4-16")
        s = LocalSlice.load("byname")
        assert s is not None and all(s.alive()) and len(s.hosts) == 2
        res = CliRunner().invoke(cli_run.ssh, ["byname", "--local", "--worker", "all", "--", "hostname"])
        assert res.exit_code == 0, res.output
        assert sorted(res.output.splitlines()) == ["[w0] byname-w0", "[w1] byname-w1"]
        res = CliRunner().invoke(cli_run.run, ["byname", "--local", "--raw", "--", "sh", "-c",
                                               "echo id=$TPUCTL_PROCESS_ID of $TPUCTL_NUM_PROCESSES at $TPUCTL_COORDINATOR"])
        assert res.exit_code == 0, res.output
        for i in range(2):
            assert f"[w{i}] id={i} of 2 at {s.hosts[0].ip}:8476" in res.output
        # a gs:// path in local mode: the hosts are pointed at the GCS emulator (started, bucket created)
        res = CliRunner().invoke(cli_run.run, ["byname", "--local", "--raw", "--", *py(
            "import urllib.request as u\nprint(json.load(u.urlopen(os.environ['STORAGE_EMULATOR_HOST'] + "
            "'/storage/v1/b/bkt'))['name'] == 'bkt')"), "--ckpt-dir", "gs://bkt/run"])
        emu = gcs.running(home)
        assert res.exit_code == 0 and emu is not None, res.output
        assert res.output.count("] True") == 2, res.output
        subprocess.run([sys.executable, "-m", "orchestrator.cli", "down", "byname", "--local"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ), check=True)
        assert not any(s.alive()) and LocalSlice.load("byname") is None
    finally:
        if s is not None:
            s.stop()


def test_workers_without_external_ips_are_reached_on_their_internal_ones(api_home):
    """`up --no-external-ips`: the workers report no external IP and `run` goes to the internal one, which this
    machine reaches only through a proxy (a local slice's internal addresses refuse SSH from here). Where the
    external IPs are not reachable from here (this machine is inside the VPC), --internal-ip says so."""
    from infra.fake_tpu_api import FakeControl
    from infra.local_slice import LocalSlice
    from orchestrator import state
    home, url = api_home
    made = []
    try:
        _up("noext", "--local", "-a", "v4-16", "--no-external-ips")
        made.append(LocalSlice.load("noext"))
        st = json.loads(CliRunner().invoke(cli_main, ["status", "noext", "--json"]).stdout)
        assert [w["external_ip"] for w in st["workers"]] == [None, None]
        internal = [w["internal_ip"] for w in st["workers"]]
        res = CliRunner().invoke(cli_run.run, ["noext", "--local", "--raw", "--ssh-wait", "1", "--", "hostname"])
        assert res.exit_code == 1 and f"w0 ({internal[0]}): unreachable over SSH" in res.output, res.output
        hop = f"{sys.executable} -m infra.ssh_hop --map 127.1.=127.0. %h %p"
        res = CliRunner().invoke(cli_run.run, ["noext", "--local", "--raw", "--ssh-proxy-command", hop, "--",
                                               "hostname"])
        assert res.exit_code == 0, res.output
        assert sorted(l for l in res.output.splitlines() if l.startswith("[w")) == ["[w0] noext-w0", "[w1] noext-w1"]

        _up("ext", "--local", "-a", "v4-16")
        made.append(sl := LocalSlice.load("ext"))
        unreachable = ["127.0.99.1", "127.0.99.2"]  # what the API reports as external: nothing listens there
        FakeControl(url).set_node_workers(state.lookup("ext").node, [h.ip for h in sl.hosts], external=unreachable)
        res = CliRunner().invoke(cli_run.run, ["ext", "--local", "--raw", "--ssh-wait", "1", "--", "hostname"])
        assert res.exit_code == 1 and "w0 (127.0.99.1): unreachable over SSH" in res.output, res.output
        res = CliRunner().invoke(cli_run.run, ["ext", "--local", "--raw", "--internal-ip", "--", "hostname"])
        assert res.exit_code == 0 and "[w1] ext-w1" in res.output, res.output
    finally:
        for s in made:
            if s is not None:
                s.stop()


def test_a_taken_coordinator_port_is_a_preflight_error_not_a_crash(sl, tmp_path, clean):
    """Something already listens where worker 0's coordinator would bind: preflight names it, nothing starts."""
    port = 18476
    ip = sl.hosts[0].ip
    ssh(sl, 0, "setsid nohup python3 -c \"import socket, time; s = socket.socket(); "
               f"s.bind(('{ip}', {port})); s.listen(); time.sleep(120)\" port-squatter >/dev/null 2>&1 < /dev/null &")
    try:
        deadline = time.time() + 60  # waits for the event (no measure): a loaded machine's room
        while ssh(sl, 0, f"grep -q ':{port:04X} .* 0A ' /proc/net/tcp", check=False).returncode != 0:
            assert time.time() < deadline
            time.sleep(0.1)
        with pytest.raises(HostError) as e:
            _run(sl, py("print('ran')"), tmp_path, coordinator_port=port)
    finally:
        ssh(sl, 0, "pkill -f '[p]ort-squatter'", check=False)
    msg = str(e.value)
    assert f"w0 ({ip}): the jax.distributed coordinator port {ip}:{port} is taken by PID " in msg, msg
    assert "(python3 -c import socket" in msg and "--coordinator-port" in msg
    assert "w1" not in msg and "w2" not in msg
    assert not list((tmp_path / "run").glob("w*.log"))  # nothing was launched


def test_a_host_that_stops_advancing_is_named_and_every_host_is_stopped(sl, tmp_path, clean):
    """Every host reported steps, then none advances: past --hang-timeout the run stops everywhere, naming the
    host whose trainer is stopped (here w1 SIGSTOPs itself; the others wait as they would in a collective)."""
    code = (f"i = {ID}\nfor s in range(1, 4):\n"  # a progress line as the trainer prints it: the step, then fields
            "    print('TPUCTL_PROGRESS step=%d dispatch_t=%f input_wait_s=0.0 step_time_s=0.2' % (s, time.time()), "
            "flush=True)\n"
            "    print('step', s, flush=True)\n    time.sleep(0.2)\n"
            "if i == 1:\n    import signal; os.kill(os.getpid(), signal.SIGSTOP)\ntime.sleep(600)")
    e, out = _run(sl, py(code), tmp_path, hang_timeout_s=3)
    assert isinstance(e, RunFailed) and e.result.returncode == 124, out
    assert e.result.failed_worker == 1 and "w1" in str(e) and "stopped advancing at step 3" in str(e), str(e)
    assert "TPUCTL_PROGRESS" not in out  # the markers stay out of the view
    assert "[tpuctl] w1 stopped advancing at step 3: no host reported a new step for 3 s; stopping every host" in out
