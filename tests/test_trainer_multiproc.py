"""One process x 8 devices vs two processes x 4 devices joined by jax.distributed on 127.0.0.1.

Same config, dropout on: the loss curves must agree (the global batch and the dropout masks depend
on (seed, step) only, never on how many processes share the work). Then a preemption notice sent to
one of the two processes makes both save the same step and exit 42.
"""
from __future__ import annotations

import re
import signal
import socket
import time

import pytest

from _trainer_util import TINY, Procs, env, losses, metrics, session_cache, shakespeare, tail
from trainer.checkpoint import Checkpointer

RUN = [*TINY, "--mesh", "data=4,model=2", "--log-every", "1", "--ckpt-every", "0", "--eval-every", "0",
       "--eval-batches", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def start_pair(procs, args, cache, log_dir):
    port = free_port()
    return [procs.start([*args, "--emulate-devices", "4"],
                        env(cache, devices=None, TPUCTL_COORDINATOR=f"127.0.0.1:{port}", TPUCTL_NUM_PROCESSES="2",
                            TPUCTL_PROCESS_ID=str(i), TPUCTL_HEARTBEAT_TIMEOUT_S="20", TPUCTL_INIT_TIMEOUT_S="120"),
                        log_dir / f"w{i}.log") for i in range(2)]


@pytest.mark.e2e
def test_two_processes_follow_the_loss_curve_of_one(tmp_path_factory, tmp_path, procs):
    cache, data = session_cache(tmp_path_factory), shakespeare(tmp_path_factory)
    args = ["pretrain", "--data", data, *RUN, "--steps", "4"]
    one = procs.start([*args, "--emulate-devices", "8", "--ckpt-dir", str(tmp_path / "one")],
                      env(cache, devices=None), tmp_path / "one.log")
    pair = start_pair(procs, [*args, "--ckpt-dir", str(tmp_path / "two")], cache, tmp_path)
    for p in [one, *pair]:
        assert p.wait(timeout=400) == 0, tail(p.log)
    assert "in 2 process(es)" in pair[0].log.read_text()
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-5, (s, a[s], b[s])
    assert Checkpointer(str(tmp_path / "two"), keep=1, read_only=True).latest_step() == 4


@pytest.mark.e2e
def test_preemption_notice_to_one_process_stops_both_at_the_same_saved_step(tmp_path_factory, tmp_path, procs):
    cache, data = session_cache(tmp_path_factory), shakespeare(tmp_path_factory)
    ckpt = tmp_path / "run"
    pair = start_pair(procs, ["pretrain", "--data", data, *RUN, "--steps", "1000", "--ckpt-dir", str(ckpt)],
                      cache, tmp_path)
    deadline = time.time() + 300
    while not any(r["step"] >= 2 for r in metrics(ckpt)):
        assert all(p.poll() is None for p in pair), tail(pair[0].log) + tail(pair[1].log)
        assert time.time() < deadline, tail(pair[0].log)
        time.sleep(0.5)
    pair[1].send_signal(signal.SIGTERM)  # JAX's coordination service tells process 0 too
    codes = [p.wait(timeout=180) for p in pair]
    assert codes == [42, 42], tail(pair[0].log) + tail(pair[1].log)
    saved = int(re.search(r"saved step (\d+)", pair[0].log.read_text()).group(1))
    assert Checkpointer(str(ckpt), keep=1, read_only=True).latest_step() == saved >= 2
