"""Local mode: slices on this machine, with no cloud account.

The Cloud TPU API is the stand-in (infra/fake_tpu_api.py, a background server this provider starts and reuses),
talked to by the same client as the real one. What the stand-in cannot be, this provider owns:
- hosts: each worker is an sshd in its own namespaces on a loopback address (infra/local_slice.py), started
  when the node is READY;
- storage: a gs:// path is the GCS emulator (infra/gcs.py), whose endpoint the hosts get in their environment;
- devices: every host emulates its accelerator's device count on CPU (TPUCTL_EMULATE_DEVICES);
- a preemption: the stand-in starts each node's hosts itself (`FakeControl.start_vms`) and stops them when
  the node is preempted or deleted, as real VMs die with it, whether or not anyone is watching.
It is the only module above infra/ that imports a stand-in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from orchestrator import state
from orchestrator.provider import cloud
from orchestrator.jobs.procs import pid_alive
from orchestrator.provider.cloud import Api
from orchestrator.provider.base import LOCAL, HostAccess, Progress, Provider
from orchestrator.spec import LOCAL_PROJECT, SliceSpec, UserError
from orchestrator.state import SliceRecord, Worker

MAX_HOSTS = 16  # a local slice is sshd processes on this machine: v4-4096 stays addresses only
OPTIONS = {"fresh": "hosts shaped like fresh TPU VMs: no uv, no wheelhouse, only the system's python3"}


class LocalProvider(Provider):
    kind = LOCAL
    cli_flags = ("--local",)
    cpu_devices = True

    default_project = LOCAL_PROJECT

    # ---- the TPU API: the stand-in
    def endpoint(self, api_endpoint: str | None = None) -> str | None:
        if api_endpoint:
            raise UserError("--local and --api-endpoint exclude each other: --local starts its own stand-in; drop one")
        return api_url()

    def connect(self, *, project: str | None = None, api_endpoint: str | None = None) -> Api:
        if api_endpoint:
            raise UserError("--local and --api-endpoint exclude each other: --local starts its own stand-in; drop one")
        return cloud.connect(api_endpoint=api_url(), project=project or LOCAL_PROJECT)

    def api_for(self, rec: SliceRecord, api_endpoint: str | None = None) -> Api:
        return self.connect(project=rec.project)  # the stand-in may have restarted on another port

    def endpoint_of(self, api: Api) -> str | None:
        return None

    def owns(self, rec: SliceRecord, api: Api) -> bool:
        return rec.provider == self.kind and rec.project == api.project

    # ---- creating
    def check(self, spec: SliceSpec) -> None:
        if spec.api_endpoint:
            raise UserError("--local and --api-endpoint exclude each other: --local starts its own stand-in; drop one")
        unknown = sorted(set(spec.provider_options) - set(OPTIONS))
        if unknown:
            raise UserError(f"unknown local slice option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")

    def default_zones(self, spec: SliceSpec) -> list[str]:
        return [spec.accelerator_type.zone_hints[0]]  # the stand-in offers the catalog's zones

    def attach(self, api: Api, rec: SliceRecord, progress: Progress) -> list[Worker]:
        """Give the stand-in's node(s) real hosts (sshd on loopback) so `tpuctl run` can reach them.

        Without root or sshd (or for a huge slice) the node keeps the stand-in's made-up addresses: `up`,
        `status` and `down` still work, and `run` says why it cannot connect."""
        from infra.fake_tpu_api import FakeControl
        from infra.local_slice import LocalHost, LocalSlice, default_base_dir
        from orchestrator.access.sshkeys import parse_metadata

        n = len(rec.workers)
        if n > MAX_HOSTS:
            progress(f"note: {n} workers is more than the {MAX_HOSTS} local hosts tpuctl starts; no SSH hosts")
            return rec.workers
        # Like a VM's guest agent, the hosts let in the keys of the node's ssh-keys metadata. A local host has
        # only root: keys for other users are not installed.
        meta = api.get_node(rec.node)
        keys = parse_metadata((meta.metadata if meta else {}).get("ssh-keys", ""))
        from orchestrator.access import oslogin
        if oslogin.applies(rec.project, meta.metadata if meta else {}, api.endpoint, progress):
            # An OS Login VM lets in the keys of the account's login profile, as its POSIX user.
            user, login_keys = oslogin.profile_keys(oslogin.account(), rec.project)
            keys = [(user, k) for k in login_keys]
        others = sorted({u for u, _ in keys if u != "root"})
        if others:
            progress(f"note: the local hosts have only root; ssh-keys for {', '.join(others)} are not installed")
        # One local slice (its own sshd hosts, its own loopback block) per node: a multislice node's VMs die
        # with that node alone, as one preempted slice's do.
        names = _host_slices(rec)
        per = n // len(names)
        # The stand-in starts the VMs (outside this process's namespaces, so they outlive it: a managed job's
        # controller recreates slices from inside its own host) and stops them when the node is preempted or
        # deleted, as the cloud kills its VMs.
        control = FakeControl(api_url(), timeout=120)
        started: list = []
        try:
            for node_name, hname in zip(rec.nodes, names):
                root_keys = tuple(k for u, k in keys if u == "root")
                if started:  # every slice's hosts let in the one client key that `run` uses (slice 0's)
                    root_keys += (Path(started[0][0].ssh_key + ".pub").read_text().strip(),)
                try:
                    d = control.start_vms(node_name, hname, per, str(default_base_dir()),
                                          fresh=bool(rec.provider_options.get("fresh")), authorized_keys=root_keys)
                except RuntimeError as e:
                    progress(f"note: no local SSH hosts for {rec.name} ({e}); `tpuctl run` will not reach it")
                    for h, _ in started:
                        LocalSlice.stop_by_name(h.name, h.base_dir)
                    return rec.workers
                host_keys = d.pop("host_keys")
                d["hosts"] = [LocalHost(**h) for h in d["hosts"]]
                started.append((LocalSlice(**d), host_keys))
            started_slices = [s_ for s_, _ in started]
            # Without external IPs the workers' internal addresses are ones this machine cannot reach over SSH
            # (nothing listens there), as a laptop outside the VPC: only a proxy command (--ssh-proxy-command)
            # that knows the way gets through; `private_address` is that way back.
            nodes, all_ips = [], []
            for node_name, (hosts, keys_by_host) in zip(rec.nodes, started):
                ips = [h.ip if rec.external_ips else private_address(h.ip) for h in hosts.hosts]
                all_ips += ips
                control.set_node_workers(node_name, ips)
                for h in hosts.hosts:  # what each VM's guest agent publishes: its real sshd host keys and its name
                    control.publish_host_keys(node_name, h.index, keys_by_host[h.index])
                    control.set_guest_attributes(node_name, h.index, [{"key": "hostname", "value": h.hostname}],
                                                 namespace="")
                nodes.append(api.get_node(node_name))
        except BaseException:
            for h, _ in started:
                LocalSlice.stop_by_name(h.name, h.base_dir)
            raise
        started = started_slices
        up = ", ".join(h.ip for hosts in started for h in hosts.hosts)
        progress(f"{rec.name}: {n} local host(s) up (sshd on {up}"
                 + (f", {per} per slice" if len(names) > 1 else "")
                 + ("" if rec.external_ips else f"; their internal addresses {', '.join(all_ips)} are not reachable "
                                                  "from here") + ")")
        if len(nodes) == 1:
            return nodes[0].workers
        return [dataclasses.replace(w, slice=s) for s, node in enumerate(nodes) for w in node.workers]

    # ---- the VMs' end
    def release(self, name: str, progress: Progress) -> None:
        from infra.local_slice import LocalSlice
        rec = state.lookup(name)
        if any([LocalSlice.stop_by_name(h) for h in ({name, *(_host_slices(rec) if rec else [])})]):
            progress(f"stopped the local hosts of {name}")

    def orphans(self, recorded: set[str]) -> list[str]:
        from infra.local_slice import LocalSlice
        return [n for n in LocalSlice.names() if n not in recorded]

    # ---- running on the hosts
    def host_access(self, name: str) -> HostAccess:
        from infra.local_slice import LocalSlice
        rec = state.lookup(name)
        ls = LocalSlice.load(_host_slices(rec)[0] if rec else name)  # multislice: slice 0's key reaches them all
        if ls is None or not (all(ls.alive()) or ls.answering()):
            raise UserError(f"the local hosts of {name} are not running: "
                            f"`tpuctl down {name}` then `tpuctl up {name} --local` again")
        if ls.fresh:  # reached like a real VM: your user and key, which `up` put in its metadata
            return HostAccess(port=ls.hosts[0].port)
        return HostAccess(user=ls.ssh_user, key=ls.ssh_key, port=ls.hosts[0].port, python=ls.python or None,
                          wheelhouse=ls.wheelhouse or None)

    def run_env(self, name: str, command: list[str], devices_per_host: int | None) -> dict[str, str]:
        env = {"TPUCTL_EMULATE_DEVICES": str(devices_per_host)} if devices_per_host else {}
        return {**env, **self.local_env(command)}

    def local_env(self, paths: list[str]) -> dict[str, str]:
        """gs:// is the GCS emulator (started if none runs). A bucket the command names exists, as the user's own
        bucket would in the cloud."""
        buckets = sorted({a.split("gs://", 1)[1].split("/", 1)[0] for a in paths if "gs://" in a} - {""})
        if not buckets:
            return {}
        from infra import gcs
        return gcs.start(buckets=tuple(buckets)).env

    # ---- managed jobs: the stand-ins of Compute Engine and Secret Manager, the GCS emulator
    def compute_endpoint(self) -> str | None:
        return service_url("compute")

    def secrets_endpoint(self) -> str | None:
        return service_url("secrets")

    def secrets_credentials(self, member: str | None = None):
        """The stand-in names its caller from the bearer token (an IAM member); none is the project's owner."""
        if member is None:
            return None
        from google.oauth2.credentials import Credentials
        return Credentials(token=member)

    def storage_env(self, bucket: str) -> dict[str, str]:
        return self.local_env([f"gs://{bucket}/"])

    def storage_up(self) -> bool:
        from infra import gcs
        return gcs.running() is not None

    def bucket_iam_endpoint(self, bucket: str, project: str) -> str | None:
        """fake-gcs-server has no bucket IAM (GET /storage/v1/b/B/iam is 404 there): the local cloud's stand-in
        beside Resource Manager serves it (infra/fake_bucket_iam.py), told the bucket is the slice's project's, as
        the emulator made it for that project."""
        from infra.fake_login_apis import FakeLoginControl
        url = service_url("compute")
        FakeLoginControl(url).bucket_project(bucket, project)
        return url

    def as_account(self, email: str):
        """The stand-ins name their caller from the bearer token (an IAM member)."""
        from google.oauth2.credentials import Credentials
        return Credentials(token=f"serviceAccount:{email}")

    def resource_manager_endpoint(self) -> str | None:
        return service_url("compute")  # the Compute Engine stand-in serves Resource Manager's projects too

    def controller_runtime(self) -> tuple[str | None, dict[str, str]]:
        """The controller's host runs this machine's interpreter (it has tpuctl's dependencies) and reaches the same
        local cloud: the stand-ins' and hosts' records in the machine dir."""
        from infra.local_slice import machine_dir
        return sys.executable, {"TPUCTL_LOCAL_DIR": str(machine_dir())}

    def controller_started(self, project: str, zone: str, instance: str, progress: Progress) -> None:
        """The instance's VM is a host the Compute Engine stand-in starts, which then runs its startup script, as a
        VM boots it. The host still sees the local cloud's records, the hosts' wheelhouse and this checkout (where
        the stand-ins' code lives), as a real controller reaches the same cloud."""
        import zlib
        from infra.fake_login_apis import FakeLoginControl
        from infra.local_slice import machine_dir, tpuctl_home
        from orchestrator.jobs.bundle import project_root
        keep = [str(machine_dir()), str(tpuctl_home() / "wheelhouse"), str(project_root())]
        # Its own loopback block, one no slice takes (slices use 127.0.10-249.x).
        first_ip = f"127.0.250.{1 + zlib.crc32(instance.encode()) % 250}"
        try:
            FakeLoginControl(self.compute_endpoint(), timeout=120).start_vm_host(
                project, zone, instance, str(machine_dir() / "vms"), keep, first_ip=first_ip)
        except RuntimeError as e:
            raise UserError(f"could not start the local host of {instance}: {e}") from None
        progress(f"{instance}: local host up; its startup script runs the controller")

    def stop_services(self) -> None:
        """The GCS emulator and the stand-ins end (their state is lost)."""
        from infra import gcs
        gcs.stop()
        for kind in ("compute", "secrets", "tpu"):
            stop_service(kind)


