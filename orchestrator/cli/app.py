"""The `tpuctl` command: a thin click layer over the orchestrator's Python API (orchestrator/slices.py)."""
from __future__ import annotations

import json
import signal
import sys
import threading

import click

from orchestrator.cli.options import StatusLine
from orchestrator.cli.options import api_options as _api_options
from orchestrator.cli.options import PassThrough
from orchestrator.cli.options import errors as _errors
from orchestrator.cli.options import json_option as _json_option
from orchestrator.spec import UserError


from orchestrator.cli.options import table as _table


def _age(s: float) -> str:
    from orchestrator.slices import fmt_duration
    return fmt_duration(s)


def _workers_table(workers) -> str:
    if any(w.slice is not None for w in workers):  # multislice: each slice's workers, slice by slice
        return _table(["SLICE", "WORKER", "INTERNAL IP", "EXTERNAL IP"],
                      [[w.slice, w.index, w.internal_ip, w.external_ip or "-"] for w in workers])
    return _table(["WORKER", "INTERNAL IP", "EXTERNAL IP"],
                  [[w.index, w.internal_ip, w.external_ip or "-"] for w in workers])


def _worker_json(w) -> dict:
    d = {"index": w.index, "internal_ip": w.internal_ip, "external_ip": w.external_ip}
    return d if w.slice is None else {**d, "slice": w.slice}


def _status_json(st) -> dict:
    d = st.to_json()
    d["workers"] = [_worker_json(w) for w in st.workers]
    return d


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="tpuctl")
def cli():
    """Take a JAX training job to a Cloud TPU slice and back.

    \b
      tpuctl up NAME --accelerator v4-16 --zone us-central2-b   create a slice
      tpuctl run NAME -- pretrain --preset gpt2-124m ...         run the trainer on every host
      tpuctl report NAME                                         charts and summary of NAME's latest run
      tpuctl down NAME                                           delete everything it created

    Add --local to any verb to use the local stand-ins (no cloud account needed).
    The local record of what was created lives in $TPUCTL_HOME (default ~/.tpuctl).
    """


# ---- up --------------------------------------------------------------------------------------------------

@cli.command("up")
@click.argument("name", required=False)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("-a", "--accelerator", metavar="TYPE",
              help="Accelerator type, e.g. v4-16, v5litepod-16 (alias v5e-16), v5p-8, v6e-4. Checked against the "
                   "catalog, then against the API's acceleratorTypes listing for the zone.")
@click.option("-z", "--zone", metavar="ZONE", help="Zone to create in, e.g. us-central2-b. Default with --local: "
                                                     "the catalog's first zone for the accelerator.")
@click.option("--zones", metavar="A,B,C", help="Zones to try in order: on a stockout the next one is tried.")
@click.option("--spot", is_flag=True, default=None, help="Spot capacity: cheaper, can be preempted at any time.")
@click.option("--reserved", is_flag=True, default=None,
              help="Consume reserved capacity (the node's schedulingConfig.reserved): the project's reservation "
                   "that matches the accelerator and zone.")
@click.option("--reservation", metavar="NAME", help="Consume this reservation (a name in the zone, or "
                                                    "projects/P/locations/Z/reservations/NAME); implies --reserved. "
                                                    "Needs a queued resource.")
@click.option("--no-external-ips", is_flag=True, default=None,
              help="Workers get internal IPs only (for org policies that forbid external IPs); the subnetwork "
                   "needs Private Google Access, and `run` must reach the VPC.")
@click.option("--ssh-proxy-command", metavar="CMD",
              help="Reach the workers through CMD from now on (recorded with the slice; OpenSSH ProxyCommand: %h %p "
                   "are the worker's address and port, %r the user). See docs/access.md.")
@click.option("--iap", is_flag=True, default=None,
              help="Reach the workers through Cloud IAP TCP forwarding (gcloud compute start-iap-tunnel), recorded "
                   "with the slice. See docs/access.md.")
@click.option("--network", metavar="NET", help="VPC network for the workers (default: the project's `default`).")
@click.option("--subnetwork", metavar="SUBNET", help="Subnetwork for the workers (default: the network's own in "
                                                      "the zone's region).")
@click.option("--service-account", metavar="EMAIL",
              help="The VMs' identity. Default: the project's default compute service account.")
