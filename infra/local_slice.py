"""A local slice: N "hosts" that are N real sshd processes on loopback addresses.

Each host runs `sshd -D` inside its own UTS, mount and PID namespaces (root only), so it has its own
hostname, its own $HOME (mounted over /root), its own /tmp (where libtpu puts its lockfile), an /etc/hosts
in which its hostname resolves to its own loopback IP (gloo advertises that address), and a process tree
that dies as a whole when the namespace's init (sshd) is killed. Paths that the private home or /tmp would
hide and the hosts still need (the Python interpreter, the slice's shared dir) are bind-mounted back.

A record (`<base_dir>/<name>/slice.json`, base_dir default $TPUCTL_HOME/local/slices) lets another process (`tpuctl down`) find and stop the slice.

    python -m infra.local_slice start NAME --hosts 2     |  stop NAME  |  ls
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,40}$")
# The hosts of every local slice share this machine's network, so a trainer's jax.profiler server cannot be on
# 9999 + its process id (trainer.common.profiling.PROFILER_PORT) there: two slices at once would collide, and
# `tpuctl profile` could trace another slice's trainer. Every session on a slice's host has TPUCTL_PROFILER_PORT
# = PROFILER_PORTS + 64 x B (sshd's SetEnv, whoever starts the trainer), B the slice's loopback block 127.0.B.x,
# which no other running slice holds (its sshd listens there); + the process id, below the kernel's ephemeral
# ports (from 32768) up to block 198.
PROFILER_PORTS = 20000


def tpuctl_home() -> Path:
    return Path(os.environ.get("TPUCTL_HOME") or Path.home() / ".tpuctl")


def machine_dir() -> Path:
    """Where local mode's "cloud" keeps its records on this machine (stand-ins, hosts, the GCS emulator):
    TPUCTL_LOCAL_DIR, else $TPUCTL_HOME/local. A managed job's controller host has its own TPUCTL_HOME and is
    given the machine's dir here, as a real controller reaches the same cloud as the laptop."""
    d = os.environ.get("TPUCTL_LOCAL_DIR")
    return Path(d) if d else tpuctl_home() / "local"


def default_base_dir() -> Path:
    return machine_dir() / "slices"


class LocalSliceError(RuntimeError):
    """One clear line about what is wrong with a local slice."""


@dataclass
class LocalHost:
    index: int
    ip: str
    port: int
    hostname: str
    home: str             # the host's $HOME as seen from the machine (it is /root inside the host)
    unshare_pid: int = 0  # the `unshare` process (its --kill-child takes the namespace down with it)
    init_pid: int = 0     # sshd, PID 1 of the host's PID namespace, as seen from the machine
    pidns: str = ""       # "pid:[inode]" of the host's PID namespace, to find strays

    @property
    def internal_ip(self) -> str:
        return self.ip

    @property
    def profiler_port(self) -> int:
        """TPUCTL_PROFILER_PORT in this host's sessions: its slice's own base (PROFILER_PORTS)."""
        return profiler_port(self.ip)


