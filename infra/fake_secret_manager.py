"""A local stand-in of Secret Manager's REST API v1, so the real `google-cloud-secret-manager` client
(`SecretManagerServiceClient(transport="rest")`) is what tests and local mode exercise.

Source of the wire format: the installed client (google-cloud-secret-manager 2.32.0): the URIs in
`secretmanager_v1/services/secret_manager_service/transports/rest_base.py` and the JSON names of `Secret`,
`SecretVersion`, `SecretPayload`, `AccessSecretVersionResponse`, `ListSecretsResponse` (`secretmanager_v1/types`)
and google.iam.v1's `Policy` / `SetIamPolicyRequest`. The messages of the 404, 409 and 403 are the real API's as
gcloud prints them ("Secret [projects/NUMBER/secrets/X] not found or has no versions.", "Permission
'secretmanager.versions.access' denied on resource (or it may not exist)." with ErrorInfo IAM_PERMISSION_DENIED);
names in answers carry the project's number, as the real API's do. The wording of the 400s is this stand-in's own.

  POST   /v1/projects/P/secrets?secretId=S              create: body Secret {replication, labels?}; 409 if it
                                                        exists
  GET    /v1/projects/P/secrets[?pageSize=&pageToken=]  list: {secrets, nextPageToken?, totalSize}
  GET    /v1/projects/P/secrets/S                       get
  DELETE /v1/projects/P/secrets/S                       delete (its versions and IAM policy with it)
  POST   /v1/projects/P/secrets/S:addVersion            body {payload: {data: base64, dataCrc32c?}}: SecretVersion
                                                        (versions 1, 2, ...; a wrong dataCrc32c is refused)
  GET    /v1/projects/P/secrets/S/versions/V:access     V = N or latest: {name (the version's number), payload
                                                        {data, dataCrc32c}}
  GET    /v1/projects/P/secrets/S:getIamPolicy          Policy {version, etag, bindings [{role, members}]}
  POST   /v1/projects/P/secrets/S:setIamPolicy          body {policy}; a stale etag: 409 ABORTED

Who calls: `Authorization: Bearer MEMBER` names the caller as an IAM member (`serviceAccount:EMAIL`,
`user:EMAIL`); a request without credentials (AnonymousCredentials) is the project's owner. A caller may do
what the project's owners may (everything), what its project roles give (`grant`), and on one secret what that
secret's policy gives: roles/secretmanager.secretAccessor -> versions.access, .viewer -> get/list/getIamPolicy,
.secretVersionAdder -> addVersion, .admin -> all. Otherwise 403, also for a secret that does not exist (the
real API does not tell a caller without access whether it exists).

Payloads never reach a log or the control API: a request is logged (with --verbose) as its method, path and
status only, and `state` shows each version's size and CRC32C, not its data.

Control under /_fake/ (JSON; FakeSecretsControl is its client):
  POST grant {project, member, role}       a project-level role (e.g. roles/secretmanager.admin)
  POST inject {kind: service_disabled, times?}   403 SERVICE_DISABLED with the activation URL
  POST deny {permission, project?}         an IAM deny policy: that permission is refused to every caller, the
                                           owner too (deny policies override any grant), until reset
  GET  health                              {ok, pid}
  GET  state                               secrets (labels, versions without data, policy), grants, calls
  POST reset

Run: python -m infra.fake_secret_manager --port 0 --ready-file F    or, in tests: start_in_thread().
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, unquote, urlsplit

import google_crc32c

from infra import serving
from infra.serving import Control, Running
from infra.gcp_ids import project_number

T_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
MAX_PAYLOAD = 64 * 1024
_SECRET_ID = re.compile(r"[A-Za-z0-9_-]{1,255}")
_MEMBER = re.compile(r"(user|serviceAccount|group|domain|principal|principalSet):.+|allUsers|allAuthenticatedUsers")
ALL = frozenset({"secretmanager.secrets.create", "secretmanager.secrets.list", "secretmanager.secrets.get",
                 "secretmanager.secrets.delete", "secretmanager.secrets.getIamPolicy",
                 "secretmanager.secrets.setIamPolicy", "secretmanager.versions.add",
                 "secretmanager.versions.access"})
ROLES = {
    "roles/owner": ALL, "roles/secretmanager.admin": ALL,
    "roles/editor": ALL - {"secretmanager.secrets.setIamPolicy"},
    "roles/viewer": frozenset({"secretmanager.secrets.get", "secretmanager.secrets.list",
                               "secretmanager.secrets.getIamPolicy"}),
    "roles/secretmanager.viewer": frozenset({"secretmanager.secrets.get", "secretmanager.secrets.list",
                                             "secretmanager.secrets.getIamPolicy"}),
    "roles/secretmanager.secretAccessor": frozenset({"secretmanager.versions.access"}),
    "roles/secretmanager.secretVersionAdder": frozenset({"secretmanager.versions.add"}),
    "roles/secretmanager.secretVersionManager": frozenset({"secretmanager.versions.add"}),
}
OWNER = "projectOwner"  # the caller with no credentials


class SecretsError(Exception):
    def __init__(self, code: int, status: str, message: str, details: list | None = None):
        super().__init__(message)
        self.code, self.status, self.message, self.details = code, status, message, details or []

    def body(self) -> dict:
        err = {"code": self.code, "message": self.message, "status": self.status}
        if self.details:
            err["details"] = self.details
        return {"error": err}


def _ts(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def _etag(*parts) -> str:
    return '"' + hashlib.sha256(repr(parts).encode()).hexdigest()[:14] + '"'


@dataclass
class _Version:
    number: int
    data: bytes
    crc: int
    created: float
    client_checksum: bool


@dataclass
class _Secret:
    number: int
    id: str
    body: dict
    created: float
    versions: list[_Version] = field(default_factory=list)
    bindings: list[dict] = field(default_factory=list)
    policy_serial: int = 0

    @property
    def name(self) -> str:
        return f"projects/{self.number}/secrets/{self.id}"


@dataclass
class SecretsState:
    secrets: dict[tuple[int, str], _Secret] = field(default_factory=dict)
    grants: dict[tuple[int, str], set[str]] = field(default_factory=dict)  # (project, member) -> roles
    injections: list[dict] = field(default_factory=list)
    denies: list[dict] = field(default_factory=list)  # {permission, project: number or None}
    calls: list[dict] = field(default_factory=list)  # method, path, caller, status: never a payload
    lock: threading.RLock = field(default_factory=threading.RLock)

    # ---- who may ------------------------------------------------------------------------------------------
    def may(self, caller: str, perm: str, number: int, secret: _Secret | None) -> bool:
        if any(d["permission"] == perm and d.get("project") in (None, number) for d in self.denies):
            return False
        if caller == OWNER:
            return True
        roles = set(self.grants.get((number, caller), ()))
        if secret is not None:
            roles |= {b["role"] for b in secret.bindings if caller in b.get("members", ())}
        return any(perm in ROLES.get(r, ()) for r in roles)

    def check(self, caller: str, perm: str, number: int, secret: _Secret | None, resource: str) -> None:
        if not self.may(caller, perm, number, secret):
            raise SecretsError(403, "PERMISSION_DENIED", f"Permission '{perm}' denied on resource (or it may not "
                                                         "exist).", [
                {"@type": T_ERROR_INFO, "reason": "IAM_PERMISSION_DENIED", "domain": "iam.googleapis.com",
                 "metadata": {"permission": perm, "resource": resource}}])

    def check_service(self, project: str) -> None:
        for inj in self.injections:
            if inj["kind"] == "service_disabled" and inj.get("project") in (None, project):
                if inj.get("times") is not None:
                    inj["times"] -= 1
                    if inj["times"] <= 0:
                        self.injections.remove(inj)
                num = _number(project)
                url = ("https://console.developers.google.com/apis/api/secretmanager.googleapis.com/overview"
                       f"?project={num}")
                raise SecretsError(403, "PERMISSION_DENIED", (
                    f"Secret Manager API has not been used in project {num} before or it is disabled. Enable it by "
                    f"visiting {url} then retry. If you enabled this API recently, wait a few minutes for the action "
                    "to propagate to our systems and retry."), [
                    {"@type": T_ERROR_INFO, "reason": "SERVICE_DISABLED", "domain": "googleapis.com",
                     "metadata": {"service": "secretmanager.googleapis.com", "consumer": f"projects/{num}",
                                  "activationUrl": url, "serviceTitle": "Secret Manager API",
                                  "containerInfo": str(num)}}])

    # ---- the API ------------------------------------------------------------------------------------------
    def _find(self, project: str, sid: str) -> _Secret | None:
        return self.secrets.get((_number(project), sid))

    def _need(self, caller: str, perm: str, project: str, sid: str) -> _Secret:
        s = self._find(project, sid)
        self.check(caller, perm, _number(project), s, f"projects/{project}/secrets/{sid}")
        if s is None:
            raise SecretsError(404, "NOT_FOUND", f"Secret [projects/{_number(project)}/secrets/{sid}] not found.")
        return s

    def create(self, caller: str, project: str, sid: str, body: dict) -> dict:
        number = _number(project)
        self.check(caller, "secretmanager.secrets.create", number, None, f"projects/{project}")
        if not _SECRET_ID.fullmatch(sid or ""):
            raise SecretsError(400, "INVALID_ARGUMENT", f"Secret id [{sid}] must match [a-zA-Z_0-9-]{{1,255}}.")
        rep = body.get("replication") or {}
        if not (rep.get("automatic") is not None or rep.get("userManaged")):
            raise SecretsError(400, "INVALID_ARGUMENT", "Secret.replication must be set: automatic or userManaged.")
        if (number, sid) in self.secrets:
            raise SecretsError(409, "ALREADY_EXISTS", f"Secret [projects/{number}/secrets/{sid}] already exists.")
        s = _Secret(number, sid, {k: v for k, v in body.items() if k in ("replication", "labels", "annotations")},
                    time.time())
        self.secrets[(number, sid)] = s
        return self.secret_json(s)

    def get(self, caller: str, project: str, sid: str) -> dict:
        return self.secret_json(self._need(caller, "secretmanager.secrets.get", project, sid))

    def list(self, caller: str, project: str, q: dict) -> dict:
        number = _number(project)
        self.check(caller, "secretmanager.secrets.list", number, None, f"projects/{project}")
        mine = [self.secret_json(s) for (n, _), s in sorted(self.secrets.items()) if n == number]
        size = int((q.get("pageSize") or ["25000"])[0] or 25000)
        start = int((q.get("pageToken") or ["0"])[0] or 0)
        out = {"secrets": mine[start:start + size], "totalSize": len(mine)}
        if start + size < len(mine):
            out["nextPageToken"] = str(start + size)
        return out

    def delete(self, caller: str, project: str, sid: str) -> dict:
        s = self._need(caller, "secretmanager.secrets.delete", project, sid)
        del self.secrets[(s.number, s.id)]
        return {}

    def add_version(self, caller: str, project: str, sid: str, body: dict) -> dict:
        s = self._need(caller, "secretmanager.versions.add", project, sid)
        payload = body.get("payload") or {}
        data = base64.b64decode(payload.get("data") or "")
        if len(data) > MAX_PAYLOAD:
            raise SecretsError(400, "INVALID_ARGUMENT", f"Secret payload is {len(data)} bytes; at most {MAX_PAYLOAD}.")
        crc = google_crc32c.value(data)
        given = payload.get("dataCrc32c")
        if given is not None and int(given) != crc:
            raise SecretsError(400, "INVALID_ARGUMENT", "The payload's data_crc32c does not match its data.")
        v = _Version(len(s.versions) + 1, data, crc, time.time(), given is not None)
        s.versions.append(v)
        return self.version_json(s, v)

    def access(self, caller: str, project: str, sid: str, version: str) -> dict:
        s = self._find(project, sid)
        self.check(caller, "secretmanager.versions.access", _number(project), s,
                   f"projects/{project}/secrets/{sid}/versions/{version}")
        if s is None or not s.versions:
            raise SecretsError(404, "NOT_FOUND",
                               f"Secret [projects/{_number(project)}/secrets/{sid}] not found or has no versions.")
        if version == "latest":
            v = s.versions[-1]
        else:
            v = next((x for x in s.versions if str(x.number) == version), None)
            if v is None:
                raise SecretsError(404, "NOT_FOUND", f"Secret Version [{s.name}/versions/{version}] not found.")
        return {"name": f"{s.name}/versions/{v.number}",
                "payload": {"data": base64.b64encode(v.data).decode(), "dataCrc32c": str(v.crc)}}

    def get_policy(self, caller: str, project: str, sid: str) -> dict:
        return self.policy_json(self._need(caller, "secretmanager.secrets.getIamPolicy", project, sid))

    def set_policy(self, caller: str, project: str, sid: str, body: dict) -> dict:
        s = self._need(caller, "secretmanager.secrets.setIamPolicy", project, sid)
        policy = body.get("policy") or {}
        if policy.get("etag") and policy["etag"] != self.policy_json(s)["etag"]:
            raise SecretsError(409, "ABORTED", "There were concurrent policy changes. Please retry the whole "
                                               "read-modify-write with exponential backoff.")
        bindings = []
        for b in policy.get("bindings") or []:
            if b.get("role") not in ROLES:
                raise SecretsError(400, "INVALID_ARGUMENT", f"Role {b.get('role')} is not supported for this "
                                                            "resource.")
            bad = [m for m in b.get("members") or [] if not _MEMBER.fullmatch(m)]
            if bad:
                raise SecretsError(400, "INVALID_ARGUMENT", f"Invalid member {bad[0]!r}: a member is TYPE:ID, "
                                                            "e.g. serviceAccount:NAME@PROJECT.iam.gserviceaccount.com.")
            if b.get("members"):
                bindings.append({"role": b["role"], "members": sorted(set(b["members"]))})
        s.bindings, s.policy_serial = bindings, s.policy_serial + 1
        return self.policy_json(s)

    # ---- JSON ---------------------------------------------------------------------------------------------
    def secret_json(self, s: _Secret) -> dict:
        return {"name": s.name, "createTime": _ts(s.created), "etag": _etag(s.name, s.created), **s.body}

    def version_json(self, s: _Secret, v: _Version) -> dict:
        out = {"name": f"{s.name}/versions/{v.number}", "createTime": _ts(v.created), "state": "ENABLED",
               "etag": _etag(s.name, v.number), "replicationStatus": {"automatic": {}}}
        if v.client_checksum:
            out["clientSpecifiedPayloadChecksum"] = True
        return out

    def policy_json(self, s: _Secret) -> dict:
        etag = base64.b64encode(hashlib.sha256(f"{s.name}/{s.policy_serial}".encode()).digest()[:8]).decode()
        out = {"version": 1, "etag": etag}
        if s.bindings:
            out["bindings"] = s.bindings
        return out

    def snapshot(self) -> dict:
        return {"secrets": [{"name": s.name, "labels": s.body.get("labels") or {}, "bindings": s.bindings,
                             "versions": [{"number": v.number, "bytes": len(v.data), "crc32c": v.crc}
                                          for v in s.versions]} for s in self.secrets.values()],
                "grants": [{"project": n, "member": m, "roles": sorted(r)} for (n, m), r in self.grants.items()],
                "injections": self.injections, "calls": self.calls}

    def reset(self) -> None:
        self.secrets.clear(), self.grants.clear(), self.injections.clear(), self.calls.clear()
        self.denies.clear()


def _number(project: str) -> int:
    """Requests may name a project by id or number; answers name it by number, as the real API's do."""
    return int(project) if project.isdigit() else project_number(project)


