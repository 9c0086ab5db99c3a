"""`tpuctl report NAME`: the trainer's report of the latest run on slice NAME, made on this machine.

A run's record is `$TPUCTL_HOME/runs/NAME/<run id>/run.json` (written by `tpuctl run`: the command, hence its
--ckpt-dir) with goodput.json beside it once the run ended well. The report itself is the trainer's
(`python -m trainer report --ckpt-dir DIR --goodput FILE`, jax-free) run here; a local slice's gs:// is the GCS
emulator it used. It is written beside the run (`<ckpt-dir>/report`), or for a gs:// --ckpt-dir under
$TPUCTL_HOME/reports/NAME/<run id>/, where a browser on this machine opens it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from orchestrator.cli.options import errors
from orchestrator.spec import UserError
from orchestrator.state import home

GOODPUT = "goodput.json"


def ckpt_dir_of(argv: list[str]) -> str | None:
    """The --ckpt-dir of a trainer command line (`--ckpt-dir X` or `--ckpt-dir=X`), or None."""
    from orchestrator.jobs.launch import flag_value
    return flag_value(argv, "--ckpt-dir")


def find_run(name: str, run_id: str | None = None) -> tuple[Path, dict, str]:
    """(run dir, run.json, --ckpt-dir) of NAME's latest run that trained into a --ckpt-dir (or of run_id)."""
    base = home() / "runs" / name
    dirs = sorted((d for d in base.glob("*") if (d / "run.json").is_file()), reverse=True) if base.is_dir() else []
    if run_id:
        dirs = [d for d in dirs if d.name == run_id]
        if not dirs:
            raise UserError(f"no run {run_id} of {name} in {base}: `tpuctl report {name}` takes the latest")
    if not dirs:
        raise UserError(f"no runs of {name} yet (they are kept in {base}): "
                        f"`tpuctl run {name} -- pretrain ... --ckpt-dir DIR` first")
    for d in dirs:
        try:
            rec = json.loads((d / "run.json").read_text())
        except (OSError, ValueError):
            continue
        ckpt = ckpt_dir_of(rec.get("argv") or [])
        if ckpt:
            return d, rec, ckpt
    raise UserError(f"no run of {name} trained into a --ckpt-dir (the latest, {dirs[0].name}, ran "
                    f"`{' '.join(json.loads((dirs[0] / 'run.json').read_text()).get('argv') or [])[:200]}`)")


def _plan_file(name: str, rec: dict, plan: str, env: dict[str, str], say) -> str:
    """--plan FILE as it is; `auto`: the compiler's plan of the run's own command for its slice's accelerator
    (`tpuctl plan`, cached), written beside the run's record."""
    if plan != "auto":
        return plan
    from orchestrator import provider, state
    from orchestrator.plan import step as P
    slice_rec = state.lookup(name)
    argv = rec.get("argv") or []
    if slice_rec is None or argv[1:3] != ["-m", "trainer"]:
        raise UserError(f"--plan auto needs the slice {name} (its accelerator) and a trainer command; pass "
                        "--plan FILE (`tpuctl plan -a TYPE --json -- CMD ... > FILE`)")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the planner reads what the trainer would (the data's meta.json)
    try:
        p = P.plan(slice_rec.accelerator, argv[3:], cpu_devices=provider.of(slice_rec).cpu_devices, progress=say)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    path = home() / "runs" / name / "plan.json"
    path.write_text(json.dumps(p.to_json()))
    return str(path)


def report(name: str, run_id: str | None = None, out: str | None = None, plan: str | None = None,
           say=lambda m: print(f"[tpuctl] {m}", file=sys.stderr, flush=True)) -> dict:
    """Make the report of NAME's latest (or run_id's) run; the trainer's report result plus which run it was."""
    from orchestrator import provider, state
    from orchestrator.jobs import sweep
    run_dir, rec, ckpt = find_run(name, run_id)
    if "://" not in ckpt and not Path(ckpt).is_absolute():
        raise UserError(f"run {run_dir.name} of {name} wrote to --ckpt-dir {ckpt}, a path relative to each host's "
                        "home: this machine cannot read it; train into gs://BUCKET/PATH (or an absolute shared path)")
    slice_rec = state.lookup(name)
    # The run's storage as the slice's provider serves it to this machine. The slice may be gone: a run whose
    # environment pointed at the GCS emulator was a local one.
    where = (provider.of(slice_rec) if slice_rec else
             provider.chosen("STORAGE_EMULATOR_HOST" in (rec.get("env") or {})))
    env = sweep.here_env(where, ckpt)
    if not out:
        out = f"{ckpt.rstrip('/')}/report" if "://" not in ckpt else str(home() / "reports" / name / run_dir.name)
    args = ["report", "--json", "--ckpt-dir", ckpt, "--out", out]
    goodput = run_dir / GOODPUT
    if goodput.is_file():
        args += ["--goodput", str(goodput)]
    if plan:  # the compiler's expected step time beside the measured one, each named
        args += ["--plan", _plan_file(name, rec, plan, where.local_env(rec.get("argv") or []), say)]
    ended = "returncode" in rec
    say(f"report of {name}'s run {run_dir.name} (--ckpt-dir {ckpt}"
        + ("" if ended else "; still running or cut short: the report shows it so far") + ")")
    try:
        res = json.loads(sweep.run_trainer(args, env))
    except UserError as e:
        gone = "does not exist" in str(e) or "no config.json" in str(e)
        hint = (" (local mode: the GCS emulator keeps its buckets in memory, so a restarted emulator no longer "
                "has them)" if gone and where.kind == provider.LOCAL and ckpt.startswith("gs://") else "")
        raise UserError(f"{name}'s run {run_dir.name}: {e}{hint}") from None
    return {"name": name, "run_id": run_dir.name, "ckpt_dir": ckpt, "returncode": rec.get("returncode"), **res}


@click.command("report")
@click.argument("name")
@click.option("--run", "run_id", metavar="RUN_ID", help="A run id of NAME (`ls $TPUCTL_HOME/runs/NAME`); "
              "default: the latest run that trained into a --ckpt-dir.")
@click.option("--out", metavar="DIR", help="Where to write the report (default: <ckpt-dir>/report, or "
              "$TPUCTL_HOME/reports/NAME/<run id>/ for a gs:// --ckpt-dir).")
@click.option("--plan", metavar="FILE|auto", help="Put the compiler's expected step time beside the measured one: "
              "a `tpuctl plan --json` FILE, or auto (the run's own command planned for its slice, cached).")
@click.option("--json", "as_json", is_flag=True, help="Print the report's table, summary and files as JSON.")
@errors
def report_cmd(name, run_id, out, plan, as_json):
    """The report of the latest run on slice NAME, made on this machine from the run's --ckpt-dir.

    \b
      tpuctl report NAME                 after `tpuctl run NAME -- pretrain ... --ckpt-dir gs://B/run1`
      tpuctl report NAME --run RUN_ID    an earlier run (ids: `ls $TPUCTL_HOME/runs/NAME`)

    Writes report.html (self-contained), run.png (loss and validation loss, learning rate, tokens/s,
    gradient norm) and summary.json: the config, the mesh, the hosts, goodput (measured by `tpuctl run`) and
    the final sample (the last one `python -m trainer sample --ckpt-dir DIR` printed), and prints them.
    The slice need not exist any more: the run's record and its --ckpt-dir are enough.
    """
    res = report(name, run_id, out, plan)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(res["printed"])