@click.option("--scopes", metavar="S[,S]", help="OAuth scopes for the VMs' service account, full URLs or short names "
                                                "(default: cloud-platform, sent explicitly so the hosts can write "
                                                "checkpoints to GCS).")
@click.option("--runtime-version", metavar="V", help="TPU VM software version. Default per generation "
                                                      "(v4: tpu-ubuntu2204-base, v5e: v2-alpha-tpuv5-lite, ...).")
@click.option("--labels", multiple=True, metavar="K=V[,K=V]", help="Extra labels (repeatable). tpuctl always adds "
                                                                  "tpuctl-name, tpuctl-owner and tpuctl-expiry.")
@click.option("--ttl", metavar="DURATION", help="Expiry (e.g. 8h, 2d) written to the tpuctl-expiry label; "
                                                 "`tpuctl gc` deletes expired slices. Default: none.")
@click.option("--no-queue", is_flag=True, default=None, help="Create a plain node instead of a queued resource.")
@click.option("--num-slices", type=int, default=None, metavar="N",
              help="Multislice: N identical slices (v4 and later) joined by the data-center network, created as one "
                   "queued resource (nodes NAME-0 .. NAME-(N-1), all or none); `run` runs one job over all of them. "
                   "Default 1.")
@click.option("--wait-capacity", is_flag=True, default=None,
              help="On a stockout keep the queued resource waiting for capacity (up to --timeout; after that it "
                   "stays queued and recorded) instead of giving up on the zone.")
@click.option("--capacity-wait", metavar="DURATION",
              help="Without --wait-capacity: how long a queued resource may wait for capacity in one zone before "
                   "tpuctl deletes it and tries the next zone (default 10m).")
@click.option("--timeout", metavar="DURATION", help="Total time to wait for READY (default 30m). On timeout the "
                                                     "slice is deleted (or kept with --keep-on-failure).")
@click.option("--keep-on-failure", is_flag=True, default=None,
              help="On timeout or Ctrl-C keep what was created (recorded, so `tpuctl down NAME` finds it) instead "
                   "of deleting it.")
@click.option("--spec", "spec_file", metavar="FILE", type=click.Path(dir_okay=False),
              help="Read the slice spec from a YAML/TOML file (keys: name, accelerator, zone/zones, project, spot, "
                   "reserved, reservation, runtime_version, labels, ttl, queued, wait_capacity, capacity_wait, "
                   "timeout, external_ips, network, subnetwork, service_account, scopes, metadata, "
                   "ssh_proxy_command, iap); "
                   "flags given on the command line win.")
@click.option("--dry-run", is_flag=True, help="Validate (also against the API) and print the plan; create nothing.")
@click.option("--fresh-vm", is_flag=True, default=None,
              help="With --local: shape the hosts like fresh TPU VMs: their own homes, the system's python3, no uv "
                   "and no shared wheelhouse, so `run` bootstraps each from the package index as on real VMs "
                   "(slower: every host downloads the dependencies).")
@click.option("--plan", "plan_run", is_flag=True,
              help="With the run's trainer command after -- (`--plan -- pretrain ...`): compile its train step for "
                   "the accelerator first (`tpuctl plan`) and create nothing if it does not fit.")
