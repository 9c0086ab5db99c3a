"""End to end on hosts shaped like fresh TPU VMs (`tpuctl up --local --fresh-vm`): no uv, no wheelhouse, the
system's python3 and its pip configuration. `run` must bootstrap every host from the package index itself,
the path every real VM takes, then train across both hosts with checkpoints in gs:// (the GCS emulator)."""
import json
import os
import signal
import subprocess
import sys

import pytest

from _local_hosts import needs_hosts, wait_idle
from infra import gcs
from infra.fake_tpu_api import FakeControl

pytestmark = [needs_hosts, pytest.mark.e2e, pytest.mark.slow]

TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32", "--batch-size", "8",
        "--mesh", "data=4,model=2", "--log-every", "1", "--eval-every", "0", "--steps", "4"]


def tpuctl(*args, env, timeout=900):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def test_a_two_host_run_on_fresh_vms_bootstraps_from_the_index_and_trains(tmp_path):
    from infra.local_slice import LocalSlice
    from orchestrator.provider import cloud
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TPUCTL_", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_")) and k != "XLA_FLAGS"}
    # A user who never made an SSH key: `up` makes one, the VMs get it through their metadata, `run` uses it.
    key = tmp_path / "ssh" / "google_compute_engine"
    env.update(TPUCTL_HOME=str(home), TPUCTL_POLL_S="0.05", CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               TPUCTL_SSH_KEY=str(key), TPUCTL_SSH_USER="root")
    emu = gcs.start(home=home, buckets=("fresh-vm",), record=True)
    api_pid = None
    sl = None
    try:
        prep = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--out", "gs://fresh-vm/data"],
                              env={**env, **emu.env}, capture_output=True, text=True, timeout=300)
        assert prep.returncode == 0, prep.stderr[-2000:]
        up = tpuctl("up", "fv", "--local", "--fresh-vm", "-a", "v4-16", env=env, timeout=300)
        assert up.returncode == 0, up.stderr
        api_info = json.loads((home / "local" / "fake_tpu_api.json").read_text())
        api_pid = api_info["pid"]
        assert f"made the SSH key {key}" in up.stderr
        pub = key.with_name(key.name + ".pub").read_text().split()
        (qr,) = FakeControl(api_info["url"]).create_bodies("queuedResource")
        assert qr["tpu"]["nodeSpec"][0]["node"]["metadata"]["ssh-keys"] == f"root:{pub[0]} {pub[1]} root", qr
        sl = LocalSlice.load("fv", home / "local" / "slices")
        assert sl is not None and sl.fresh and not sl.wheelhouse and len(sl.hosts) == 2

        # What a fresh VM has: the system python3, no uv, nothing of this machine's Python set-up.
        look = tpuctl("ssh", "fv", "--local", "-w", "all", "--", "command -v uv || echo no-uv; command -v python3",
                      env=env, timeout=120)
        assert look.returncode == 0, look.stderr
        assert sorted(look.stdout.split()) == sorted(["[w0]", "no-uv", "[w0]", "/usr/bin/python3",
                                                      "[w1]", "no-uv", "[w1]", "/usr/bin/python3"]), look.stdout

        run = tpuctl("run", "fv", "--local", "--json", "--", "pretrain", "--data", "gs://fresh-vm/data", *TINY,
                     "--ckpt-dir", "gs://fresh-vm/run", env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        res = json.loads(run.stdout)
        assert res["exit_codes"] == {"0": 0, "1": 0}
        for i in ("0", "1"):  # each host built its own environment from the index
            assert "deps=installed app=installed flavour=cpu" in res["push"][i], res["push"]
        assert "in 2 process(es)" in run.stderr and "done: step 4, checkpoint in gs://fresh-vm/run" in run.stderr
        tools = tpuctl("ssh", "fv", "--local", "-w", "all", "--", "readlink -e ~/.tpuctl-host/tools/uv", env=env)
        assert tools.returncode == 0 and tools.stdout.count("/root/.tpuctl-host/tools/uvpkg/bin/uv") == 2, \
            tools.stdout + tools.stderr

        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        client = storage.Client(project="local", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": emu.endpoint})
        done = {b.name for b in client.list_blobs("fresh-vm", prefix="run/") if b.name.endswith("commit_success.txt")}
        assert "run/4/commit_success.txt" in done, done

        down = tpuctl("down", "fv", "--local", env=env, timeout=300)
        assert down.returncode == 0, down.stderr
        assert not any(sl.alive())
    finally:
        if sl is not None:
            sl.stop()
        gcs.stop(home)
        if api_pid:
            os.kill(api_pid, signal.SIGKILL)
            try:
                os.waitpid(api_pid, 0)
            except ChildProcessError:
                pass
    assert wait_idle(sl, timeout=1) == {}
