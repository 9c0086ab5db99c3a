"""SSH to every worker of a slice with fabric: preflight, push the bundle, run everywhere, stop.

One fabric Connection per worker, used from one thread per worker (a ThreadingGroup for the
all-at-once steps). Nothing reads the local stdin (`in_stream=False`) except the secrets upload,
whose stdin is an in-memory buffer.
"""
from __future__ import annotations

import fcntl
import getpass
import hashlib
import io
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import paramiko
from fabric import Config, Connection, ThreadingGroup

from orchestrator.access import hostkeys
from orchestrator.access import oslogin
from orchestrator.access import sshproxy
from orchestrator.jobs.bundle import Bundle
from orchestrator.jobs.launch import HOSTWRAP, HostLayout, Worker, _home_path

# paramiko logs a failed handshake (with a traceback) from its transport thread; tpuctl reports it in one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

HOST_DIR = Path(__file__).resolve().parents[1] / "host"  # the files pushed to every host
# The accelerator probe the trainer uses too, sent ahead of hostprobe.py's source (stdlib only, as that is).
from trainer.common import accelerators  # noqa: E402 (jax-free)
PROBE_SOURCE = Path(accelerators.__file__)
MIN_FREE_GB = 2.0
MAX_SKEW_S = 60.0     # TLS to GCS and the coordinator's deadlines go wrong past this
WARN_SKEW_S = 2.0


class HostError(RuntimeError):
    """What went wrong on which host, one line each."""


class RunGoing(HostError):
    """Preflight found a tpuctl run still going on the hosts (hostwrap keeps runs past their SSH sessions)."""

    def __init__(self, message: str, runs: dict[str, str], hosts: dict[str, list[int]]):
        super().__init__(message)
        self.runs = runs    # run id -> its command's tag
        self.hosts = hosts  # run id -> the worker indices it runs on


def _default_key() -> str | None:
    # What `gcloud compute tpus tpu-vm ssh` creates and TPU VMs accept.
    k = Path.home() / ".ssh" / "google_compute_engine"
    return str(k) if k.exists() else None


@dataclass
class SshConfig:
    user: str = field(default_factory=getpass.getuser)
    key: str | None = field(default_factory=_default_key)
    port: int = 22
    connect_timeout: float = 10.0
    # Host keys pinned on first contact (an OpenSSH known_hosts file of this slice's own); None: not checked.
    known_hosts: str | None = None
    # A VM reports READY before its sshd is up and its keys are in: keep trying to connect this long.
    wait_s: float = 180.0
    slice: str = ""  # for messages: the slice these workers belong to
    # The host keys the workers published (guest attributes): pinned exactly, before any connection. None: pin
    # on first contact (hosts given by address, with no TPU API to ask).
    host_keys: hostkeys.Published | None = None
    # Worker index -> ProxyCommand template (%h %p %r %%): every connection to that worker goes through it.
    proxy_commands: dict[int, str] = field(default_factory=dict)
    os_login_project: str | None = None  # the VMs use OS Login (a refused login then means a missing role)


class _Conn(Connection):
    """A fabric Connection that starts a fresh proxy process for every open (a closed one cannot be reused)."""

    def open(self):
        if self.is_connected or not self._proxy_template:
            return super().open()
        self.proxy = sshproxy.Proxy(sshproxy.expand(self._proxy_template, self.host, self.port, self.user))
        self.connect_kwargs["sock"] = self.proxy
        try:
            return super().open()
        except BaseException:
            self.proxy.close()
            raise


