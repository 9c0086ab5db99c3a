"""The slice verbs as plain functions (up, down, status, ls, gc, workers, recreate) returning dataclasses.

The CLI is a thin layer over these; other parts (run, ssh, the supervisor) call them directly.
Invariant of `up`: the local record is written *before* the create call, so from then on anything in the cloud
is findable by name; a failure after the create call (stockout, timeout, Ctrl-C) either deletes what was
created and drops the record, or keeps the record (status "failed"/"waiting") so `down` and `gc` find it.
"""
from __future__ import annotations

import difflib
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from orchestrator import catalog, cloud, state
from orchestrator.cloud import Api, CloudError, NodeInfo
from orchestrator.spec import (CLOUD_PLATFORM_SCOPE, LABEL_EXPIRY, LABEL_NAME, LABEL_OWNER, SliceSpec, UserError, check_name, check_zone,
                               owner_label)
from orchestrator.state import SliceRecord, Worker

Progress = Callable[[str], None]
_WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "STATE_UNSPECIFIED")


class Interrupted(UserError):
    """up was interrupted (Ctrl-C / SIGTERM); the message says what was cleaned up."""


def _noop(_: str) -> None:
    pass


def fmt_duration(s: float) -> str:
    if s < 10:
        return f"{s:.1f}s"
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


# ---- plan ----------------------------------------------------------------------------------------------

@dataclass
class Plan:
    name: str
    accelerator: str
    chips: int
    hosts: int
    topology: str
    hbm_gib: float
    hbm_gib_per_chip: float
    peak_bf16_tflops: float
    price_per_hour: float        # USD, list price (catalog); spot or on-demand
    spot: bool
    reserved: bool
    zones: list[str]
    runtime_version: str
    project: str
    queued: bool
    labels: dict[str, str]

    def summary(self) -> str:
        kind = "spot" if self.spot else ("reserved" if self.reserved else "on-demand")
        how = "queued resource" if self.queued else "node"
        return (f"{self.name}: {self.accelerator} = {self.chips} chips on {self.hosts} host(s), topology "
                f"{self.topology}, {self.hbm_gib:g} GiB HBM ({self.hbm_gib_per_chip:g}/chip), "
                f"{self.peak_bf16_tflops:,.0f} peak bf16 TFLOP/s; ${self.price_per_hour:.2f}/hour {kind} list price; "
                f"{how} in {', '.join(self.zones)} (project {self.project}, runtime {self.runtime_version})")


def make_plan(spec: SliceSpec, project: str, zones: list[str] | None = None) -> Plan:
    acc = spec.accelerator_type
    zones = zones or spec.zones
    return Plan(name=spec.name, accelerator=acc.name, chips=acc.chips, hosts=acc.hosts, topology=acc.topology,
                hbm_gib=acc.hbm_gib, hbm_gib_per_chip=acc.hbm_gib_per_chip, peak_bf16_tflops=acc.peak_bf16_tflops,
                price_per_hour=acc.price_per_hour(zones[0] if zones else None, spec.spot), spot=spec.spot,
                reserved=spec.reserved, zones=list(zones), runtime_version=spec.runtime, project=project,
                queued=spec.queued, labels=_labels(spec))


def _labels(spec: SliceSpec, now: float | None = None) -> dict[str, str]:
    now = time.time() if now is None else now
    expiry = str(int(now + spec.ttl_s)) if spec.ttl_s else "never"
    return {**spec.labels, LABEL_NAME: spec.name, LABEL_OWNER: owner_label(), LABEL_EXPIRY: expiry}


def _default_zones(spec: SliceSpec) -> list[str]:
    if spec.zones:
        return spec.zones
    if spec.local:  # the stand-in offers the catalog's zones: pick the first one for this generation
        return [spec.accelerator_type.zone_hints[0]]
    hints = ", ".join(spec.accelerator_type.zone_hints)
    raise UserError(f"no zone given: pass --zone Z (or --zones a,b,c); zones offering {spec.accelerator} "
                    f"per the catalog: {hints}")


def _usable_zones(api: Api, spec: SliceSpec, progress: Progress) -> list[str]:
    """The zones whose acceleratorTypes listing (the source of truth) offers the accelerator."""
    usable, refused = [], []
    for zone in spec.zones:
        try:
            offered = api.accelerator_types(zone)
        except CloudError as e:
            if e.kind in ("zone", "not-found"):
                raise CloudError("zone", f"{e}; zones offering {spec.accelerator} per the catalog: "
                                         f"{', '.join(spec.accelerator_type.zone_hints)}", raw=e.raw,
                                 status=e.status) from None
            raise
        if spec.accelerator in offered:
            usable.append(zone)
        else:
            refused.append((zone, offered))
            if len(spec.zones) > 1:
                progress(f"{zone} does not offer {spec.accelerator}; skipping it")
    if not usable:
        zone, offered = refused[0]
        same_gen = [t for t in offered if t.split("-")[0] == spec.accelerator.split("-")[0]]
        listed = ", ".join(same_gen or offered[:8]) or "nothing"
        hints = [z for z in spec.accelerator_type.zone_hints if z not in spec.zones]
        raise UserError(f"{spec.accelerator} is not offered in {', '.join(spec.zones)} (the API lists there: {listed}); "
                        + (f"try --zone {hints[0]} (catalog zones for {spec.accelerator_type.generation.name}: "
                           f"{', '.join(spec.accelerator_type.zone_hints)})" if hints else "pick another accelerator"))
    versions = api.runtime_versions(usable[0])
    if spec.runtime not in versions:
        close = difflib.get_close_matches(spec.runtime, versions, n=3, cutoff=0.5)
        raise UserError(f"runtime version {spec.runtime!r} is not available in {usable[0]}; "
                        + (f"did you mean {', '.join(close)}?" if close else
                           f"the default for {spec.accelerator_type.generation.name} is "
                           f"{spec.accelerator_type.default_runtime_version}"))
    return usable


