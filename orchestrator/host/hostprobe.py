"""Preflight probe, run on every host over SSH with the host's own python3 (stdlib only, Python >= 3.8).

Reports one JSON line (after the marker TPUCTL_PROBE): hostname, Python, free disk, the clock, which
layers of the bundle are installed, and whatever holds the accelerator: processes with /dev/accel*,
/dev/vfio/* or the libtpu lockfile open, a lockfile nobody holds, and a tpuctl trainer still running
from an earlier run (recorded by hostwrap's pidfile). With --kill-stale it clears them first.

With --coordinator IP:PORT (worker 0 only) it also reports whoever already listens where the jax.distributed
coordinator will bind.

usage: python3 hostprobe.py --root DIR [--app-hash H] [--deps-key K] [--wrap NAME ...] [--kill-stale]
                            [--coordinator IP:PORT]
"""
import argparse
import errno
import glob
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import time

LOCKFILE = "/tmp/libtpu_lockfile"

# The accelerator probe is the trainer's own (trainer/common/accelerators.py): the orchestrator sends its source
# ahead of this file's (orchestrator/access/hosts.py), so on a host tpu_nodes is already defined here; run from
# the repository, it is imported.
if "tpu_nodes" not in globals():
    from trainer.common.accelerators import tpu_nodes


def device_paths():
    return tpu_nodes()


def holders(paths, raw=False):
    """{path: [pid, ...]} for the open file descriptors of every process we can inspect. raw: the paths are
    link targets as /proc shows them (e.g. "socket:[123]"), not files to resolve."""
    want = {p if raw else os.path.realpath(p): p for p in paths}
    out = {}
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            if target in want:
                out.setdefault(want[target], [])
                if int(pid) not in out[want[target]]:
                    out[want[target]].append(int(pid))
    return out


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def pgid_members(pgid):
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
    return out


def find_stale(root):
    stale = []
    paths = device_paths() + ([LOCKFILE] if os.path.exists(LOCKFILE) else [])
    held = holders(paths)
    for path in paths:
        for pid in held.get(path, []):
            stale.append({"kind": "device", "path": path, "pid": pid, "cmd": cmdline(pid)})
    if os.path.exists(LOCKFILE) and not held.get(LOCKFILE):
        stale.append({"kind": "lockfile", "path": LOCKFILE, "pid": None, "cmd": ""})
    for pidfile in glob.glob(os.path.join(root, "run", "*.pid")):
        try:
            with open(pidfile) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        members = pgid_members(int(rec.get("pgid", 0))) if rec.get("pgid") else []
        wrapper = rec.get("wrapper_pid")
        if wrapper and alive(wrapper) and wrapper not in members:
            members.append(wrapper)
        if members:
            stale.append({"kind": "trainer", "path": pidfile, "pid": rec.get("pgid") or wrapper,
                          "pgid": rec.get("pgid"), "wrapper": wrapper, "run_id": rec.get("run_id"),
                          "tag": rec.get("tag", ""), "cmd": cmdline(members[0])})
        else:
            os.unlink(pidfile)  # a record of a run that is gone: not a problem, just litter
    return stale


def _kill(pid, sig, group=False):
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # someone else's process on a real VM: try sudo
        subprocess.call(["sudo", "-n", "kill", "-%d" % sig, ("-%d" % pid) if group else str(pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_gone(targets, seconds):
    """Until no (pid, is_group) target has a live process, at most `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline and any((pgid_members(p) if g else alive(p)) for p, g in targets):
        time.sleep(0.05)


def kill_stale(stale, grace=3.0):
    targets = []
    for s in stale:
        if s["kind"] == "trainer" and s.get("pgid"):
            targets.append((s["pgid"], True))
            if s.get("wrapper"):  # its keeper, outside the group: it stops the group too, and records the end
                targets.append((s["wrapper"], False))
        elif s.get("pid"):
            targets.append((s["pid"], False))
    for pid, group in targets:
        _kill(pid, signal.SIGTERM, group)
    _wait_gone(targets, grace)
    for pid, group in targets:
        _kill(pid, signal.SIGKILL, group)
    # SIGKILL is delivered asynchronously: wait until they are gone (a dying trainer can still hold the TPU's
    # device files the next run opens)
    _wait_gone(targets, 5.0)
    for s in stale:
        if s["kind"] in ("lockfile", "device") and s["path"] == LOCKFILE and os.path.exists(LOCKFILE):
            try:
                os.unlink(LOCKFILE)
            except PermissionError:
                subprocess.call(["sudo", "-n", "rm", "-f", LOCKFILE])
            except FileNotFoundError:
                pass
        if s["kind"] == "trainer" and os.path.exists(s["path"]):
            os.unlink(s["path"])


def port_holder(ip, port):
    """None when ip:port can be bound now (the coordinator can start there); else who listens on it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((ip, port))
        return None
    except OSError as e:
        if e.errno != errno.EADDRINUSE:  # not this host's address, say: nothing to report here
            return None
    finally:
        s.close()
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                        inodes.add("socket:[%s]" % cols[9])
        except (OSError, IndexError, ValueError):
            pass
    for pids in holders(inodes, raw=True).values():
        return {"pid": pids[0], "cmd": cmdline(pids[0])}
    return {"pid": None, "cmd": ""}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--app-hash", default="")
    ap.add_argument("--deps-key", default="")
    ap.add_argument("--deps-root", default="")
    ap.add_argument("--wrap", action="append", default=[])
    ap.add_argument("--kill-stale", action="store_true")
    ap.add_argument("--coordinator", default="", help="IP:PORT the jax.distributed coordinator will bind here")
    a = ap.parse_args()
    root = os.path.expanduser(a.root)
    os.makedirs(os.path.join(root, "run"), exist_ok=True)
    stale = find_stale(root)
    cleared = []
    if stale and a.kill_stale:
        kill_stale(stale)
        cleared, stale = stale, find_stale(root)
    disk = shutil.disk_usage(root)
    flavour = "tpu" if device_paths() else "cpu"
    key = "%s-%s" % (a.deps_key, flavour) if a.deps_key else ""
    print("TPUCTL_PROBE " + json.dumps({
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "free_gb": round(disk.free / 2**30, 2),
        "time": time.time(),
        "flavour": flavour,
        "stale": stale,
        "cleared": cleared,
        "deps_key": key,
        "have_deps": bool(key) and os.path.exists(os.path.join(
            os.path.expanduser(a.deps_root) if a.deps_root else os.path.join(root, "deps"), key, ".complete")),
        "have_app": bool(a.app_hash) and os.path.exists(os.path.join(root, "app", a.app_hash, ".complete")),
        "have_files": [w for w in a.wrap if os.path.exists(os.path.join(root, "bin", w))],
        "coordinator_taken": port_holder(a.coordinator.rsplit(":", 1)[0], int(a.coordinator.rsplit(":", 1)[1]))
        if a.coordinator else None,
    }))


if __name__ == "__main__":
    main()
