"""OS Login: whether a project (or one node) enforces it, and registering this machine's key for the account.

With OS Login on (`enable-oslogin=TRUE` in the project's common metadata or in the VM's own metadata), a VM ignores
keys in `ssh-keys` metadata: the key must be registered with the OS Login API for the user's Google account
(`users/EMAIL:importSshPublicKey`), and the SSH user is the POSIX name of that account's login profile. The account
also needs `roles/compute.osLogin` (or `roles/compute.osAdminLogin`, with sudo) on the project, which the VM checks
when sshd asks it; without it the login is refused like an unknown key.

Both APIs are reached with the official clients over REST (`google-cloud-compute` ProjectsClient.get for the common
metadata, `google-cloud-os-login` OsLoginServiceClient): the default endpoints with Application Default
Credentials, or the URL in TPUCTL_COMPUTE_API_ENDPOINT / TPUCTL_OSLOGIN_API_ENDPOINT (http:// = a stand-in,
anonymous credentials), as orchestrator/provider/cloud.py does for the TPU API.
"""
from __future__ import annotations

import configparser
import os
import time
from dataclasses import dataclass
from pathlib import Path

from google.api_core import exceptions as gexc

from orchestrator.provider.cloud import rest_client_kwargs as _client_kwargs
from orchestrator.spec import UserError

ENV_COMPUTE = "TPUCTL_COMPUTE_API_ENDPOINT"
ENV_OSLOGIN = "TPUCTL_OSLOGIN_API_ENDPOINT"
ENV_ACCOUNT = "TPUCTL_ACCOUNT"
KEY = "enable-oslogin"
ROLES = "roles/compute.osLogin (or roles/compute.osAdminLogin)"


def enabled(value: str | None) -> bool | None:
    """An `enable-oslogin` metadata value: True/False, None when absent."""
    return None if value is None else value.strip().upper() == "TRUE"


def project_enforces(project: str, endpoint: str | None = None) -> bool:
    """Whether the project's common metadata turns OS Login on for its VMs."""
    from google.cloud import compute_v1
    endpoint = endpoint or os.environ.get(ENV_COMPUTE) or None
    try:
        p = compute_v1.ProjectsClient(**_client_kwargs(endpoint)).get(project=project, timeout=30)
    except gexc.Forbidden as e:
        raise UserError(f"cannot read project {project}'s common metadata (Compute Engine API: {_msg(e)}): "
                        "ask for roles/compute.viewer on the project") from None
    except gexc.GoogleAPICallError as e:
        raise UserError(f"cannot read project {project}'s common metadata (Compute Engine API: {_msg(e)})") from None
    items = {i.key: i.value for i in p.common_instance_metadata.items}
    return bool(enabled(items.get(KEY)))


def node_enforces(metadata: dict[str, str], project_value: bool) -> bool:
    """A VM's own `enable-oslogin` wins over the project's."""
    own = enabled(metadata.get(KEY))
    return project_value if own is None else own


@dataclass(frozen=True)
class Decision:
    """Whether a slice's VMs use OS Login, and what decided it: `node` (the VMs' own enable-oslogin metadata),
    `project` (its common metadata) or `nobody` (a stand-in TPU API with no Compute Engine API to ask: off)."""
    on: bool
    by: str
    value: str = ""  # the deciding enable-oslogin value as written ("" when nobody decided)


def nothing_to_ask(tpu_endpoint: str | None) -> bool:
    """A stand-in TPU API (http://) belongs to no Google project: without a Compute Engine endpoint given there is
    no project metadata to read."""
    return not os.environ.get(ENV_COMPUTE) and (tpu_endpoint or "").startswith("http://")


def decide(project: str, node_metadata: dict[str, str], tpu_endpoint: str | None,
           project_value=None) -> Decision:
    """The VMs' own `enable-oslogin` metadata, else the project's (`project_value()`: default, read it; raises
    UserError when it cannot be read). What `up`, `run`, `ssh` and `tpuctl check NAME` all go by."""
    own = node_metadata.get(KEY)
    if enabled(own) is not None:
        return Decision(bool(enabled(own)), "node", own)
    if nothing_to_ask(tpu_endpoint):
        return Decision(False, "nobody")
    on = project_value() if project_value else project_enforces(project, os.environ.get(ENV_COMPUTE) or None)
    return Decision(on, "project", "TRUE" if on else "FALSE or unset")


