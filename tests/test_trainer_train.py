"""Training runs on 8 emulated CPU devices: loss falls, exact resume, cross-mesh restore, preemption, sample."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _trainer_util import REPO, TINY, Procs, corpus, env, losses, metrics, tail  # noqa: F401 (corpus: a fixture)
from trainer.cli import main
from trainer.common.checkpoint import Checkpointer
from trainer.common.config import PRESETS, Config

# Every in-process run: log every step, save only at the last step (or on a preemption notice).
RUN = [*TINY, "--log-every", "1", "--ckpt-every", "0", "--eval-every", "0", "--eval-batches", "1"]


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def saved_params(ckpt_dir, step=None):
    ckpt = Checkpointer(str(ckpt_dir), keep=1, read_only=True)
    try:
        step = step or ckpt.latest_step()
        from trainer.pretrain.train import Steps, setup_mesh
        cfg = ckpt.saved_config(step)
        steps = Steps(cfg, setup_mesh(cfg))
        params, _ = ckpt.restore(step, steps.abstract_params)
        return step, jax.device_get(params)
    finally:
        ckpt.close()


@pytest.fixture(scope="module")
def resume_runs(corpus, tmp_path_factory):
    """6 steps straight (steps 3 and 4 profiled); 3 steps, stop, resume to 6; and the step-3 checkpoint resumed
    on a 4x2 mesh.

    Async saves every 2 steps while training goes on: the step buffers are donated to the next step, so
    this also checks that a save in flight is not clobbered. The resumed run is not profiled: its losses
    matching the straight run's also say that profiling changes nothing computed."""
    d = tmp_path_factory.mktemp("resume")
    base = ["pretrain", "--data", corpus, *RUN, "--mesh", "data=8,model=1", "--ckpt-every", "2"]
    # The straight run's host has "chips": libtpu's metrics service is the stand-in, sampled every 50 ms.
    from infra import fake_tpu_metrics
    svc, mp = fake_tpu_metrics.start(), pytest.MonkeyPatch()
    mp.setenv("TPU_RUNTIME_METRICS_PORTS", str(svc.port))
    mp.setenv("TPUCTL_CHIP_SAMPLE_S", "0.05")
    try:
        assert main([*base, "--ckpt-dir", str(d / "straight"), "--steps", "6", "--profile", "3:5"]) == 0
    finally:
        mp.undo()
        svc.stop()
    assert main([*base, "--ckpt-dir", str(d / "resumed"), "--steps", "3"]) == 0
    shutil.copytree(d / "resumed", d / "cross")
    shutil.copytree(d / "resumed", d / "table")
    shutil.copytree(d / "resumed", d / "split")
    assert main([*base, "--ckpt-dir", str(d / "resumed"), "--steps", "6"]) == 0
    cross = ["pretrain", "--data", corpus, *RUN, "--mesh", "data=4,model=2"]
    assert main([*cross, "--ckpt-dir", str(d / "cross"), "--steps", "4"]) == 0
    # The same step-3 checkpoint (table split over all 8 devices: --vocab-parallel auto is on at this size)
    # resumed with the table replicated.
    assert main([*base, "--vocab-parallel", "off", "--ckpt-dir", str(d / "table"), "--steps", "4"]) == 0
    # ... and with AdamW's moments split over data (ZeRO-1) instead of whole on every device (the default)
    assert main([*base, "--optimizer-state", "sharded", "--ckpt-dir", str(d / "split"), "--steps", "4"]) == 0
    return d