# ---- up ------------------------------------------------------------------------------------------------

@dataclass
class Attempt:
    zone: str
    outcome: str      # ready | capacity | ...
    detail: str = ""
    status: str = ""  # the API's error.status (RESOURCE_EXHAUSTED, FAILED_PRECONDITION, INVALID_ARGUMENT)


def _why(attempts: list[Attempt]) -> str:
    """The capacity answers met, in words: stockout, reserved capacity short, spot preempted while creating."""
    words = {"FAILED_PRECONDITION": "reserved capacity short", "INVALID_ARGUMENT": "spot preempted while creating"}
    seen = dict.fromkeys((a.detail if "after --capacity-wait" in a.detail else words.get(a.status, "stockout"))
                         for a in attempts if a.outcome == "capacity")
    return ", ".join(seen) or "stockout"


@dataclass
class UpResult:
    record: SliceRecord
    plan: Plan
    attempts: list[Attempt]
    elapsed_s: float

    @property
    def workers(self) -> list[Worker]:
        return self.record.workers


def up(spec: SliceSpec, *, progress: Progress | None = None, on_plan: Callable[[Plan], None] | None = None,
       dry_run: bool = False) -> UpResult:
    """Validate, plan, create (queued resource or node), wait for READY, record. Raises UserError/CloudError."""
    progress = progress or _noop
    t0 = time.monotonic()
    spec.validate()
    spec.zones = _default_zones(spec)
    api = cloud.connect(api_endpoint=spec.api_endpoint, local=spec.local, project=spec.project)
    api.on_retry = progress
    _check_name_free(spec.name)
    zones = _usable_zones(api, spec, progress)
    plan = make_plan(spec, api.project, zones)
    if on_plan:
        on_plan(plan)
    if dry_run:
        rec = SliceRecord(name=spec.name, project=api.project, zone=zones[0], accelerator=spec.accelerator,
                          node=f"{api.parent(zones[0])}/nodes/{spec.name}", labels=plan.labels,
                          price_per_hour=plan.price_per_hour, status="planned")
        return UpResult(rec, plan, [], time.monotonic() - t0)
    _add_ssh_key(spec, progress)
    deadline = t0 + spec.timeout_s
    claim_id = uuid.uuid4().hex
    if not state.claim(_record(api, spec, zones[0], claim_id)):  # two `up NAME` at once: one wins the name
        other = state.lookup(spec.name)
        raise UserError(f"a slice named {spec.name} was just recorded by another tpuctl "
                        f"({other.status if other else 'gone again'}{f' in {other.zone}' if other else ''}); "
                        f"use another name, or `tpuctl down {spec.name}` first")
    attempts: list[Attempt] = []
    leftovers: list[str] = []
    for zone in zones:
        try:
            rec = _create_in_zone(api, spec, zone, deadline, progress, claim_id, leftovers)
        except CloudError as e:
            if e.kind != "capacity":
                raise
            attempts.append(Attempt(zone, "capacity", e.raw or str(e), e.status))
            rest = zones[zones.index(zone) + 1:]
            if rest:
                progress(f"no capacity for {spec.accelerator} in {zone} ({_why(attempts[-1:])}); trying {rest[0]}")
                continue
            tried = ", ".join(a.zone for a in attempts)
            hint = "try other zones with --zones a,b,c" + (
                "" if spec.wait_capacity else
                f", or {'' if spec.queued else 'drop --no-queue and add '}--wait-capacity to queue until capacity "
                "frees up")
            left = _finish_failed(api, spec, zones[-1], claim_id, leftovers, "no capacity")
            raise CloudError("capacity", f"no capacity for {spec.accelerator} in {tried} right now ({_why(attempts)}), "
                                         f"{left}: {hint}", raw=e.raw, status=e.status) from None
        attempts.append(Attempt(zone, "ready"))
        plan.price_per_hour = rec.price_per_hour
        return UpResult(rec, plan, attempts, time.monotonic() - t0)
    raise AssertionError("unreachable")


