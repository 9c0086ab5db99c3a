"""`tpuctl jobs` and `tpuctl controller status|down`: managed jobs read from their bucket, from any machine
(orchestrator/jobs/managed.py). `run --detach`, `logs JOB` and `cancel JOB` live with their verbs in run_verbs."""
from __future__ import annotations

import json
import time

import click

from orchestrator.cli.options import errors as _errors
from orchestrator.cli.options import local_option, table


def _note(m: str) -> None:
    click.echo(f"[tpuctl] {m}", err=True)


def _buckets_option(f):
    return click.option("--bucket", "buckets", multiple=True, metavar="BUCKET",
                        help="The job bucket (repeatable; default: $TPUCTL_JOBS_BUCKET, else the buckets this "
                             "machine submitted to).")(f)


def _age(s: float) -> str:
    from orchestrator.slices import fmt_duration
    return fmt_duration(s)


@click.command("jobs")
@_buckets_option
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON.")
@local_option
@_errors
def jobs(buckets, as_json, local):
    """List managed jobs (`run --detach`): id, name, slice, state, step of total, recoveries, goodput, age, $ so far.

    \b
      tpuctl jobs --bucket BUCKET

    Read from the bucket, so it works from any machine. A live job whose controller is gone gets a new controller
    here, which picks the job up where it is (its trainers keep running meanwhile).
    """
    from orchestrator import provider
    from orchestrator.jobs import managed
    from orchestrator.jobs.store import cost_so_far
    prov = provider.chosen(local)
    rows = managed.jobs(managed.buckets(buckets), prov, say=_note)
    now = time.time()
    for r in rows:
        r["cost_usd"] = round(cost_so_far(r, now), 4)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no managed jobs: `tpuctl run NAME --detach -- ...` submits one")
        return
    click.echo(table(["ID", "NAME", "SLICE", "STATE", "STEP", "RECOVERIES", "GOODPUT", "AGE", "$ SO FAR"], [
        [r["id"], r["name"], r["slice"], r["state"],
         f"{r['step'] if r.get('step') is not None else '-'}/{r.get('total_steps') or '?'}", r.get("recoveries", 0),
         f"{r['goodput']['goodput']:.0%}" if r.get("goodput") else "-",
         _age(now - r["submitted"]), f"{r['cost_usd']:.2f}"] for r in rows]))
    for b in sorted({r["bucket"] for r in rows}):
        for c in managed.controller_status(b, prov):
            if c["alive"]:
                click.echo(f"controller {c['instance']}: up {_age(c['uptime_s'])}, {c['cost_usd']:.3f} $ so far "
                           f"({c['price_per_hour']:.4f} $/hour; it deletes itself after {c['idle_minutes']:g} idle "
                           "minutes)")


@click.group("controller")
def controller():
    """The managed-jobs controller: one small VM per project and region (docs/jobs.md)."""


@controller.command("status")
@_buckets_option
@click.option("--json", "as_json", is_flag=True, help="Print the controllers as JSON.")
@local_option
@_errors
def controller_status(buckets, as_json, local):
    """Each controller of the bucket: alive, its VM, live jobs, idle since, uptime and cost so far."""
    from orchestrator import provider
    from orchestrator.jobs import managed
    prov = provider.chosen(local)
    buckets = managed.buckets(buckets)
    rows = [c for b in buckets for c in managed.controller_status(b, prov)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no controller has served these buckets")
        return
    click.echo(table(["REGION", "INSTANCE", "VM", "ALIVE", "LIVE JOBS", "UP", "$/HOUR", "$ SO FAR"], [
        [c["region"], c["instance"], c["vm"], "yes" if c["alive"] else "no", len(c["live_jobs"]),
         _age(c["uptime_s"]) if c["alive"] else "-", f"{c['price_per_hour']:.4f}", f"{c['cost_usd']:.3f}"]
        for c in rows]))


@controller.command("down")
@_buckets_option
@click.option("--force", is_flag=True, help="Delete it even with live jobs (their trainers keep running; the next "
                                            "`tpuctl jobs` starts a controller again).")
@local_option
@_errors
def controller_down(buckets, force, local):
    """Delete the controller VM(s) of the bucket now, instead of waiting for them to idle out."""
    from orchestrator import provider
    from orchestrator.jobs import managed
    prov = provider.chosen(local)
    buckets = managed.buckets(buckets)
    gone = [g for b in buckets for g in managed.controller_down(b, prov, force=force, say=_note)]
    click.echo(f"deleted {', '.join(gone)}" if gone else "no controller VM to delete")
