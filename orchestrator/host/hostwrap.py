"""The wrapper every trainer runs under on a host (stdlib only, Python >= 3.8).

run:  loads the run's secrets from a 0600 file (written from stdin, deleted as soon as it is read) into
      the child's environment, starts the command in its own process group, records
      {wrapper_pid, pgid, run_id} in a pidfile (so `stop` and the next preflight find the whole tree),
      copies the output to a host-side log, forwards SIGTERM/SIGINT/SIGHUP to the group, kills the group if
      the SSH session that started it goes away, and exits with the child's status (128+N for signal N).
stop: SIGTERM to the recorded group, SIGKILL after a grace period, also to the wrapper.
state: one line with the group's processes and their /proc state (T: stopped), to name a host that hangs.

usage: hostwrap.py run --pidfile F --run-id ID [--log F] [--secrets F] [--cwd D] [--grace S] -- CMD...
       hostwrap.py stop --pidfile F [--grace S]
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # zombies still count for kill(0); look closer
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
            except (OSError, IndexError, ValueError):
                pass
    return False


def stop_group(pgid, grace):
    if not _killpg(pgid, signal.SIGTERM):
        return
    deadline = time.time() + grace
    while time.time() < deadline and _group_alive(pgid):
        time.sleep(0.05)
    _killpg(pgid, signal.SIGKILL)


MIN_MASKED_LINE = 6  # lines of a multi-line secret shorter than this ("{", "}") are not masked on their own


def mask_variants(values):
    """What to replace with *** in any output line, for secret values: each value as it is, JSON-escaped and
    as Python's repr shows it (a multi-line value never fits in one output line, so those forms matter), and
    every line of a multi-line value of at least MIN_MASKED_LINE characters. Longest first."""
    out = set()
    for v in values:
        if not v:
            continue
        forms = {v, json.dumps(v)[1:-1], json.dumps(v, ensure_ascii=False)[1:-1], repr(v)[1:-1]}
        out |= forms
        for form in forms:
            out |= {ln.strip() for ln in form.splitlines() if len(ln.strip()) >= MIN_MASKED_LINE}
    return sorted((m for m in out if m and "\n" not in m), key=len, reverse=True)


def private_open(path, mode="ab"):
    """Open for writing, readable by this user only (0600), whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC), 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode)


def cmd_run(a, argv):
    env = dict(os.environ)
    masks = []
    if a.secrets:
        with open(a.secrets) as f:
            secrets = json.load(f)
        os.unlink(a.secrets)  # nothing of it stays on disk
        env.update(secrets)
        masks = [m.encode() for m in mask_variants(secrets.values())]
    if a.log:
        os.makedirs(os.path.dirname(a.log) or ".", mode=0o700, exist_ok=True)
    log = private_open(a.log) if a.log else None
    child = subprocess.Popen(argv, env=env, cwd=a.cwd or None, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    pgid = child.pid
    tmp = a.pidfile + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"wrapper_pid": os.getpid(), "pgid": pgid, "run_id": a.run_id, "started": time.time()}, f)
    os.replace(tmp, a.pidfile)
    stopping = threading.Event()

    def on_signal(signum, _frame):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=stop_group, args=(pgid, a.grace), daemon=True).start()

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parent = os.getppid()

    def watch_parent():  # the SSH session died (controller killed, connection lost): take the tree down
        while child.poll() is None:
            if os.getppid() != parent:
                on_signal(signal.SIGHUP, None)
                return
            time.sleep(0.5)

    threading.Thread(target=watch_parent, daemon=True).start()
    out = sys.stdout.buffer
    for line in iter(child.stdout.readline, b""):
        for m in masks:  # a trainer that prints its secrets does not put them in any log
            line = line.replace(m, b"***")
        if log:
            log.write(line)
            log.flush()
        try:
            out.write(line)
            out.flush()
        except (BrokenPipeError, OSError):
            on_signal(signal.SIGHUP, None)
    rc = child.wait()
    _killpg(pgid, signal.SIGKILL)  # whatever the command left behind in its group (loader workers, ...)
    try:
        with open(a.pidfile) as f:
            if json.load(f).get("wrapper_pid") == os.getpid():
                os.unlink(a.pidfile)
    except (OSError, ValueError):
        pass
    return rc if rc >= 0 else 128 - rc


def cmd_state(a):
    """One line: the run's processes (pid, state letter from /proc, CPU ticks), to tell stopped or hung ones."""
    try:
        with open(a.pidfile) as f:
            pgid = int(json.load(f)["pgid"])
    except (OSError, ValueError, KeyError):
        print("TPUCTL_STATE " + json.dumps({"running": False, "procs": []}))
        return 0
    procs = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            procs.append({"pid": int(pid), "state": fields[0], "cpu": int(fields[11]) + int(fields[12])})
    print("TPUCTL_STATE " + json.dumps({"running": bool(procs), "procs": procs}))
    return 0


def cmd_stop(a):
    try:
        with open(a.pidfile) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        print("hostwrap: nothing running (%s)" % a.pidfile)
        return 0
    stop_group(int(rec["pgid"]), a.grace)
    wrapper = rec.get("wrapper_pid")
    deadline = time.time() + 2
    while wrapper and time.time() < deadline and os.path.exists("/proc/%d" % wrapper):
        time.sleep(0.05)
    if wrapper and os.path.exists("/proc/%d" % wrapper):
        try:
            os.kill(wrapper, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.unlink(a.pidfile)
    except FileNotFoundError:
        pass
    print("hostwrap: stopped process group %s" % rec["pgid"])
    return 0


def main():
    argv = sys.argv[1:]
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    opts = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="hostwrap")
    sub = ap.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("--pidfile", required=True)
    r.add_argument("--run-id", default="")
    r.add_argument("--log")
    r.add_argument("--secrets")
    r.add_argument("--cwd")
    r.add_argument("--grace", type=float, default=10.0)
    s = sub.add_parser("stop")
    s.add_argument("--pidfile", required=True)
    s.add_argument("--grace", type=float, default=3.0)
    st = sub.add_parser("state")
    st.add_argument("--pidfile", required=True)
    a = ap.parse_args(opts)
    if a.verb == "run":
        if not cmd:
            ap.error("run needs a command after --")
        return cmd_run(a, cmd)
    return cmd_state(a) if a.verb == "state" else cmd_stop(a)


if __name__ == "__main__":
    sys.exit(main())
