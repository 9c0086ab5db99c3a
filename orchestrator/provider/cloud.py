"""The Cloud TPU v2 API through the official `google-cloud-tpu` client (REST transport).

`connect()` resolves the endpoint (default, or `--api-endpoint`/TPUCTL_TPU_API_ENDPOINT: the local provider
passes its stand-in's URL), the credentials (anonymous for http://, otherwise Application Default Credentials)
and the project. `Api` wraps the calls tpuctl makes and turns every google.api_core error into a CloudError: one line
that says what happened and how to fix it, with a `kind` the caller can branch on.
"""
from __future__ import annotations

import configparser
import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from google.api_core import exceptions as gexc


def rest_client_kwargs(endpoint: str | None) -> dict:
    """A Google client's REST keyword arguments for `endpoint` (None: the default one); an http:// endpoint is a
    local stand-in, reached without credentials."""
    kw: dict = {"transport": "rest"}
    if endpoint:
        kw["client_options"] = {"api_endpoint": endpoint}
    if endpoint and endpoint.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials
        kw["credentials"] = AnonymousCredentials()
    return kw
from google.cloud import tpu_v2

from orchestrator.spec import UserError
from orchestrator.state import Worker

ENV_ENDPOINT = "TPUCTL_TPU_API_ENDPOINT"
_REST_PREFIX = re.compile(r"^(\d{3} )?(GET|POST|DELETE|PATCH|PUT) \S+: ")
_QUOTA_NAME = re.compile(r"[Qq]uota (?:limit |metric )?'([^']+)'")
_CAPACITY_WORDS = re.compile(r"no more capacity|stockout|insufficient capacity|not enough resources|"
                             r"capacity (?:is )?(?:not )?available|resources? (?:are )?(?:not )?available", re.I)


# ---- endpoint, credentials, project ---------------------------------------------------------------------

def _gcloud_project() -> str | None:
    """The project in the active gcloud configuration, read from its file (no gcloud process)."""
    cfg_dir = Path(os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud")
    try:
        active = (cfg_dir / "active_config").read_text().strip() or "default"
    except OSError:
        active = "default"
    parser = configparser.ConfigParser()
    try:
        parser.read(cfg_dir / "configurations" / f"config_{active}")
    except configparser.Error:
        return None
    return parser.get("core", "project", fallback=None) or None


def resolve_project(project: str | None, *, adc_project: str | None = None) -> str:
    project = (project or os.environ.get("TPUCTL_PROJECT") or os.environ.get("GOOGLE_CLOUD_PROJECT")
               or os.environ.get("CLOUDSDK_CORE_PROJECT") or _gcloud_project() or adc_project)
    if not project:
        raise UserError("no Google Cloud project: pass --project P, set GOOGLE_CLOUD_PROJECT, "
                        "or run `gcloud config set project P`")
    if not re.fullmatch(r"[a-z][-a-z0-9.:]{4,62}[a-z0-9]", project):
        raise UserError(f"invalid project id {project!r}: use the project ID (lowercase, e.g. my-project-123), "
                        "not its name or number")
    return project


def resolve_endpoint(api_endpoint: str | None = None) -> str | None:
    """The URL the client talks to; None means the default googleapis.com endpoint."""
    url = api_endpoint or os.environ.get(ENV_ENDPOINT) or None
    if url and not re.match(r"^(https?://)?[A-Za-z0-9.\-\[\]:]+(:\d+)?/?$", url):
        raise UserError(f"invalid --api-endpoint {url!r}: give a host or URL such as "
                        "https://us-central1-tpu.googleapis.com or http://127.0.0.1:8470")
    return url.rstrip("/") if url else None


def make_client(endpoint: str | None) -> tuple[tpu_v2.TpuClient, str | None]:
    """(client, ADC project). http:// endpoints get anonymous credentials, others Application Default ones."""
    options = {"api_endpoint": endpoint} if endpoint else None
    if endpoint and endpoint.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials
        return tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(), client_options=options), None
    import google.auth
    from google.auth import exceptions as auth_exc
    try:
        creds, adc_project = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    except auth_exc.DefaultCredentialsError as e:
        first = str(e).splitlines()[0][:160] if str(e) else ""
        raise CloudError("auth", "no Google Cloud credentials found: run `gcloud auth application-default login` "
                                 "(or set GOOGLE_APPLICATION_CREDENTIALS to a key file), or use --local "
                                 f"to try tpuctl without a cloud account ({first})") from None
    return tpu_v2.TpuClient(transport="rest", credentials=creds, client_options=options), adc_project


