"""Deleting a slice: the queued resource (force) and the node, in any state, idempotently, and what its provider
ends with the VMs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator import catalog, provider, state
from orchestrator.provider.cloud import Api, CloudError
from orchestrator.provider import Provider
from orchestrator.slices.common import Progress, fmt_duration, noop
from orchestrator.slices.inspect import api_of, probe
from orchestrator.state import SliceRecord


DELETE_WAIT_BASE_S = 180.0
DELETE_WAIT_PER_HOST_S = 30.0


def delete_wait_s(rec: SliceRecord) -> float:
    try:
        hosts = catalog.lookup(rec.accelerator).hosts * rec.slices
    except ValueError:
        hosts = max(1, len(rec.workers))
    return DELETE_WAIT_BASE_S + DELETE_WAIT_PER_HOST_S * hosts


def delete_quietly(api: Api, rec: SliceRecord) -> list[str]:
    """Delete what one zone's attempt created; returns the resources still being deleted when the wait ran out
    (they stay in the record as leftovers, so the next zone's attempt does not lose them)."""
    try:
        delete_and_wait(api, rec, timeout_s=delete_wait_s(rec), progress=noop)
        return []
    except CloudError:
        return [r for r in _resources(rec) if _get(api, r) is not None]


def _resources(rec: SliceRecord) -> list[str]:
    """Every cloud resource the record stands for: the queued resource first (force takes its nodes along), the
    node(s) (each slice's of a multislice one), then what earlier zones left being deleted."""
    out = [r for r in (rec.queued_resource, *rec.nodes) if r]
    return out + [r for r in rec.leftovers if r not in out]


def _get(api: Api, resource: str):
    return api.get_queued_resource(resource) if "/queuedResources/" in resource else api.get_node(resource)


def start_delete(api: Api, rec: SliceRecord) -> list[str]:
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


def delete_and_wait(api: Api, rec: SliceRecord, *, timeout_s: float, progress: Progress) -> list[str]:
    started = start_delete(api, rec)
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


@dataclass
class DownResult:
    name: str
    deleted: list[str] = field(default_factory=list)   # resources whose deletion this call started
    nothing: bool = False                               # nothing existed: a no-op (exit 0)
    message: str = ""


def down(name: str, *, where: Provider | None = None, project: str | None = None, zone: str | None = None,
         api_endpoint: str | None = None, wait: bool = True, timeout_s: float | None = None,
         progress: Progress | None = None) -> DownResult:
    """Delete the queued resource (force) and the node, idempotently; works in any state. Waits up to timeout_s
    (default: what a slice of its size takes, delete_wait_s). A name not in the local record is looked up with
    `where` (the user's --local or not) in --zone."""
    progress = progress or noop
    where = where or provider.chosen(False)
    rec = state.lookup(name)
    if rec is None:
        rec = probe(name, where, project=project, zone=zone, api_endpoint=api_endpoint)
        if rec is None:
            where.release(name, progress)  # whatever the provider still runs under that name
            loc = f" in {zone}" if zone else " in the local record (pass --zone/--project to look in the cloud)"
            return DownResult(name, nothing=True, message=f"nothing to delete: no slice named {name}{loc}")
    api = api_of(rec, api_endpoint)
    if wait:
        deleted = delete_and_wait(api, rec, timeout_s=timeout_s or delete_wait_s(rec), progress=progress)
    else:
        deleted = start_delete(api, rec)
    provider.of(rec).release(name, progress)
    state.remove(name)
    if not deleted:
        return DownResult(name, nothing=True, message=f"nothing to delete: {name} no longer exists in {rec.zone} "
                                                      "(dropped it from the local record)")
    kinds = " and ".join("queued resource" if "/queuedResources/" in d else "node" for d in deleted)
    return DownResult(name, deleted, message=f"deleted {name} ({kinds}) in {rec.zone}"
                                             + ("" if wait else " (deletion started)"))
