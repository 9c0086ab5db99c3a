"""The keeper of one run on a host, and the tools tpuctl reaches it with (stdlib only, Python >= 3.8).

A run belongs to the host, not to the SSH session that started it: a laptop that sleeps, a dropped connection or
a killed tpuctl changes nothing for the trainer. Only `stop` (Ctrl-C in an attached terminal, `tpuctl cancel`, the
first failure on another host), the trainer's own end, or the VM going away end it.

run:    starts the run's keeper, detached from this SSH session, then follows its log like `follow`. A run
        whose keeper is already going (same pidfile) is only followed.
keep:   the detached keeper: loads the run's secrets from a 0600 file (deleted as soon as it is read) into the
        child's environment, starts the command in its own process group, records {wrapper_pid, pgid, run_id,
        tag, started} in the pidfile (so `stop` and the next preflight find the whole tree), copies the output
        to the host's log (secrets masked, always valid UTF-8), forwards SIGTERM/SIGINT/SIGHUP to the group,
        and writes the exit file ({rc, run_id, tag, started, ended, stopped}) when the command ends (128+N for
        signal N); the exit file stays, so that how a run ended can be read later by a tpuctl that was not
        watching (`runs`).
follow: prints the log from line --skip-lines on, as it grows, until the run has ended and the log is read;
        then `TPUCTL_EXIT <rc>[ stopped]` on a line of its own ("stopped": `stop` ended it), and exits with rc. Its first line is `TPUCTL_FOLLOW <n>`.
        Killing it (the SSH session went away) does nothing to the run.
runs:   `TPUCTL_RUNS [{run_id, tag, started, running, rc, trainer}]`: the runs this host knows (live, or ended
        with an exit file); trainer, for a live one: whether its command is `... -m trainer pretrain|lora` (what
        `tpuctl top` and `profile` can look into), read from /proc.
stop:   SIGTERM to the recorded group, SIGKILL after a grace period, also to the keeper.
state:  one line with the group's processes and their /proc state (T: stopped), to name a host that hangs.
beside: runs ARGS with the live trainer's own Python (argv[0]), environment and working directory, read from
        /proc of the process the pidfile names, less the run's secrets (the keeper records their names, never
        their values), plus TPUCTL_TRAINER_PID and TPUCTL_RUN_LOG: what `tpuctl top` and `profile` run on every
        host (`python -m trainer hoststat|capture`) sees the same bundle, devices settings and --ckpt-dir paths
        as the trainer. Exits with ARGS' status; 3 with one line when no run is live.

usage: hostwrap.py run --pidfile F --run-id ID --log F [--tag T] [--secrets F] [--cwd D] [--grace S] -- CMD...
       hostwrap.py follow --pidfile F --log F [--skip-lines N]
       hostwrap.py runs --dir RUNDIR
       hostwrap.py stop --pidfile F [--grace S]
       hostwrap.py beside --pidfile F --log F -- ARGS...
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


EXIT_MARK = "TPUCTL_EXIT "
FOLLOW_MARK = "TPUCTL_FOLLOW "
GONE = 137  # the keeper vanished without an exit status: killed (SIGKILL), or the VM rebooted


def exit_file(pidfile):
    return pidfile[:-len(".pid")] + ".exit" if pidfile.endswith(".pid") else pidfile + ".exit"


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _alive(pid):
    try:
        with open("/proc/%d/stat" % int(pid)) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError, ValueError):
        return False


def cmd_keep(a, argv):
    env = dict(os.environ)
    masks, secrets = [], {}
    if a.secrets:
        with open(a.secrets) as f:
            secrets = json.load(f)
        os.unlink(a.secrets)  # nothing of it stays on disk
        env.update(secrets)
        masks = [m.encode() for m in mask_variants(secrets.values())]
    os.makedirs(os.path.dirname(a.log) or ".", mode=0o700, exist_ok=True)
    log = private_open(a.log)
    try:
        child = subprocess.Popen(argv, env=env, cwd=a.cwd or None, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        log.write(("hostwrap: cannot start %s: %s\n" % (argv[0], e)).encode())
        log.close()
        _write_json(exit_file(a.pidfile), {"rc": 127, "run_id": a.run_id, "ended": time.time()})
        return 127
    pgid = child.pid
    started = time.time()
    _write_json(a.pidfile, {"wrapper_pid": os.getpid(), "pgid": pgid, "run_id": a.run_id, "tag": a.tag,
                            "started": started, "secret_names": sorted(secrets)})
    stopping = threading.Event()

    def on_signal(signum, _frame):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=stop_group, args=(pgid, a.grace), daemon=True).start()

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    for line in iter(child.stdout.readline, b""):
        for m in masks:  # a trainer that prints its secrets does not put them in any log
            line = line.replace(m, b"***")
        # Valid UTF-8, so that every reader counts the same lines and characters.
        log.write(line.decode("utf-8", "replace").encode("utf-8"))
        log.flush()
    rc = child.wait()
    _killpg(pgid, signal.SIGKILL)  # whatever the command left behind in its group (loader workers, ...)
    rc = rc if rc >= 0 else 128 - rc
    log.close()
    stopped = os.path.exists(a.pidfile + ".stopping")  # `stop` ended it (Ctrl-C, cancel, another host's failure)
    # The pidfile goes below: the exit file keeps what names the run (its tag: which command it was), so that a
    # tpuctl that was not watching tells this command's ended run from another's (`runs`).
    _write_json(exit_file(a.pidfile), {"rc": rc, "run_id": a.run_id, "tag": a.tag, "started": started,
                                       "ended": time.time(), "stopped": stopped})
    try:
        os.unlink(a.pidfile + ".stopping")
    except OSError:
        pass
    rec = _read_json(a.pidfile)
    if rec and rec.get("wrapper_pid") == os.getpid():
        try:
            os.unlink(a.pidfile)
        except OSError:
            pass
    return rc


def _status(pidfile):
    """(running, rc, stopped): the run's keeper is alive; its exit status once it has written one, and whether
    `stop` ended it."""
    ended = _read_json(exit_file(pidfile)) or {}
    rec = _read_json(pidfile)
    running = bool(rec) and (_alive(rec.get("wrapper_pid", 0)) or _group_alive(int(rec.get("pgid") or 0)))
    return running, ended.get("rc"), bool(ended.get("stopped"))


def cmd_follow(a):
    out = sys.stdout.buffer
    out.write((FOLLOW_MARK + "%d\n" % a.skip_lines).encode())
    out.flush()
    gone_since = None
    f = None
    skip, partial = a.skip_lines, b""
    while True:
        if f is None and os.path.exists(a.log):
            f = open(a.log, "rb")
        chunk = f.read(1 << 16) if f is not None else b""
        if chunk:
            partial += chunk
            *lines, partial = partial.split(b"\n")
            for line in lines:
                if skip:
                    skip -= 1
                    continue
                out.write(line + b"\n")
            out.flush()
            continue
        running, rc, stopped = _status(a.pidfile)
        if rc is not None or not running:
            if rc is None:  # the keeper is gone without a word: give a dying keeper a moment to write it
                gone_since = gone_since or time.time()
                if time.time() - gone_since < 2:
                    time.sleep(0.1)
                    continue
                rc = GONE
            rest = (f.read() if f is not None else b"")
            partial += rest
            *lines, partial = partial.split(b"\n")
            for line in lines:
                if skip:
                    skip -= 1
                    continue
                out.write(line + b"\n")
            if partial and not skip:
                out.write(partial + b"\n")
            out.write((EXIT_MARK + "%d%s\n" % (rc, " stopped" if stopped else "")).encode())
            out.flush()
            return rc
        time.sleep(0.1)


def cmd_run(a, argv):
    running, rc, _ = _status(a.pidfile)
    if not running and rc is None:
        os.makedirs(os.path.dirname(a.pidfile) or ".", exist_ok=True)
        keep = [sys.executable, os.path.abspath(__file__), "keep", "--pidfile", a.pidfile, "--run-id", a.run_id,
                "--log", a.log, "--grace", str(a.grace), "--tag", a.tag or ""]
        if a.secrets:
            keep += ["--secrets", a.secrets]
        if a.cwd:
            keep += ["--cwd", a.cwd]
        # Its own session, no terminal and no pipe to this one: the end of the SSH session is nothing to it.
        k = subprocess.Popen(keep + ["--"] + argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        while k.poll() is None and not os.path.exists(a.pidfile):
            time.sleep(0.02)
    a.skip_lines = 0
    return cmd_follow(a)


def cmd_runs(a):
    out = []
    names = sorted(os.listdir(a.dir)) if os.path.isdir(a.dir) else []
    for n in names:
        if n.endswith(".pid") or (n.endswith(".exit") and n[:-len(".exit")] + ".pid" not in names):
            pidfile = os.path.join(a.dir, n[:-len(".exit")] + ".pid" if n.endswith(".exit") else n)
            rec = _read_json(pidfile) or {}
            running, rc, stopped = _status(pidfile)
            ended = _read_json(exit_file(pidfile)) or {}
            trainer = _is_trainer(rec.get("pgid")) if running else None
            out.append({"trainer": trainer,
                        "run_id": rec.get("run_id") or ended.get("run_id") or os.path.basename(pidfile)[:-4],
                        "tag": rec.get("tag") or ended.get("tag", ""),
                        "started": rec.get("started") or ended.get("started"), "running": running, "rc": rc,
                        "stopped": stopped, "ended": ended.get("ended")})
    print("TPUCTL_RUNS " + json.dumps(out))
    return 0


TRAINER_VERBS = ("pretrain", "lora")  # the trainer's verbs that train: progress lines and a profiler server


def _is_trainer(pgid):
    """Whether the process leading the run's group runs `... -m trainer pretrain|lora` (None: it cannot be read)."""
    try:
        with open("/proc/%d/cmdline" % int(pgid), "rb") as f:
            words = [w.decode("utf-8", "replace") for w in f.read().split(b"\0")]
    except (OSError, TypeError, ValueError):
        return None
    return any(words[i] == "-m" and words[i + 1] == "trainer" and words[i + 2] in TRAINER_VERBS
               for i in range(len(words) - 2))


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