def private_address(ip: str) -> str:
    """The internal address a local host of a slice without external IPs has in the TPU API: 127.0.B.I becomes
    127.1.B.I (loopback too, so the hosts bind and reach it, e.g. the jax.distributed coordinator; no sshd
    listens there, so SSH from this machine is refused)."""
    a, b, c, d = ip.split(".")
    return f"{a}.{int(b) + 1}.{c}.{d}"


def _host_slices(rec: SliceRecord) -> list[str]:
    """The local slices (infra/local_slice.py) holding a record's hosts: its name, or each node's (NAME-i)."""
    return [rec.name] if rec.slices <= 1 else [n.rsplit("/", 1)[-1] for n in rec.nodes]


# ---- the TPU API stand-in as a background server --------------------------------------------------------

def _dir() -> Path:
    from infra.local_slice import machine_dir
    return machine_dir()


def _alive(url: str, pid: int) -> bool:
    # Its answer is what counts: from a managed job's controller host (its own PID namespace) the stand-in's pid
    # is not visible. It gets time to answer: on a busy machine a slow answer taken for none would start a second
    # stand-in, and every slice and instance the first one holds would be lost to its callers.
    for timeout in (2, 10):
        try:
            with urllib.request.urlopen(f"{url}/_fake/health", timeout=timeout) as r:
                return json.loads(r.read()).get("pid") == pid
        except TimeoutError:
            continue
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                continue
            return False
        except (OSError, ValueError):
            return False
    return False


