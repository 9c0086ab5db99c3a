"""One process x 8 devices vs two processes x 4 devices joined by jax.distributed on 127.0.0.1.

Same config, dropout on: the loss curves must agree (the global batch and the dropout masks depend
on (seed, step) only, never on how many processes share the work), with a `--profile` window traced by both,
a live capture taken from one, and that one named as the straggler while it is slowed on purpose. Then a
preemption notice sent to one of the two processes makes both save the same step and exit 42. (One pair of
processes serves all these checks: starting jax.distributed twice would double this test's time.)
"""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque

import pytest

from _trainer_util import REPO, TINY, Procs, env, losses, metrics, session_cache, shakespeare, tail
from trainer.common import steptimes
from trainer.common.checkpoint import Checkpointer

RUN = [*TINY, "--mesh", "data=4,model=2", "--log-every", "1", "--ckpt-every", "0", "--eval-every", "0",
       "--eval-batches", "1"]
CURVE = 4  # steps compared


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


@pytest.mark.e2e
def test_two_processes_follow_one_and_stop_together_on_a_preemption_notice(tmp_path_factory, tmp_path, procs):
    cache, data = session_cache(tmp_path_factory), shakespeare(tmp_path_factory)
    args = ["pretrain", "--data", data, *RUN]
    one = procs.start([*args, "--steps", str(CURVE), "--emulate-devices", "8", "--ckpt-dir", str(tmp_path / "one")],
                      env(cache, devices=None), tmp_path / "one.log")
    port, two, prof_port = free_port(), tmp_path / "two", free_port()
    # The pair also profiles steps 2 and 3 (the unprofiled single process's loss curve must still be theirs), and
    # serves jax.profiler on prof_port + process id.
    pair = [procs.start([*args, "--steps", "1000", "--emulate-devices", "4", "--ckpt-dir", str(two),
                         "--profile", "2:4"],
                        env(cache, devices=None, TPUCTL_COORDINATOR=f"127.0.0.1:{port}", TPUCTL_NUM_PROCESSES="2",
                            TPUCTL_PROCESS_ID=str(i), TPUCTL_HEARTBEAT_TIMEOUT_S="20", TPUCTL_INIT_TIMEOUT_S="120",
                            TPUCTL_PROFILER_PORT=str(prof_port)),
                        tmp_path / f"w{i}.log") for i in range(2)]
    logs = lambda: "\n".join(tail(p.log) for p in [one, *pair])
    deadline = time.time() + 400
    while not any(r["step"] >= CURVE for r in metrics(two)):
        assert all(p.poll() is None for p in pair), logs()
        assert time.time() < deadline, logs()
        time.sleep(0.5)
    # The coordinator listens on the address it was given (worker 0's), not on every interface.
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    # A live capture of the running process 1 through its profiler server, as `tpuctl profile` takes one on a
    # host; a server that does not answer is one line naming it.
    live = [sys.executable, "-m", "trainer", "capture", "--out", str(two / "profiles" / "live"), "--duration-ms",
            "1000", "--session", "now"]
    cap_env = {**env(cache, devices=None, TPUCTL_PROCESS_ID="1", TPUCTL_PROFILER_PORT=str(prof_port)),
               "PYTHONPATH": str(REPO)}
    cap = subprocess.run(live, env=cap_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert cap.returncode == 0 and "captured 1000 ms" in cap.stdout, cap.stdout + cap.stderr + logs()
    assert len(list((two / "profiles" / "live" / "plugins" / "profile" / "now").glob("*-p1.xplane.pb"))) == 1
    dead = subprocess.run([*live, "--port", str(free_port())], env=cap_env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert dead.returncode == 1 and dead.stdout == "" and len(dead.stderr.strip().splitlines()) == 1, dead.stderr
    assert dead.stderr.startswith("error: the profiler server at localhost:") and "did not answer" in dead.stderr
    # Process 1 slowed on purpose (SIGSTOP/SIGCONT pulses of 0.3 s): the hosts' records name it, not process 0.
    n, t0 = len(metrics(two)), time.time()
    while time.time() - t0 < 6 or len(metrics(two)) < n + 10:
        # the pair still trains; 400 s is the bound the first CURVE steps had above (compiles included), far
        # more than 10 steps at half speed take on a loaded 2-core machine
        assert all(p.poll() is None for p in pair) and time.time() - t0 < 400, logs()
        pair[1].send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        pair[1].send_signal(signal.SIGCONT)
        time.sleep(0.3)
    slow = steptimes.straggler(metrics(two))
    assert slow and slow["process"] == 1 and slow["stalled"] and not slow["input_bound"], (slow, metrics(two)[-3:])
    # A preemption notice to process 1 only: JAX's coordination service tells process 0, and both
    # agree on the step to save.
    pair[1].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=240) for p in pair] == [42, 42], logs()
    assert one.wait(timeout=240) == 0, logs()
    assert "in 2 process(es)" in pair[0].log.read_text()
    saved = int(re.search(r"saved step (\d+)", pair[0].log.read_text()).group(1))
    assert saved >= CURVE and Checkpointer(str(two), keep=1, read_only=True).latest_step() == saved

    a, b = losses(tmp_path / "one"), losses(two)
    assert sorted(a) == list(range(1, CURVE + 1)) and sorted(b) == list(range(1, saved + 1))
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-5, (s, a[s], b[s])

    # Both processes' traces of the window, in one session of one run (the run id process 0 shared).
    traces = sorted(two.glob("profiles/*/plugins/profile/steps_2_4/*.xplane.pb"))
    assert [(p.parents[3].name == traces[0].parents[3].name, p.parent.name, p.name.rsplit("-", 1)[-1])
            for p in traces] == [(True, "steps_2_4", "p0.xplane.pb"), (True, "steps_2_4", "p1.xplane.pb")], traces
    assert all(p.stat().st_size > 0 for p in traces)
    # TensorBoard's profile plugin, by its own loader, lists that session with both hosts (per-host tools: the
    # trace viewer; the overview merges them as ALL_HOSTS).
    import argparse

    from tensorboard.plugins.base_plugin import TBContext
    from xprof.profile_plugin import ProfilePlugin
    plugin = ProfilePlugin(TBContext(logdir=str(two), data_provider=None,
                                     flags=argparse.Namespace(master_tpu_unsecure_channel="")))
    session = f"profiles/{traces[0].parents[3].name}/steps_2_4"
    assert session in plugin.runs_imp()
    assert sorted(h["hostname"] for h in plugin.host_impl(session, "trace_viewer")) == sorted(
        p.name[:-len(".xplane.pb")] for p in traces)
    # Every logged step holds both processes' dispatch times and input waits, and each process printed its own.
    for r in metrics(two):
        assert len(r["hosts"]) == 2 and all(h["dispatch_t"] > 0 and h["input_wait_s"] >= 0 and h["stalled_s"] >= 0
                                            for h in r["hosts"]), r
    for p in pair:
        assert re.search(r"^TPUCTL_PROGRESS step=2 dispatch_t=[\d.]+ input_wait_s=[\d.]+ stalled_s=[\d.]+ "
                         r"step_time_s=[\d.]+ tokens_per_s=[\d.]+$",
                         p.log.read_text(), re.M), tail(p.log)


