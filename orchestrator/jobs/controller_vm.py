"""The managed-jobs controller's VM: one small on-demand Compute Engine instance per project and region, created
through the Compute Engine API on first use, found gone and recreated by the next tpuctl command that needs it,
and deleted by the controller itself once it has been idle (orchestrator/jobs/controller.py).

It boots with a startup script that installs tpuctl from the bundle the submitter uploaded to the job bucket and
runs the controller as a systemd service (a reboot does not lose it). Where the provider gives an interpreter
that already has tpuctl's dependencies (local mode), the script runs the controller with it instead.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.spec import UserError

MACHINE = "e2-small"
# e2-small on demand, us-central1 list price (2 vCPU shared, 2 GB): 0.016751 USD/hour, about 12.23 USD a month
# if it never idled.
PRICE_PER_HOUR = 0.016751
IMAGE = "projects/debian-cloud/global/images/family/debian-12"
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
LABEL = "tpuctl-controller"


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def instance_name(region: str) -> str:
    return f"tpuctl-controller-{region}"


@dataclass(frozen=True)
class Where:
    """Where a controller lives and what it serves."""
    project: str
    zone: str
    bucket: str
    provider: str                     # the provider kind the controller uses for its own VM and services
    endpoint: str | None = None       # the Compute Engine API (None: the default)
    service_account: str = "default"  # "default": the project's default compute service account
    idle_minutes: float = 10.0

    @property
    def region(self) -> str:
        return region_of(self.zone)

    @property
    def name(self) -> str:
        return instance_name(self.region)


def _clients(endpoint: str | None):
    from google.cloud import compute_v1
    from orchestrator.provider.cloud import rest_client_kwargs
    kw = rest_client_kwargs(endpoint)
    return compute_v1.InstancesClient(**kw), compute_v1.ZoneOperationsClient(**kw)


def _why(e: Exception) -> str:
    msg = getattr(e, "message", None) or str(e)
    return " ".join(str(msg).split())


def refusal(e: Exception, where: Where, doing: str = "create") -> UserError:
    """A call the API refused (a create, or a look-up: `doing`), as one line with the fix."""
    text = _why(e)
    if "SERVICE_DISABLED" in text or "has not been used in project" in text or "is disabled" in text:
        return UserError(f"cannot {doing} the tpuctl controller: the Compute Engine API is not enabled in project "
                         f"{where.project}: `gcloud services enable compute.googleapis.com --project "
                         f"{where.project}` ({text})")
    if "Quota" in text or "QUOTA" in text:
        return UserError(f"cannot {doing} the tpuctl controller ({MACHINE} in {where.zone}): {text}; ask for more "
                         "quota (IAM & Admin > Quotas) or free some in that region")
    if "Constraint" in text or "constraints/" in text:
        return UserError(f"cannot {doing} the tpuctl controller: an organisation policy forbids it: {text}; ask "
                         "your organisation's admin for an exception for this project")
    if "Permission" in text or "403" in text:
        return UserError(f"cannot {doing} the tpuctl controller: {text}; it needs roles/compute.instanceAdmin.v1 "
                         "and roles/iam.serviceAccountUser on the controller's service account")
    return UserError(f"cannot {doing} the tpuctl controller {where.name} in {where.zone}: {text}")


def get(where: Where) -> dict | None:
    """The controller instance as the API has it ({name, status, created}), or None when there is none. An API
    that refuses the look-up (disabled, forbidden) is one line with the fix, for every command that asks."""
    from google.api_core import exceptions as gx
    inst, _ = _clients(where.endpoint)
    try:
        i = inst.get(project=where.project, zone=where.zone, instance=where.name, timeout=30)
    except gx.NotFound:
        return None
    except gx.GoogleAPICallError as e:
        raise refusal(e, where, "look up") from None
    return {"name": i.name, "status": i.status, "created": i.creation_timestamp, "zone": where.zone,
            "machine": i.machine_type.rsplit("/", 1)[-1]}


def startup_script(where: Where, bundle_uri: str, env: dict[str, str], python: str | None) -> str:
    """What the VM runs at each boot: fetch the bundle, install it, run the controller as a service."""
    args = ["-m", "orchestrator.jobs.controller", "--bucket", where.bucket, "--project", where.project, "--zone",
            where.zone, "--provider", where.provider, "--idle-minutes", str(where.idle_minutes)]
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
    fetch = ("import sys, zipfile, io; from google.cloud import storage; "
             "b, _, p = sys.argv[1][5:].partition('/'); "
             "data = storage.Client().bucket(b).blob(p).download_as_bytes(); "
             "open(sys.argv[2], 'wb').write(data)")
    if python:  # an interpreter with tpuctl's dependencies already: unpack the bundle and run it
        return f"""#!/bin/bash
# tpuctl controller (local mode: this host's interpreter already has the dependencies)
set -eu
{exports}export TPUCTL_HOME=/root/.tpuctl-controller
mkdir -p /root/tpuctl-controller && cd /root/tpuctl-controller
{shlex.quote(python)} -c {shlex.quote(fetch)} {shlex.quote(bundle_uri)} bundle.whl
rm -rf code && mkdir code && cd code && {shlex.quote(python)} -m zipfile -e ../bundle.whl .
exec {shlex.quote(python)} {' '.join(shlex.quote(a) for a in args)} >> /root/tpuctl-controller/controller.log 2>&1
"""
    wheel = shlex.quote(bundle_uri.rsplit("/", 1)[-1])
    unit_env = "".join(f"Environment={k}={v}\n" for k, v in sorted(
        {**env, "TPUCTL_HOME": "/var/lib/tpuctl", "TPUCTL_SSH_KEY": "/var/lib/tpuctl/ssh/key"}.items()))
    return f"""#!/bin/bash