def _finish_failed(api: Api, spec: SliceSpec, zone: str, claim_id: str, leftovers: list[str], why: str) -> str:
    """After the last zone failed: drop our record, or keep it (failed) while earlier zones are still deleting.
    Returns the words for the message."""
    if not leftovers:
        state.release(spec.name, claim_id)
        return "nothing was left behind"
    rec = _record(api, spec, zone, claim_id)
    rec.status, rec.leftovers = "failed", list(leftovers)
    rec.note = f"{why}; still deleting {', '.join(leftovers)}"
    state.save_claimed(rec) or state.claim(rec)
    return (f"{', '.join(leftovers)} {'is' if len(leftovers) == 1 else 'are'} still being deleted and stay recorded "
            f"(`tpuctl down {spec.name}` finishes it)")


def _add_ssh_key(spec: SliceSpec, progress: Progress) -> None:
    """A new VM lets in only the keys it is given: put the user's (made if missing) in the node's ssh-keys."""
    from orchestrator import sshkeys
    if "ssh-keys" in spec.metadata:
        return
    try:
        path, pub, created = sshkeys.ensure_key()
        entry = sshkeys.metadata_entry(sshkeys.default_user(), pub)
    except (sshkeys.SshKeyError, OSError) as e:
        raise UserError(str(e)) from None
    if created:
        progress(f"made the SSH key {path} (ed25519) that new VMs will let in")
    spec.metadata = {**spec.metadata, "ssh-keys": entry}


def _check_name_free(name: str) -> None:
    rec = state.lookup(name)
    if rec is None:
        return
    st = status(name)
    if st.state in ("GONE",) and not rec.leftovers and rec.status != "creating":
        state.release(name, rec.claim)  # deleted outside tpuctl: the stale record must not block the name
        return
    raise UserError(f"a slice named {name} already exists ({st.state} in {rec.zone}); use another name, "
                    f"or `tpuctl down {name}` first")


def _record(api: Api, spec: SliceSpec, zone: str, claim_id: str) -> SliceRecord:
    acc = spec.accelerator_type
    return SliceRecord(
        name=spec.name, project=api.project, zone=zone, accelerator=acc.name,
        node=f"{api.parent(zone)}/nodes/{spec.name}",
        queued_resource=f"{api.parent(zone)}/queuedResources/{spec.name}" if spec.queued else None,
        api_endpoint=None if spec.local else api.endpoint, local=spec.local, fresh_hosts=spec.fresh_hosts,
        labels=_labels(spec),
        price_per_hour=acc.price_per_hour(zone, spec.spot), spot=spec.spot, reserved=spec.reserved,
        runtime_version=spec.runtime, status="creating", claim=claim_id,
        reservation=api.reservation_path(zone, spec.reservation) if spec.reservation else None,
        external_ips=spec.external_ips, network=spec.network, subnetwork=spec.subnetwork,
        service_account=spec.service_account, scopes=list(spec.scopes), metadata=dict(spec.metadata))


def _save(rec: SliceRecord) -> None:
    """Write our record; if it was dropped meanwhile (down, gc), write it again: what exists must stay findable."""
    if not state.save_claimed(rec):
        state.claim(rec)


def _create_in_zone(api: Api, spec: SliceSpec, zone: str, deadline: float, progress: Progress, claim_id: str,
                    leftovers: list[str]) -> SliceRecord:
    acc = spec.accelerator_type
    rec = _record(api, spec, zone, claim_id)
    rec.leftovers = list(leftovers)
    labels = rec.labels
    _save(rec)  # before the create call: from here on, a crash leaves something findable by name
    vm = cloud.VmConfig(external_ips=spec.external_ips, network=spec.network, subnetwork=spec.subnetwork,
                        service_account=spec.service_account, scopes=tuple(spec.scopes),
                        metadata=tuple(sorted(spec.metadata.items())))
    body = api.node_body(acc.name, spec.runtime, labels, spot=spec.spot, reserved=spec.reserved,
                         in_queue=spec.queued, vm=vm)
    what = "queued resource" if spec.queued else "node"
    try:
        progress(f"creating {what} {spec.name} in {zone}")
        if spec.queued:
            op = api.create_queued_resource(zone, spec.name, spec.name, body, spot=spec.spot,
                                            valid_until_s=None if spec.wait_capacity else
                                            valid_until_s(spec.capacity_wait_s), reservation=rec.reservation)
        else:
            op = api.create_node(zone, spec.name, body)
    except CloudError as e:
        if e.kind != "capacity":  # the API refused: nothing was created (ours: our record goes, or stays failed)
            _finish_failed(api, spec, zone, claim_id, leftovers, str(e))
        raise
    except BaseException:  # interrupted during the call: it may or may not exist
        raise _abandon(api, rec, spec, "interrupted during the create call", progress) from None

    last = {"state": "CREATING"}
    try:
        node = _wait_ready(api, rec, op, spec, deadline, progress, last)
    except CloudError as e:
        if e.kind == "capacity":
            progress(f"no capacity in {zone}: deleting the {what}")
            leftovers.extend(_delete_quietly(api, rec))
            raise
        if e.kind == "timeout" and spec.wait_capacity and last["state"] in _WAITING:
            rec.status, rec.note = "waiting", "queued for capacity (--wait-capacity)"
            _save(rec)
            raise CloudError("waiting", f"{spec.name} is still waiting for capacity in {zone} after "
                                        f"{fmt_duration(spec.timeout_s)}; the queued resource stays queued "
                                        f"(--wait-capacity): `tpuctl status {spec.name}` shows when it is READY, "
                                        f"`tpuctl down {spec.name}` cancels it") from None
        raise _abandon(api, rec, spec, str(e), progress, cause=e) from None
    except KeyboardInterrupt:
        raise _abandon(api, rec, spec, "interrupted while waiting", progress) from None
    rec.workers, rec.status = node.workers, "ready"
    if spec.local:
        rec.workers = _attach_local_hosts(api, rec, progress)
    _save(rec)
    return rec


