"""One job over two slices, end to end on this machine: `tpuctl up --local -a v4-8 --num-slices 2` (one multislice
queued resource in the TPU API stand-in, each slice's worker its own sshd host), `tpuctl run` trains a
gpt2-tiny-sized model 30 steps on both slices as one jax.distributed job (--mesh is one slice's; the slices add
the dcn axis), slice 1 is preempted after step 15 (its node PREEMPTED, its VM's processes die; slice 0's when the
queued resource is deleted), tpuctl recreates both and the same command resumes. Step 30 must equal, bit for bit, an
uninterrupted run of the same job, and its loss that of one v4-16 with --mesh data=8,model=1 at the same global
batch (both made cheaply: two plain trainer processes with the environment the hosts get, no SSH), and `down`
leaves nothing."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _local_hosts import TEST_CACHE, needs_hosts
from bench.system.preempt import ARGS, BUCKET, LocalSpot
from infra.fake_tpu_api import FakeControl
from infra.local_slice import LocalSlice
from test_preemption_e2e import COMPARE

pytestmark = [needs_hosts, pytest.mark.e2e, pytest.mark.slow]

STEPS = 30


def _args(mesh: str) -> list[str]:
    """bench.system.preempt's gpt2-tiny-sized run, 30 steps, a checkpoint every 5, global batch 8."""
    change = {"--steps": str(STEPS), "--ckpt-every": "5", "--mesh": mesh, "--decay-steps": "25"}
    out = list(ARGS)
    for i, a in enumerate(out[:-1]):
        if a in change:
            out[i + 1] = change[a]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(spot: LocalSpot, args: list[str], ckpt: str, slices: int) -> str:
    """Two plain trainer processes of 4 emulated devices each: two v4-8 slices (the environment `tpuctl run` gives
    their hosts: slice-major ids, MEGASCALE_*) or, with slices=1, one v4-16's two hosts. No SSH, no bundle.
    Returns process 0's output. The coordinator's port is picked free here and bound later by process 0: should
    another process take it in between (a busy machine's ephemeral ports), the pair is started again on another."""
    for attempt in range(3):
        outs, codes = _plain_once(spot, args, ckpt, slices, _free_port())
        if codes == [0, 0] or attempt == 2 or PORT_TAKEN not in outs[0]:
            break
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return outs[0]


PORT_TAKEN = "Failed to add port to server"  # grpc's words when the coordinator cannot bind its port


