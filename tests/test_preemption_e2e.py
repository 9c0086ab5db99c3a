"""A spot run through a real preemption: the TPU API stand-in preempts the node at a random step while the real
trainer runs on a 2-host local slice, the hosts die with their "VMs", `tpuctl run` recreates the slice and runs
the command again, and the trainer resumes from its latest complete checkpoint in gs:// (the GCS emulator).
The final parameters and optimizer state must equal, bit for bit, those of an uninterrupted run."""
import json
import os
import random
import subprocess
import sys
import time

import pytest

from _local_hosts import TEST_CACHE, needs_hosts
from bench.system.preempt import ARGS, BUCKET, STEPS, LocalSpot

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


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    """One local cloud, slice and uninterrupted reference run for the attached and the managed run. The hosts (and
    the controller's) install from the machine's test wheelhouse, as every e2e test's do: the dependency layer and
    the hosts' compile cache are built once per machine, not once per test."""
    home = tmp_path_factory.mktemp("preempt") / "home"
    home.mkdir()
    TEST_CACHE.joinpath("wheelhouse").mkdir(parents=True, exist_ok=True)
    (home / "wheelhouse").symlink_to(TEST_CACHE / "wheelhouse")
    with LocalSpot(home) as spot:
        ref_rc, _, ref_err = spot.run(f"gs://{BUCKET}/ref")
        assert ref_rc == 0, ref_err[-3000:]
        yield spot