# A queued resource's server-side validUntilDuration is this much longer than tpuctl's own --capacity-wait, so
# that tpuctl gives up first, with its own message, and deletes it; the server's limit only catches a tpuctl that
# died while waiting.
VALID_UNTIL_MARGIN_S = 300.0


def valid_until_s(capacity_wait_s: float) -> float:
    return capacity_wait_s + max(VALID_UNTIL_MARGIN_S, capacity_wait_s / 2)


MAX_LOCAL_HOSTS = 16  # a local slice is sshd processes on this machine: v4-4096 stays addresses only


def _attach_local_hosts(api: Api, rec: SliceRecord, progress: Progress) -> list[Worker]:
    """Local mode: give the stand-in's node real hosts (sshd on loopback) so `tpuctl run` can reach them.

    Without root or sshd (or for a huge slice) the node keeps the stand-in's made-up addresses: `up`,
    `status` and `down` still work, and `run` says why it cannot connect.
    """
    from infra.fake_tpu_api import FakeControl
    from infra.local_slice import LocalSlice, LocalSliceError

    n = len(rec.workers)
    if n > MAX_LOCAL_HOSTS:
        progress(f"note: {n} workers is more than the {MAX_LOCAL_HOSTS} local hosts tpuctl starts; no SSH hosts")
        return rec.workers
    # Like a VM's guest agent, the hosts let in the keys of the node's ssh-keys metadata. A local host has only
    # root: keys for other users are not installed.
    from orchestrator.sshkeys import parse_metadata
    meta = api.get_node(rec.node)
    keys = parse_metadata((meta.metadata if meta else {}).get("ssh-keys", ""))
    others = sorted({u for u, _ in keys if u != "root"})
    if others:
        progress(f"note: the local hosts have only root; ssh-keys for {', '.join(others)} are not installed")
    try:
        hosts = LocalSlice.start(rec.name, n, fresh=rec.fresh_hosts,
                                 authorized_keys=tuple(k for u, k in keys if u == "root"))
    except (LocalSliceError, OSError) as e:
        progress(f"note: no local SSH hosts for {rec.name} ({e}); `tpuctl run` will not reach it")
        return rec.workers
    try:
        FakeControl(cloud.local_api_url()).set_node_workers(rec.node, [h.ip for h in hosts.hosts])
        node = api.get_node(rec.node)
    except BaseException:
        hosts.stop()
        raise
    progress(f"{rec.name}: {n} local host(s) up (sshd on {', '.join(h.ip for h in hosts.hosts)})")
    return node.workers


def _wait_ready(api: Api, rec: SliceRecord, op, spec: SliceSpec, deadline: float, progress: Progress,
                last: dict) -> NodeInfo:
    op_done, waiting_since = False, time.monotonic()
    where = dict(zone=rec.zone, accelerator=rec.accelerator, project=rec.project)
    def out_of_patience(what: str) -> CloudError:  # tpuctl's own limit, reached before the server's validUntil
        own = f"stockout: {what} after --capacity-wait {fmt_duration(spec.capacity_wait_s)}"
        return CloudError("capacity", f"no capacity for {rec.accelerator} in {rec.zone}: {own}", raw=own,
                          status="RESOURCE_EXHAUSTED")

    while True:
        if not op_done:
            op_done, code, msg = api.poll_operation(op)
            if code:
                raise cloud.operation_error(code, msg, action=f"create {rec.accelerator}", **where)
            if (not op_done and rec.queued_resource and not spec.wait_capacity
                    and time.monotonic() - waiting_since > spec.capacity_wait_s):
                raise out_of_patience("create operation still pending")
        q = api.get_queued_resource(rec.queued_resource) if rec.queued_resource and op_done else None
        node = None
        if q is not None:
            last["state"] = q.state
            if q.state == "FAILED":
                if q.error_code in (0, 8) and not (q.error_code == 0 and q.error_message):
                    raise cloud.exhausted(q.error_message or "queued resource FAILED", sync=False, **where)
                raise cloud.operation_error(q.error_code, q.error_message, action=f"create {rec.accelerator}", **where)
            if q.state in ("SUSPENDING", "SUSPENDED", "DELETING"):
                raise CloudError("failed", f"the queued resource went {q.state} before the slice was ready "
                                           "(preempted or deleted elsewhere)")
            if q.state in _WAITING:
                if not spec.wait_capacity and time.monotonic() - waiting_since > spec.capacity_wait_s:
                    raise out_of_patience(f"still {q.state}")
            else:
                node = api.get_node(rec.node)
        elif not rec.queued_resource:
            node = api.get_node(rec.node)
        elif op_done:
            raise CloudError("failed", f"the queued resource {rec.queued_resource} disappeared while waiting "
                                       "(deleted elsewhere?)")
        if node is not None:
            last["state"] = node.state
            if node.state == "READY" and len(node.workers) > 0:
                return node
            if node.state in ("PREEMPTED", "TERMINATED", "STOPPED", "DELETING"):
                raise CloudError("failed", f"the node went {node.state} before it was ready")
        parts = ([f"queued resource {q.state}"] if q is not None else []) + ([f"node {node.state}"] if node else [])
        progress(f"{rec.name} in {rec.zone}: {', '.join(parts) or 'creating'}")
        if time.monotonic() > deadline:
            raise CloudError("timeout", f"{rec.name} was not READY within --timeout {fmt_duration(spec.timeout_s)} "
                                        f"(last state {last['state']})")
        time.sleep(api.poll_s)