def applies(project: str, node_metadata: dict[str, str], tpu_endpoint: str | None,
            say=None) -> bool:
    """Whether a slice's VMs use OS Login (`decide`). A project that cannot be read counts as not enforcing (said
    through `say`)."""
    try:
        return decide(project, node_metadata, tpu_endpoint).on
    except UserError as e:
        if say:
            say(f"note: {e}; assuming OS Login is off (`tpuctl check` tells)")
        return False


def profile_keys(account_email: str, project: str, endpoint: str | None = None) -> tuple[str, list[str]]:
    """(POSIX user name, ["TYPE BASE64", ...]) of the account's login profile: what an OS Login VM lets in."""
    from google.cloud import oslogin_v1
    endpoint = endpoint or os.environ.get(ENV_OSLOGIN) or None
    try:
        prof = oslogin_v1.OsLoginServiceClient(**_client_kwargs(endpoint)).get_login_profile(
            request={"name": f"users/{account_email}", "project_id": project}, timeout=30)
    except gexc.GoogleAPICallError as e:
        raise UserError(f"cannot read the OS Login profile of {account_email} ({_msg(e)})") from None
    accounts = list(prof.posix_accounts)
    primary = next((a for a in accounts if a.primary), accounts[0] if accounts else None)
    keys = [" ".join(k.key.split()[:2]) for k in prof.ssh_public_keys.values()]
    return (primary.username if primary else ""), keys


def refused(user: str, project: str) -> str:
    """What an SSH refusal means on an OS Login VM (the VM asks OS Login whether the account may log in)."""
    return (f"the VMs use OS Login and refused {user}: your account needs {ROLES} on project {project} "
            "(an administrator grants it with `gcloud projects add-iam-policy-binding`)")


def account(explicit: str | None = None) -> str:
    """The Google account whose login profile is used: --account / TPUCTL_ACCOUNT, gcloud's core/account, or
    the service account of Application Default Credentials."""
    who = explicit or os.environ.get(ENV_ACCOUNT)
    if not who:
        cfg = Path(os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud")
        try:
            active = (cfg / "active_config").read_text().strip() or "default"
        except OSError:
            active = "default"
        parser = configparser.ConfigParser()
        try:
            parser.read(cfg / "configurations" / f"config_{active}")
            who = parser.get("core", "account", fallback=None)
        except configparser.Error:
            who = None
    if not who:
        try:
            import google.auth
            creds, _ = google.auth.default()
            who = getattr(creds, "service_account_email", None)
        except Exception:  # noqa: BLE001 - no credentials: said below
            who = None
    if not who or "@" not in who:
        raise UserError("OS Login needs your Google account's email: set TPUCTL_ACCOUNT=you@example.com, or run "
                        "`gcloud config set account you@example.com`")
    return who


def register(public_key: str, *, project: str, account_email: str, ttl_s: float | None = None,
             endpoint: str | None = None) -> str:
    """Import the key for the account (expiring after ttl_s, when given); the POSIX user name to SSH as."""
    from google.cloud import oslogin_v1
    from google.cloud.oslogin_v1 import common
    endpoint = endpoint or os.environ.get(ENV_OSLOGIN) or None
    key = common.SshPublicKey(key=public_key)
    if ttl_s:
        key.expiration_time_usec = int((time.time() + ttl_s) * 1e6)
    try:
        resp = oslogin_v1.OsLoginServiceClient(**_client_kwargs(endpoint)).import_ssh_public_key(
            parent=f"users/{account_email}", ssh_public_key=key, project_id=project, timeout=30)
    except gexc.Forbidden as e:
        raise UserError(f"OS Login refused to register your SSH key for {account_email} in project {project} "
                        f"({_msg(e)}): your account needs {ROLES} on {project}") from None
    except gexc.GoogleAPICallError as e:
        raise UserError(f"OS Login could not register your SSH key for {account_email} ({_msg(e)})") from None
    accounts = list(resp.login_profile.posix_accounts)
    primary = next((a for a in accounts if a.primary), accounts[0] if accounts else None)
    if primary is None or not primary.username:
        raise UserError(f"OS Login has no POSIX account for {account_email} in project {project}: your account "
                        f"needs {ROLES} on {project}")
    return primary.username


def _msg(e: Exception) -> str:
    return " ".join(str(getattr(e, "message", None) or e).split())[:200]
