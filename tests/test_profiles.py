"""The profile window's flag, the straggler rule over each host's records, and per-host step times (no jax run:
the traces themselves are checked on real runs in test_trainer_train.py and test_trainer_multiproc.py); the
profiler server's refusals, and one trainer run on a host where no socket may listen."""
from __future__ import annotations

import pytest

import errno
import gzip
import os
import socket
import subprocess
import sys
from pathlib import Path

from trainer.common import profiling, steptimes
from trainer.common.config import UsageError
from trainer.experiments import profiles, where_time_goes


def test_a_window_is_a_half_open_range_of_steps_named_by_its_session():
    w = profiling.parse_window("5:8")
    assert (w.start, w.end, w.last, w.session, str(w)) == (5, 8, 7, "steps_5_8", "5:8")
    assert [s for s in range(1, 12) if s in w] == [5, 6, 7]
    assert profiling.parse_window("") is None
    profiling.check_window(w, 7)  # the last step may be the run's last
    with pytest.raises(UsageError, match="ends at step 6"):
        profiling.check_window(w, 6)
    assert profiles.window_of(w.session) == (5, 8) and profiles.window_of("2026_12_02_16_29_22") is None


@pytest.mark.parametrize("text, needle", [("5:5", "empty"), ("8:5", "reversed"), ("0:2", "start at 1"),
                                          ("5", "START:END"), (":8", "START:END"), ("a:b", "START:END")])
def test_a_bad_window_is_one_line(text, needle):
    with pytest.raises(UsageError, match=needle) as e:
        profiling.parse_window(text)
    assert "\n" not in str(e.value)


def test_collectives_are_named_by_kind_whatever_the_backend_calls_them():
    assert profiles.kind_of("all_gather.22") == "all-gather"  # XLA:CPU
    assert profiles.kind_of("all-reduce-start.3") == "all-reduce"  # async on TPU
    assert profiles.kind_of("reduce-scatter-done") == "reduce-scatter"
    assert profiles.kind_of("fusion.7", "all-to-all") == "all-to-all"  # xprof's category wins
    assert profiles.kind_of("collective-permute.1") == "other collective"
    assert profiles.kind_of("ynn_fusion.40") is None and profiles.kind_of("all-reduce-fusion.1") is None


def _records(lag_of_1: list[float], wait_of_1: float = 0.0, stall_of_1: list[float] | None = None,
             step_s: float = 0.1) -> list[dict]:
    """Three hosts dispatching logged steps 10, 20, ...; host 1 late by lag_of_1[i] at the i-th, or stalled."""
    out = []
    for i, lag in enumerate(lag_of_1):
        t = 1000.0 + i * 10 * step_s
        out.append({"step": 10 * (i + 1), "step_time_s": step_s, "hosts": [
            {"dispatch_t": t, "input_wait_s": 0.0, "stalled_s": 0.0},
            {"dispatch_t": t + lag, "input_wait_s": wait_of_1, "stalled_s": (stall_of_1 or [0.0] * 99)[i]},
            {"dispatch_t": t + 0.001, "input_wait_s": 0.0, "stalled_s": 0.0}]})
    return out


