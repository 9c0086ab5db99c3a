"""Reports from what runs leave in their --ckpt-dir (config.json, metrics.jsonl, trial.json): a results table,
the power-law fit (trainer/experiments/scaling.py), PNG charts (matplotlib) and one self-contained HTML page.

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
from trainer.experiments.scaling import PowerLaw, fit_power_law

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


def final_loss(r: dict) -> float | None:
    """The loss a trial is judged by: its best validation loss, else its last training loss."""
    return r["best_val_loss"] if r.get("best_val_loss") is not None else r.get("final_train_loss")


def frontier(rows: list[dict]) -> list[tuple[float, float]]:
    """(FLOPs, loss) of the best finished trial of each model size: what a scaling law in compute describes
    (the other axes of the sweep, such as the learning rate, are tuned away)."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["status"] == "done" and r.get("flops") and final_loss(r) is not None:
            if r["params"] not in best or final_loss(r) < final_loss(best[r["params"]]):
                best[r["params"]] = r
    return sorted((r["flops"], final_loss(r)) for r in best.values())


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


# --- charts ----------------------------------------------------------------------------------------

def _plt():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("charts need matplotlib: pip install 'tpuctl[report]' (make setup installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plain_log_ticks(ax) -> None:
    """Losses span less than a decade: label them 8.2, 8.4 (not 8.4x10^0); minor x labels only where the
    axis spans too little for major ones."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    if ax.get_yscale() == "log":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    lo, hi = ax.get_xlim()
    if ax.get_xscale() == "log" and lo > 0 and hi / lo > 30:  # major labels are enough
        ax.xaxis.set_minor_formatter(NullFormatter())


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def sweep_charts(rows: list[dict], runs: list[dict], axes: dict, fit: PowerLaw | None) -> dict[str, bytes]:
    """name -> PNG bytes."""
    from trainer.common.metrics import flops_per_token
    plt = _plt()
    charts = {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, run in zip(rows, runs):
        recs = sorted((m for m in run["metrics"] if isinstance(m.get("loss"), (int, float))), key=lambda m: m["step"])
        if not recs or run["config"] is None:
            continue
        c = run["config"]
        per_step = c.train.batch_size * c.model.seq_len * flops_per_token(c.model)
        steps = [m["step"] for m in recs]
        ax1.plot(steps, [m["loss"] for m in recs], label=r["trial"])
        ax2.plot([s * per_step for s in steps], [m["loss"] for m in recs], label=r["trial"])
    ax1.set(xlabel="step", ylabel="train loss", title="Loss against steps")
    ax2.set(xlabel="training FLOPs", ylabel="train loss", title="Loss against compute", xscale="log")
    _plain_log_ticks(ax2)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    charts["loss_curves"] = _png(fig)

    done = [r for r in rows if r.get("final_train_loss") is not None and r.get("params")]
    if done:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        loss = [final_loss(r) for r in done]
        ax1.scatter([r["params_non_embedding"] or r["params"] for r in done], loss)
        ax2.scatter([r["flops"] for r in done], loss)
        for r, l in zip(done, loss):
            ax1.annotate(r["trial"], (r["params_non_embedding"] or r["params"], l), fontsize=6)
        if fit is not None:
            import numpy as np
            xs = np.geomspace(min(r["flops"] for r in done), max(r["flops"] for r in done), 100)
            ax2.plot(xs, fit(xs), "r--", label=f"fit: {fit.a:.3g}·C^-{fit.b:.3g} + {fit.c:.3g}")
            ax2.legend(fontsize=8)
        ax1.set(xlabel="non-embedding parameters", ylabel="final loss (best val, else train)",
                title="Final loss against parameters", xscale="log", yscale="log")
        ax2.set(xlabel="training FLOPs", ylabel="final loss", title="Final loss against compute",
                xscale="log", yscale="log")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3, which="both")
            _plain_log_ticks(ax)
        charts["final_loss"] = _png(fig)

    if "lr" in axes and len(axes["lr"]) > 1 and done:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        by_size: dict[int, list] = {}
        for r, l in zip(done, loss):
            by_size.setdefault(r["params"], []).append((r["lr"], l))
        for size, pts in sorted(by_size.items()):
            pts.sort()
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{size:,} params")
            best = min(pts, key=lambda p: p[1])
            ax.plot([best[0]], [best[1]], "*", ms=16, color=line.get_color(), markeredgecolor="k")
        ax.set(xscale="log", xlabel="learning rate", ylabel="final loss", title="Loss against LR (★ best per size)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        charts["loss_vs_lr"] = _png(fig)
    return charts


def run_chart(run: dict) -> bytes:
    plt = _plt()
    recs = sorted(run["metrics"], key=lambda m: m.get("step", 0))
    fig, axs = plt.subplots(2, 2, figsize=(11, 7))
    steps = [m["step"] for m in recs]
    axs[0, 0].plot(steps, [m.get("loss") for m in recs], label="train")
    val = [(m["step"], m["val_loss"]) for m in recs if m.get("val_loss") is not None]
    if val:
        axs[0, 0].plot(*zip(*val), "o-", label="val")
    axs[0, 0].set(title="loss", xlabel="step")
    axs[0, 0].legend()
    axs[0, 1].plot(steps, [m.get("lr") for m in recs])
    axs[0, 1].set(title="learning rate", xlabel="step")
    axs[1, 0].plot(steps, [m.get("tokens_per_s") for m in recs])
    axs[1, 0].set(title="tokens/s (global)", xlabel="step")
    axs[1, 1].plot(steps, [m.get("grad_norm") for m in recs])
    axs[1, 1].set(title="gradient norm", xlabel="step")
    for ax in axs.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()  # the lower charts' titles clear the upper charts' axis labels
    return _png(fig)


def hosts_chart(records: list[dict], strag: dict | None) -> bytes | None:
    """Per-host step time and lateness (steptimes.straggler's) over the run (PNG), the straggler drawn thicker;
    None with records of fewer than 2 processes."""
    from trainer.common import steptimes
    from trainer.experiments.where_time_goes import host_step_times
    per_host = host_step_times(records)
    if len(per_host) < 2:  # one process: the run chart's tokens/s says it all
        return None
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    slow = strag["process"] if strag else None
    for p, xs in sorted(per_host.items()):
        label = f"process {p}" + (" (straggler)" if p == slow else "")
        ax1.plot([s for s, _ in xs], [t * 1e3 for _, t in xs], lw=2.5 if p == slow else 1, label=label)
    rows = sorted((r for r in records if r.get("hosts")), key=lambda r: r["step"])
    for p in sorted(per_host):
        pts = [(r["step"], max(lag, stall, 0.0)) for r in rows
               for q, (lag, stall) in enumerate(zip(steptimes.lags(r["hosts"]), steptimes.stalls(r["hosts"])))
               if q == p and lag is not None]
        ax2.plot([s for s, _ in pts], [v * 1e3 for _, v in pts], lw=2.5 if p == slow else 1, label=f"process {p}")
    ax1.set(title="step time per host (own clock)", xlabel="step", ylabel="ms")
    ax2.set(title="late beyond the other hosts (dispatch or stall)", xlabel="step", ylabel="ms")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


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
        fit, notes = None, []
        pts = frontier(rows)
        if len(pts) >= 4:
            try:
                fit = fit_power_law(*zip(*pts))
                notes.append("Fit over the best final loss of each model size against its training FLOPs: "
                             + fit.describe())
            except (RuntimeError, ValueError) as e:  # scipy's curve_fit gives up with RuntimeError
                notes.append(f"no power-law fit: {str(e).splitlines()[0]}")
        else:
            notes.append(f"no power-law fit: it needs finished trials of at least 4 model sizes, this sweep has "
                         f"{len(pts)}")
        failed = [f"{r['trial']}: {r['reason']}" for r in rows if r["status"] == "failed"]
        if failed:
            notes.append("failed: " + "; ".join(failed))
        pngs = sweep_charts(rows, runs, rec["axes"], fit) if charts else {}
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
    pngs = {"run": run_chart(run)} if charts and run["metrics"] else {}
    hosts_png = hosts_chart(run["metrics"], time_goes["straggler"]) if charts else None
    if hosts_png:
        pngs["hosts"] = hosts_png
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