def test_chip_use_is_sampled_into_the_runs_metrics_and_the_report(resume_runs):
    """The straight run's host answered with known chips: its records carry them and the report's section says
    so; the resumed run's host had no metrics service: no chip figure at all, and the report says no TPU."""
    from infra import fake_tpu_metrics
    from trainer.experiments import where_time_goes
    recs = metrics(resume_runs / "straight")
    samples = [r["hosts"][0]["chips"] for r in recs if r.get("hosts") and r["hosts"][0].get("chips")]
    assert samples, recs
    want = [{"device": c.device_id, "duty_cycle_pct": c.duty_cycle_pct, "hbm_used_bytes": c.hbm_used,
             "hbm_total_bytes": c.hbm_total} for c in fake_tpu_metrics.known_chips()]
    assert all(s["chips"] == want for s in samples)
    text = where_time_goes.section(str(resume_runs / "straight"), recs, read_profiles=False)["text"]
    assert f"sampled {len(samples)} time(s)" in text and "duty cycle median" in text and "HBM at most" in text
    from trainer.experiments import charts
    assert charts.chips_chart(recs)[:8] == b"\x89PNG\r\n\x1a\n" and charts.chips_chart(metrics(resume_runs / "resumed")) is None
    resumed = metrics(resume_runs / "resumed")
    assert not any(h and h.get("chips") for r in resumed for h in r.get("hosts") or [])
    assert "Chips: no TPU" in where_time_goes.section(str(resume_runs / "resumed"), resumed, read_profiles=False)["text"]


