"""Compute Engine v1 instances and zonal operations, as `google-cloud-compute`'s `InstancesClient` and
`ZoneOperationsClient` (REST transport) speak them; `infra/fake_login_apis.py` serves this on its port.

Source of the wire format: the installed client (google-cloud-compute 1.57.0): the URIs in
`compute_v1/services/{instances,zone_operations}/transports/rest_base.py`, the JSON names of `Instance`,
`Operation`, `Errors`, `ErrorDetails`, `QuotaExceededInfo` in `compute_v1/types/compute.py`, and how an operation
ends in `google/api_core/extended_operation.py`: `insert()`/`delete()` return the Operation at once, `.result()`
polls `zoneOperations.get` until `status: DONE`, and a DONE operation with `httpErrorStatusCode` and
`httpErrorMessage` raises `from_http_status(code, message, errors=error.errors)`. That polling goes through a
ZoneOperationsClient the library builds without the caller's client_options (`instances/transports/base.py`,
`_zone_operations_client`), so against this stand-in a caller waits with its own ZoneOperationsClient. The
refusals' wording is the real API's as users have quoted it (gcloud, Terraform): "Quota 'CPUS' exceeded.  Limit:
24.0 in region R." with its quotaInfo (metric compute.googleapis.com/cpus, limit CPUS-per-project-region); HTTP 412
conditionNotMet
"Constraint constraints/compute.vmExternalIpAccess violated for project NUMBER. Add instance ... to the constraint
to use external IP with it."; 403 SERVICE_DISABLED with the API's activation URL. The wording of the 400s for a
malformed instance is this stand-in's own.

  POST   /compute/v1/projects/P/zones/Z/instances                  insert: Operation (RUNNING); 409 if it exists
  GET    /compute/v1/projects/P/zones/Z/instances[?filter=&maxResults=&pageToken=]    InstanceList
  GET    /compute/v1/projects/P/zones/Z/instances/N                Instance; 404 if there is none
  DELETE /compute/v1/projects/P/zones/Z/instances/N                delete: Operation; 404 if there is none
  GET    /compute/v1/projects/P/zones/Z/operations/O               Operation
  POST   /compute/v1/projects/P/zones/Z/operations/O/wait          the Operation once DONE (or after wait_max_s)

An instance moves with the clock (every request first advances everything to "now"): PROVISIONING
--provisioning_s--> STAGING --staging_s--> RUNNING (its insert operation DONE); delete: STOPPING --stopping_s-->
TERMINATED --terminated_s--> gone (its delete operation DONE). Its networkInterfaces[0].networkIP is what the
stand-in was told (`set_ips`, like the TPU stand-in's workers), else 10.128.0.N; an accessConfig gets a natIP
(the told external IP, else the internal one). `serviceAccounts[].email: "default"` becomes the project's
default account (NUMBER-compute@developer.gserviceaccount.com).
"""
from __future__ import annotations

import datetime as dt
import itertools
import re
import threading
import time
import zlib
from dataclasses import dataclass, field

from infra.gcp_ids import default_service_account, project_number

BASE = "https://www.googleapis.com/compute/v1"
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_MACHINE_RE = re.compile(r"(e2|n1|n2|n2d|n4|c2|c3|c4|t2d)-(micro|small|medium|(standard|highmem|highcpu)-\d+)")
OPS = ("insert", "get", "list", "delete", "operation", "project", "any")
INJECTION_KINDS = ("quota", "org_policy", "service_disabled")
# The per-region or global limit each quota name is reported under (metric, limit name, dimensions).
_QUOTAS = {
    "CPUS": ("compute.googleapis.com/cpus", "CPUS-per-project-region", "region"),
    "E2_CPUS": ("compute.googleapis.com/e2_cpus", "E2-CPUS-per-project-region", "region"),
    "IN_USE_ADDRESSES": ("compute.googleapis.com/in_use_addresses", "IN-USE-ADDRESSES-per-project-region",
                         "region"),
    "CPUS_ALL_REGIONS": ("compute.googleapis.com/cpus_all_regions", "CPUS-ALL-REGIONS-per-project", "global"),
}
_EXTERNAL_IP = "constraints/compute.vmExternalIpAccess"