@dataclass
class LocalSlice:
    name: str
    base_dir: str
    hosts: list[LocalHost]
    ssh_key: str
    ssh_user: str = "root"
    shared_dir: str = ""   # visible at the same path on every host and on the machine
    python: str = ""       # an interpreter every host can run (the one this machine uses)
    wheelhouse: str = ""   # the machine's wheelhouse (+ uv cache), visible on every host at the same path
    created: float = 0.0
    fresh: bool = False    # shaped like fresh TPU VMs: no wheelhouse, no uv, only the system's python3

    # ---------------------------------------------------------------- paths and record
    @property
    def dir(self) -> Path:
        return Path(self.base_dir) / self.name

    @staticmethod
    def _record_path(name: str, base_dir: str | os.PathLike) -> Path:
        return Path(base_dir) / name / "slice.json"

    def _write_record(self) -> None:
        path = self._record_path(self.name, self.base_dir)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)  # atomic: a reader never sees half a record

    @classmethod
    def load(cls, name: str, base_dir: str | os.PathLike | None = None) -> "LocalSlice | None":
        """The recorded slice NAME (alive or not), or None if there is no record."""
        base_dir = Path(base_dir or default_base_dir())
        path = cls._record_path(name, base_dir)
        try:
            d = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        d["hosts"] = [LocalHost(**h) for h in d["hosts"]]
        return cls(**d)

    @classmethod
    def ls(cls, base_dir: str | os.PathLike | None = None) -> list["LocalSlice"]:
        base_dir = Path(base_dir or default_base_dir())
        out = []
        for rec in sorted(base_dir.glob("*/slice.json")):
            s = cls.load(rec.parent.name, base_dir)
            if s is not None:
                out.append(s)
        return out

    def host_keys(self, i: int) -> list[str]:
        """Host i's sshd host public keys ("TYPE BASE64" each), what a VM's guest agent publishes."""
        etc = self.dir / f"w{i}" / "etc"
        return [" ".join(p.read_text().split()[:2]) for p in sorted(etc.glob("ssh_host_*_key.pub"))]

    def alive(self) -> list[bool]:
        return [_pid_in_ns(h.init_pid, h.pidns) for h in self.hosts]

    def answering(self, timeout: float = 2.0) -> bool:
        """Every host's sshd accepts a connection: what a process in another host's PID namespace (a managed
        job's controller) can check, where the hosts' processes are not visible."""
        for h in self.hosts:
            try:
                socket.create_connection((h.ip, h.port), timeout=timeout).close()
            except OSError:
                return False
        return True

    # ---------------------------------------------------------------- start
    @classmethod
    def start(cls, name: str, n_hosts: int, base_dir: str | os.PathLike | None = None, *,
              port: int = 2222, first_ip: str | None = None, keep: tuple[str, ...] = (),
              wheelhouse: str | os.PathLike | None = None, timeout: float = 15.0,
              fresh: bool = False, authorized_keys: tuple[str, ...] = ()) -> "LocalSlice":
        """Start (or return the already running) local slice NAME with n_hosts hosts.

        keep: extra paths under /root or /tmp that the hosts must still see at the same path.
        wheelhouse: the machine's shared wheelhouse (default $TPUCTL_HOME/wheelhouse), kept visible.
        fresh: hosts as a new TPU VM has them: the private home hides this machine's interpreter, uv and
        wheelhouse, so a run bootstraps each host from the package index (the system's python3 and its pip
        configuration are what the hosts see, as an image's own would be).
        authorized_keys: more public keys root accepts ("TYPE BASE64"), as a VM's metadata ssh-keys give them.
        """
        if not NAME_RE.match(name):
            raise LocalSliceError(f"invalid local slice name {name!r}: use lowercase letters, digits and '-', "
                                  "starting with a letter")
        if n_hosts < 1:
            raise LocalSliceError(f"a local slice needs at least 1 host, got {n_hosts}")
        if os.geteuid() != 0:
            raise LocalSliceError("the local slice needs root (it uses namespaces and binds loopback sshd); "
                                  "run as root or inside a container")
        if not os.access(SSHD, os.X_OK):
            raise LocalSliceError(f"{SSHD} not found: install openssh-server (`make sys-deps`)")
        base_dir = Path(base_dir or default_base_dir()).resolve()
        existing = cls.load(name, base_dir)
        if existing is not None:
            if all(existing.alive()) and len(existing.hosts) == n_hosts and existing.fresh == fresh:
                return existing  # idempotent
            if all(existing.alive()):
                shape = f"{len(existing.hosts)} {'fresh ' if existing.fresh else ''}hosts"
                raise LocalSliceError(f"local slice {name!r} is running with {shape}, not {n_hosts}"
                                      f"{' fresh' if fresh else ''}: stop it first "
                                      f"(python -m infra.local_slice stop {name})")
            existing.stop()  # stale record: clean whatever is left, then start afresh

        for attempt in range(3):
            try:
                return cls._start_once(name, n_hosts, base_dir, port, first_ip, keep, wheelhouse, timeout, fresh,
                                       authorized_keys)
            except LocalSliceError as e:
                # Another process took an address between our check and sshd's bind: next block.
                if first_ip or attempt == 2 or "Address already in use" not in str(e):
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, name, n_hosts, base_dir, port, first_ip, keep, wheelhouse, timeout,
                    fresh, authorized_keys=()) -> "LocalSlice":
        sdir = base_dir / name
        sdir.mkdir(parents=True, exist_ok=True)
        shared = sdir / "shared"
        shared.mkdir(exist_ok=True)
        key = sdir / "client_key"
        if not key.exists():
            _keygen(key)
        ips = _pick_ips(n_hosts, port, first_ip, base_dir, name)
        hostnames = [f"{name}-w{i}" for i in range(n_hosts)]
        # The interpreter's installation (e.g. /root/.pyenv/...) must survive the private home.
        py_prefix = os.path.realpath(sys.base_prefix)
        wh = Path(wheelhouse or tpuctl_home() / "wheelhouse").resolve()
        if fresh:  # nothing of this machine's Python set-up: what the hosts see is the system image
            s = cls(name=name, base_dir=str(base_dir), hosts=[], ssh_key=str(key), shared_dir=str(shared),
                    created=time.time(), fresh=True)
        else:
            wh.mkdir(parents=True, exist_ok=True)
            s = cls(name=name, base_dir=str(base_dir), hosts=[], ssh_key=str(key), shared_dir=str(shared),
                    python=_base_python(), wheelhouse=str(wh), created=time.time())
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        try:
            for i, ip in enumerate(ips):
                hdir = sdir / f"w{i}"
                host = LocalHost(index=i, ip=ip, port=port, hostname=hostnames[i], home=str(hdir / "home"))
                _prepare_host(hdir, host, key, ips, hostnames, authorized_keys)
                if not fresh:
                    _share_compile_cache(Path(host.home), wh)
                keeps = [str(shared), str(hdir / "etc"), *keep] + ([] if fresh else [py_prefix, str(wh)])
                proc = subprocess.Popen(
                    ["unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child",
                     "sh", "-c", _host_script(hdir, host, keeps)],
                    stdin=subprocess.DEVNULL, stdout=open(hdir / "host.log", "ab"), stderr=subprocess.STDOUT,
                    start_new_session=True)
                host.unshare_pid = proc.pid
                s.hosts.append(host)
                s._write_record()  # each host recorded as it starts: a killed `start` leaves nothing unnamed
            for h in s.hosts:
                h.init_pid, h.pidns = _ns_child(h.unshare_pid, timeout)
            s._write_record()
            deadline = time.monotonic() + timeout
            for h in s.hosts:
                _wait_ssh(h, deadline, sdir / f"w{h.index}")
        except BaseException:
            s.stop()
            raise
        return s

    # ---------------------------------------------------------------- stop
    def stop(self) -> None:
        """Kill every host's namespace (sshd and everything started under it) and remove the record."""
        # Its members are listed while the namespace is still this host's: once it is gone, its id may name a
        # newer host's namespace (another slice's, started meanwhile), whose processes are not ours to kill.
        members = {h.index: ns_members(h.pidns, h.init_pid) for h in self.hosts}
        for h in self.hosts:
            if _pid_in_ns(h.init_pid, h.pidns):
                _kill(h.init_pid, signal.SIGKILL)
            if _is_ours(h.unshare_pid, str(self.dir / f"w{h.index}")):  # a stale record's pid may be reused
                _kill(h.unshare_pid, signal.SIGKILL)
            else:
                h.unshare_pid = 0
        deadline = time.monotonic() + 10
        for h in self.hosts:
            # Killing PID 1 of a PID namespace kills all of it; make sure, then reap unshare.
            while time.monotonic() < deadline:
                strays = [pid for pid in members[h.index] if _pid_in_ns(pid, h.pidns)]
                if not strays:
                    break
                for pid in strays:
                    _kill(pid, signal.SIGKILL)
                time.sleep(0.05)
            _reap(h.unshare_pid)
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    def stop_by_name(cls, name: str, base_dir: str | os.PathLike | None = None) -> bool:
        """Stop slice NAME from any process: its recorded hosts, and any host process its folder's paths name
        (a `start` killed before it recorded them). False if there was nothing to stop."""
        d = Path(base_dir or default_base_dir()) / name
        s = cls.load(name, base_dir)
        if s is not None:
            s.stop()
        strays = _unshares_under(d)
        for pid in strays:
            _kill(pid, signal.SIGKILL)  # --kill-child: the host's namespace goes with it
        for pid in strays:
            _reap(pid)
        found = s is not None or bool(strays)
        shutil.rmtree(d, ignore_errors=True)
        return found

    @classmethod
    def names(cls, base_dir: str | os.PathLike | None = None) -> list[str]:
        """Every slice with a folder here, recorded or not (a killed `start` may leave one without a record)."""
        base = Path(base_dir or default_base_dir())
        return sorted(p.name for p in base.iterdir() if p.is_dir() and NAME_RE.match(p.name)) if base.is_dir() else []


