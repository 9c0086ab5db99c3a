"""The per-host command and environment (pure functions), run through a real shell."""
import json
import subprocess
import sys

import pytest

from orchestrator.jobs import launch as L

WORKERS = [L.Worker(0, "10.0.0.2", "34.1.1.1"), L.Worker(1, "10.0.0.3", "34.1.1.2")]
NASTY = "a b 'single' \"double\" $(touch PWNED) `touch PWNED2`; touch PWNED3 && echo $HOME\nnewline \\ back"


def test_coordinator_is_worker0_internal_ip_and_every_host_gets_its_id():
    spec = L.LaunchSpec(argv=["python", "-m", "trainer"], env={"A": "1"})
    envs = [L.host_env(spec, WORKERS, i) for i in range(2)]
    for i, e in enumerate(envs):
        assert e["TPUCTL_COORDINATOR"] == f"10.0.0.2:{L.DEFAULT_COORDINATOR_PORT}"
        assert e["TPUCTL_NUM_PROCESSES"] == "2" and e["TPUCTL_PROCESS_ID"] == str(i)
        assert int(e["TPUCTL_HEARTBEAT_TIMEOUT_S"]) < 100 and int(e["TPUCTL_INIT_TIMEOUT_S"]) < 300
        assert e["A"] == "1"
        assert e["TPUCTL_RUN_ID"] == spec.run_id  # the trainer keeps each run's profiles under it
    assert WORKERS[0].address == "34.1.1.1" and L.Worker(0, "10.0.0.2").address == "10.0.0.2"


@pytest.mark.parametrize("pairs,msg", [
    (["NOEQUALS"], "is not K=V"), (["1BAD=x"], "environment variable name"),
    (["TPUCTL_PROCESS_ID=3"], "sets TPUCTL_PROCESS_ID itself"), (["A B=x"], "environment variable name")])
def test_bad_env_is_one_clear_line(pairs, msg):
    with pytest.raises(L.LaunchError, match=msg):
        L.parse_env(pairs)


def test_env_value_keeps_equals_and_secret_must_be_set():
    assert L.parse_env(["K=a=b=c", "E="]) == {"K": "a=b=c", "E": ""}
    assert L.read_secrets(["TOK"], {"TOK": "s3cr3t"}) == {"TOK": "s3cr3t"}
    with pytest.raises(L.LaunchError, match="TOK is not set in your environment"):
        L.read_secrets(["TOK"], {})


def test_command_passes_nasty_args_and_env_through_a_real_shell_unchanged(tmp_path):
    """The host command, minus the wrapper, run by sh: argv and env arrive byte for byte, nothing else runs."""
    spec = L.LaunchSpec(argv=[sys.executable, "-c", "import json,os,sys; print(json.dumps([sys.argv[1:], "
                              "os.environ['NASTY']]))", NASTY, "--flag=" + NASTY, ";", "&&", "*"],
                        env={"NASTY": NASTY})
    cmd = L.host_command(spec, WORKERS, 1, layout=L.HostLayout(root=str(tmp_path / "root")),
                         wrap_python=sys.executable, wrap_script="hostwrap.py")
    # Run it with the real hostwrap in place, from a directory where a stray `touch` would be visible.
    (tmp_path / "root" / "bin").mkdir(parents=True)
    (tmp_path / "root" / "bin" / "hostwrap.py").write_text(open("orchestrator/host/hostwrap.py").read())
    p = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, cwd=tmp_path,
                       env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stdout + p.stderr
    *_, last, end = p.stdout.strip().splitlines()
    assert end == "TPUCTL_EXIT 0"
    args, env = json.loads(last)
    assert args == [NASTY, "--flag=" + NASTY, ";", "&&", "*"] and env == NASTY
    assert not list(tmp_path.glob("PWNED*")) and not list((tmp_path / "root").glob("**/PWNED*"))