class ComputeError(Exception):
    """An answer the API gives instead of a resource: Compute Engine's error body (`errors[]` with `reason`)."""

    def __init__(self, code: int, message: str, reason: str, domain: str = "global", *, status: str | None = None,
                 details: list | None = None, extra: dict | None = None):
        super().__init__(message)
        self.code, self.message, self.reason, self.domain = code, message, reason, domain
        self.status, self.details, self.extra = status, details or [], extra or {}

    def body(self) -> dict:
        err = {"code": self.code, "message": self.message,
               "errors": [{"message": self.message, "domain": self.domain, "reason": self.reason, **self.extra}]}
        if self.status:
            err["status"] = self.status
        if self.details:
            err["details"] = self.details
        return {"error": err}


def not_found(what: str) -> ComputeError:
    return ComputeError(404, f"The resource '{what}' was not found", "notFound")


def _invalid(field_name: str, value, why: str) -> ComputeError:
    return ComputeError(400, f"Invalid value for field '{field_name}': '{value}'. {why}", "invalid")


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def _fingerprint(obj) -> str:
    import base64
    return base64.b64encode(zlib.crc32(repr(obj).encode()).to_bytes(8, "big")).decode()


def _url(project: str, path: str) -> str:
    """A resource's full URL, as the API returns what a request may name partly (`global/networks/default`)."""
    if path.startswith("http"):
        return path
    return f"{BASE}/projects/{project}/{path.removeprefix(f'projects/{project}/')}"


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


@dataclass
class InstancesConfig:
    provisioning_s: float = 0.2
    staging_s: float = 0.2
    stopping_s: float = 0.2
    terminated_s: float = 0.2
    wait_max_s: float = 120.0  # zoneOperations.wait answers by then even when not DONE (the real API: ~2 min)


@dataclass
class _Instance:
    project: str
    zone: str
    name: str
    id: str
    body: dict
    ip: str
    external_ip: str
    created: float
    deleting: float | None = None
    status: str = "PROVISIONING"
    history: list = field(default_factory=list)


@dataclass
class _Op:
    project: str
    zone: str
    name: str
    id: str
    kind: str  # insert | delete
    target: str
    target_id: str
    started: float
    status: str = "RUNNING"
    ended: float | None = None
    error: dict | None = None  # {"errors": [...]}, with http_code/http_message below
    http_code: int = 0
    http_message: str = ""