def test_exact_resume_matches_a_straight_run(resume_runs):
    straight, resumed = losses(resume_runs / "straight"), losses(resume_runs / "resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for s in straight:
        assert abs(straight[s] - resumed[s]) <= 1e-6, (s, straight[s], resumed[s])
    assert straight[6] < straight[1]
    for step in (4, 6):  # both saved asynchronously while the next steps ran
        (sa, pa), (sb, pb) = saved_params(resume_runs / "straight", step), saved_params(resume_runs / "resumed", step)
        assert sa == sb == step
        for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # The resumed run's config is saved with it and printed; steps 1-3 came from the first run.
    assert (resume_runs / "resumed" / "config.json").is_file()


def test_a_profiled_window_is_where_tensorboard_looks_and_its_split_adds_up_to_the_step(resume_runs, tmp_path):
    import argparse
    import socket

    from tensorboard.plugins.base_plugin import TBContext
    from xprof.profile_plugin import ProfilePlugin

    from trainer.experiments import profiles, report
    straight = resume_runs / "straight"
    found = list(straight.glob("profiles/*/plugins/profile/*/*.xplane.pb"))
    host = f"{socket.gethostname()}-p0"
    assert [(p.parent.name, p.name) for p in found] == [("steps_3_5", f"{host}.xplane.pb")]
    # The profile plugin's own loader (what TensorBoard's profile tab asks) lists the session and its host.
    plugin = ProfilePlugin(TBContext(logdir=str(straight), data_provider=None,
                                     flags=argparse.Namespace(master_tpu_unsecure_channel="")))
    session = f"profiles/{found[0].parents[3].name}/steps_3_5"
    assert session in plugin.runs_imp()
    assert plugin.host_impl(session, "overview_page") == [{"hostname": host}]

    win, = profiles.summarize_run(str(straight))
    h, = win["hosts"]
    assert win["window"] == (3, 5) and h["host"] == host and h["hardware"] == "CPU_ONLY"
    assert [s["step"] for s in h["steps"]] == [3, 4]
    # The split is read from the trace, and its three parts are the whole traced step, none counted twice.
    for s in h["steps"]:
        assert s["compute_s"] > 0 and s["collective_s"] > 0 and s["idle_s"] >= 0, s
        assert s["compute_s"] + s["collective_s"] + s["idle_s"] == pytest.approx(s["step_s"], rel=1e-6), s
    # The traced step is the training loop's own (metrics.jsonl: its wall clock, which never looks at the trace).
    # The loop counts step 2's checkpoint save (--ckpt-every 2) in step 3's time, which the trace's step 3 leaves
    # out: step 4 is compared. The trace is never longer (2%: the two clocks' rounding): a trace step that held
    # more than the loop's step (the save, another step) is over it. The loop's clock also spans the host work
    # around the traced step (reading the loss, the progress line), a few ms that a loaded machine stretches by
    # its waits to be scheduled: some 10% on a busy machine. Half is the lower bound: a machine would have to
    # stall that host work as long as the step itself to break it. That the trace step holds its compute and its
    # collectives is checked above, on their own.
    measured = {r["step"]: r["step_time_s"] for r in metrics(straight)}
    s = h["steps"][1]
    assert 0.5 * measured[4] <= s["compute_s"] + s["collective_s"] + s["idle_s"] <= 1.02 * measured[4], \
        (s, measured[4])
    # 8 devices on the data axis: the gradients' reductions are collectives, named by kind.
    assert set(h["collectives"]) <= {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "other collective"}
    assert h["collectives"] and all(v > 0 for v in h["collectives"].values())
    shares = [op["share"] for op in h["top_ops"]]
    assert len(shares) == 10 and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    # The report's "where the time goes" section says it, and which numbers come from where.
    res = report.report(str(straight), str(tmp_path / "report"), charts=False)
    text = res["summary"]["where the time goes"]
    assert "From the trace" in text and f"{host} (CPU_ONLY): step" in text and "Measured by the training loop" in text
    assert res["profiles"][0]["hosts"][0]["top_ops"][0]["op"] in text


def test_checkpoint_from_8x1_restores_onto_4x2(resume_runs):
    cross, straight = losses(resume_runs / "cross"), losses(resume_runs / "straight")
    assert sorted(cross) == [1, 2, 3, 4]
    # Step 4 ran on a 4x2 mesh from the 8x1 checkpoint of step 3: same loss as the straight 8x1 run.
    assert cross[4] == pytest.approx(straight[4], abs=1e-5)
    assert cross[4] != straight[3]


def test_checkpoint_restores_whether_the_table_is_split_or_replicated(resume_runs):
    table, straight = losses(resume_runs / "table"), losses(resume_runs / "straight")
    assert sorted(table) == [1, 2, 3, 4]
    assert table[4] == pytest.approx(straight[4], abs=1e-5)  # replicated table + all-reduce: same step


def test_the_optimizer_state_split_over_data_or_replicated_gives_the_same_step(resume_runs):
    """The step-3 checkpoint (moments replicated) restores with them split over the 8 devices, and that step 4
    is the replicated one's: where the optimizer state lives changes no number."""
    split, straight = losses(resume_runs / "split"), losses(resume_runs / "straight")
    assert sorted(split) == [1, 2, 3, 4]
    assert split[4] == pytest.approx(straight[4], abs=1e-5) and split[4] != straight[3]


def _start_long_run(procs, corpus, tmp_path):
    """(process, ckpt dir) of a single-process run far longer than any test waits: a signal stops it."""
    ckpt = tmp_path / "run"
    p = procs.start(["pretrain", "--emulate-devices", "8", "--data", corpus, *RUN, "--steps", "1000",
                     "--ckpt-dir", str(ckpt)], env(os.environ["TPUCTL_CACHE"], devices=None), tmp_path / "log")
    return p, ckpt


def _wait_until(p, ready, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert p.poll() is None, tail(p.log)
        assert time.time() < deadline, tail(p.log)
        time.sleep(0.1)


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 42, "preemption notice: saved step"),
                                             (signal.SIGINT, 130, "interrupted: saved step")],
                         ids=["preemption-notice", "ctrl-c"])
def test_stop_request_saves_that_step_and_the_next_run_continues(corpus, tmp_path, procs, sig, code, said):
    """SIGTERM (a preemption notice) and Ctrl-C both save the step they land on, with no periodic saves."""
    p, ckpt = _start_long_run(procs, corpus, tmp_path)
    _wait_until(p, lambda: any(r["step"] >= 2 for r in metrics(ckpt)))
    p.send_signal(sig)
    assert p.wait(timeout=120) == code, tail(p.log)
    log = p.log.read_text()
    assert "Traceback" not in log, tail(p.log)
    saved = int(re.search(said + r" (\d+)", log).group(1))
    assert saved >= 2 and (ckpt / str(saved)).is_dir()
    assert Checkpointer(str(ckpt), keep=1, read_only=True).latest_step() == saved
    assert main(["pretrain", "--data", corpus, *RUN, "--steps", str(saved + 1), "--ckpt-dir", str(ckpt)]) == 0
    steps = [r["step"] for r in metrics(ckpt)]
    assert steps[-1] == saved + 1 and steps.count(saved + 1) == 1 and max(steps[:-1]) == saved