# -------------------------------------------------------------------- helpers
def _base_python() -> str:
    """The real interpreter (not the venv's symlink) of the Python this runs on."""
    exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(exe.resolve()) if exe.exists() else os.path.realpath(sys.executable)


def _keygen(path: Path) -> None:
    tmp = path.with_name(path.name + ".new")
    for p in (tmp, tmp.with_suffix(".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tpuctl-local", "-f", str(tmp)],
                   check=True, stdin=subprocess.DEVNULL)
    os.replace(tmp.with_name(tmp.name + ".pub"), path.with_name(path.name + ".pub"))
    os.replace(tmp, path)


def _used_blocks(base_dir: Path, name: str) -> set[str]:
    used = set()
    for rec in base_dir.glob("*/slice.json"):
        if rec.parent.name == name:
            continue
        try:
            d = json.loads(rec.read_text())
            used.update(h["ip"].rsplit(".", 1)[0] for h in d["hosts"])
        except (OSError, json.JSONDecodeError, KeyError):
            pass
    return used


def _can_bind(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False


def _pick_ips(n: int, port: int, first_ip: str | None, base_dir: Path, name: str) -> list[str]:
    """127.0.B.1..n for the first block B >= 10 that no other slice uses and whose ports are free."""
    if first_ip:
        a, b, c, d = (int(x) for x in first_ip.split("."))
        ips = [f"{a}.{b}.{c}.{d + i}" for i in range(n)]
        busy = [ip for ip in ips if not _can_bind(ip, port)]
        if busy:
            raise LocalSliceError(f"port {port} is already in use on {', '.join(busy)}: pick another --first-ip")
        return ips
    if n > 250:
        raise LocalSliceError(f"at most 250 hosts in a local slice, got {n}")
    used = _used_blocks(base_dir, name)
    for b in range(10, 250):
        block = f"127.0.{b}"
        ips = [f"{block}.{i + 1}" for i in range(n)]
        if block not in used and all(_can_bind(ip, port) for ip in ips):
            return ips
    raise LocalSliceError(f"no free block of {n} loopback addresses with port {port} free")


def profiler_port(ip: str) -> int:
    """The profiler servers' base port of the hosts at loopback address 127.0.B.x (PROFILER_PORTS)."""
    return PROFILER_PORTS + 64 * int(ip.split(".")[2])


def _prepare_host(hdir: Path, host: LocalHost, key: Path, ips: list[str], hostnames: list[str],
                  authorized_keys: tuple[str, ...] = ()) -> None:
    etc = hdir / "etc"
    for d in (etc, hdir / "home" / ".ssh", hdir / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(hdir / "tmp", 0o1777)
    hk = etc / "ssh_host_ed25519_key"
    if not hk.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hk)], check=True,
                       stdin=subprocess.DEVNULL)
    auth = hdir / "home" / ".ssh" / "authorized_keys"
    auth.write_text(key.with_name(key.name + ".pub").read_text().strip() + "\n" +
                    "".join(f"{k}\n" for k in authorized_keys))
    os.chmod(auth, 0o600)
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
    lines += [f"{ip} {hn}" for ip, hn in zip(ips, hostnames)]
    (etc / "hosts").write_text("\n".join(lines) + "\n")
    (etc / "hostname").write_text(host.hostname + "\n")
    (etc / "sshd_config").write_text(f"""\
ListenAddress {host.ip}:{host.port}
HostKey {hk}
PidFile none
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 200:30:400
MaxSessions 100
ClientAliveInterval 15
LogLevel ERROR
Subsystem sftp internal-sftp
SetEnv TPUCTL_PROFILER_PORT={host.profiler_port}
""")


