"""`python -m bench --quick`: the benchmark runs end to end and prints its comparison lines.

It checks that the bench works, not how fast anything is (no timed assertions): the numbers at --quick
sizes mean nothing.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=420):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the bench must set up its own 8 devices
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


@pytest.mark.slow  # ~50 s on 2 idle cores: compiling the seed's step (twice) and ours dominates
def test_quick_bench_prints_ratios():
    r = _run("--quick", "--skip", "124m")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "8 cpu devices" in out
    m = re.search(r"ratio ours/seed tokens/s: ([0-9.]+)x", out)
    assert m and float(m.group(1)) > 0, out
    assert re.search(r"^\[1\] seed .* ([0-9,]+) tokens/s, step [0-9.]+ s", out, re.M), out
    assert re.search(r"^\[2\] ours .* ([0-9,]+) tokens/s, step [0-9.]+ s", out, re.M), out
    assert re.search(r"^\[3\] CPU peak, .*single [0-9.,]+ GFLOP/s, sharded8 [0-9.,]+ GFLOP/s", out, re.M), out
    assert re.search(r"seed: N=[0-9,]+, .* of peak", out), out
    m = re.search(r"ratio save-every-2/no-save step time: ([0-9.]+)x", out)
    assert m and float(m.group(1)) > 0, out
    assert "[4b] gpt2-124m: skipped" in out and "[6] launch bench: skipped" in out
    m = re.search(r"^\[12\] ratio gs/local: ([0-9.]+)x; gs:// against the 2M tokens/s a host needs: ([0-9.]+)x", out,
                  re.M)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out
    m = re.search(r"^     ratio to off: profiled ([0-9.]+)x; inside the window [0-9.]+ ms", out, re.M)
    assert m and float(m.group(1)) > 0, out


def test_bad_flag_is_one_line_error():
    r = _run("--rounds", "0", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --rounds 0: must be at least 1"]


def test_side_by_side_reads_maxtexts_records_and_says_what_was_not_measured(tmp_path):
    """[15]'s MaxText rows come from the records its bench scripts write (no compile here): only those of the same
    work with every layer counted (unscanned), for the chip asked, with their own jax and libtpu; a chip with no
    record, or a missing path, is one "not measured" row."""
    from bench.compiler import side_by_side as S
    rec = {"overrides": ["compile_topology=v5e-8", "per_device_batch_size=8"], "jax": "0.12.0.1", "temp_bytes": 2 ** 30,
           "bytes_accessed": 41e9, "flops": 7.4e12, "n_params_model_state": 124_475_910, "scan_layers": False,
           "global_batch": 64, "max_target_length": 1024, "remat_policy": "minimal", "ici_fsdp_parallelism": 1,
           "decoder_block": "DecoderBlockType.GPT3"}
    (tmp_path / "dp.json").write_text(__import__("json").dumps(rec))
    (tmp_path / "scanned.json").write_text(__import__("json").dumps({**rec, "scan_layers": True}))
    (tmp_path / "v6e.json").write_text(__import__("json").dumps({**rec, "overrides": ["compile_topology=v6e-8"],
                                                                  "global_batch": 32}))
    (tmp_path / "venv_freeze.txt").write_text("jax==0.12.0.1\nlibtpu==0.0.52\n")
    v5e, v6e = S.CHIPS["v5e-8"], S.CHIPS["v6e-8"]
    rows = S.maxtext(v5e, tmp_path)
    assert [r.label for r in rows] == ["MaxText, gpt3 block, splash, remat minimal, data=8 (params replicated) [dp]"]
    assert (rows[0].jax, rows[0].libtpu, rows[0].bytes_accessed) == ("0.12.0.1", "0.0.52", 41e9)
    line = S.render(v5e, rows[0])
    # 41 GB at 819 GB/s over 6 x 124.5M x 8192 tokens at 197 TFLOP/s: r = 1.61, the step waits on memory
    assert " 1.61 " in line and "memory" in line and "0.0.52" in line
    for missing in (S.maxtext(v6e, tmp_path), S.maxtext(v5e, tmp_path / "nothing-here")):
        assert len(missing) == 1 and missing[0].note.startswith("not measured")
        assert "not measured" in S.render(v6e, missing[0])
    # Where the records are read: --maxtext, else $TPUCTL_MAXTEXT_FIGURES, else the shared folder.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(S.MAXTEXT_ENV, raising=False)
        assert S.maxtext_path(None) == S.DEFAULT_MAXTEXT
        mp.setenv(S.MAXTEXT_ENV, str(tmp_path / "from-env"))
        assert S.maxtext_path(None) == tmp_path / "from-env"
        assert S.maxtext_path(str(tmp_path / "given")) == tmp_path / "given"
    # Given PATH and the committed records together: v5e-8's come from PATH, v6e-8's from bench/maxtext_records/.
    both = [tmp_path, S.COMMITTED_MAXTEXT]
    assert [r.label for r in S.maxtext(v5e, both)] == [r.label for r in rows]
    assert S.maxtext_paths(str(tmp_path)) == both and S.maxtext_paths(str(S.COMMITTED_MAXTEXT)) == [S.COMMITTED_MAXTEXT]
    # Our rows go through `tpuctl plan`'s API: a step it refuses (here before any compile) is a "failed" row.
    bad = S.ours(v5e, "ours, a bad flag", ["--no-such-flag"])
    assert bad.note == "failed: unrecognized arguments: --no-such-flag" and "failed" in S.render(v5e, bad)


def test_side_by_side_reads_maxtexts_v6e_records_from_the_repository(tmp_path, monkeypatch):
    """v6e-8's MaxText rows come from the committed records (bench/maxtext_records/, no compile here), each with
    the jax and libtpu that compiled it, beside any PATH; without them (and none in PATH) the chip says "not
    measured"."""
    import json
    from bench.compiler import side_by_side as S
    v6e = S.CHIPS["v6e-8"]
    rows = S.maxtext(v6e, S.maxtext_paths(str(tmp_path / "nothing-here")))
    stems = {r.label.rsplit("[", 1)[-1].rstrip("]") for r in rows}
    assert {"gpt3_auto_noscan_dp_v6e", "gpt3_auto_noscan_minimal_dp_v6e"} <= stems, [r.label for r in rows]
    for r in rows:
        assert not r.note and "data=8 (params replicated)" in r.label
        assert (r.jax, r.libtpu) == ("0.12.0.1", "0.0.52"), r  # MaxText 0.2.5's venv, as its v5e-8 records
        # per device and step, every layer counted: FLOPs near 6NT/8 = 6.1e12 or above (remat), tens of GB, GiBs
        assert 5e12 < r.flops < 1e13 and 1e10 < r.bytes_accessed < 1e11 and 0 < r.temp_bytes < 8 * 2 ** 30
        assert r.libtpu in S.render(v6e, r)
    # each committed record is v6e-8's: none shows up for v5e-8 from here
    assert S.maxtext(S.CHIPS["v5e-8"], S.COMMITTED_MAXTEXT)[0].note.startswith("not measured")
    for rec in S.COMMITTED_MAXTEXT.glob("*.json"):
        assert "compile_topology=v6e-8" in json.loads(rec.read_text())["overrides"]
    # without the committed records (gone from where they are read) and none in PATH: one "not measured" row
    monkeypatch.setattr(S, "COMMITTED_MAXTEXT", tmp_path / "gone")
    missing = S.maxtext(v6e, S.maxtext_paths(str(tmp_path)))
    assert len(missing) == 1 and missing[0].note.startswith("not measured") and "gone (missing)" in missing[0].note
    assert "not measured" in S.render(v6e, missing[0])