# ---- what the API returns, as plain dataclasses ---------------------------------------------------------

@dataclass(frozen=True)
class VmConfig:
    """The VMs' network and identity as the create request carries them. An empty service account is the API's
    own default (the project's default compute service account); the scopes are always sent."""
    external_ips: bool = True
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None
    scopes: tuple[str, ...] = ("https://www.googleapis.com/auth/cloud-platform",)
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass
class NodeInfo:
    name: str                 # projects/P/locations/Z/nodes/N
    state: str                # CREATING, READY, PREEMPTED, TERMINATED, DELETING, ...
    health: str = ""
    accelerator: str = ""
    runtime_version: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    queued_resource: str = ""
    spot: bool = False
    metadata: dict[str, str] = field(default_factory=dict)  # the VMs' metadata (ssh-keys: what the guest agent installs)
    service_account: str = ""

    @property
    def zone(self) -> str:
        return self.name.split("/")[3]


@dataclass
class QueuedInfo:
    name: str
    state: str                # ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, FAILED, SUSPENDED, DELETING
    node: str = ""            # full name of the node it creates (multislice: the first, NAME-0)
    nodes: list[str] = field(default_factory=list)  # every node it creates (multislice: NAME-0 .. NAME-(N-1))
    labels: dict[str, str] = field(default_factory=dict)
    error_code: int = 0
    error_message: str = ""
    spot: bool = False

    @property
    def zone(self) -> str:
        return self.name.split("/")[3]


def _enum_name(v) -> str:
    return getattr(v, "name", str(v))


def node_info(n: tpu_v2.Node) -> NodeInfo:
    workers = [Worker(index=i, internal_ip=ep.ip_address, external_ip=ep.access_config.external_ip or None)
               for i, ep in enumerate(n.network_endpoints)]
    return NodeInfo(name=n.name, state=_enum_name(n.state), health=_enum_name(n.health) if n.health else "",
                    accelerator=n.accelerator_type, runtime_version=n.runtime_version, labels=dict(n.labels),
                    workers=workers, queued_resource=n.queued_resource,
                    spot=bool(n.scheduling_config.spot or n.scheduling_config.preemptible),
                    service_account=n.service_account.email, metadata=dict(n.metadata))


def queued_info(q: tpu_v2.QueuedResource) -> QueuedInfo:
    spec = q.tpu.node_spec[0] if q.tpu.node_spec else None
    err = q.state.failed_data.error
    nodes = []
    if spec is not None and "multislice_params" in spec:  # NodeSpec's name_strategy oneof: node_id or this
        ms = spec.multislice_params
        prefix = ms.node_id_prefix or q.name.rsplit("/", 1)[-1]  # the service's default: the queued resource id
        nodes = [f"{spec.parent}/nodes/{prefix}-{i}" for i in range(ms.node_count)]
    elif spec is not None:
        nodes = [f"{spec.parent}/nodes/{spec.node_id}"]
    return QueuedInfo(name=q.name, state=_enum_name(q.state.state), node=nodes[0] if nodes else "", nodes=nodes,
                      labels=dict(spec.node.labels) if spec else {},
                      error_code=err.code, error_message=err.message, spot="spot" in q)


# ---- errors -------------------------------------------------------------------------------------------
# Classified by the answer's `error.status` (google.rpc.Code name) and ErrorInfo.reason, never by the exception
# class: over REST a FAILED_PRECONDITION arrives as an HTTP 400 (BadRequest), and a stockout, a chip-quota error
# and a request-rate limit all arrive as RESOURCE_EXHAUSTED.

_RPC_NAMES = {1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
              6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
              10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
              16: "UNAUTHENTICATED"}