def test_ctrl_c_before_the_first_step_stops_in_one_line(corpus, tmp_path, procs):
    p, _ = _start_long_run(procs, corpus, tmp_path)
    _wait_until(p, lambda: "params | mesh" in p.log.read_text())  # printed just before the step is compiled
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=120) == 130, tail(p.log)
    log = p.log.read_text()
    assert "Traceback" not in log, tail(p.log)
    # Either the Ctrl-C landed while compiling (nothing to save) or, compiled from the cache, on step 1.
    assert log.rstrip().endswith("interrupted") or re.search(r"interrupted: saved step \d+", log), tail(p.log)


def test_a_ctrl_c_a_library_drops_before_the_first_step_still_stops_the_run(tmp_path, capsys):
    """A KeyboardInterrupt raised inside a library's callback is printed and dropped (jax's garbage-collection
    callback, during a compile: seen under load, where the run then went on to its last step). The CLI's early
    handler remembers the Ctrl-C; the loop's first act raises it again, and the dropped one prints nothing."""
    from trainer.common import process
    handler, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        process.catch_early_interrupt()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs at once
        except KeyboardInterrupt as e:  # what the callback's caller does with it
            sys.unraisablehook(type("U", (), {"exc_type": KeyboardInterrupt, "exc_value": e, "exc_traceback": None,
                                              "err_msg": None, "object": None})())
        ckpt = Checkpointer(str(tmp_path / "run"), keep=1)
        with pytest.raises(KeyboardInterrupt):
            ckpt.watch_interrupt()
        ckpt.watch_interrupt()  # remembered once: this time the loop's own handler goes in
        assert signal.getsignal(signal.SIGINT) == ckpt._on_sigint
        ckpt.unwatch()
        ckpt.close()
        assert capsys.readouterr().err == ""
    finally:
        signal.signal(signal.SIGINT, handler)
        sys.unraisablehook = hook


# A process that dies while its async save of step 2 is being written (after a finished save of step 1).
_DIES_MID_SAVE = """
import glob, os, sys
import jax.numpy as jnp
from trainer.common.checkpoint import Checkpointer
from trainer.common.config import PRESETS, Config
d = sys.argv[1]
cfg = Config("gpt2-tiny", *PRESETS["gpt2-tiny"])
big = {"w": jnp.ones((32, 1024, 1024))}  # 128 MB: its write takes far longer than noticing the tmp dir
ckpt = Checkpointer(d, keep=3)
ckpt.save(1, {"w": jnp.ones(4)}, {"m": jnp.ones(4)}, cfg)
ckpt.wait()
ckpt.save(2, big, {"m": jnp.ones(4)}, cfg)
while not glob.glob(os.path.join(d, "2.*tmp*")):
    pass
os._exit(0)
"""


def test_a_save_cut_short_is_never_a_step_and_the_next_writer_deletes_it(tmp_path):
    d = tmp_path / "run"
    subprocess.run([sys.executable, "-c", _DIES_MID_SAVE, str(d)], cwd=REPO, check=True, timeout=240,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    leftover = [p.name for p in d.iterdir() if "tmp" in p.name]
    assert leftover, sorted(p.name for p in d.iterdir())  # the premise: step 2 was cut short
    reader = Checkpointer(str(d), keep=3, read_only=True)
    assert reader.latest_step() == 1
    reader.close()
    assert all((d / name).exists() for name in leftover)  # a reader leaves the directory alone
    writer = Checkpointer(str(d), keep=3)  # as a resumed run: it deletes the leftover before its first save
    writer.save(3, {"w": jnp.ones(4)}, {"m": jnp.ones(4)}, Config("gpt2-tiny", *PRESETS["gpt2-tiny"]))
    writer.close()
    assert sorted(p.name for p in d.iterdir() if p.name[0].isdigit()) == ["1", "3"]
