"""A managed job's secrets (`--secret-env K`: W&B, Kaggle keys) in Secret Manager, readable by the controller's
service account and nobody new. The job's spec names each secret's resource, never its value; the controller
reads the values when it launches the job and hands them to the hosts as `tpuctl run` does (stdin into a 0600 file).
"""
from __future__ import annotations

import re

from orchestrator.spec import UserError

ACCESSOR = "roles/secretmanager.secretAccessor"


def _client(endpoint: str | None, credentials=None):
    from google.cloud import secretmanager_v1
    from orchestrator.provider.cloud import rest_client_kwargs
    kw = rest_client_kwargs(endpoint)
    if credentials is not None:  # a stand-in names its caller from these (local mode's controller account)
        kw["credentials"] = credentials
    return secretmanager_v1.SecretManagerServiceClient(**kw)


def secret_id(job_id: str, env_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"tpuctl-{job_id}-{env_name}")[:255]


def _why(e: Exception) -> str:
    """The API's own words: the REST transport puts the request (METHOD URL:) before them."""
    why = " ".join(str(getattr(e, "message", None) or e).split())
    return re.sub(r"^(GET|POST|PUT|PATCH|DELETE) \S+: ", "", why)


def store(project: str, job_id: str, values: dict[str, str], reader: str, *, endpoint: str | None = None,
          credentials=None) -> dict[str, str]:
    """One secret per value, with `reader` (serviceAccount:EMAIL) as its only added accessor. Returns
    {ENV_NAME: secret resource name}."""
    if not values:
        return {}
    from google.api_core import exceptions as gx
    from google.iam.v1 import policy_pb2
    c = _client(endpoint, credentials)
    out = {}
    try:
        for env_name, value in sorted(values.items()):
            sid = secret_id(job_id, env_name)
            s = c.create_secret(request={"parent": f"projects/{project}", "secret_id": sid,
                                         "secret": {"replication": {"automatic": {}},
                                                    "labels": {"tpuctl-job": job_id.lower()}}})
            c.add_secret_version(request={"parent": s.name, "payload": {"data": value.encode()}})
            pol = c.get_iam_policy(request={"resource": s.name})
            pol.bindings.append(policy_pb2.Binding(role=ACCESSOR, members=[reader]))
            c.set_iam_policy(request={"resource": s.name, "policy": pol})
            out[env_name] = s.name
    except gx.GoogleAPICallError as e:
        drop(out, endpoint=endpoint, credentials=credentials)
        # The reason is the error's ErrorInfo (google.api_core puts it in .reason), not its message.
        if isinstance(e, gx.Forbidden) and "SERVICE_DISABLED" in (getattr(e, "reason", None) or "", _why(e)):
            raise UserError(f"Secret Manager is not enabled in project {project}: `gcloud services enable "
                            f"secretmanager.googleapis.com --project {project}` ({_why(e)})") from None
        if isinstance(e, gx.Forbidden):
            raise UserError(f"cannot store the job's secrets in Secret Manager ({_why(e)}): ask for "
                            "roles/secretmanager.admin on the project") from None
        raise UserError(f"cannot store the job's secrets in Secret Manager: {_why(e)}") from None
    return out


def read(names: dict[str, str], *, endpoint: str | None = None, credentials=None) -> dict[str, str]:
    """{ENV_NAME: value} for {ENV_NAME: secret resource name}."""
    from google.api_core import exceptions as gx
    c = _client(endpoint, credentials)
    out = {}
    for env_name, name in names.items():
        try:
            out[env_name] = c.access_secret_version(request={"name": f"{name}/versions/latest"}).payload.data.decode()
        except gx.GoogleAPICallError as e:
            raise UserError(f"cannot read the job's secret {env_name} ({name}): {_why(e)}; the controller's "
                            f"service account needs {ACCESSOR} on it") from None
    return out


def drop(names: dict[str, str], *, endpoint: str | None = None, credentials=None) -> None:
    """Delete a finished job's secrets (what is already gone is fine)."""
    from google.api_core import exceptions as gx
    c = _client(endpoint, credentials)
    for name in names.values():
        try:
            c.delete_secret(request={"name": name})
        except gx.NotFound:
            pass
