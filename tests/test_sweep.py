"""Sweeps on one machine (`python -m trainer sweep`), the results table, the power-law fit and the report files."""
from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from _sweep_util import BASE, fake_trial, lr_sweep
from _trainer_util import REPO, env, session_cache, shakespeare
from trainer.experiments import report
from trainer.experiments import scaling
from trainer.experiments import sweep
from trainer.cli import main
from trainer.common.config import PRESETS, ModelConfig



def _err(capsys) -> str:
    return capsys.readouterr().err.strip()


# --- bad input, before anything runs ------------------------------------------------------------------

def test_an_unknown_grid_key_is_named_before_anything_runs(capsys, tmp_path):
    out = tmp_path / "sw"
    assert main(["sweep", "--set", "n_layers=2,4", "--out", str(out), "--", *BASE]) == 2
    assert _err(capsys) == ("error: unknown grid key 'n_layers' (did you mean n_layer?): use a `pretrain` flag name "
                            "such as n_layer, d_model, lr, batch_size (`python -m trainer pretrain --help` lists them)")
    grid = tmp_path / "g.yaml"
    grid.write_text("d_model: [64, 128]\nwidth: [1]\n")
    assert main(["sweep", "--grid", str(grid), "--out", str(out), "--", *BASE]) == 2
    assert "unknown grid key 'width'" in _err(capsys)
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    ([], "the grid is empty: give --grid FILE or --set KEY=V1,V2"),
    (["--set", "n_layer="], "--set 'n_layer=': no values"),
    (["--grid", "EMPTY"], "the grid is empty"),
    (["--grid", "NOVALS"], "n_layer has no values"),
    (["--set", "n_layer=1,2", "--set", "lr=0.1", "--zip"], "--zip needs lists of one length: n_layer has 2, lr has 1"),
    (["--set", "n_layer=two"], "grid key n_layer: 'two' is not an integer"),
    (["--set", "lr=fast"], "grid key lr: 'fast' is not a number"),
    (["--set", "n_head=3"], "trial n_head-3: --d-model 128 is not divisible by --n-head 3"),
    (["--set", "ckpt_dir=a,b"], "the sweep sets --ckpt-dir per trial"),
])
def test_empty_or_bad_grids_are_refused(capsys, tmp_path, args, needle):
    (tmp_path / "EMPTY").write_text("# nothing\n")
    (tmp_path / "NOVALS").write_text("n_layer: []\n")
    args = [str(tmp_path / a) if a in ("EMPTY", "NOVALS") else a for a in args]
    assert main(["sweep", *args, "--out", str(tmp_path / "sw"), "--", *BASE]) == 2
    err = _err(capsys)
    assert err.startswith("error: ") and needle in err and "\n" not in err, err
    assert not (tmp_path / "sw").exists()


def test_the_base_command_is_checked(capsys, tmp_path):
    out = str(tmp_path / "sw")
    assert main(["sweep", "--set", "n_layer=1", "--out", out]) == 2
    assert "give the base command after --" in _err(capsys)
    assert main(["sweep", "--set", "n_layer=1", "--out", out, "--", *BASE, "--ckpt-dir", "x"]) == 2
    assert "the base command sets --ckpt-dir" in _err(capsys)
    assert main(["sweep", "--set", "n_layer=1", "--out", out, "--", *BASE, "--n-layer", "3"]) == 2
    assert "--n-layer is both a grid key and in the base command" in _err(capsys)


def test_a_dir_holding_another_sweep_or_other_files_is_refused(capsys, tmp_path):
    out = str(tmp_path / "sw")
    assert main(["sweep", "--plan", "--set", "n_layer=1,2", "--out", out, "--", *BASE]) == 0
    capsys.readouterr()
    # The same sweep again: a resume, accepted.
    assert main(["sweep", "--plan", "--set", "n_layer=1,2", "--out", out, "--", *BASE]) == 0
    capsys.readouterr()
    assert main(["sweep", "--plan", "--set", "n_layer=1,3", "--out", out, "--", *BASE]) == 2
    assert _err(capsys) == (f"error: --out {out} holds another sweep (trials n_layer-1, n_layer-2; base `pretrain "
                            "--preset gpt2-tiny --steps 4`): use another --out, or the same grid and base command "
                            "to resume it")
    assert main(["sweep", "--plan", "--set", "n_layer=1,2", "--out", out, "--", *BASE, "--lr", "0.1"]) == 2
    assert "holds another sweep" in _err(capsys)
    run = tmp_path / "a-run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert main(["sweep", "--plan", "--set", "n_layer=1", "--out", str(run), "--", *BASE]) == 2
    assert "is not empty and holds no sweep" in _err(capsys)