def _share_compile_cache(home: Path, wheelhouse: Path) -> None:
    """The trainer's XLA compile cache on this host (its default, ~/.cache/tpuctl/jax) is the machine's one,
    under the wheelhouse as the dependency layers are: hosts that share a machine compile a program once, and a
    slice started again (recreated after a preemption, the next test or demo) reads what the last one wrote."""
    cache = wheelhouse / "xla-cache"
    cache.mkdir(parents=True, exist_ok=True)
    link = home / ".cache" / "tpuctl" / "jax"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() or link.exists()):  # a host restarted from an older record keeps its own
        link.symlink_to(cache, target_is_directory=True)


def _host_script(hdir: Path, host: LocalHost, keeps: list[str]) -> str:
    """Runs as PID 1 of the host's fresh namespaces: set hostname and mounts, then become sshd."""
    q = shlex.quote
    cmds = ["set -e", "mount --make-rprivate /", f"hostname {q(host.hostname)}"]
    private = {"/root": hdir / "home", "/tmp": hdir / "tmp"}
    for keep in keeps:
        keep = os.path.realpath(keep)
        for mnt, src in private.items():
            if keep == mnt or keep.startswith(mnt + "/"):
                target = src / os.path.relpath(keep, mnt)
                cmds.append(f"mkdir -p {q(str(target))} && mount --bind {q(keep)} {q(str(target))}")
    # The mount point that holds the host's own dir goes last: mounted first, it would hide the other's
    # source (with the default $TPUCTL_HOME=~/.tpuctl, /root over /root/.tpuctl/.../tmp).
    here = os.path.realpath(hdir)
    for mnt, src in sorted(private.items(), key=lambda kv: here == kv[0] or here.startswith(kv[0] + "/")):
        cmds.append(f"mount --rbind {q(str(src))} {mnt}")
    etc = hdir / "etc"
    cmds.append(f"mount --bind {q(str(etc / 'hosts'))} /etc/hosts")
    cmds.append(f"mount --bind {q(str(etc / 'hostname'))} /etc/hostname")
    cmds.append(f"exec {SSHD} -D -e -f {q(str(etc / 'sshd_config'))}")
    return "\n".join(cmds)