_HTTP_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                409: "ALREADY_EXISTS", 412: "FAILED_PRECONDITION", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                501: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
_RESERVED_SHORT = re.compile(r"insufficient reserved capacity", re.I)
_PREEMPTED_IN_CREATE = re.compile(r"in state PREEMPTED", re.I)
_RESERVATION_MISSING = re.compile(r"reservation\b.*\bnot found", re.I)
_LOCATION_REFUSED = re.compile(r"Location (\S+?)\.? is not found or access is unauthorized", re.I)
_REGION = re.compile(r"in region ([a-z]+-[a-z]+\d+)")
# What the caller does next, by kind: another zone, the same call again after a pause, or nothing.
NEXT_ZONE, RETRY, STOP = "next-zone", "retry", "stop"
_ACTIONS = {"capacity": NEXT_ZONE, "rate-limit": RETRY, "transient": RETRY}
RETRIED = frozenset(k for k, a in _ACTIONS.items() if a == RETRY)


class CloudError(UserError):
    """An explained API failure: one line that says what happened and what to do.

    kind: capacity (stockout, reserved capacity short, spot preempted during create) | quota | rate-limit |
    transient | reservation | zone | service-disabled | billing | location-policy | permission | auth |
    bad-argument | precondition | not-found | exists | unreachable | timeout | waiting | failed.
    `action` is what tpuctl does about it: next-zone, retry (with backoff) or stop."""

    def __init__(self, kind: str, message: str, *, raw: str = "", quota: str | None = None,
                 status: str = "", reason: str = ""):
        super().__init__(message)
        self.kind, self.raw, self.quota, self.status, self.reason = kind, raw, quota, status, reason

    @property
    def action(self) -> str:
        return _ACTIONS.get(self.kind, STOP)


def _message(exc) -> str:
    msg = getattr(exc, "message", None) or str(exc)
    return _REST_PREFIX.sub("", str(msg)).strip()


def _answer(exc) -> tuple[str, str, list, dict]:
    """(error.status, ErrorInfo.reason, details, ErrorInfo.metadata) of a client exception."""
    status = ""
    resp = getattr(exc, "response", None)
    if resp is not None and hasattr(resp, "json"):
        with contextlib.suppress(Exception):
            status = (resp.json().get("error") or {}).get("status") or ""
    if not status and getattr(exc, "grpc_status_code", None) is not None:
        status = exc.grpc_status_code.name
    if not status:
        status = _HTTP_STATUS.get(getattr(exc, "code", None) or 0, "")
    details = [d for d in (getattr(exc, "details", None) or []) if isinstance(d, dict)]
    return status, getattr(exc, "reason", None) or "", details, getattr(exc, "metadata", None) or {}


def _quota_name(msg: str, metadata: dict | None = None) -> str | None:
    for key in ("quota_limit", "quota_metric"):
        if (metadata or {}).get(key):
            return metadata[key]
    m = _QUOTA_NAME.search(msg)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Where:
    """What a call was about, for the message: the action, the project, the zone and the accelerator."""
    action: str
    project: str
    zone: str = ""
    accelerator: str = ""
    endpoint: str | None = None

    @property
    def text(self) -> str:
        return f"project {self.project}" + (f", zone {self.zone}" if self.zone else "")


