"""Creating a slice: `up` (validate, plan, create a queued resource or a node, wait for READY, record) and
`recreate` (the same spec again, after a preemption).

Invariant of `up`: the local record is written *before* the create call, so from then on anything in the cloud
is findable by name; a failure after the create call (stockout, timeout, Ctrl-C) either deletes what was
created and drops the record, or keeps the record (status "failed"/"waiting") so `down` and `gc` find it.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable

from orchestrator import provider, state
from orchestrator.provider import cloud
from orchestrator.access import oslogin
from orchestrator.provider.cloud import Api, CloudError, NodeInfo
from orchestrator.provider import Provider
from orchestrator.slices.common import Progress, fmt_duration, noop
from orchestrator.slices.delete import delete_and_wait, delete_quietly, delete_wait_s, down
from orchestrator.slices.inspect import joined_workers, status
from orchestrator.slices.quote import Plan, labels_of, make_plan, usable_zones
from orchestrator.spec import CLOUD_PLATFORM_SCOPE, LABEL_EXPIRY, SliceSpec, UserError
from orchestrator.state import SliceRecord, Worker

_WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "STATE_UNSPECIFIED")


class Interrupted(UserError):
    """up was interrupted (Ctrl-C / SIGTERM); the message says what was cleaned up."""


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
    progress = progress or noop
    t0 = time.monotonic()
    spec.validate()
    where = provider.get(spec.provider)
    where.check(spec)
    spec.zones = spec.zones or where.default_zones(spec)
    api = where.connect(project=spec.project, api_endpoint=spec.api_endpoint)
    api.on_retry = progress
    _check_name_free(spec.name)
    zones = usable_zones(api, spec, progress)
    plan = make_plan(spec, api.project, zones)
    if on_plan:
        on_plan(plan)
    if dry_run:
        rec = SliceRecord(name=spec.name, project=api.project, zone=zones[0], accelerator=spec.accelerator,
                          node=f"{api.parent(zones[0])}/nodes/{spec.name}" + ("-0" if spec.num_slices > 1 else ""),
                          slices=spec.num_slices, labels=plan.labels,
                          price_per_hour=plan.price_per_hour, status="planned")
        return UpResult(rec, plan, [], time.monotonic() - t0)
    if oslogin.applies(api.project, spec.metadata, api.endpoint, progress):
        _register_os_login(spec, api.project, progress)  # the VMs ignore ssh-keys metadata: none is written
    else:
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
            rec = _create_in_zone(api, where, spec, zone, deadline, progress, claim_id, leftovers)
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
    from orchestrator.access import sshkeys
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


def _register_os_login(spec: SliceSpec, project: str, progress: Progress) -> None:
    """OS Login: the user's key (made if missing) goes to the account's login profile, kept as long as the slice."""
    from orchestrator.access import sshkeys
    try:
        path, pub, created = sshkeys.ensure_key()
    except (sshkeys.SshKeyError, OSError) as e:
        raise UserError(str(e)) from None
    if created:
        progress(f"made the SSH key {path} (ed25519) that new VMs will let in")
    who = oslogin.account()
    user = oslogin.register(pub, project=project, account_email=who, ttl_s=spec.ttl_s)
    progress(f"OS Login is on in {project}: registered {path}.pub for {who} (POSIX user {user}"
             + (", expires with the slice's --ttl" if spec.ttl_s else "") + "); no ssh-keys metadata")


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
        node=f"{api.parent(zone)}/nodes/{spec.name}" + ("-0" if spec.num_slices > 1 else ""),
        queued_resource=f"{api.parent(zone)}/queuedResources/{spec.name}" if spec.queued else None,
        slices=spec.num_slices,
        api_endpoint=provider.get(spec.provider).endpoint_of(api), provider=spec.provider,
        provider_options=dict(spec.provider_options), labels=labels_of(spec),
        price_per_hour=acc.price_per_hour(zone, spec.spot) * spec.num_slices, spot=spec.spot, reserved=spec.reserved,
        runtime_version=spec.runtime, status="creating", claim=claim_id,
        reservation=api.reservation_path(zone, spec.reservation) if spec.reservation else None,
        external_ips=spec.external_ips, network=spec.network, subnetwork=spec.subnetwork,
        service_account=spec.service_account, scopes=list(spec.scopes), metadata=dict(spec.metadata),
        ssh_proxy_command=spec.ssh_proxy_command, iap=spec.iap)


def _save(rec: SliceRecord) -> None:
    """Write our record; if it was dropped meanwhile (down, gc), write it again: what exists must stay findable."""
    if not state.save_claimed(rec):
        state.claim(rec)


def _create_in_zone(api: Api, where: Provider, spec: SliceSpec, zone: str, deadline: float, progress: Progress,
                    claim_id: str, leftovers: list[str]) -> SliceRecord:
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
                                            valid_until_s(spec.capacity_wait_s), reservation=rec.reservation,
                                            node_count=spec.num_slices)
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
        nodes = _wait_ready(api, rec, op, spec, deadline, progress, last)
    except CloudError as e:
        if e.kind == "capacity":
            progress(f"no capacity in {zone}: deleting the {what}")
            leftovers.extend(delete_quietly(api, rec))
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
    rec.workers, rec.status = joined_workers(nodes), "ready"
    rec.workers = where.attach(api, rec, progress)
    _save(rec)
    return rec


# A queued resource's server-side validUntilDuration is this much longer than tpuctl's own --capacity-wait, so
# that tpuctl gives up first, with its own message, and deletes it; the server's limit only catches a tpuctl that
# died while waiting.
VALID_UNTIL_MARGIN_S = 300.0


def valid_until_s(capacity_wait_s: float) -> float:
    return capacity_wait_s + max(VALID_UNTIL_MARGIN_S, capacity_wait_s / 2)


def _wait_ready(api: Api, rec: SliceRecord, op, spec: SliceSpec, deadline: float, progress: Progress,
                last: dict) -> list[NodeInfo]:
    """Every node of the record READY with its workers (one, or each slice's of a multislice one)."""
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
        nodes: list[NodeInfo | None] = []
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
                nodes = [api.get_node(n) for n in rec.nodes]
        elif not rec.queued_resource:
            nodes = [api.get_node(rec.node)]
        elif op_done:
            raise CloudError("failed", f"the queued resource {rec.queued_resource} disappeared while waiting "
                                       "(deleted elsewhere?)")
        seen = [n for n in nodes if n is not None]
        for node in seen:
            last["state"] = node.state
            if node.state in ("PREEMPTED", "TERMINATED", "STOPPED", "DELETING"):
                raise CloudError("failed", f"the node {node.name.rsplit('/', 1)[1]} went {node.state} before it "
                                           "was ready")
        if seen and len(seen) == len(rec.nodes) and all(n.state == "READY" and n.workers for n in seen):
            return seen
        parts = ([f"queued resource {q.state}"] if q is not None else []) + (
            [f"node {seen[0].state}"] if len(seen) == 1 and rec.slices == 1 else
            [f"{sum(n.state == 'READY' for n in seen)}/{rec.slices} slices READY"] if seen else [])
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
        delete_and_wait(api, rec, timeout_s=delete_wait_s(rec), progress=noop)
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
def spec_of(rec: SliceRecord) -> SliceSpec:
    """The SliceSpec that recreates a recorded slice (same name, zone, accelerator, labels, remaining TTL)."""
    user_labels = {k: v for k, v in rec.labels.items() if not k.startswith("tpuctl-")}
    expiry = rec.labels.get(LABEL_EXPIRY, "never")
    ttl = max(60.0, float(expiry) - time.time()) if expiry.isdigit() else None
    return SliceSpec(name=rec.name, accelerator=rec.accelerator, zones=[rec.zone], project=rec.project,
                     spot=rec.spot, reserved=rec.reserved, runtime_version=rec.runtime_version or None,
                     labels=user_labels, ttl_s=ttl, queued=rec.queued_resource is not None,
                     api_endpoint=rec.api_endpoint, provider=rec.provider,
                     provider_options=dict(rec.provider_options), reservation=rec.reservation,
                     external_ips=rec.external_ips, network=rec.network, subnetwork=rec.subnetwork,
                     service_account=rec.service_account, scopes=list(rec.scopes) or [CLOUD_PLATFORM_SCOPE],
                     metadata=dict(rec.metadata), ssh_proxy_command=rec.ssh_proxy_command, iap=rec.iap,
                     num_slices=rec.slices)


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