NO_RUN = 3  # `beside` found no live run


def cmd_beside(a, argv):
    rec = _read_json(a.pidfile) or {}
    pid = int(rec.get("pgid") or 0)  # the keeper starts the command as its group's leader: the trainer itself
    try:
        if not _alive(pid):  # ended (a zombie has no environment), or a pidfile a killed keeper left
            raise OSError("not running")
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            python = f.read().split(b"\0")[0].decode()
        cwd = os.readlink("/proc/%d/cwd" % pid)
    except (OSError, ValueError, IndexError):
        print("hostwrap: no live run (%s)" % a.pidfile)
        return NO_RUN
    env = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in env.items()}
    for k in rec.get("secret_names") or []:  # what tpuctl sent as secrets stays the trainer's own
        env.pop(k, None)
    env.update(TPUCTL_TRAINER_PID=str(pid), TPUCTL_RUN_LOG=os.path.abspath(a.log))
    sys.stdout.flush()
    try:
        return subprocess.call([python] + argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL)
    except OSError as e:
        print("hostwrap: cannot start %s: %s" % (python, e))
        return 127


def cmd_stop(a):
    try:
        with open(a.pidfile) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        print("hostwrap: nothing running (%s)" % a.pidfile)
        return 0
    with open(a.pidfile + ".stopping", "w"):
        pass
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
    for verb in ("run", "keep"):
        r = sub.add_parser(verb)
        r.add_argument("--pidfile", required=True)
        r.add_argument("--run-id", default="")
        r.add_argument("--log", required=True)
        r.add_argument("--tag", default="")
        r.add_argument("--secrets")
        r.add_argument("--cwd")
        r.add_argument("--grace", type=float, default=10.0)
    f = sub.add_parser("follow")
    f.add_argument("--pidfile", required=True)
    f.add_argument("--log", required=True)
    f.add_argument("--skip-lines", type=int, default=0)
    rs = sub.add_parser("runs")
    rs.add_argument("--dir", required=True)
    s = sub.add_parser("stop")
    s.add_argument("--pidfile", required=True)
    s.add_argument("--grace", type=float, default=3.0)
    st = sub.add_parser("state")
    st.add_argument("--pidfile", required=True)
    b = sub.add_parser("beside")
    b.add_argument("--pidfile", required=True)
    b.add_argument("--log", required=True)
    a = ap.parse_args(opts)
    if a.verb in ("run", "keep"):
        if not cmd:
            ap.error("%s needs a command after --" % a.verb)
        return cmd_run(a, cmd) if a.verb == "run" else cmd_keep(a, cmd)
    if a.verb == "beside":
        if not cmd:
            ap.error("beside needs the trainer Python's arguments after --")
        return cmd_beside(a, cmd)
    return {"follow": cmd_follow, "runs": cmd_runs, "state": cmd_state, "stop": cmd_stop}[a.verb](a)


if __name__ == "__main__":
    sys.exit(main())
