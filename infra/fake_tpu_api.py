"""A local stand-in of the Cloud TPU v2 REST API, so the real `google-cloud-tpu` client is what tests exercise.

Speaks `/v2/projects/P/locations/Z/{nodes,queuedResources,acceleratorTypes,runtimeVersions,operations}` (and
`nodes/N:getGuestAttributes`) in
camelCase JSON, with long-running operations shaped the way the client's strict parser wants them. State moves
with the clock (no background thread: every request first advances everything to "now"):

  node:            CREATING --creating_s--> READY --(preempt)--> PREEMPTED | TERMINATED;
                   DELETE -> DELETING --deleting_s--> gone
  queued resource: ACCEPTED --accept_s--> WAITING_FOR_RESOURCES --waiting_s--> PROVISIONING --(node READY)--> ACTIVE
                   stockout: stays WAITING_FOR_RESOURCES until its validUntil (or the injection's fail_after_s)
                   passes -> FAILED (code 8); a preempted node (or one deleted directly) makes it SUSPENDING
                   while the service deletes the node (DELETING), then SUSPENDED; DELETE ?force -> DELETING -> gone.
                   FAILED and SUSPENDED ones stay (and hold quota) until deleted.
  deleting takes deleting_s + deleting_per_host_s x worker VMs.

A control API under /_fake/ (JSON; FakeControl is its client):
  GET  health | state            state: live nodes/queued resources (with `history`), `gone`, create_calls
                                 (each with the request `body` as it arrived),
                                 delete_calls, injections, worker_ips, zones, config
  POST inject {kind, zone?, accelerator?, project?, resource?, op?, times?, message?, ...}
       op: which request it answers (create, get, list, delete, operation, accelerator_types,
       runtime_versions, locations, guest_attributes, any). The real API's answers, each with its HTTP status, `error.status`
       and `details` (see _error_for; FakeControl has a method per kind):
         stockout {fail_after_s?}   code 8 in the create LRO; a queued resource waits, then FAILED
         reserved_capacity {sync?}  FAILED_PRECONDITION "Insufficient reserved capacity" (LRO code 9 / HTTP 400)
         spot_preempted {sync?}     INVALID_ARGUMENT "... while in state PREEMPTED" (LRO code 3 / HTTP 400)
         reservation_not_found      404 NOT_FOUND "Reservation not found" (also for any unknown reservationName)
         location                   403 "Location Z is not found or access is unauthorized." (unknown zones too)
         service_disabled | billing_disabled | location_policy | permission   403 + ErrorInfo.reason
         quota {quota?, limit?, async?}   429 + QuotaFailure, per region (async: code 8 in the LRO)
         rate_limit                 429 + ErrorInfo RATE_LIMIT_EXCEEDED
         unavailable | internal     503 | 500;   bad_argument {message?}   400 INVALID_ARGUMENT
         never_ready, slow {creating_s}, pending_create {pending_s}: a queued resource's create operation
         stays pending (the resource ACCEPTED) that long
  POST clear {kind?} · config {creating_s, deleting_s, deleting_per_host_s, suspend_s, accept_s, waiting_s,
       stockout_fail_s} · reset
  POST zones {zones: {zone: [types]}} or {zone, accelerator_types} · runtime_versions {versions}
  POST reservations {name}           a reservation that a queued resource's reservationName may name
  POST workers {ips: [...] | null}   nodes created afterwards get these IPs (ipAddress and externalIp), port 8470
  POST vm_hosts {node, name, hosts, base_dir, fresh?, authorized_keys?}   local mode: the node's VMs as sshd
       hosts (a LocalSlice) started by this process and bound to the node: a preemption or delete of the node
       stops them, as the cloud kills its VMs
  POST node_workers {node, ips, external?}  set them on an existing node (external: other external IPs)
  POST guest_attributes {node, worker, items: [{namespace?, key, value}], namespace?}   what a worker's guest
                                     agent publishes (namespace: replace only that one's items, e.g. hostkeys)
  POST preempt {node, state?: PREEMPTED|TERMINATED}   a READY node; in a queued resource it goes DELETING, then
                                     is gone, and its queued resource goes SUSPENDING, then SUSPENDED

Run: python -m infra.fake_tpu_api --port 8470 [--host 127.0.0.1]    or, in tests: start_in_thread().
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from infra import serving
from infra.serving import Control
from infra.gcp_ids import project_number

OP_META = "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata"
T_NODE = "type.googleapis.com/google.cloud.tpu.v2.Node"
T_QR = "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"
T_EMPTY = "type.googleapis.com/google.protobuf.Empty"
_ID_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
# Node fields a request may carry that we echo back; anything else would break the client's strict LRO parser.
_NODE_SPEC_FIELDS = ("description", "acceleratorType", "acceleratorConfig", "runtimeVersion", "networkConfig",
                     "cidrBlock", "serviceAccount", "schedulingConfig", "labels", "metadata", "tags",
                     "dataDisks", "shieldedInstanceConfig")
_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 409: "ALREADY_EXISTS",
           429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
# google.rpc.Code numbers, as an LRO's or a FAILED queued resource's error carries them.
RPC_CODES = {"INVALID_ARGUMENT": 3, "NOT_FOUND": 5, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8,
             "FAILED_PRECONDITION": 9, "INTERNAL": 13, "UNAVAILABLE": 14}
T_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
T_QUOTA_FAILURE = "type.googleapis.com/google.rpc.QuotaFailure"
# Answers the real API gives, injectable by name (see _error_for). Capacity kinds fail the create; the others
# fail whichever request they match (`op`).
ERROR_KINDS = ("reserved_capacity", "spot_preempted", "reservation_not_found", "location", "service_disabled",
               "billing_disabled", "location_policy", "permission", "quota", "rate_limit", "unavailable",
               "internal", "bad_argument")
INJECTION_KINDS = ("stockout", "never_ready", "slow", "pending_create") + ERROR_KINDS
# The request an injection matches: `op` names, by route.
OPS = ("create", "get", "list", "delete", "operation", "accelerator_types", "runtime_versions", "locations",
       "guest_attributes", "any")
# Checked before anything else in a request (any op by default, except where noted) ...
_EARLY_KINDS = ("location", "service_disabled", "billing_disabled", "location_policy", "permission", "rate_limit",
                "unavailable", "internal", "bad_argument")
# ... and, on create, after the request was validated: capacity, reservations, chip quota.
_LATE_KINDS = ("reserved_capacity", "spot_preempted", "reservation_not_found", "quota")
_DEFAULT_OP = {"permission": "create", "bad_argument": "create", "stockout": "create", "never_ready": "create",
               "slow": "create", "pending_create": "create", **{k: "create" for k in _LATE_KINDS}}


@dataclass
class FakeConfig:
    creating_s: float = 0.3     # node CREATING -> READY
    deleting_s: float = 0.1     # DELETING -> gone (plus deleting_per_host_s per worker VM)
    deleting_per_host_s: float = 0.0  # a multi-host slice takes longer to delete (minutes for the real one)
    suspend_s: float = 0.0      # a preempted node in a queued resource stays PREEMPTED/TERMINATED this long
                                # before the service deletes it
    accept_s: float = 0.05      # queued resource ACCEPTED -> WAITING_FOR_RESOURCES
    waiting_s: float = 0.05     # WAITING_FOR_RESOURCES -> PROVISIONING when there is capacity
    stockout_fail_s: float = 0.2  # plain-node stockout: the create LRO fails after this
    idle_timeout_s: float = 0.0   # >0: the server exits after this long without a request
    zones: dict[str, list[str]] | None = None   # zone -> accelerator types; None: OFFERED
    runtime_versions: list[str] | None = None


# What the service offers, kept here on its own (Google's TPU regions-and-zones and version pages): tpuctl's
# catalog is checked against this table, so a wrong catalog entry fails a test instead of being agreed with.
# generation -> (AcceleratorConfig type, {size in the name: (topology, worker VMs)})
_CUBE = {8: ("2x2x1", 1), 16: ("2x2x2", 2), 32: ("2x2x4", 4), 64: ("2x4x4", 8), 128: ("4x4x4", 16),
         256: ("4x4x8", 32), 512: ("4x8x8", 64), 1024: ("8x8x8", 128), 2048: ("8x8x16", 256), 4096: ("8x16x16", 512)}
_PLANE = {1: ("1x1", 1), 4: ("2x2", 1), 8: ("2x4", 1), 16: ("4x4", 4), 32: ("4x8", 8), 64: ("8x8", 16),
          128: ("8x16", 32), 256: ("16x16", 64)}
SHAPES: dict[str, tuple[str, dict[int, tuple[str, int]]]] = {
    "v2": ("V2", {8: ("2x2", 1)}),
    "v3": ("V3", {8: ("2x2", 1)}),
    "v4": ("V4", _CUBE),
    "v5p": ("V5P", {**_CUBE, 8192: ("16x16x16", 1024), 12288: ("16x16x24", 1536)}),
    "v5litepod": ("V5LITE_POD", _PLANE),
    "v6e": ("V6E", _PLANE),
}
OFFERED: dict[str, tuple[str, ...]] = {  # zone -> generations offered there
    "us-central1-a": ("v3", "v5p", "v5litepod"),
    "us-central1-b": ("v2", "v3", "v6e"),
    "us-central1-c": ("v2",),
    "us-central1-f": ("v2", "v3"),
    "us-central2-b": ("v4",),
    "us-east1-d": ("v6e",),
    "us-east5-a": ("v5p", "v5litepod", "v6e"),
    "us-east5-b": ("v5litepod", "v6e"),
    "us-east5-c": ("v5litepod",),
    "us-south1-a": ("v5litepod",),
    "us-west1-c": ("v5litepod",),
    "us-west4-a": ("v5litepod",),
    "europe-west4-a": ("v2", "v3", "v6e"),
    "europe-west4-b": ("v5p", "v5litepod"),
}
RUNTIME_VERSIONS = ("tpu-ubuntu2204-base", "tpu-vm-base", "tpu-vm-tf-2.16.1-pjrt", "v2-alpha-tpuv5",
                    "v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e")


def default_zones() -> dict[str, list[str]]:
    return {z: [f"{g}-{size}" for g in gens for size in SHAPES[g][1]] for z, gens in OFFERED.items()}


def default_runtime_versions() -> list[str]:
    return list(RUNTIME_VERSIONS)


def _shape(accelerator: str) -> tuple[str, str, int]:
    """(AcceleratorConfig type, topology, worker count) for an accelerator type name."""
    gen, _, size = accelerator.rpartition("-")
    if gen in SHAPES and size.isdigit() and int(size) in SHAPES[gen][1]:
        topology, hosts = SHAPES[gen][1][int(size)]
        return SHAPES[gen][0], topology, hosts
    return "TYPE_UNSPECIFIED", "", 1


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _duration_s(text) -> float | None:
    if not text:
        return None
    return float(str(text).rstrip("s"))


class ApiError(Exception):
    def __init__(self, code: int, message: str, details: list | None = None, status: str | None = None):
        super().__init__(message)
        self.code, self.message, self.details = code, message, details or []
        self.status = status or _STATUS.get(code, "UNKNOWN")

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "status": self.status, "details": self.details}}

    def rpc_status(self) -> dict:
        """The google.rpc.Status an LRO or a FAILED queued resource reports for the same failure."""
        return {"code": RPC_CODES.get(self.status, 2), "message": self.message}


class _Tracked:
    """Keeps every state a resource passed through (GET /_fake/state shows it as `history`)."""

    def __setattr__(self, key, value):
        if key == "state":
            self.__dict__.setdefault("history", []).append(value)
        object.__setattr__(self, key, value)


@dataclass
class _Node(_Tracked):
    name: str
    project: str
    zone: str
    spec: dict
    hosts: int
    created: float
    t_ready: float | None            # None: READY never comes
    state: str = "CREATING"
    qr: str | None = None
    t_fail: float | None = None      # plain-node failure (stockout / async quota): removed, its LRO errors
    fail_error: dict | None = None
    t_gone: float | None = None
    t_suspend: float | None = None   # preempted in a queued resource: the service deletes it from then on
    endpoints: list[dict] = field(default_factory=list)
    id: int = 0
    # What each worker's guest agent has published: worker index -> [{namespace, key, value}] (none until set
    # through /_fake/guest_attributes: the agent starts after the VM reports READY).
    guest_attributes: dict[int, list[dict]] = field(default_factory=dict)


@dataclass
class _QR(_Tracked):
    name: str
    project: str
    zone: str
    body: dict
    created: float
    t_waiting: float
    t_fail: float | None = None      # FAILED at this time when still waiting
    fail_error: dict | None = None   # the error it fails with
    blocked_by: int | None = None    # id of the stockout injection that keeps it waiting
    slow_creating_s: float | None = None
    never_ready: bool = False
    state: str = "ACCEPTED"
    initiator: str = "USER"
    node: str | None = None          # its first node (the only one unless multislice)
    nodes: list[str] = field(default_factory=list)  # every node it provisioned, slice by slice
    t_provision: float | None = None
    t_gone: float | None = None
    error: dict | None = None


@dataclass
class _Op:
    name: str
    verb: str        # create | delete
    kind: str        # node | queuedResource
    target: str
    created: float
    done: bool = False
    result: dict | None = None      # {"response": ...} or {"error": ...}, frozen once done
    t_done: float | None = None     # a create operation that stays pending until then


class FakeTpu:
    """The stand-in's state. Every public method takes the lock and first advances the clock."""

    def __init__(self, config: FakeConfig | None = None):
        self.config = config or FakeConfig()
        self._initial = dataclasses.replace(self.config)
        self.zones = {z: list(t) for z, t in (self.config.zones or default_zones()).items()}
        self.runtime_versions = list(self.config.runtime_versions or default_runtime_versions())
        self.lock = threading.RLock()
        self.nodes: dict[str, _Node] = {}
        self.qrs: dict[str, _QR] = {}
        self.ops: dict[str, _Op] = {}
        self.create_calls: list[dict] = []
        self.delete_calls: list[dict] = []
        self.gone: list[dict] = []  # resources that no longer exist, with the states they went through
        self.injections: list[dict] = []
        self.reservations: dict[str, dict] = {}  # full reservation name -> {}
        self.worker_ips: list[str] | None = None
        self._ids = itertools.count(1)
        self.last_request = time.monotonic()
        self._failed: dict[str, dict] = {}  # plain nodes that failed to create -> the error their LRO reports
        # Local mode's VMs: node -> the local slice (infra/local_slice.py) whose sshd hosts are its VMs. They die
        # with the node (preempted, deleted), as real VMs do, whoever is watching or not.
        self.vm_hosts: dict[str, dict] = {}
        self._dying: dict[str, threading.Thread] = {}  # node -> its VMs stopping after a delete (`_vms_die`)

    # ---- clock ------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for q in list(self.qrs.values()):
            self._tick_qr(q, now)
        for n in list(self.nodes.values()):
            self._tick_node(n, now)
        for q in list(self.qrs.values()):  # a node that just became READY or PREEMPTED moves its QR
            self._tick_qr(q, now)
        for op in self.ops.values():
            self._tick_op(op)

    def _tick_node(self, n: _Node, now: float) -> None:
        if n.state == "CREATING" and n.t_fail is not None and now >= n.t_fail:
            self._gone("node", n)
        elif n.state == "CREATING" and n.t_ready is not None and now >= n.t_ready:
            n.state = "READY"
            n.endpoints = n.endpoints or self._endpoints(n)
        elif n.state == "DELETING" and now >= (n.t_gone or 0) and self._vms_gone(n.name):
            self._gone("node", n)

    def _tick_qr(self, q: _QR, now: float) -> None:
        if q.state == "ACCEPTED" and now >= q.t_waiting:
            q.state = "WAITING_FOR_RESOURCES"
        if q.state == "WAITING_FOR_RESOURCES":
            blocked = q.blocked_by is not None and any(i["id"] == q.blocked_by for i in self.injections)
            if q.fail_error is not None and now >= (q.t_fail or 0):      # e.g. an asynchronous quota error
                q.state, q.error, q.initiator = "FAILED", q.fail_error, "SERVICE"
            elif blocked:                                                 # stockout: wait, maybe fail
                if q.t_fail is not None and now >= q.t_fail:
                    q.state, q.initiator = "FAILED", "SERVICE"
                    q.error = {"code": 8, "message": _stockout_message(q.zone)}
            elif now >= q.t_waiting + self.config.waiting_s:             # capacity (again)
                self._provision(q, now)
        mine = [self.nodes[n] for n in q.nodes if n in self.nodes]
        if q.state == "PROVISIONING":
            # A multislice queued resource is ACTIVE once every slice is READY: all of them or none.
            if mine and len(mine) == len(q.nodes) and all(n.state == "READY" for n in mine):
                q.state = "ACTIVE"
        if q.state == "ACTIVE":
            lost = [n for n in mine if n.state in ("PREEMPTED", "TERMINATED")]
            if lost or len(mine) < len(q.nodes):
                # The service deletes a preempted queued resource's preempted nodes: SUSPENDING while they go.
                # With multislice the job of every slice is lost with one; the healthy slices' nodes stay until
                # the queued resource is deleted (force) or recreated.
                q.state, q.initiator = "SUSPENDING", "SERVICE"
                for node in lost:
                    node.t_suspend = now + self.config.suspend_s   # when the service starts deleting it
        if q.state == "SUSPENDING":
            for node in mine:
                if node.state in ("PREEMPTED", "TERMINATED") and now >= (node.t_suspend or 0):
                    node.state, node.t_gone = "DELETING", self._deleting(node.hosts, now)
        if q.state == "SUSPENDING" and not any(n.state in ("PREEMPTED", "TERMINATED", "DELETING") for n in
                                               (self.nodes[x] for x in q.nodes if x in self.nodes)):
            q.state = "SUSPENDED"
        if q.state == "DELETING" and now >= (q.t_gone or 0) and all(self._vms_gone(n) for n in q.nodes):
            self._gone("queuedResource", q)

    def _gone(self, kind: str, obj) -> None:
        if kind == "node":
            self._vms_die(obj.name)
        (self.nodes if kind == "node" else self.qrs).pop(obj.name, None)
        self.gone.append({"kind": kind, "name": obj.name, "history": list(obj.history)})

    def _provision(self, q: _QR, now: float) -> None:
        spec = q.body["tpu"]["nodeSpec"][0]
        creating = q.slow_creating_s if q.slow_creating_s is not None else self.config.creating_s
        names = _qr_node_names(q.name, spec)
        for name in names:  # multislice: capacity for every slice at once, or the queued resource keeps waiting
            node = self._new_node(name, q.project, q.zone, json.loads(json.dumps(spec.get("node") or {})), now,
                                  None if q.never_ready else now + creating)
            node.qr = q.name
            if q.body.get("spot") is not None:
                node.spec.setdefault("schedulingConfig", {})["spot"] = True
        q.state, q.node, q.nodes, q.t_provision = "PROVISIONING", names[0], names, now

    def _tick_op(self, op: _Op) -> None:
        if op.done or (op.t_done is not None and time.monotonic() < op.t_done):
            return
        if op.verb == "create" and op.kind == "node":
            n = self.nodes.get(op.target)
            if n is None:
                err = self._failed.pop(op.target, None) or {"code": 10, "message": "the node was deleted while it was being created"}
                op.done, op.result = True, {"error": err}
            elif n.state == "READY":
                op.done, op.result = True, {"response": {"@type": T_NODE, **self.node_json(n)}}
        elif op.verb == "create":
            q = self.qrs.get(op.target)
            op.done = True
            op.result = {"response": {"@type": T_QR, **self.qr_json(q)}} if q else \
                {"error": {"code": 10, "message": "the queued resource was deleted"}}
        elif op.target not in (self.nodes if op.kind == "node" else self.qrs):
            op.done, op.result = True, {"response": {"@type": T_EMPTY}}

    # ---- helpers ------------------------------------------------------------------------------------
    def _deleting(self, hosts: int, now: float) -> float:
        """When a slice of `hosts` worker VMs that starts deleting now is gone."""
        return now + self.config.deleting_s + self.config.deleting_per_host_s * hosts

    def _new_node(self, name: str, project: str, zone: str, spec: dict, now: float, t_ready: float | None) -> _Node:
        spec = {k: spec[k] for k in _NODE_SPEC_FIELDS if k in spec}
        acc = spec.get("acceleratorType") or ""
        api_type, topology, hosts = _shape(acc)
        if not acc and spec.get("acceleratorConfig"):
            topology = spec["acceleratorConfig"].get("topology", "")
        node = _Node(name=name, project=project, zone=zone, spec=spec, hosts=hosts, created=now, t_ready=t_ready,
                     id=next(self._ids))
        node.spec.setdefault("acceleratorConfig", {"type": api_type, "topology": topology})
        sa = dict(node.spec.get("serviceAccount") or {})
        if not sa.get("email"):  # the API's default: the project's default compute service account
            sa["email"] = f"{_project_number(project)}-compute@developer.gserviceaccount.com"
        node.spec["serviceAccount"] = sa
        if self.worker_ips:
            node.endpoints = self._endpoints(node)  # decided at creation: later /_fake/workers calls don't move it
        self.nodes[name] = node
        return node

    def _endpoints(self, n: _Node, external_ips: list[str] | None = None) -> list[dict]:
        external = (n.spec.get("networkConfig") or {}).get("enableExternalIps", False)  # proto3: absent = false
        out = []
        for i in range(n.hosts):
            if self.worker_ips and i < len(self.worker_ips):
                internal = ext = self.worker_ips[i]
                if external_ips and i < len(external_ips):
                    ext = external_ips[i]
            else:
                a, b = (n.id // 250) % 250, n.id % 250
                internal, ext = f"10.{a}.{b}.{i + 2}", f"34.{a}.{b}.{i + 2}"
            ep = {"ipAddress": internal, "port": 8470}
            if external:
                ep["accessConfig"] = {"externalIp": ext}
            out.append(ep)
        return out

    def node_json(self, n: _Node) -> dict:
        d = dict(n.spec)
        d.update(name=n.name, state=n.state, id=str(n.id), createTime=_rfc3339(time.time() - (time.monotonic() - n.created)),
                 apiVersion="V2")
        if n.endpoints and n.state in ("READY", "PREEMPTED", "DELETING"):
            d["networkEndpoints"] = n.endpoints
        if n.state == "READY":
            d["health"] = "HEALTHY"
        if n.qr:
            d["queuedResource"] = n.qr
        return d

    def qr_json(self, q: _QR) -> dict:
        d = {k: q.body[k] for k in ("tpu", "spot", "guaranteed", "queueingPolicy", "reservationName") if k in q.body}
        d["name"] = q.name
        d["createTime"] = _rfc3339(time.time() - (time.monotonic() - q.created))
        key = {"ACCEPTED": "acceptedData", "PROVISIONING": "provisioningData", "ACTIVE": "activeData",
               "FAILED": "failedData", "DELETING": "deletingData", "SUSPENDING": "suspendingData",
               "SUSPENDED": "suspendedData"}.get(q.state)
        state = {"state": q.state, "stateInitiator": q.initiator}
        if key:
            state[key] = {"error": q.error} if q.state == "FAILED" else {}
        d["state"] = state
        return d

    def _match(self, kinds: tuple[str, ...], project: str, zone: str, acc: str | None, op: str,
               resource: str | None = None) -> dict | None:
        for inj in self.injections:
            if inj["kind"] not in kinds:
                continue
            if inj.get("zone") and inj["zone"] != zone:
                continue
            if inj.get("project") and inj["project"] != project:
                continue
            if acc is not None and inj.get("accelerator") and inj["accelerator"] != acc:
                continue
            if resource and inj.get("resource") and inj["resource"] != resource:
                continue
            want = inj.get("op") or _DEFAULT_OP.get(inj["kind"], "create")
            if want != "any" and want != op:
                continue
            return inj
        return None

    def _consume(self, inj: dict) -> None:
        if inj.get("times") is not None:
            inj["times"] -= 1
            if inj["times"] <= 0 and inj["kind"] != "stockout":  # a stockout lasts until cleared
                self.injections.remove(inj)

    def check_request(self, op: str, project: str, zone: str | None, resource: str | None = None,
                      permission: str = "tpu.nodes.list") -> None:
        """What the API checks before it looks at a request: an injected refusal, then the location."""
        inj = self._match(_EARLY_KINDS, project, zone or "", None, op, resource)
        if inj is not None:
            self._consume(inj)
            raise _error_for(inj["kind"], project, zone or "-", inj, permission=permission)
        if zone is not None and zone not in self.zones:
            raise _error_for("location", project, zone, {})

    def _new_op(self, verb: str, kind: str, project: str, zone: str, target: str, now: float,
                t_done: float | None = None) -> _Op:
        name = f"projects/{project}/locations/{zone}/operations/operation-{int(time.time() * 1000)}-{next(self._ids)}"
        op = _Op(name=name, verb=verb, kind=kind, target=target, created=now, t_done=t_done)
        self.ops[name] = op
        self._tick_op(op)
        return op

    def op_json(self, op: _Op) -> dict:
        d = {"name": op.name, "done": op.done,
             "metadata": {"@type": OP_META, "createTime": _rfc3339(time.time() - (time.monotonic() - op.created)),
                          "target": op.target, "verb": op.verb, "apiVersion": "v2"}}
        if op.done:
            d.update(op.result or {})
        return d

    # ---- API ----------------------------------------------------------------------------------------
    def create(self, kind: str, project: str, zone: str, rid: str | None, body: dict) -> dict:
        """POST nodes?nodeId= or queuedResources?queuedResourceId=."""
        now = time.monotonic()
        self.tick(now)
        if kind == "node":
            spec = body
        else:
            specs = ((body.get("tpu") or {}).get("nodeSpec")) or []
            spec = (specs[0].get("node") if specs else None) or {}
        acc = spec.get("acceleratorType") or ""
        call = {"kind": kind, "project": project, "zone": zone, "id": rid, "accelerator": acc,
                "spot": bool(body.get("spot") is not None or (spec.get("schedulingConfig") or {}).get("spot")),
                "labels": dict(spec.get("labels") or {}), "time": time.time(), "status": 200,
                "body": json.loads(json.dumps(body))}  # the request body as it arrived
        self.create_calls.append(call)
        try:
            return self._create(kind, project, zone, rid, body, spec, acc, now)
        except ApiError as e:
            call["status"], call["error"] = e.code, e.message
            raise

    def _create(self, kind, project, zone, rid, body, spec, acc, now) -> dict:
        self.check_request("create", project, zone, kind,
                           permission="tpu.nodes.create" if kind == "node" else "tpu.queuedResources.create")
        _check_v2_fields(body if kind == "queuedResource" else {}, spec)
        what = "nodeId" if kind == "node" else "queuedResourceId"
        if not rid or not _ID_RE.fullmatch(rid):
            raise ApiError(400, f"Invalid {what} {rid!r}: must match [a-z]([-a-z0-9]*[a-z0-9])? and be at most 63 characters.")
        if kind == "queuedResource":
            specs = body["tpu"]["nodeSpec"]
            ms = specs[0].get("multisliceParams") if len(specs) == 1 else None
            if len(specs) != 1 or not (specs[0].get("nodeId") or ms):
                raise ApiError(400, "tpu.nodeSpec must hold exactly one node spec with a nodeId or multisliceParams.")
            if specs[0].get("nodeId") and ms:  # NodeSpec.name_strategy is a oneof in the v2 proto
                raise ApiError(400, "tpu.nodeSpec[0]: nodeId and multisliceParams exclude each other.")
            if ms is not None:
                count = ms.get("nodeCount")
                if not isinstance(count, int) or count < 2:  # MultisliceParams.node_count: "This needs to be > 1."
                    raise ApiError(400, f"tpu.nodeSpec[0].multisliceParams.nodeCount must be greater than 1, "
                                        f"got {count!r}.")
                prefix = ms.get("nodeIdPrefix") or rid or ""
                if not _ID_RE.fullmatch(f"{prefix}-{count - 1}"):
                    raise ApiError(400, f"Invalid multisliceParams.nodeIdPrefix {prefix!r}.")
            parent = f"projects/{project}/locations/{zone}"
            if specs[0].get("parent") != parent:
                raise ApiError(400, f"tpu.nodeSpec[0].parent must be {parent}.")
        if not acc and not spec.get("acceleratorConfig"):
            raise ApiError(400, "acceleratorType or acceleratorConfig is required.")
        if acc and acc not in self.zones[zone]:
            raise ApiError(400, f"Accelerator type \"{acc}\" is not available in zone \"{zone}\".")
        rv = spec.get("runtimeVersion")
        if not rv or rv not in self.runtime_versions:
            raise ApiError(400, f"Runtime version \"{rv}\" is not supported in zone \"{zone}\".")
        spot = bool(body.get("spot") is not None or (spec.get("schedulingConfig") or {}).get("spot"))
        reservation = body.get("reservationName") or ""
        if reservation and reservation not in self.reservations:
            raise _error_for("reservation_not_found", project, zone, {}, reservation=reservation)
        # Capacity and quota: refused at once (sync), or reported by the create LRO / the queued resource.
        late = self._match(_LATE_KINDS, project, zone, acc, "create", kind)
        if late is not None:
            self._consume(late)
            err = _error_for(late["kind"], project, zone, late, acc=acc, spot=spot, reservation=reservation)
            sync = late.get("sync")
            if sync is None:  # chip quota and a missing reservation come back from the create call itself
                sync = late["kind"] in ("quota", "reservation_not_found") and not late.get("async")
            if sync:
                raise err
        name = f"projects/{project}/locations/{zone}/{'nodes' if kind == 'node' else 'queuedResources'}/{rid}"
        node_names = [name] if kind == "node" else _qr_node_names(name, body["tpu"]["nodeSpec"][0])
        if name in (self.nodes if kind == "node" else self.qrs) or any(n in self.nodes for n in node_names):
            raise ApiError(409, f"Resource '{name}' already exists.")
        stockout = self._match(("stockout",), project, zone, acc, "create")
        slow = self._match(("slow",), project, zone, acc, "create")
        never = self._match(("never_ready",), project, zone, acc, "create")
        for i in (stockout, slow, never):
            if i:
                self._consume(i)
        lro_error = late and err.rpc_status()
        reserved = bool(reservation or (spec.get("schedulingConfig") or {}).get("reserved"))
        if reserved and not lro_error and not any(
                r.startswith(f"projects/{project}/locations/{zone}/reservations/") for r in self.reservations):
            lro_error = _error_for("reserved_capacity", project, zone, {}).rpc_status()  # nothing reserved here
        creating = slow.get("creating_s", 5.0) if slow else self.config.creating_s

        if kind == "node":
            node = self._new_node(name, project, zone, spec, now, None if never else now + creating)
            if stockout or lro_error:
                node.t_fail = now + self.config.stockout_fail_s
                node.t_ready = None
                self._failed[name] = lro_error or {"code": 8, "message": _stockout_message(zone)}
            op = self._new_op("create", "node", project, zone, name, now)
            return self.op_json(op)

        pending = self._match(("pending_create",), project, zone, acc, "create")
        if pending:
            self._consume(pending)
        t_done = now + float(pending.get("pending_s", 60)) if pending else None
        q = _QR(name=name, project=project, zone=zone, body=body, created=now,
                t_waiting=(t_done or now) + self.config.accept_s,
                slow_creating_s=creating if slow else None, never_ready=bool(never))
        valid = _duration_s((body.get("queueingPolicy") or {}).get("validUntilDuration"))
        if stockout:
            q.blocked_by = stockout["id"]
            fail_after = stockout.get("fail_after_s")
            candidates = [t for t in (valid, fail_after) if t is not None]
            q.t_fail = now + min(candidates) if candidates else None
        elif lro_error:
            q.fail_error = lro_error
            q.t_fail = q.t_waiting
        self.qrs[name] = q
        op = self._new_op("create", "queuedResource", project, zone, name, now, t_done)
        return self.op_json(op)

    def get(self, kind: str, name: str) -> dict:
        self.tick()
        table = self.nodes if kind == "node" else self.qrs
        project, zone = _parts(name)
        self.check_request("get", project, zone, kind)
        obj = table.get(name)
        if obj is None:
            raise ApiError(404, f"Resource '{name}' was not found")
        return self.node_json(obj) if kind == "node" else self.qr_json(obj)

    def list(self, kind: str, project: str, zone: str) -> list[dict]:
        self.tick()
        self.check_request("list", project, zone, kind)
        prefix = f"projects/{project}/locations/{zone}/"
        if kind == "node":
            return [self.node_json(n) for n in self.nodes.values() if n.name.startswith(prefix)]
        return [self.qr_json(q) for q in self.qrs.values() if q.name.startswith(prefix)]

    def delete(self, kind: str, name: str, force: bool = False) -> dict:
        now = time.monotonic()
        self.tick(now)
        project, zone = _parts(name)
        self.delete_calls.append({"kind": kind, "name": name, "force": force, "time": time.time()})
        self.check_request("delete", project, zone, kind,
                           permission=f"tpu.{'nodes' if kind == 'node' else 'queuedResources'}.delete")
        if kind == "node":
            n = self.nodes.get(name)
            if n is None:
                raise ApiError(404, f"Resource '{name}' was not found")
            # A node inside a queued resource may be deleted directly (Google's samples delete the node, then the
            # queued resource); the queued resource then goes SUSPENDING -> SUSPENDED.
            if n.state != "DELETING":
                n.state, n.t_gone = "DELETING", self._deleting(n.hosts, now)
            self._vms_die(n.name, answer_first=True)
            q = self.qrs.get(n.qr or "")
            if q is not None and q.state in ("ACTIVE", "PROVISIONING"):
                q.state = "SUSPENDING"
        else:
            q = self.qrs.get(name)
            if q is None:
                raise ApiError(404, f"Resource '{name}' was not found")
            nodes = [self.nodes[n] for n in q.nodes if n in self.nodes]
            if nodes and not force:
                raise ApiError(400, f"Queued resource {name} has an existing node {nodes[0].name}; delete with "
                                    "force=true or delete the node first.", status="FAILED_PRECONDITION")
            if q.state != "DELETING":
                acc = (((q.body["tpu"]["nodeSpec"][0].get("node") or {}).get("acceleratorType")) or "")
                q.state, q.t_gone, q.initiator = "DELETING", self._deleting(_shape(acc)[2], now), "USER"
            for node in nodes:  # force: every node of it, every slice of a multislice one
                if node.state != "DELETING":
                    node.state, node.t_gone = "DELETING", self._deleting(node.hosts, now)
                self._vms_die(node.name, answer_first=True)
        return self.op_json(self._new_op("delete", kind, project, zone, name, now))

    def get_guest_attributes(self, name: str, query_path: str = "", worker_ids: list | None = None) -> dict:
        """POST nodes/N:getGuestAttributes {queryPath, workerIds}. The answer is GetGuestAttributesResponse (the
        google.cloud.tpu_v2 types GuestAttributes / GuestAttributesValue / GuestAttributesEntry): one
        `guestAttributes` entry per worker asked for, in worker order (gcloud's TPU VM ssh reads entry i as
        worker i, or entry 0 when it asked for one worker), each {queryPath, queryValue: {items: [{namespace, key,
        value}]}}. The guest agent publishes its SSH host keys under namespace `hostkeys`, key = the key type
        (`ssh-ed25519`), value = the key's base64 (gcloud takes its last 6 characters as a host key suffix), and
        the VM's name under key `hostname` (what gcloud's --tunnel-through-iap hands to start-iap-tunnel). A
        worker that has published nothing has no items."""
        self.tick()
        project, zone = _parts(name)
        self.check_request("guest_attributes", project, zone, "node", permission="tpu.nodes.getGuestAttributes")
        n = self.nodes.get(name)
        if n is None:
            raise ApiError(404, f"Resource '{name}' was not found")
        ids = list(range(n.hosts))
        if worker_ids:
            try:
                ids = [int(w) for w in worker_ids]
            except ValueError:
                raise ApiError(400, f"Invalid worker id in {worker_ids!r}") from None
            bad = [i for i in ids if not 0 <= i < n.hosts]
            if bad:
                raise ApiError(400, f"Worker id {bad[0]} is out of range: the node has {n.hosts} workers")
        path = query_path.strip("/")
        out = []
        for i in ids:
            items = [dict(it) for it in n.guest_attributes.get(i, [])
                     if not path or _under(f"{it['namespace']}/{it['key']}".strip("/"), path)]
            out.append({"queryPath": query_path, "queryValue": {"items": items}} if items else {"queryPath": query_path})
        return {"guestAttributes": out}

    def set_guest_attributes(self, node: str, worker: int, items: list[dict], namespace: str | None = None) -> dict:
        """A worker's guest agent publishes `items` ({namespace?, key, value}); with `namespace`, they replace
        what that namespace held (e.g. other `hostkeys`), else everything."""
        n = self._find_node(node)
        if not 0 <= int(worker) < n.hosts:
            raise ApiError(400, f"worker {worker} is out of range: {n.name} has {n.hosts} workers")
        new = [{"namespace": it.get("namespace", namespace or ""), "key": it["key"], "value": it["value"]}
               for it in items]
        kept = [] if namespace is None else [it for it in n.guest_attributes.get(int(worker), [])
                                             if it["namespace"] != namespace]
        n.guest_attributes[int(worker)] = kept + new
        return {"worker": int(worker), "items": n.guest_attributes[int(worker)]}

    def get_op(self, name: str) -> dict:
        self.tick()
        self.check_request("operation", *_parts(name))
        op = self.ops.get(name)
        if op is None:
            raise ApiError(404, f"Operation '{name}' was not found")
        return self.op_json(op)

    def accelerator_types(self, project: str, zone: str) -> list[dict]:
        self.check_request("accelerator_types", project, zone)
        out = []
        for t in self.zones[zone]:
            api_type, topology, _ = _shape(t)
            out.append({"name": f"projects/{project}/locations/{zone}/acceleratorTypes/{t}", "type": t,
                        "acceleratorConfigs": [{"type": api_type, "topology": topology}]})
        return out

    def runtime_version_list(self, project: str, zone: str) -> list[dict]:
        self.check_request("runtime_versions", project, zone)
        return [{"name": f"projects/{project}/locations/{zone}/runtimeVersions/{v}", "version": v}
                for v in self.runtime_versions]

    # ---- control (/_fake/) ----------------------------------------------------------------------------
    def inject(self, spec: dict) -> dict:
        kind = spec.get("kind")
        if kind not in INJECTION_KINDS:
            raise ApiError(400, f"unknown injection kind {kind!r}; known: {', '.join(INJECTION_KINDS)}")
        inj = dict(spec, id=next(self._ids))
        self.injections.append(inj)
        return inj

    def clear(self, kind: str | None = None) -> None:
        self.injections = [i for i in self.injections if kind and i["kind"] != kind]

    def preempt(self, node: str, to: str = "PREEMPTED") -> dict:
        """A READY node is preempted (spot) or TERMINATED (maintenance/host failure) by the service."""
        self.tick()
        n = self._find_node(node)
        if to not in ("PREEMPTED", "TERMINATED"):
            raise ApiError(400, f"state must be PREEMPTED or TERMINATED, not {to!r}")
        if n.state != "READY":
            raise ApiError(400, f"node {n.name} is {n.state}, only a READY node can be preempted", status="FAILED_PRECONDITION")
        n.state = to
        self._vms_die(n.name)  # a preemption kills the VMs, and every process and SSH session on them
        self.tick()  # in a queued resource: the node goes DELETING at once, the queued resource SUSPENDING
        return self.node_json(n)

    def bind_vms(self, node: str, name: str, base_dir: str) -> None:
        self.vm_hosts[self._find_node(node).name] = {"name": name, "base_dir": base_dir}

    def _vms_die(self, node: str, answer_first: bool = False) -> None:
        """The node's local VMs (sshd hosts and every process on them) stop. answer_first: in the background, as
        a delete's do: the real API answers a delete at once with an operation and the VMs go while it runs (the
        node stays DELETING until they are gone, `_vms_gone`); stopping them inside the request held every
        client's call for as long as a loaded machine took to stop them."""
        b = self.vm_hosts.pop(node, None)
        if b is None:
            return
        from infra.local_slice import LocalSlice
        if not answer_first:
            LocalSlice.stop_by_name(b["name"], b["base_dir"])
            return
        t = threading.Thread(target=LocalSlice.stop_by_name, args=(b["name"], b["base_dir"]), daemon=True,
                             name=f"vms-die-{node.rsplit('/', 1)[-1]}")
        self._dying[node] = t
        t.start()

    def _vms_gone(self, node: str) -> bool:
        t = self._dying.get(node)
        if t is not None and t.is_alive():
            return False
        self._dying.pop(node, None)
        return True

    def _find_node(self, node: str) -> _Node:
        if node in self.nodes:
            return self.nodes[node]
        matches = [n for n in self.nodes.values() if n.name.rsplit("/", 1)[-1] == node]
        if len(matches) != 1:
            raise ApiError(404, f"no node named {node!r} (or several: give the full name)")
        return matches[0]

    def set_node_workers(self, node: str, ips: list[str], external: list[str] | None = None) -> dict:
        n = self._find_node(node)
        saved, self.worker_ips = self.worker_ips, list(ips)
        try:
            n.endpoints = self._endpoints(n, external)
        finally:
            self.worker_ips = saved
        return self.node_json(n)

    def snapshot(self) -> dict:
        self.tick()
        return {
            "nodes": [dict(self.node_json(n), hosts=n.hosts, history=n.history) for n in self.nodes.values()],
            "queued_resources": [dict(self.qr_json(q), history=q.history) for q in self.qrs.values()],
            "gone": self.gone,
            "create_calls": self.create_calls,
            "delete_calls": self.delete_calls,
            "operations": len(self.ops),
            "injections": self.injections,
            "reservations": sorted(self.reservations),
            "worker_ips": self.worker_ips,
            "zones": self.zones,
            "config": {k: v for k, v in dataclasses.asdict(self.config).items() if k not in ("zones", "runtime_versions")},
        }

    def reset(self) -> None:
        """Forget everything and go back to the offerings and timings it started with."""
        self.nodes.clear(), self.qrs.clear(), self.ops.clear(), self._failed.clear()
        self.create_calls.clear(), self.delete_calls.clear(), self.gone.clear()
        self.injections.clear()
        self.reservations.clear()
        self.worker_ips = None
        for node in list(self.vm_hosts):
            self._vms_die(node)
        self.config = dataclasses.replace(self._initial)
        self.zones = {z: list(t) for z, t in (self.config.zones or default_zones()).items()}
        self.runtime_versions = list(self.config.runtime_versions or default_runtime_versions())


def _qr_node_names(qr_name: str, spec: dict) -> list[str]:
    """The nodes a queued resource's node spec makes: nodeId, or with multisliceParams {nodeCount, nodeIdPrefix}
    PREFIX-0 .. PREFIX-(nodeCount-1), the prefix defaulting to the queued resource's id (google-cloud-tpu's v2
    QueuedResource.Tpu.NodeSpec.MultisliceParams)."""
    ms = spec.get("multisliceParams")
    if not ms:
        return [f"{spec['parent']}/nodes/{spec['nodeId']}"]
    prefix = ms.get("nodeIdPrefix") or qr_name.rsplit("/", 1)[-1]
    return [f"{spec['parent']}/nodes/{prefix}-{i}" for i in range(int(ms["nodeCount"]))]


def _under(full: str, path: str) -> bool:
    """A guest attribute `namespace/key` is under query path `path` (a namespace, or one key of it)."""
    return full == path or full.startswith(path + "/")


def _parts(name: str) -> tuple[str, str]:
    p = name.split("/")
    return p[1], p[3]


# v2 request fields the stand-in knows beyond the node's: an unknown one is refused the way the API's JSON
# parser refuses it (gcloud's alpha track sends v2alpha1 fields such as guaranteed.reserved).
_V2_QR_FIELDS = {"tpu", "spot", "guaranteed", "queueingPolicy", "reservationName", "name", "createTime", "state"}
_V2_GUARANTEED_FIELDS = {"minDuration"}
_V2_SCHEDULING_FIELDS = {"preemptible", "reserved", "spot"}


def _unknown_field(name: str, where: str) -> ApiError:
    return ApiError(400, f'Invalid JSON payload received. Unknown name "{name}" at \'{where}\': Cannot find field.')


def _check_v2_fields(qr: dict, node: dict) -> None:
    for k in qr:
        if k not in _V2_QR_FIELDS:
            raise _unknown_field(k, "queued_resource")
    for k in qr.get("guaranteed") or {}:
        if k not in _V2_GUARANTEED_FIELDS:
            raise _unknown_field(k, "queued_resource.guaranteed")
    for k in node.get("schedulingConfig") or {}:
        if k not in _V2_SCHEDULING_FIELDS:
            raise _unknown_field(k, "node.scheduling_config")


def _stockout_message(zone: str) -> str:
    # The wording Cloud TPU uses (catalog.md, errors [18]).
    return (f"There is no more capacity in the zone \"{zone}\"; you can try in another zone where Cloud TPU Nodes "
            "are offered (see https://cloud.google.com/tpu/docs/regions) [EID: 0xfa4e]")


_project_number = project_number


def _region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _eid() -> str:
    return f"[EID: 0x{int(time.time() * 1e6) & 0xffffffffffff:012x}]"


def _chip_quota_name(acc: str, spot: bool) -> str:
    """A per-region chip quota name in the API's pattern, e.g. TPUV6EPreemptiblePerProjectPerRegionForTPUAPI."""
    gen = _shape(acc)[0] if acc else "V4"
    gen = {"V5LITE_POD": "V5sLitepod", "V5P": "V5P", "TYPE_UNSPECIFIED": "V4"}.get(gen, gen)
    return f"TPU{gen}{'Preemptible' if spot else ''}PerProjectPerRegionForTPUAPI"


def _quota_message(zone: str, inj: dict, acc: str = "", spot: bool = False) -> str:
    quota = inj.get("quota") or _chip_quota_name(acc, spot)
    return f"Quota limit '{quota}' has been exceeded. Limit: {inj.get('limit', 0)} in region {_region(zone)}."


def _error_info(reason: str, domain: str, metadata: dict) -> dict:
    return {"@type": T_ERROR_INFO, "reason": reason, "domain": domain, "metadata": metadata}


def _error_for(kind: str, project: str, zone: str, inj: dict, *, acc: str = "", spot: bool = False,
               permission: str = "tpu.nodes.list", reservation: str = "") -> ApiError:
    """The answer the real API gives for `kind`: HTTP status, `error.status`, message and `details`."""
    msg = inj.get("message")
    consumer = f"projects/{project}"
    if kind == "reserved_capacity":  # over REST a FAILED_PRECONDITION is an HTTP 400
        return ApiError(400, msg or f"Insufficient reserved capacity. Contact customer support to increase your "
                                    f"reservation. {_eid()}", status="FAILED_PRECONDITION")
    if kind == "spot_preempted":     # a spot node preempted while it was being created
        return ApiError(400, msg or f"Cloud TPU received a bad request. update is not supported while in state "
                                    f"PREEMPTED {_eid()}", status="INVALID_ARGUMENT")
    if kind == "reservation_not_found":
        name = reservation or inj.get("reservation") or f"projects/{project}/locations/{zone}/reservations/unknown"
        return ApiError(404, msg or f"Reservation not found: {name}", status="NOT_FOUND")
    if kind == "location":
        return ApiError(403, msg or f"Location {zone} is not found or access is unauthorized.")
    if kind == "service_disabled":
        url = f"https://console.developers.google.com/apis/api/tpu.googleapis.com/overview?project={project}"
        return ApiError(403, msg or (f"Cloud TPU API has not been used in project {project} before or it is "
                                     f"disabled. Enable it by visiting {url} then retry. If you enabled this API "
                                     "recently, wait a few minutes for the action to propagate to our systems and "
                                     "retry."), details=[
            _error_info("SERVICE_DISABLED", "googleapis.com",
                        {"service": "tpu.googleapis.com", "consumer": consumer, "activationUrl": url,
                         "serviceTitle": "Cloud TPU API", "containerInfo": project}),
            {"@type": "type.googleapis.com/google.rpc.Help",
             "links": [{"description": "Google developers console API activation", "url": url}]}])
    if kind == "billing_disabled":
        url = f"https://console.developers.google.com/billing/enable?project={project}"
        return ApiError(403, msg or (f"This API method requires billing to be enabled. Please enable billing on "
                                     f"project #{project} by visiting {url} then retry. If you enabled billing for "
                                     "this project recently, wait a few minutes for the action to propagate to our "
                                     "systems and retry."), details=[
            _error_info("BILLING_DISABLED", "googleapis.com", {"service": "tpu.googleapis.com", "consumer": consumer})])
    if kind == "location_policy":
        return ApiError(403, msg or (f"Location {zone} violates constraint constraints/gcp.resourceLocations on "
                                     f"the resource projects/{project}/locations/{zone}."), details=[
            _error_info("LOCATION_POLICY_VIOLATED", "googleapis.com",
                        {"constraint": "constraints/gcp.resourceLocations", "location": zone})])
    if kind == "permission":
        perm = inj.get("permission") or permission
        return ApiError(403, msg or (f"Permission '{perm}' denied on resource '//tpu.googleapis.com/projects/"
                                     f"{project}/locations/{zone}' (or it may not exist)."), details=[
            _error_info("IAM_PERMISSION_DENIED", "iam.googleapis.com",
                        {"permission": perm, "resource": f"projects/{project}/locations/{zone}"})])
    if kind == "quota":              # chip quota: per region, a QuotaFailure detail
        text = msg or _quota_message(zone, inj, acc, spot)
        return ApiError(429, text, details=[
            {"@type": T_QUOTA_FAILURE, "violations": [{"subject": f"project:{project}", "description": text}]}])
    if kind == "rate_limit":         # the API's request-rate limit: retry later, it is not chip quota
        return ApiError(429, msg or (f"Quota exceeded for quota metric 'Read requests' and limit 'Read requests "
                                     f"per minute' of service 'tpu.googleapis.com' for consumer '{consumer}'."),
                        details=[_error_info("RATE_LIMIT_EXCEEDED", "googleapis.com", {
                            "quota_metric": "tpu.googleapis.com/read_requests",
                            "quota_limit": "ReadRequestsPerMinutePerProject", "quota_limit_value": "600",
                            "quota_location": "global", "consumer": consumer, "service": "tpu.googleapis.com"})])
    if kind == "unavailable":
        return ApiError(503, msg or "The service is currently unavailable.")
    if kind == "internal":
        return ApiError(500, msg or "Internal error encountered.")
    if kind == "bad_argument":
        return ApiError(400, msg or "Invalid value in the request.")
    raise ValueError(kind)


# ---- HTTP ------------------------------------------------------------------------------------------------
_LOC = r"/v2/projects/(?P<p>[^/]+)/locations/(?P<z>[^/]+)"
_ROUTES = [
    ("GET", re.compile(_LOC + r"/acceleratorTypes"), "acc_list"),
    ("GET", re.compile(_LOC + r"/acceleratorTypes/(?P<id>[^/]+)"), "acc_get"),
    ("GET", re.compile(_LOC + r"/runtimeVersions"), "rv_list"),
    ("GET", re.compile(_LOC + r"/runtimeVersions/(?P<id>[^/]+)"), "rv_get"),
    ("POST", re.compile(_LOC + r"/nodes"), "node_create"),
    ("GET", re.compile(_LOC + r"/nodes"), "node_list"),
    ("GET", re.compile(_LOC + r"/nodes/(?P<id>[^/:]+)"), "node_get"),
    ("POST", re.compile(_LOC + r"/nodes/(?P<id>[^/:]+):getGuestAttributes"), "node_guest_attributes"),
    ("DELETE", re.compile(_LOC + r"/nodes/(?P<id>[^/:]+)"), "node_delete"),
    ("POST", re.compile(_LOC + r"/queuedResources"), "qr_create"),
    ("GET", re.compile(_LOC + r"/queuedResources"), "qr_list"),
    ("GET", re.compile(_LOC + r"/queuedResources/(?P<id>[^/:]+)"), "qr_get"),
    ("DELETE", re.compile(_LOC + r"/queuedResources/(?P<id>[^/:]+)"), "qr_delete"),
    ("GET", re.compile(_LOC + r"/operations/(?P<id>[^/:]+)"), "op_get"),
    ("GET", re.compile(r"/v2/projects/(?P<p>[^/]+)/locations"), "loc_list"),
]


def _page(items: list, key: str, q: dict) -> dict:
    size = int((q.get("pageSize") or ["0"])[0] or 0)
    start = int((q.get("pageToken") or ["0"])[0] or 0)
    if size <= 0:
        return {key: items[start:]}
    out = {key: items[start:start + size]}
    if start + size < len(items):
        out["nextPageToken"] = str(start + size)
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-tpu-api/1"
    fake: FakeTpu  # set on the subclass made by make_server
    verbose = False

    def log_message(self, fmt, *args):  # quiet unless asked
        if self.verbose:
            sys.stderr.write("fake_tpu_api: " + fmt % args + "\n")

    def _send(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "Invalid JSON payload received.") from None

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        q = parse_qs(url.query)
        try:
            body = self._body() if method in ("POST", "PATCH") else {}
            if url.path == "/_fake/vm_hosts" and method == "POST":
                return self._send(200, self._start_vms(body))
            with self.fake.lock:
                self.fake.last_request = time.monotonic()
                if url.path.startswith("/_fake/"):
                    code, obj = 200, self._control(method, url.path[len("/_fake/"):], body, q)
                else:
                    code, obj = 200, self._api(method, url.path, body, q)
        except ApiError as e:
            code, obj = e.code, e.body()
        except Exception as e:  # a bug in the stand-in: answer 500 rather than hang the client
            code, obj = 500, ApiError(500, f"fake_tpu_api internal error: {type(e).__name__}: {e}").body()
        self._send(code, obj)

    def _api(self, method: str, path: str, body: dict, q: dict):
        f = self.fake
        for m, rx, action in _ROUTES:
            mt = rx.fullmatch(path)
            if m != method or not mt:
                continue
            g = mt.groupdict()
            p, z, rid = g.get("p"), g.get("z"), g.get("id")
            base = f"projects/{p}/locations/{z}"
            if action == "acc_list":
                return _page(f.accelerator_types(p, z), "acceleratorTypes", q)
            if action == "acc_get":
                for t in f.accelerator_types(p, z):
                    if t["type"] == rid:
                        return t
                raise ApiError(404, f"Accelerator type '{rid}' is not available in zone {z}.")
            if action == "rv_list":
                return _page(f.runtime_version_list(p, z), "runtimeVersions", q)
            if action == "rv_get":
                for v in f.runtime_version_list(p, z):
                    if v["version"] == rid:
                        return v
                raise ApiError(404, f"Runtime version '{rid}' was not found.")
            if action == "node_create":
                return f.create("node", p, z, (q.get("nodeId") or [None])[0], body)
            if action == "qr_create":
                return f.create("queuedResource", p, z, (q.get("queuedResourceId") or [None])[0], body)
            if action == "node_list":
                return _page(f.list("node", p, z), "nodes", q)
            if action == "qr_list":
                return _page(f.list("queuedResource", p, z), "queuedResources", q)
            if action == "node_get":
                return f.get("node", f"{base}/nodes/{rid}")
            if action == "qr_get":
                return f.get("queuedResource", f"{base}/queuedResources/{rid}")
            if action == "node_guest_attributes":
                return f.get_guest_attributes(f"{base}/nodes/{rid}", body.get("queryPath") or "",
                                              body.get("workerIds") or None)
            if action == "node_delete":
                return f.delete("node", f"{base}/nodes/{rid}")
            if action == "qr_delete":
                force = (q.get("force") or ["false"])[0].lower() in ("true", "1")
                return f.delete("queuedResource", f"{base}/queuedResources/{rid}", force=force)
            if action == "op_get":
                return f.get_op(f"{base}/operations/{rid}")
            if action == "loc_list":
                f.check_request("locations", p, None)
                return {"locations": [{"name": f"projects/{p}/locations/{zz}", "locationId": zz} for zz in f.zones]}
        raise ApiError(404, f"no such method: {method} {path}")

    def _start_vms(self, body: dict) -> dict:
        """Local mode: the node's VMs as sshd hosts on this machine (LocalSlice), started here, outside any
        caller's namespaces, so they outlive whoever asked (a managed job's controller host too), and bound to
        the node so that they die with it. Slow (seconds): outside the lock."""
        from infra.local_slice import LocalSlice, LocalSliceError
        with self.fake.lock:
            self.fake._find_node(body["node"])
        try:
            s = LocalSlice.start(body["name"], int(body["hosts"]), body["base_dir"], fresh=bool(body.get("fresh")),
                                 authorized_keys=tuple(body.get("authorized_keys") or ()))
        except (LocalSliceError, OSError) as e:
            raise ApiError(409, f"local hosts for {body['node']}: {e}")
        with self.fake.lock:
            self.fake.bind_vms(body["node"], s.name, s.base_dir)
        d = dataclasses.asdict(s)
        d["host_keys"] = [s.host_keys(h.index) for h in s.hosts]
        return d

    def _control(self, method: str, what: str, body: dict, q: dict):
        f = self.fake
        if what == "health":
            return {"ok": True, "pid": os.getpid()}
        if what == "state":
            return f.snapshot()
        if what == "inject" and method == "POST":
            return f.inject(body)
        if what in ("inject", "clear") and method in ("DELETE", "POST"):
            f.clear(body.get("kind") or (q.get("kind") or [None])[0])
            return {"injections": f.injections}
        if what == "config" and method == "POST":
            for k, v in body.items():
                if k not in ("creating_s", "deleting_s", "deleting_per_host_s", "suspend_s", "accept_s", "waiting_s",
                             "stockout_fail_s", "idle_timeout_s"):
                    raise ApiError(400, f"unknown config key {k!r}")
                setattr(f.config, k, float(v))
            return dataclasses.asdict(f.config)
        if what == "zones" and method == "POST":
            if "zones" in body:
                f.zones = {z: list(t) for z, t in body["zones"].items()}
            else:
                f.zones[body["zone"]] = list(body.get("accelerator_types") or [])
            return {"zones": f.zones}
        if what == "runtime_versions" and method == "POST":
            f.runtime_versions = list(body.get("versions") or [])
            return {"versions": f.runtime_versions}
        if what == "reservations" and method == "POST":
            f.reservations[body["name"]] = {}
            return {"reservations": sorted(f.reservations)}
        if what == "workers" and method == "POST":
            ips = body.get("ips")
            f.worker_ips = list(ips) if ips else None
            return {"ips": f.worker_ips}
        if what == "node_workers" and method == "POST":
            return f.set_node_workers(body["node"], body.get("ips") or [], body.get("external"))
        if what == "guest_attributes" and method == "POST":
            return f.set_guest_attributes(body["node"], int(body["worker"]), list(body.get("items") or []),
                                          body.get("namespace"))
        if what == "preempt" and method == "POST":
            return f.preempt(body["node"], body.get("state", "PREEMPTED"))
        if what == "reset" and method == "POST":
            f.reset()
            return {"ok": True}
        raise ApiError(404, f"no such control endpoint: {method} /_fake/{what}")


def make_server(host: str = "127.0.0.1", port: int = 0, config: FakeConfig | None = None,
                verbose: bool = False) -> ThreadingHTTPServer:
    fake = FakeTpu(config)
    handler = type("Handler", (_Handler,), {"fake": fake, "verbose": verbose})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    server.fake = fake  # type: ignore[attr-defined]
    return server


class FakeControl(Control):
    """A small client of the control API (tests, local mode)."""

    def health(self) -> dict:
        return self.call("GET", "health")

    def state(self) -> dict:
        return self.call("GET", "state")

    def inject(self, kind: str, **kw) -> dict:
        """The generic form: kind is one of INJECTION_KINDS; zone/project/accelerator/resource narrow what it
        matches, op (one of OPS) says which request, times how often (None: until cleared)."""
        return self.call("POST", "inject", {"kind": kind, **{k: v for k, v in kw.items() if v is not None}})

    # The real API's refusals by name. Each returns the injection; `times=None` lasts until clear().
    def service_disabled(self, *, op: str = "any", times: int | None = None, **kw) -> dict:
        """403 PERMISSION_DENIED, ErrorInfo SERVICE_DISABLED (the Cloud TPU API is not enabled)."""
        return self.inject("service_disabled", op=op, times=times, **kw)

    def billing_disabled(self, *, op: str = "any", times: int | None = None, **kw) -> dict:
        """403 PERMISSION_DENIED, ErrorInfo BILLING_DISABLED."""
        return self.inject("billing_disabled", op=op, times=times, **kw)

    def location_forbidden(self, zone: str, *, op: str = "any", times: int | None = None, **kw) -> dict:
        """403 "Location ZONE is not found or access is unauthorized." (what an unknown zone also gets)."""
        return self.inject("location", zone=zone, op=op, times=times, **kw)

    def location_policy(self, zone: str, *, op: str = "any", times: int | None = None, **kw) -> dict:
        """403, ErrorInfo LOCATION_POLICY_VIOLATED (an org policy forbids the zone)."""
        return self.inject("location_policy", zone=zone, op=op, times=times, **kw)

    def permission_denied(self, *, op: str = "create", permission: str | None = None, times: int | None = None,
                          **kw) -> dict:
        """403, ErrorInfo IAM_PERMISSION_DENIED with metadata.permission."""
        return self.inject("permission", op=op, permission=permission, times=times, **kw)

    def chip_quota(self, *, quota: str | None = None, limit: int = 0, times: int | None = None, **kw) -> dict:
        """429 RESOURCE_EXHAUSTED with a QuotaFailure: "Quota limit 'Q' has been exceeded. Limit: N in region R."
        On create; async=True reports it in the create LRO / the queued resource instead."""
        return self.inject("quota", quota=quota, limit=limit, times=times, **kw)

    def rate_limit(self, *, op: str = "any", times: int | None = 1, **kw) -> dict:
        """429 RESOURCE_EXHAUSTED, ErrorInfo RATE_LIMIT_EXCEEDED (requests per minute, not chips)."""
        return self.inject("rate_limit", op=op, times=times, **kw)

    def transient(self, status: int = 503, *, op: str = "any", times: int | None = 1, **kw) -> dict:
        """503 UNAVAILABLE or 500 INTERNAL, `times` times on requests of `op`."""
        return self.inject({503: "unavailable", 500: "internal"}[status], op=op, times=times, **kw)

    def stockout(self, zone: str | None = None, **kw) -> dict:
        """RESOURCE_EXHAUSTED (code 8) "no more capacity" in the create LRO; a queued resource waits instead."""
        return self.inject("stockout", zone=zone, **kw)

    def reserved_capacity(self, zone: str | None = None, *, sync: bool = False, times: int | None = None,
                          **kw) -> dict:
        """FAILED_PRECONDITION "Insufficient reserved capacity": in the create LRO / the queued resource (code 9),
        or with sync=True from the create call itself (HTTP 400, status FAILED_PRECONDITION)."""
        return self.inject("reserved_capacity", zone=zone, sync=sync, times=times, **kw)

    def spot_preempted_during_create(self, zone: str | None = None, *, sync: bool = False,
                                     times: int | None = None, **kw) -> dict:
        """INVALID_ARGUMENT (code 3) "... not supported while in state PREEMPTED" in the create LRO."""
        return self.inject("spot_preempted", zone=zone, sync=sync, times=times, **kw)

    def add_reservation(self, name: str) -> dict:
        """A reservation (full name projects/P/locations/Z/reservations/R); any other name is NOT_FOUND."""
        return self.call("POST", "reservations", {"name": name})

    def create_bodies(self, kind: str | None = None) -> list[dict]:
        """The request bodies of every create call so far (kind: node | queuedResource), oldest first."""
        return [c["body"] for c in self.state()["create_calls"] if kind is None or c["kind"] == kind]

    def clear(self, kind: str | None = None) -> dict:
        return self.call("POST", "clear", {"kind": kind} if kind else {})

    def config(self, **kw) -> dict:
        return self.call("POST", "config", kw)

    def set_zone(self, zone: str, accelerator_types: list[str]) -> dict:
        return self.call("POST", "zones", {"zone": zone, "accelerator_types": accelerator_types})

    def set_workers(self, ips: list[str] | None) -> dict:
        return self.call("POST", "workers", {"ips": ips})

    def set_node_workers(self, node: str, ips: list[str], external: list[str] | None = None) -> dict:
        """The node's workers: internal IPs (and, where it has external IPs, these instead of the same ones)."""
        return self.call("POST", "node_workers", {"node": node, "ips": ips, **({"external": external} if external else {})})

    def preempt(self, node: str, state: str = "PREEMPTED") -> dict:
        return self.call("POST", "preempt", {"node": node, "state": state})

    def set_guest_attributes(self, node: str, worker: int, items: list[dict], namespace: str | None = None) -> dict:
        """What worker `worker` of `node` publishes ({namespace?, key, value} each); `namespace` replaces only
        that namespace's items."""
        return self.call("POST", "guest_attributes", {"node": node, "worker": worker, "items": items,
                                                      **({"namespace": namespace} if namespace is not None else {})})

    def publish_host_keys(self, node: str, worker: int, keys: list[str]) -> dict:
        """Worker `worker`'s guest agent publishes these host keys ("TYPE BASE64" each) under `hostkeys/`,
        replacing the ones it published before (a test's way to publish a key the host does not have)."""
        items = [{"key": k.split()[0], "value": k.split()[1]} for k in keys]
        return self.set_guest_attributes(node, worker, items, namespace="hostkeys")

    def reset(self) -> dict:
        return self.call("POST", "reset", {})

    def start_vms(self, node: str, name: str, hosts: int, base_dir: str, *, fresh: bool = False,
                  authorized_keys: tuple[str, ...] = ()) -> dict:
        """Local mode: start `node`'s VMs as local slice `name` (sshd hosts) from the stand-in's own process and
        bind them to the node: they stop when it is preempted or deleted. Returns the slice's record (its
        `LocalSlice` fields) with each host's published `host_keys`."""
        return self.call("POST", "vm_hosts", {"node": node, "name": name, "hosts": hosts, "base_dir": base_dir,
                                              "fresh": fresh, "authorized_keys": list(authorized_keys)})


@dataclass
class RunningFake:
    server: ThreadingHTTPServer
    thread: threading.Thread
    url: str

    @property
    def fake(self) -> FakeTpu:
        return self.server.fake  # type: ignore[attr-defined]

    @property
    def control(self) -> FakeControl:
        return FakeControl(self.url)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def start_in_thread(config: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> RunningFake:
    """Serve in a daemon thread of this process; call .stop() when done."""
    server = make_server(host, port, config)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="fake-tpu-api")
    t.start()
    return RunningFake(server, t, f"http://{host}:{server.server_address[1]}")


def _watch_idle(server: ThreadingHTTPServer, idle_s: float) -> None:
    fake: FakeTpu = server.fake  # type: ignore[attr-defined]
    while True:
        time.sleep(min(idle_s, 5.0))
        if time.monotonic() - fake.last_request > idle_s:
            server.shutdown()
            return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.fake_tpu_api", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8470, help="0 picks a free port (see --ready-file)")
    ap.add_argument("--ready-file", help="write {pid, host, port, url} as JSON here once listening")
    ap.add_argument("--creating-s", type=float, default=FakeConfig.creating_s)
    ap.add_argument("--deleting-s", type=float, default=FakeConfig.deleting_s)
    ap.add_argument("--idle-timeout", type=float, default=0.0, help="exit after this many idle seconds (0: never)")
    ap.add_argument("--verbose", action="store_true", help="log every request to stderr")
    a = ap.parse_args(argv)
    cfg = FakeConfig(creating_s=a.creating_s, deleting_s=a.deleting_s, idle_timeout_s=a.idle_timeout)
    try:
        server = make_server(a.host, a.port, cfg, verbose=a.verbose)
    except OSError as e:
        print(f"error: cannot listen on {a.host}:{a.port}: {e.strerror}; pick another --port", file=sys.stderr)
        return 2
    if a.idle_timeout > 0:
        threading.Thread(target=_watch_idle, args=(server, a.idle_timeout), daemon=True).start()
    return serving.serve(server, a.host, a.ready_file, "fake Cloud TPU API")


if __name__ == "__main__":
    sys.exit(main())
