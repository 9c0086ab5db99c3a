"""Cloud Storage's bucket IAM (JSON API v1), served by infra/fake_login_apis.py beside Resource Manager's project
policies: what fake-gcs-server (the GCS emulator, infra/gcs.py) does not have. `tpuctl run --detach` asks it
whether the controller's service account may write the job bucket, through the real google-cloud-storage client
pointed at this server (provider.bucket_iam_endpoint); the objects themselves stay in the emulator.

Modelled on the JSON API as google-cloud-storage calls it (google/cloud/storage/bucket.py: Bucket.get_iam_policy,
set_iam_policy, test_iam_permissions; google/cloud/storage/iam.py for the Policy's JSON):

  GET /storage/v1/b/B/iam[?optionsRequestedPolicyVersion=N]   Policy {kind: storage#policy, resourceId:
                                             projects/_/buckets/B, version, etag, bindings: [{role, members,
                                             condition?}]}; needs storage.buckets.getIamPolicy
  PUT /storage/v1/b/B/iam                    body Policy: replaces it (a stale etag is 412 conditionNotMet);
                                             needs storage.buckets.setIamPolicy
  GET /storage/v1/b/B/iam/testPermissions?permissions=P&permissions=Q
                                             {kind: storage#testIamPermissionsResponse, permissions: [the ones
                                             the caller holds]}: needs no permission of its own; a name that is
                                             not a storage permission is 400

Who calls: `Authorization: Bearer MEMBER` names the caller as an IAM member (`serviceAccount:EMAIL`, `user:...`),
as the Secret Manager stand-in reads it; no credentials (AnonymousCredentials) is the project's owner. What a
caller holds on a bucket is what the bucket's policy and its project's policy (the Resource Manager stand-in's,
same server) grant it, directly or through allUsers / allAuthenticatedUsers, or through the bucket's convenience
members (projectEditor:P: every roles/editor of project P). Conditional bindings are not evaluated (they grant
nothing here).

A bucket belongs to a project: the one the control call `bucket_project` names (set once, as a bucket's project
never changes; local mode's provider names the slice's project for the buckets the emulator made for it), else
none: only the bucket's own policy counts then.
A bucket nobody set a policy for has the one Cloud Storage gives a new bucket: its project's owners and editors
as legacyBucketOwner and legacyObjectOwner, its viewers as legacyBucketReader and legacyObjectReader. Which
buckets exist is the emulator's to say: every name has a policy here.
"""
from __future__ import annotations

import copy

from infra.fake_project_iam import OWNER, IamError, ProjectPolicies, _etag

OBJ = "storage.objects."
BKT = "storage.buckets."
# The storage permissions of the roles a bucket or its project may grant (predefined roles' documented lists,
# storage part only: what a job bucket's writer and its policy's reader need).
_OBJ_ALL = frozenset({OBJ + "create", OBJ + "get", OBJ + "delete", OBJ + "list", OBJ + "update"})
_BKT_READ = frozenset({BKT + "get", BKT + "list"})
_IAM = frozenset({BKT + "getIamPolicy", BKT + "setIamPolicy"})
ROLES: dict[str, frozenset[str]] = {
    "roles/owner": _OBJ_ALL | _BKT_READ | _IAM | {BKT + "create", BKT + "delete", BKT + "update"},
    "roles/editor": _OBJ_ALL | _BKT_READ | {BKT + "create", BKT + "delete", BKT + "update"},
    "roles/viewer": frozenset({OBJ + "get", OBJ + "list"}) | _BKT_READ,
    "roles/storage.admin": _OBJ_ALL | _BKT_READ | _IAM | {BKT + "create", BKT + "delete", BKT + "update"},
    "roles/storage.objectAdmin": _OBJ_ALL,
    "roles/storage.objectUser": _OBJ_ALL,
    "roles/storage.objectCreator": frozenset({OBJ + "create"}),
    "roles/storage.objectViewer": frozenset({OBJ + "get", OBJ + "list"}),
    "roles/storage.legacyBucketOwner": frozenset({BKT + "get", BKT + "update", OBJ + "create", OBJ + "delete",
                                                  OBJ + "list"}) | _IAM,
    "roles/storage.legacyBucketWriter": frozenset({BKT + "get", OBJ + "create", OBJ + "delete", OBJ + "list"}),
    "roles/storage.legacyBucketReader": frozenset({BKT + "get", OBJ + "list"}),
    "roles/storage.legacyObjectOwner": frozenset({OBJ + "get", OBJ + "update"}),
    "roles/storage.legacyObjectReader": frozenset({OBJ + "get"}),
}
_CONVENIENCE = {"projectOwner": "roles/owner", "projectEditor": "roles/editor", "projectViewer": "roles/viewer"}


