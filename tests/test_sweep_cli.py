"""`tpuctl sweep` without a slice: its refusals, `sweep report DIR`, and how a failed trial's reason is read."""
from __future__ import annotations

import json

from _sweep_util import lr_sweep
from orchestrator.jobs import sweep
from orchestrator.cli.app import main


def test_sweep_refuses_a_missing_slice_and_anything_but_pretrain(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    assert main(["sweep", "nos", "--set", "n_layer=1,2", "--out", str(tmp_path / "sw"), "--", "pretrain"]) == 1
    assert "Error: no slice named nos in the local record" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()
    assert main(["sweep", "nos", "--set", "n_layer=1", "--out", str(tmp_path / "sw"), "--", "python", "x.py"]) == 1
    assert "a sweep runs the trainer's pretrain" in capsys.readouterr().err
    assert main(["sweep", "report"]) == 1
    assert "write `tpuctl sweep report DIR`" in capsys.readouterr().err


def test_sweep_report_prints_the_table_and_writes_the_page(tmp_path, capsys):
    root, names = lr_sweep(tmp_path / "lr")
    assert main(["sweep", "report", str(root)]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in names) and f"report: {root}/report/report.html" in out
    assert main(["sweep", "report", str(root), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["trial"] for r in rep["rows"]] == names and "text" not in rep


def test_a_failed_trial_is_described_by_its_host_and_the_trainers_error_line(tmp_path):
    (tmp_path / "w1.log").write_text("config: {}\nerror: --batch-size 6 is not divisible by the 4 processes\n")
    (tmp_path / "w0.log").write_text("step 1/4\n")
    res = {"run_dir": str(tmp_path), "exit_codes": {"0": 0, "1": 2}, "failed_worker": 1, "returncode": 2}
    assert sweep._reason(res) == "w1 exited 2: error: --batch-size 6 is not divisible by the 4 processes"
    res = {"run_dir": str(tmp_path), "exit_codes": {"0": -9, "1": None}, "failed_worker": None, "returncode": 1}
    assert sweep._reason(res) == "w0 exited -9: step 1/4"


def test_env_and_no_plan_are_handed_to_the_sweep_and_a_bad_env_is_refused(tmp_path, monkeypatch, capsys):
    """The command line's part; that --env reaches each trial's trainer is test_sweep_e2e's to show."""
    seen = {}

    def fake_sweep(name, grid_args, out, base, *, run_flags=None, **_):
        seen.update(name=name, run_flags=run_flags)
        return sweep.SweepResult(name, out)

    monkeypatch.setattr(sweep, "sweep", fake_sweep)
    argv = ["sweep", "s", "--set", "n_layer=1,2", "--out", str(tmp_path / "sw"), "--env", "A=1", "--env", "B=x=y",
            "--no-plan", "--", "pretrain"]
    assert main(argv) == 0
    assert seen == {"name": "s", "run_flags": ["--env", "A=1", "--env", "B=x=y", "--no-plan"]}
    seen.clear()
    assert main(["sweep", "s", "--set", "n_layer=1", "--out", str(tmp_path / "sw"), "--env", "NOVALUE", "--",
                 "pretrain"]) == 1
    assert "--env 'NOVALUE' is not K=V: write --env NAME=value" in capsys.readouterr().err and seen == {}