class ComputeInstances:
    """The state behind the routes above; every method runs under the caller's lock."""

    def __init__(self, config: InstancesConfig | None = None, lock: threading.RLock | None = None):
        self.config = config or InstancesConfig()
        self.instances: dict[tuple[str, str, str], _Instance] = {}
        self.ops: dict[tuple[str, str, str], _Op] = {}
        self.gone: list[dict] = []
        self.inserts: list[dict] = []  # request bodies as they arrived
        self.injections: list[dict] = []
        self.next_ip: tuple[str | None, str | None] = (None, None)
        self._ids = itertools.count(1)
        self.lock = lock or threading.RLock()

    # ---- the clock ----------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        c = self.config
        for key, inst in list(self.instances.items()):
            if inst.deleting is None:
                age = now - inst.created
                st = ("PROVISIONING" if age < c.provisioning_s else
                      "STAGING" if age < c.provisioning_s + c.staging_s else "RUNNING")
            else:
                age = now - inst.deleting
                st = ("STOPPING" if age < c.stopping_s else
                      "TERMINATED" if age < c.stopping_s + c.terminated_s else "GONE")
            if st != inst.status:
                inst.status = st
                inst.history.append([st, now])
            if st == "GONE":
                del self.instances[key]
                self.gone.append({"project": inst.project, "zone": inst.zone, "name": inst.name,
                                  "ip": inst.ip, "at": now, "history": inst.history})
        for op in self.ops.values():
            if op.status == "DONE":
                continue
            key = (op.project, op.zone, op.target)
            inst = self.instances.get(key)
            done = (op.error is not None or
                    (op.kind == "insert" and (inst is None or inst.status not in ("PROVISIONING", "STAGING"))) or
                    (op.kind == "delete" and inst is None))
            if done:
                op.status, op.ended = "DONE", now

    # ---- injected refusals --------------------------------------------------------------------------------
    def inject(self, spec: dict) -> dict:
        if spec.get("kind") not in INJECTION_KINDS:
            raise ValueError(f"unknown injection kind {spec.get('kind')!r}; one of {', '.join(INJECTION_KINDS)}")
        if spec.get("op", "insert") not in OPS:
            raise ValueError(f"unknown op {spec.get('op')!r}; one of {', '.join(OPS)}")
        inj = {"op": "insert" if spec["kind"] != "service_disabled" else "any", **spec}
        self.injections.append(inj)
        return inj

    def _find(self, op: str, project: str, zone: str | None, kind: str) -> dict | None:
        for inj in self.injections:
            if inj["kind"] != kind or inj["op"] not in ("any", op):
                continue
            if inj.get("project") not in (None, project) or (zone and inj.get("zone") not in (None, zone)):
                continue
            return inj
        return None

    def _consume(self, inj: dict) -> dict:
        if inj.get("times") is not None:
            inj["times"] -= 1
            if inj["times"] <= 0:
                self.injections.remove(inj)
        return inj

    def _take(self, op: str, project: str, zone: str | None, kind: str) -> dict | None:
        inj = self._find(op, project, zone, kind)
        return None if inj is None else self._consume(inj)

    def check_service(self, op: str, project: str, zone: str | None = None) -> None:
        """What the API front end refuses before Compute Engine sees the request: the API not enabled."""
        if self._take(op, project, zone, "service_disabled"):
            raise service_disabled(project)

    # ---- the API ------------------------------------------------------------------------------------------
    def set_ips(self, ip: str | None, external: str | None = None) -> None:
        self.next_ip = (ip, external)

    def set_instance_ip(self, project: str, zone: str, name: str, ip: str, external: str | None = None) -> dict:
        inst = self._get(project, zone, name)
        inst.ip, inst.external_ip = ip, external or ip
        return self.instance_json(inst)

    def insert(self, project: str, zone: str, body: dict) -> dict:
        self.check_service("insert", project, zone)
        now = time.time()
        self.tick(now)
        self.inserts.append({"project": project, "zone": zone, "body": body})
        name = body.get("name") or ""
        if not _NAME_RE.fullmatch(name):
            raise _invalid("resource.name", name, "Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|"
                                                  "[1-9][0-9]{0,19})'")
        machine = (body.get("machineType") or "").rsplit("/", 1)[-1]
        if not machine:
            raise _invalid("resource.machineType", "", "Machine type must be specified.")
        if not _MACHINE_RE.fullmatch(machine):
            raise _invalid("resource.machineType", body["machineType"],
                           f"Machine type with name '{machine}' does not exist in zone '{zone}'.")
        disks = body.get("disks") or []
        if not any(d.get("boot") for d in disks):
            raise _invalid("resource.disks", "", "A boot disk must be specified.")
        if not body.get("networkInterfaces"):
            raise _invalid("resource.networkInterfaces", "", "At least one network interface must be specified.")
        if (project, zone, name) in self.instances:
            raise ComputeError(409, f"The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists",
                               "alreadyExists")
        # An organisation policy is checked before quota; a policy the instance does not break is not used up.
        policy = self._find("insert", project, zone, "org_policy")
        if policy is not None and (err := org_policy_error(project, zone, name, policy, body)) is not None:
            self._consume(policy)
            raise err
        inj = self._take("insert", project, zone, "quota")
        if inj and inj.get("sync"):
            raise quota_sync_error(zone, inj)
        n = next(self._ids)
        iid = str(1000000000000000000 + n * 7919)
        op = self._new_op(project, zone, "insert", name, iid, now)
        if inj:  # the request was taken; the operation fails and no instance is made
            op.error, op.http_code, op.http_message = quota_op_error(zone, inj), 403, "FORBIDDEN"
            return self.op_json(op)
        ip, external = self.next_ip
        ip = ip or f"10.128.0.{1 + n % 250}"
        inst = _Instance(project, zone, name, iid, body, ip, external or ip, now, history=[["PROVISIONING", now]])
        self.instances[(project, zone, name)] = inst
        return self.op_json(op)

    def _get(self, project: str, zone: str, name: str) -> _Instance:
        inst = self.instances.get((project, zone, name))
        if inst is None:
            raise not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        return inst

    def get(self, project: str, zone: str, name: str) -> dict:
        self.check_service("get", project, zone)
        self.tick()
        return self.instance_json(self._get(project, zone, name))

    def list(self, project: str, zone: str, q: dict) -> dict:
        self.check_service("list", project, zone)
        self.tick()
        items = [self.instance_json(i) for (p, z, _), i in sorted(self.instances.items()) if (p, z) == (project, zone)]
        flt = (q.get("filter") or [""])[0]
        if flt:
            items = [i for i in items if _matches(i, flt)]
        size = int((q.get("maxResults") or ["500"])[0] or 500)
        start = int((q.get("pageToken") or ["0"])[0] or 0)
        out = {"kind": "compute#instanceList", "id": f"projects/{project}/zones/{zone}/instances",
               "items": items[start:start + size], "selfLink": f"{BASE}/projects/{project}/zones/{zone}/instances"}
        if start + size < len(items):
            out["nextPageToken"] = str(start + size)
        return out

    def delete(self, project: str, zone: str, name: str) -> dict:
        self.check_service("delete", project, zone)
        now = time.time()
        self.tick(now)
        inst = self._get(project, zone, name)
        if inst.deleting is None:
            inst.deleting = now
            inst.status = "STOPPING"
            inst.history.append(["STOPPING", now])
        return self.op_json(self._new_op(project, zone, "delete", name, inst.id, now))

    def get_op(self, project: str, zone: str, name: str) -> dict:
        self.check_service("operation", project, zone)
        self.tick()
        op = self.ops.get((project, zone, name))
        if op is None:
            raise not_found(f"projects/{project}/zones/{zone}/operations/{name}")
        return self.op_json(op)

    def wait_op(self, project: str, zone: str, name: str) -> dict:
        """zoneOperations.wait: the caller holds no lock here; it sleeps between looks."""
        deadline = time.time() + self.config.wait_max_s
        while True:
            with self.lock:
                out = self.get_op(project, zone, name)
            if out["status"] == "DONE" or time.time() >= deadline:
                return out
            time.sleep(0.05)

    # ---- JSON ---------------------------------------------------------------------------------------------
    def _new_op(self, project: str, zone: str, kind: str, target: str, target_id: str, now: float) -> _Op:
        n = next(self._ids)
        name = f"operation-{int(now * 1000)}-{n:013x}-{zlib.crc32(target.encode()):08x}-{n * 2654435761 % 2**32:08x}"
        op = _Op(project, zone, name, str(7000000000000000000 + n), kind, target, target_id, now)
        self.ops[(project, zone, name)] = op
        return op

    def op_json(self, op: _Op) -> dict:
        zone_url = f"{BASE}/projects/{op.project}/zones/{op.zone}"
        out = {"kind": "compute#operation", "id": op.id, "name": op.name, "zone": zone_url,
               "operationType": op.kind, "targetLink": f"{zone_url}/instances/{op.target}", "targetId": op.target_id,
               "status": op.status, "user": "tpuctl-local@local", "progress": 100 if op.status == "DONE" else 0,
               "insertTime": _rfc3339(op.started), "startTime": _rfc3339(op.started),
               "selfLink": f"{zone_url}/operations/{op.name}"}
        if op.ended is not None:
            out["endTime"] = _rfc3339(op.ended)
        if op.error is not None and op.status == "DONE":
            out["error"] = op.error
            out["httpErrorStatusCode"], out["httpErrorMessage"] = op.http_code, op.http_message
        return out

    def instance_json(self, inst: _Instance) -> dict:
        b, p, z = inst.body, inst.project, inst.zone
        zone_url = f"{BASE}/projects/{p}/zones/{z}"
        machine = b["machineType"].rsplit("/", 1)[-1]
        nics = []
        for i, nic in enumerate(b.get("networkInterfaces") or []):
            net = nic.get("network") or "global/networks/default"
            sub = nic.get("subnetwork") or f"regions/{region_of(z)}/subnetworks/default"
            out = {"kind": "compute#networkInterface", "name": f"nic{i}", "network": _url(p, net),
                   "subnetwork": _url(p, sub),
                   "networkIP": inst.ip if i == 0 else f"10.{128 + i}.0.2", "stackType": "IPV4_ONLY",
                   "fingerprint": _fingerprint((inst.name, i))}
            if nic.get("accessConfigs"):
                out["accessConfigs"] = [{"kind": "compute#accessConfig", "type": "ONE_TO_ONE_NAT",
                                         "name": ac.get("name") or "External NAT", "natIP": inst.external_ip,
                                         "networkTier": ac.get("networkTier") or "PREMIUM"}
                                        for ac in nic["accessConfigs"]]
            nics.append(out)
        disks = [{"kind": "compute#attachedDisk", "type": "PERSISTENT", "mode": "READ_WRITE", "index": i,
                  "boot": bool(d.get("boot")), "autoDelete": bool(d.get("autoDelete", False)),
                  "deviceName": d.get("deviceName") or (inst.name if i == 0 else f"persistent-disk-{i}"),
                  "source": d.get("source") or f"{zone_url}/disks/{inst.name if i == 0 else f'{inst.name}-{i}'}",
                  "interface": "SCSI"} for i, d in enumerate(b.get("disks") or [])]
        sas = [{"email": default_service_account(p) if sa.get("email") in (None, "", "default") else sa["email"],
                "scopes": list(sa.get("scopes") or [])} for sa in b.get("serviceAccounts") or []]
        items = (b.get("metadata") or {}).get("items") or []
        out = {"kind": "compute#instance", "id": inst.id, "creationTimestamp": _rfc3339(inst.created),
               "name": inst.name, "description": b.get("description", ""), "tags": b.get("tags") or {},
               "machineType": f"{zone_url}/machineTypes/{machine}", "status": inst.status, "zone": zone_url,
               "canIpForward": bool(b.get("canIpForward", False)), "networkInterfaces": nics, "disks": disks,
               "metadata": {"kind": "compute#metadata", "fingerprint": _fingerprint(items), "items": items},
               "serviceAccounts": sas, "selfLink": f"{zone_url}/instances/{inst.name}",
               "scheduling": {"onHostMaintenance": "MIGRATE", "automaticRestart": True, "preemptible": False,
                              "provisioningModel": "STANDARD", **(b.get("scheduling") or {})},
               "labels": b.get("labels") or {}, "labelFingerprint": _fingerprint(b.get("labels") or {}),
               "fingerprint": _fingerprint(inst.id), "startRestricted": False,
               "deletionProtection": bool(b.get("deletionProtection", False))}
        if inst.status in ("RUNNING", "STOPPING"):
            out["cpuPlatform"] = "Intel Broadwell"
            out["lastStartTimestamp"] = _rfc3339(inst.created + self.config.provisioning_s + self.config.staging_s)
        return out

    def snapshot(self) -> dict:
        self.tick()
        return {"instances": [{"project": i.project, "zone": i.zone, "name": i.name, "status": i.status,
                               "ip": i.ip, "external_ip": i.external_ip, "history": i.history, "body": i.body}
                              for i in self.instances.values()],
                "gone": self.gone, "inserts": self.inserts, "injections": self.injections,
                "operations": [self.op_json(o) for o in self.ops.values()],
                "config": self.config.__dict__, "next_ip": list(self.next_ip)}

    def reset(self) -> None:
        self.instances.clear(), self.ops.clear(), self.gone.clear(), self.inserts.clear()
        self.injections.clear()
        self.next_ip = (None, None)
        self.config = InstancesConfig()