def _caller(auth: str | None) -> str:
    if not auth:
        return OWNER
    token = auth.removeprefix("Bearer ").strip()
    if not _MEMBER.fullmatch(token):
        raise SecretsError(401, "UNAUTHENTICATED", "Request had invalid authentication credentials. Expected OAuth "
                                                   "2 access token, login cookie or other valid authentication "
                                                   "credential.")
    return token


_S = r"/v1/projects/(?P<p>[^/]+)/secrets"
_ROUTES = [
    ("POST", re.compile(_S), "create"),
    ("GET", re.compile(_S), "list"),
    ("GET", re.compile(_S + r"/(?P<s>[^/:]+)"), "get"),
    ("DELETE", re.compile(_S + r"/(?P<s>[^/:]+)"), "delete"),
    ("POST", re.compile(_S + r"/(?P<s>[^/:]+):addVersion"), "add_version"),
    ("GET", re.compile(_S + r"/(?P<s>[^/:]+)/versions/(?P<v>[^/:]+):access"), "access"),
    ("GET", re.compile(_S + r"/(?P<s>[^/:]+):getIamPolicy"), "get_policy"),
    ("POST", re.compile(_S + r"/(?P<s>[^/:]+):setIamPolicy"), "set_policy"),
]


def _handler(state: SecretsState, log: Callable[[str], None] | None):
    class H(serving.JsonHandler):
        # The one log is `log` in _do: method, path, caller, status; never a body.

        def _do(self, method: str) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            caller = "?"
            try:
                body = json.loads(raw or b"{}")
                with state.lock:
                    if path.startswith("/_fake/"):
                        code, out = 200, self._control(method, path[len("/_fake/"):], body)
                    else:
                        caller = _caller(self.headers.get("Authorization"))
                        code, out = 200, self._api(method, path, body, parse_qs(url.query), caller)
            except SecretsError as e:
                code, out = e.code, e.body()
            except (ValueError, KeyError, TypeError) as e:
                code, out = 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": str(e)}}
            if not path.startswith("/_fake/"):
                with state.lock:
                    state.calls.append({"method": method, "path": path, "caller": caller, "status": code})
                if log:
                    log(f"{method} {path} caller={caller} -> {code}")
            self._send(code, out)

        def _api(self, method: str, path: str, body: dict, q: dict, caller: str) -> dict:
            for verb, rx, name in _ROUTES:
                if verb == method and (m := rx.fullmatch(path)):
                    p = m["p"]
                    state.check_service(p)
                    if name == "create":
                        return state.create(caller, p, (q.get("secretId") or [""])[0], body)
                    if name == "list":
                        return state.list(caller, p, q)
                    if name == "access":
                        return state.access(caller, p, m["s"], m["v"])
                    if name in ("add_version", "set_policy"):
                        return getattr(state, name)(caller, p, m["s"], body)
                    return getattr(state, name)(caller, p, m["s"])
            raise SecretsError(404, "NOT_FOUND", f"no such method: {method} {path}")

        def _control(self, method: str, what: str, body: dict) -> dict:
            if what == "grant" and method == "POST":
                if body["role"] not in ROLES:
                    raise ValueError(f"unknown role {body['role']!r}; one of {', '.join(sorted(ROLES))}")
                state.grants.setdefault((_number(body["project"]), body["member"]), set()).add(body["role"])
                return {"ok": True}
            if what == "inject" and method == "POST":
                if body.get("kind") != "service_disabled":
                    raise ValueError(f"unknown injection kind {body.get('kind')!r}; one of service_disabled")
                state.injections.append(dict(body))
                return {"ok": True}
            if what == "deny" and method == "POST":
                if body.get("permission") not in ALL:
                    raise ValueError(f"unknown permission {body.get('permission')!r}; one of {', '.join(sorted(ALL))}")
                state.denies.append({"permission": body["permission"],
                                     "project": _number(body["project"]) if body.get("project") else None})
                return {"ok": True}
            if what == "state":
                return state.snapshot()
            if what == "health":
                return {"ok": True, "pid": os.getpid()}
            if what == "reset" and method == "POST":
                state.reset()
                return {"ok": True}
            raise SecretsError(404, "NOT_FOUND", f"no such control endpoint: {method} /_fake/{what}")

        def do_GET(self):
            self._do("GET")

        def do_POST(self):
            self._do("POST")

        def do_DELETE(self):
            self._do("DELETE")

    return H


