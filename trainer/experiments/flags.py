"""The command line of the experiments: `sweep` (a grid of pretrain trials) and `report` (a run's or a sweep's
table, charts and HTML page). Neither imports jax."""
from __future__ import annotations

import json

from trainer.common.config import UsageError
from trainer.experiments import report, sweep


def add_parsers(sub) -> None:
    """`sweep` and `report` subcommands of `python -m trainer`."""
    sw = sub.add_parser("sweep", help="run a grid of pretrain trials, one after another, each resumable",
                        description="Run every point of a grid (or zip) of config values with a base `pretrain` "
                                    "command, one trial after another, each in DIR/<trial> (its --ckpt-dir). A "
                                    "finished trial is skipped; an unfinished one resumes from its checkpoint; a "
                                    "failed one is recorded and the sweep goes on.",
                        epilog="example: python -m trainer sweep --set n_layer=2,4 --set d_model=128,256 "
                               "--out runs/depth -- pretrain --preset gpt2-tiny --steps 200")
    sw.add_argument("--grid", metavar="FILE", help="YAML mapping of flag name -> list of values (n_layer: [2, 4])")
    sw.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=V1,V2",
                    help="one axis of the grid (repeatable); adds to --grid")
    sw.add_argument("--zip", action="store_true", help="pair the i-th values of every axis instead of all combinations")
    sw.add_argument("--out", required=True, metavar="DIR", help="the sweep's dir, local or gs://")
    sw.add_argument("--json", action="store_true", help="print the trials (with --plan) or the summary as JSON")
    sw.add_argument("--plan", action="store_true",
                    help="check everything, claim DIR and print the trials with their state; run nothing")
    sw.add_argument("--record", metavar="TRIAL", help="record how TRIAL's run ended (used by `tpuctl sweep`)")
    sw.add_argument("--status", choices=("done", "failed", "interrupted"), help="with --record")
    sw.add_argument("--exit-code", type=int, default=None, help="with --record")
    sw.add_argument("--reason", default="", help="with --record")
    sw.add_argument("--wall-s", type=float, default=None, help="with --record")
    sw.add_argument("base", nargs="*", metavar="-- pretrain ...", help="the base command, after --")

    rp = sub.add_parser("report", help="table, charts and an HTML page of a run or a sweep",
                        description="Write the results table (CSV, Markdown, JSON), PNG charts and one "
                                    "self-contained report.html for a sweep dir (it holds sweep.json) or a run's "
                                    "--ckpt-dir, and print the table. A run's report also charts loss, validation "
                                    "loss, LR and tokens/s, and summarises its config, mesh, hosts, goodput and "
                                    "final sample (summary.json).")
    rp.add_argument("--ckpt-dir", required=True, help="a sweep's --out or a run's --ckpt-dir (local or gs://)")
    rp.add_argument("--out", default=None, help="where to write the report (default: <ckpt-dir>/report)")
    rp.add_argument("--json", action="store_true", help="print the table and the fit as JSON")
    rp.add_argument("--goodput", default=None, metavar="FILE",
                    help="a run's goodput.json as `tpuctl run` writes it ($TPUCTL_HOME/runs/NAME/<run id>/; "
                         "`tpuctl report NAME` passes it)")
    rp.add_argument("--plan", default=None, metavar="FILE",
                    help="a `tpuctl plan --json` of the run's command: its expected step time is shown beside the "
                         "measured one")


def command(args) -> int:
    if args.cmd == "report":
        res = report.report(args.ckpt_dir, args.out, goodput=args.goodput, plan=args.plan)
        print(json.dumps(res) if args.json else res["printed"])
        return 0
    if args.record:
        if args.status is None:
            raise UsageError("--record TRIAL needs --status done|failed|interrupted")
        rec = sweep.load(args.out)
        if rec is None or args.record not in rec["trials"]:
            raise UsageError(f"--record {args.record}: not a trial of the sweep in {args.out}")
        sweep.record(f"{args.out.rstrip('/')}/{args.record}", args.status, args.exit_code, args.reason, args.wall_s)
        return 0
    axes = sweep.load_grid(args.grid) if args.grid else {}
    for k, v in sweep.parse_sets(args.sets).items():
        axes[k] = axes.get(k, []) + v
    sw = sweep.plan(axes, "zip" if args.zip else "grid", args.out, args.base)
    if args.plan:
        sweep.claim(sw)
        trials = [{"name": t.name, "overrides": t.overrides, "argv": t.argv, "ckpt_dir": t.ckpt_dir,
                   "status": sweep.status(t.ckpt_dir).get("status")} for t in sw.trials]
        if args.json:
            print(json.dumps({"out": sw.out, "mode": sw.mode, "axes": sw.axes, "trials": trials}))
        else:
            for t in trials:
                print(f"{t['name']:<40} {t['status']:<12} {' '.join(t['argv'])}")
        return 0
    return sweep.run_local(sw)