# The stand-ins local mode runs as background servers on this machine: module, record stem, what it stands for.
_SERVICES = {"tpu": ("infra.fake_tpu_api", "fake_tpu_api", "Cloud TPU"),
             "compute": ("infra.fake_login_apis", "fake_login_apis", "Compute Engine"),
             "secrets": ("infra.fake_secret_manager", "fake_secret_manager", "Secret Manager")}


def service_url(kind: str, args: tuple[str, ...] = ()) -> str:
    """Start (or reuse) one local stand-in; its pid and port live in the machine dir's `<stem>.json`. It outlives
    the command that started it, as the cloud's services do."""
    module, stem, what = _SERVICES[kind]
    d = _dir()
    d.mkdir(parents=True, exist_ok=True)
    info_path = d / f"{stem}.json"
    with open(d / f"{stem}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two tpuctl processes must not start two stand-ins
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(info_path.read_text())
            if _alive(info["url"], info["pid"]):
                return info["url"]
        with contextlib.suppress(FileNotFoundError):
            info_path.unlink()
        log = open(d / f"{stem}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", module, "--port", "0", "--ready-file", str(info_path), *args],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if info_path.exists():
                return json.loads(info_path.read_text())["url"]
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise UserError(f"could not start the local {what} stand-in; see {d / (stem + '.log')}")


def api_url(idle_timeout_s: float = 6 * 3600) -> str:
    """The local Cloud TPU stand-in (started if none answers)."""
    return service_url("tpu", ("--idle-timeout", str(idle_timeout_s)))


def service_info(kind: str) -> dict | None:
    """{pid, host, port, url} of a running local stand-in, or None."""
    try:
        info = json.loads((_dir() / f"{_SERVICES[kind][1]}.json").read_text())
    except (OSError, ValueError):
        return None
    return info if _alive(info["url"], info["pid"]) else None


def api_info() -> dict | None:
    return service_info("tpu")


def stop_service(kind: str) -> bool:
    """Stop one local stand-in (its state is lost). True if one was running."""
    info = service_info(kind)
    with contextlib.suppress(FileNotFoundError):
        (_dir() / f"{_SERVICES[kind][1]}.json").unlink()
    if not info:
        return False
    if kind == "compute":  # the instances' hosts end with the service that started them
        from infra.fake_login_apis import FakeLoginControl
        with contextlib.suppress(RuntimeError, OSError):
            FakeLoginControl(info["url"], timeout=60).reset()
    pid = info["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        for _ in range(250):
            with contextlib.suppress(ChildProcessError):  # our own child: reap it, or it lingers as a zombie
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return True
            if not pid_alive(pid):
                return True
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
    return True


def stop_api() -> bool:
    return stop_service("tpu")