def caller_of(authorization: str | None) -> str:
    """The IAM member a request comes from: its bearer token, or the project's owner without one."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization.split(None, 1)[1].strip()
    return OWNER


class BucketPolicies:
    """Every bucket's IAM policy and project (callers hold the server's lock)."""

    def __init__(self, projects: ProjectPolicies):
        self.projects = projects
        self.policies: dict[str, dict] = {}
        self.project_of: dict[str, str] = {}

    def _project(self, bucket: str) -> str | None:
        return self.project_of.get(bucket)

    def belongs(self, bucket: str, project: str) -> dict:
        return {"bucket": bucket, "project": self.project_of.setdefault(bucket, project)}

    def _policy(self, bucket: str, project: str | None) -> dict:
        if bucket not in self.policies:
            b = []
            if project:
                owners = [f"projectEditor:{project}", f"projectOwner:{project}"]
                b = [{"role": "roles/storage.legacyBucketOwner", "members": owners},
                     {"role": "roles/storage.legacyBucketReader", "members": [f"projectViewer:{project}"]},
                     {"role": "roles/storage.legacyObjectOwner", "members": list(owners)},
                     {"role": "roles/storage.legacyObjectReader", "members": [f"projectViewer:{project}"]}]
            p = {"version": 1, "bindings": b}
            p["etag"] = _etag(p)
            self.policies[bucket] = p
        return self.policies[bucket]

    def held(self, caller: str, bucket: str, project: str | None) -> set[str]:
        """The storage permissions `caller` holds on `bucket`."""
        if caller == OWNER:
            return set().union(*ROLES.values())
        proj = self.projects.get(project) if project else {"bindings": []}
        basic: dict[str, set[str]] = {}
        for b in proj["bindings"]:
            basic.setdefault(b["role"], set()).update(b.get("members") or [])
        out: set[str] = set()
        for policy, is_bucket in ((proj, False), (self._policy(bucket, project), True)):
            for b in policy["bindings"]:
                if b.get("condition"):
                    continue
                for m in b.get("members") or []:
                    kind, _, rest = m.partition(":")
                    if m == caller or m in ("allUsers", "allAuthenticatedUsers") or (
                            is_bucket and kind in _CONVENIENCE and rest == project
                            and caller in basic.get(_CONVENIENCE[kind], ())):
                        out |= ROLES.get(b["role"], frozenset())
                        break
        return out

    def _need(self, caller: str, bucket: str, project: str | None, perm: str) -> None:
        if perm not in self.held(caller, bucket, project):
            raise IamError(403, "PERMISSION_DENIED", f"{caller.partition(':')[2] or caller} does not have {perm} "
                                                     f"access to the Google Cloud Storage bucket. Permission "
                                                     f"'{perm}' denied on resource (or it may not exist).")

    def get(self, caller: str, bucket: str) -> dict:
        project = self._project(bucket)
        self._need(caller, bucket, project, BKT + "getIamPolicy")
        return {"kind": "storage#policy", "resourceId": f"projects/_/buckets/{bucket}",
                **copy.deepcopy(self._policy(bucket, project))}

    def set(self, caller: str, bucket: str, body: dict) -> dict:
        project = self._project(bucket)
        self._need(caller, bucket, project, BKT + "setIamPolicy")
        current = self._policy(bucket, project)
        if body.get("etag") and body["etag"] != current["etag"]:
            raise IamError(412, "FAILED_PRECONDITION", "conditionNotMet: the policy's etag is not the current one")
        bindings = []
        for b in body.get("bindings") or []:
            if not str(b.get("role", "")).startswith(("roles/", "projects/", "organizations/")):
                raise IamError(400, "INVALID_ARGUMENT", f"Role {b.get('role')!r} is not a valid role.")
            if b.get("members"):
                bindings.append({k: copy.deepcopy(b[k]) for k in ("role", "members", "condition") if k in b})
        new = {"version": int(body.get("version") or 1), "bindings": bindings}
        new["etag"] = _etag(new)
        self.policies[bucket] = new
        return {"kind": "storage#policy", "resourceId": f"projects/_/buckets/{bucket}", **copy.deepcopy(new)}

    def test(self, caller: str, bucket: str, permissions: list[str]) -> dict:
        bad = [p for p in permissions if not p.startswith("storage.")]
        if not permissions or bad:
            raise IamError(400, "INVALID_ARGUMENT", f"Invalid permission(s): {', '.join(bad) or 'none given'}")
        held = self.held(caller, bucket, self._project(bucket))
        return {"kind": "storage#testIamPermissionsResponse", "permissions": [p for p in permissions if p in held]}

    def reset(self) -> None:
        self.policies.clear()
        self.project_of.clear()
