"""The chip check (bench/tpu, `make tpu-check`): on a host without a TPU it says so and exits 0; its sections run
on the CPU at tiny sizes; and the record of its run on a v5e chip reads back with the plan's calibrated time
(trainer/common/calibration.py, as it is now) within 15% of every step the chip measured."""
from __future__ import annotations

import json
import subprocess
import sys

from _trainer_util import REPO
from bench.tpu import report

RECORD = REPO / "bench" / "tpu_records" / "v5e-2026-12-05.json"


def test_without_a_tpu_it_says_so_and_exits_0(tmp_path):
    import os
    e = {**os.environ, "TPUCTL_DEVICE_ROOT": str(tmp_path)}  # a device tree with no accelerator node
    p = subprocess.run([sys.executable, "-m", "bench.tpu", "--out", str(tmp_path / "out")], cwd=REPO, env=e,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("no TPU on this host"), (p.stdout, p.stderr)
    assert "docs/tpu-check.md" in p.stdout and not (tmp_path / "out").exists()


def test_the_v5e_record_reads_back_with_the_plan_within_15_percent_of_every_measured_step():
    data = json.loads(RECORD.read_text())
    assert data["about"]["device_kind"] == "TPU v5 lite" and data["about"]["versions"]["libtpu"] == "0.0.42.1"
    built = report.build(data["about"], data["rows"], data.get("failed", {}))
    s = built["summary"]
    assert s["ours_over_seed_b16"] >= report.SPEEDUP_GOAL
    assert s["checks"] >= 6 and s["checks_passed"] == s["checks"]  # kernels x4, the resume, the trace
    planned = {name: e["table"] for name, e in s["plan_errors"].items()}
    assert set(planned) == {"ours, batch 8", "ours, batch 16", "ours, batch 32",
                            "gemma2-2b LoRA r8 all targets, 4 x 512", "gemma3-1b LoRA r8 all targets, 8 x 512"}
    assert all(abs(e) <= report.PLAN_TOLERANCE for e in planned.values()), planned
    text = report.render(built)
    assert "ours / seed at batch 16: 1.96x" in text and "within ±15%" in text and "FAIL" not in text


def test_its_steps_lora_and_profile_sections_run_on_the_cpu_at_tiny_sizes(tmp_path):
    """The code a TPU host runs, at tiny sizes on the CPU (figures that mean nothing): our step beside the seed's,
    the LoRA steps from random weights (each traced, `--trace`, and its trace read by `--summarize`), a trace and its
    summary, the kernels against their references, one choice, one table and the JSON."""
    import os
    out = tmp_path / "out"
    e = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "bench.tpu", "--cpu", "--quick", "--out", str(out), "--only", "steps",
                        "--only", "lora", "--only", "profile", "--only", "kernels", "--only", "choices",
                        "--choice", "resident, block 256", "--trace"], cwd=REPO, env=e, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((out / "tpu-check.json").read_text())
    names = [r["name"] for r in data["rows"]]
    assert names[:4] == ["ours, batch 8", "seed, batch 8", "ours, batch 16", "seed, batch 16"], names
    assert sum(n.endswith("LoRA r8 all targets, 2 x 128") for n in names) == 2
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in data["rows"] if r["section"] in ("steps", "lora"))
    prof, = (r for r in data["rows"] if r["section"] == "profile")
    assert prof["ok"] and prof["figures"]["summary"]["hardware"] == "CPU_ONLY"
    assert (out / "profile-gpt2-124m-b8.xplane.pb").exists() and not data["failed"]
    assert "[steps]" in p.stdout and "[lora]" in p.stdout and "ours / seed at batch 16" in p.stdout
    lora_rows = [r for r in data["rows"] if r["section"] == "lora" and r["figures"].get("peer") != "tunix"]
    assert all((out / r["figures"]["trace"]).exists() for r in lora_rows), lora_rows
    import gzip  # one trace as a TPU host sends it back (bench/tpu/on_host.sh): gzipped, read so
    first = out / lora_rows[0]["figures"]["trace"]
    (out / (first.name + ".gz")).write_bytes(gzip.compress(first.read_bytes()))
    first.unlink()
    read = subprocess.run([sys.executable, "-m", "bench.tpu", "--summarize", str(out)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    summed = [r for r in json.loads((out / "tpu-check.json").read_text())["rows"]
              if r["section"] == "lora" and r["figures"].get("trace")]
    assert len(summed) == len(lora_rows) >= 2
    assert all(r["figures"]["profile"]["top_ops"] for r in summed), summed
    assert f"{lora_rows[0]['name']}:" in read.stdout and " 1. " in read.stdout
    # The kernels against their references (interpreted here), the resident attention kernel among them, and a
    # choice picked by name: the rows a chip's next run of `--choice resident` fills in.
    kernels = {r["name"]: r for r in data["rows"] if r["section"] == "kernels"}
    assert kernels["resident vs f32 attention, tiny (2 x 64)"]["ok"] and all(r["ok"] for r in kernels.values())
    chosen = [r for r in data["rows"] if r["section"] == "choices" and r["step_s"]]
    assert [r["name"] for r in chosen] == ["ours, batch 8, attention: resident, block 256"]
    assert chosen[0]["note"].startswith("attention resident-interpret")


def test_the_cli_rows_take_the_steady_windows_and_name_a_saves_stall():
    """The chip check's `cli` rows read metrics.jsonl as the trainer writes it: the tok/s of the windows that hold
    steps alone (not the first, which compiles; not one a save or the profiler was left out of; not the one after
    an evaluation), the steps right after each save against the median step, and two loss curves within noise."""
    from bench.tpu import cli
    recs = [{"step": 1, "loss": 9.0, "tokens_per_s": 5e3},                                   # the compile
            {"step": 10, "loss": 8.0, "tokens_per_s": 160e3},
            {"step": 20, "loss": 7.5, "tokens_per_s": 161e3, "left_out_s": {"checkpoint": 0.4}},
            {"step": 30, "loss": 7.2, "tokens_per_s": 56e3, "val_loss": 7.3},              # slow: a save's stall
            {"step": 40, "loss": 7.0, "tokens_per_s": 20e3},                               # after the evaluation
            {"step": 50, "loss": 6.9, "tokens_per_s": 159e3}]
    tps, clean = cli.steady(recs)
    assert [r["step"] for r in clean] == [10, 30, 50] and tps == 159e3
    times = {s: 0.100 for s in range(1, 161)}
    times[1], times[51], times[52], times[101] = 40.0, 0.130, 0.104, 0.101  # compile; two steps after a save
    got = cli.stall([{"step": s, "step_time_s": t} for s, t in times.items()], 50, 3)
    assert got["median_s"] == 0.100 and abs(got["worst"] - 1.3) < 1e-9
    assert [round(x, 2) for x in got["by_save"][50]] == [1.3, 1.04, 1.0] and 160 not in got["by_save"]
    noisy = [3.0 + 0.05 * (-1) ** i for i in range(20)]
    assert cli.within_noise([x + 0.01 for x in noisy], noisy)["ok"]
    assert not cli.within_noise([x + 0.2 for x in noisy], noisy)["ok"]
    assert cli.within_noise(noisy, noisy)["ok"]  # equal curves: no noise to compare with, and no difference


def test_rows_are_chosen_by_name_and_the_plans_join_by_name(tmp_path):
    """--rows picks rows before they are built; a plan compiled ahead (--plan-ahead) joins the timed row of the
    same name, and the report prices it (the table's plan column), naming the commit it was compiled from."""
    from bench.tpu import common, plans
    s = common.Settings(quick=True, out=str(tmp_path), peak=None, hbm=None, device_kind="TPU v5 lite",
                        rows=("batch 16",))
    assert s.wants("ours, batch 16") and s.wants("seed, batch 16") and not s.wants("ours, batch 8")
    assert common.Settings(quick=True, out="", peak=None, hbm=None, device_kind="").wants("anything")
    exact = common.Settings(quick=True, out="", peak=None, hbm=None, device_kind="", rows=("=ours, batch 1",))
    assert exact.wants("ours, batch 1") and not exact.wants("ours, batch 16")
    # --plan-ahead chooses rows as the check does ("=NAME" too), and says so when none is chosen
    assert plans.plan_ahead(str(tmp_path / "none.json"), ("=no such row",)) == 2
    assert not (tmp_path / "none.json").exists()
    cmds = plans.commands()
    assert cmds["ours, batch 16"] == ["pretrain", "--preset", "gpt2-124m", "--batch-size", "16"]
    assert "--base-dtype" in cmds["gemma4-e2b LoRA r8 all targets, 1 x 512"]
    # the vocab rows variant is a Steps option forced on one chip: no trainer command (no flag) builds its step
    assert not any("vocab rows" in name for name in cmds) and "--vocab-parallel" not in str(cmds)
    # each size's variants are its own command plus the variant's flags; a twin is the whole size's command
    assert cmds["gemma2-2b LoRA r8 all targets, 4 x 512, lora-impl beside"] == [
        *cmds["gemma2-2b LoRA r8 all targets, 4 x 512"], "--lora-impl", "beside"]
    twin = cmds["gemma4-26b-a4b (6 layers) LoRA r8 all targets, 4 x 512"]
    assert twin[:3] == ["lora", "--model", "gemma4-26b-a4b"] and not any("(6 layers)," in n for n in cmds)
    work = {"matmul_flops": 12.2e12, "attention_flops": 1.86e12, "head_dim": 64, "attention_kernel": "resident",
            "loss_kernel_flops": 0.0, "other_bytes": 20e9}
    rows = [{"section": "steps", "name": "ours, batch 16", "step_s": 0.1, "figures": {}},
            {"section": "steps", "name": "seed, batch 16", "step_s": 0.26, "figures": {}}]
    plans.join(rows, {"tpu": "v5e:1x1", "rows": {"ours, batch 16": {"work": work, "commit": "abc1234"}}})
    assert rows[0]["figures"]["work"] == work and "abc1234" in rows[0]["figures"]["plan_from"]
    assert "work" not in rows[1]["figures"]
    built = report.build({"device_kind": "TPU v5 lite"}, rows, {})
    assert 0.08 < built["rows"][0]["plan_s"] < 0.13 and built["rows"][1].get("plan_s") is None


def test_the_defaults_record_of_2026_12_06_reads_back():
    """The chip's run of the defaults (--attention auto taking the resident kernel on v5e): the CLI at batch 16
    with no flag but the batch size at 160k tok/s or more, the seed's step beside it, splash's losses within noise
    of the defaults', the resume bit for bit, the plan (compiled ahead) within 15% of the step; and the save stall
    it found is reported as a failed check, not hidden."""
    data = json.loads((REPO / "bench" / "tpu_records" / "v5e-2026-12-06-a.json").read_text())
    assert data["about"]["versions"] == {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"}
    built = report.build(data["about"], data["rows"], data.get("failed", {}))
    rows = {r["name"]: r for r in built["rows"]}
    assert rows["pretrain gpt2-124m, batch 16, defaults"]["tokens_per_s"] >= 160e3
    assert rows["ours, batch 16"]["note"].startswith("attention resident")
    assert built["summary"]["ours_over_seed_b16"] >= report.SPEEDUP_GOAL
    assert rows["pretrain gpt2-124m, batch 16, --attention splash"]["ok"]
    assert rows["pretrain 6 steps; stopped at 3, resumed"]["ok"]
    assert abs(built["summary"]["plan_errors"]["ours, batch 16"]["table"]) <= report.PLAN_TOLERANCE
    stall = next(r for r in built["rows"] if r["name"].startswith("checkpoint stall"))
    assert stall["ok"] is False and stall["figures"]["worst"] > 1 + 0.10


def test_the_26b_twin_and_the_experts_records_read_back_with_the_grouped_matmuls_own_rates():
    """gemma4-26b-a4b cut to 6 layers on one v5e chip (call k2), with its plan's work compiled ahead: the plan
    within 15% of the chip once the experts' grouped matmuls are priced at their own rate (they were priced as
    plain matmuls: -37%); and that rate is what the chip's kernel rows (calls k5, l, m and n) measured, by rows an
    expert."""
    from trainer.common import calibration
    data = json.loads((REPO / "bench" / "tpu_records" / "v5e-2026-12-06-k.json").read_text())
    built = report.build(data["about"], data["rows"], data.get("failed", {}))
    name = "gemma4-26b-a4b (6 layers) LoRA r8 all targets, 4 x 512"
    row, = (r for r in data["rows"] if r["name"] == name)
    work = row["figures"]["work"]
    assert work["grouped_matmul_flops"] > 0 and work["grouped_rows_per_expert"] == 128
    err = built["summary"]["plan_errors"][name]["table"]
    assert abs(err) <= report.PLAN_TOLERANCE, err
    measured = {}  # rows an expert -> FLOP/s of ragged_dot, from the chip's rows
    for rec in ("v5e-2026-12-06-k5.json", "v5e-2026-12-06-l.json", "v5e-2026-12-06-m.json", "v5e-2026-12-06-n.json"):
        for r in json.loads((REPO / "bench" / "tpu_records" / rec).read_text())["rows"]:
            if r["name"].startswith("experts' MLP, ragged_dot"):
                assert r["ok"], r["note"]
                measured[r["figures"]["routed"] // r["figures"]["experts"]] = r["figures"]["flops"] / r["step_s"]
    assert set(measured) == set(calibration.V5E.grouped_matmul_flops_s) == {128, 256, 512, 1024, 2048}
    for rows, rate in measured.items():
        assert abs(calibration.V5E.grouped_matmul_flops_s[rows] / rate - 1) < 0.01, (rows, rate)
        assert calibration.V5E.grouped_at(rows) == calibration.V5E.grouped_matmul_flops_s[rows]
    # between measured points along the log of the rows, the ends' rates outside them
    mid = calibration.V5E.grouped_at(362)  # about halfway from 256 to 512 on a log scale
    assert measured[256] < mid < measured[512] and abs(mid / ((measured[256] + measured[512]) / 2) - 1) < 0.02
    assert calibration.V5E.grouped_at(64) == calibration.V5E.grouped_matmul_flops_s[128]
    assert calibration.V5E.grouped_at(4096) == calibration.V5E.grouped_matmul_flops_s[2048]
