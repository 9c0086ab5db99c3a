"""Managed jobs as one Python API: `tpuctl run NAME --detach`, `jobs`, `logs JOB`, `cancel JOB`, `controller
status|down` only parse and call these.

A managed job is handed to a controller (orchestrator/jobs/controller.py) on a small VM of its own
(controller_vm.py), which supervises it as `tpuctl run` would: recovery from preemption, the first failure
stopping every host, bounded restarts, goodput. Its record lives in the job bucket (store.py), so every verb here
reads GCS and works from any machine; a controller found gone is recreated by whichever of these verbs needs it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator import provider, state
from orchestrator.jobs import bucket_access
from orchestrator.jobs import bundle as B
from orchestrator.jobs import controller_vm as V
from orchestrator.jobs import job_secrets
from orchestrator.jobs import launch as L
from orchestrator.jobs.attached import RunOptions, command_argv
from orchestrator.jobs.store import LIVE, JobStore, bucket_of, initial_state, is_job_id, new_job_id
from orchestrator.spec import UserError

# The controller beats every few seconds; a heartbeat older than this means it is gone (TPUCTL_CONTROLLER_STALE_S
# tunes it).
HEARTBEAT_FRESH_S = float(os.environ.get("TPUCTL_CONTROLLER_STALE_S") or 30.0)
BOOT_WAIT_S = 600.0        # a new controller VM: boot, install, first heartbeat
_BUCKETS = "jobs.json"     # in $TPUCTL_HOME: the buckets this machine submitted to (what `jobs` reads by default)


@dataclass(frozen=True)
class DetachOptions:
    """`run --detach`'s own flags."""
    controller_service_account: str = "default"
    controller_idle: float = 10.0   # minutes with no live job before the controller deletes its VM
    take_wait_s: float = 300.0      # how long submit waits for the controller to take the job


def _remember(bucket: str) -> None:
    p = state.home() / _BUCKETS
    try:
        known = json.loads(p.read_text())
    except (OSError, ValueError):
        known = {}
    known.setdefault("buckets", [])
    if bucket not in known["buckets"]:
        known["buckets"].append(bucket)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, p)


def default_buckets() -> list[str]:
    """$TPUCTL_JOBS_BUCKET, else the buckets this machine submitted jobs to."""
    if os.environ.get("TPUCTL_JOBS_BUCKET"):
        return [os.environ["TPUCTL_JOBS_BUCKET"]]
    try:
        return list(json.loads((state.home() / _BUCKETS).read_text()).get("buckets") or [])
    except (OSError, ValueError):
        return []


def buckets(given: list[str] | tuple[str, ...]) -> list[str]:
    """The buckets a verb reads: those given, else the default ones; one line when there are none."""
    out = list(given) or default_buckets()
    if not out:
        raise UserError("no job bucket known here: pass --bucket BUCKET (or set TPUCTL_JOBS_BUCKET)")
    return out


def open_store(bucket: str, prov: provider.Provider) -> JobStore:
    os.environ.update(prov.storage_env(bucket))  # this process's storage client reaches the bucket
    return JobStore(bucket)


def _where(spec_or_rec: dict, prov: provider.Provider) -> V.Where:
    return V.Where(project=spec_or_rec["project"], zone=spec_or_rec["zone"], bucket=spec_or_rec["bucket"],
                   provider=prov.kind, endpoint=prov.compute_endpoint(),
                   service_account=spec_or_rec.get("controller_service_account") or "default",
                   idle_minutes=float(spec_or_rec.get("controller_idle") or 10.0))


# ---- the controller's life, as seen from any machine ------------------------------------------------------
def controller_alive(store: JobStore, region: str, now: float | None = None) -> dict | None:
    hb = store.heartbeat(region)
    if hb and not hb.get("stopping") and not hb.get("booting") and \
            (now or time.time()) - hb.get("at", 0) < HEARTBEAT_FRESH_S:
        return hb
    return None


