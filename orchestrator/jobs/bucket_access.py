"""Can a managed job's controller write the job bucket? Asked at submit, before anything is made: the controller
runs as its own service account, and a bucket only the submitter can write would fail the job on its VM, after a
controller, a secret and a job record exist.

It asks the bucket's testIamPermissions as the controller's account (check); where it cannot act as that account,
it reads the bucket's IAM policy (google-cloud-storage) and the project's (Cloud Resource Manager v1
projects.getIamPolicy, REST) and refuses only when neither grants the account, or everyone (allUsers,
allAuthenticatedUsers), roles that together hold storage.objects.create, get and delete. A policy this caller
cannot read, or a grant to members that cannot be expanded here (a group, a domain, another project's
convenience value, a conditional binding, a custom role), leaves it unchecked: one warning, not a refusal.
Grants on a folder or the organisation are not read: a refusal names the role to grant, which fixes it either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from orchestrator.spec import UserError

ROLE = "roles/storage.objectAdmin"
NEEDED = frozenset({"create", "get", "delete"})  # storage.objects.*: write a record, read it back, replace it
_ALL = NEEDED
# What each role holds of NEEDED (predefined roles that grant none of it are left out: they add nothing).
ROLE_GRANTS: dict[str, frozenset[str]] = {
    "roles/owner": _ALL, "roles/editor": _ALL, "roles/storage.admin": _ALL, "roles/storage.objectAdmin": _ALL,
    "roles/storage.objectUser": _ALL, "roles/storage.objectCreator": frozenset({"create"}),
    "roles/storage.objectViewer": frozenset({"get"}), "roles/viewer": frozenset({"get"}),
    "roles/storage.legacyBucketOwner": frozenset({"create", "delete"}),
    "roles/storage.legacyBucketWriter": frozenset({"create", "delete"}),
    "roles/storage.legacyObjectOwner": frozenset({"get"}), "roles/storage.legacyObjectReader": frozenset({"get"}),
    "roles/storage.legacyBucketReader": frozenset(), "roles/storage.bucketViewer": frozenset(),
}
# Convenience members of a bucket's policy: every holder of that basic role in the project.
_CONVENIENCE = {"projectOwner": "roles/owner", "projectEditor": "roles/editor", "projectViewer": "roles/viewer"}


@dataclass
class Verdict:
    granted: set[str] = field(default_factory=set)       # of NEEDED, what the policies surely give the account
    unsure: list[str] = field(default_factory=list)      # "ROLE to MEMBER": grants that may reach it
    unread: list[str] = field(default_factory=list)      # policies that could not be read, and why

    @property
    def ok(self) -> bool:
        return NEEDED <= self.granted


def _role_grants(role: str) -> frozenset[str] | None:
    """What ROLE holds of NEEDED; None when it cannot be told here (a custom role, an unknown storage role)."""
    if role in ROLE_GRANTS:
        return ROLE_GRANTS[role]
    if role.startswith(("projects/", "organizations/")) or "storage" in role.lower():
        return None
    return frozenset()


def judge(member: str, policies: list[dict], project_ids: tuple[str, ...] = (), project_policy: dict | None = None,
          verdict: Verdict | None = None) -> Verdict:
    """What `policies` (IAM Policy JSON: {bindings: [{role, members, condition?}]}) grant `member`
    (serviceAccount:EMAIL) of NEEDED. project_ids (id, number) and project_policy expand a bucket's convenience
    members (projectEditor:P) when P is that project."""
    v = verdict or Verdict()
    basic = {}
    for b in (project_policy or {}).get("bindings") or []:
        basic.setdefault(b.get("role"), set()).update(b.get("members") or [])
    for policy in policies:
        for b in policy.get("bindings") or []:
            role = b.get("role", "")
            grants = _role_grants(role)
            if grants is not None and not grants:
                continue
            for m in b.get("members") or []:
                kind, _, rest = m.partition(":")
                if m == member or m in ("allUsers", "allAuthenticatedUsers"):
                    reaches = True
                elif kind in _CONVENIENCE and rest in project_ids and project_policy is not None:
                    reaches = member in basic.get(_CONVENIENCE[kind], ())
                elif kind in ("group", "domain", "principalSet", "principal", *_CONVENIENCE):
                    reaches = None  # cannot be expanded here
                else:
                    reaches = False  # another user or service account
                if reaches and grants is not None and not b.get("condition"):
                    v.granted |= grants
                elif reaches is not False:
                    v.unsure.append(f"{role} to {m}" + (" (conditional)" if b.get("condition") else ""))
    return v


# ---- reading the policies --------------------------------------------------------------------------------
def _crm(endpoint: str | None):
    """An authorized session on Cloud Resource Manager (the endpoint and credentials as every Google REST client
    here gets them: provider.cloud.rest_client_kwargs) and its base URL."""
    from google.auth.transport.requests import AuthorizedSession
    from orchestrator.provider.cloud import rest_client_kwargs
    creds = rest_client_kwargs(endpoint).get("credentials")
    if creds is None:
        import google.auth
        creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    return AuthorizedSession(creds), (endpoint or "https://cloudresourcemanager.googleapis.com").rstrip("/")


def _call(session, method: str, url: str, body: dict | None = None) -> dict:
    r = session.request(method, url, json=body, timeout=30)
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:200]
        raise PermissionError(f"HTTP {r.status_code}: {msg}")
    return r.json()


def _project_number(session, base: str, project: str) -> str:
    return _call(session, "GET", f"{base}/v1/projects/{project}")["projectNumber"]


def service_account_email(account: str, number: Callable[[], str]) -> str:
    """The account's email: `default` is the project's Compute Engine default service account."""
    return account if account != "default" else f"{number()}-compute@developer.gserviceaccount.com"


PERMISSIONS = tuple(f"storage.objects.{p}" for p in sorted(NEEDED))


def _bucket(name: str, project: str, endpoint: str | None, credentials=None):
    """gs://name as google-cloud-storage sees it on the API that holds its IAM (None: Cloud Storage's own)."""
    from google.cloud import storage
    kw = {"client_options": {"api_endpoint": endpoint}} if endpoint else {}
    return storage.Client(project=project, credentials=credentials, **kw).bucket(name)


