"""Helpers shared by the trainer tests: the prepared corpus, tiny run flags, subprocess runs, metrics."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_prepared: dict[str, str] = {}

# A model small enough that a step is cheap; the 50k-vocab output matmul still dominates.
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32", "--batch-size", "8",
        "--dropout", "0.1", "--warmup-steps", "2", "--decay-steps", "50", "--lr", "1e-2"]


def shakespeare(tmp_path_factory) -> str:
    """The embedded corpus, tokenised once per test session."""
    if "dir" not in _prepared:
        from trainer.pretrain import prepare
        out = tmp_path_factory.mktemp("shakespeare") / "tok"
        prepare.prepare(None, str(out))
        _prepared["dir"] = str(out)
    return _prepared["dir"]


def session_cache(tmp_path_factory) -> str:
    """One TPUCTL_CACHE (prepared tokens) for all trainer tests of the session; the XLA compile cache is
    JAX_COMPILATION_CACHE_DIR, the machine's one (conftest.py)."""
    if "cache" not in _prepared:
        _prepared["cache"] = str(tmp_path_factory.mktemp("tpuctl-cache"))
    return _prepared["cache"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The Shakespeare tokens' folder, with the session's TPUCTL_CACHE set while the module's tests run (a module
    takes it by importing it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TPUCTL_CACHE", session_cache(tmp_path_factory))
    yield shakespeare(tmp_path_factory)
    mp.undo()


def env(cache: str, devices: int | None = 8, **extra: str) -> dict:
    """Environment of a trainer subprocess: its own device count (no inherited XLA count flag)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("TPUCTL_")}
    flags = " ".join(f for f in e.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
    if devices:
        flags += f" --xla_force_host_platform_device_count={devices}"
    e.update(XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", TPUCTL_CACHE=cache, PYTHONUNBUFFERED="1",
             TPUCTL_PROFILER_PORT="0")  # no profiler server unless the test names a port (conftest.py)
    e.update(extra)
    return e


class Procs:
    """Trainer subprocesses in their own process groups, all killed on close (use as a fixture)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict, log: Path, python: bool = False) -> subprocess.Popen:
        """`python -m trainer ARGS` (python=True: `python ARGS`)."""
        f = open(log, "w")
        p = subprocess.Popen([sys.executable, *([] if python else ["-m", "trainer"]), *args], cwd=REPO, env=env, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        p.log = log
        f.close()
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # JAX handles SIGTERM as a preemption notice
                except ProcessLookupError:
                    pass
                p.wait(timeout=30)


def metrics(ckpt_dir) -> list[dict]:
    path = Path(ckpt_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def losses(ckpt_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(ckpt_dir)}


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(Path(path).read_text().splitlines()[-n:]) if Path(path).exists() else ""