def _plain_once(spot: LocalSpot, args: list[str], ckpt: str, slices: int, port: int) -> tuple[list[str], list[int]]:
    procs = []
    for i in range(2):
        env = {**spot.env, **spot.emu.env, "JAX_PLATFORMS": "cpu", "TPUCTL_EMULATE_DEVICES": "4",
               "TPUCTL_COORDINATOR": f"127.0.0.1:{port}", "TPUCTL_NUM_PROCESSES": "2", "TPUCTL_PROCESS_ID": str(i),
               "TPUCTL_HEARTBEAT_TIMEOUT_S": "60", "TPUCTL_INIT_TIMEOUT_S": "300"}
        if slices > 1:
            env.update(MEGASCALE_COORDINATOR_ADDRESS="127.0.0.1", MEGASCALE_NUM_SLICES=str(slices),
                       MEGASCALE_SLICE_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer", *args, "--ckpt-dir", ckpt], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return outs, [p.returncode for p in procs]


READ = r"""
import json, sys, gcsfs
fs = gcsfs.GCSFileSystem()
print(json.dumps([[json.loads(l) for l in fs.cat(p).decode().splitlines() if l.strip()] if p.endswith("l")
                  else [json.loads(fs.cat(p))] for p in sys.argv[1:]]))
"""


def test_two_slices_one_job_survive_a_slice_preemption_bit_equal(tmp_path):
    args, v4_16 = _args("data=4,model=1"), _args("data=8,model=1")
    # The hosts install from the machine's test wheelhouse (a machine-wide cache, as $TPUCTL_HOME/wheelhouse is
    # for users): the dependency layer is built once per machine, not once per test.
    (tmp_path / "home").mkdir()
    TEST_CACHE.joinpath("wheelhouse").mkdir(parents=True, exist_ok=True)
    (tmp_path / "home" / "wheelhouse").symlink_to(TEST_CACHE / "wheelhouse")
    with LocalSpot(tmp_path / "home", name="ms", accelerator="v4-8", num_slices=2) as spot:
        fake = FakeControl(spot.api["url"])
        # 1. One queued resource with multisliceParams.nodeCount 2; nodes ms-0 and ms-1, each worker its own host.
        creates = fake.state()["create_calls"]
        assert [c["kind"] for c in creates] == ["queuedResource"]
        assert creates[0]["body"]["tpu"]["nodeSpec"][0]["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "ms"}
        st = json.loads(spot.cli("status", "ms", "--local", "--json").stdout)
        assert [d["node"].rsplit("/", 1)[1] for d in st["nodes"]] == ["ms-0", "ms-1"]
        assert [(w["slice"], w["index"]) for w in st["workers"]] == [(0, 0), (1, 0)]
        assert len({w["internal_ip"] for w in st["workers"]}) == 2 and set(LocalSlice.names(
            tmp_path / "home" / "local" / "slices")) == {"ms-0", "ms-1"}

        # 2 + 3. Both slices as one job; slice 1 preempted after step 15; both recreated; resumed to step 30.
        rc, res, err = spot.run(f"gs://{BUCKET}/ms", (15,), args=args, node="ms-1", log="s0w0.log", steps=STEPS)
        assert rc == 0, err[-4000:]
        # Every host's lines carry its slice and worker; each host has its log (process 1 writes nothing of its
        # own: its progress reports are the runner's, and no native library logs at INFO).
        assert "one job over 2 slices of v4-8" in err and "[s0w0] step 30/30" in err
        # run's gate planned the hybrid step on the slices' CPU devices before launching
        assert "[tpuctl] plan: fits on 2 x v4-8: " in err and "(2 slices joined by DCN: " in err
        assert "[s0w0] mesh 2 slices x data=4,model=1 (8 devices, 2 processes)" in err
        assert all((Path(res["run_dir"]) / f"s{s}w0.log").is_file() for s in (0, 1))
        first, second = res["attempts"]
        assert first["outcome"] == "preempted" and second["outcome"] == "done", res["attempts"]
        assert second["resumed_from"] in (10, 15), res["attempts"]
        assert "ms's slice 1 (ms-1) of 2 was preempted" in err and "FAILED" not in err and "---- s" not in err, \
            err[-3000:]
        assert "1 preemption(s)" in err and res["goodput"]["restarts"] == 1
        _plain(spot, args, f"gs://{BUCKET}/ref", slices=2)
        one = _plain(spot, v4_16, f"gs://{BUCKET}/v4-16", slices=1)
        assert "mesh data=8,model=1 over 8" in one and "slices" not in one

        env = {**spot.env, **spot.emu.env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
               "JAX_PLATFORMS": "cpu"}
        got = subprocess.run([sys.executable, "-c", READ, f"{BUCKET}/ms/metrics.jsonl",
                              f"{BUCKET}/v4-16/metrics.jsonl", f"{BUCKET}/ms/run_info.json"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr[-2000:]
        rows_ms, rows_one, info = json.loads(got.stdout)
        ms, one = ([r["loss"] for r in rows if r["step"] == STEPS][-1] for rows in (rows_ms, rows_one))
        assert abs(ms - one) <= 1e-4 * abs(one), (ms, one)
        info = info[0]
        assert info["mesh"] == {"dcn": 2, "data": 4, "model": 1} and info["process_slices"] == [0, 1], info
        cmp = subprocess.run([sys.executable, "-c", COMPARE, json.dumps([*v4_16, "--ckpt-dir", "x"]),
                              f"gs://{BUCKET}/ref", f"gs://{BUCKET}/ms"], env=env, capture_output=True, text=True,
                             timeout=300)
        assert cmp.returncode == 0, cmp.stderr[-3000:]
        same = json.loads(cmp.stdout.strip().splitlines()[-1])
        assert same["steps"] == [STEPS, STEPS] and same["leaves"] >= 20 and same["equal"], same  # params + Adam

        # 4. down: no node, no queued resource, no local host left.
        down = spot.cli("down", "ms", "--local")
        assert down.returncode == 0, down.stderr
        left = fake.state()
        assert left["nodes"] == [] and left["queued_resources"] == []
        assert LocalSlice.names(tmp_path / "home" / "local" / "slices") == []
