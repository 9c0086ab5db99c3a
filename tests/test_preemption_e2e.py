"""A spot run through a real preemption: the TPU API stand-in preempts the node at a random step while the real
trainer runs on a 2-host local slice, the hosts die with their "VMs", `tpuctl run` recreates the slice and runs
the command again, and the trainer resumes from its latest complete checkpoint in gs:// (the GCS emulator).
The final parameters and optimizer state must equal, bit for bit, those of an uninterrupted run."""
import json
import random
import subprocess
import sys
import time

import pytest

from _local_hosts import needs_hosts
from bench.preempt import ARGS, BUCKET, STEPS, LocalSpot

pytestmark = [needs_hosts, pytest.mark.e2e, pytest.mark.slow]

# Restores both runs' last step onto the same mesh (8 devices, one process) and compares every leaf exactly.
COMPARE = r"""
import json, sys
import numpy as np, jax
from trainer.cli import parser
from trainer.common import config
from trainer.pretrain import train as loop
from trainer.common.checkpoint import Checkpointer
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
    with LocalSpot(tmp_path / "home") as spot:
        ref_rc, _, ref_err = spot.run(f"gs://{BUCKET}/ref")
        assert ref_rc == 0, ref_err[-3000:]
        at = random.Random(time.time_ns()).randint(13, 27)  # printed on failure: the step it was preempted at
        rc, res, err = spot.run(f"gs://{BUCKET}/run", (at,))
        assert rc == 0, f"preempted at {at}\n{err[-4000:]}"
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
        status = json.loads(spot.cli("status", spot.name, "--local", "--json").stdout)
        assert status["last_run"]["goodput"] == g and status["last_run"]["run_id"] == res["run_id"]

        cmp = subprocess.run([sys.executable, "-c", COMPARE, json.dumps([*ARGS, "--ckpt-dir", "x"]),
                              f"gs://{BUCKET}/ref", f"gs://{BUCKET}/run"],
                             env={**spot.env, **spot.emu.env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                                  "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
        assert cmp.returncode == 0, cmp.stderr[-3000:]
        got = json.loads(cmp.stdout.strip().splitlines()[-1])
        assert got["steps"] == [STEPS, STEPS] and got["leaves"] >= 40 and got["equal"], (at, got)  # params + Adam
