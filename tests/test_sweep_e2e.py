"""`tpuctl sweep` on a local slice (`up --local`: the TPU API stand-in, a real sshd host, the GCS emulator): a 2x2
grid of n_layer x d_model. Interrupted in its second trial, the sweep is run again: the finished trial is skipped,
only the interrupted one resumes from its checkpoint, the other two start; the table has 4 rows with the model's
parameter counts; a third run of the same sweep runs nothing."""
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from _local_hosts import TEST_CACHE, needs_hosts
from infra import gcs
from infra.local_slice import LocalSlice

pytestmark = [needs_hosts, pytest.mark.e2e, pytest.mark.slow]

# Tiny trials; long enough (40 steps) that an interrupt seen at step 5 lands well before the end.
BASE = ["pretrain", "--n-head", "2", "--seq-len", "32", "--batch-size", "8", "--steps", "40", "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0", "--warmup-steps", "2",
        "--decay-steps", "50"]
GRID = ["--set", "n_layer=1,2", "--set", "d_model=32,64"]
TRIALS = ["n_layer-1_d_model-32", "n_layer-1_d_model-64", "n_layer-2_d_model-32", "n_layer-2_d_model-64"]


def tpuctl(*args, env, timeout=600):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def _params_said(log: str) -> dict[str, tuple[int, int]]:
    """trial -> (the parameter count, the devices) the trainer itself printed ("[w0] 1,623,520 params | mesh
    data=2,model=1 over 2 cpu devices in 1 process(es)")."""
    out, trial = {}, None
    for line in log.splitlines():
        m = re.search(r"\] (\S+): tpuctl run ", line)
        if m:
            trial = m.group(1)
        m = re.match(r"\[w0\] ([\d,]+) params \| mesh \S+ over (\d+) cpu devices", line)
        if m and trial:
            out[trial] = (int(m.group(1).replace(",", "")), int(m.group(2)))
    return out


def test_a_2x2_sweep_on_a_local_slice_resumes_only_the_interrupted_trial_then_runs_nothing(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (TEST_CACHE / "wheelhouse").mkdir(parents=True, exist_ok=True)
    (home / "wheelhouse").symlink_to(TEST_CACHE / "wheelhouse")  # the machine-wide cache of the other e2e tests
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TPUCTL_", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_")) and k != "XLA_FLAGS"}
    env.update(TPUCTL_HOME=str(home), TPUCTL_POLL_S="0.05", CLOUDSDK_CONFIG=str(home / "gcloud"),
               TPUCTL_SSH_KEY=os.environ["TPUCTL_SSH_KEY"])
    emu = gcs.start(home=home, buckets=("sweeps",))  # recorded: tpuctl run and sweep reuse it
    api_pid = None
    # --no-plan: each trial's `tpuctl run` would compile its step for the v4-8 first (the plan gate has its own
    # tests in test_plan.py); what this test shows is the sweep's bookkeeping across runs.
    # --env reaches every trial's trainer: 2 emulated devices where the host's own setting is 4 (v4-8), which
    # each trainer prints.
    sweep = ["sweep", "sw", "--local", *GRID, "--no-plan", "--env", "TPUCTL_EMULATE_DEVICES=2",
             "--out", "gs://sweeps/depth-width"]
    try:
        up = tpuctl("up", "sw", "--local", "-a", "v4-8", env=env, timeout=180)
        assert up.returncode == 0, up.stderr
        api_pid = json.loads((home / "local" / "fake_tpu_api.json").read_text())["pid"]

        # 1. Ctrl-C while the second trial trains: it saves its step, the sweep stops (exit 130).
        p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *sweep, "--", *BASE], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             # Ctrl-C as a terminal delivers it, even when this test runs with SIGINT ignored
                             # (a background job): an ignored signal stays ignored across exec.
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        guard = threading.Timer(420, os.killpg, (p.pid, signal.SIGKILL))
        guard.start()
        first, in_second = [], False
        try:
            for line in p.stdout:
                first.append(line)
                in_second = in_second or f"[2/4] {TRIALS[1]}:" in line
                if in_second and re.match(r"\[w0\] step +5/40 ", line):
                    os.killpg(p.pid, signal.SIGINT)
                    break
            first += p.communicate(timeout=180)[0]
        finally:
            guard.cancel()
        log1 = "".join(first)
        assert p.returncode == 130, log1[-4000:]
        saved = re.search(r"\[w0\] preemption notice: saved step (\d+) to gs://sweeps/depth-width/" + TRIALS[1], log1)
        assert saved, log1[-4000:]
        step = int(saved.group(1))
        assert 5 <= step < 40
        assert f"sweep interrupted in {TRIALS[1]}: the same command resumes it" in log1

        # 2. The same command: the finished trial is skipped, only the interrupted one resumes.
        r2 = tpuctl(*sweep, "--json", "--", *BASE, env=env)
        assert r2.returncode == 0, r2.stderr[-4000:]
        assert "4 trial(s), 1 done, 3 to run" in r2.stderr
        assert f"tpuctl run sw -- {' '.join(BASE)} --n-layer 1 --d-model 32" not in r2.stderr  # trial 1 skipped
        assert r2.stderr.count("resuming from step") == 1
        assert f"resuming from step {step}" in r2.stderr and r2.stderr.count("starting from scratch") == 2
        res = json.loads(r2.stdout)
        assert [(t["name"], t["status"]) for t in res["trials"]] == [(TRIALS[0], "skipped")] + \
            [(n, "done") for n in TRIALS[1:]]
        rows = {r["trial"]: r for r in res["report"]["rows"]}
        assert list(rows) == TRIALS and all(r["status"] == "done" for r in rows.values())
        said = {**_params_said(log1), **_params_said(r2.stderr)}
        assert sorted(said) == TRIALS
        for name in TRIALS:
            assert rows[name]["params"] == said[name][0], (name, rows[name], said[name])
            assert said[name][1] == 2, (name, said[name])  # --env TPUCTL_EMULATE_DEVICES=2
            assert rows[name]["tokens"] == 40 * 8 * 32 and rows[name]["best_val_loss"] is not None
        # Non-embedding: 12 d^2 + 13 d per layer (4x MLP) + the final LayerNorm.
        for name in TRIALS:
            nl, d = (int(x) for x in re.findall(r"\d+", name))
            assert rows[name]["params_non_embedding"] == nl * (12 * d * d + 13 * d) + 2 * d
        assert os.path.getsize(res["report"]["html"]) > 0
        assert res["report"]["html"] == str(home / "sweeps" / "sw" / "report" / "report.html")

        # 3. Once more: nothing to run, no run started.
        runs = sorted((home / "runs" / "sw").iterdir())
        r3 = tpuctl(*sweep, "--", *BASE, env=env)
        assert r3.returncode == 0, r3.stderr[-3000:]
        assert "4 trial(s), 4 done, 0 to run" in r3.stderr and "[w0]" not in r3.stderr
        assert sorted((home / "runs" / "sw").iterdir()) == runs
        assert "sweep sw: 4/4 trial(s) done in gs://sweeps/depth-width" in r3.stdout
    finally:
        tpuctl("down", "sw", "--local", "--yes", env=env, timeout=180)
        sl = LocalSlice.load("sw", home / "local" / "slices")
        if sl is not None:
            sl.stop()
        emu.stop()
        if api_pid:
            try:
                os.kill(api_pid, signal.SIGKILL)
                os.waitpid(api_pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
