"""`tpuctl check`: a first-time user's checklist, each item checked against the real services.

Credentials, project, the TPU API, the zone and accelerator, an SSH key for new VMs, the checkpoint bucket.
Each item is one line with ✔ or ✘ and, when ✘, the fix. Nothing is created in the cloud; the bucket check
writes one small object and deletes it.
"""
from __future__ import annotations

import socket
import uuid
from dataclasses import asdict, dataclass

from orchestrator import catalog, provider
from orchestrator.provider import cloud
from orchestrator.access import sshkeys
from orchestrator.provider import Provider
from orchestrator.spec import UserError


@dataclass
class Item:
    name: str
    ok: bool | None       # None: not checked (an earlier item failed, or nothing to check it against)
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {True: "✔", False: "✘", None: "-"}[self.ok]
        return f"{mark} {self.name}: {self.detail}" + (f"\n    fix: {self.fix}" if self.fix else "")

    def to_json(self) -> dict:
        return asdict(self)


def credentials(endpoint: str | None) -> Item:
    if endpoint and endpoint.startswith("http://"):
        return Item("credentials", True, f"anonymous (the endpoint {endpoint} is plain http: a stand-in)")
    import google.auth
    from google.auth import exceptions as auth_exc
    try:
        creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    except auth_exc.DefaultCredentialsError as e:
        return Item("credentials", False, f"no Application Default Credentials ({str(e).splitlines()[0][:120]})",
                    "gcloud auth application-default login")
    who = getattr(creds, "service_account_email", None) or getattr(creds, "account", None) or type(creds).__name__
    return Item("credentials", True, f"Application Default Credentials ({who})")


def project_item(project: str | None) -> tuple[Item, str | None]:
    try:
        p = cloud.resolve_project(project)
    except UserError as e:
        return Item("project", False, str(e).split(":")[0], "pass --project P, or `gcloud config set project P`"), None
    return Item("project", True, p), p


def api_and_zone(api, project: str, zone: str | None, accelerator: str | None) -> list[Item]:
    """The TPU API answers for the project, and the zone offers the accelerator (one cheap list call)."""
    if not zone:
        return [Item("TPU API", None, "not checked: pass --zone Z (the first call is made in a zone)"),
                Item("zone", None, "not checked: pass --zone Z")]
    try:
        offered = api.accelerator_types(zone)
    except cloud.CloudError as e:
        text = " ".join(str(e).split())
        if e.kind in ("zone", "location-policy", "not-found", "bad-argument"):  # the API answered: the zone is wrong
            return [Item("TPU API", True, f"answers for {project}"), Item("zone", False, text)]
        fix = f"gcloud services enable tpu.googleapis.com --project {project}" if e.kind == "service-disabled" else ""
        return [Item("TPU API", False, text, fix), Item("zone", None, "not checked: the API refused")]
    items = [Item("TPU API", True, f"answers for {project}")]
    if accelerator:
        try:
            acc = catalog.lookup(accelerator)
        except catalog.UnknownAccelerator as e:
            return items + [Item("zone", False, str(e))]
        if acc.name not in offered:
            hints = ", ".join(acc.zone_hints) or "see the catalog"
            return items + [Item("zone", False, f"{zone} does not offer {acc.name}",
                                 f"pick a zone that does (per the catalog: {hints})")]
        return items + [Item("zone", True, f"{zone} offers {acc.name}")]
    return items + [Item("zone", True, f"{zone} answers ({len(offered)} accelerator types)")]


def os_login(project: str, where: Provider, tpu_endpoint: str | None = None) -> tuple[Item, object]:
    """Whether the project enforces OS Login (its common metadata, read through the Compute Engine API): what
    `up` goes by for a new slice whose metadata does not say. Also returns what was read (True/False, the
    UserError, or None when there was nothing to ask) for `slice_os_login`."""
    from orchestrator.access import oslogin
    if oslogin.nothing_to_ask(where.endpoint(tpu_endpoint)):  # a local slice's TPU API is its stand-in too
        # A stand-in TPU API is no project of Google's: its Compute Engine API is a stand-in too, or none.
        return Item("OS Login", None, f"not checked: the TPU API is a stand-in and no Compute Engine API is given "
                                      f"(set {oslogin.ENV_COMPUTE} to a stand-in)"), None
    try:
        on = oslogin.project_enforces(project)
    except UserError as e:
        return Item("OS Login", False, str(e)), e
    if on:
        return Item("OS Login", True, f"enforced in {project} (enable-oslogin=TRUE): keys in ssh-keys metadata are "
                                      f"ignored; your account needs {oslogin.ROLES} and the SSH user is its POSIX "
                                      "name (a node's own enable-oslogin metadata can still override)"), True
    return Item("OS Login", True, f"not enforced in {project}'s common metadata: `up` puts your key in each VM's "
                                  "ssh-keys metadata"), False


