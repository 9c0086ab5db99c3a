"""Cloud Resource Manager v1's projects and their IAM policies, served by infra/fake_login_apis.py beside Compute
Engine and OS Login: what `tpuctl run --detach` reads to tell whether the controller's service account can write
the job bucket, with the bucket's own policy (infra/fake_bucket_iam.py, which weighs this one too).

Modelled on the v1 API as Google's generated clients call it (googleapis/google-api-ruby-client
generated/google/apis/cloudresourcemanager_v1/service.rb: get_project, get_project_iam_policy,
set_project_iam_policy; and the Policy / Binding / GetIamPolicyRequest / SetIamPolicyRequest types beside it):

  GET  /v1/projects/P                 Project {projectNumber (a decimal string), projectId, name,
                                      lifecycleState: ACTIVE, createTime}
  POST /v1/projects/P:getIamPolicy    body GetIamPolicyRequest {options?: {requestedPolicyVersion}}; answers
                                      Policy {version, etag, bindings: [{role, members, condition?}]}
  POST /v1/projects/P:setIamPolicy    body SetIamPolicyRequest {policy, updateMask?}: replaces the policy and
                                      answers it with a new etag. A policy whose etag is not the current one is
                                      409 ABORTED (read-modify-write lost a race); `allUsers` or
                                      `allAuthenticatedUsers` as a member is 400 INVALID_ARGUMENT (a project does
                                      not support them, as the API documents).

A project nobody set a policy for has the one a new project has: its creator (user:owner@example.com) as
roles/owner, and its Compute Engine default service account (infra.gcp_ids, what `default` resolves to) as
roles/editor, which Compute Engine grants that account when the API is enabled. Project numbers are
infra.gcp_ids.project_number's, as every stand-in reports them.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import time

from infra.gcp_ids import default_service_account, project_number

PUBLIC = ("allUsers", "allAuthenticatedUsers")
OWNER = "user:owner@example.com"


class IamError(Exception):
    def __init__(self, code: int, status: str, message: str):
        super().__init__(message)
        self.code, self.status, self.message = code, status, message

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "status": self.status}}


def _etag(policy: dict) -> str:
    raw = json.dumps(policy.get("bindings") or [], sort_keys=True).encode()
    return base64.b64encode(hashlib.sha256(raw + str(time.time_ns()).encode()).digest()[:8]).decode()


class ProjectPolicies:
    """Every project's IAM policy (callers hold the server's lock)."""

    def __init__(self):
        self.policies: dict[str, dict] = {}

    def project(self, project: str) -> dict:
        return {"projectNumber": str(project_number(project)), "projectId": project, "name": project,
                "lifecycleState": "ACTIVE", "createTime": "2024-01-01T00:00:00Z"}

    def get(self, project: str, body: dict | None = None) -> dict:
        if project not in self.policies:
            p = {"version": 1, "bindings": [{"role": "roles/editor",
                                             "members": [f"serviceAccount:{default_service_account(project)}"]},
                                            {"role": "roles/owner", "members": [OWNER]}]}
            p["etag"] = _etag(p)
            self.policies[project] = p
        return copy.deepcopy(self.policies[project])

    def set(self, project: str, body: dict) -> dict:
        policy = body.get("policy")
        if not isinstance(policy, dict):
            raise IamError(400, "INVALID_ARGUMENT", "Request contains an invalid argument: policy is required.")
        current = self.get(project)
        if policy.get("etag") and policy["etag"] != current["etag"]:
            raise IamError(409, "ABORTED", "There were concurrent policy changes. Please retry the whole "
                                           "read-modify-write with exponential backoff.")
        bindings = []
        for b in policy.get("bindings") or []:
            if not str(b.get("role", "")).startswith(("roles/", "projects/", "organizations/")):
                raise IamError(400, "INVALID_ARGUMENT", f"Role {b.get('role')!r} is not supported for this resource.")
            for m in b.get("members") or []:
                if m in PUBLIC:
                    raise IamError(400, "INVALID_ARGUMENT", f"Policy members of type {m} are not supported on a "
                                                            "project.")
            if b.get("members"):
                bindings.append({k: copy.deepcopy(b[k]) for k in ("role", "members", "condition") if k in b})
        new = {"version": 3 if any("condition" in b for b in bindings) else int(policy.get("version") or 1),
               "bindings": bindings}
        new["etag"] = _etag(new)
        self.policies[project] = new
        return copy.deepcopy(new)

    def reset(self) -> None:
        self.policies.clear()