def _ns_child(unshare_pid: int, timeout: float) -> tuple[int, str]:
    """The outer PID and PID-namespace id of the process `unshare --fork` started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        except FileNotFoundError:
            raise LocalSliceError(f"a local host exited at once (unshare pid {unshare_pid}); see its host.log")
        if kids:
            pid = int(kids[0])
            try:
                ns = os.readlink(f"/proc/{pid}/ns/pid")
            except FileNotFoundError:
                continue
            if ns != os.readlink("/proc/self/ns/pid"):
                return pid, ns
        time.sleep(0.01)
    raise LocalSliceError(f"a local host did not start within {timeout:.0f} s (unshare pid {unshare_pid})")


def _wait_ssh(h: LocalHost, deadline: float, hdir: Path) -> None:
    while time.monotonic() < deadline:
        if not _pid_in_ns(h.init_pid, h.pidns):
            log = (hdir / "host.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise LocalSliceError(f"sshd of local host w{h.index} ({h.ip}:{h.port}) exited: {' | '.join(log)}")
        if _listens(h.init_pid, h.ip, h.port):  # this sshd's own socket, not another slice's on that address
            try:
                with socket.create_connection((h.ip, h.port), timeout=1) as s:
                    s.settimeout(2)
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                pass
        time.sleep(0.02)
    raise LocalSliceError(f"sshd of local host w{h.index} ({h.ip}:{h.port}) is not answering")


def _listens(pid: int, ip: str, port: int) -> bool:
    """True if process pid holds the listening TCP socket on ip:port."""
    want = "%08X:%04X" % (int.from_bytes(socket.inet_aton(ip), "little"), port)
    inodes = set()
    try:
        for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if f[1] == want and f[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            pass
    return False


def _pid_in_ns(pid: int, pidns: str) -> bool:
    """True if pid is alive and still the process we recorded (same PID namespace): pids get reused."""
    if not pid:
        return False
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == pidns and _state(pid) != "Z"
    except OSError:
        return False


def _is_ours(pid: int, hdir: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(pid) and cmd[:1] == [b"unshare"] and any(hdir.encode() + b"/" in c for c in cmd)


def _unshares_under(d: Path) -> list[int]:
    """The `unshare` processes (hosts) whose command names a path under d."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and _is_ours(int(p.name), str(d)):
            out.append(int(p.name))
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def ns_members(pidns: str, init_pid: int) -> list[int]:
    """The live processes of a host's PID namespace, its init (sshd) included, while that init lives. A namespace
    id ("pid:[inode]") is reused once the namespace is gone, and it is gone with its init: the kernel kills every
    other member then. So with the init gone, nothing of this host is left, whatever now shows the same id."""
    if not pidns or not _pid_in_ns(init_pid, pidns):
        return []
    return _pids_in_ns(pidns)


