"""A spot run through a real preemption: the TPU API stand-in preempts the node at a random step while the real
trainer runs on a 2-host local slice, the hosts die with their "VMs", `tpuctl run` recreates the slice and runs
the command again, and the trainer resumes from its latest complete checkpoint in gs:// (the GCS emulator).
The final parameters and optimizer state must equal, bit for bit, those of an uninterrupted run."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from _local_hosts import needs_hosts
from infra import gcs
from infra.fake_tpu_api import FakeControl

pytestmark = [needs_hosts, pytest.mark.e2e, pytest.mark.slow]

STEPS = 60
ARGS = ["pretrain", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32", "--batch-size", "8",
        "--dropout", "0.1", "--warmup-steps", "2", "--decay-steps", "50", "--lr", "1e-2", "--seed", "7",
        "--mesh", "data=4,model=2", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--steps", str(STEPS), "--ckpt-every", "10", "--data", "gs://preempt-e2e/data"]

# Restores both runs' last step onto the same mesh (8 devices, one process) and compares every leaf exactly.
COMPARE = r"""
import json, sys
import numpy as np, jax
from trainer.__main__ import parser
from trainer import config, loop
from trainer.checkpoint import Checkpointer
cfg = config.resolve(parser().parse_args(json.loads(sys.argv[1])))
steps = loop.Steps(cfg, loop.setup_mesh(cfg))
trees = []
for d in sys.argv[2:]:
    ck = Checkpointer(d, 1, read_only=True)
    trees.append((ck.latest_step(), ck.restore(ck.latest_step(), steps.abstract_params, steps.abstract_opt)))
(sa, a), (sb, b) = trees
la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
print(json.dumps({"steps": [sa, sb], "leaves": len(la),
                  "equal": len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))}))
"""


def test_a_preempted_run_is_recreated_resumes_and_ends_bit_equal(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TPUCTL_", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_")) and k != "XLA_FLAGS"}
    env.update(TPUCTL_HOME=str(home), TPUCTL_POLL_S="0.05", CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               TPUCTL_SSH_KEY=os.environ["TPUCTL_SSH_KEY"])
    emu = gcs.start(home=home, buckets=("preempt-e2e",), record=True)
    tpuctl = [sys.executable, "-m", "orchestrator.cli"]
    api_pid = None
    try:
        prep = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--out", "gs://preempt-e2e/data"],
                              env={**env, **emu.env}, capture_output=True, text=True, timeout=300)
        assert prep.returncode == 0, prep.stderr[-2000:]
        up = subprocess.run([*tpuctl, "up", "pre", "--local", "-a", "v4-16"], env=env, capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, up.stderr
        info = json.loads((home / "local" / "fake_tpu_api.json").read_text())
        api_pid = info["pid"]

        ref = subprocess.run([*tpuctl, "run", "pre", "--local", "--json", "--", *ARGS, "--ckpt-dir",
                              "gs://preempt-e2e/ref"], env=env, capture_output=True, text=True, timeout=900)
        assert ref.returncode == 0, ref.stderr[-3000:]

        at = random.Random(time.time_ns()).randint(13, 27)  # printed on failure: the step it was preempted at
        run = subprocess.Popen([*tpuctl, "run", "pre", "--local", "--json", "--", *ARGS, "--ckpt-dir",
                                "gs://preempt-e2e/run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        node = json.loads(subprocess.run([*tpuctl, "status", "pre", "--local", "--json"], env=env,
                                         capture_output=True, text=True, timeout=120).stdout)["node"]
        runs = home / "runs" / "pre"
        deadline = time.time() + 600
        while True:
            logs = sorted(runs.glob("*/w0.log"))
            text = logs[-1].read_text(errors="replace") if len(logs) == 2 else ""
            if f"step {at}/{STEPS}" in text:
                break
            assert run.poll() is None and time.time() < deadline, f"preempt at {at}: {text[-2000:]}"
            time.sleep(0.05)
        FakeControl(info["url"]).preempt(node)
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, f"preempted at {at}\n{err[-4000:]}"
        res = json.loads(out)
        first, second = res["attempts"]
        assert first["outcome"] == "preempted" and second["outcome"] == "done", res["attempts"]
        assert first["last_step"] >= at and second["resumed_from"] in (10, 20, 30), res["attempts"]
        assert second["resumed_from"] <= first["last_step"] < second["resumed_from"] + 20
        assert res["steps_redone"] == second["steps_redone"] == first["last_step"] - second["resumed_from"]
        # Reported as a preemption, once, with the step: no FAILED line, no host tails repeated.
        assert f"VM was preempted at step {first['last_step']}" in err or \
            f"VMs were preempted at step {first['last_step']}" in err, err[-3000:]
        assert "FAILED" not in err and "---- w" not in err, err[-3000:]
        assert (f"1 preemption(s): lost at step {first['last_step']}, resumed from step {second['resumed_from']}; "
                f"{res['steps_redone']} step(s) redone") in err

        # Goodput: the parts add up to the wall time (within 1%), and the table says where the time went.
        g = res["goodput"]
        parts = g["productive_s"] + g["lost_to_preemptions_s"] + g["overhead_s"]
        assert abs(parts - g["wall_s"]) <= 0.01 * g["wall_s"], g
        assert g["restarts"] == 1 and 0 < g["goodput"] < 1 and g["redone_s"] > 0 and second["recover_s"] > 0, g
        assert f"goodput {g['goodput']:.1%}" in err and "attempt  outcome" in err
        status = json.loads(subprocess.run([*tpuctl, "status", "pre", "--local", "--json"], env=env,
                                           capture_output=True, text=True, timeout=120).stdout)
        assert status["last_run"]["goodput"] == g and status["last_run"]["run_id"] == res["run_id"]

        cmp = subprocess.run([sys.executable, "-c", COMPARE, json.dumps([*ARGS, "--ckpt-dir", "x"]),
                              "gs://preempt-e2e/ref", "gs://preempt-e2e/run"],
                             env={**env, **emu.env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                                  "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
        assert cmp.returncode == 0, cmp.stderr[-3000:]
        got = json.loads(cmp.stdout.strip().splitlines()[-1])
        assert got["steps"] == [STEPS, STEPS] and got["leaves"] >= 40 and got["equal"], (at, got)  # params + Adam
    finally:
        subprocess.run([*tpuctl, "down", "pre", "--local"], env=env, capture_output=True, timeout=300)
        gcs.stop(home)
        if api_pid:
            os.kill(api_pid, signal.SIGKILL)
            try:
                os.waitpid(api_pid, 0)
            except ChildProcessError:
                pass
