"""Reading slices: status, ls, workers, node. Reading has no side effect; `refresh` writes what it read back into
the local record, and only the commands that promise that (`tpuctl status`) call it."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from orchestrator import catalog, provider, state
from orchestrator.cloud import Api, NodeInfo
from orchestrator.provider import Provider
from orchestrator.slices.common import HOLDS_QUOTA
from orchestrator.spec import UserError, check_name, check_zone
from orchestrator.state import SliceRecord, Worker


def api_of(rec: SliceRecord, api_endpoint: str | None = None) -> Api:
    """The API that holds a recorded slice (api_endpoint: read a cloud record through another endpoint)."""
    return provider.of(rec).api_for(rec, api_endpoint)


def probe(name: str, where: Provider, *, project: str | None, zone: str | None,
          api_endpoint: str | None) -> SliceRecord | None:
    """An unrecorded slice looked up in the API by name (needs a zone)."""
    if not zone:
        return None
    check_zone(zone)
    check_name(name)
    api = where.connect(project=project, api_endpoint=api_endpoint)
    qr_name, node_name = f"{api.parent(zone)}/queuedResources/{name}", f"{api.parent(zone)}/nodes/{name}"
    q, n = api.get_queued_resource(qr_name), api.get_node(node_name)
    if q is None and n is None:
        return None
    acc = n.accelerator if n else ""
    return SliceRecord(name=name, project=api.project, zone=zone, accelerator=acc, node=node_name,
                       queued_resource=qr_name if q else None, api_endpoint=where.endpoint_of(api),
                       provider=where.kind, labels=n.labels if n else (q.labels if q else {}), status="unrecorded")


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
    provider: str = ""
    node: str = ""
    queued_resource: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    recorded: bool = True
    note: str = ""
    error: str = ""            # why the live state could not be read
    holds_quota: bool = False  # a FAILED or SUSPENDED queued resource: counts against quota until deleted
    ready_node: NodeInfo | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("ready_node")
        return d


def status_of(rec: SliceRecord, api: Api | None, error: str = "") -> SliceStatus:
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
    return SliceStatus(
        name=rec.name, state=st, queued_state=q.state if q else "", health=n.health if n else "",
        accelerator=rec.accelerator, project=rec.project, zone=rec.zone, hosts=hosts, workers=workers,
        created_at=rec.created_at, age_s=round(age, 1), price_per_hour=rec.price_per_hour,
        cost_so_far=round(rec.price_per_hour * age / 3600, 4) if n is not None else 0.0, spot=rec.spot,
        provider=rec.provider, node=rec.node, queued_resource=rec.queued_resource, labels=rec.labels,
        recorded=rec.status != "unrecorded", note=rec.note, error=error,
        holds_quota=bool(q and q.state in HOLDS_QUOTA), ready_node=n if n is not None and n.state == "READY" else None)


def status(name: str, *, where: Provider | None = None, project: str | None = None, zone: str | None = None,
           api_endpoint: str | None = None) -> SliceStatus:
    """One slice, read from the API: state, health, workers, age, $/hour, cost so far. A name not in the local
    record is looked up with `where` (the user's --local or not) in --zone."""
    rec = state.lookup(name) or probe(name, where or provider.chosen(False), project=project, zone=zone,
                                      api_endpoint=api_endpoint)
    if rec is None:
        raise UserError(f"no slice named {name} in the local record (see `tpuctl ls`); to look it up in the "
                        "cloud, pass --zone and --project")
    return status_of(rec, api_of(rec, api_endpoint))


def refresh(name: str, **kw) -> SliceStatus:
    """status(), and a READY node's state and workers written into the record (a slice that became READY after
    `up` stopped waiting for it, or whose workers changed)."""
    st = status(name, **kw)
    n = st.ready_node
    if n is not None and st.recorded:
        def fix(rs):
            rec = rs.get(name)
            if rec is not None and (rec.status != "ready" or rec.workers != n.workers):
                rec.status, rec.workers = "ready", n.workers
        state.update(fix)
    return st


def ls(*, kind: str | None = None, api_endpoint: str | None = None) -> list[SliceStatus]:
    """Every recorded slice (kind: only those of one provider), read from the API."""
    out = []
    for rec in state.records().values():
        if kind is not None and rec.provider != kind:
            continue
        try:
            out.append(status_of(rec, api_of(rec, api_endpoint)))
        except UserError as e:  # one unreachable endpoint must not hide the other slices
            out.append(status_of(rec, None, error=str(e)))
    return out


def workers(name: str) -> list[Worker]:
    """The slice's workers (index, internal IP, external IP), read from the API."""
    st = status(name)
    if st.error:
        raise UserError(f"cannot read {name}'s workers: {st.error}")
    if st.state != "READY" or not st.workers:
        raise UserError(f"{name} is {st.state}, not READY: it has no workers to reach "
                        f"(`tpuctl status {name}`; `tpuctl down {name}` and `tpuctl up` again if it was preempted)")
    return st.workers


def node(name: str) -> NodeInfo | None:
    """The slice's node as the API sees it now (state READY/PREEMPTED/...), or None when it is gone."""
    rec = state.lookup(name)
    if rec is None:
        raise UserError(f"no slice named {name} in the local record (see `tpuctl ls`)")
    return api_of(rec).get_node(rec.node)