@_json_option
@_api_options
@_errors
def up_cmd(name, command, accelerator, zone, zones, spot, reserved, reservation, no_external_ips, ssh_proxy_command,
           iap, network, subnetwork,
           service_account, scopes, runtime_version, labels, ttl, no_queue, wait_capacity, capacity_wait, timeout,
           keep_on_failure, spec_file, dry_run, fresh_vm, plan_run, as_json, api_endpoint, local, project, num_slices):
    """Create a TPU slice (queued resource) and wait until it is READY.

    Validates everything first, prints the plan (chips, hosts, topology, HBM, list $/hour), creates, waits
    with a live status line, and prints each worker's index, internal and external IP. A failure after the
    create call never leaves an orphan: it is deleted, or kept in the local record for `tpuctl down`.
    """
    from orchestrator import provider as _provider, slices
    from orchestrator.spec import SliceSpec, load_slice_spec

    spec = (load_slice_spec(spec_file) if spec_file else SliceSpec(name="", accelerator="")).with_flags(
        name=name, accelerator=accelerator, zone=zone, zones=zones, spot=spot, reserved=reserved,
        wait_capacity=wait_capacity, keep_on_failure=keep_on_failure, no_queue=no_queue,
        no_external_ips=no_external_ips, reservation=reservation, network=network, subnetwork=subnetwork,
        service_account=service_account, scopes=scopes, runtime_version=runtime_version, labels=labels, ttl=ttl,
        capacity_wait=capacity_wait, timeout=timeout, project=project, api_endpoint=api_endpoint,
        provider=_provider.LOCAL if local else None, fresh_vm=fresh_vm, ssh_proxy_command=ssh_proxy_command, iap=iap,
        num_slices=num_slices)

    line = StatusLine()
    if plan_run or command:
        _plan_first(spec, list(command), plan_run, line)

    def on_plan(plan):
        line.note(("plan: " if not dry_run else "plan (dry run): ") + plan.summary())

    # `kill` while waiting cleans up like Ctrl-C does (only where a handler can be set: the main thread).
    hook = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if hook:
        signal.signal(signal.SIGTERM, _sigterm)
    try:
        with line:
            res = slices.up(spec, progress=line, on_plan=on_plan, dry_run=dry_run)
    finally:
        if hook:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rec = res.record
    if as_json:
        out = {"name": rec.name, "state": "PLANNED" if dry_run else "READY", "project": rec.project,
               "zone": rec.zone, "accelerator": rec.accelerator, "node": rec.node,
               "queued_resource": rec.queued_resource, "price_per_hour": rec.price_per_hour, "labels": rec.labels,
               "workers": [_worker_json(w) for w in rec.workers], "slices": rec.slices, "nodes": rec.nodes,
               "attempts": [a.__dict__ for a in res.attempts], "elapsed_s": round(res.elapsed_s, 2),
               "plan": res.plan.__dict__}
        click.echo(json.dumps(out, indent=2))
        return
    if dry_run:
        click.echo(f"dry run: {rec.name} would be created in {', '.join(res.plan.zones)}; nothing was created")
        return
    n = len(rec.workers)
    what = rec.accelerator if rec.slices == 1 else f"{rec.slices} slices of {rec.accelerator}"
    click.echo(f"{rec.name} is READY in {rec.zone} ({what}, {n} worker{'' if n == 1 else 's'}) after "
               f"{_age(res.elapsed_s)}; ${rec.price_per_hour:.2f}/hour list price")
    click.echo(_workers_table(rec.workers))
    click.echo(f"next: tpuctl run {rec.name} -- ...    delete: tpuctl down {rec.name}")


def _plan_first(spec, command: list[str], plan_run: bool, line: StatusLine) -> None:
    """`up --plan -- ARGS`: nobody creates a slice for a train step that cannot fit on it."""
    from orchestrator.plan import step as plan
    if not plan_run:
        raise UserError(f"arguments after NAME ({' '.join(command)}) are the run's command, read only with --plan: "
                        "`tpuctl up NAME -a TYPE --plan -- pretrain ...`")
    if not command:
        raise UserError("--plan needs the run's trainer command after --: `tpuctl up NAME -a TYPE --plan -- "
                        "pretrain --preset gpt2-124m --ckpt-dir gs://BUCKET/run`")
    with line:
        from orchestrator import provider
        p = plan.gate(spec.accelerator, command, cpu_devices=provider.get(spec.provider).cpu_devices,
                      num_slices=spec.num_slices or 1, progress=line, skip_flag="leaving out --plan",
                      on_skip=lambda why: line.note(f"plan: {why}"))
    if p:
        line.note(f"plan: {p.verdict()}")


def _sigterm(signum, frame):
    raise KeyboardInterrupt


# ---- down ------------------------------------------------------------------------------------------------