def _abandon(api: Api, rec: SliceRecord, spec: SliceSpec, reason: str, progress: Progress,
             cause: CloudError | None = None) -> UserError:
    """After a failure that follows the create call: delete what was created, or keep it recorded. Returns the
    error to raise (Interrupted when there is no cause), whose message says which."""
    what = "queued resource and node" if rec.queued_resource else "node"

    def err(msg: str) -> UserError:
        if cause is None:
            return Interrupted(msg)
        return CloudError(cause.kind, msg, raw=cause.raw, quota=cause.quota)

    if spec.keep_on_failure:
        rec.status, rec.note = "failed", reason
        _save(rec)
        return err(f"{reason}; kept the {what} {rec.name} (--keep-on-failure): `tpuctl down {rec.name}` deletes it")
    try:
        progress(f"{reason}: deleting the {what} {rec.name}")
        _delete_and_wait(api, rec, timeout_s=delete_wait_s(rec), progress=_noop)
        state.release(rec.name, rec.claim)
        return err(f"{reason}; deleted the {what} {rec.name}: nothing was left behind")
    except BaseException as e:  # an API error, or a second Ctrl-C: keep the record so down/gc find it
        rec.status, rec.note = "failed", reason
        _save(rec)
        why = str(e) or type(e).__name__
        return err(f"{reason}; could not delete the {what} {rec.name} ({why}); it stays in the local record: "
                   f"run `tpuctl down {rec.name}`")


# Deleting a slice takes longer the more VMs it has: minutes for a multi-host slice. tpuctl waits this long
# (base + per worker VM) before it calls a deletion unfinished; the stand-in models the same durations with
# FakeConfig.deleting_s + deleting_per_host_s.
DELETE_WAIT_BASE_S = 180.0
DELETE_WAIT_PER_HOST_S = 30.0


def delete_wait_s(rec: SliceRecord) -> float:
    try:
        hosts = catalog.lookup(rec.accelerator).hosts
    except ValueError:
        hosts = max(1, len(rec.workers))
    return DELETE_WAIT_BASE_S + DELETE_WAIT_PER_HOST_S * hosts


def _delete_quietly(api: Api, rec: SliceRecord) -> list[str]:
    """Delete what one zone's attempt created; returns the resources still being deleted when the wait ran out
    (they stay in the record as leftovers, so the next zone's attempt does not lose them)."""
    try:
        _delete_and_wait(api, rec, timeout_s=delete_wait_s(rec), progress=_noop)
        return []
    except CloudError:
        return [r for r in _resources(rec) if _get(api, r) is not None]


def _resources(rec: SliceRecord) -> list[str]:
    """Every cloud resource the record stands for: the queued resource first (force takes its node along), the
    node, then what earlier zones left being deleted."""
    out = [r for r in (rec.queued_resource, rec.node) if r]
    return out + [r for r in rec.leftovers if r not in out]


def _get(api: Api, resource: str):
    return api.get_queued_resource(resource) if "/queuedResources/" in resource else api.get_node(resource)


def _start_delete(api: Api, rec: SliceRecord) -> list[str]:
    started = []
    for r in _resources(rec):
        cur = _get(api, r)
        if cur is None or cur.state == "DELETING":
            continue
        try:
            ok = (api.delete_queued_resource(r, force=True) if "/queuedResources/" in r else api.delete_node(r))
        except CloudError as e:
            if e.kind not in ("precondition", "bad-argument"):  # a node whose queued resource is being deleted
                raise
            ok = False
        if ok:
            started.append(r)
    return started