KERNEL_LOG = """\
I1206 23:28:40.434995   21210 deepsea_compiler_backend.cc:3769] [fusion.460] LLO optimizing 142,480 instructions
I1206 23:28:40.450314   21212 deepsea_compiler_backend.cc:3422] XLA::TPU LLO dependency graph-based optimizations
I1206 23:28:40.495571   21213 deepsea_compiler_backend.cc:3769] [divide_cosine_fusion] LLO optimizing 84,636 instructions
I1206 23:28:40.502700   21214 deepsea_compiler_backend.cc:3769] [fusion.9] LLO optimizing 1,000 instructions
I1206 23:28:40.509603   21215 deepsea_compiler_backend.cc:3769] [<no-hlo-instruction>] LLO optimizing 50 instructions
I1206 23:28:41.000000   21118 deepsea_compiler_base.cc:3931] BACKEND_PASSES stage duration: 2m21.2s
"""
KERNEL_HLO = """\
%wide.windowed_dot_general_body_ag.1 (p: f32[8]) -> f32[8] {
  %fusion.9 = f32[8]{0} fusion(%p), kind=kOutput, metadata={op_name="jit(_train_step)/jvp()/dot_general"}
}

ENTRY %main (a: f32[640,8]) -> f32[640,8] {
  %fusion.460 = f32[640,8]{1,0} fusion(%a), kind=kOutput, metadata={op_name="jit(_train_step)/transpose(jvp())/checkpoint/dot_general"}
  ROOT %divide_cosine_fusion = f32[4,512,128]{2,1,0} fusion(%a), kind=kLoop, metadata={op_name="jit(_train_step)/jvp()/cos"}
}
"""


def test_kernel_costs_joins_libtpus_kernels_with_the_program(tmp_path):
    from bench.compiler import kernel_costs as K
    ks = K.kernels(KERNEL_LOG, KERNEL_HLO)
    assert [(k.name, k.instructions) for k in ks] == [("fusion.460", 142480), ("divide_cosine_fusion", 84636),
                                                      ("fusion.9", 1000), ("<no-hlo-instruction>", 50)]
    assert [K.part_of(k) for k in ks] == ["backward: matmuls", "rotary tables", "forward: matmuls",
                                          "not in the program's text"]
    assert [K.held_by(k) for k in ks][:3] == ["top level", "top level",
                                              "the compiler's windowed collective matmul loops"]
    assert K.table(ks, K.held_by)[0] == ("top level", 2, 142480 + 84636)
    (tmp_path / "libtpu.log").write_text(KERNEL_LOG)
    (tmp_path / "step.hlo").write_text(KERNEL_HLO)
    text = K.read(str(tmp_path), top=2)
    assert text.startswith("4 kernels, 228,166 LLO instructions")
    assert "BACKEND_PASSES stage: 2m21.2s" in text and "fusion.9 " not in text.split("largest kernels")[1]