@cli.command("down")
@click.argument("name", required=False)
@click.option("--all", "all_", is_flag=True, help="Delete every slice in the local record (with --local: only "
                                                  "local-mode ones). Asks first unless --yes.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("-z", "--zone", metavar="ZONE", help="For a name not in the local record: look for it in this zone.")
@click.option("--no-wait", is_flag=True, help="Start the deletion and return without waiting until it is gone.")
@click.option("--force", is_flag=True, help="Delete a slice even while a managed job runs on it (the job then "
                                            "fails; `tpuctl cancel JOB --down` ends both cleanly).")
@_json_option
@_api_options
@_errors
def down_cmd(name, all_, yes, zone, no_wait, force, as_json, api_endpoint, local, project):
    """Delete a slice: its queued resource (force) and its node. Idempotent.

    Works in any state (READY, FAILED, SUSPENDED, PREEMPTED, still waiting). A second `down`, or a name
    that exists nowhere, says there is nothing to delete and exits 0.
    """
    from orchestrator import provider, slices
    if bool(name) == bool(all_):
        raise UserError("give a NAME or --all: `tpuctl down NAME` (or `tpuctl down --all --yes`)")
    if not force:
        from orchestrator import state
        from orchestrator.jobs import managed
        for n in ([name] if name else list(state.records())):
            if live := managed.live_jobs_on(n):
                ids = ", ".join(j["id"] for j in live)
                raise UserError(f"{n} runs managed job {ids} ({live[0]['state']}): `tpuctl cancel {live[0]['id']} "
                                f"--down` stops it and deletes the slice; `tpuctl down {n} --force` deletes it anyway")
    line = StatusLine(quiet=as_json)
    with line:
        if all_:
            from orchestrator import state
            names = [n for n, r in state.records().items() if not local or r.provider == "local"]
            if not names:
                results = []
            else:
                if not yes:
                    if not sys.stdin.isatty():
                        raise UserError(f"--all would delete {len(names)} slice(s) ({', '.join(names)}): "
                                        "pass --yes to confirm")
                    click.confirm(f"delete {len(names)} slice(s): {', '.join(names)}?", abort=True, err=True)
                results = [slices.down(n, api_endpoint=api_endpoint, wait=not no_wait, progress=line)
                           for n in names]
        else:
            results = [slices.down(name, where=provider.chosen(local), project=project, zone=zone,
                                   api_endpoint=api_endpoint, wait=not no_wait, progress=line)]
    if as_json:
        click.echo(json.dumps([r.__dict__ for r in results], indent=2))
        return
    if not results:
        click.echo("nothing to delete: the local record is empty")
    for r in results:
        click.echo(r.message)


# ---- status / ls -----------------------------------------------------------------------------------------

@cli.command("status")
@click.argument("name")
@click.option("-z", "--zone", metavar="ZONE", help="For a name not in the local record: look for it in this zone.")
@_json_option
@_api_options
@_errors
def status_cmd(name, zone, as_json, api_endpoint, local, project):
    """Show one slice: state, health, accelerator, workers (index, internal/external IP), age, $/hour, cost."""
    from orchestrator import slices
    from orchestrator import provider
    st = slices.refresh(name, where=provider.chosen(local), project=project, zone=zone, api_endpoint=api_endpoint)
    last = _last_goodput(name)
    if as_json:
        click.echo(json.dumps({**_status_json(st), "last_run": last}, indent=2))
        return
    click.echo(_table(["NAME", "STATE", "HEALTH", "ACCELERATOR", "ZONE", "WORKERS", "AGE", "$/HOUR", "COST"],
                      [_ls_row(st)]))
    if st.queued_resource:
        click.echo(f"queued resource: {st.queued_resource} ({st.queued_state or 'gone'})")
    if st.slices > 1:
        for d in st.nodes:
            click.echo(f"slice {d['slice']}: node {d['node']} {d['state']}" + (f" {d['health']}" if d['health'] else "")
                       + f", {d['workers']} worker(s)")
    else:
        click.echo(f"node: {st.node}")
    if st.error:
        click.echo(f"note: could not read the live state: {st.error}")
    if st.state == "GONE":
        click.echo(f"note: {name} no longer exists in the cloud; `tpuctl down {name}` drops it from the local record")
    if st.note:
        click.echo(f"note: {st.note}")
    if st.workers:
        click.echo(_workers_table(st.workers))
    if last:
        g = last["goodput"]
        click.echo(f"last run {last['run_id']}: goodput {g['goodput']:.1%} ({g['productive_s']:.0f} s of steps kept in "
                   f"{g['wall_s']:.0f} s; first step after {g['time_to_first_step_s']:.0f} s; "
                   f"{g['restarts']} restart(s), {g['lost_to_preemptions_s']:.0f} s lost to preemptions)")


def _last_goodput(name: str) -> dict | None:
    """The goodput of NAME's latest supervised run (`run` writes it beside the run's logs), or None."""
    from orchestrator.state import home
    runs = sorted((home() / "runs" / name).glob("*/goodput.json"))
    try:
        return json.loads(runs[-1].read_text()) if runs else None
    except (OSError, ValueError):
        return None


def _ls_row(st) -> list:
    return [st.name, st.state + (f" (QR {st.queued_state}: holds quota)" if st.holds_quota else ""), st.health or "-", st.accelerator, st.zone + (" (local)" if st.provider == "local" else ""),
            f"{len(st.workers)}/{st.hosts}" + (f" ({st.slices} slices)" if st.slices > 1 else ""), _age(st.age_s), f"{st.price_per_hour:.2f}", f"{st.cost_so_far:.2f}"]


@cli.command("ls")
@_json_option
@click.option("--local", is_flag=True, default=False, help="Only local-mode slices.")
@click.option("--cloud", is_flag=True, default=False, help="Only slices in the cloud (not local mode).")
@click.option("--api-endpoint", metavar="URL", help="Refresh cloud slices through this endpoint instead of the one "
                                                    "each was created with.")
@_errors
def ls_cmd(as_json, local, cloud, api_endpoint):
    """List the slices in the local record, refreshed from the API: state, health, accelerator, workers,
    age, $/hour and cost so far (list price x age, an estimate)."""
    from orchestrator import slices
    if local and cloud:
        raise UserError("--local and --cloud exclude each other; drop one (or both to see everything)")
    rows = slices.ls(kind="local" if local else ("gcp" if cloud else None), api_endpoint=api_endpoint)
    if as_json:
        click.echo(json.dumps([_status_json(s) for s in rows], indent=2))
        return
    if not rows:
        click.echo("no slices in the local record (create one with `tpuctl up NAME --accelerator ... --zone ...`)")
        return
    click.echo(_table(["NAME", "STATE", "HEALTH", "ACCELERATOR", "ZONE", "WORKERS", "AGE", "$/HOUR", "COST"],
                      [_ls_row(s) for s in rows]))
    for s in rows:
        if s.error:
            click.echo(f"note: {s.name}: {s.error}")
        if s.holds_quota:
            click.echo(f"note: {s.name}: its queued resource is {s.queued_state} and holds quota until it is deleted: "
                       f"`tpuctl down {s.name}` (or `tpuctl gc --yes`)")


# ---- gc --------------------------------------------------------------------------------------------------

@cli.command("gc")
@click.option("-y", "--yes", is_flag=True, help="Delete what was found (default: only list it).")
@click.option("--zones", metavar="A,B,C", help="Zones to scan. Default: the zones in the local record plus every "
                                               "zone in the catalog.")
@_json_option
@_api_options
@_errors
def gc_cmd(yes, zones, as_json, api_endpoint, local, project):
    """Find tpuctl's leftovers: resources whose tpuctl-expiry label has passed, resources of yours (tpuctl-owner)
    that the local record no longer lists, FAILED or SUSPENDED queued resources (recorded or not: they hold quota
    until deleted), and records whose resources are gone. Lists them; --yes deletes."""
    from orchestrator import slices
    from orchestrator.spec import split_zones
    line = StatusLine(quiet=True)
    with line:
        from orchestrator import provider
        res = slices.gc(where=provider.chosen(local), yes=yes, project=project,
                        zones=split_zones([zones]) if zones else None, api_endpoint=api_endpoint)
    if as_json:
        click.echo(json.dumps({"items": [i.__dict__ for i in res.items], "zones": res.zones,
                               "skipped_zones": res.skipped_zones, "applied": res.applied}, indent=2))
        return
    if not res.items:
        click.echo(f"nothing to collect in {len(res.zones)} zone(s)")
    else:
        click.echo(_table(["KIND", "NAME", "ZONE", "REASON", "DONE"],
                          [[i.kind, i.name, i.zone, i.reason, ("deleted" if i.deleted else (i.error or "-"))]
                           for i in res.items]))
        if not yes:
            click.echo(f"{len(res.items)} item(s) found; run `tpuctl gc --yes` to delete them")
    for z, why in res.skipped_zones.items():
        click.echo(f"note: skipped {z}: {why}", err=True)


# ---- check -----------------------------------------------------------------------------------------------

@cli.command("check")
@click.argument("name", required=False)
@click.option("-z", "--zone", metavar="ZONE", help="The zone you will create in (the TPU API is asked there).")
@click.option("-a", "--accelerator", metavar="TYPE", help="Also check that the zone offers this accelerator.")
@click.option("--bucket", metavar="gs://B[/PREFIX]", help="The checkpoint bucket: checked writable by you "
                                                         "(one small object written and deleted).")
@click.option("--ssh-key", metavar="PATH", help="The key pair new VMs get (default ~/.ssh/google_compute_engine, "
                                                "env TPUCTL_SSH_KEY); made if missing.")
@_json_option
@_api_options
@_errors
def check_cmd(name, zone, accelerator, bucket, ssh_key, as_json, api_endpoint, local, project):
    """Check what a first run needs, one line each (✔ / ✘ and the fix); exit 1 if anything is ✘.

    \b
      tpuctl check --zone us-central2-b -a v4-16 --bucket gs://my-bucket
      tpuctl check NAME        # also whether slice NAME's VMs use OS Login

    Credentials (Application Default Credentials), the project, the Cloud TPU API enabled, the zone usable and
    offering the accelerator, whether the project enforces OS Login, an SSH key for new VMs, the bucket
    writable. With NAME (a recorded slice), also whether its VMs use OS Login: their own enable-oslogin
    metadata, else the project's, as `run` decides. Creates nothing in the cloud.
    """
    from orchestrator import provider
    from orchestrator.check import run_checks
    items = run_checks(project=project, zone=zone, accelerator=accelerator, bucket_url=bucket,
                       api_endpoint=api_endpoint, where=provider.chosen(local), ssh_key_path=ssh_key,
                       slice_name=name)
    failed = [i for i in items if i.ok is False]
    if as_json:
        click.echo(json.dumps({"ok": not failed, "items": [i.to_json() for i in items]}, indent=1))
    else:
        for i in items:
            click.echo(i.line())
        click.echo(f"{len(failed)} problem(s): fix the ✘ lines above" if failed else "all set", err=bool(failed))
    sys.exit(1 if failed else 0)


# ---- sweep ------------------------------------------------------------------------------------------------

@cli.command("sweep", cls=PassThrough)
@click.argument("name")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--grid", metavar="FILE", help="YAML mapping of pretrain flag name -> list of values (n_layer: [2, 4]).")
@click.option("--set", "sets", multiple=True, metavar="KEY=V1,V2", help="One axis of the grid (repeatable).")
@click.option("--zip", "zip_", is_flag=True, help="Pair the i-th values of every axis instead of all combinations.")
@click.option("--out", metavar="DIR", help="The sweep's dir: gs://BUCKET/PATH, or a path every host shares. "
                                           "Each trial's --ckpt-dir is DIR/<trial>.")
@click.option("--local", is_flag=True, default=False, help="NAME is a local slice (`tpuctl up --local`).")
@click.option("--ssh-proxy-command", metavar="CMD", help="Each trial's `run` reaches the workers through CMD (as "
                                                         "`tpuctl run --ssh-proxy-command`).")
@click.option("--iap", is_flag=True, help="Each trial's `run` reaches the workers through Cloud IAP (as `run --iap`).")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Set K=V in every trial's environment on every "
                                                                  "host (as `tpuctl run --env`; repeatable).")