def test_plan_lists_grid_and_zip_trials_with_their_commands(capsys, tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("n_layer: [1, 2]\nlr: [0.001, 3e-3]\n")
    assert main(["sweep", "--plan", "--json", "--grid", str(grid), "--out", str(tmp_path / "g"), "--", *BASE]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in plan["trials"]] == ["n_layer-1_lr-0.001", "n_layer-1_lr-0.003",
                                                   "n_layer-2_lr-0.001", "n_layer-2_lr-0.003"]
    t = plan["trials"][3]
    assert t["argv"] == [*BASE, "--n-layer", "2", "--lr", "0.003", "--ckpt-dir", f"{tmp_path}/g/n_layer-2_lr-0.003"]
    assert t["status"] == "pending" and t["overrides"] == {"n_layer": 2, "lr": 0.003}
    assert main(["sweep", "--plan", "--json", "--grid", str(grid), "--zip", "--out", str(tmp_path / "z"), "--",
                 *BASE]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out)["trials"]] == ["n_layer-1_lr-0.001",
                                                                                    "n_layer-2_lr-0.003"]
    # What `tpuctl sweep` records for a trial it ran on a slice.
    assert main(["sweep", "--out", str(tmp_path / "z"), "--record", "n_layer-2_lr-0.003", "--status", "failed",
                 "--exit-code", "1", "--reason", "w1 exited 1"]) == 0
    assert sweep.status(f"{tmp_path}/z/n_layer-2_lr-0.003")["reason"] == "w1 exited 1"
    assert main(["sweep", "--out", str(tmp_path / "z"), "--record", "nope", "--status", "done"]) == 2


# --- counts, fit ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=32),
                               ModelConfig(n_layer=3, n_head=4, d_model=64, d_ff=96, seq_len=48, vocab_size=1000),
                               PRESETS["gpt2-124m"][0]])
def test_param_counts_match_the_model(m):
    import jax
    from flax import nnx
    from trainer.models import gpt2
    shapes = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(gpt2.GPT2(m, nnx.Rngs(0)), nnx.Param)))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    embeddings = shapes["wte"].shape[0] * m.d_model + shapes["wpe"].shape[0] * m.d_model
    assert report.param_counts(m) == (total, total - embeddings)


@pytest.mark.parametrize("use_scipy", [True, False])
def test_the_power_law_fit_recovers_known_parameters(use_scipy):
    a, b, c = 350.0, 0.12, 1.8
    rng = np.random.default_rng(0)
    C = np.geomspace(1e15, 1e22, 16)
    L = (a * C**-b + c) * (1 + 0.002 * rng.standard_normal(C.size))
    fit = scaling.fit_power_law(C, L, use_scipy=use_scipy)
    for got, want in ((fit.a, a), (fit.b, b), (fit.c, c)):
        assert abs(got - want) <= 0.05 * want, (fit, a, b, c)
    assert 0 < fit.b_err < 0.05 and 0 < fit.c_err < 0.1 and fit.a_err > 0  # the noise shows in the errors
    assert f"b = {fit.b:.4g} ± {fit.b_err:.2g}" in fit.describe()
    with pytest.raises(ValueError, match="at least 4"):
        scaling.fit_power_law(C[:3], L[:3])