def ensure_controller(where: V.Where, store: JobStore, prov: provider.Provider, say: Callable[[str], None],
                      bundle_uri: str | None = None) -> dict:
    """A controller that beats for this bucket and region: the one there is, or a new VM (a deleted or dead one's
    replacement). Returns its heartbeat."""
    if hb := controller_alive(store, where.region):
        return hb
    boot = store.heartbeat(where.region) or {}
    bundle_uri = bundle_uri or boot.get("bundle_uri")
    if bundle_uri is None:
        raise UserError(f"no controller bundle recorded in gs://{where.bucket}: submit a job with `tpuctl run NAME "
                        "--detach -- ...` first")
    inst = V.get(where)  # an API that refuses even the look-up is one line with the fix (controller_vm.get)
    if inst is not None and inst["status"] in ("PROVISIONING", "STAGING", "RUNNING") and boot.get("booting") and \
            time.time() - boot.get("at", 0) < BOOT_WAIT_S:
        say(f"the tpuctl controller {where.name} is starting")
    else:
        if inst is not None:  # there, but not beating (stopped, dead, or stuck): replace it
            say(f"the tpuctl controller {where.name} is {inst['status']} but silent: replacing it")
            V.delete(where)
            while V.get(where) is not None:
                time.sleep(1)
        elif boot.get("at"):
            say(f"the tpuctl controller {where.name} is gone: creating it again (its jobs' trainers keep running; "
                "the new controller picks them up from the bucket)")
        python, env = prov.controller_runtime()
        env = {**env, **prov.storage_env(where.bucket)}
        # Recorded before the VM exists: the controller reads its bundle from it as it boots, and a tpuctl that
        # finds the controller gone later can recreate it. A VM the API refuses puts back what was there.
        before = store.heartbeat(where.region)
        store.put_heartbeat(where.region, {"booting": True, "bundle_uri": bundle_uri, "project": where.project,
                                           "zone": where.zone, "provider": prov.kind,
                                           "service_account": where.service_account,
                                           "idle_minutes": where.idle_minutes})
        try:
            V.create(where, V.startup_script(where, bundle_uri, env, python), say)
        except UserError:
            store.restore_heartbeat(where.region, before)
            raise
        prov.controller_started(where.project, where.zone, where.name, say)
    deadline = time.monotonic() + BOOT_WAIT_S
    while (hb := controller_alive(store, where.region)) is None:
        if time.monotonic() > deadline:
            raise UserError(f"the tpuctl controller {where.name} did not start within {BOOT_WAIT_S / 60:.0f} "
                            f"minutes: see its serial console (gcloud compute instances get-serial-port-output "
                            f"{where.name} --zone {where.zone}); `tpuctl controller down` removes it")
        time.sleep(1)
    return hb


def _exists(where: V.Where) -> bool:
    """Is there a controller VM (True when the API cannot say: what it might boot from stays)?"""
    try:
        return V.get(where) is not None
    except Exception:  # noqa: BLE001 - unknown is kept
        return True


