"""Reading slices: status, ls, workers, node. Reading has no side effect; `refresh` writes what it read back into
the local record, and only the commands that promise that (`tpuctl status`) call it."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from orchestrator import catalog, provider, state
from orchestrator.provider.cloud import Api, NodeInfo
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


def joined_workers(nodes: list[NodeInfo]) -> list[Worker]:
    """The workers of a job over these nodes, in JAX process order: one node's as the API lists them; a
    multislice one's slice-major (slice 0's workers, then slice 1's ...), each tagged with its slice."""
    if len(nodes) == 1:
        return list(nodes[0].workers)
    return [replace(w, slice=s) for s, n in enumerate(nodes) for w in n.workers]


def _overall(nodes: list[NodeInfo | None], q) -> str:
    """One state for the slice(s): READY only when every node is; else the first node that is not (a
    preempted slice makes the whole multislice job lost); a node gone: its queued resource's state, or GONE."""
    if nodes and all(n is not None for n in nodes):
        bad = [n for n in nodes if n.state != "READY"]
        return bad[0].state if bad else "READY"
    if any(n is not None for n in nodes) and q is None:
        return next(n.state for n in nodes if n is not None)
    return q.state if q is not None else "GONE"


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
    slices: int = 1
    nodes: list[dict] = field(default_factory=list)  # per slice: name, state, health, workers
    ready_workers: list[Worker] | None = field(default=None, repr=False, compare=False)  # every node READY

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("ready_workers")
        return d


def status_of(rec: SliceRecord, api: Api | None, error: str = "") -> SliceStatus:
    now = time.time()
    q = n = None
    nodes: list[NodeInfo | None] = []
    if api is not None and not error:
        try:
            q = api.get_queued_resource(rec.queued_resource) if rec.queued_resource else None
            nodes = [api.get_node(name) for name in rec.nodes]
        except UserError as e:
            error = str(e)
    live = [x for x in nodes if x is not None]
    n = live[0] if live else None
    st = "UNKNOWN" if error else _overall(nodes, q)
    try:
        hosts = catalog.lookup(rec.accelerator).hosts * rec.slices
    except ValueError:
        hosts = sum(len(x.workers) for x in live)
    all_ready = bool(nodes) and len(live) == len(nodes) and all(x.state == "READY" for x in live)
    workers = (joined_workers(live) if live and len(live) == len(nodes) and all(x.workers for x in live)
               else ([] if (not live and not error) else rec.workers))
    per_slice = [{"slice": i, "node": name, "state": x.state if x else "GONE", "health": x.health if x else "",
                  "workers": len(x.workers) if x else 0} for i, (name, x) in enumerate(zip(rec.nodes, nodes))]
    age = max(0.0, now - rec.created_at)
    return SliceStatus(
        name=rec.name, state=st, queued_state=q.state if q else "", health=n.health if n else "",
        accelerator=rec.accelerator, project=rec.project, zone=rec.zone, hosts=hosts, workers=workers,
        created_at=rec.created_at, age_s=round(age, 1), price_per_hour=rec.price_per_hour,
        cost_so_far=round(rec.price_per_hour * age / 3600, 4) if n is not None else 0.0, spot=rec.spot,
        provider=rec.provider, node=rec.node, queued_resource=rec.queued_resource, labels=rec.labels,
        recorded=rec.status != "unrecorded", note=rec.note, error=error,
        holds_quota=bool(q and q.state in HOLDS_QUOTA), slices=rec.slices,
        nodes=per_slice if rec.slices > 1 else [], ready_workers=workers if all_ready else None)


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
    ready = st.ready_workers
    if ready is not None and st.recorded:
        def fix(rs):
            rec = rs.get(name)
            if rec is not None and (rec.status != "ready" or rec.workers != ready):
                rec.status, rec.workers = "ready", ready
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
