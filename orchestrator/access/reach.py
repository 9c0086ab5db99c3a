"""One call from a slice's name to everything needed to reach its workers: `reach(NAME, ...)`.

The workers come from the slice's record and the TPU API (orchestrator.slices.workers), or directly from
`--hosts ip[:port],...`. How to SSH to them follows flags > environment > the slice's provider > the TPU VM
defaults: the user, key and port; the known_hosts file the slice's host keys are pinned in; the keys the VMs
published (guest attributes); the OS Login user when the slice has OS Login on; the proxy per worker
(--ssh-proxy-command > --iap > TPUCTL_SSH_PROXY_COMMAND > what `up` recorded). The command line only parses its
flags into `Reach` and calls `reach`.
"""
from __future__ import annotations

import getpass
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator import provider
from orchestrator.access import hostkeys, sshproxy
from orchestrator.access.hosts import SshConfig
from orchestrator.jobs import launch as L
from orchestrator.provider import HostAccess, Provider
from orchestrator.spec import UserError
from orchestrator.state import home as _home

DEFAULT_SSH_PORT = 22


@dataclass
class Target:
    name: str
    workers: list[L.Worker]
    ssh: SshConfig
    where: Provider
    access: HostAccess = HostAccess()
    devices_per_host: int | None = None  # from the accelerator type, when the slice is recorded
    accelerator: str | None = None  # the recorded slice's type (the plan checks the step against it)
    slices: int = 1                 # a multislice record: one job over this many slices of `accelerator`


def _parse_hosts(spec: str) -> list[L.Worker]:
    out = []
    for i, item in enumerate(x.strip() for x in spec.split(",") if x.strip()):
        host, _, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        if not port.isdigit() and port:
            raise UserError(f"--hosts {item!r}: write ip or ip:port, comma-separated")
        out.append(L.Worker(index=i, internal_ip=host, port=int(port) if port else None))
    if not out:
        raise UserError("--hosts is empty: write --hosts 10.0.0.2,10.0.0.3[:22]")
    return out


def known_hosts_file(name: str, created_at: float | None) -> Path:
    """Where the host keys of slice NAME are pinned. A recreated slice (a new record) gets a file of its own,
    and the files of the slice's earlier incarnations are removed: new VMs, new host keys."""
    d = _home() / "known_hosts"
    stem = f"{name}@{int(created_at * 1000) if created_at else 'hosts'}"
    for old in d.glob(f"{name}@*"):
        if old.name.split(".")[0] != stem:
            old.unlink(missing_ok=True)
    return d / stem


@dataclass(frozen=True)
class SshFlags:
    """What the user said about reaching the workers (every verb that crosses SSH takes the same flags)."""
    hosts: str | None = None           # --hosts ip[:port],...: these hosts, no slice looked up
    local: bool | None = None          # --local: where --hosts live (the local provider)
    ssh_user: str | None = None
    ssh_key: str | None = None
    ssh_port: int | None = None
    ssh_wait: float | None = None      # how long to keep trying a worker that refuses or drops the connection
    internal_ip: bool = False          # reach every worker on its internal IP (this machine is in the VPC)
    ssh_proxy_command: str | None = None
    iap: bool = False


def reach(name: str, flags: SshFlags = SshFlags(), say: Callable[[str], None] = lambda m: None) -> Target:
    """The workers of slice NAME (or --hosts) and how to SSH to them (flags > env > provider > TPU VM defaults;
    the proxy: --ssh-proxy-command > --iap > TPUCTL_SSH_PROXY_COMMAND > what `up` recorded). `say` gets the
    one-line notes on the way (OS Login decided by the project, ...)."""
    hosts, local, ssh_user, ssh_key, ssh_port = flags.hosts, flags.local, flags.ssh_user, flags.ssh_key, flags.ssh_port
    ssh_wait, internal_ip, ssh_proxy_command, iap = flags.ssh_wait, flags.internal_ip, flags.ssh_proxy_command, flags.iap
    if ssh_proxy_command and iap:
        raise UserError("--ssh-proxy-command and --iap exclude each other: --iap is a proxy command; pick one")
    if ssh_proxy_command is not None:
        _checked(ssh_proxy_command, "--ssh-proxy-command")
    from orchestrator import catalog, slices, state
    devices, created, accelerator, n_slices = None, None, None, 1
    rec = state.lookup(name)
    if hosts:
        workers = _parse_hosts(hosts)
        where = provider.chosen(local)  # no record consulted: the user says where these hosts live
        access = where.host_access(name)
    else:
        if rec is None:  # run takes no --zone/--project to look further: the record is where slices are found
            raise UserError(f"no slice named {name} in the local record: `tpuctl ls` lists them, "
                            f"`{' '.join(['tpuctl up', name, '...', *provider.chosen(local).cli_flags])}` creates it, "
                            "or pass --hosts IP,...")
        where = provider.of(rec)
        ws = slices.workers(name)
        created, n_slices = rec.created_at, rec.slices
        try:
            devices = catalog.lookup(rec.accelerator).devices_per_host
            accelerator = rec.accelerator
        except (ValueError, KeyError):
            devices = None
        # A worker without an external IP (--no-external-ips) is reached on its internal one; --internal-ip
        # forces that for all, for a machine inside the VPC.
        workers = [L.Worker(index=w.index, internal_ip=w.internal_ip, slice=w.slice,
                            external_ip=None if internal_ip else w.external_ip) for w in ws]
        access = where.host_access(name)
    user = ssh_user or os.environ.get("TPUCTL_SSH_USER") or access.user or getpass.getuser()
    key = ssh_key or os.environ.get("TPUCTL_SSH_KEY") or access.key
    port = ssh_port or int(os.environ.get("TPUCTL_SSH_PORT") or 0) or access.port or DEFAULT_SSH_PORT
    ssh = SshConfig(user=user, port=port) if key is None else SshConfig(user=user, key=key, port=port)
    ssh.known_hosts = str(known_hosts_file(name, created))
    ssh.slice = name
    if ssh_wait is not None:
        ssh.wait_s = ssh_wait
    env_proxy = os.environ.get(sshproxy.ENV) or None
    if not (ssh_proxy_command or iap) and env_proxy:
        ssh_proxy_command = _checked(env_proxy, sshproxy.ENV)
    elif not (ssh_proxy_command or iap) and rec is not None and not hosts:
        ssh_proxy_command, iap = rec.ssh_proxy_command, rec.iap
    if rec is not None and not hosts:
        ssh.host_keys = _published_keys(where, rec)
        if not (ssh_user or os.environ.get("TPUCTL_SSH_USER")) and _os_login(where, rec, ssh, say):
            ssh.os_login_project = rec.project
        if iap:
            ssh.proxy_commands = _iap_commands(where, rec)
    elif iap:
        raise UserError("--iap needs a slice tpuctl created (the workers' VM names come from the TPU API), not "
                        "--hosts: pass --ssh-proxy-command instead")
    if ssh_proxy_command:
        ssh.proxy_commands = {w.index: ssh_proxy_command for w in workers}
    return Target(name=name, workers=workers, ssh=ssh, where=where, access=access, devices_per_host=devices,
                  accelerator=accelerator, slices=n_slices)