def test_the_run_outlives_its_follower_and_a_new_follower_goes_on_from_a_line(tmp_path):
    """hostwrap keeps the run detached from the session that started it: killing the follower (an SSH session
    that drops) leaves the command running and writing its log; `follow --skip-lines N` prints the rest and the
    exit status; a `stop` ends it and says so."""
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "hostwrap.py").write_text(open("orchestrator/host/hostwrap.py").read())
    lay = L.HostLayout(root=str(root))
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    code = "import sys, time\nfor i in range(1, 7):\n    print('line', i, flush=True); time.sleep(0.4)\nsys.exit(3)"
    spec = L.LaunchSpec(argv=[sys.executable, "-c", code], distributed=False)
    cmd = L.host_command(spec, WORKERS, 0, layout=lay, wrap_python=sys.executable, wrap_script="hostwrap.py",
                         tag="t1")
    f = subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    assert f.stdout.readline().strip() == "TPUCTL_FOLLOW 0"
    assert f.stdout.readline().strip() == "line 1"
    f.kill()  # the session goes away
    f.wait()
    follow = L.follow_command(lay, spec.run_id, skip_lines=2, wrap_python=sys.executable, wrap_script="hostwrap.py")
    p = subprocess.run(["sh", "-c", follow], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=30)
    assert p.returncode == 3
    assert p.stdout.splitlines() == ["TPUCTL_FOLLOW 2", "line 3", "line 4", "line 5", "line 6", "TPUCTL_EXIT 3"]
    assert (root / "logs" / f"{spec.run_id}.log").read_text().splitlines() == [f"line {i}" for i in range(1, 7)]
    runs = subprocess.run(["sh", "-c", L.runs_command(lay, wrap_python=sys.executable, wrap_script="hostwrap.py")],
                          capture_output=True, text=True, env=env).stdout
    [r] = json.loads(runs.split("TPUCTL_RUNS ", 1)[1])
    assert (r["run_id"], r["running"], r["rc"], r["stopped"]) == (spec.run_id, False, 3, False)
    assert r["tag"] == "t1" and r["started"], r  # an ended run still names its command (its pidfile is gone)

    # A run that is stopped: its followers get the signal's status, marked as a stop (not a failure).
    spec2 = L.LaunchSpec(argv=[sys.executable, "-c", "import time\nprint('up', flush=True); time.sleep(60)"],
                         distributed=False)
    cmd2 = L.host_command(spec2, WORKERS, 0, layout=lay, wrap_python=sys.executable, wrap_script="hostwrap.py")
    f2 = subprocess.Popen(["sh", "-c", cmd2], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    assert [f2.stdout.readline().strip() for _ in range(2)] == ["TPUCTL_FOLLOW 0", "up"]
    # `beside` it: the run's own Python and environment, the arguments reaching it as they are.
    beside = L.beside_command(lay, spec2.run_id, ["-c", "import json, os, sys; print(json.dumps([sys.argv[1:], "
                              "os.environ['TPUCTL_RUN_ID'], sys.executable]))", NASTY, ";"],
                              wrap_python=sys.executable, wrap_script="hostwrap.py")
    b = subprocess.run(["sh", "-c", beside], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)
    assert b.returncode == 0 and json.loads(b.stdout) == [[NASTY, ";"], spec2.run_id, sys.executable], b
    stop = L.stop_command(lay, spec2.run_id, wrap_python=sys.executable, grace=2, wrap_script="hostwrap.py")
    subprocess.run(["sh", "-c", stop], check=True, capture_output=True, env=env, cwd=tmp_path)
    rest = f2.communicate(timeout=30)[0]
    assert rest.splitlines()[-1] == "TPUCTL_EXIT 143 stopped" and f2.returncode == 143


def test_secrets_are_never_in_the_command_line():
    spec = L.LaunchSpec(argv=["python", "-m", "trainer"], secret_names=["TOKEN"])
    cmd = L.host_command(spec, WORKERS, 0, layout=L.HostLayout(), wrap_python="python3",
                         env_python=".tpuctl-host/deps/k/bin/python")
    assert "--secrets" in cmd and "TOKEN" not in cmd
    up = L.secrets_upload_command(L.HostLayout(), spec.run_id)
    assert up.startswith("umask 077") and "cat >" in up


def test_python_argv0_needs_an_environment():
    spec = L.LaunchSpec(argv=["python", "x.py"])
    with pytest.raises(L.LaunchError, match="no bundle"):
        L.host_command(spec, WORKERS, 0, layout=L.HostLayout(), wrap_python="python3")


def test_a_local_slice_emulates_its_accelerators_devices_per_host_through_the_environment():
    """The command is not rewritten: the local provider's run environment carries the device count (the trainer
    reads it when --emulate-devices is not given); real hosts get nothing of the kind."""
    from orchestrator import provider
    argv = ["python", "-m", "trainer", "pretrain", "--steps", "3"]
    assert provider.get("local").run_env("x", argv, 4) == {"TPUCTL_EMULATE_DEVICES": "4"}
    assert provider.get("gcp").run_env("x", argv, 4) == {}