def test_the_host_late_on_average_over_recent_steps_is_the_straggler():
    s = steptimes.straggler(_records([0.3, 0.3, 0.0, 0.3, 0.3]))
    assert s == {"process": 1, "lag_s": pytest.approx(0.2995), "steps": 4, "of": 5, "input_bound": False,
                 "stalled": False}
    assert steptimes.straggler(_records([0.3] * 5, wait_of_1=0.28))["input_bound"] is True
    # Held up inside the steps (the others wait for it in the collectives and all dispatch together), in every
    # other step, as SIGSTOP pulses do: its stalls name it.
    s = steptimes.straggler(_records([0.0] * 10, stall_of_1=[0.3, 0.0] * 5))
    assert (s["process"], s["steps"], s["of"], s["stalled"]) == (1, 5, 10, True)
    # Late now and then, or always within the margin: nobody is named.
    assert steptimes.straggler(_records([0.05] + [0.0] * 9)) is None
    assert steptimes.straggler(_records([0.01] * 5)) is None
    # Only the last RECENT records count: an old slow patch is forgotten.
    assert steptimes.straggler(_records([0.3] * 5 + [0.0] * 10)) is None
    # A trace started or stopped (--profile) in a step's interval: each host pays its own, the step is left out.
    recs = _records([0.0] * 10)
    for r in recs[:6]:
        r["hosts"][1].update(dispatch_t=r["hosts"][1]["dispatch_t"] + 0.4, profiler_s=0.4)
    assert steptimes.straggler(recs) is None
    for r in recs[:6]:
        r["hosts"][1]["profiler_s"] = 0.0
    assert steptimes.straggler(recs)["process"] == 1
    # One process, or records from before per-host records existed: nothing to compare.
    assert steptimes.straggler([{"step": 1, "hosts": [{"dispatch_t": 1.0, "input_wait_s": 0}]}, {"step": 2}]) is None


def test_the_stall_clock_counts_the_time_its_process_was_stopped():
    import os
    import signal
    import subprocess
    import sys
    import time
    code = ("import sys, time\nfrom trainer.common.steptimes import StallClock\nc = StallClock()\n"
            "print('ready', flush=True)\nsys.stdin.readline()\nprint(round(c.take(), 2), flush=True)")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # running: nothing counted
        for _ in range(2):
            p.send_signal(signal.SIGSTOP)
            time.sleep(0.4)
            p.send_signal(signal.SIGCONT)
            time.sleep(0.1)
        p.stdin.write("\n")
        p.stdin.flush()
        assert 0.6 <= float(p.stdout.readline()) <= 1.2  # two stops of 0.4 s (a loaded machine adds a little)
    finally:
        p.kill()
        p.wait()


def test_each_host_s_step_time_comes_from_its_own_dispatch_times():
    recs = _records([0.0, 0.5, 0.5])
    times = where_time_goes.host_step_times(recs)
    assert [s for s, _ in times[0]] == [20, 30]
    assert times[0][0][1] == pytest.approx(0.1) and times[1][0][1] == pytest.approx(0.15)  # (1 s + 0.5) / 10
    assert times[1][1][1] == pytest.approx(0.1)
    text = where_time_goes.section("/nonexistent", recs, read_profiles=False)["text"]
    assert "Straggler: process 1" in text and "not its input and not a stall" in text and "No profile" in text


def _gviz(cols: list[str], rows: list[list], p: dict | None = None) -> dict:
    return {"cols": [{"id": c} for c in cols], "rows": [{"c": [{"v": v} for v in r]} for r in rows], "p": p or {}}


