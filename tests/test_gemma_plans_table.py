"""docs/gemma.md's plan tables (bench/compiler/gemma_plans.py --table) from plans' JSON, no compile: the model
sweep takes the default command's row for model=1, the newest plan of a mesh planned twice, and orders each size's
meshes by model; a plan compiled at one row a device says its largest batch is at least that row."""
from __future__ import annotations

from bench.compiler import gemma_plans as gp

GIB = 2 ** 30


def _row(size, acc, mesh="", total=10.0, extra="", rows=4, fits=True):
    cmd = " ".join(gp.command(acc, size, extra.split() if extra else [], mesh))
    return {"size": size, "accelerator": acc, "sweep_mesh": mesh, "fits": fits, "command": cmd,
            "hbm_bytes_per_device": 16 * GIB, "headroom_bytes": int((16 - total) * GIB),
            "per_device": {"total_bytes": total * GIB, "params_bytes": 5 * GIB, "temp_bytes": (total - 5) * GIB},
            "timing": {"step_s": 0.5, "bound": "memory", "roofline_step_s": 0.6, "compute_s": 0.2},
            "largest_batch": {"rows_per_device": rows, "compiled_rows_per_device": rows},
            "wall_s": 100.0, "cpu_s": 150.0, "load_before": 1.0, "load_after": 1.2}


def test_the_sweep_takes_model_1_from_the_default_row_and_a_one_row_plan_is_a_lower_bound():
    rows = [_row("gemma4-26b-a4b", "v5litepod-8", "data=1,model=8", 11.3),
            _row("gemma4-26b-a4b", "v5litepod-8", "data=4,model=2", 12.5),  # planned again below: replaced
            _row("gemma4-26b-a4b", "v5litepod-8", "data=4,model=2", 10.9),
            _row("gemma4-26b-a4b", "v5litepod-8", total=10.88),
            _row("gemma4-31b", "v5litepod-8", total=13.12, extra="--batch-size 8", rows=1)]
    text = gp.table(rows)
    sweep = [line for line in text.splitlines() if line.startswith("| gemma4-26b-a4b | v5litepod-8 | data")]
    assert [line.split(" | ")[2] for line in sweep] == [
        "data=8,model=1 (the default command's row)", "data=4,model=2", "data=1,model=8"], sweep
    assert "10.88 GiB" in sweep[0] and "10.90 GiB" in sweep[1] and "11.30 GiB" in sweep[2]
    one, = (line for line in text.splitlines() if line.startswith("| gemma4-31b (1 row a device)"))
    assert "largest batch: at least 1 row a device (one row compiled; plan two to extrapolate)" in one
    assert "largest batch 4 rows a device" in text  # the 26B default row's, compiled at that batch (older record)
    # a plan's rows are a device's, a data group's or the step's (its `per`): at data=1 the step's
    step = {**_row("gemma4-e2b", "v4-8", extra="--mesh data=1,model=4"),
            "largest_batch": {"rows": 12, "per": "step", "compiled_rows": 16}}
    assert "largest batch 12 rows a step (extrapolated, not compiled)" in gp.table([step])
    # a sweep's own model=1 row gives way to a newer default-command row, and stays where it is the newer
    older = [_row("gemma4-31b", "v5litepod-8", "data=8,model=1", 15.08), _row("gemma4-31b", "v5litepod-8", total=13.1),
             _row("gemma4-e4b", "v5litepod-8", total=5.7), _row("gemma4-e4b", "v5litepod-8", "data=8,model=1", 5.45)]
    lines = [line for line in gp.table(older).splitlines() if "data=8,model=1" in line]
    e4b, big = lines  # the sizes in gemma_plans.SIZES' order
    assert "13.10 GiB" in big and "the default command's row" in big, lines
    assert "5.45 GiB" in e4b and "the default command's row" not in e4b, lines
    # a plan answered from a record of its program (trainer/common/program_counts.py) says its time was no compile's
    read = {**_row("gemma4-e2b", "v4-8"), "counted_earlier": {"where": "tpuctl", "recorded": "2026-12-07"}}
    assert "planned in 100 s (150 CPU s, load 1.0-1.2), its figures read from tpuctl's record of the program " \
           "(compiled 2026-12-07)" in gp.table([read])
    assert "read from" not in gp.table([_row("gemma4-e2b", "v4-8")])