def _matches(inst: dict, flt: str) -> bool:
    """A list filter's `FIELD = VALUE` / `FIELD != VALUE` terms joined by AND (or spaces, in parentheses): the
    forms a caller looking for its own VMs uses (`labels.K = V`, `name = N`, `status = RUNNING`)."""
    for term in re.findall(r"\(?\s*([\w.-]+)\s*(=|!=|eq|ne)\s*\"?([^\s\")]*)\"?\s*\)?", flt):
        key, opr, want = term
        cur = inst
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        have = "" if cur is None else str(cur)
        if key in ("machineType", "zone") and have:
            have = have.rsplit("/", 1)[-1]
        equal = re.fullmatch(want, have) is not None if opr in ("eq", "ne") else have == want
        if equal != (opr in ("=", "eq")):
            return False
    return True


# ---- the real API's refusals ------------------------------------------------------------------------------
def _quota_parts(zone: str, inj: dict) -> tuple[str, dict]:
    name = inj.get("quota") or "CPUS"
    metric, limit_name, scope = _QUOTAS.get(
        name, (f"compute.googleapis.com/{name.lower()}", f"{name.replace('_', '-')}-per-project-region", "region"))
    limit = float(inj.get("limit", 0))
    where = "globally" if scope == "global" else f"in region {region_of(zone)}"
    text = inj.get("message") or f"Quota '{name}' exceeded.  Limit: {limit:.1f} {where}."
    info = {"metricName": metric, "limitName": limit_name, "limit": limit,
            "dimensions": {"global": "global"} if scope == "global" else {"region": region_of(zone)}}
    return text, info


