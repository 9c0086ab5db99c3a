"""`tpuctl top`'s and `profile`'s parts that need no slice: the RuntimeMetricService stand-in read by tpu-info's
own client, hostwrap's `beside` running `python -m trainer hoststat` beside a live command (its environment less
the run's secrets, its directory), and top's table and JSON. The live 2-host run is in tests/test_run_e2e.py."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import fake_tpu_metrics as F
from orchestrator.host import hostwrap
from orchestrator.observe import top as T

ROOT = Path(__file__).resolve().parents[1]
HOSTWRAP = Path(hostwrap.__file__)


@pytest.fixture(scope="module")
def metrics_service():
    r = F.start()
    yield r
    r.stop()


def test_tpu_info_reads_the_stand_in_exactly(metrics_service):
    from tpu_info import metrics
    usage = metrics.get_chip_usage_new(None, addr=metrics_service.address)
    assert [(u.device_id, u.memory_usage, u.total_memory, u.duty_cycle_pct) for u in usage] == \
        [(c.device_id, c.hbm_used, c.hbm_total, c.duty_cycle_pct) for c in F.known_chips()]
    assert set(metrics_service.service.calls) == {F.HBM_USED, F.HBM_TOTAL, F.DUTY_CYCLE}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _progress(step, dispatch_t, stalled=0.0):
    return (f"TPUCTL_PROGRESS step={step} dispatch_t={dispatch_t:.6f} input_wait_s=0.001000 stalled_s={stalled:.6f} "
            f"step_time_s=0.250000 tokens_per_s=1024.0")


def _keep(tmp_path, command, secrets=None, env=None):
    """A run kept by hostwrap on this machine, as on a host: (pidfile, log, process)."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    pidfile, log = run / "r1.pid", tmp_path / "logs" / "r1.log"
    args = [sys.executable, str(HOSTWRAP), "run", "--pidfile", str(pidfile), "--run-id", "r1", "--log", str(log),
            "--cwd", str(ROOT)]
    if secrets:
        (run / "r1.secrets").write_text(json.dumps(secrets))
        args += ["--secrets", str(run / "r1.secrets")]
    p = subprocess.Popen([*args, "--", *command], env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 30
    while not (log.exists() and "ready" in log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    return pidfile, log, p


def _beside(pidfile, log, *args):
    return subprocess.run([sys.executable, str(HOSTWRAP), "beside", "--pidfile", str(pidfile), "--log", str(log),
                           "--", *args], capture_output=True, text=True, timeout=120, cwd="/")


def test_hoststat_beside_a_live_command_and_top_shows_it(tmp_path, metrics_service):
    """A stand-in trainer (its argv a real `pretrain` command line, its output progress lines) kept by hostwrap
    with a secret; `beside` runs hoststat in its environment and folder: the step and times from its lines, the
    straggler from its --ckpt-dir's metrics.jsonl, the chips exactly as the stand-in serves them (the first port
    listed answers nothing), and the secret not passed on."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    t0 = 1_700_000_000.0
    # process 1 dispatches 0.3 s after process 0 in every step: the straggler, and not for its input
    recs = [{"step": s, "loss": 1.0, "tokens_per_s": 1000.0, "step_time_s": 0.25,
             "hosts": [{"dispatch_t": t0 + s, "input_wait_s": 0.001, "stalled_s": 0.0, "profiler_s": 0.0},
                       {"dispatch_t": t0 + s + 0.3, "input_wait_s": 0.001, "stalled_s": 0.0, "profiler_s": 0.0}]}
            for s in range(1, 13)]
    (ckpt / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    lines = [_progress(s, t0 + s) for s in range(1, 13)]
    code = f"import time; print({chr(10).join(lines)!r}); print('ready', flush=True); time.sleep(120)"
    command = [sys.executable, "-c", code, "-m", "trainer", "pretrain", "--preset", "gpt2-tiny",
               "--ckpt-dir", str(ckpt)]
    env = {"TPU_RUNTIME_METRICS_PORTS": f"{_free_port()},{metrics_service.port}", "TPUCTL_PROCESS_ID": "0",
           "TPUCTL_RUN_ID": "r1", "PYTHONPATH": str(ROOT), "TPUCTL_PROFILER_PORT": str(_free_port())}
    pidfile, log, p = _keep(tmp_path, command, secrets={"MY_TOKEN": "s3cret-value"}, env=env)
    try:
        seen = _beside(pidfile, log, "-c", "import os, sys; print(os.environ.get('MY_TOKEN'), os.getcwd(), "
                                           "os.environ['TPUCTL_RUN_ID'], sys.executable)")
        assert seen.returncode == 0 and seen.stdout.split() == ["None", str(ROOT), "r1", sys.executable], seen
        res = _beside(pidfile, log, "-m", "trainer", "hoststat")
        assert res.returncode == 0, res.stdout + res.stderr
        stat = json.loads(res.stdout.strip().splitlines()[-1])
        # capture beside it: its --out defaults to the trainer's --ckpt-dir/profiles/RUN_ID; a profiler server
        # that does not answer is one line naming its address (what `tpuctl profile` reports for that host).
        cap = _beside(pidfile, log, "-m", "trainer", "capture", "--duration-ms", "100")
        err = cap.stderr.strip().splitlines()
        assert cap.returncode == 1 and len(err) == 1 and err[0].startswith(
            f"error: the profiler server at localhost:{env['TPUCTL_PROFILER_PORT']} did not answer"), cap.stderr
    finally:
        subprocess.run([sys.executable, str(HOSTWRAP), "stop", "--pidfile", str(pidfile), "--grace", "1"],
                       capture_output=True, timeout=30)
        p.wait(timeout=30)
    assert (stat["step"], stat["step_time_s"], stat["tokens_per_s"], stat["run_id"]) == (12, 0.25, 1024.0, "r1")
    assert stat["chips"] == [{"device": c.device_id, "duty_cycle_pct": c.duty_cycle_pct,
                              "hbm_used_bytes": c.hbm_used, "hbm_total_bytes": c.hbm_total} for c in F.known_chips()]
    s = stat["straggler"]
    assert (s["process"], s["steps"], s["of"], s["input_bound"]) == (1, 10, 10, False), s
    assert s["lag_s"] == pytest.approx(0.3)
    assert 0 <= stat["cpu_pct"] <= 100 and 0 < stat["mem_used_bytes"] < stat["mem_total_bytes"]

    # top's table from two such hosts: the stand-in's values as they are; the straggler named with its lag.
    other = {**stat, "process": 1, "chips": T.NO_TPU, "straggler": None}
    snap = {"name": "s", "run_id": "r1", "time": time.time(), "straggler": {"worker": "w1", **s},
            "hosts": [{"worker": f"w{i}", **{k: h[k] for k in ("host", "process", "step", "step_time_s",
                                                                 "tokens_per_s", "cpu_pct", "mem_used_bytes",
                                                                 "mem_total_bytes", "chips")}, "error": None}
                      for i, h in enumerate([stat, other])]}
    table = T.render(snap)
    rows = table.splitlines()
    w0, = [r for r in rows if r.startswith("w0 ")]
    w1, = [r for r in rows if r.startswith("w1 ")]
    assert w0.endswith("0:12.5% 1.0/16.0G  1:25.0% 2.0/16.0G  2:37.5% 3.0/16.0G  3:50.0% 4.0/16.0G"), table
    assert " 12 " in w0 and "250 ms" in w0 and "1,024" in w0
    assert w1.endswith("no TPU")
    assert "straggler: w1 (process 1), 300 ms late in 10 of the last 10 logged steps; cause: not its input" in table


def test_beside_without_a_live_run_says_so(tmp_path):
    res = _beside(tmp_path / "none.pid", tmp_path / "none.log", "-m", "trainer", "hoststat")
    assert res.returncode == hostwrap.NO_RUN and res.stdout.strip() == f"hostwrap: no live run ({tmp_path}/none.pid)"


def test_hoststat_alone_says_no_tpu_and_no_step():
    """Run with no trainer beside it and no metrics service: nothing made up."""
    env = {**os.environ, "TPU_RUNTIME_METRICS_PORTS": str(_free_port())}
    env.pop("TPUCTL_TRAINER_PID", None)
    env.pop("TPUCTL_RUN_LOG", None)
    env.pop("TPUCTL_PROFILER_PORT", None)  # the suite's "no profiler" (conftest.py): here, a host's default
    res = subprocess.run([sys.executable, "-m", "trainer", "hoststat"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    stat = json.loads(res.stdout)
    assert (stat["step"], stat["step_time_s"], stat["tokens_per_s"], stat["chips"], stat["straggler"]) == \
        (None, None, None, "no TPU", None)
    # capture with no trainer beside it needs its --out: one line, exit 2
    cap = subprocess.run([sys.executable, "-m", "trainer", "capture", "--duration-ms", "100"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=120)
    assert cap.returncode == 2 and cap.stderr.strip().splitlines() == [
        "error: capture: pass --out DIR (no trainer beside this process names its --ckpt-dir and TPUCTL_RUN_ID)"]