class FakeSecretsControl(Control):

    def grant(self, project: str, member: str, role: str) -> dict:
        """A project-level role for `member` (`serviceAccount:EMAIL`, `user:EMAIL`)."""
        return self.call("POST", "grant", {"project": project, "member": member, "role": role})

    def service_disabled(self, *, project: str | None = None, times: int | None = None) -> dict:
        return self.call("POST", "inject", {"kind": "service_disabled", "project": project, "times": times})

    def deny(self, permission: str, *, project: str | None = None) -> dict:
        """An IAM deny policy on `permission` (in `project`, else everywhere): every caller is refused it."""
        return self.call("POST", "deny", {"permission": permission, "project": project})

    def state(self) -> dict:
        return self.call("GET", "state")

    def reset(self) -> dict:
        return self.call("POST", "reset", {})




def make_server(host: str = "127.0.0.1", port: int = 0,
                log: Callable[[str], None] | None = None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _handler(SecretsState(), log))
    server.daemon_threads = True
    return server


def start_in_thread(host: str = "127.0.0.1", port: int = 0,
                    log: Callable[[str], None] | None = None) -> Running:
    """Serve in a daemon thread of this process; call .stop() when done. `log` gets one line per API request."""
    return serving.in_thread(make_server(host, port, log), "fake-secret-manager", FakeSecretsControl)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.fake_secret_manager", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (see --ready-file)")
    ap.add_argument("--ready-file", help="write {pid, host, port, url} as JSON here once listening")
    ap.add_argument("--verbose", action="store_true", help="log each request's method, path and status to stderr")
    a = ap.parse_args(argv)
    try:
        server = make_server(a.host, a.port, (lambda line: print(line, file=sys.stderr, flush=True))
                             if a.verbose else None)
    except OSError as e:
        print(f"error: cannot listen on {a.host}:{a.port}: {e.strerror}; pick another --port", file=sys.stderr)
        return 2
    return serving.serve(server, a.host, a.ready_file, "Secret Manager stand-in")


if __name__ == "__main__":
    sys.exit(main())
