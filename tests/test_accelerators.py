"""The host's accelerator probe on a fake device tree (TPUCTL_DEVICE_ROOT): what it finds, the host tools and the
trainer reading the same nodes, and a TPU host whose chip jax does not find stopping instead of training on the
CPU."""
from __future__ import annotations

import json
import subprocess
import sys

from _trainer_util import REPO, TINY, env, session_cache
from orchestrator.access import hosts
from trainer.common import accelerators


def _tree(root, *nodes: str):
    for n in nodes:
        p = root / n.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    return root


def test_every_chip_node_is_found_whatever_its_number_and_nothing_else(tmp_path):
    v5e = _tree(tmp_path / "v5e", "/dev/vfio/1", "/dev/vfio/vfio", "/dev/null")
    assert accelerators.tpu_nodes(str(v5e)) == [str(v5e / "dev/vfio/1")]
    v4 = _tree(tmp_path / "v4", "/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3")
    assert [p[len(str(v4)):] for p in accelerators.device_nodes(str(v4))] == [f"/dev/accel{i}" for i in range(4)]
    gpu = _tree(tmp_path / "gpu", "/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")
    assert (accelerators.tpu_nodes(str(gpu)), accelerators.gpu_nodes(str(gpu))) == ([], [str(gpu / "dev/nvidia0")])
    assert accelerators.device_nodes(str(_tree(tmp_path / "cpu", "/dev/null"))) == []


def test_the_host_probe_sent_to_a_host_reads_the_same_nodes(tmp_path):
    """The source hosts.preflight sends (the trainer's probe, then hostprobe.py), run as it is on a host: with the
    host's python3 from the home folder, where the repository is not importable."""
    src = hosts.PROBE_SOURCE.read_text() + "\n" + (hosts.HOST_DIR / "hostprobe.py").read_text()
    fake = _tree(tmp_path / "tree", "/dev/vfio/1", "/dev/vfio/vfio")
    found = {}
    for name, root in (("tpu", fake), ("none", tmp_path / "empty")):
        p = subprocess.run(["python3", "-I", "-c", src, "--root", str(tmp_path / "home")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", accelerators.DEVICE_ROOT_ENV: str(root)})
        assert p.returncode == 0, p.stderr
        line = next(l for l in p.stdout.splitlines() if l.startswith("TPUCTL_PROBE "))
        found[name] = json.loads(line.split(" ", 1)[1])
    assert found["tpu"]["flavour"] == "tpu" and found["none"]["flavour"] == "cpu", found


def test_a_tpu_node_without_a_tpu_stops_the_trainer_and_jax_platforms_cpu_trains(tmp_path_factory, tmp_path):
    """A v5e host whose chip is /dev/vfio/1 and whose jax finds no TPU (this machine has libtpu and no chip, as a
    host with a held or unopenable chip): the trainer names the node and exits non-zero, before any step. Asked
    for the CPU, it trains there."""
    fake = _tree(tmp_path / "tree", "/dev/vfio/1", "/dev/vfio/vfio")
    e = env(session_cache(tmp_path_factory), devices=None, **{accelerators.DEVICE_ROOT_ENV: str(fake)})
    e.pop("JAX_PLATFORMS")
    args = [sys.executable, "-m", "trainer", "pretrain", *TINY, "--steps", "2", "--ckpt-dir", str(tmp_path / "run")]
    p = subprocess.run(args, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    err = p.stderr.strip().splitlines()[-1]
    assert err.startswith("error: this host has a TPU device node") and str(fake / "dev/vfio/1") in err, err
    assert "JAX_PLATFORMS=cpu" in err and "libtpu" in err
    assert "step 1" not in p.stdout + p.stderr and not (tmp_path / "run").exists()

    p = subprocess.run(args, cwd=REPO, env={**e, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 2/2" in p.stdout + p.stderr and (tmp_path / "run" / "metrics.jsonl").exists()