def _delete_and_wait(api: Api, rec: SliceRecord, *, timeout_s: float, progress: Progress) -> list[str]:
    started = _start_delete(api, rec)
    deadline = time.monotonic() + timeout_s
    while True:
        live = [(r, cur.state) for r in _resources(rec) if (cur := _get(api, r)) is not None]
        if not live:
            return started
        left = ", ".join(f"{'queued resource' if '/queuedResources/' in r else 'node'} "
                         f"{r.rsplit('/', 1)[1]} ({r.split('/')[3]}) {st}" for r, st in live)
        if time.monotonic() > deadline:
            raise CloudError("timeout", f"deletion of {rec.name} started but it still exists after "
                                        f"{fmt_duration(timeout_s)} ({left}); run `tpuctl down {rec.name}` again later")
        progress(f"deleting {rec.name}: {left}")
        time.sleep(api.poll_s)


# ---- connections by record -----------------------------------------------------------------------------

_APIS: dict[tuple, Api] = {}


def _api_for(rec: SliceRecord, api_endpoint: str | None = None, local: bool | None = None) -> Api:
    is_local = rec.local if local is None else local
    if is_local:  # the stand-in may have been restarted on another port: resolve it each time
        return cloud.connect(local=True, project=rec.project)
    endpoint = api_endpoint or rec.api_endpoint
    key = (endpoint, rec.project)
    if key not in _APIS:  # one client per endpoint and project (each builds an HTTP session)
        _APIS[key] = cloud.connect(api_endpoint=endpoint, project=rec.project)
    return _APIS[key]


def _probe(name: str, *, project: str | None, zone: str | None, api_endpoint: str | None,
           local: bool) -> SliceRecord | None:
    """An unrecorded slice looked up in the API by name (needs a zone)."""
    if not zone:
        return None
    check_zone(zone)
    check_name(name)
    api = cloud.connect(api_endpoint=api_endpoint, local=local, project=project)
    qr_name, node_name = f"{api.parent(zone)}/queuedResources/{name}", f"{api.parent(zone)}/nodes/{name}"
    q, n = api.get_queued_resource(qr_name), api.get_node(node_name)
    if q is None and n is None:
        return None
    acc = n.accelerator if n else ""
    return SliceRecord(name=name, project=api.project, zone=zone, accelerator=acc, node=node_name,
                       queued_resource=qr_name if q else None, api_endpoint=None if local else api.endpoint,
                       local=local, labels=n.labels if n else (q.labels if q else {}), status="unrecorded")


# ---- down ----------------------------------------------------------------------------------------------

@dataclass
class DownResult:
    name: str
    deleted: list[str] = field(default_factory=list)   # resources whose deletion this call started
    nothing: bool = False                               # nothing existed: a no-op (exit 0)
    message: str = ""


def down(name: str, *, project: str | None = None, zone: str | None = None, api_endpoint: str | None = None,
         local: bool | None = None, wait: bool = True, timeout_s: float | None = None,
         progress: Progress | None = None) -> DownResult:
    """Delete the queued resource (force) and the node, idempotently; works in any state. Waits up to timeout_s
    (default: what a slice of its size takes, delete_wait_s)."""
    progress = progress or _noop
    rec = state.lookup(name)
    if rec is None:
        rec = _probe(name, project=project, zone=zone, api_endpoint=api_endpoint, local=bool(local))
        if rec is None:
            where = f" in {zone}" if zone else " in the local record (pass --zone/--project to look in the cloud)"
            return DownResult(name, nothing=True, message=f"nothing to delete: no slice named {name}{where}")
    api = _api_for(rec, api_endpoint, local)
    if wait:
        deleted = _delete_and_wait(api, rec, timeout_s=timeout_s or delete_wait_s(rec), progress=progress)
    else:
        deleted = _start_delete(api, rec)
    if rec.local:
        from infra.local_slice import LocalSlice
        if LocalSlice.stop_by_name(name):
            progress(f"stopped the local hosts of {name}")
    state.remove(name)
    if not deleted:
        return DownResult(name, nothing=True, message=f"nothing to delete: {name} no longer exists in {rec.zone} "
                                                      "(dropped it from the local record)")
    kinds = " and ".join("queued resource" if "/queuedResources/" in d else "node" for d in deleted)
    return DownResult(name, deleted, message=f"deleted {name} ({kinds}) in {rec.zone}"
                                             + ("" if wait else " (deletion started)"))


def down_all(*, local: bool | None = None, progress: Progress | None = None, **kw) -> list[DownResult]:
    names = [n for n, r in state.records().items() if local is None or r.local == local]
    return [down(n, progress=progress, **kw) for n in names]


# ---- status / ls ---------------------------------------------------------------------------------------