def test_a_sweep_plans_model_1_first_against_its_own_cache_and_records_the_cold_command(tmp_path):
    """Each slice's meshes from model=1 up (a model > 1 plan's data-only step is then in the sweep's cache); a row
    runs without --no-cache with TPUCTL_HOME the sweep's, and records the command a user runs (with --no-cache)."""
    assert gp.jobs(["gemma4-e2b"], ["v4-8", "v5litepod-8"], True, [1, 2, 4]) == [
        ("gemma4-e2b", "v4-8", "data=4,model=1"), ("gemma4-e2b", "v4-8", "data=2,model=2"),
        ("gemma4-e2b", "v4-8", "data=1,model=4"), ("gemma4-e2b", "v5litepod-8", "data=8,model=1"),
        ("gemma4-e2b", "v5litepod-8", "data=4,model=2"), ("gemma4-e2b", "v5litepod-8", "data=2,model=4")]
    assert gp.jobs(["gemma4-e2b"], ["v4-8"], False) == [("gemma4-e2b", "v4-8", "")]
    # a mesh of model >= 4 is compared with the one before it (half the model), model=2 with data alone (the plan's
    # default): each doubling of `model` that holds more is explained by its own plan's `mesh:` note
    assert gp.command("v4-8", "gemma4-e2b", [], "data=1,model=4")[5:9] == ["--no-cache", "--compare-mesh",
                                                                           "data=2,model=2", "--"]
    assert "--compare-mesh" not in gp.command("v4-8", "gemma4-e2b", [], "data=2,model=2")
    assert "--compare-mesh" not in gp.command("v4-8", "gemma4-e2b", [])
    grew = {"op_name": "jit(_train_step)/transpose(jvp())/checkpoint/cbtr,crf->cbtf/dot_general",
            "shape": "bf16[2,2560,16,1,512]", "bytes": 80 * 2 ** 20, "other_bytes": None,
            "source": "trainer/models/lora.py:204 (apply)"}
    noted = {**_row("gemma4-e2b", "v4-8", "data=1,model=4"),
             "mesh_check": {"compared_mesh": "data=2,model=2", "more_bytes": 99 * 2 ** 20, "grown": [grew]}}
    less = {**_row("gemma4-e2b", "v4-8", "data=2,model=2"),
            "mesh_check": {"data_only_mesh": "data=4,model=1", "more_bytes": -52 * 2 ** 20, "grown": []}}
    lines = [x for x in gp.table([noted, less]).splitlines() if x.startswith("| gemma4-e2b | v4-8 | data=")]
    assert lines[0].endswith("| -52 MiB against data=4,model=1 |"), lines  # an older record's name of the mesh
    assert lines[1].endswith("| +99 MiB against data=2,model=2; grew most: cbtr,crf->cbtf/dot_general "
                             "bf16[2,2560,16,1,512] 80 MiB (new) at trainer/models/lora.py:204 (apply) |"), lines
    # a real process standing in for tpuctl: it prints, as the plan's JSON, the cache it was given and its arguments
    echo = ["sh", "-c", 'printf \'{"home": "%s", "args": "%s"}\' "$TPUCTL_HOME" "$*"', "sh", "--no-cache", "--json"]
    row = gp.plan_one(echo, cache_home=str(tmp_path))
    assert row["home"] == str(tmp_path) and row["args"] == "--json", row
    assert "--no-cache" in row["command"] and "--no-cache" not in row["ran"], row
    cold = gp.plan_one(echo)
    assert cold["args"] == "--no-cache --json" and "ran" not in cold, cold


def test_a_row_planned_when_beside_was_the_default_says_so_until_planned_again():
    """Rows from before `--lora-impl stacked` was the default carry `--lora-impl beside` in their command and cell;
    a row planned since (the plain command) replaces the one of the same size, flags, slice and mesh."""
    before = [gp.planned_beside(r) for r in (
        _row("gemma4-e2b", "v4-8", total=11.7), _row("gemma4-e2b", "v5litepod-8", total=10.1),
        _row("gemma4-e2b", "v4-8", "data=2,model=2", 12.19), _row("gemma4-e2b", "v4-8", "data=1,model=4", 4.92))]
    assert before[0]["command"].endswith("--lora-impl beside") and gp.lora_impl(before[0]) == "beside"
    assert gp.planned_beside(before[0]) == before[0]  # said once
    now = [_row("gemma4-e2b", "v4-8", total=11.5), _row("gemma4-e2b", "v4-8", "data=2,model=2", 11.0)]
    text = gp.table(before + now)
    # one line of the default table: --lora-impl is not a flag of the row's label
    e2b, = (line for line in text.split("\n\n")[0].splitlines() if line.startswith("| gemma4-e2b |"))
    v5, v4 = e2b.split(" | ")[1:3]
    assert "10.10 of 16" in v5 and "planned with `--lora-impl beside`, the default before" in v5, v5
    assert "11.50 of 16" in v4 and "beside" not in v4, v4
    sweep = {line.split(" | ")[2]: line for line in text.splitlines() if line.startswith("| gemma4-e2b | v4-8 | data")}
    assert "11.50 GiB" in sweep["data=4,model=1 (the default command's row)"]
    assert "11.00 GiB" in sweep["data=2,model=2"] and "beside" not in sweep["data=2,model=2"]
    assert "4.92 GiB" in sweep["data=1,model=4"] and "`--lora-impl beside`" in sweep["data=1,model=4"]