def _checked(command: str, what: str) -> str:
    try:
        return sshproxy.check(command, what)
    except sshproxy.ProxyError as e:
        raise UserError(str(e)) from None


def _published_keys(where: Provider, rec) -> hostkeys.Published:
    """The workers' host keys as their guest agents published them (TPU API guest attributes, `hostkeys/`)."""
    from orchestrator.provider.cloud import CloudError
    api = []

    def fetch() -> dict[tuple[int, int], list[tuple[str, str]]]:
        try:
            api[:] = api or [where.api_for(rec)]
            # {(slice, worker index): keys}: each slice's node publishes its own workers' (one node on one slice)
            per_node = [api[0].guest_attributes(node, hostkeys.NAMESPACE + "/") for node in rec.nodes]
        except CloudError as e:
            if e.kind == "permission":
                raise hostkeys.Unreadable(
                    f"cannot read the workers' published SSH host keys: your account lacks "
                    f"{hostkeys.PERMISSION} on project {rec.project}; pinning each worker's key on first contact "
                    "instead (grant that permission to have tpuctl check the keys the VMs publish)") from None
            raise hostkeys.Unreadable(f"cannot read the workers' published SSH host keys ({e}); pinning each "
                                      "worker's key on first contact instead") from None
        return {(sl, i): [(k, v) for ns, k, v in items if ns == hostkeys.NAMESPACE]
                for sl, attrs in enumerate(per_node) for i, items in enumerate(attrs)}
    return hostkeys.Published(slice=rec.name, fetch=fetch)


def _os_login(where: Provider, rec, ssh: SshConfig, say: Callable[[str], None]) -> bool:
    """With OS Login on for the slice: register the key (until the slice's expiry) and SSH as the POSIX user."""
    from orchestrator.access import oslogin
    from orchestrator.access import sshkeys
    from orchestrator.spec import LABEL_EXPIRY
    # The node's metadata is what `up` sent (recorded); only when it does not decide is the project asked.
    if not oslogin.applies(rec.project, rec.metadata, where.endpoint(rec.api_endpoint),
                           say):
        return False
    try:
        _, pub, _ = sshkeys.ensure_key(ssh.key or None)
    except (sshkeys.SshKeyError, OSError) as e:
        raise UserError(str(e)) from None
    expiry = rec.labels.get(LABEL_EXPIRY, "")
    ttl = max(60.0, float(expiry) - time.time()) if expiry.isdigit() else None
    ssh.user = oslogin.register(pub, project=rec.project, account_email=oslogin.account(), ttl_s=ttl)
    return True


def _iap_commands(where: Provider, rec) -> dict[int, str]:
    """Per worker: the IAP hop to its VM, named as the VM's guest agent publishes it (`hostname`)."""
    try:
        attrs = where.api_for(rec).guest_attributes(rec.node, "")
    except UserError as e:
        raise UserError(f"--iap: cannot read the workers' VM names from their guest attributes ({e})") from None
    out = {}
    for i, items in enumerate(attrs):
        vm = next((v for _ns, k, v in items if k == "hostname"), None)
        if not vm:
            raise UserError(f"--iap: worker {i} of {rec.name} has not published its VM name (guest attribute "
                            "hostname) yet; retry in a minute, or pass --ssh-proxy-command")
        try:
            out[i] = sshproxy.iap_command(vm, rec.zone, rec.project)
        except sshproxy.ProxyError as e:
            raise UserError(str(e)) from None
    return out