def test_the_fit_takes_the_best_finished_trial_of_each_model_size():
    rows = [{"params": p, "flops": f, "status": st, "best_val_loss": l, "final_train_loss": l and l + 1}
            for p, f, st, l in [(10, 1e9, "done", 5.0), (10, 1e9, "done", 4.5), (20, 2e9, "failed", 1.0),
                                (20, 2e9, "done", 4.2), (30, 3e9, "done", None), (40, 4e9, "pending", 3.0)]]
    rows[4]["final_train_loss"] = 4.1  # no validation loss: judged by its last training loss
    assert report.frontier(rows) == [(1e9, 4.5), (2e9, 4.2), (3e9, 4.1)]


# --- the report of a sweep ------------------------------------------------------------------------------

def test_report_writes_table_charts_and_a_self_contained_html(tmp_path, capsys):
    root, names = lr_sweep(tmp_path / "lr")
    assert main(["report", "--ckpt-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "n_layer-1_lr-0.003" in out and "report.html" in out
    rep = root / "report"
    for f in ("results.csv", "results.md", "results.json", "loss_curves.png", "final_loss.png", "loss_vs_lr.png",
              "report.html"):
        assert (rep / f).stat().st_size > 0, f
        if f.endswith(".png"):
            assert (rep / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(io.StringIO((rep / "results.csv").read_text())))
    assert [r["trial"] for r in rows] == names
    total, non_emb = report.param_counts(dataclasses_replace_layers(2))
    assert rows[3]["params"] == str(total) and rows[3]["params_non_embedding"] == str(non_emb)
    assert rows[5]["status"] == "failed"
    r0 = rows[0]
    cfg = PRESETS["gpt2-tiny"]
    assert int(r0["tokens"]) == 30 * cfg[1].batch_size * cfg[0].seq_len
    assert float(r0["best_val_loss"]) == pytest.approx(6.0 - 0.5 + math.log10(3) + 0.1)
    assert float(r0["val_ppl"]) == pytest.approx(math.exp(float(r0["best_val_loss"])))
    assert float(r0["tokens_per_s"]) == 1001.5 and r0["mfu"] == "" and float(r0["wall_s"]) == 12.5
    md = (rep / "results.md").read_text()
    assert md.count("\n") == 2 + len(names) and "| n_layer-1_lr-0.001 | done |" in md
    page = (rep / "report.html").read_text()
    # Self-contained: the charts are data: URLs; the table's numbers are on the page.
    assert page.count('src="data:image/png;base64,') == 3 and "http://" not in page and "https://" not in page
    for r in rows:
        assert f"<td>{r['trial']}</td>" in page
        assert f"<td>{float(r['best_val_loss']):.4f}</td>" in page
    # Two model sizes: too few for a scaling law (the fit takes the best trial of each size).
    assert "no power-law fit: it needs finished trials of at least 4 model sizes, this sweep has 2" in page
    assert "failed: n_layer-2_lr-0.01: exit code 1: boom" in page

    assert main(["report", "--ckpt-dir", str(root), "--json", "--out", str(tmp_path / "elsewhere")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kind"] == "sweep" and len(res["rows"]) == 6 and res["fit"] is None
    assert (tmp_path / "elsewhere" / "report.html").exists()


# --- the final-loss chart: the fit as a line, labels that do not collide ------------------------------

# The demo's sweep (docs/demo.md): three widths of one layer, 40 steps of 64 x 64 tokens; its report's rows.
DEMO_ROWS = [{"trial": f"d_model-{d}", "status": "done", "params": p, "params_non_embedding": ne, "flops": f,
              "best_val_loss": l, "final_train_loss": t}
             for d, p, ne, f, l, t in [(32, 145_888, 12_768, 1.4496e11, 6.9166, 6.8962),
                                       (64, 316_352, 50_112, 3.1407e11, 6.6532, 6.6185),
                                       (128, 731_008, 198_528, 7.2478e11, 6.5545, 6.5337)]]


def _live(fig):
    """A figure the report already saved and closed gets a canvas to draw on again."""
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    return fig


def _boxes(fig, texts):
    r = fig.canvas.get_renderer()
    return [t.get_window_extent(r) for t in texts if t.get_visible() and t.get_text()]


def _no_overlaps(fig):
    """Every axis of every panel has at least 2 tick labels, none touching another (minor ones included)."""
    _live(fig).canvas.draw()
    for ax in fig.axes:
        for labels in (ax.get_xticklabels() + ax.get_xticklabels(minor=True),
                       ax.get_yticklabels() + ax.get_yticklabels(minor=True)):
            boxes = _boxes(fig, labels)
            assert len(boxes) >= 2, [t.get_text() for t in labels]
            for i, a in enumerate(boxes):
                for b in boxes[i + 1:]:
                    assert not a.overlaps(b), ([t.get_text() for t in labels], a, b)


def _labels_beside_points(fig):
    """Each trial's name is drawn next to its own point: over no point (a marker is 6 pt wide), over no other
    name, and nearer its own point than any other."""
    import math
    from matplotlib.transforms import Bbox
    from trainer.experiments import charts
    _live(fig).canvas.draw()
    n = 0
    for ax in fig.axes:
        labels = [t for t in ax.texts if t.get_gid() == charts.POINT_LABEL_GID]
        pts = ax.transData.transform([t.xy for t in labels])
        r = 3 * fig.dpi / 72
        marks = [Bbox.from_extents(x - r, y - r, x + r, y + r) for x, y in pts]
        boxes = [t.get_window_extent() for t in labels]
        for i, (t, box) in enumerate(zip(labels, boxes)):
            assert not any(box.overlaps(m) for m in marks), t.get_text()
            assert not any(box.overlaps(b) for j, b in enumerate(boxes) if j != i), t.get_text()
            dist = [math.hypot(max(box.x0 - x, 0, x - box.x1), max(box.y0 - y, 0, y - box.y1)) for x, y in pts]
            assert min(range(len(pts)), key=dist.__getitem__) == i, (t.get_text(), dist)
        n += len(labels)
    return n


def test_the_final_loss_chart_draws_the_fit_with_its_exponent_and_uncertainty():
    from trainer.experiments import charts
    C = np.geomspace(1e15, 1e19, 6)
    L = (350.0 * C**-0.12 + 1.8) * (1 + 0.002 * np.random.default_rng(1).standard_normal(C.size))
    rows = [{"trial": f"size-{i}", "status": "done", "params": 10**6 * (i + 1), "params_non_embedding": 10**6 * i + 5,
             "flops": c, "best_val_loss": l, "final_train_loss": l} for i, (c, l) in enumerate(zip(C, L))]
    fit = scaling.fit_power_law(*zip(*report.frontier(rows)))
    assert fit.b == pytest.approx(0.12, rel=0.1) and 0 < fit.b_err < 0.05
    fig = charts.final_loss_figure(rows, fit)
    params_ax, compute_ax = fig.axes
    (line,) = [ln for ln in compute_ax.lines if ln.get_gid() == charts.FIT_GID]
    x, y = line.get_data()
    assert x.min() == pytest.approx(C.min()) and x.max() == pytest.approx(C.max())
    np.testing.assert_allclose(y, fit.a * x**-fit.b + fit.c, rtol=1e-9)
    label = line.get_label()
    assert f"$b$ = {scaling.plus_minus(fit.b, fit.b_err)}" in label and "C^{-b}" in label
    assert label in [t.get_text() for t in compute_ax.get_legend().get_texts()]
    assert not [t for t in compute_ax.texts if t.get_gid() == charts.NO_FIT_GID]
    assert _labels_beside_points(fig) == 2 * len(rows)
    _no_overlaps(fig)
    assert scaling.plus_minus(0.05234, 0.0041) == "0.0523 ± 0.0041" and scaling.plus_minus(6.2, 0.13) == "6.20 ± 0.13"


def test_three_sizes_are_too_few_for_the_fit_the_chart_says_so_and_draws_no_curve(monkeypatch, tmp_path):
    """The demo's sweep: 3 model sizes for a law of 3 parameters. Through the report's own path (its notes and the
    figure it drew), and the axes that once read "3×10⁴4×10⁴"."""
    from trainer.experiments import charts
    figs = []
    real = charts.final_loss_figure
    monkeypatch.setattr(charts, "final_loss_figure", lambda *a, **k: figs.append(real(*a, **k)) or figs[-1])
    root, _ = lr_sweep(tmp_path / "lr")  # two sizes
    res = report.report(str(root))
    assert res["fit"] is None
    (note,) = [n for n in res["notes"] if n.startswith("no power-law fit")]
    (fig,) = figs
    compute_ax = fig.axes[1]
    assert not [ln for ln in compute_ax.lines if ln.get_gid() == charts.FIT_GID] and compute_ax.get_legend() is None
    (text,) = [t for t in compute_ax.texts if t.get_gid() == charts.NO_FIT_GID]
    assert " ".join(text.get_text().split()) == note and "at least 4 model sizes, this sweep has 2" in note
    assert _labels_beside_points(fig) == 2 * 6  # two trials of each size a few pixels apart among them
    _no_overlaps(fig)

    demo = real(DEMO_ROWS, None, "no power-law fit: it needs finished trials of at least 4 model sizes, this "
                                 "sweep has 3")
    assert [t.get_text() for t in demo.axes[1].texts if t.get_gid() == charts.NO_FIT_GID]
    assert not [ln for ax in demo.axes for ln in ax.lines if ln.get_gid() == charts.FIT_GID]
    assert _labels_beside_points(demo) == 6
    _no_overlaps(demo)
    assert charts.tick_text(3e4) == r"$3\times10^{4}$" and charts.tick_text(1e11) == "$10^{11}$"
    assert charts.tick_text(6.6) == "6.6"


def dataclasses_replace_layers(n):
    import dataclasses
    return dataclasses.replace(PRESETS["gpt2-tiny"][0], n_layer=n)


def test_report_of_a_single_run_and_of_nothing(tmp_path, capsys):
    fake_trial(tmp_path, "run", 1, 0.003, [9.0, 8.0])
    assert main(["report", "--ckpt-dir", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report" / "run.png").stat().st_size > 0
    page = (tmp_path / "run" / "report" / "report.html").read_text()
    assert "<h2>config</h2>" in page and "n_layer=1" in page
    capsys.readouterr()
    assert main(["report", "--ckpt-dir", str(tmp_path / "nothing")]) == 2
    assert "--ckpt-dir " + str(tmp_path / "nothing") + " does not exist" in _err(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["report", "--ckpt-dir", str(tmp_path / "empty")]) == 2
    assert "no config.json or metrics.jsonl there" in _err(capsys)


# --- a real sweep on this machine ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_local_sweep_records_a_failed_trial_goes_on_and_skips_finished_trials(tmp_path_factory, tmp_path):
    """Two trials: one trains, one fails at load (a context longer than the validation split); the failure is
    recorded with the trainer's own error line and the sweep still ends with its summary; a rerun skips the
    finished trial and tries the failed one again."""
    corpus = shakespeare(tmp_path_factory)
    out = tmp_path / "sw"
    argv = [sys.executable, "-m", "trainer", "sweep", "--set", "seq_len=32,200000", "--out", str(out), "--",
            "pretrain", "--data", corpus, "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--batch-size", "8", "--steps", "2",
            "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0"]
    e = env(session_cache(tmp_path_factory), devices=1)
    p = subprocess.run(argv, cwd=REPO, env=e, capture_output=True, text=True, timeout=400)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[seq_len-32] done: step 2" in p.stdout
    assert sweep.status(f"{out}/seq_len-32")["status"] == "done"
    failed = sweep.status(f"{out}/seq_len-200000")
    assert failed["status"] == "failed" and failed["exit_code"] == 2
    assert failed["reason"].startswith("exit code 2: the val split of ") and "--seq-len 200000" in failed["reason"]
    assert f"1/2 trial(s) done\n  failed: seq_len-200000: {failed['reason']}" in p.stdout

    again = subprocess.run(argv, cwd=REPO, env=e, capture_output=True, text=True, timeout=400)
    assert again.returncode == 1
    assert "2 trial(s), 1 done, 1 to run" in again.stdout and "[seq_len-32]" not in again.stdout
