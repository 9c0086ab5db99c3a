"""Local stand-ins of Compute Engine (project metadata, VM instances) and OS Login, so the real
`google-cloud-compute` and `google-cloud-os-login` clients (REST transport) are what tests exercise. One server
answers both:

  Compute Engine v1   GET  /compute/v1/projects/P            a Project (compute_v1 types Project / Metadata /
                                                             Items): `commonInstanceMetadata.items` [{key, value}],
                                                             where `enable-oslogin: TRUE` turns OS Login on for
                                                             every VM of the project
                      instances insert/get/list/delete and zoneOperations get/wait under
                      /compute/v1/projects/P/zones/Z/: infra/fake_compute_instances.py (its docstring has the
                      routes, the life of an instance and the sources of the wire format)
  OS Login v1         POST /v1/users/U:importSshPublicKey    body SshPublicKey {key, expirationTimeUsec},
                                                             ?projectId=P; answers ImportSshPublicKeyResponse
                                                             {loginProfile: LoginProfile}
                      GET  /v1/users/U/loginProfile          LoginProfile {name, posixAccounts, sshPublicKeys}
  (oslogin_v1 types LoginProfile / PosixAccount / SshPublicKey; the key map is by the key's SHA-256 hex
  fingerprint, and the POSIX user name is the account's email with every character that is not a letter or a
  digit turned into `_`, as OS Login names accounts of the account's own domain.)
  Cloud Resource Manager v1   GET /v1/projects/P, POST /v1/projects/P:getIamPolicy, :setIamPolicy: a project and
                      its IAM policy (infra/fake_project_iam.py: routes, defaults, sources)
  Cloud Storage JSON v1   GET|PUT /storage/v1/b/B/iam, GET /storage/v1/b/B/iam/testPermissions: a bucket's IAM
                      policy and what a caller holds on it (infra/fake_bucket_iam.py: routes, callers, defaults)

Errors are google.rpc shapes: {"error": {code, message, status, details: [ErrorInfo]}}; Compute Engine's own add
`errors: [{message, domain, reason}]`.

Control under /_fake/ (JSON, FakeLoginControl is its client):
  POST project_metadata {project, items: {key: value}}   the project's common metadata
  POST deny {what: compute|oslogin|resourcemanager, permission?}   403 IAM_PERMISSION_DENIED for that API (until
                                                          reset)
  POST username {account, username}                      the POSIX name the profile reports for an account
  POST bucket_project {bucket, project}                   the project a bucket belongs to (its policy's default,
                                                          its project's grants); set once: answers the one it has
  GET  state                                              imported keys per account, with their expiry
  POST reset
  Compute Engine instances (FakeLoginControl has a method for each):
  POST compute_ips {ip, external?}                        instances inserted afterwards report this networkIP
                                                          (and natIP: external, else ip); null: 10.128.0.N
  POST compute_instance_ip {project, zone, name, ip, external?}   change an existing instance's
  POST compute_inject {kind, op?, project?, zone?, times?, ...}   a refusal as the real API gives it:
         quota {quota?: CPUS, limit?: 0, sync?}    the insert operation ends QUOTA_EXCEEDED (quotaInfo), or
                                                   sync: HTTP 403 quotaExceeded; no instance is made
         org_policy {constraint?}                 HTTP 412 conditionNotMet; vmExternalIpAccess (the default)
                                                   refuses only an instance that asks for an external IP
         service_disabled                         HTTP 403 SERVICE_DISABLED with the activation URL (op: any)
       op: insert (default) | get | list | delete | operation | project | any; times: None = until reset
  POST compute_config {provisioning_s, staging_s, stopping_s, terminated_s, wait_max_s}
  GET  compute_state                                      instances (with status history and the insert body),
                                                          gone ones, insert bodies, operations, injections
  POST compute_vm_host {project, zone, name, base_dir, keep?, first_ip?}   local mode: the RUNNING instance gets a real host
         (an sshd in its own namespaces, infra/local_slice.py) started by this process, and its metadata's
         `startup-script` is run there as root, as the guest agent does at boot; deleting the instance stops the
         host, as the VM dies with it. Answers the host's record.
  GET  health                                             {ok, pid}

Run: python -m infra.fake_login_apis --port 0 --ready-file F    or, in tests: start_in_thread().
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from infra import serving
from infra.serving import Control, Running
from infra.fake_compute_instances import ComputeError, ComputeInstances, InstancesConfig
from infra.fake_bucket_iam import BucketPolicies, caller_of
from infra.fake_project_iam import IamError, ProjectPolicies

_ZONE = r"/compute/v1/projects/(?P<p>[^/]+)/zones/(?P<z>[^/]+)"
_COMPUTE_ROUTES = [
    ("POST", re.compile(_ZONE + r"/instances"), "insert"),
    ("GET", re.compile(_ZONE + r"/instances"), "list"),
    ("GET", re.compile(_ZONE + r"/instances/(?P<n>[^/]+)"), "get"),
    ("DELETE", re.compile(_ZONE + r"/instances/(?P<n>[^/]+)"), "delete"),
    ("GET", re.compile(_ZONE + r"/operations/(?P<n>[^/]+)"), "get_op"),
]
_WAIT = re.compile(_ZONE + r"/operations/(?P<n>[^/]+)/wait")


class _Err(Exception):
    def __init__(self, code: int, status: str, message: str, details: list | None = None):
        super().__init__(message)
        self.code, self.status, self.message, self.details = code, status, message, details or []

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "status": self.status, "details": self.details}}


def posix_name(account: str) -> str:
    return re.sub(r"[^a-z0-9]", "_", account.lower())[:32]


@dataclass
class LoginState:
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)   # project -> common metadata
    keys: dict[str, dict[str, dict]] = field(default_factory=dict)      # account -> fingerprint -> SshPublicKey
    denied: dict[str, str] = field(default_factory=dict)                # compute|oslogin -> permission
    usernames: dict[str, str] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    compute: ComputeInstances = field(default=None)  # type: ignore[assignment]
    iam: ProjectPolicies = field(default_factory=ProjectPolicies)
    buckets: BucketPolicies = field(default=None)  # type: ignore[assignment]
    vm_hosts: dict[tuple[str, str, str], tuple[str, str]] = field(default_factory=dict)  # instance -> host, base

    def __post_init__(self):
        if self.compute is None:
            self.compute = ComputeInstances(lock=self.lock)
        if self.buckets is None:
            self.buckets = BucketPolicies(self.iam)

    def project(self, project: str) -> dict:
        self.compute.check_service("project", project)
        self._check("compute", f"compute.projects.get on projects/{project}")
        items = [{"key": k, "value": v} for k, v in self.metadata.get(project, {}).items()]
        fp = hashlib.md5(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]
        return {"kind": "compute#project", "id": str(abs(hash(project)) % 10**12), "name": project,
                "commonInstanceMetadata": {"kind": "compute#metadata", "fingerprint": fp, "items": items},
                "selfLink": f"https://www.googleapis.com/compute/v1/projects/{project}"}

    def _check(self, what: str, default_permission: str) -> None:
        if what in self.denied:
            perm = self.denied[what] or default_permission
            raise _Err(403, "PERMISSION_DENIED", f"Permission '{perm}' denied on resource (or it may not exist).",
                       [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "IAM_PERMISSION_DENIED",
                         "domain": "googleapis.com", "metadata": {"permission": perm}}])

    def profile(self, account: str, project: str | None = None) -> dict:
        name = self.usernames.get(account) or posix_name(account)
        uid = 1000 + int(hashlib.sha256(account.encode()).hexdigest()[:6], 16) % 100000
        return {"name": account,
                "posixAccounts": [{"primary": True, "username": name, "uid": str(uid), "gid": str(uid),
                                   "homeDirectory": f"/home/{name}", "operatingSystemType": "LINUX",
                                   "accountId": project or "", "systemId": ""}],
                "sshPublicKeys": {fp: k for fp, k in self.keys.get(account, {}).items()
                                  if not k.get("expirationTimeUsec") or
                                  int(k["expirationTimeUsec"]) > time.time() * 1e6}}

    def import_key(self, account: str, body: dict, project: str | None) -> dict:
        self._check("oslogin", "compute.oslogin.updateExternalUser" if project else "oslogin.sshPublicKeys.create")
        key = (body.get("key") or "").strip()
        parts = key.split()
        if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
            raise _Err(400, "INVALID_ARGUMENT", "Invalid SSH key: expected 'TYPE BASE64 [COMMENT]'.")
        fp = hashlib.sha256(parts[1].encode()).hexdigest()
        entry = {"key": key, "fingerprint": fp, "name": f"users/{account}/sshPublicKeys/{fp}"}
        if body.get("expirationTimeUsec"):
            entry["expirationTimeUsec"] = str(int(body["expirationTimeUsec"]))
        self.keys.setdefault(account, {})[fp] = entry
        return {"loginProfile": self.profile(account, project)}


def _handler(state: LoginState):
    class H(serving.JsonHandler):

        def _do(self, method: str) -> None:
            url = urlsplit(self.path)
            q = parse_qs(url.query)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}") if n else {}
            path = unquote(url.path)
            try:
                if method == "POST" and (m := _WAIT.fullmatch(path)):  # sleeps: must not hold the lock
                    self._send(200, state.compute.wait_op(m["p"], m["z"], m["n"]))
                    return
                if method == "POST" and path == "/_fake/compute_vm_host":  # starts sshd: seconds, outside the lock
                    self._send(200, _start_vm_host(state, body))
                    return
                with state.lock:
                    self._send(200, self._route(method, path, body, q))
            except (_Err, ComputeError, IamError) as e:
                self._send(e.code, e.body())
            except (ValueError, KeyError, TypeError) as e:  # a control call's bad argument
                self._send(400, {"error": {"code": 400, "message": str(e), "status": "INVALID_ARGUMENT"}})

        def _route(self, method: str, path: str, body: dict, q: dict) -> dict:
            project = (q.get("projectId") or [None])[0]
            if m := re.fullmatch(r"/compute/v1/projects/([^/]+)", path):
                if method == "GET":
                    return state.project(m.group(1))
            if m := re.fullmatch(r"/v1/users/([^/:]+):importSshPublicKey", path):
                if method == "POST":
                    return state.import_key(m.group(1), body, project)
            if m := re.fullmatch(r"/v1/users/([^/:]+)/loginProfile", path):
                if method == "GET":
                    state._check("oslogin", "oslogin.users.get")  # noqa: SLF001
                    return state.profile(m.group(1), project)
            if m := re.fullmatch(r"/v1/projects/([^/:]+)", path):
                if method == "GET":
                    state._check("resourcemanager", "resourcemanager.projects.get")  # noqa: SLF001
                    return state.iam.project(m.group(1))
            if m := re.fullmatch(r"/v1/projects/([^/:]+):(getIamPolicy|setIamPolicy)", path):
                if method == "POST":
                    state._check("resourcemanager", f"resourcemanager.projects.{m.group(2)}")  # noqa: SLF001
                    return (state.iam.get if m.group(2) == "getIamPolicy" else state.iam.set)(m.group(1), body)
            if m := re.fullmatch(r"/storage/v1/b/([^/]+)/iam(/testPermissions)?", path):
                caller = caller_of(self.headers.get("Authorization"))
                if method == "GET" and m.group(2):
                    return state.buckets.test(caller, m.group(1), q.get("permissions") or [])
                if method == "GET":
                    return state.buckets.get(caller, m.group(1))
                if method == "PUT":
                    return state.buckets.set(caller, m.group(1), body)
            for verb, rx, name in _COMPUTE_ROUTES:
                if verb == method and (m := rx.fullmatch(path)):
                    return self._compute(name, m, body, q)
            if path.startswith("/_fake/"):
                return self._control(method, path[len("/_fake/"):], body)
            raise _Err(404, "NOT_FOUND", f"no such method: {method} {path}")

        def _compute(self, name: str, m: re.Match, body: dict, q: dict) -> dict:
            c, p, z = state.compute, m["p"], m["z"]
            perm = {"insert": "compute.instances.create", "list": "compute.instances.list",
                    "get": "compute.instances.get", "delete": "compute.instances.delete",
                    "get_op": "compute.zoneOperations.get"}[name]
            state._check("compute", perm)  # noqa: SLF001
            if name == "insert":
                return c.insert(p, z, body)
            if name == "list":
                return c.list(p, z, q)
            out = {"get": c.get, "delete": c.delete, "get_op": c.get_op}[name](p, z, m["n"])
            if name == "delete" and (host := state.vm_hosts.pop((p, z, m["n"]), None)):
                threading.Thread(target=_stop_vm_host, args=host, daemon=True).start()
            return out

        def _control(self, method: str, what: str, body: dict) -> dict:
            c = state.compute
            if what == "compute_ips" and method == "POST":
                c.set_ips(body.get("ip"), body.get("external"))
                return {"ok": True}
            if what == "compute_instance_ip" and method == "POST":
                return c.set_instance_ip(body["project"], body["zone"], body["name"], body["ip"],
                                         body.get("external"))
            if what == "compute_inject" and method == "POST":
                return c.inject(body)
            if what == "compute_config" and method == "POST":
                for k, v in body.items():
                    if k not in InstancesConfig.__dataclass_fields__:
                        raise ValueError(f"unknown compute_config field {k!r}")
                    setattr(c.config, k, float(v))
                return c.config.__dict__
            if what == "compute_state":
                c.tick()
                return c.snapshot()
            if what == "project_metadata" and method == "POST":
                state.metadata[body["project"]] = dict(body.get("items") or {})
                return {"ok": True}
            if what == "deny" and method == "POST":
                state.denied[body["what"]] = body.get("permission") or ""
                return {"ok": True}
            if what == "bucket_project" and method == "POST":
                return state.buckets.belongs(body["bucket"], body["project"])
            if what == "username" and method == "POST":
                state.usernames[body["account"]] = body["username"]
                return {"ok": True}
            if what == "state":
                return {"keys": state.keys, "metadata": state.metadata, "denied": state.denied}
            if what == "health":
                return {"ok": True, "pid": os.getpid()}
            if what == "reset" and method == "POST":
                state.metadata.clear(), state.keys.clear(), state.denied.clear(), state.usernames.clear()
                for host in state.vm_hosts.values():
                    _stop_vm_host(*host)
                state.vm_hosts.clear()
                state.iam.reset()
                state.buckets.reset()
                c.reset()
                return {"ok": True}
            raise _Err(404, "NOT_FOUND", f"no such control endpoint: {method} /_fake/{what}")

        def do_GET(self):
            self._do("GET")

        def do_POST(self):
            self._do("POST")

        def do_DELETE(self):
            self._do("DELETE")

        def do_PUT(self):
            self._do("PUT")

    return H


def _start_vm_host(state: LoginState, body: dict) -> dict:
    """The instance's VM as a host on this machine, and its startup script run there (the guest agent's part)."""
    from infra.local_slice import LocalSlice, LocalSliceError
    key = (body["project"], body["zone"], body["name"])
    with state.lock:
        inst = state.compute.get(*key)
    if inst["status"] != "RUNNING":
        raise _Err(400, "FAILED_PRECONDITION", f"instance {body['name']} is {inst['status']}, not RUNNING")
    try:
        s = LocalSlice.start(body["name"], 1, body["base_dir"], keep=tuple(body.get("keep") or ()),
                             first_ip=body.get("first_ip"))
    except (LocalSliceError, OSError) as e:
        raise _Err(409, "ABORTED", f"local host for instance {body['name']}: {e}") from None
    with state.lock:
        state.vm_hosts[key] = (s.name, s.base_dir)
    items = {i["key"]: i["value"] for i in (inst.get("metadata") or {}).get("items") or []}
    if items.get("startup-script"):
        h = s.hosts[0]
        Path(h.home, "startup-script").write_text(items["startup-script"])
        # As the guest agent: as root, detached from whoever asked, its output kept beside it.
        subprocess.run(["ssh", "-i", s.ssh_key, "-p", str(h.port), "-o", "StrictHostKeyChecking=no",
                        "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{h.ip}",
                        "setsid nohup bash /root/startup-script > /root/startup-script.log 2>&1 < /dev/null &"],
                       check=True, timeout=60, stdin=subprocess.DEVNULL)
    return dataclasses.asdict(s)


def _stop_vm_host(name: str, base_dir: str) -> None:
    from infra.local_slice import LocalSlice
    time.sleep(0.3)  # the delete's answer goes out first: the caller may be on that VM
    LocalSlice.stop_by_name(name, base_dir)


class FakeLoginControl(Control):

    def set_project_metadata(self, project: str, items: dict[str, str]) -> dict:
        return self.call("POST", "project_metadata", {"project": project, "items": items})

    def deny(self, what: str, permission: str | None = None) -> dict:
        return self.call("POST", "deny", {"what": what, "permission": permission})

    def bucket_project(self, bucket: str, project: str) -> dict:
        return self.call("POST", "bucket_project", {"bucket": bucket, "project": project})

    def set_username(self, account: str, username: str) -> dict:
        return self.call("POST", "username", {"account": account, "username": username})

    def state(self) -> dict:
        return self.call("GET", "state")

    # Compute Engine instances
    def set_ips(self, ip: str | None, external: str | None = None) -> dict:
        """Instances inserted afterwards report `ip` as networkIP (and `external`, else `ip`, as an access
        config's natIP); None: 10.128.0.N."""
        return self.call("POST", "compute_ips", {"ip": ip, "external": external})

    def set_instance_ip(self, project: str, zone: str, name: str, ip: str, external: str | None = None) -> dict:
        return self.call("POST", "compute_instance_ip", {"project": project, "zone": zone, "name": name, "ip": ip,
                                                         "external": external})

    def inject(self, kind: str, **kw) -> dict:
        return self.call("POST", "compute_inject", {"kind": kind, **{k: v for k, v in kw.items() if v is not None}})

    def quota(self, *, quota: str = "CPUS", limit: float = 0, sync: bool = False, times: int | None = None,
              **kw) -> dict:
        """An instance insert refused for quota: the operation ends QUOTA_EXCEEDED (sync: HTTP 403)."""
        return self.inject("quota", quota=quota, limit=limit, sync=sync or None, times=times, **kw)

    def org_policy(self, constraint: str | None = None, *, times: int | None = None, **kw) -> dict:
        """HTTP 412 conditionNotMet "Constraint ... violated for project NUMBER ..." on insert."""
        return self.inject("org_policy", constraint=constraint, times=times, **kw)

    def service_disabled(self, *, op: str = "any", times: int | None = None, **kw) -> dict:
        """HTTP 403 SERVICE_DISABLED: the Compute Engine API is not enabled in the project."""
        return self.inject("service_disabled", op=op, times=times, **kw)

    def compute_config(self, **kw) -> dict:
        return self.call("POST", "compute_config", kw)

    def compute_state(self) -> dict:
        return self.call("GET", "compute_state")

    def start_vm_host(self, project: str, zone: str, name: str, base_dir: str, keep: list[str] = (),
                      first_ip: str | None = None) -> dict:
        return self.call("POST", "compute_vm_host", {"project": project, "zone": zone, "name": name,
                                                      "base_dir": base_dir, "keep": list(keep), "first_ip": first_ip})

    def health(self) -> dict:
        return self.call("GET", "health")

    def reset(self) -> dict:
        return self.call("POST", "reset", {})




def start_in_thread(host: str = "127.0.0.1", port: int = 0) -> Running:
    return serving.in_thread(ThreadingHTTPServer((host, port), _handler(LoginState())), "fake-login-apis",
                             FakeLoginControl)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.fake_login_apis", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (see --ready-file)")
    ap.add_argument("--ready-file", help="write {pid, host, port, url} as JSON here once listening")
    a = ap.parse_args(argv)
    try:
        server = ThreadingHTTPServer((a.host, a.port), _handler(LoginState()))
    except OSError as e:
        print(f"error: cannot listen on {a.host}:{a.port}: {e.strerror}; pick another --port", file=sys.stderr)
        return 2
    return serving.serve(server, a.host, a.ready_file, "Compute Engine and OS Login stand-in")


if __name__ == "__main__":
    sys.exit(main())