def test_on_a_gpu_shaped_step_table_the_split_and_the_ops_are_xprof_s_own_breakdown_and_hlo_stats(monkeypatch):
    """xprof's tables in the shape its overview_page has where the device is not a TPU (the column ids xprof
    2.24.2 names on a CPU trace: deviceComputeTimeMs, ..., stepTimeMs) and hlo_stats' rows. A TPU's step table has
    other columns: the real TPU traces below."""
    step_cols = ["stepnum", "deviceComputeTimeMs", "deviceToDeviceTimeMs", "deviceCollectivesTimeMs",
                 "hostComputeTimeMs", "kernelLaunchTimeMs", "infeedTimeMs", "outfeedTimeMs", "compileTimeMs",
                 "otherTimeMs", "tooltip", "stepTimeMs"]
    overview = [_gviz(["selfTimePercent"], []), _gviz(step_cols, [
        ["train 5", 80.0, 2.0, 10.0, 1.0, 0.0, 5.0, 0.0, 0.0, 2.0, "", 100.0],
        ["train 6", 70.0, 0.0, 20.0, 1.0, 0.0, 5.0, 0.0, 0.0, 4.0, "", 100.0]], {"hardware_type": "TPU"})]
    ops = [("fusion.1", "convolution fusion", 100.0), ("all-reduce.2", "all-reduce", 40.0),
           ("all-gather-start.1", "all-gather", 20.0), ("fusion.2", "loop fusion", 30.0)]
    ops += [(f"fusion.{i}", "loop fusion", 1.0) for i in range(10, 20)]
    hlo = _gviz(["rank", "category", "hlo_op_name", "total_self_time"], [[0, c, n, us] for n, c, us in ops])
    monkeypatch.setattr(profiles, "tool", lambda path, name: {"overview_page": overview, "hlo_stats": hlo}[name])
    h = profiles.summarize("/x/t1v-w0-p0.xplane.pb")
    assert (h["host"], h["hardware"]) == ("t1v-w0-p0", "TPU") and "hlo_stats" in h["source"]
    assert [(s["step"], s["compute_s"], s["collective_s"]) for s in h["steps"]] == [
        (5, pytest.approx(0.08), pytest.approx(0.012)), (6, pytest.approx(0.07), pytest.approx(0.02))]
    assert h["steps"][0]["input_s"] == pytest.approx(0.005) and h["steps"][0]["idle_s"] == pytest.approx(0.003)
    assert h["mean"]["step_s"] == pytest.approx(0.1)
    assert h["collectives"] == {"all-reduce": pytest.approx(20e-6), "all-gather": pytest.approx(10e-6)}  # per step
    assert [o["op"] for o in h["top_ops"][:4]] == ["fusion.1", "all-reduce.2", "fusion.2", "all-gather-start.1"]
    assert len(h["top_ops"]) == 10 and h["top_ops"][0]["share"] == pytest.approx(100 / 200)
    text = profiles.describe({"run": "r", "session": "steps_5_7", "window": (5, 7), "hosts": [h]})
    assert "steps 5 to 6" in text and "compute 75.0 ms (75%)" in text and "all-reduce 20 µs" in text