class PinHostKeys(paramiko.MissingHostKeyPolicy):
    """Trust on first use, per slice: an unknown host's key is written to the slice's known_hosts file; a
    known host that shows another key is refused by paramiko itself (BadHostKeyException), before any
    command or secret is sent. Hosts of one slice connect from several threads: writes are merged under a lock."""

    _lock = threading.Lock()

    def __init__(self, path: str):
        self.path = path

    def missing_host_key(self, client, hostname, key):
        with self._lock, open(self.path + ".lock", "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            keys = paramiko.HostKeys()
            if os.path.exists(self.path):
                keys.load(self.path)
            known = keys.lookup(hostname)
            if known and key.get_name() in known and known[key.get_name()] != key:
                raise paramiko.BadHostKeyException(hostname, key, known[key.get_name()])
            keys.add(hostname, key.get_name(), key)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            keys.save(tmp)
            os.replace(tmp, self.path)
        client.get_host_keys().add(hostname, key.get_name(), key)


@dataclass
class InstallOptions:
    """How bootstrap.sh builds the dependency layer (defaults: a real host, from the package index)."""
    wheelhouse: str | None = None  # install only from this directory of wheels (shared on the machine)
    uv_cache: str | None = None    # uv's cache (shared on the machine: a second host links, not unpacks)
    python: str | None = None      # a Python >= 3.11 the host has (else bootstrap finds or installs one)


@dataclass
class Probe:
    """One host's preflight answer."""
    worker: Worker
    error: str | None = None          # unreachable, no python3, ...
    hostname: str = ""
    python: str = ""
    free_gb: float = 0.0
    skew_s: float = 0.0
    flavour: str = "cpu"
    stale: list[dict] = field(default_factory=list)
    cleared: list[dict] = field(default_factory=list)
    deps_key: str = ""
    have_deps: bool = False
    have_app: bool = False
    have_files: list[str] = field(default_factory=list)
    coordinator: str = ""                  # IP:PORT checked for the coordinator (worker 0)
    coordinator_taken: dict | None = None  # who already listens there

    def problems(self) -> list[str]:
        w = f"{self.worker.name} ({self.worker.address})"
        if self.error:
            return [f"{w}: {self.error}"]
        out = []
        for s in self.stale:
            what = {"device": f"holds {s['path']}", "lockfile": f"left {s['path']} behind (no process holds it)",
                    "trainer": f"is a tpuctl trainer still running (run {s.get('run_id')})"}[s["kind"]]
            who = f"PID {s['pid']} ({s['cmd'][:80]})" if s.get("pid") else "a dead process"
            out.append(f"{w}: {who} {what}: rerun with --kill-stale to clear it")
        if self.coordinator_taken is not None:
            t = self.coordinator_taken
            who = f"PID {t['pid']} ({t['cmd'][:80]})" if t.get("pid") else "another process"
            out.append(f"{w}: the jax.distributed coordinator port {self.coordinator} is taken by {who}: "
                       "pass --coordinator-port with a free port, or stop that process")
        if self.free_gb < MIN_FREE_GB:
            out.append(f"{w}: only {self.free_gb:.1f} GB free in the home directory (need {MIN_FREE_GB} GB)")
        if abs(self.skew_s) > MAX_SKEW_S:
            out.append(f"{w}: clock is {self.skew_s:+.0f} s off this machine's: fix NTP on the host")
        return out

    def warnings(self) -> list[str]:
        w = f"{self.worker.name} ({self.worker.address})"
        out = []
        if not self.error and abs(self.skew_s) > WARN_SKEW_S:
            out.append(f"{w}: clock is {self.skew_s:+.1f} s off this machine's")
        if not self.error and self.python and tuple(map(int, self.python.split(".")[:2])) < (3, 11):
            out.append(f"{w}: host Python is {self.python}; bootstrap brings 3.11 for jax")
        return out


def file_id(path: Path) -> str:
    """Name of a helper script on the host: versioned by content, so an edit is re-uploaded."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return f"{path.stem}-{digest}{path.suffix}"


def _slot(w: Worker) -> tuple[int, int]:
    """Where a worker's published host keys are found: (its slice, its index in the slice's node)."""
    return (w.slice or 0, w.index)


class Hosts:
    """The workers of one slice, over SSH."""

    def __init__(self, workers: list[Worker], ssh: SshConfig, layout: HostLayout | None = None):
        if not workers:
            raise HostError("no workers to connect to")
        self.workers = sorted(workers, key=lambda w: (w.slice or 0, w.index))  # JAX process order
        self.ssh = ssh
        self.layout = layout or HostLayout()
        self.published: dict[tuple[int, int], list[paramiko.PKey]] = {}  # (slice, worker) -> its published keys
        self._pinned = False
        if ssh.key and not Path(ssh.key).expanduser().exists():
            raise HostError(f"SSH key {ssh.key} does not exist: pass --ssh-key PATH")
        self.conns = [self._connect(w) for w in self.workers]
        self.helpers = {p.name: file_id(p) for p in (HOST_DIR / HOSTWRAP, HOST_DIR / "bootstrap.sh")}

    def _connect(self, w: Worker) -> Connection:
        config = Config(overrides={"load_ssh_configs": False,
                                   "run": {"in_stream": False, "hide": True, "warn": True}})
        kw = {"banner_timeout": 30, "auth_timeout": 30}
        if self.ssh.key:  # exactly this key: no agent, no ~/.ssh/id_* guessing
            kw.update(key_filename=str(Path(self.ssh.key).expanduser()), look_for_keys=False, allow_agent=False)
        c = _Conn(w.address, user=self.ssh.user, port=w.port or self.ssh.port, config=config,
                  connect_timeout=self.ssh.connect_timeout, connect_kwargs=kw)
        c._proxy_template = self.ssh.proxy_commands.get(w.index)
        c.proxy = None
        pub = self.published.get(_slot(w))
        if pub:  # exactly what the VM published: nothing else, and nothing pinned earlier
            for k in pub:
                c.client.get_host_keys().add(hostkeys.host_id(c.host, c.port), k.get_name(), k)
            c.client.set_missing_host_key_policy(hostkeys.OnlyPublished(pub))
        elif self.ssh.known_hosts:
            Path(self.ssh.known_hosts).parent.mkdir(parents=True, exist_ok=True)
            if os.path.exists(self.ssh.known_hosts):
                c.client.load_host_keys(self.ssh.known_hosts)
            c.client.set_missing_host_key_policy(PinHostKeys(self.ssh.known_hosts))
        return c

    def wait_reachable(self, say: Callable[[str], None] | None = None) -> None:
        """Open every connection, retrying refusals and timeouts for up to ssh.wait_s (sshd on a new VM
        starts after READY). A refused key or a changed host key fails at once: waiting cannot fix either."""
        deadline = time.monotonic() + self.ssh.wait_s
        said: set[int] = set()
        if self.ssh.host_keys is not None and not self._pinned:
            self._pin_published(say, deadline)

        def one(i: int, c: Connection) -> None:
            w = self.workers[i]
            where = f"{w.name} ({w.address})"
            while True:
                try:
                    c.open()
                    return
                except paramiko.BadHostKeyException as e:
                    if _slot(w) in self.published:
                        raise HostError(self._impostor(w, e)) from None
                    raise HostError(
                        f"{where}: its SSH host key changed since tpuctl first connected ({e.key.get_name()} "
                        f"{e.key.get_fingerprint().hex()[:16]}..., pinned {e.expected_key.get_fingerprint().hex()[:16]}"
                        f"...): nothing was sent to it. If the VM was recreated, remove its line from "
                        f"{self.ssh.known_hosts}; otherwise treat it as an impostor") from None
                except paramiko.AuthenticationException as e:
                    if self.ssh.os_login_project:
                        raise HostError(f"{where}: {oslogin.refused(self.ssh.user, self.ssh.os_login_project)}") \
                            from None
                    key = self.ssh.key or "your SSH agent / default keys"
                    raise HostError(
                        f"{where}: SSH refused user {self.ssh.user} with key {key} ({_one_line(e)}): the VM lets in "
                        f"only keys in its metadata (`tpuctl up` adds yours) or the project's; pass --ssh-user / "
                        f"--ssh-key for another identity") from None
                except (OSError, EOFError, socket.timeout, paramiko.SSHException) as e:
                    left = deadline - time.monotonic()
                    proxy = getattr(c, "proxy", None)
                    why = (proxy.problem() if proxy is not None else None) or _one_line(e)
                    if proxy is not None and proxy.problem() and (left <= 0 or proxy.fatal):
                        raise HostError(f"{where}: {why}") from None
                    if left <= 0:
                        raise HostError(f"{where}: unreachable over SSH as {self.ssh.user}@{c.host}:{c.port} after "
                                        f"{self.ssh.wait_s:.0f} s: {why}") from None
                    if say and i not in said:
                        said.add(i)
                        say(f"waiting for SSH on {where} ({why}); up to {self.ssh.wait_s:.0f} s")
                    try:
                        c.close()
                    except Exception:  # noqa: BLE001 - a half-open client: start afresh
                        pass
                    time.sleep(min(2.0, max(0.1, left)))

        errors = [e for e in self.each(one) if isinstance(e, Exception)]
        if errors:
            lines = [str(e) for e in errors]
            raise HostError("preflight: " + ("\n  ".join(lines) if len(lines) > 1 else lines[0]))

    def pin_published(self, say: Callable[[str], None] | None = None) -> None:
        """Fetch and pin the workers' published host keys now (waiting up to ssh.wait_s for them)."""
        if self.ssh.host_keys is not None and not self._pinned:
            self._pin_published(say, time.monotonic() + self.ssh.wait_s)

    def _pin_published(self, say: Callable[[str], None] | None, deadline: float) -> None:
        """Wait (until `deadline`) for every worker to publish its host keys, then pin exactly those; a worker
        that published nothing by then, or keys that cannot be read, fall back to first-contact pinning."""
        self._pinned = True
        src = self.ssh.host_keys
        tell = say or (lambda m: print(f"[tpuctl] {m}", file=sys.stderr, flush=True))
        waited = False
        while True:
            try:
                got = src.fetch()
            except hostkeys.Unreadable as e:
                tell(f"{src.slice}: {e}")
                return
            keys = {_slot(w): hostkeys.parse(got.get(_slot(w), [])) for w in self.workers}
            missing = [w for w in self.workers if not keys[_slot(w)]]
            # A worker whose key was pinned on first contact before (this slice's known_hosts file is this
            # incarnation's own: same VMs) is not waited for again: its pin is what a publication would give.
            pinned = self._first_contact_pins(missing)
            if not [w for w in missing if w not in pinned] or time.monotonic() >= deadline:
                break
            if not waited:
                waited = True
                tell(f"waiting for {', '.join(w.name for w in missing)} of {src.slice} to publish their SSH host "
                     f"keys (guest attributes {hostkeys.NAMESPACE}/); up to {self.ssh.wait_s:.0f} s")
            time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
        for i, w in enumerate(self.workers):
            if keys[_slot(w)]:
                self.published[_slot(w)] = keys[_slot(w)]
                if self.ssh.known_hosts:  # the interactive `ssh` and later commands trust the same keys
                    hostkeys.pin(self.ssh.known_hosts, hostkeys.host_id(w.address, w.port or self.ssh.port),
                                 keys[_slot(w)])
        missing = [w for w in missing if w not in pinned]
        if missing:
            tell(f"{src.slice}: {', '.join(f'{w.name} ({w.address})' for w in missing)} published no SSH host keys "
                 f"(guest attributes {hostkeys.NAMESPACE}/) within {self.ssh.wait_s:.0f} s: pinning "
                 f"{'its' if len(missing) == 1 else 'their'} key{'' if len(missing) == 1 else 's'} on first "
                 "contact instead")
        # Nothing was opened yet: the connections start afresh, trusting what was published.
        self.conns = [self._connect(w) for w in self.workers]

    def _first_contact_pins(self, workers: list[Worker]) -> list[Worker]:
        """The workers whose host key this slice's known_hosts file already holds."""
        if not workers or not self.ssh.known_hosts or not os.path.exists(self.ssh.known_hosts):
            return []
        known = paramiko.HostKeys(self.ssh.known_hosts)
        return [w for w in workers if known.lookup(hostkeys.host_id(w.address, w.port or self.ssh.port))]

    def _impostor(self, w: Worker, e: paramiko.BadHostKeyException) -> str:
        pub = self.published[_slot(w)]
        same = [k for k in pub if k.get_name() == e.key.get_name()]
        shown = ", ".join(f"{k.get_name()} {hostkeys.fingerprint(k)}" for k in (same or pub))
        return (f"slice {self.ssh.slice or '?'}: worker {w.index} ({w.name}, {w.address}) presented SSH host key "
                f"{e.key.get_name()} {hostkeys.fingerprint(e.key)}, but the VM published {shown} in its guest "
                f"attributes ({hostkeys.NAMESPACE}/): refused, nothing was sent to it. Something other than that "
                f"VM answers at {w.address}; do not trust it")

    def reopen(self, i: int) -> Connection:
        """A fresh connection to worker i in place of one that dropped (its proxy, if any, started anew). Raises
        what opening raises: the caller decides how long to keep trying."""
        try:
            self.conns[i].close()
        except Exception:  # noqa: BLE001 - a dead transport: nothing to close cleanly
            pass
        c = self._connect(self.workers[i])
        c.open()
        self.conns[i] = c
        return c

    def group(self, indices: list[int] | None = None) -> ThreadingGroup:
        conns = [self.conns[i] for i in (range(len(self.conns)) if indices is None else indices)]
        return ThreadingGroup.from_connections(conns)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.close()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- helpers
    def each(self, fn: Callable[[int, Connection], object], indices: list[int] | None = None) -> list:
        """fn(i, conn) on every (or the given) worker at once; results in worker order (exceptions kept)."""
        idx = list(range(len(self.conns))) if indices is None else list(indices)
        if not idx:
            return []

        def call(i):
            try:
                return fn(i, self.conns[i])
            except Exception as e:  # noqa: BLE001 - reported per host by the caller
                return e
        with ThreadPoolExecutor(max_workers=min(32, len(idx))) as ex:
            return list(ex.map(call, idx))

    def stream(self, command: str, indices: list[int] | None = None, out=None, prefix: bool = True,
               timeout: float | None = None) -> dict[int, int]:
        """Run a command on the workers at once, output line by line with a [wI] prefix; {index: exit}."""
        out = out or sys.stdout
        lock = threading.Lock()

        def one(i: int, c: Connection) -> int:
            w = _Lines(out, lock, f"[{self.workers[i].name}] " if prefix else "")
            try:
                rc = c.run(command, out_stream=w, err_stream=w, hide=False, warn=True, timeout=timeout).exited
            except Exception as e:  # noqa: BLE001 - that host failed; the others go on
                w.write(f"tpuctl: {_one_line(e)}\n")
                rc = 255
            w.close()
            return rc
        idx = list(range(len(self.conns))) if indices is None else list(indices)
        return dict(zip(idx, self.each(one, idx)))

    # ---------------------------------------------------------------- preflight
    def preflight(self, *, kill_stale: bool = False, bundle: Bundle | None = None,
                  say: Callable[[str], None] | None = None, coordinator: str | None = None) -> list[Probe]:
        """Probe every host in parallel. Raises HostError naming each host's problem (and the PID).

        coordinator: IP:PORT where worker 0 will serve jax.distributed; preflight checks it is free."""
        self.wait_reachable(say)
        src = PROBE_SOURCE.read_text() + "\n" + (HOST_DIR / "hostprobe.py").read_text()
        args = ["--root", self.layout.root]
        if bundle is not None:
            args += ["--app-hash", bundle.short, "--deps-key", bundle.deps_hash[:16]]
        if self.layout.deps_root:
            args += ["--deps-root", self.layout.deps_root]
        for name in self.helpers.values():
            args += ["--wrap", name]
        if kill_stale:
            args.append("--kill-stale")
        cmd = "cd && python3 -c " + shlex.quote(src) + " " + " ".join(shlex.quote(a) for a in args)

        def probe(i: int, c: Connection) -> Probe:
            p = Probe(worker=self.workers[i])
            t0 = time.time()
            check = coordinator and i == 0  # process 0 (workers are in process order)
            try:
                r = c.run(cmd + (f" --coordinator {shlex.quote(coordinator)}" if check else ""), timeout=60)
            except Exception as e:  # noqa: BLE001
                p.error = f"unreachable over SSH as {self.ssh.user}@{c.host}:{c.port}: {_one_line(e)}"
                return p
            t1 = time.time()
            line = next((l for l in r.stdout.splitlines() if l.startswith("TPUCTL_PROBE ")), None)
            if r.exited != 0 or line is None:
                err = (r.stderr.strip().splitlines() or ["no output"])[-1]
                p.error = ("python3 not found on the host" if r.exited == 127 else f"preflight failed: {err}")
                return p
            try:
                d = json.loads(line[len("TPUCTL_PROBE "):])
                p.hostname, p.python, p.free_gb = d["hostname"], d["python"], d["free_gb"]
                p.skew_s = d["time"] - (t0 + t1) / 2  # against the midpoint of the round trip
                p.flavour, p.stale, p.cleared = d["flavour"], d["stale"], d["cleared"]
                p.deps_key, p.have_deps, p.have_app = d["deps_key"], d["have_deps"], d["have_app"]
                p.have_files = d["have_files"]
            except (ValueError, KeyError, TypeError) as e:  # not the probe this tpuctl pushed: say so, never crash
                p.error = f"preflight answered in an unknown form ({type(e).__name__}: {e}): {line[:200]}"
                return p
            p.coordinator, p.coordinator_taken = (coordinator or "") if check else "", d.get("coordinator_taken")
            return p

        probes = self.each(probe)
        going: dict[str, str] = {}
        on: dict[str, list[int]] = {}
        what: dict[str, str] = {}
        for i, p in enumerate(probes):
            for st in p.stale:
                if st["kind"] == "trainer" and st.get("run_id"):
                    going[st["run_id"]] = st.get("tag") or ""
                    on.setdefault(st["run_id"], []).append(i)
                    what.setdefault(st["run_id"], f"PID {st.get('pid')} ({st.get('cmd', '')[:80]})")
        if going and not kill_stale:
            where = "; ".join(f"run {r} on {', '.join(self.workers[i].name for i in ix)}: {what[r]}"
                              for r, ix in on.items())
            raise RunGoing(f"a tpuctl run is still going on these hosts ({where})", going, on)
        problems = [line for p in probes for line in p.problems()]
        if problems:
            raise HostError("preflight: " + "\n  ".join(problems) if len(problems) > 1 else
                            "preflight: " + problems[0])
        return probes

    def ensure_helpers(self) -> None:
        """The host-side helpers (hostwrap) of this tpuctl on every host, for verbs that reach a run without a
        preflight (attach, cancel, the runs list): one `test -f` where they are there already."""
        lay = self.layout
        names = " ".join(_home_path(lay.bin(n)) for n in self.helpers.values())

        def put(i: int, c: Connection) -> None:
            if c.run(f"for f in {names}; do test -f $f || exit 1; done", warn=True).exited == 0:
                return
            c.run(f"mkdir -p {_home_path(lay.bin())}", warn=False)
            home = c.run("echo $HOME", warn=False).stdout.strip()
            for src, name in self.helpers.items():
                _put(c, HOST_DIR / src, f"{home}/{lay.bin(name)}")
        errors = {i: e for i, e in enumerate(self.each(put)) if isinstance(e, Exception)}
        if errors:
            raise HostError("; ".join(f"{self.workers[i].name}: {_one_line(e)}" for i, e in errors.items()))

    # ---------------------------------------------------------------- push
    def push(self, bundle: Bundle | None, probes: list[Probe], install: InstallOptions | None = None, *,
             out: Callable[[int, str], None] | None = None) -> dict[int, str]:
        """Upload and install the bundle where it is missing; {index: "cached" | bootstrap's summary}."""
        need = [i for i, p in enumerate(probes) if bundle is not None and not (p.have_app and p.have_deps)]
        files_missing = [i for i, p in enumerate(probes)
                         if set(self.helpers.values()) - set(p.have_files)]
        result = {i: "cached" for i in range(len(probes))}
        upload = sorted(set(need) | set(files_missing))
        if not upload:
            return result
        lay = self.layout
        if bundle is not None:
            remote_wheel = f"{lay.root}/bundles/{bundle.wheel.name}"
            remote_reqs = f"{lay.root}/bundles/requirements-{bundle.deps_hash[:16]}.txt"
            reqs_local = bundle.wheel.parent / f"requirements-{bundle.deps_hash[:16]}.txt"
        if bundle is not None and not reqs_local.exists():
            tmp = reqs_local.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(bundle.requirements_text())
            os.replace(tmp, reqs_local)

        def put(i: int, c: Connection) -> None:
            c.run(f"mkdir -p {_home_path(lay.root + '/bundles')} {_home_path(lay.bin())}", warn=False)
            home = c.run("echo $HOME", warn=False).stdout.strip()
            for src, name in self.helpers.items():
                if name not in probes[i].have_files:
                    _put(c, HOST_DIR / src, f"{home}/{lay.bin(name)}")
            if i in need:
                _put(c, bundle.wheel, f"{home}/{remote_wheel}")
                _put(c, reqs_local, f"{home}/{remote_reqs}")

        errors = {i: e for i, e in zip(upload, self.each(put, upload)) if isinstance(e, Exception)}
        if errors:
            raise HostError("push: " + "; ".join(f"{self.workers[i].name}: upload failed: {_one_line(e)}"
                                                 for i, e in errors.items()))
        if not need:
            return result

        def bootstrap(i: int, c: Connection) -> str:
            args = ["--root", lay.root, "--deps-key", probes[i].deps_key, "--reqs", remote_reqs,
                    "--app-hash", bundle.short, "--wheel", remote_wheel]
            opt = install or InstallOptions()
            for flag, value in (("--wheelhouse", opt.wheelhouse), ("--uv-cache", opt.uv_cache),
                                ("--python", opt.python)):
                if value:
                    args += [flag, value]
            if lay.deps_root:
                args += ["--deps-root", lay.deps_root]
            cmd = "cd && bash " + _home_path(lay.bin(self.helpers["bootstrap.sh"])) + " " + \
                " ".join(shlex.quote(a) for a in args) + " 2>&1"
            r = c.run(cmd, timeout=3600)
            lines = r.stdout.splitlines()
            if out:
                for line in lines:
                    if not line.startswith("TPUCTL_BOOTSTRAP"):
                        out(i, line)
            summary = next((l for l in lines if l.startswith("TPUCTL_BOOTSTRAP ")), None)
            if r.exited != 0 or summary is None:
                # bootstrap.sh's own error line names the host and the step; the lines before it say why.
                err = next((l for l in reversed(lines) if l.startswith("error: ")), None)
                tail = " | ".join(l for l in lines[-6:] if l != err and l.strip()) or "no output"
                raise HostError(f"bootstrap failed (exit {r.exited}): {err + '; ' if err else ''}last lines: {tail}")
            return summary[len("TPUCTL_BOOTSTRAP "):]

        for i, r in zip(need, self.each(bootstrap, need)):
            if isinstance(r, Exception):
                errors[i] = r
            else:
                result[i] = r
        if errors:
            raise HostError("push: " + "; ".join(f"{self.workers[i].name} ({self.workers[i].address}): "
                                                 f"{_one_line(e)}" for i, e in errors.items()))
        return result

    # ---------------------------------------------------------------- secrets and stop
    def upload_secrets(self, command: str, payload: str, indices: list[int] | None = None) -> None:
        """Pipe the payload into `command`'s stdin on each host (never argv, never echoed)."""
        def send(i: int, c: Connection):
            r = c.run(command, in_stream=io.StringIO(payload), echo_stdin=False, hide=True, warn=True)
            if r.exited != 0:
                raise HostError(f"could not write the secrets file (exit {r.exited})")
        errors = [(i, e) for i, e in zip(indices or range(len(self.conns)), self.each(send, indices))
                  if isinstance(e, Exception)]
        if errors:
            raise HostError("secrets: " + "; ".join(f"{self.workers[i].name}: {_one_line(e)}" for i, e in errors))

    def stop(self, command: str, indices: list[int] | None = None, timeout: float = 30) -> dict:
        """Run the stop command on fresh connections (the run's own are busy streaming)."""
        idx = list(range(len(self.conns))) if indices is None else list(indices)

        def stop_one(i: int, _c: Connection):
            c = self._connect(self.workers[i])
            try:
                return c.run(command, timeout=timeout)
            finally:
                c.close()
        return dict(zip(idx, self.each(stop_one, idx)))


class _Lines:
    """invoke out_stream: whole lines, prefixed, written under a lock shared by all hosts."""

    def __init__(self, out, lock: threading.Lock, tag: str):
        self.out, self.lock, self.tag, self.buf = out, lock, tag, ""

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        if lines:
            with self.lock:
                self.out.writelines(self.tag + line + "\n" for line in lines)
                self.out.flush()
        return len(s)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.buf:
            self.write("\n")


def _put(c: Connection, local: Path, remote: str) -> None:
    """Upload to a temp name, then rename: a half-written file never carries the final name."""
    tmp = f"{remote}.part{os.getpid()}-{threading.get_ident()}"
    c.put(str(local), tmp)
    sftp = c.sftp()
    try:
        sftp.posix_rename(tmp, remote)
    except OSError:
        sftp.remove(remote)
        sftp.rename(tmp, remote)


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    text = s[-1] if s else type(e).__name__
    if hasattr(e, "result") and getattr(e.result, "stderr", ""):
        text = e.result.stderr.strip().splitlines()[-1]
    return f"{type(e).__name__}: {text}" if text and type(e).__name__ not in text else text
