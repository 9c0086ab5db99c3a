"""Reports from what runs leave in their --ckpt-dir (config.json, metrics.jsonl, trial.json): a results table,
the power-law fit (trainer/experiments/scaling.py), PNG charts (trainer/experiments/charts.py) and one
self-contained HTML page.

`python -m trainer report --ckpt-dir DIR`: DIR holding sweep.json is a sweep (one row per trial), any other
DIR is one run. Jax-free: it reads files, local or gs://.
"""
from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import statistics

from trainer.common.config import Config, UsageError
from trainer.experiments import charts as charts_lib
from trainer.experiments.scaling import LAW, MIN_POINTS, PARAMETERS, fit_power_law, final_loss, frontier

__all__ = ["final_loss", "frontier"]  # the fit's own (trainer/experiments/scaling.py), read here too

COLUMNS = ["trial", "status", "params", "params_non_embedding", "tokens", "flops", "final_train_loss",
           "best_val_loss", "val_ppl", "tokens_per_s", "mfu", "wall_s"]


# --- counts ----------------------------------------------------------------------------------------

def param_counts(m) -> tuple[int, int]:
    """(total, non-embedding) parameters of trainer/models/gpt2.py for a ModelConfig, without building it.
    Non-embedding leaves out the token table (tied with the output layer) and the position table."""
    d, f = m.d_model, m.ff
    per_layer = 4 * d * d + 2 * d * f + 9 * d + f  # 2 LayerNorms, qkv + out (with biases), MLP (with biases)
    non_embedding = m.n_layer * per_layer + 2 * d  # + the final LayerNorm
    return non_embedding + m.padded_vocab * d + m.seq_len * d, non_embedding


# --- reading runs ----------------------------------------------------------------------------------

def _read(path) -> str | None:
    return path.read_text() if path.exists() else None


def read_run(run_dir: str) -> dict:
    """config, metrics records and trial status of one run dir."""
    from etils import epath
    d = epath.Path(run_dir)
    cfg_text = _read(d / "config.json")
    lines = (_read(d / "metrics.jsonl") or "").splitlines()
    recs = []
    for ln in lines:
        try:
            recs.append(json.loads(ln))
        except ValueError:
            continue
    trial = _read(d / "trial.json")
    try:
        cfg = Config.from_dict(json.loads(cfg_text)) if cfg_text else None
    except (KeyError, TypeError, AttributeError):  # not a pretrain config (a `lora` run's): charts only
        cfg = None
    return {"dir": run_dir, "config": cfg, "metrics": recs, "trial": json.loads(trial) if trial else None}


def row(name: str, run: dict) -> dict:
    """One table row: sizes from the config, the rest from metrics.jsonl (the last record per step wins)."""
    from trainer.common.metrics import flops_per_token, perplexity
    cfg, trial = run["config"], run["trial"] or {}
    by_step = {r["step"]: r for r in run["metrics"] if isinstance(r.get("step"), int)}
    recs = [by_step[s] for s in sorted(by_step)]
    out = {c: None for c in COLUMNS}
    out.update(trial=name, status=trial.get("status") or ("pending" if not recs else "unfinished"),
               reason=trial.get("reason") or "", wall_s=trial.get("wall_s"))
    if cfg is not None:
        out["params"], out["params_non_embedding"] = param_counts(cfg.model)
        for k, v in {**_flat(cfg)}.items():
            out.setdefault(k, v)
    if recs and cfg is not None:
        last = recs[-1]
        tokens = last["step"] * cfg.train.batch_size * cfg.model.seq_len
        out.update(tokens=tokens, flops=tokens * flops_per_token(cfg.model), final_train_loss=last.get("loss"))
        if trial.get("status") not in ("done", "failed", "interrupted") and last["step"] >= cfg.train.steps:
            out["status"] = "done"
        vals = [r["val_loss"] for r in recs if isinstance(r.get("val_loss"), (int, float))]
        if vals:
            out["best_val_loss"] = min(vals)
            out["val_ppl"] = perplexity(min(vals))
        # The first logged step includes warm-up effects: the median over the rest (all of them if one).
        tps = [r["tokens_per_s"] for r in recs[1:] or recs if r.get("tokens_per_s")]
        out["tokens_per_s"] = statistics.median(tps) if tps else None
        mfu = [r["mfu"] for r in recs[1:] or recs if r.get("mfu") is not None]
        out["mfu"] = statistics.median(mfu) if mfu else None
    return out