# ---- submit -----------------------------------------------------------------------------------------------
def submit(name: str, command: list[str], opts: RunOptions, d: DetachOptions = DetachOptions(), *,
           say: Callable[[str], None] = print, sweep: dict | None = None) -> dict:
    """Hand `command` on slice NAME to the controller; returns once the controller has taken it:
    {id, bucket, name, ...}. sweep={"grid_args": [...], "out": DIR}: the job is `tpuctl sweep`'s, each trial of
    the grid run in turn by the controller (command is the trials' base `pretrain ...`)."""
    argv = command_argv(command, opts.raw)
    rec = state.lookup(name)
    if rec is None:
        raise UserError(f"no slice named {name} in the local record: `tpuctl up {name} ...` first (a managed job "
                        "runs on a slice tpuctl made, which its controller can recreate)")
    ckpt = sweep["out"] if sweep else L.flag_value(argv, "--ckpt-dir")
    what = "--out" if sweep else "--ckpt-dir"
    if not ckpt or not ckpt.startswith("gs://"):
        raise UserError(f"--detach needs a gs:// {what} (got {ckpt or 'none'}): the controller resumes the job "
                        "from its checkpoints after a preemption, on VMs that are not this machine")
    bucket = bucket_of(ckpt)
    prov = provider.of(rec)
    store = open_store(bucket, prov)
    store.check(iam_endpoint=prov.bucket_iam_endpoint(bucket, rec.project), project=rec.project)
    # The controller writes the bucket as its own account: refused here, before a controller, secret or record
    # exists, when that account cannot.
    email = bucket_access.check(bucket, rec.project, d.controller_service_account,
                                endpoint=prov.resource_manager_endpoint(),
                                iam_endpoint=prov.bucket_iam_endpoint(bucket, rec.project),
                                as_account=prov.as_account, warn=lambda m: say(f"warning: {m}"))
    if opts.plan and argv[:3] == [L.PYTHON, "-m", "trainer"] and not sweep:  # a sweep plans each trial itself
        from orchestrator.plan import step as P
        P.check_before_run(rec.accelerator, rec.slices, argv[3:], prov.local_env(argv), cpu_devices=prov.cpu_devices,
                           say=say)
    spec_base = {"project": rec.project, "zone": rec.zone, "bucket": bucket,
                 "controller_service_account": d.controller_service_account, "controller_idle": d.controller_idle}
    where = _where(spec_base, prov)
    job_id = new_job_id()
    # The secrets go first: a Secret Manager that refuses (API disabled, no access) is found before a controller
    # VM exists. Their reader is the controller's account: the live controller's own, else the one it will run as.
    secret_refs: dict[str, str] = {}
    if opts.secrets:
        alive = controller_alive(store, where.region)
        email = (alive or {}).get("service_account_email") or email
        if not email:
            raise UserError(f"cannot tell the email of the controller's service account "
                            f"{d.controller_service_account!r}, which must read the job's secrets: pass "
                            "--controller-service-account EMAIL")
        secret_refs = job_secrets.store(rec.project, job_id, opts.secrets, f"serviceAccount:{email}",
                                        endpoint=prov.secrets_endpoint(), credentials=prov.secrets_credentials())
    uploaded = []
    try:
        bundle = B.build(workdir=opts.workdir, extras=B.trainer_extras(argv, L.PYTHON))
        bundle_uri = f"gs://{bucket}/tpuctl/bundles/{bundle.hash[:16]}/{bundle.wheel.name}"
        blob = store.bucket.blob(bundle_uri.split("/", 3)[3])
        if not blob.exists():  # the wheel and its dependency list: what a controller VM installs (controller_vm.py)
            reqs = store.bucket.blob(bundle_uri.split("/", 3)[3].rsplit("/", 1)[0] + "/requirements.txt")
            reqs.upload_from_string(bundle.requirements_text())
            uploaded.append(reqs)
            blob.upload_from_filename(str(bundle.wheel))
            uploaded.append(blob)
        say(f"plan: {name} at {rec.price_per_hour:.2f} $/hour while the job lives, supervised by {where.name} "
            f"({V.MACHINE}, {V.PRICE_PER_HOUR:.4f} $/hour while it has live jobs, then {d.controller_idle:g} idle "
            "minutes)")
        ensure_controller(where, store, prov, say, bundle_uri=bundle_uri)
    except BaseException:
        # Refused (or interrupted) before the job exists: its secrets go, and the bundle this submit uploaded
        # unless a controller VM is there to boot from it (one already there stays).
        if secret_refs:
            job_secrets.drop(secret_refs, endpoint=prov.secrets_endpoint(), credentials=prov.secrets_credentials())
        if uploaded and not _exists(where):
            for b in uploaded:
                b.delete()
        raise
    total = L.flag_value(argv, "--steps")
    spec = {**spec_base, "id": job_id, "name": name, "slice_name": name, "command": list(command),
            "kind": "sweep" if sweep else "run", "sweep": sweep,
            "provider": prov.kind, "region": where.region, "submitted": time.time(),
            "total_steps": int(total) if total and total.isdigit() else None,
            "price_per_hour": rec.price_per_hour,
            "opts": {"env": opts.env, "kill_stale": opts.kill_stale, "raw": opts.raw,
                     "coordinator_port": opts.coordinator_port, "heartbeat_timeout": opts.heartbeat_timeout,
                     "init_timeout": opts.init_timeout, "on_preemption": opts.on_preemption,
                     "hang_timeout": opts.hang_timeout, "max_restarts": opts.max_restarts},
            "secrets": secret_refs,
            "bundle": {"uri": bundle_uri, "hash": bundle.hash, "requirements": bundle.requirements,
                       "no_deps": bundle.no_deps, "has_workdir": bundle.has_workdir}}
    store.put_slice(job_id, rec.to_json())
    store.put_spec(job_id, spec)
    _remember(bucket)
    say(f"job {job_id} submitted to gs://{bucket}; waiting for the controller to take it")
    deadline = time.monotonic() + d.take_wait_s
    while (st := store.state(job_id)) is None:
        if time.monotonic() > deadline:
            raise UserError(f"the controller has not taken job {job_id} in {d.take_wait_s:.0f} s: "
                            f"`tpuctl controller status --bucket {bucket}`; the job stays queued")
        time.sleep(0.5)
    return {"id": job_id, "bucket": bucket, "name": name, "state": st["state"], "controller": where.name}


