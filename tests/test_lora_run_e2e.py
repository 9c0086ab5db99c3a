"""End to end: `python -m trainer lora` on 2 SSH hosts x 4 CPU devices (the runner `tpuctl run` uses), base
weights pulled into the GCS emulator, data and adapter checkpoints on gs://: the same loss at every step as
one process with 8 devices (the global batch and the dropout masks depend on (seed, step) only)."""
import json
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

LORA = ["-m", "trainer", "lora", "--weights", "gs://e2e/gemma", "--data", "gs://e2e/train.jsonl", "--rank", "4",
        "--alpha", "8", "--targets", "q,v,down", "--dropout", "0.1", "--seq-len", "48", "--batch-size", "8",
        "--steps", "6", "--lr", "1e-2", "--mesh", "data=4,model=2", "--log-every", "1", "--val-fraction", "0.2",
        "--dtype", "float32", "--base-dtype", "float32", "--ckpt-every", "3"]


def _losses(text: str) -> dict[int, float]:
    return {d["step"]: d["loss"] for d in map(json.loads, text.splitlines())}


@pytest.mark.e2e
@pytest.mark.slow
def test_lora_on_two_ssh_hosts_matches_one_process(tmp_path_factory, tmp_path, monkeypatch):
    emu = gc.tiny_gemma_on_gcs(tmp_path, monkeypatch)
    sl = None
    try:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        client = storage.Client(project="local", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": emu.endpoint})
        lines = [json.dumps({"prompt": f"question {i}?", "response": "to be or not to be"[: 6 + i]}) for i in range(12)]
        client.bucket("e2e").blob("train.jsonl").upload_from_string("\n".join(lines) + "\n")

        genv = {**emu.env, "JAX_PLATFORMS": "cpu"}
        sl = start("lora-e2e", 2, tmp_path_factory.mktemp("slices"))
        bundle = B.build(cache_dir=tmp_path / "bundles")
        install, layout = shared_install(sl.wheelhouse, bundle, python=sl.python)
        r = run_job(workers(sl), LaunchSpec(["python", *LORA, "--ckpt-dir", "gs://e2e/multi", "--emulate-devices",
                                             "4"], env=genv),
                    run_dir=tmp_path / "r", ssh=ssh_config(sl), bundle=bundle, install=install, layout=layout)
        logs = [(tmp_path / "r" / f"w{i}.log").read_text() for i in range(2)]
        assert r.ok and r.exit_codes == {0: 0, 1: 0}, logs[0][-3000:]
        assert "in 2 process(es)" in logs[0], logs[0][-3000:]
        multi = _losses(client.bucket("e2e").blob("multi/metrics.jsonl").download_as_text())
        saved = {b.name.split("/")[1] for b in client.list_blobs("e2e", prefix="multi/")
                 if b.name.endswith("commit_success.txt")}
        assert {"3", "6"} <= saved, saved
    finally:
        if sl is not None:
            sl.stop()
    assert sl is not None and wait_idle(sl, timeout=1) == {}

    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCTL_")}
    env.update(genv, XLA_FLAGS="--xla_force_host_platform_device_count=8", TPUCTL_CACHE=str(tmp_path / "cache"))
    try:
        one = subprocess.run([sys.executable, *LORA, "--ckpt-dir", str(tmp_path / "one")], env=env,
                             capture_output=True, text=True, timeout=400)
    finally:
        emu.stop()
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    single = _losses((tmp_path / "one" / "metrics.jsonl").read_text())
    assert sorted(single) == sorted(multi) == list(range(1, 7))
    for s in single:
        assert abs(single[s] - multi[s]) <= 1e-5, (s, single[s], multi[s])
    assert multi[6] < multi[1]