def _bit_equal_to_ref(spot, ckpt: str) -> dict:
    cmp = subprocess.run([sys.executable, "-c", COMPARE, json.dumps([*ARGS, "--ckpt-dir", "x"]),
                          f"gs://{BUCKET}/ref", ckpt],
                         env={**spot.env, **spot.emu.env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                              "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 0, cmp.stderr[-3000:]
    return json.loads(cmp.stdout.strip().splitlines()[-1])


def test_a_preempted_run_is_recreated_resumes_and_ends_bit_equal(spot):
    if True:
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

        # Goodput: the parts add up to the wall time, and the table says where the time went. What no part
        # claims (unaccounted) is the bookkeeping between attempts here: the local slice record and the run's
        # step files read, milliseconds; 5% of the wall (several seconds) is out of a loaded machine's reach,
        # while a recreate or a start-up left out of its part would take seconds of it.
        g = res["goodput"]
        parts = g["productive_s"] + g["lost_to_preemptions_s"] + g["overhead_s"] + g["unaccounted_s"]
        assert abs(parts - g["wall_s"]) < 1e-6 and abs(g["unaccounted_s"]) < 0.05 * g["wall_s"], g
        assert g["restarts"] == 1 and 0 < g["goodput"] < 1 and g["redone_s"] > 0 and second["recover_s"] > 0, g
        assert f"goodput {g['goodput']:.1%}" in err and "attempt  outcome" in err
        status = json.loads(spot.cli("status", spot.name, "--local", "--json").stdout)
        assert status["last_run"]["goodput"] == g and status["last_run"]["run_id"] == res["run_id"]

        got = _bit_equal_to_ref(spot, f"gs://{BUCKET}/run")
        assert got["steps"] == [STEPS, STEPS] and got["leaves"] >= 40 and got["equal"], (at, got)  # params + Adam


# ---- managed jobs: the laptop leaves, the controller dies, cancel, idle -------------------------------------
def _pidns(pid) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _tpuctl_procs_here(home) -> list[str]:
    """This user's tpuctl processes (TPUCTL_HOME=home) in this machine's PID namespace; the controller's host and
    the TPU hosts have namespaces of their own. (Other tpuctl users of a shared machine are not this laptop.)"""
    mine, out, tag = _pidns("self"), [], f"TPUCTL_HOME={home}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "orchestrator" in cmd and "infra." not in cmd and _pidns(d) == mine:
            try:
                if tag in open(f"/proc/{d}/environ", "rb").read().split(b"\0"):
                    out.append(f"{d}: {cmd[:200]}")
            except OSError:
                continue
    return out


def _trainers() -> list[int]:
    """The long job's trainer processes (`python -m trainer pretrain ...`, not the wrappers that name them)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if argv[1:4] == [b"-m", b"trainer", b"pretrain"] and b"gs://preempt-e2e/long" in argv:
            out.append(int(d))
    return sorted(out)


def _has(path: str, text: str) -> bool:
    try:
        return text.encode() in open(path, "rb").read()
    except OSError:
        return False


def _jobs(spot, env=None) -> list[dict]:
    r = subprocess.run([*spot.tpuctl, "jobs", "--local", "--json", "--bucket", BUCKET], env=env or spot.env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _gcs(spot):
    """The job bucket, read from this test's process (google-cloud-storage on the emulator)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    if not hasattr(spot, "gcs"):
        spot.gcs = storage.Client(project="local", credentials=AnonymousCredentials(),
                                  client_options={"api_endpoint": spot.emu.endpoint}).bucket(BUCKET)
    return spot.gcs


def _record(spot, rel: str) -> dict | None:
    from google.api_core import exceptions as gx
    try:
        return json.loads(_gcs(spot).blob(f"tpuctl/{rel}").download_as_bytes())
    except gx.NotFound:
        return None


def _until(spot, job_id: str, ok, what: str, timeout: float = 420, check=None) -> dict:
    """Poll the job's record (state.json, what `tpuctl jobs` lists) until ok(job). Read here rather than through a
    `tpuctl jobs` per poll: each would take a second of CPU from the 2 cores the hosts train on, and would replace a
    controller whose heartbeat a loaded machine delayed. A wait that outlives `timeout` says what it waited for,
    before pytest's own limit ends the test without a word."""
    deadline = time.time() + timeout
    while True:
        job = _record(spot, f"jobs/{job_id}/state.json") or {"state": "PENDING"}
        if check:
            check(job)
        if ok(job):
            return job
        assert job["state"] in ("PENDING", "STARTING", "RUNNING", "RECOVERING") and time.time() < deadline, \
            f"waiting for {what}: {job}"
        time.sleep(1)


def _instances(spot) -> list[str]:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1
    url = json.loads((spot.home / "local" / "fake_login_apis.json").read_text())["url"]
    c = compute_v1.InstancesClient(transport="rest", credentials=AnonymousCredentials(),
                                   client_options={"api_endpoint": url})
    return [i.name for i in c.list(project="local-project", zone=spot.zone)], c


def _node(spot) -> str:
    # The controller beats every 2 s; a loaded 2-core runner can delay a beat by several, and a command that finds
    # it stale replaces a controller that is alive. 15 s is 7 beats; the controller-dies test waits this long for
    # the deleted controller's heartbeat to go stale (the default, 30 s, would double that wait).
    spot.env["TPUCTL_CONTROLLER_STALE_S"] = "15"
    node = json.loads(spot.cli("status", spot.name, "--local", "--json").stdout)["node"]
    spot.zone = node.split("/")[3]
    return node


def test_a_managed_job_outlives_the_laptop_and_a_preemption(spot):
    """Must-show: the laptop leaves (every tpuctl here SIGKILLed after the submit), the slice is preempted, the job
    ends SUCCEEDED with 1 recovery, bit-equal to the uninterrupted run, read from a fresh TPUCTL_HOME."""
    from infra.fake_tpu_api import FakeControl
    node = _node(spot)
    sub = spot.cli("run", spot.name, "--detach", "--json", "--controller-idle", "0.4", "--", *ARGS,
                   "--ckpt-dir", f"gs://{BUCKET}/managed")
    assert sub.returncode == 0, sub.stderr[-3000:]
    job = json.loads(sub.stdout)
    for line in _tpuctl_procs_here(spot.home):  # the laptop leaves: nothing of tpuctl outlives the submit here
        os.kill(int(line.split(":")[0]), 9)
    strays: list[str] = []

    def watch(j):  # from the submit to the end, only these `jobs` reads ran tpuctl on this machine
        strays.extend(_tpuctl_procs_here(spot.home))

    watch(None)
    spot.wait_step(f"gs://{BUCKET}/managed", 13)
    FakeControl(spot.api["url"]).preempt(node)
    done = _until(spot, job["id"], lambda j: j["state"] == "SUCCEEDED", "SUCCEEDED", check=watch)
    assert not strays, strays

    # `sweep --detach`: the controller runs each trial of the grid, then writes the report into the bucket.
    # Submitted now, while the controller is up (it idles out --controller-idle after its last job), and checked
    # last: the checks below run beside it instead of before a new controller VM.
    base, skip = [], 0
    for i, a in enumerate(ARGS):  # the trials' base: short, the width the grid's axis
        if skip:
            skip -= 1
        elif a in ("--d-model", "--steps"):
            skip = 1
        else:
            base.append(a)
    sw = spot.cli("sweep", spot.name, "--local", "--detach", "--json", "--controller-idle", "0.4", "--set",
                  "d_model=16,32", "--out", f"gs://{BUCKET}/sweep", "--", *base, "--steps", "4")
    assert sw.returncode == 0, sw.stderr[-3000:]

    assert done["recoveries"] == 1 and done["step"] == STEPS, done
    assert done["goodput"]["restarts"] == 1 and 0 < done["goodput"]["goodput"] < 1, done
    # every attempt is in the job's record (a controller that replaced this one would count them too)
    assert [a["outcome"] for a in done["attempts"]] == ["preempted", "done"], done["attempts"]
    got = _bit_equal_to_ref(spot, f"gs://{BUCKET}/managed")
    assert got["steps"] == [STEPS, STEPS] and got["leaves"] >= 40 and got["equal"], got
    # From any machine: an empty TPUCTL_HOME and the bucket's name (and this machine's local cloud).
    fresh = {**spot.env, "TPUCTL_HOME": str(spot.home.parent / "fresh"), "TPUCTL_LOCAL_DIR": str(spot.home / "local")}
    (seen,) = [j for j in _jobs(spot, fresh) if j["id"] == job["id"]]
    assert seen["state"] == "SUCCEEDED" and seen["recoveries"] == 1 and seen["goodput"] == done["goodput"], seen
    logs = subprocess.run([*spot.tpuctl, "logs", job["id"], "--local", "--bucket", BUCKET], env=fresh,
                          capture_output=True, text=True, timeout=120)
    assert logs.returncode == 0 and f"step {STEPS}/{STEPS}" in logs.stdout and "recreating" in logs.stdout, \
        logs.stdout[-3000:] + logs.stderr[-2000:]

    swept = _until(spot, json.loads(sw.stdout)["id"], lambda j: j["state"] == "SUCCEEDED", "the sweep")
    assert [t["status"] for t in swept["trials"]] == ["done", "done"], swept
    assert swept["report"] == f"gs://{BUCKET}/sweep/report/report.html" and "2/2 trial(s) done" in swept["message"]


def test_a_managed_jobs_controller_dies_and_is_replaced_then_cancel_and_idle(spot):
    """Must-show: a job's controller VM is deleted mid-run and the next `jobs` brings a new one that re-attaches to
    the same run; `down` refuses while it is live; `cancel` stops every host; the idle controller deletes its VM."""
    _node(spot)
    long_args = [a if a != str(STEPS) else "100000" for a in ARGS]
    token = "tok-" + os.urandom(8).hex()  # a job's secret: to the trainers through Secret Manager, nowhere else
    spot.env["JOB_TOKEN"] = token
    sub = spot.cli("run", spot.name, "--detach", "--json", "--controller-idle", "0.25", "--secret-env", "JOB_TOKEN",
                   "--", *long_args, "--ckpt-dir", f"gs://{BUCKET}/long")
    del spot.env["JOB_TOKEN"]
    assert sub.returncode == 0, sub.stderr[-3000:]
    job2 = json.loads(sub.stdout)
    before = _until(spot, job2["id"], lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 3, "RUNNING")
    for pid in _trainers():
        assert f"JOB_TOKEN={token}".encode() in open(f"/proc/{pid}/environ", "rb").read()
    blobs = list(_gcs(spot).list_blobs(prefix="tpuctl/"))
    assert blobs and not [b.name for b in blobs if token.encode() in b.download_as_bytes()]
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _has(f"/proc/{p}/cmdline", token)]
    down = spot.cli("down", spot.name, "--local")
    assert down.returncode != 0 and job2["id"] in down.stderr and "--force" in down.stderr, down.stderr
    names, compute = _instances(spot)
    (ctl_name,) = names
    compute.delete(project="local-project", zone=spot.zone, instance=ctl_name)
    trainers = _trainers()
    assert len(trainers) == 2, trainers
    stale, region = float(spot.env["TPUCTL_CONTROLLER_STALE_S"]), spot.zone.rsplit("-", 1)[0]
    deadline = time.time() + 120
    while time.time() - (_record(spot, f"controller/{region}.json") or {}).get("at", 0) <= stale:
        assert time.time() < deadline, "the deleted controller's heartbeat never went stale"
        time.sleep(0.5)
    assert _trainers() == trainers  # training goes on without a controller
    _jobs(spot)  # the next `tpuctl jobs` finds the heartbeat stale and brings a new controller
    hb = _record(spot, f"controller/{region}.json")
    assert hb and not hb.get("booting") and hb["started"] > before["controller_since"], hb
    after = _until(spot, job2["id"], lambda j: j["controller_since"] != before["controller_since"] and
                   (j["step"] or 0) > before["step"] + 5, "the new controller to re-attach")
    assert after["run_id"] == before["run_id"] and after["recoveries"] == 0, (before, after)
    assert _trainers() == trainers  # the same processes: re-attached, not restarted
    # Cancel: every host stops within 30 s of the command (timed on the hosts' processes, not on the command's
    # own return), the job reads CANCELLED, nothing is left on the hosts.
    t0 = time.time()
    c = subprocess.Popen([*spot.tpuctl, "cancel", job2["id"], "--local", "--json", "--bucket", BUCKET], env=spot.env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while _trainers() and time.time() - t0 < 60:
        time.sleep(0.2)
    stopped_s = time.time() - t0
    out, err = c.communicate(timeout=300)
    assert c.returncode == 0 and json.loads(out)["state"] == "CANCELLED", out + err[-3000:]
    assert not _trainers() and stopped_s < 30, (_trainers(), stopped_s)
    # Idle: the controller deletes its own VM (--controller-idle 0.25: 15 s after the cancel).
    deadline = time.time() + 180
    while _instances(spot)[0]:
        assert time.time() < deadline, "the idle controller did not delete its VM"
        time.sleep(1)