def slice_os_login(rec, project: str, project_read) -> Item:
    """Whether slice `rec`'s VMs use OS Login, decided as `run` and `ssh` decide (oslogin.decide): each node's own
    `enable-oslogin` metadata, read from the TPU API (the record's, what `up` sent, for a node that is gone), else
    the project's (`project_read`, what `os_login` read, when it is rec's project)."""
    from orchestrator import provider as providers
    from orchestrator.access import oslogin
    name = f"OS Login on {rec.name}"
    where = providers.of(rec)
    try:
        tpu = where.endpoint(rec.api_endpoint)
        api = where.api_for(rec)
        infos = [api.get_node(n) for n in rec.nodes]
    except (cloud.CloudError, UserError) as e:
        return Item(name, False, f"cannot read its node(s) from the TPU API ({' '.join(str(e).split())[:200]})")

    def project_value() -> bool:
        if isinstance(project_read, Exception):
            raise project_read
        return bool(project_read)
    cached = project_value if project == rec.project and project_read is not None else None
    try:
        ds = [oslogin.decide(rec.project, info.metadata if info else rec.metadata, tpu, cached) for info in infos]
    except UserError:
        return Item(name, None, f"not known: its VMs have no enable-oslogin metadata of their own and {rec.project}'s "
                                "common metadata cannot be read; `run` assumes OS Login is off")
    if len(set(ds)) > 1:  # one node spec makes every slice's VMs: only a node changed since would differ
        return Item(name, False, "its nodes disagree on enable-oslogin: " + "; ".join(
            f"{n.rsplit('/', 1)[-1]} {'on' if d.on else 'off'} (by the {d.by})" for n, d in zip(rec.nodes, ds)))
    gone = [n.rsplit("/", 1)[-1] for n, info in zip(rec.nodes, infos) if info is None]
    note = f" (node(s) {', '.join(gone)} gone: the record's metadata, what `up` sent)" if gone else ""
    d = ds[0]
    then = ("`run` registers your key with OS Login and logs in as your account's POSIX user" if d.on else
            "`run` logs in with the key in the VMs' ssh-keys metadata")
    if d.by == "node":
        why = f"its VMs' own metadata says enable-oslogin={d.value}, which wins over the project's"
    elif d.by == "project":
        why = (f"its VMs have no enable-oslogin of their own, so {rec.project}'s applies "
               f"({'enforced' if d.on else 'not enforced'})")
    else:
        why = "its VMs have no enable-oslogin of their own and its TPU API is a stand-in with no project to ask"
    return Item(name, True, f"{'on' if d.on else 'off'}: {why}{note}; {then}")


def ssh_key(path: str | None) -> Item:
    try:
        p, pub, created = sshkeys.ensure_key(path)
    except (sshkeys.SshKeyError, OSError) as e:
        return Item("SSH key", False, str(e), "pass --ssh-key PATH to a key pair that has a .pub beside it")
    what = "made" if created else "found"
    return Item("SSH key", True, f"{what} {p} ({pub.split()[0]}); `tpuctl up` puts it in each new VM's metadata")


def bucket(url: str | None, project: str | None, zone: str | None) -> Item:
    if not url:
        return Item("bucket", None, "not checked: pass --bucket gs://B (where checkpoints go)")
    if not url.startswith("gs://") or not url[5:].split("/")[0]:
        return Item("bucket", False, f"{url} is not a gs:// bucket URL", "write --bucket gs://BUCKET[/PREFIX]")
    name, _, prefix = url[5:].partition("/")
    from google.api_core import exceptions as gexc
    from google.cloud import storage
    where = f" --location {zone.rsplit('-', 1)[0]}" if zone else ""
    try:
        client = storage.Client(project=project)
        blob = client.bucket(name).blob(f"{prefix.strip('/') + '/' if prefix.strip('/') else ''}"
                                        f".tpuctl-check-{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
        blob.upload_from_string(b"tpuctl check\n")
        blob.delete()
    except gexc.NotFound:
        return Item("bucket", False, f"gs://{name} does not exist",
                    f"gcloud storage buckets create gs://{name} --project {project}{where}  (same region as the slice)")
    except gexc.Forbidden as e:
        return Item("bucket", False, f"you cannot write gs://{name} ({getattr(e, 'message', e)})",
                    f"ask for roles/storage.objectAdmin on gs://{name}, or use a bucket of your own")
    except Exception as e:  # noqa: BLE001 - network, credentials: one line, the check goes on
        return Item("bucket", False, f"gs://{name}: {' '.join(str(e).split())[:200]}")
    return Item("bucket", True, f"gs://{name} is writable (wrote and deleted one object)")


def run_checks(*, project: str | None = None, zone: str | None = None, accelerator: str | None = None,
               bucket_url: str | None = None, api_endpoint: str | None = None, where: Provider | None = None,
               ssh_key_path: str | None = None, slice_name: str | None = None) -> list[Item]:
    """slice_name: a recorded slice, whose VMs' own OS Login setting is checked too."""
    from orchestrator import state
    rec = state.lookup(slice_name) if slice_name else None
    if slice_name and rec is None:
        raise UserError(f"no slice named {slice_name} in the local record: `tpuctl ls` lists them; leave NAME out "
                        "to check the project alone")
    where = where or provider.chosen(False)
    endpoint = where.endpoint(api_endpoint)
    items = [credentials(endpoint)]
    pitem, p = project_item(project or (rec.project if rec else None) or where.default_project)
    items.append(pitem)
    if items[0].ok and p:
        try:
            api = where.connect(api_endpoint=api_endpoint, project=p)
        except UserError as e:
            items += [Item("TPU API", False, " ".join(str(e).split())), Item("zone", None, "not checked")]
        else:
            items += api_and_zone(api, p, zone, accelerator)
        login, read = os_login(p, where, api_endpoint)
        items.append(login)
        if rec is not None:
            items.append(slice_os_login(rec, p, read))
    else:
        items += [Item("TPU API", None, "not checked: no credentials or project"), Item("zone", None, "not checked")]
    items.append(ssh_key(ssh_key_path))
    items.append(bucket(bucket_url, p, zone))
    return items