def test_the_plan_s_expected_step_stands_beside_the_measured_one_each_named(tmp_path):
    plan = {"accelerator": "v5litepod-8", "timing": {"step_s_at_peak": 0.05, "step_s_at_mfu": 0.1,
                                                     "mfu_assumed": 0.5}}
    (tmp_path / "plan.json").write_text(__import__("json").dumps(plan))
    recs = _records([0.0] * 4, step_s=0.2)
    text = where_time_goes.section("/nonexistent", recs, where_time_goes.read_plan(str(tmp_path / "plan.json")),
                                   read_profiles=False)["text"]
    assert "Measured by the training loop (metrics.jsonl, wall clock of process 0): median step 200.0 ms" in text
    assert ("Expected by the compiler's plan (tpuctl plan, v5litepod-8): 50.0 ms at the chips' peak, 100.0 ms at "
            "50% MFU (measured / plan at that MFU: 2.00x)") in text
    with pytest.raises(UsageError, match="--plan .* does not exist"):
        where_time_goes.read_plan(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("plan: yes")
    with pytest.raises(UsageError, match="is not JSON"):
        where_time_goes.read_plan(str(tmp_path / "bad.json"))


def test_without_xprof_the_report_names_the_windows_it_could_not_read(tmp_path, monkeypatch):
    session = tmp_path / "profiles" / "r1" / "plugins" / "profile" / "steps_2_4"
    session.mkdir(parents=True)
    (session / "h-p0.xplane.pb").write_bytes(b"")

    def no_xprof():
        raise UsageError("reading profiles needs xprof: pip install 'tpuctl[profile]' (make setup installs it)")
    monkeypatch.setattr(profiles, "_xprof", no_xprof)
    text = where_time_goes.section(str(tmp_path), _records([0.0] * 3))["text"]
    assert f"1 profiled window(s) under {tmp_path}/profiles, not read: reading profiles needs xprof" in text
    assert "Measured by the training loop" in text and "No profile" not in text


# Two different TPU traces, each of two steps (--profile 3:5) of a small GPT-2 on one v5e chip (jax 0.10.2, libtpu
# 0.0.42.1, 2026-12-05), and xprof's own reading of each file: its overview_page's active step
# (active_steptime_ms_average) and hlo_stats' op time by category (each category's share of all ops' self time).
TPU_TRACES = Path(__file__).parent / "data" / "tpu_traces"
XPROF_READS = {"gpt2-2l-b4-t512": (7.84, {"custom-call": 48.1, "loop fusion": 26.7, "convolution fusion": 13.1}),
               "gpt2-4l-d256-b8-t256": (2.54, {"custom-call": 55.8, "loop fusion": 19.5,
                                               "convolution fusion": 10.5})}


def test_tpu_traces_in_one_folder_each_read_as_their_own_host_s_device_step_split_and_ops(tmp_path):
    session = tmp_path / "profiles" / "r1" / "plugins" / "profile" / "steps_3_5"
    session.mkdir(parents=True)
    for i, name in enumerate(XPROF_READS):  # our layout: every host's trace in the session's one folder
        (session / f"t1v-w{i}.xplane.pb").write_bytes(gzip.decompress((TPU_TRACES / f"{name}.xplane.pb.gz").read_bytes()))
    win, = profiles.summarize_run(str(tmp_path))
    assert [h["host"] for h in win["hosts"]] == ["t1v-w0", "t1v-w1"]
    for h, (active_ms, categories) in zip(win["hosts"], XPROF_READS.values()):
        assert h["hardware"] == "TPU" and "TPU step table" in h["source"]
        assert h["device_step_s"] * 1e3 == pytest.approx(active_ms, rel=0.05)
        for category, pct in categories.items():
            assert abs(100 * h["categories"][category] - pct) <= 2, (category, h["categories"])
        assert len(h["steps"]) == 2
        for st in h["steps"]:
            assert st["compute_s"] > 0 and st["step_s"] >= st["compute_s"]
            assert st["compute_s"] + st["collective_s"] + st["input_s"] + st["idle_s"] == pytest.approx(
                st["step_s"], rel=0.01)
        # the loss kernels lead, at the rates xprof measured (near the chip's 197 TFLOP/s bf16 peak)
        top = h["top_ops"][0]
        assert top["op"].startswith("xent_") and top["category"] == "custom-call" and 150e12 < top["flop_s"] < 197e12
    # each its own figures, and nothing written beside them (xprof's ALL_HOSTS cache would answer every host
    # with the first one's)
    assert win["hosts"][0]["device_step_s"] > 2.5 * win["hosts"][1]["device_step_s"]
    assert sorted(os.listdir(session)) == ["t1v-w0.xplane.pb", "t1v-w1.xplane.pb"]
    text = profiles.describe(win)
    assert "t1v-w0 (TPU): device step 7.8 ms" in text and "t1v-w1 (TPU): device step 2.5 ms" in text
    assert "op time by category: custom-call 48.1%" in text and "TFLOP/s" in text


def test_tpuctl_profile_summarizes_each_host_s_own_trace_and_names_one_it_cannot_read(tmp_path):
    from orchestrator.observe import live_profile
    session = tmp_path / "profiles" / "r1" / "plugins" / "profile" / "live_1"
    session.mkdir(parents=True)
    traces = {}
    for i, name in enumerate(XPROF_READS):
        p = session / f"t1v-w{i}.xplane.pb"
        p.write_bytes(gzip.decompress((TPU_TRACES / f"{name}.xplane.pb.gz").read_bytes()))
        traces[f"w{i}"] = str(p)
    (session / "t1v-w2.xplane.pb").write_bytes(b"not a trace")
    traces["w2"] = str(session / "t1v-w2.xplane.pb")
    res = live_profile.Profiled("r1", "live_1", 1000, traces=traces)
    live_profile.summarize(res)
    assert [round(res.summaries[w]["device_step_s"] * 1e3, 2) for w in ("w0", "w1")] == [7.84, 2.54]
    assert "error" in res.summaries["w2"]
    text = live_profile.where(res)
    assert "w0 (TPU): device step 7.8 ms" in text and "w1 (TPU): device step 2.5 ms" in text
    assert "w2: trace not summarized here: " in text


# A process in which no socket may listen: a seccomp filter makes every bind(2) fail with the errno given, as a
# sandbox's does (no root needed: no_new_privs first), then the trainer runs as `python -m trainer` would.
_NO_LISTEN = r'''
import ctypes, platform, runpy, sys
err = int(sys.argv[1])
arch, nr = {"x86_64": (0xc000003e, 49), "aarch64": (0xc00000b7, 200)}[platform.machine()]
class Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
LD, JEQ, RET = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
insns = (Insn * 6)(Insn(LD, 0, 0, 4), Insn(JEQ, 0, 3, arch), Insn(LD, 0, 0, 0), Insn(JEQ, 0, 1, nr),
                   Insn(RET, 0, 0, 0x00050000 | err), Insn(RET, 0, 0, 0x7fff0000))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0, ctypes.get_errno()  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(Prog(6, insns)), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
if sys.argv[2:] == ["server"]:  # the profiler server alone
    from trainer.common import profiling
    print(profiling.start_server(0)[1])
else:
    sys.argv = ["trainer", *sys.argv[2:]]
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
'''


def _no_listen(err: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    from _trainer_util import REPO
    return subprocess.run([sys.executable, "-c", _NO_LISTEN, str(getattr(errno, err)), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _unheld_port() -> int:
    """A port nobody holds, so that only the host's refusal can fail a bind to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(err: str, port: int) -> str:
    return f"this host refuses to listen on port {port} ({err}: {os.strerror(getattr(errno, err))}); --profile " \
           "still traces its window to files under --ckpt-dir"


@pytest.mark.parametrize("err", ["EACCES", "EPERM", "EAFNOSUPPORT"])
def test_a_bind_the_host_refuses_is_named_by_its_errno(err):
    """EACCES, EPERM: a policy refuses the bind; EAFNOSUPPORT: no IPv6 socket, then no IPv4 one, may be made."""
    port = _unheld_port()
    r = _no_listen(err, ["server"], {**os.environ, profiling.PORT_ENV: str(port)})
    assert r.returncode == 0 and r.stdout.strip() == _refused(err, port), r.stdout + r.stderr[-2000:]


def test_the_trainer_on_a_host_where_no_socket_may_listen_says_why_and_still_traces_its_window(tmp_path_factory,
                                                                                              tmp_path):
    """`python -m trainer` with every bind refused (EAFNOSUPPORT): one line names the errno, not a port taken, and
    --profile's window is still traced to a file under --ckpt-dir."""
    from _trainer_util import TINY, env, session_cache, shakespeare
    port, ckpt = _unheld_port(), tmp_path / "ckpt"
    args = ["pretrain", "--data", shakespeare(tmp_path_factory), *TINY, "--steps", "2", "--profile", "1:2",
            "--log-every", "1", "--ckpt-every", "0", "--eval-every", "0", "--eval-batches", "1",
            "--ckpt-dir", str(ckpt)]
    r = _no_listen("EAFNOSUPPORT", args, env(session_cache(tmp_path_factory), devices=1,
                                             TPUCTL_PROFILER_PORT=str(port)))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    said = [line for line in out.splitlines() if "profiler server of process 0" in line]
    assert len(said) == 1 and _refused("EAFNOSUPPORT", port) in said[0], said
    assert "is taken" not in out
    assert len(list(ckpt.glob("profiles/*/plugins/profile/steps_1_2/*.xplane.pb"))) == 1, out[-3000:]


def test_a_port_another_program_holds_is_named_taken(monkeypatch):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        monkeypatch.setenv(profiling.PORT_ENV, str(s.getsockname()[1]))
        assert profiling.start_server(0) == (None, f"port {s.getsockname()[1]} is taken on this host (set "
                                                   f"{profiling.PORT_ENV} to another base)")