def classify(status: str, msg: str, w: Where, *, reason: str = "", details: list | None = None,
             metadata: dict | None = None, sync: bool = True) -> CloudError:
    """One line, with the fix, for an answer of the API (a synchronous error or an LRO/queued-resource error)."""
    details = details or []
    acc, zone, project = w.accelerator or "the slice", w.zone, w.project

    def err(kind: str, text: str, **kw) -> CloudError:
        return CloudError(kind, text, raw=msg, status=status, reason=reason, **kw)

    quota_failure = any(d.get("@type", "").endswith("google.rpc.QuotaFailure") for d in details)
    if reason == "RATE_LIMIT_EXCEEDED":
        return err("rate-limit", f"the Cloud TPU API is rate-limiting requests from {project} (RATE_LIMIT_EXCEEDED, "
                                 f"while trying to {w.action}); this is the request rate, not chip quota: wait a "
                                 f"minute and retry. API said: {msg}")
    if status == "RESOURCE_EXHAUSTED":
        quota = _quota_name(msg, metadata)
        if quota_failure or quota or re.search(r"quota", msg, re.I):
            name = quota or "the TPU quota named in the error"
            m = _REGION.search(msg)
            scope = f"region {m.group(1)}" if m else (f"zone {zone}" if zone else "this region")
            return err("quota", f"quota exceeded for {acc} in {zone or scope} ({name}, per {scope}): request more at "
                                f"https://console.cloud.google.com/iam-admin/quotas?project={project} (filter by "
                                f"{name}), try a zone in another region, or pick a smaller --accelerator. "
                                f"API said: {msg}", quota=quota)
        if sync and not _CAPACITY_WORDS.search(msg):
            return err("rate-limit", f"the Cloud TPU API is rate-limiting requests from {project} while trying to "
                                     f"{w.action} ({msg}): wait a minute and retry")
        return err("capacity", f"no capacity for {acc} in {zone} right now (stockout). API said: {msg}")
    if status == "FAILED_PRECONDITION" and _RESERVED_SHORT.search(msg):
        return err("capacity", f"not enough reserved capacity for {acc} in {zone} (Insufficient reserved capacity): "
                               f"ask for a larger reservation, or use another zone. API said: {msg}")
    if status == "INVALID_ARGUMENT" and _PREEMPTED_IN_CREATE.search(msg):
        return err("capacity", f"the spot {acc} in {zone} was preempted while it was being created (no spot "
                               f"capacity there now). API said: {msg}")
    if status == "NOT_FOUND" and _RESERVATION_MISSING.search(msg):
        m = re.search(r"(projects/\S+/reservations/[^\s.,;]+)", msg)
        name = m.group(1) if m else "the reservation"
        return err("reservation", f"reservation not found: {name} does not exist in {zone} for project {project}: "
                                  f"check the name (--reservation NAME) and that the reservation is in this zone. "
                                  f"API said: {msg}")
    if reason == "SERVICE_DISABLED":
        return err("service-disabled", f"the Cloud TPU API is not enabled in project {project}: run `gcloud services "
                                       f"enable tpu.googleapis.com --project {project}`, wait a minute, and retry")
    if reason == "BILLING_DISABLED":
        return err("billing", f"billing is not enabled for project {project}: link a billing account at "
                              f"https://console.cloud.google.com/billing/linkedaccount?project={project}, then retry")
    if reason == "LOCATION_POLICY_VIOLATED":
        return err("location-policy", f"an organization policy of project {project} forbids zone {zone} "
                                      f"(constraints/gcp.resourceLocations): pick a zone it allows, or ask your "
                                      f"organization admin. API said: {msg}")
    loc = _LOCATION_REFUSED.search(msg)
    if loc and status in ("PERMISSION_DENIED", "NOT_FOUND"):
        bad = loc.group(1).rstrip(".")
        return err("zone", f"zone {bad} is not a Cloud TPU location for project {project}, or the project may not "
                           f"use it: check the spelling (e.g. us-central2-b, see https://cloud.google.com/tpu/docs/"
                           f"regions-zones); if it is right, your account may lack tpu.locations permissions there "
                           f"(roles/tpu.viewer or roles/tpu.admin on {project})")
    if status == "PERMISSION_DENIED":
        perm = (metadata or {}).get("permission", "")
        return err("permission", f"permission denied while trying to {w.action} in {w.text}"
                                 + (f" (missing {perm})" if perm else "")
                                 + f": grant your account roles/tpu.admin on {project} and check that the project id "
                                   f"is right. API said: {msg}")
    if status == "UNAUTHENTICATED":
        return err("auth", f"the Cloud TPU API rejected the credentials ({msg}): run "
                           "`gcloud auth application-default login`")
    if status == "NOT_FOUND":
        return err("not-found", f"not found while trying to {w.action} in {w.text}: {msg}")
    if status == "ALREADY_EXISTS":
        return err("exists", f"cannot {w.action}: it already exists in {w.text} ({msg}); pick another name "
                             "or delete it with `tpuctl down NAME --zone Z --project P`")
    if status == "FAILED_PRECONDITION":
        return err("precondition", f"cannot {w.action} in {w.text} now: {msg}")
    if status in ("INVALID_ARGUMENT", "OUT_OF_RANGE"):
        return err("bad-argument", f"the Cloud TPU API rejected the request to {w.action} in {w.text}: {msg} "
                                   "(check --accelerator, --zone and --runtime-version; see `tpuctl up --help`)")
    if status in ("UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "ABORTED", "UNKNOWN") and sync:
        return err("transient", f"the Cloud TPU API failed while trying to {w.action} in {w.text} "
                                f"({status}: {msg}); it usually passes: retry in a minute")
    return err("failed", f"could not {w.action} in {zone or w.text}: {msg or 'no reason given'}"
                         + (f" ({status})" if status else ""))


def explain(exc: BaseException, *, action: str, project: str, zone: str = "", accelerator: str = "",
            endpoint: str | None = None) -> CloudError:
    """Turn a client exception into a one-line CloudError with the fix."""
    if isinstance(exc, CloudError):
        return exc
    w = Where(action, project, zone, accelerator, endpoint)
    if isinstance(exc, gexc.RetryError):
        return CloudError("transient", f"the Cloud TPU API did not answer in time while trying to {action} "
                                       f"({_message(exc)}); retry, or check --api-endpoint", raw=_message(exc))
    if isinstance(exc, gexc.GoogleAPICallError):
        status, reason, details, metadata = _answer(exc)
        return classify(status, _message(exc), w, reason=reason, details=details, metadata=metadata)
    import requests
    if isinstance(exc, requests.exceptions.RequestException):
        target = endpoint or "https://tpu.googleapis.com"
        return CloudError("unreachable", f"cannot reach the Cloud TPU API at {target} ({type(exc).__name__}): "
                                         "check your network or --api-endpoint", raw=str(exc))
    from google.auth import exceptions as auth_exc
    if isinstance(exc, auth_exc.GoogleAuthError):
        return CloudError("auth", f"could not get Google credentials ({str(exc).splitlines()[0][:200]}): run "
                                  "`gcloud auth application-default login`", raw=str(exc))
    raise exc  # not an API error: a bug, let it surface


def exhausted(msg: str, *, sync: bool, zone: str, accelerator: str, project: str) -> CloudError:
    """A RESOURCE_EXHAUSTED answer: stockout, chip quota or request rate, told apart by details and message."""
    return classify("RESOURCE_EXHAUSTED", msg, Where(f"create {accelerator}", project, zone, accelerator), sync=sync)


def operation_error(code: int, msg: str, *, zone: str, accelerator: str, project: str, action: str) -> CloudError:
    """An error reported by an LRO or a FAILED queued resource (a google.rpc.Status: a code, no HTTP)."""
    return classify(_RPC_NAMES.get(code, "UNKNOWN" if code else ""), msg, Where(action, project, zone, accelerator),
                    sync=False)


# ---- the API ---------------------------------------------------------------------------------------------

@dataclass
class Api:
    client: tpu_v2.TpuClient
    project: str
    endpoint: str | None = None   # None: the default Cloud TPU endpoint
    call_timeout: float = 30.0
    tries: int = 5                                   # per call, for rate limits and transient errors
    on_retry: Callable[[str], None] | None = None    # told once per call that it is being retried

    @property
    def poll_s(self) -> float:
        """How often waits poll: fast against a stand-in (http://), gently against the real API."""
        env = os.environ.get("TPUCTL_POLL_S")
        if env:
            return float(env)
        return 0.1 if (self.endpoint or "").startswith("http://") else 5.0

    def parent(self, zone: str) -> str:
        return f"projects/{self.project}/locations/{zone}"

    @property
    def backoff_s(self) -> float:
        """The first pause before a retry; it doubles each time (1 s against the real API)."""
        return min(self.poll_s, 1.0)

    def _do(self, fn, *, action: str, zone: str = "", accelerator: str = "", retry: frozenset[str] = RETRIED):
        """Call fn; every client error becomes one explained line. Errors of the kinds in `retry` (rate limits and
        transient errors) are retried with exponential backoff, announced once through on_retry."""
        delay = self.backoff_s
        for attempt in range(1, self.tries + 1):
            try:
                return fn()
            except Exception as e:
                err = explain(e, action=action, project=self.project, zone=zone, accelerator=accelerator,
                              endpoint=self.endpoint)
                if err.kind not in retry or attempt == self.tries:
                    if attempt > 1:
                        err.args = (f"{err} (after {attempt} tries)",)
                    raise err from None
                if attempt == 1 and self.on_retry is not None:
                    self.on_retry(f"the Cloud TPU API answered {err.status or err.kind} while trying to {action}; "
                                  f"retrying with backoff (up to {self.tries} tries)")
                time.sleep(delay)
                delay *= 2

    def accelerator_types(self, zone: str) -> list[str]:
        return self._do(lambda: [a.type_ for a in self.client.list_accelerator_types(
            parent=self.parent(zone), timeout=self.call_timeout)], action="list accelerator types", zone=zone)

    def runtime_versions(self, zone: str) -> list[str]:
        return self._do(lambda: [r.version for r in self.client.list_runtime_versions(
            parent=self.parent(zone), timeout=self.call_timeout)], action="list runtime versions", zone=zone)

    def node_body(self, accelerator: str, runtime_version: str, labels: dict[str, str], *, spot: bool = False,
                  reserved: bool = False, in_queue: bool = False, vm: "VmConfig | None" = None) -> tpu_v2.Node:
        """The Node a create request carries. Spot inside a queued resource is the queued resource's `spot`, not
        the node's; `reserved` is the node's schedulingConfig.reserved in v2 (v2alpha1's guaranteed.reserved
        does not exist there)."""
        vm = vm or VmConfig()
        sched = tpu_v2.SchedulingConfig(spot=spot and not in_queue, reserved=reserved)
        return tpu_v2.Node(accelerator_type=accelerator, runtime_version=runtime_version, labels=labels,
                           network_config=tpu_v2.NetworkConfig(enable_external_ips=vm.external_ips,
                                                               network=vm.network or "",
                                                               subnetwork=vm.subnetwork or ""),
                           service_account=tpu_v2.ServiceAccount(email=vm.service_account or "",
                                                                 scope=list(vm.scopes)),
                           metadata=dict(vm.metadata), scheduling_config=sched)

    def reservation_path(self, zone: str, reservation: str) -> str:
        """A reservation's full name: projects/P/locations/Z/reservations/R (a short name is taken as in zone)."""
        return reservation if reservation.startswith("projects/") else f"{self.parent(zone)}/reservations/{reservation}"

    def create_node(self, zone: str, node_id: str, node: tpu_v2.Node):
        """Start creating a plain node; returns the google.api_core Operation."""
        return self._do(lambda: self.client.create_node(parent=self.parent(zone), node_id=node_id, node=node,
                                                        timeout=self.call_timeout),
                        action="create a TPU node", zone=zone, accelerator=node.accelerator_type,
                        retry=frozenset({"rate-limit"}))  # a 503 may have created it: not blindly sent again

    def create_queued_resource(self, zone: str, qr_id: str, node_id: str, node: tpu_v2.Node, *, spot: bool = False,
                               valid_until_s: float | None = None, reservation: str | None = None,
                               node_count: int = 1):
        """Start creating a queued resource holding one node, or with node_count > 1 a multislice one (v2's
        NodeSpec.multisliceParams {nodeCount, nodeIdPrefix=node_id}: nodes node_id-0 .. node_id-(N-1), all
        provisioned or none); returns the Operation. `reservation` (v2's reservationName) consumes that
        reservation; the node then also carries schedulingConfig.reserved."""
        NodeSpec = tpu_v2.QueuedResource.Tpu.NodeSpec
        if node_count > 1:
            ns = NodeSpec(parent=self.parent(zone), node=node, multislice_params=NodeSpec.MultisliceParams(
                node_count=node_count, node_id_prefix=node_id))
        else:
            ns = NodeSpec(parent=self.parent(zone), node_id=node_id, node=node)
        qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[ns]))
        if spot:
            qr.spot = tpu_v2.QueuedResource.Spot()
        if reservation:
            qr.reservation_name = self.reservation_path(zone, reservation)
        if valid_until_s:
            qr.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(
                valid_until_duration={"seconds": max(1, int(valid_until_s))})
        return self._do(lambda: self.client.create_queued_resource(
            parent=self.parent(zone), queued_resource_id=qr_id, queued_resource=qr, timeout=self.call_timeout),
            action="create a queued resource", zone=zone, accelerator=node.accelerator_type, retry=frozenset({"rate-limit"}))

    def get_node(self, name: str) -> NodeInfo | None:
        try:
            return node_info(self._do(lambda: self.client.get_node(name=name, timeout=self.call_timeout),
                                      action="get node", zone=name.split("/")[3]))
        except CloudError as e:
            if e.kind == "not-found":
                return None
            raise

    def get_queued_resource(self, name: str) -> QueuedInfo | None:
        try:
            return queued_info(self._do(lambda: self.client.get_queued_resource(name=name, timeout=self.call_timeout),
                                        action="get queued resource", zone=name.split("/")[3]))
        except CloudError as e:
            if e.kind == "not-found":
                return None
            raise

    def delete_node(self, name: str) -> bool:
        """Start deleting a node. False when it does not exist."""
        try:
            self._do(lambda: self.client.delete_node(name=name, timeout=self.call_timeout),
                     action="delete node", zone=name.split("/")[3])
            return True
        except CloudError as e:
            if e.kind == "not-found":
                return False
            raise

    def delete_queued_resource(self, name: str, force: bool = True) -> bool:
        """Start deleting a queued resource (force: with its node). False when it does not exist."""
        try:
            self._do(lambda: self.client.delete_queued_resource(request={"name": name, "force": force},
                                                                timeout=self.call_timeout),
                     action="delete queued resource", zone=name.split("/")[3])
            return True
        except CloudError as e:
            if e.kind == "not-found":
                return False
            raise

    def list_nodes(self, zone: str) -> list[NodeInfo]:
        return self._do(lambda: [node_info(n) for n in self.client.list_nodes(
            parent=self.parent(zone), timeout=self.call_timeout)], action="list nodes", zone=zone)

    def list_queued_resources(self, zone: str) -> list[QueuedInfo]:
        return self._do(lambda: [queued_info(q) for q in self.client.list_queued_resources(
            parent=self.parent(zone), timeout=self.call_timeout)], action="list queued resources", zone=zone)

    def guest_attributes(self, name: str, query_path: str = "") -> list[list[tuple[str, str, str]]]:
        """Each worker's published guest attributes under query_path, in worker order: [(namespace, key, value)]."""
        resp = self._do(lambda: self.client.get_guest_attributes(
            request={"name": name, "query_path": query_path}, timeout=self.call_timeout),
            action="read the workers' guest attributes", zone=name.split("/")[3])
        return [[(e.namespace, e.key, e.value) for e in ga.query_value.items] for ga in resp.guest_attributes]

    def poll_operation(self, op) -> tuple[bool, int, str]:
        """(done, error code, error message) of an Operation, refreshed once."""
        self._do(lambda: op.done(), action="poll operation")
        pb = op.operation
        if not pb.done:
            return False, 0, ""
        return True, (pb.error.code if pb.HasField("error") else 0), (pb.error.message if pb.HasField("error") else "")