# ---- reading ------------------------------------------------------------------------------------------------
def jobs(buckets: list[str], prov: provider.Provider, *, say: Callable[[str], None] = print,
         revive: bool = True) -> list[dict]:
    """Every job in these buckets, oldest first. A live job whose controller is gone gets a new one (revive)."""
    out = []
    for bucket in buckets:
        store = open_store(bucket, prov)
        rows = store.jobs()
        if revive:
            _revive(store, rows, prov, say)
        out += [{**r, "bucket": bucket} for r in rows]
    return out


def _revive(store: JobStore, rows: list[dict], prov: provider.Provider, say: Callable[[str], None]) -> None:
    regions = {}
    for r in rows:
        if r["state"] in LIVE:
            spec = store.spec(r["id"])
            if spec:
                regions.setdefault(spec["region"], spec)
    for region, spec in regions.items():
        if controller_alive(store, region) is None:
            ensure_controller(_where(spec, prov), store, prov, say)


def find(job_id: str, buckets: list[str], prov: provider.Provider) -> tuple[JobStore, dict]:
    if not is_job_id(job_id):
        raise UserError(f"{job_id!r} is not a job id (job-YYYYMMDD-HHMMSS-xxxx): `tpuctl jobs` lists them")
    for bucket in buckets:
        store = open_store(bucket, prov)
        if (spec := store.spec(job_id)) is not None:
            return store, spec
    raise UserError(f"no job {job_id} in {', '.join('gs://' + b for b in buckets) or 'any known bucket'}: pass "
                    "--bucket BUCKET")


def job_state(store: JobStore, spec: dict) -> dict:
    return store.state(spec["id"]) or initial_state(spec)


def logs(store: JobStore, spec: dict, *, follow: bool, out: Callable[[str], None], poll_s: float = 2.0) -> dict:
    """Print the job's log from the bucket: what its controller's `run` printed, every attempt's host lines
    ([wI]) and its own ([tpuctl]) in order; with follow, what arrives until the job ends. Returns the final
    state. (Each host's own log of each run is beside it, under logs/RUN_ID/: host_logs.)"""
    seen = 0
    while True:
        st = job_state(store, spec)
        text = store.logs(spec["id"]).get("controller.log", b"")[seen:].decode(errors="replace")
        live = st["state"] in LIVE
        cut = text.rfind("\n") + 1 if follow and live else len(text)  # whole lines only while it grows
        for line in text[:cut].splitlines():
            out(line)
        seen += len(text[:cut].encode())
        if not follow or not live:
            return st
        time.sleep(poll_s)


def job_host(store: JobStore, spec: dict, worker: str) -> str:
    """The host a `--worker` names in this job (N or wN: worker N; s1w0: a multislice job's host), as its logs
    are named; one line listing the job's hosts when it has no such one."""
    import re
    from orchestrator.state import SliceRecord
    if not re.fullmatch(r"(s\d+)?w?\d+", worker):
        raise UserError(f"--worker {worker}: pick a worker index, a host such as s1w0, or all")
    host = f"w{worker}" if worker.isdigit() else worker
    rec = store.slice(spec["id"])  # written at submit, before the spec; the controller keeps it current
    hosts = [w.name for w in SliceRecord.from_json(rec).workers] if rec else []
    if host not in hosts:
        raise UserError(f"job {spec['id']} has no worker {worker}: its slice {spec['slice_name']} has "
                        f"{', '.join(hosts) or 'no workers recorded'} (--worker " + (
                            f"0..{len(hosts) - 1})" if all(h[1:].isdigit() for h in hosts) else "s0w0, ...)"))
    return host


def host_logs(store: JobStore, spec: dict, host: str, *, follow: bool, out: Callable[[str], None],
              run_id: str | None = None, poll_s: float = 2.0) -> dict:
    """Print one host's own log from the bucket, as that host wrote it: each of the job's runs in turn (a line
    `[tpuctl] run RUN_ID` before each after the first: the attempt after a recovery, a sweep's next trial), or
    run_id's only; with follow, what arrives until the job ends. Returns the final state."""
    seen: dict[str, int] = {}
    while True:
        st = job_state(store, spec)  # before the logs: the controller copies them last before the job's end
        live = follow and st["state"] in LIVE
        sizes = store.host_log_sizes(spec["id"], host)
        for run in sorted(sizes) if run_id is None else [r for r in sizes if r == run_id]:
            if sizes[run] <= seen.get(run, 0):
                continue
            text = store.log_bytes(spec["id"], f"{run}/{host}.log", seen.get(run, 0)).decode(errors="replace")
            cut = text.rfind("\n") + 1 if live else len(text)  # whole lines only while it grows
            if not text[:cut]:
                continue
            if run not in seen and seen:
                out(f"[tpuctl] run {run}")
            for line in text[:cut].splitlines():
                out(line)
            seen[run] = seen.get(run, 0) + len(text[:cut].encode())
        if not live:
            if not seen:
                what = f"run {run_id}" if run_id else f"job {spec['id']} ({st['state']})"
                raise UserError(f"no log of {host} in {what} yet" + (
                    f": `tpuctl logs {spec['id']} --worker {host} --follow` waits for it" if st["state"] in LIVE
                    else ""))
            return st
        time.sleep(poll_s)