def _flat(cfg: Config) -> dict:
    import dataclasses
    return {**dataclasses.asdict(cfg.model), **dataclasses.asdict(cfg.train)}


def sweep_rows(sweep_dir: str) -> tuple[dict, list[dict], list[dict]]:
    """(sweep record, rows, runs) of a sweep dir, in the sweep's trial order."""
    from trainer.experiments import sweep
    rec = sweep.load(sweep_dir)
    if rec is None:
        raise UsageError(f"{sweep_dir} holds no {sweep.SWEEP_JSON}: not a sweep dir")
    runs = [read_run(f"{sweep_dir.rstrip('/')}/{name}") for name in rec["trials"]]
    rows = [row(name, r) for name, r in zip(rec["trials"], runs)]
    for r in rows:
        r["axes"] = {k: r.get(k) for k in rec["axes"]}
    return rec, rows, runs


# --- formats ---------------------------------------------------------------------------------------

def _cell(col: str, v) -> str:
    if v is None:
        return "-"
    if col in ("params", "params_non_embedding", "tokens"):
        return f"{v:,}"
    if col == "flops":
        return f"{v:.3g}"
    if col in ("final_train_loss", "best_val_loss"):
        return f"{v:.4f}"
    if col == "val_ppl":
        return f"{v:,.2f}"
    if col == "tokens_per_s":
        return f"{v:,.0f}"
    if col == "mfu":
        return f"{100 * v:.1f}%"
    if col == "wall_s":
        return f"{v:.1f}"
    return str(v)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r[c] for c in COLUMNS])
    return buf.getvalue()