def check(bucket: str, project: str, account: str, *, endpoint: str | None, iam_endpoint: str | None = None,
          as_account: Callable[[str], object] | None = None, warn: Callable[[str], None]) -> str | None:
    """Refuse (UserError, one line with the fix) when the controller's account cannot write gs://bucket; warn once
    when that cannot be told from here. Returns the account's email (None when it could not be told).

    First the service's own answer: the bucket's testIamPermissions (google-cloud-storage Bucket.test_iam_permissions,
    JSON API GET b/BUCKET/iam/testPermissions), asked as the account itself (as_account), since that call answers
    for its caller only; it weighs every grant (groups, folders, conditions) as the job's writes will be weighed.
    Where acting as the account is refused (no roles/iam.serviceAccountTokenCreator on it), the policies are read
    and judged instead (judge)."""
    fix = f"grant it {ROLE} on gs://{bucket}"
    known: dict[str, str] = {}

    def number() -> str:  # the project's number, read once: the default account's email and convenience members
        if "n" not in known:
            known["n"] = _project_number(*_crm(endpoint), project)
        return known["n"]
    try:
        email = service_account_email(account, number)
    except Exception as e:  # noqa: BLE001 - no answer about the account: the job may still work
        warn(f"could not check that the controller's service account can write gs://{bucket} (its email: "
             f"{_short(e)}): it needs {ROLE} there")
        return None
    member = f"serviceAccount:{email}"

    def refuse(why: str) -> UserError:
        return UserError(f"the controller's service account {email} cannot write gs://{bucket}{why}: {fix} (gcloud "
                         f"storage buckets add-iam-policy-binding gs://{bucket} --member={member} --role={ROLE}), "
                         "or pass --controller-service-account")
    asked = None
    if as_account is not None:
        try:
            held = set(_bucket(bucket, project, iam_endpoint, as_account(email)).test_iam_permissions(
                list(PERMISSIONS), timeout=30))
        except Exception as e:  # noqa: BLE001 - cannot act as it, or no answer: the policies are read instead
            asked = f"testIamPermissions as it: {_short(e)}"
        else:
            if set(PERMISSIONS) <= held:
                return email
            lacks = ", ".join(p for p in PERMISSIONS if p not in held)
            raise refuse(f" (it lacks {lacks})")
    v, project_policy, ids = Verdict(), None, (project,)
    if asked:
        v.unread.append(asked)
    try:
        s, base = _crm(endpoint)
        project_policy = _call(s, "POST", f"{base}/v1/projects/{project}:getIamPolicy",
                               {"options": {"requestedPolicyVersion": 3}})
        judge(member, [project_policy], verdict=v)
        ids = (project, number())
    except Exception as e:  # noqa: BLE001 - unread: judged on what could be read
        v.unread.append(f"project {project}'s policy: {_short(e)}")
    if not v.ok:
        try:
            pol = _bucket(bucket, project, iam_endpoint).get_iam_policy(requested_policy_version=3, timeout=30)
            judge(member, [pol.to_api_repr()], ids, project_policy, verdict=v)
        except Exception as e:  # noqa: BLE001 - unread: judged on what could be read
            v.unread.append(f"gs://{bucket}'s policy: {_short(e)}")
    if v.ok:
        return email
    if v.unread[bool(asked):] or v.unsure:
        why = "; ".join(v.unread + ([f"grants it may hold: {', '.join(v.unsure[:3])}"] if v.unsure else []))
        warn(f"could not check that the controller's service account {email} can write gs://{bucket} "
             f"({why}): if the job fails to write its record, {fix}")
        return email
    raise refuse("")


def _short(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