def cancel(store: JobStore, spec: dict, prov: provider.Provider, *, down: bool = False,
           say: Callable[[str], None] = print, timeout_s: float = 120.0) -> dict:
    """Ask the controller to stop the job (every host within its grace) and wait for CANCELLED."""
    st = job_state(store, spec)
    if st["state"] not in LIVE:
        raise UserError(f"job {spec['id']} is already {st['state']}")
    store.request_cancel(spec["id"], down)
    ensure_controller(_where(spec, prov), store, prov, say)
    deadline = time.monotonic() + timeout_s
    while (st := job_state(store, spec))["state"] in LIVE:
        if time.monotonic() > deadline:
            raise UserError(f"job {spec['id']} is still {st['state']} {timeout_s:.0f} s after the cancel: "
                            f"`tpuctl cancel {spec['slice_name']}` stops its run on the hosts directly")
        time.sleep(0.5)
    return st


def live_jobs_on(name: str) -> list[dict]:
    """Live managed jobs on slice NAME in the buckets this machine knows (for `down`'s refusal)."""
    rec = state.lookup(name)
    if rec is None:
        return []
    prov = provider.of(rec)
    if not prov.storage_up():  # no storage, no live job in it: `down` must not start any
        return []
    out = []
    for bucket in default_buckets():
        try:
            rows = open_store(bucket, prov).jobs()
        except Exception:  # noqa: BLE001 - an unreachable bucket must not block `down`; it is named instead
            continue
        out += [r for r in rows if r["state"] in LIVE and r["slice"] == name]
    return out


def controller_status(bucket: str, prov: provider.Provider) -> list[dict]:
    """The controllers that have served this bucket, region by region: heartbeat, VM, cost so far."""
    store = open_store(bucket, prov)
    out = []
    for b in store.client.list_blobs(store.bucket, prefix="tpuctl/controller/"):
        region = b.name.rsplit("/", 1)[-1].removesuffix(".json")
        hb = store.heartbeat(region) or {}
        where = V.Where(hb.get("project", ""), hb.get("zone", ""), bucket, prov.kind, prov.compute_endpoint())
        inst = V.get(where) if where.project and where.zone else None
        alive = controller_alive(store, region) is not None
        up_s = time.time() - hb["started"] if alive and hb.get("started") else 0.0
        out.append({"region": region, "instance": where.name, "vm": inst["status"] if inst else "none",
                    "alive": alive, "live_jobs": hb.get("jobs", []) if alive else [],
                    "idle_since": hb.get("idle_since"), "idle_minutes": hb.get("idle_minutes"),
                    "uptime_s": up_s, "price_per_hour": V.PRICE_PER_HOUR,
                    "cost_usd": up_s / 3600 * V.PRICE_PER_HOUR})
    return out


def controller_down(bucket: str, prov: provider.Provider, *, force: bool = False,
                    say: Callable[[str], None] = print) -> list[str]:
    """Delete the controller VMs of this bucket; refuses while they have live jobs unless force (the trainers keep
    running; the next tpuctl command that needs a controller makes one)."""
    gone = []
    for c in controller_status(bucket, prov):
        if c["live_jobs"] and not force:
            raise UserError(f"{c['instance']} supervises {', '.join(c['live_jobs'])}: `tpuctl cancel JOB` first, or "
                            "--force (the jobs' trainers keep running; the next `tpuctl jobs` starts a controller "
                            "again)")
        store = open_store(bucket, prov)
        hb = store.heartbeat(c["region"]) or {}
        if V.delete(V.Where(hb.get("project", ""), hb.get("zone", ""), bucket, prov.kind, prov.compute_endpoint())):
            say(f"deleted {c['instance']}")
            gone.append(c["instance"])
    return gone