def quota_op_error(zone: str, inj: dict) -> dict:
    """An insert operation that ends in QUOTA_EXCEEDED (how a VM's CPU quota usually refuses)."""
    text, info = _quota_parts(zone, inj)
    return {"errors": [{"code": "QUOTA_EXCEEDED", "message": text, "errorDetails": [{"quotaInfo": info}]}]}


def quota_sync_error(zone: str, inj: dict) -> ComputeError:
    """The same refusal when the API answers the insert itself: HTTP 403, reason quotaExceeded."""
    text, _ = _quota_parts(zone, inj)
    return ComputeError(403, text, "quotaExceeded", "usageLimits")


def org_policy_error(project: str, zone: str, name: str, inj: dict, body: dict) -> ComputeError | None:
    """HTTP 412 conditionNotMet. vmExternalIpAccess refuses only an instance that asks for an external IP."""
    constraint = inj.get("constraint") or _EXTERNAL_IP
    num = project_number(project)
    if constraint == _EXTERNAL_IP:
        if not any(nic.get("accessConfigs") for nic in body.get("networkInterfaces") or []):
            return None
        text = (f"Constraint {constraint} violated for project {num}. Add instance projects/{project}/zones/{zone}"
                f"/instances/{name} to the constraint to use external IP with it.")
    else:
        text = f"Constraint {constraint} violated for project {num}."
    return ComputeError(412, inj.get("message") or text, "conditionNotMet")