@click.option("--no-plan", is_flag=True, help="Launch each trial without first checking its train step against the "
                                              "slice (as `tpuctl run --no-plan`).")
@click.option("--detach", is_flag=True, help="A managed job: the tpuctl controller runs the sweep, trial by trial, "
              "with this machine off (`tpuctl run --detach`; --out must be gs://). `tpuctl jobs` follows it.")
@click.option("--controller-idle", type=click.FloatRange(min=0), default=10, show_default=True, metavar="MINUTES",
              help="With --detach: the controller deletes its VM after this long with no live job.")
@click.option("--controller-service-account", default="default", show_default=True, metavar="EMAIL",
              help="With --detach: the service account the controller's VM runs as.")
@_json_option
@_errors
def sweep_cmd(name, command, grid, sets, zip_, out, local, ssh_proxy_command, iap, envs, no_plan, detach,
              controller_idle, controller_service_account, as_json):
    """Run every trial of a grid on slice NAME, one after another; or `tpuctl sweep report DIR`.

    \b
      tpuctl sweep NAME --set n_layer=2,4 --set d_model=128,256 --out gs://B/depth -- pretrain --preset gpt2-tiny
      tpuctl sweep NAME --grid sweep.yaml --zip --out gs://B/lr -- pretrain --steps 2000
      tpuctl sweep report gs://B/depth              the table, PNG charts and one HTML page

    Every trial is one `tpuctl run NAME -- pretrain ... --ckpt-dir DIR/<trial>`. Everything is checked before
    anything runs (an unknown grid key, an empty grid, a DIR that holds another sweep). Run again to resume:
    finished trials are skipped, an unfinished one resumes from its checkpoint. A failed trial is recorded and
    the sweep goes on; the summary names it and why. Exit 0 all done, 1 some failed, 130 interrupted.
    """
    from orchestrator.jobs import sweep
    if name == "report":
        if len(command) != 1:
            raise UserError("write `tpuctl sweep report DIR` (DIR: the sweep's --out)")
        from orchestrator import provider
        rep = sweep.make_report(command[0].rstrip("/").rsplit("/", 1)[-1], command[0],
                                sweep.here_env(provider.chosen(local), command[0]))
        if as_json:
            click.echo(json.dumps({k: v for k, v in rep.items() if k != "text"}))
        else:
            click.echo(rep["text"])
            for n in rep["notes"]:
                click.echo(n)
            click.echo(f"report: {rep['html']}")
        return
    command = list(command)
    if command and command[0] != "pretrain":
        raise UserError("a sweep runs the trainer's pretrain: `tpuctl sweep NAME --set K=V1,V2 --out DIR -- pretrain ...`")
    grid_args = (["--grid", grid] if grid else []) + [a for s in sets for a in ("--set", s)] + (["--zip"] if zip_ else [])
    if ssh_proxy_command:
        from orchestrator.access import sshproxy
        try:
            sshproxy.check(ssh_proxy_command)
        except sshproxy.ProxyError as e:
            raise UserError(str(e)) from None
    from orchestrator.jobs import launch
    launch.parse_env(envs)  # `tpuctl run --env`'s own check, before any trial starts
    run_flags = (["--ssh-proxy-command", ssh_proxy_command] if ssh_proxy_command else []) + (["--iap"] if iap else []) \
        + [a for kv in envs for a in ("--env", kv)] + (["--no-plan"] if no_plan else [])
    if detach:
        if ssh_proxy_command or iap:
            raise UserError("--detach takes the slice's recorded way to its workers; drop --ssh-proxy-command/--iap")
        from orchestrator import provider, state
        from orchestrator.jobs import managed
        from orchestrator.jobs.attached import RunOptions
        rec = state.lookup(name)
        if rec is not None and (out or "").startswith("gs://"):  # the grid checked here, before anything is made
            sweep.run_trainer(["sweep", "--plan", "--json", *grid_args, "--out", out, "--", *command],
                              sweep.here_env(provider.of(rec), out))
        job = managed.submit(name, command, RunOptions(env=launch.parse_env(envs), plan=not no_plan),
                             managed.DetachOptions(controller_service_account=controller_service_account,
                                                   controller_idle=controller_idle),
                             say=lambda m: click.echo(f"[tpuctl] {m}", err=True),
                             sweep={"grid_args": grid_args, "out": out or ""})
        click.echo(json.dumps(job) if as_json else
                   f"sweep job {job['id']} taken by the controller; `tpuctl jobs --bucket {job['bucket']}` follows "
                   f"it, the report lands in {out.rstrip('/')}/report")
        return
    res = sweep.sweep(name, grid_args, out or "", command, run_flags=run_flags)
    if as_json:
        click.echo(json.dumps(res.to_json()))
    else:
        if res.report:
            click.echo(res.report["text"])
        click.echo(sweep.summary(res))
    sys.exit(res.returncode)


# ---- the other verbs live in one module per family; none of them imports this module ------------------------

from orchestrator.cli import (data_verbs, jobs_verbs, observe_verbs, plan_verbs, report_verbs,  # noqa: E402
                              run_verbs, weights_verbs)

for _cmd in (run_verbs.run, run_verbs.attach, run_verbs.cancel, run_verbs.ssh, run_verbs.logs, weights_verbs.weights,
             data_verbs.data, plan_verbs.plan, report_verbs.report_cmd, jobs_verbs.jobs, jobs_verbs.controller,
             observe_verbs.top, observe_verbs.profile):
    cli.add_command(_cmd)


def main(argv=None) -> int:
    try:
        cli.main(args=argv, prog_name="tpuctl", standalone_mode=True)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