@dataclass
class SliceStatus:
    name: str
    state: str                 # node state when a node exists, else the queued resource's, else GONE/UNKNOWN
    queued_state: str = ""
    health: str = ""
    accelerator: str = ""
    project: str = ""
    zone: str = ""
    hosts: int = 0
    workers: list[Worker] = field(default_factory=list)
    created_at: float = 0.0
    age_s: float = 0.0
    price_per_hour: float = 0.0
    cost_so_far: float = 0.0   # list price x age while a node exists (an estimate, not the bill)
    spot: bool = False
    local: bool = False
    node: str = ""
    queued_resource: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    recorded: bool = True
    note: str = ""
    error: str = ""            # why the live state could not be read
    holds_quota: bool = False  # a FAILED or SUSPENDED queued resource: counts against quota until deleted

    def to_json(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


def _status_of(rec: SliceRecord, api: Api | None, error: str = "") -> SliceStatus:
    now = time.time()
    q = n = None
    if api is not None and not error:
        try:
            q = api.get_queued_resource(rec.queued_resource) if rec.queued_resource else None
            n = api.get_node(rec.node)
        except UserError as e:
            error = str(e)
    st = "UNKNOWN" if error else (n.state if n else (q.state if q else "GONE"))
    try:
        hosts = catalog.lookup(rec.accelerator).hosts
    except ValueError:
        hosts = len(n.workers) if n else 0
    workers = n.workers if n and n.workers else ([] if (n is None and not error) else rec.workers)
    age = max(0.0, now - rec.created_at)
    if n is not None and n.state == "READY" and rec.status != "unrecorded" and (
            rec.status != "ready" or rec.workers != n.workers):
        def fix(rs):
            if rec.name in rs:
                rs[rec.name].status, rs[rec.name].workers = "ready", n.workers
        state.update(fix)
    return SliceStatus(
        name=rec.name, state=st, queued_state=q.state if q else "", health=n.health if n else "",
        accelerator=rec.accelerator, project=rec.project, zone=rec.zone, hosts=hosts, workers=workers,
        created_at=rec.created_at, age_s=round(age, 1), price_per_hour=rec.price_per_hour,
        cost_so_far=round(rec.price_per_hour * age / 3600, 4) if n is not None else 0.0, spot=rec.spot,
        local=rec.local, node=rec.node, queued_resource=rec.queued_resource, labels=rec.labels,
        recorded=rec.status != "unrecorded", note=rec.note, error=error,
        holds_quota=bool(q and q.state in HOLDS_QUOTA))


def status(name: str, *, project: str | None = None, zone: str | None = None, api_endpoint: str | None = None,
           local: bool | None = None) -> SliceStatus:
    """One slice, refreshed from the API: state, health, workers, age, $/hour, cost so far."""
    rec = state.lookup(name) or _probe(name, project=project, zone=zone, api_endpoint=api_endpoint, local=bool(local))
    if rec is None:
        raise UserError(f"no slice named {name} in the local record (see `tpuctl ls`); to look it up in the "
                        "cloud, pass --zone and --project")
    return _status_of(rec, _api_for(rec, api_endpoint, local))


def ls(*, local: bool | None = None, api_endpoint: str | None = None) -> list[SliceStatus]:
    """Every recorded slice (local=True: only local-mode ones; False: only cloud ones), refreshed from the API."""
    out = []
    for rec in state.records().values():
        if local is not None and rec.local != local:
            continue
        try:
            api = _api_for(rec, api_endpoint, None)
            out.append(_status_of(rec, api))
        except UserError as e:  # one unreachable endpoint must not hide the other slices
            out.append(_status_of(rec, None, error=str(e)))
    return out


def workers(name: str, *, api_endpoint: str | None = None, local: bool | None = None) -> list[Worker]:
    """The slice's workers (index, internal IP, external IP), refreshed from the API."""
    st = status(name, api_endpoint=api_endpoint, local=local)
    if st.error:
        raise UserError(f"cannot read {name}'s workers: {st.error}")
    if st.state != "READY" or not st.workers:
        raise UserError(f"{name} is {st.state}, not READY: it has no workers to reach "
                        f"(`tpuctl status {name}`; `tpuctl down {name}` and `tpuctl up` again if it was preempted)")
    return st.workers


def node(name: str, *, api_endpoint: str | None = None, local: bool | None = None) -> NodeInfo | None:
    """The slice's node as the API sees it now (state READY/PREEMPTED/...), or None when it is gone."""
    rec = state.lookup(name)
    if rec is None:
        raise UserError(f"no slice named {name} in the local record (see `tpuctl ls`)")
    return _api_for(rec, api_endpoint, local).get_node(rec.node)


def spec_of(rec: SliceRecord) -> SliceSpec:
    """The SliceSpec that recreates a recorded slice (same name, zone, accelerator, labels, remaining TTL)."""
    user_labels = {k: v for k, v in rec.labels.items() if not k.startswith("tpuctl-")}
    expiry = rec.labels.get(LABEL_EXPIRY, "never")
    ttl = max(60.0, float(expiry) - time.time()) if expiry.isdigit() else None
    return SliceSpec(name=rec.name, accelerator=rec.accelerator, zones=[rec.zone], project=rec.project,
                     spot=rec.spot, reserved=rec.reserved, runtime_version=rec.runtime_version or None,
                     labels=user_labels, ttl_s=ttl, queued=rec.queued_resource is not None,
                     api_endpoint=rec.api_endpoint, local=rec.local, fresh_hosts=rec.fresh_hosts,
                     reservation=rec.reservation,
                     external_ips=rec.external_ips, network=rec.network, subnetwork=rec.subnetwork,
                     service_account=rec.service_account, scopes=list(rec.scopes) or [CLOUD_PLATFORM_SCOPE],
                     metadata=dict(rec.metadata))


def recreate(name: str, *, progress: Progress | None = None, timeout_s: float | None = None) -> UpResult:
    """Delete a (e.g. preempted) slice and create it again with the same spec; for the supervisor."""
    rec = state.lookup(name)
    if rec is None:
        raise UserError(f"no slice named {name} in the local record")
    spec = spec_of(rec)
    if timeout_s:
        spec.timeout_s = timeout_s
    down(name, progress=progress)
    return up(spec, progress=progress)


# FAILED and SUSPENDED queued resources keep counting against the project's TPU quota until someone deletes them.
HOLDS_QUOTA = ("FAILED", "SUSPENDED")


# ---- gc ------------------------------------------------------------------------------------------------

@dataclass
class GcItem:
    kind: str          # node | queued_resource | record
    name: str          # full resource name (or the slice name for a record)
    slice: str
    zone: str
    reason: str        # expired | unrecorded | holds-quota (FAILED/SUSPENDED queued resource) | gone (a record
                       # whose resources no longer exist)
    deleted: bool = False
    error: str = ""


@dataclass
class GcResult:
    items: list[GcItem]
    zones: list[str]
    skipped_zones: dict[str, str]   # zone -> why it could not be listed
    applied: bool                   # False: listed only (no --yes)


def gc(*, yes: bool = False, project: str | None = None, zones: list[str] | None = None,
       api_endpoint: str | None = None, local: bool = False, now: float | None = None) -> GcResult:
    """Find tpuctl-labelled resources that expired or that the local record no longer lists (only the current
    owner's), and records whose resources are gone; delete/drop them with yes=True."""
    now = time.time() if now is None else now
    for z in zones or []:
        check_zone(z)
    api = cloud.connect(api_endpoint=api_endpoint, local=local, project=project)
    recs = {n: r for n, r in state.records().items()
            if r.project == api.project and r.local == local and (local or r.api_endpoint == api.endpoint)}
    scan = list(zones or []) or sorted({r.zone for r in recs.values()} | set(catalog.all_zones()))
    recorded = {r.node for r in recs.values()} | {r.queued_resource for r in recs.values() if r.queued_resource}
    me = owner_label()
    items: list[GcItem] = []
    skipped: dict[str, str] = {}
    seen: set[str] = set()
    for zone in scan:
        try:
            qrs, nodes = api.list_queued_resources(zone), api.list_nodes(zone)
        except CloudError as e:
            skipped[zone] = str(e)
            continue
        seen.update(q.name for q in qrs)
        seen.update(n.name for n in nodes)
        owned_nodes = {q.node for q in qrs}
        for kind, res in [("queued_resource", q) for q in qrs] + [("node", n) for n in nodes]:
            labels = res.labels
            if LABEL_NAME not in labels:
                continue  # not tpuctl's
            if kind == "node" and res.name in owned_nodes:
                continue  # its queued resource is the thing to delete (force takes the node along)
            if getattr(res, "state", "") == "DELETING":
                continue
            expiry = labels.get(LABEL_EXPIRY, "never")
            mine = res.name in recorded or labels.get(LABEL_OWNER) == me
            if kind == "queued_resource" and res.state in HOLDS_QUOTA and mine:
                items.append(GcItem(kind, res.name, labels[LABEL_NAME], zone, f"holds-quota ({res.state})"))
            elif expiry.isdigit() and int(expiry) < now:
                items.append(GcItem(kind, res.name, labels[LABEL_NAME], zone, "expired"))
            elif res.name not in recorded and labels.get(LABEL_OWNER) == me:
                items.append(GcItem(kind, res.name, labels[LABEL_NAME], zone, "unrecorded"))
    for r in recs.values():
        young = r.status == "creating" and now - r.created_at < 600  # an `up` may be about to create it
        if (r.zone in scan and r.zone not in skipped and not young and r.node not in seen
                and (r.queued_resource or "") not in seen):
            items.append(GcItem("record", r.name, r.name, r.zone, "gone"))
    if yes:
        for it in items:
            try:
                if it.kind == "record":
                    state.remove(it.name)
                elif it.kind == "queued_resource":
                    api.delete_queued_resource(it.name, force=True)
                else:
                    api.delete_node(it.name)
                it.deleted = True
                if it.kind != "record":
                    _drop_record_of(it.name)
            except CloudError as e:
                it.error = str(e)
    return GcResult(items, scan, skipped, applied=yes)


def _drop_record_of(resource: str) -> None:
    def fix(rs):
        for n in [n for n, r in rs.items() if resource in (r.node, r.queued_resource)]:
            del rs[n]
    state.update(fix)