def service_disabled(project: str) -> ComputeError:
    """The API front end's answer for a project where the Compute Engine API is off: 403 PERMISSION_DENIED with
    ErrorInfo SERVICE_DISABLED and the activation URL (errors[].reason accessNotConfigured)."""
    num = project_number(project)
    url = f"https://console.developers.google.com/apis/api/compute.googleapis.com/overview?project={num}"
    text = (f"Compute Engine API has not been used in project {num} before or it is disabled. Enable it by visiting "
            f"{url} then retry. If you enabled this API recently, wait a few minutes for the action to propagate to "
            "our systems and retry.")
    return ComputeError(403, text, "accessNotConfigured", "usageLimits", status="PERMISSION_DENIED",
                        extra={"extendedHelp": "https://console.developers.google.com"}, details=[
        {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "SERVICE_DISABLED",
         "domain": "googleapis.com", "metadata": {"service": "compute.googleapis.com", "consumer": f"projects/{num}",
                                                   "activationUrl": url, "serviceTitle": "Compute Engine API",
                                                   "containerInfo": str(num)}},
        {"@type": "type.googleapis.com/google.rpc.LocalizedMessage", "locale": "en-US", "message": text},
        {"@type": "type.googleapis.com/google.rpc.Help",
         "links": [{"description": "Google developers console API activation", "url": url}]}])