def _pids_in_ns(pidns: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "ns" / "pid") == pidns and _state(int(p.name)) != "Z":
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int) -> None:
    """Wait for (or give up on) a process we started; a stale record's pid may not be our child."""
    if not pid:
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:  # not our child: just wait until it is gone
            if not Path(f"/proc/{pid}").exists() or _state(pid) == "Z":
                return
        time.sleep(0.02)
    _kill(pid, signal.SIGKILL)


# -------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.local_slice", description=__doc__.split("\n")[0])
    ap.add_argument("--base-dir", default=None, help="where records live (default $TPUCTL_HOME/local/slices)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start")
    st.add_argument("name")
    st.add_argument("--hosts", type=int, default=2)
    st.add_argument("--port", type=int, default=2222)
    st.add_argument("--fresh", action="store_true", help="hosts shaped like fresh TPU VMs (no uv, no wheelhouse)")
    st.add_argument("--first-ip", default=None)
    sp = sub.add_parser("stop")
    sp.add_argument("name")
    sub.add_parser("ls")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "start":
            s = LocalSlice.start(a.name, a.hosts, a.base_dir, port=a.port, first_ip=a.first_ip, fresh=a.fresh)
            for h in s.hosts:
                print(f"w{h.index}  {h.hostname}  {h.ip}:{h.port}  home={h.home}")
            print(f"ssh -i {s.ssh_key} -p {s.hosts[0].port} {s.ssh_user}@{s.hosts[0].ip}")
        elif a.cmd == "stop":
            print(f"stopped {a.name}" if LocalSlice.stop_by_name(a.name, a.base_dir) else f"no local slice {a.name!r}")
        else:
            for s in LocalSlice.ls(a.base_dir):
                up = s.alive()
                print(f"{s.name}  {sum(up)}/{len(up)} hosts up  " + " ".join(h.ip for h in s.hosts))
    except LocalSliceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