def byte_corpus(root) -> str:
    """A prepared corpus of random bytes (vocab 256): a step is then mostly its collectives, so the host
    can queue steps far ahead of the devices, as the demo's 50k-vocab steps do between its logged steps."""
    import json

    import numpy as np
    out = root / "bytes"
    out.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 2000)):
        rng.integers(0, 256, n, dtype=np.uint16).tofile(out / f"{split}.bin")
    (out / "meta.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 256, "eot": 0, "dtype": "uint16"}))
    return str(out)


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process (0 once it is gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


@pytest.mark.e2e
@pytest.mark.slow
def test_two_cpu_processes_that_log_only_at_the_end_do_not_stall(tmp_path_factory, tmp_path, procs):
    # Nothing waits for a step's result until the last one: with steps queued ahead, XLA:CPU's launch pool
    # filled up and both processes slept at 0% CPU within a few hundred steps (trainer/mesh.one_step_in_flight).
    cache, data, port, steps = session_cache(tmp_path_factory), byte_corpus(tmp_path), free_port(), 80
    pair = [procs.start(["pretrain", "--data", data, "--vocab-size", "256", "--n-layer", "1", "--n-head", "2",
                         "--d-model", "32", "--seq-len", "16", "--batch-size", "8", "--emulate-devices", "4",
                         "--steps", str(steps), "--log-every", str(steps), "--ckpt-every", "0", "--eval-every", "0",
                         "--eval-batches", "1", "--ckpt-dir", str(tmp_path / "run")],
                        env(cache, devices=None, TPUCTL_COORDINATOR=f"127.0.0.1:{port}", TPUCTL_NUM_PROCESSES="2",
                            TPUCTL_PROCESS_ID=str(i), TPUCTL_HEARTBEAT_TIMEOUT_S="20", TPUCTL_INIT_TIMEOUT_S="120"),
                        tmp_path / f"w{i}.log") for i in range(2)]
    logs = lambda: "\n".join(tail(p.log) for p in pair)
    seen, last = deque(maxlen=10), {}  # CPU ticks of both processes, every 2 s
    while any(p.poll() is None for p in pair):
        time.sleep(2)
        last.update({p.pid: cpu_ticks(p.pid) for p in pair if p.poll() is None})
        seen.append(sum(last.values()))
        # Under 1 s of CPU in 20 s: stalled (a training process uses a whole core, or its share of a busy one;
        # a stalled one only wakes for its heartbeats).
        assert len(seen) < seen.maxlen or seen[-1] - seen[0] >= 100, "the trainers stalled at 0% CPU:\n" + logs()
    assert [p.returncode for p in pair] == [0, 0], logs()
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, steps]


MEET = """
import os, sys, time
from trainer.common import mesh
from trainer.common.config import UsageError
mesh.init_distributed()
import jax
jax.devices()  # the CPU backend's start is itself a meeting of every process
if os.environ["TPUCTL_PROCESS_ID"] == "1":
    time.sleep(float(sys.argv[1]))  # a host still compiling
try:
    mesh.meet("the compiled train step")
except UsageError as e:
    print("error:", e, flush=True)
    os._exit(2)
print("met", flush=True)
jax.distributed.shutdown()  # process 0 serves the coordination service: it stays until both are done
os._exit(0)
"""


@pytest.mark.e2e
def test_processes_meet_after_a_compile_and_a_late_one_is_named(tmp_path_factory, tmp_path, procs):
    """The barrier after each compile: a process 3 s late is waited for; one that does not arrive within
    TPUCTL_BARRIER_TIMEOUT_S is named (by process and tpuctl worker) by the process that waited."""
    cache = session_cache(tmp_path_factory)
    for late_s, timeout_s, want in ((3, "60", ["met", "met"]), (60, "4", None)):
        port = free_port()
        pair = [procs.start(["-c", MEET, str(late_s)], env(cache, devices=1, TPUCTL_COORDINATOR=f"127.0.0.1:{port}",
                                                          TPUCTL_NUM_PROCESSES="2", TPUCTL_PROCESS_ID=str(i),
                                                          TPUCTL_BARRIER_TIMEOUT_S=timeout_s,
                                                          TPUCTL_HEARTBEAT_TIMEOUT_S="100",
                                                          TPUCTL_INIT_TIMEOUT_S="120"),
                            tmp_path / f"meet{late_s}-w{i}.log", python=True) for i in range(2)]
        if want:
            assert [p.wait(timeout=120) for p in pair] == [0, 0], tail(pair[0].log) + tail(pair[1].log)
            assert [p.log.read_text().split()[-1] for p in pair] == want
        else:
            assert pair[0].wait(timeout=120) == 2, tail(pair[0].log)
            line = [l for l in pair[0].log.read_text().splitlines() if l.startswith("error: ")][0]
            assert line.startswith("error: process(es) 1 (tpuctl's worker(s) w1) did not reach the compiled train "
                                   "step within 4 s of process 0"), line