def to_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cell(c, r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_text(rows: list[dict]) -> str:
    cells = [COLUMNS] + [[_cell(c, r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


# --- the HTML page ----------------------------------------------------------------------------------

def html_page(title: str, rows: list[dict], charts: dict[str, bytes], notes: list[str],
              sections: dict[str, str] | None = None) -> str:
    """One file: the table, `sections` (title -> preformatted text) and the charts embedded as data: URLs
    (nothing to fetch, no script)."""
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{esc(_cell(c, r.get(c)))}</td>" for c in COLUMNS) + "</tr>" for r in rows)
    imgs = "".join(f'<figure><img alt="{esc(k)}" src="data:image/png;base64,{base64.b64encode(v).decode()}">'
                   f"<figcaption>{esc(k)}</figcaption></figure>" for k, v in charts.items())
    note = "".join(f"<p>{esc(n)}</p>" for n in notes)
    secs = "".join(f'<h2>{esc(k)}</h2><pre class="summary">{esc(v)}</pre>' for k, v in (sections or {}).items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, td:nth-child(2) {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
pre.summary {{ white-space: pre-wrap; background: #f8f8f8; padding: 0.6em; }}
</style></head>
<body><h1>{esc(title)}</h1>{note}
<table id="results"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{secs}{imgs}
</body></html>
"""


# --- the command -----------------------------------------------------------------------------------

def write(out_dir: str, files: dict[str, bytes | str]) -> list[str]:
    from etils import epath
    d = epath.Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, content in files.items():
        p = d / name
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        paths.append(str(p))
    return paths


def report(ckpt_dir: str, out_dir: str | None = None, charts: bool = True, goodput: str | None = None,
           plan: str | None = None) -> dict:
    """Write the report of a sweep or a single run; returns what was written and the table (and for a run,
    its summary: trainer/experiments/report.py `summary`; goodput: a goodput.json of `tpuctl run` for it)."""
    from trainer.experiments import sweep
    ckpt_dir = ckpt_dir.rstrip("/")
    out_dir = out_dir or f"{ckpt_dir}/report"
    if sweep.load(ckpt_dir) is not None:
        if goodput or plan:
            raise UsageError(f"--{'goodput' if goodput else 'plan'} applies to one run's --ckpt-dir; {ckpt_dir} is a "
                             "sweep dir")
        rec, rows, runs = sweep_rows(ckpt_dir)
        fit, no_fit, notes = None, None, []
        pts = frontier(rows)
        if len(pts) >= MIN_POINTS:
            try:
                fit = fit_power_law(*zip(*pts))
                notes.append("Fit over the best final loss of each model size against its training FLOPs: "
                             + fit.describe())
            except (RuntimeError, ValueError) as e:  # scipy's curve_fit gives up with RuntimeError
                no_fit = f"no power-law fit: {str(e).splitlines()[0]}"
        else:
            no_fit = (f"no power-law fit: it needs finished trials of at least {MIN_POINTS} model sizes, this sweep "
                      f"has {len(pts)} ({LAW} has {PARAMETERS} parameters: a curve of it passes through "
                      f"any {PARAMETERS} points)")
        notes += [no_fit] if no_fit else []
        failed = [f"{r['trial']}: {r['reason']}" for r in rows if r["status"] == "failed"]
        if failed:
            notes.append("failed: " + "; ".join(failed))
        pngs = charts_lib.sweep_charts(rows, runs, rec["axes"], fit, no_fit) if charts else {}
        files = {"results.csv": to_csv(rows), "results.md": to_markdown(rows),
                 "results.json": json.dumps(_json_rows(rows), indent=1) + "\n",
                 **{f"{k}.png": v for k, v in pngs.items()}}
        title = f"Sweep {ckpt_dir}"
        files["report.html"] = html_page(title, rows, pngs, notes)
        written = write(out_dir, files)
        res = {"kind": "sweep", "dir": ckpt_dir, "rows": _json_rows(rows), "notes": notes,
               "fit": None if fit is None else fit.__dict__, "files": written,
               "html": f"{out_dir}/report.html", "text": to_text(rows)}
        return {**res, "printed": printed(res)}
    run = read_run(ckpt_dir)
    if run["config"] is None and not run["metrics"]:
        from etils import epath
        if not epath.Path(ckpt_dir).exists():
            raise UsageError(f"--ckpt-dir {ckpt_dir} does not exist (deleted, or never written)")
        raise UsageError(f"--ckpt-dir {ckpt_dir}: no config.json or metrics.jsonl there (not a run or sweep dir)")
    r = row(ckpt_dir.rsplit("/", 1)[-1], run)
    facts = run_facts(ckpt_dir, goodput)
    sections = summary(run, r, facts)
    from trainer.experiments import where_time_goes
    time_goes = where_time_goes.section(ckpt_dir, run["metrics"], where_time_goes.read_plan(plan))
    sections["where the time goes"] = time_goes["text"]
    pngs = {"run": charts_lib.run_chart(run)} if charts and run["metrics"] else {}
    hosts_png = charts_lib.hosts_chart(run["metrics"], time_goes["straggler"]) if charts else None
    if hosts_png:
        pngs["hosts"] = hosts_png
    chips_png = charts_lib.chips_chart(run["metrics"]) if charts else None
    if chips_png:
        pngs["chips"] = chips_png
    files = {"results.json": json.dumps(_json_rows([r]), indent=1) + "\n",
             "summary.json": json.dumps({**facts, "summary": sections, "profiles": time_goes["windows"],
                                         "straggler": time_goes["straggler"]}, indent=1) + "\n",
             **{f"{k}.png": v for k, v in pngs.items()}}
    files["report.html"] = html_page(f"Run {ckpt_dir}", [r], pngs, [], sections)
    written = write(out_dir, files)
    res = {"kind": "run", "dir": ckpt_dir, "rows": _json_rows([r]), "notes": [], "fit": None, **facts,
           "profiles": time_goes["windows"], "straggler": time_goes["straggler"], "summary": sections, "files": written, "html": f"{out_dir}/report.html", "text": to_text([r])}
    return {**res, "printed": printed(res)}


# --- one run's summary ---------------------------------------------------------------------------------

def run_facts(ckpt_dir: str, goodput: str | None = None) -> dict:
    """What the trainer recorded beside the run (run_info.json: mesh, devices, hosts; the last line of
    samples.jsonl) and, from `goodput` (a goodput.json as `tpuctl run` writes it, local or gs://), where the
    run's wall time went. Missing parts are None."""
    from etils import epath
    d = epath.Path(ckpt_dir)
    info = _read(d / "run_info.json")
    samples = [ln for ln in (_read(d / "samples.jsonl") or "").splitlines() if ln.strip()]
    g = None
    if goodput:
        p = epath.Path(goodput)
        if not p.exists():
            raise UsageError(f"--goodput {goodput} does not exist (`tpuctl run` writes goodput.json beside the "
                             "run's logs, $TPUCTL_HOME/runs/NAME/<run id>/)")
        g = json.loads(p.read_text())
        g = g.get("goodput", g)
    return {"run_info": json.loads(info) if info else None, "sample": json.loads(samples[-1]) if samples else None,
            "goodput": g}


def summary(run: dict, r: dict, facts: dict) -> dict[str, str]:
    """Section title -> text: the config, the mesh, the hosts, goodput, the final sample, the results."""
    cfg, info, g, smp = run["config"], facts["run_info"], facts["goodput"], facts["sample"]
    out = {}
    if cfg is not None:
        import dataclasses
        out["config"] = "\n".join([f"preset {cfg.preset}"] + [
            f"{part}: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(getattr(cfg, part)).items())
            for part in ("model", "train")])
    if info:
        mesh = ",".join(f"{k}={v}" for k, v in info["mesh"].items())
        out["mesh"] = (f"{mesh} over {info['devices']} {info['device_kind']} device(s); dtype {info['dtype']}; "
                       f"vocab-parallel {'on' if info.get('vocab_parallel') else 'off'}")
        out["hosts"] = f"{info['processes']} process(es): " + ", ".join(
            f"{i}: {h}" for i, h in enumerate(info["hosts"]))
        if info.get("started_at_step"):
            out["hosts"] += f" (this start resumed from step {info['started_at_step']})"
    else:
        out["mesh"] = out["hosts"] = "not recorded (the trainer writes run_info.json into --ckpt-dir at each start)"
    if g:
        out["goodput"] = (f"{g['goodput']:.1%} of {g['wall_s']:.0f} s wall went to kept steps "
                          f"({g['productive_s']:.0f} s); first step after {g['time_to_first_step_s']:.0f} s; "
                          f"{g['restarts']} restart(s), {g['lost_to_preemptions_s']:.0f} s lost to preemptions")
    else:
        out["goodput"] = ("not known here: `tpuctl run` measures it; `tpuctl report NAME` includes it "
                          "(or --goodput $TPUCTL_HOME/runs/NAME/<run id>/goodput.json)")
    out["results"] = (f"final train loss {_cell('final_train_loss', r.get('final_train_loss'))}, best val loss "
                      f"{_cell('best_val_loss', r.get('best_val_loss'))} (perplexity {_cell('val_ppl', r.get('val_ppl'))}), "
                      f"{_cell('tokens', r.get('tokens'))} tokens at {_cell('tokens_per_s', r.get('tokens_per_s'))} tokens/s")
    if smp:
        opts = ", ".join(f"{k} {smp[k]}" for k in ("temperature", "top_k", "seed") if k in smp)
        out["final sample"] = f"step {smp.get('step')}, prompt {smp.get('prompt')!r}, {opts}:\n{smp.get('text', '')}"
    else:
        out["final sample"] = "none recorded: `python -m trainer sample --ckpt-dir DIR` records each sample it prints"
    return out


def printed(res: dict) -> str:
    """What `python -m trainer report` prints (and `tpuctl report`, from the JSON): the table, the notes, a
    run's summary, where the files are."""
    lines = [res["text"], *res["notes"]]
    lines += [f"{title}: " + text.replace("\n", "\n  ") for title, text in (res.get("summary") or {}).items()]
    return "\n".join(lines + [f"report: {res['html']}", f"files: {', '.join(res['files'])}"])


def _json_rows(rows: list[dict]) -> list[dict]:
    keep = COLUMNS + ["reason", "axes"]
    return [{k: (None if isinstance(r.get(k), float) and not math.isfinite(r[k]) else r.get(k)) for k in keep}
            for r in rows]
