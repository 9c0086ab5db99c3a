"""End to end: `weights pull` from the Kaggle stand-in into the GCS emulator, then `python -m trainer sample`
on 2 SSH hosts x 4 CPU devices (the runner `tpuctl run` uses) reading gs:// only: the same greedy text as one
process with 8 devices, printed by worker 0 only."""
import os
import subprocess
import sys

import pytest

import _gemma_ckpt as gc
from _local_hosts import needs_hosts, ssh_config, start, wait_idle, workers
from orchestrator.jobs import bundle as B
from orchestrator.jobs.launch import LaunchSpec
from orchestrator.jobs.runner import run_job, shared_install

pytestmark = needs_hosts

SAMPLE = ["-m", "trainer", "sample", "--weights", "gs://e2e/gemma", "--prompt", "To be, or not", "--chat",
          "--temperature", "0", "--max-new-tokens", "12", "--mesh", "data=4,model=2"]


@pytest.mark.e2e
def test_sample_on_two_ssh_hosts_from_gcs_matches_one_process(tmp_path_factory, tmp_path, monkeypatch):
    emu = gc.tiny_gemma_on_gcs(tmp_path, monkeypatch)
    sl = None
    try:

        genv = {**emu.env, "JAX_PLATFORMS": "cpu"}
        sl = start("gemma-e2e", 2, tmp_path_factory.mktemp("slices"))
        bundle = B.build(cache_dir=tmp_path / "bundles")
        install, layout = shared_install(sl.wheelhouse, bundle, python=sl.python)
        r = run_job(workers(sl), LaunchSpec(["python", *SAMPLE, "--emulate-devices", "4"], env=genv),
                    run_dir=tmp_path / "r", ssh=ssh_config(sl), bundle=bundle, install=install, layout=layout)
        logs = [(tmp_path / "r" / f"w{i}.log").read_text() for i in range(2)]
        assert r.ok and r.exit_codes == {0: 0, 1: 0}, logs[0][-3000:]
        assert "tokens in" in logs[0] and "mesh {'data': 4, 'model': 2}" in logs[0], logs[0][-3000:]
        assert "tokens in" not in logs[1]  # only process 0 prints
    finally:
        if sl is not None:
            sl.stop()
    assert sl is not None and wait_idle(sl, timeout=1) == {}

    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCTL_")}
    env.update(genv, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    try:
        one = subprocess.run([sys.executable, *SAMPLE], env=env, capture_output=True, text=True, timeout=300)
    finally:
        emu.stop()
    assert one.returncode == 0, one.stderr[-2000:]
    text = one.stdout.strip()
    assert text and text in logs[0] and text not in logs[1]
