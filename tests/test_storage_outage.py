"""The checkpoint bucket stops answering mid-run (the GCS emulator is killed during an async save): the trainer
stops within its storage budget of the bucket going away with one line naming the bucket and the operation (exit 3), never takes a
half-written step for a checkpoint, and the same command resumes from the previous complete step once the
bucket is back."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from _skips import skip_setup
from _trainer_util import TINY, env, session_cache, shakespeare
from infra import gcs

pytestmark = pytest.mark.slow

ARGS = ["pretrain", *TINY, "--ckpt-every", "1", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--ckpt-dir", "gs://outage-b/run"]


def test_a_bucket_outage_stops_the_run_and_the_same_command_resumes(tmp_path_factory, tmp_path):
    data = shakespeare(tmp_path_factory)
    home, store = tmp_path / "home", tmp_path / "gcs-data"
    emu = gcs.start(home=home, backend="filesystem", data_dir=str(store), buckets=("outage-b",), record=False,
                    reuse=False)
    e = env(session_cache(tmp_path_factory), **emu.env)
    log = tmp_path / "run1.log"
    p = subprocess.Popen([sys.executable, "-m", "trainer", *ARGS, "--data", data, "--steps", "5000"], env=e,
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not re.search(r"step +8/", log.read_text()):
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(emu.pid, signal.SIGKILL)  # every step saves: this lands in (or just before) an async save
        gone = time.monotonic()
        rc = p.wait(timeout=150)
        # The budget (60 s, TPUCTL_STORAGE_TIMEOUT_S) is the promise: from the bucket going away to the exit. The
        # watch stops the run 51-53 s after the last answer (the budget less 2 s between probes, a probe's 5 s
        # timeout and 2 s for the exit, plus up to 2 s between probes: bucket_watch.py); a killed emulator refuses
        # at once, so the probe's 5 s are room for a loaded machine's late wakeups. A run the watch missed would exit only when a later
        # operation's own 60 s ran out.
        took = time.monotonic() - gone
    finally:
        if p.poll() is None:
            p.kill()
        emu.stop()
    out = log.read_text()
    errors = [l for l in out.splitlines() if l.startswith("error: ")]
    assert rc == 3 and len(errors) == 1 and took < 60, (took, out[-3000:])
    assert errors[0].startswith("error: the bucket gs://outage-b ") and "while saving step " in errors[0], errors
    assert "the same command resumes from the latest complete step" in errors[0]
    stopped_at = max(int(s) for s in re.findall(r"step +(\d+)/", out))

    # The bucket is back with the same data: only complete steps are listed, and the run resumes from the last.
    emu = gcs.start(home=home, backend="filesystem", data_dir=str(store), port=emu.port, record=False, reuse=False)
    try:
        complete = sorted(int(d.name) for d in (store / "outage-b" / "run").iterdir()
                          if d.name.isdigit() and (d / "commit_success.txt").exists())
        listed = subprocess.run([sys.executable, "-c", "from trainer.common.checkpoint import Checkpointer as C; "
                                 "print(sorted(C('gs://outage-b/run', 1, read_only=True).mngr.all_steps()))"],
                                env=e, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr[-2000:]
        steps = [int(x) for x in re.findall(r"\d+", listed.stdout.strip().splitlines()[-1])]
        assert steps and set(steps) <= set(complete) and max(steps) == max(complete), (steps, complete)
        last = max(complete)
        assert last < stopped_at + 1
        again = subprocess.run([sys.executable, "-m", "trainer", *ARGS, "--data", data, "--steps", str(last + 2)],
                               env=e, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        assert f"resuming from step {last}" in again.stdout + again.stderr
    finally:
        emu.stop()


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_step(tmp_path_factory, tmp_path):
    """The checkpoint dir is a small tmpfs that fills up on the third save: one line naming the dir, the host and
    the full device (exit 3), and the steps saved before it still restore."""
    if os.geteuid() != 0:
        skip_setup("root, to mount a tmpfs (CI runs as root)")
    data = shakespeare(tmp_path_factory)
    ckpt = tmp_path / "small"
    ckpt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(ckpt)], check=True)
    try:
        e = env(session_cache(tmp_path_factory))
        r = subprocess.run([sys.executable, "-m", "trainer", "pretrain", *TINY, "--ckpt-every", "1", "--log-every", "1",
                            "--eval-every", "0", "--eval-batches", "1", "--data", data, "--ckpt-dir", str(ckpt),
                            "--steps", "50", "--keep", "10"], env=e, capture_output=True, text=True, timeout=600)
        errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
        assert r.returncode == 3 and len(errors) == 1, r.stdout[-2000:] + r.stderr[-3000:]
        assert errors[0].startswith(f"error: {ckpt} on ") and "is full (no space left on the device)" in errors[0]
        assert errors[0].endswith("resumes from the latest complete step once some space is freed")
        check = subprocess.run([sys.executable, "-c", "from trainer.common.checkpoint import Checkpointer as C; "
                                f"c = C({str(ckpt)!r}, 1, read_only=True); s = c.latest_step(); "
                                "print(s, sorted(c.saved_config(s).to_dict()['model']))"],
                               env=e, capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stderr[-2000:]
        step = int(check.stdout.split()[0])
        assert step >= 1 and f"the latest step known saved is {step}," in errors[0], (errors, check.stdout)
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)


def test_the_bucket_watch_stops_within_the_budget_of_the_last_answer(tmp_path, monkeypatch):
    """The watch behind the bound above when no storage operation reports the failure (an async save or a
    metrics.jsonl rewrite left hanging): it never fires while the bucket answers, and fires once no answer has
    come for the budget less a probe's timeout and the exit's slack, counted from the last answer."""
    from trainer.common import bucket_watch as bw
    emu = gcs.start(home=tmp_path / "home", buckets=("watch-b",), record=False, reuse=False)
    for k, v in emu.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(bw, "PROBE_S", 0.2)
    fired = []
    w = bw.BucketWatch("watch-b", "run", 3.0 + bw.PROBE_S + bw.PROBE_TIMEOUT_S + bw.EXIT_SLACK_S, fired.append)
    started = w.last_ok
    w.start()
    try:
        deadline = time.monotonic() + 60
        while w.last_ok == started:  # the first answer (the client's import and first request are slow here)
            assert time.monotonic() < deadline and not fired
            time.sleep(0.05)
        answered = w.last_ok
        time.sleep(4)  # longer than the limit: an answering bucket never stops the run
        assert not fired and w.last_ok > answered  # it was asked, and answered, meanwhile
    finally:
        emu.stop()
    gone = time.monotonic()
    while not fired and time.monotonic() - gone < 30:
        time.sleep(0.05)
    took = time.monotonic() - gone
    # The watch's promise is its budget (10 s here) from the last answer, which came before `gone`; it fires
    # once 3 s have passed without one, and the other 7 s are a probe's own timeout and the exit's slack: room
    # for a loaded machine's late wakeups, and a watch that missed the silence would use all 30 s above.
    assert fired and fired[0] >= 3.0 and took < 3.0 + bw.PROBE_TIMEOUT_S + bw.EXIT_SLACK_S, (fired, took)
    w.stop()


def _hanging_proxy(target_port: int):
    """A TCP proxy in front of the emulator that, once `hang` is set, stops passing bytes either way (connections
    stay open, and new ones are accepted and held): a bucket whose requests hang rather than fail. Returns (port,
    hang, done): setting `done` ends its threads."""
    import selectors
    import socket
    import threading
    hang, done = threading.Event(), threading.Event()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(0.1)

    def pipe(a: socket.socket) -> None:
        b = socket.create_connection(("127.0.0.1", target_port))
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        with a, b:
            while not done.is_set():
                if hang.is_set():
                    done.wait(0.05)  # held open, answering nothing
                    continue
                for key, _ in sel.select(timeout=0.1):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)

    def serve() -> None:
        with lsock:
            while not done.is_set():
                try:
                    conn, _ = lsock.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=pipe, args=(conn,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return lsock.getsockname()[1], hang, done


def test_a_hanging_bucket_stops_the_run_within_the_budget(tmp_path, monkeypatch):
    """A bucket whose requests hang (each probe runs to its timeout) rather than fail at once: the watch's worst
    case, a check that finds the silence just short of the limit, then a wait and a hung probe before the next. The
    silence at the stop plus the exit's slack stays within the budget. Times are scaled down (1 s waits, 1 s
    probe timeout, 1 s slack; budget 8.2 s): the limit is then 5.2 s of silence, reached at the third check, about
    6 s after the last answer; counting without the wait (a 6.2 s limit) would stop at the fourth, about 8 s."""
    from trainer.common import bucket_watch as bw
    emu = gcs.start(home=tmp_path / "home", buckets=("watch-b",), record=False, reuse=False)
    port, hang, done = _hanging_proxy(emu.port)
    for k, v in gcs.emulator_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(k, v)
    for name in ("PROBE_S", "PROBE_TIMEOUT_S", "EXIT_SLACK_S"):
        monkeypatch.setattr(bw, name, 1.0)
    budget = 8.2
    fired = []
    w = bw.BucketWatch("watch-b", "run", budget, fired.append)
    started = w.last_ok
    w.start()
    try:
        deadline = time.monotonic() + 60
        while w.last_ok == started:  # the first answer, through the proxy
            assert time.monotonic() < deadline and not fired
            time.sleep(0.05)
        hang.set()
        while not fired and time.monotonic() < deadline + 30:
            time.sleep(0.05)
    finally:
        w.stop()
        done.set()
        emu.stop()
    assert fired and w.limit <= fired[0] and fired[0] + bw.EXIT_SLACK_S <= budget, (w.limit, fired)