# tpuctl controller: installs tpuctl from the job bucket's bundle and runs it as a systemd service
set -eu
{exports}D=/opt/tpuctl
if [ ! -x $D/venv/bin/python ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv openssh-client
  python3 -m venv $D/venv
  $D/venv/bin/pip install -q google-cloud-storage
fi
$D/venv/bin/python -c {shlex.quote(fetch)} {shlex.quote(bundle_uri)} $D/{wheel}
$D/venv/bin/python -c {shlex.quote(fetch)} {shlex.quote(bundle_uri.rsplit("/", 1)[0] + "/requirements.txt")} $D/requirements.txt
$D/venv/bin/pip install -q -r $D/requirements.txt
$D/venv/bin/pip install -q --no-deps $D/{wheel}
mkdir -p /var/lib/tpuctl/ssh
# Its own SSH key, which reaches the TPU VMs through OS Login as the VM's service account (docs/jobs.md).
[ -f /var/lib/tpuctl/ssh/key ] || ssh-keygen -q -t ed25519 -N '' -f /var/lib/tpuctl/ssh/key
cat > /etc/systemd/system/tpuctl-controller.service <<'UNIT'
[Unit]
Description=tpuctl managed-jobs controller
After=network-online.target
Wants=network-online.target
[Service]
{unit_env}ExecStart=/opt/tpuctl/venv/bin/python {' '.join(args)}
Restart=on-failure
RestartSec=10
[Install]
WantedBy=multi-user.target
UNIT
# OS Login names the controller by its service account's email, which only the metadata server knows.
SA=$(curl -s -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/email)
mkdir -p /etc/systemd/system/tpuctl-controller.service.d
printf '[Service]\\nEnvironment=TPUCTL_ACCOUNT=%s\\n' "$SA" > /etc/systemd/system/tpuctl-controller.service.d/account.conf
systemctl daemon-reload
systemctl enable --now tpuctl-controller
"""


def create(where: Where, script: str, progress: Callable[[str], None]) -> None:
    """Insert the controller instance and wait until it is RUNNING."""
    from google.api_core import exceptions as gx
    from google.cloud import compute_v1
    inst_c, ops = _clients(where.endpoint)
    body = compute_v1.Instance(
        name=where.name, machine_type=f"zones/{where.zone}/machineTypes/{MACHINE}",
        labels={LABEL: "true"}, description="tpuctl managed-jobs controller; deletes itself when idle",
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image=IMAGE, disk_size_gb=20))],
        network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default", access_configs=[
            compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])],
        service_accounts=[compute_v1.ServiceAccount(email=where.service_account, scopes=SCOPES)],
        metadata=compute_v1.Metadata(items=[compute_v1.Items(key="startup-script", value=script)]))
    progress(f"creating the tpuctl controller {where.name} ({MACHINE}, {where.zone}, "
             f"{PRICE_PER_HOUR:.4f} $/hour while it lives; it deletes itself after {where.idle_minutes:g} idle "
             "minutes)")
    try:
        op = inst_c.insert(project=where.project, zone=where.zone, instance_resource=body, timeout=60)
        _wait(ops, where, op.name, 300)
    except gx.Conflict:
        return  # another tpuctl created it first
    except gx.GoogleAPICallError as e:
        raise refusal(e, where) from None
    deadline = time.monotonic() + 300
    while (got := get(where)) is None or got["status"] != "RUNNING":
        if time.monotonic() > deadline:
            raise UserError(f"the tpuctl controller {where.name} did not reach RUNNING in 5 minutes "
                            f"(it is {got['status'] if got else 'gone'}); `tpuctl controller down` and retry")
        time.sleep(1)


def delete(where: Where, wait: bool = True) -> bool:
    """Delete the controller instance; False when there was none."""
    from google.api_core import exceptions as gx
    inst_c, ops = _clients(where.endpoint)
    try:
        op = inst_c.delete(project=where.project, zone=where.zone, instance=where.name, timeout=60)
    except gx.NotFound:
        return False
    if wait:
        _wait(ops, where, op.name, 300)
    return True


def _wait(ops, where: Where, op_name: str, timeout: float) -> None:
    """Until the zonal operation is DONE: its error raised as the API's (the library's own wait would poll through a
    client that ignores this one's endpoint)."""
    from google.api_core import exceptions as gx
    from google.cloud import compute_v1
    deadline = time.monotonic() + timeout
    while True:
        op = ops.wait(project=where.project, zone=where.zone, operation=op_name, timeout=130)
        if op.status == compute_v1.Operation.Status.DONE:
            if op.error and op.error.errors:
                msg = "; ".join(e.message for e in op.error.errors)
                raise gx.from_http_status(op.http_error_status_code or 400, msg)
            return
        if time.monotonic() > deadline:
            raise UserError(f"operation {op_name} on {where.name} did not finish in {timeout:.0f} s")