def connect(*, api_endpoint: str | None = None, project: str | None = None) -> Api:
    """An Api for this endpoint and project (see the module doc for how each is resolved)."""
    url = api_endpoint or os.environ.get(ENV_ENDPOINT) or ""
    if url.startswith("http://"):
        # No credentials involved: check the project before anything starts or is called.
        project = resolve_project(project)
        endpoint = resolve_endpoint(api_endpoint)
        client, _ = make_client(endpoint)
    else:
        endpoint = resolve_endpoint(api_endpoint)
        client, adc_project = make_client(endpoint)
        project = resolve_project(project, adc_project=adc_project)
    return Api(client=client, project=project, endpoint=endpoint)


def get_node(name: str, *, project: str | None = None, zone: str | None = None,
             api_endpoint: str | None = None) -> NodeInfo | None:
    """A node's current state (READY, PREEMPTED, ...) and workers, or None when it is gone.

    `name` is a full node name (projects/P/locations/Z/nodes/N) or a short one with project and zone."""
    if not name.startswith("projects/"):
        if not zone:
            raise UserError(f"get_node({name!r}) needs a zone (or the full node name)")
        api = connect(api_endpoint=api_endpoint, project=project)
        return api.get_node(f"{api.parent(zone)}/nodes/{name}")
    api = connect(api_endpoint=api_endpoint, project=name.split("/")[1])
    return api.get_node(name)
