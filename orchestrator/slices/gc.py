"""`gc`: tpuctl's resources that expired or that no record lists any more (the current owner's), FAILED or
SUSPENDED queued resources (they hold quota), records whose resources are gone, and what the provider still
runs for slices no record names."""
from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator import catalog, provider, state
from orchestrator.provider.cloud import CloudError
from orchestrator.provider import Provider
from orchestrator.slices.common import HOLDS_QUOTA, noop
from orchestrator.spec import LABEL_EXPIRY, LABEL_NAME, LABEL_OWNER, check_zone, owner_label


@dataclass
class GcItem:
    kind: str          # node | queued_resource | record | hosts (what the provider runs for an unrecorded slice)
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


def gc(*, where: Provider | None = None, yes: bool = False, project: str | None = None,
       zones: list[str] | None = None, api_endpoint: str | None = None, now: float | None = None) -> GcResult:
    """Find tpuctl-labelled resources that expired or that the local record no longer lists (only the current
    owner's), and records whose resources are gone; delete/drop them with yes=True."""
    now = time.time() if now is None else now
    for z in zones or []:
        check_zone(z)
    where = where or provider.chosen(False)
    api = where.connect(project=project, api_endpoint=api_endpoint)
    recs = {n: r for n, r in state.records().items() if where.owns(r, api)}
    scan = list(zones or []) or sorted({r.zone for r in recs.values()} | set(catalog.all_zones()))
    recorded = ({n for r in recs.values() for n in r.nodes}
                | {r.queued_resource for r in recs.values() if r.queued_resource})
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
        owned_nodes = {n for q in qrs for n in q.nodes}  # every slice of a multislice queued resource
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
        if (r.zone in scan and r.zone not in skipped and not young and not seen & set(r.nodes)
                and (r.queued_resource or "") not in seen):
            items.append(GcItem("record", r.name, r.name, r.zone, "gone"))
    live = set(state.records())
    # A multislice record's provider-side things carry its nodes' names (NAME-0 ...): they are not orphans.
    live |= {n.rsplit("/", 1)[-1] for r in state.records().values() if r.slices > 1 for n in r.nodes}
    items += [GcItem("hosts", n, n, "-", "unrecorded") for n in where.orphans(live)]
    if yes:
        for it in items:
            try:
                if it.kind == "record":
                    state.remove(it.name)
                elif it.kind == "hosts":
                    where.release(it.name, noop)
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
        for n in [n for n, r in rs.items() if resource in (*r.nodes, r.queued_resource)]:
            del rs[n]
    state.update(fix)
