"""A run's life on a slice: preflight -> push -> launch everywhere at once -> watch -> stop.

Every host's output streams to the terminal with a [wI] prefix and into run_dir/wI.log. The first
non-zero exit stops every other host's process group (over SSH, through hostwrap's pidfile), shows each
host's last lines and names the failing worker. Ctrl-C stops every host the same way.

The run belongs to the hosts, not to the SSH connections that follow it (hostwrap keeps it, detached): a
connection that drops is opened again for up to Watch.reconnect_s, and the host's log is followed on from the
last line received. `attach` follows a run that is already going, started from anywhere.
"""
from __future__ import annotations

import io
import json
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, TextIO

from orchestrator.host.hostwrap import EXIT_MARK, FOLLOW_MARK, mask_variants, private_open
from orchestrator.jobs import launch as L
from orchestrator.jobs.bundle import Bundle
from orchestrator.access.hosts import HostError, Hosts, InstallOptions, Probe, SshConfig  # noqa: F401 - HostError: raised from here

PREEMPTED = 42  # the trainer saved a checkpoint on a preemption notice (docs/CONTRACTS.md)
HUNG = 124      # a host stopped advancing: every host was stopped
# No host reported a new step for this long (after each had reported one): the run is hung. Compiles and the
# first step are not judged (they come before a host's first report); saves are bounded by the trainer itself.
DEFAULT_HANG_TIMEOUT_S = 300.0
# A host whose connection is down when the run is being stopped: how long its end is looked for on a new one.
STOP_RECONNECT_S = 20.0
PROGRESS = "TPUCTL_PROGRESS step="  # every trainer process prints it at each logged step (docs/CONTRACTS.md)


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    returncode: int
    exit_codes: dict[int, int | None]       # worker index -> exit status (None: did not finish)
    failed_worker: int | None = None
    push: dict[int, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    interrupted: bool = False
    cancelled: bool = False   # stopped on the hosts from elsewhere (`tpuctl cancel`, another terminal's Ctrl-C)
    report: str = ""      # each host's last lines and the FAILED line, when the run failed
    hung: str = ""        # why the failed worker is named as the one that stopped advancing
    attempts: list[dict] = field(default_factory=list)  # across preemptions (supervise): one summary each
    goodput: dict = field(default_factory=dict)          # supervise.goodput: where the wall time went

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class RunFailed(RuntimeError):
    def __init__(self, message: str, result: RunResult):
        super().__init__(message)
        self.result = result


class _HostStream:
    """invoke out_stream for one host: whole lines, secrets masked, to the terminal and the log."""

    def __init__(self, index: int, out: TextIO, log: Path, lock: threading.Lock, secrets: list[str],
                 first_output: dict, t0: float, tail: int, progress: dict | None = None, name: str = ""):
        self.prefix, self.out, self.lock, self.secrets = f"[{name or f'w{index}'}] ", out, lock, secrets
        self.log = io.TextIOWrapper(private_open(log), encoding="utf-8", errors="replace")
        self.buf, self.tail = "", deque(maxlen=tail)
        self.index, self.first_output, self.t0 = index, first_output, t0
        self.progress = progress if progress is not None else {}  # index -> (step, monotonic time)
        self.first_progress: dict = {}                            # index -> (step, monotonic time)
        self.following = False   # past hostwrap's TPUCTL_FOLLOW line: what follows are the host log's lines
        self.lines = 0           # the host log's complete lines received: where a reconnect follows on from
        self.exit_rc: int | None = None  # hostwrap's TPUCTL_EXIT: the run ended on this host with this status
        self.stopped = False             # ... because a stop ended it (Ctrl-C, `tpuctl cancel`, a failure elsewhere)

    def resume(self) -> None:
        """A new connection follows the log on from self.lines: a line cut off by the drop comes again whole."""
        self.buf, self.following = "", False

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self._line(line)
        return len(s)

    def _line(self, line: str) -> None:
        if line.startswith(FOLLOW_MARK):
            self.following = True
            return
        words = line[len(EXIT_MARK):].split() if self.following and line.startswith(EXIT_MARK) else []
        if words and words[0].lstrip("-").isdigit():
            self.exit_rc, self.stopped = int(words[0]), words[1:] == ["stopped"]
            return
        if self.following:
            self.lines += 1
        line = line.rstrip("\r")
        for v in self.secrets:
            line = line.replace(v, "***")
        self.first_output.setdefault(self.index, time.monotonic() - self.t0)
        if line.startswith(PROGRESS):
            step, *_ = line[len(PROGRESS):].split() or [""]  # then key=value fields (docs/CONTRACTS.md)
            if step.isdigit():
                self.progress[self.index] = (int(step), time.monotonic())
                self.first_progress.setdefault(self.index, self.progress[self.index])
            return
        self.log.write(line + "\n")
        self.log.flush()
        self.tail.append(line)
        with self.lock:
            self.out.write(self.prefix + line + "\n")
            self.out.flush()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.buf:
            self._line(self.buf)
            self.buf = ""
        self.log.close()

    def note(self, text: str) -> None:
        """A line of tpuctl's own in this host's view (not from the host's log)."""
        following, self.following = self.following, False
        self._line(text)
        self.following = following


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def _describe(rc: int | None) -> str:
    if rc is None:
        return "did not finish"
    if rc > 128 and rc - 128 in signal.Signals._value2member_map_:
        return f"exit {rc} (killed by {signal.Signals(rc - 128).name})"
    return f"exit {rc}"


@dataclass(frozen=True)
class Watch:
    """How a run is watched once it runs: how long the others get after the first failure, how long hosts may
    take to save on a preemption notice, when a silent run counts as hung, and whether a failure's host tails
    are printed (False: the caller prints them only if the VMs were not preempted)."""
    tail_lines: int = 30
    fail_grace_s: float = 2.0
    preempt_grace_s: float = 120.0
    hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S
    report_failure: bool = True
    # A dropped connection is opened again for this long (the run goes on on the host meanwhile); 0: never;
    # None: as long as a new connection may take (SshConfig.wait_s, `--ssh-wait`).
    reconnect_s: float | None = None
    # Asked while reconnecting: True when the hosts are gone for good (the slice was preempted), so that the
    # caller's recovery starts at once instead of after reconnect_s.
    slice_lost: Callable[[], bool] | None = None


def run_job(workers: list[L.Worker], spec: L.LaunchSpec, *, ssh: SshConfig, run_dir: Path | str,
            secret_env: dict[str, str] | None = None, bundle: Bundle | None = None,
            install: InstallOptions | None = None, layout: L.HostLayout | None = None, kill_stale: bool = False,
            watch: Watch = Watch(), out: TextIO | None = None) -> RunResult:
    """Run spec.argv on every worker at once; argv[0] == "python" is the bundle's Python (needs `bundle`).

    secret_env holds values (read from the user's environment by the caller); they reach the hosts only
    through stdin and are masked in the output. Raises RunFailed (with .result) when a host fails or the run
    is interrupted, HostError when preflight or push fails (nothing was started then).
    """
    out = out or sys.stdout
    secret_env = dict(secret_env or {})
    for k in spec.env:
        L.check_env_name(k, "--env")
    spec = replace(spec, secret_names=sorted(secret_env))
    argv, env = spec.argv, spec.env
    if argv and argv[0] == L.PYTHON and bundle is None:
        raise L.LaunchError("the command runs `python` from the bundle, but no bundle was given")
    run_dir = Path(run_dir)
    _private_dirs(run_dir)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    say = lambda msg: (out.write(f"[tpuctl] {msg}\n"), out.flush())  # noqa: E731
    hosts = Hosts(workers, ssh, layout)
    lay = hosts.layout
    workers = hosts.workers
    record = {"run_id": spec.run_id, "argv": spec.argv, "env": env, "secret_env": spec.secret_names,
              "workers": [asdict(w) for w in workers], "bundle": bundle.hash if bundle else None,
              "started": time.time()}
    write_json(run_dir / "run.json", record)
    try:
        probes = hosts.preflight(kill_stale=kill_stale, bundle=bundle, say=say,
                                 coordinator=L.coordinator(workers, spec.coordinator_port)
                                 if spec.distributed and len(workers) > 1 else None)
        timings["preflight_s"] = time.monotonic() - t0
        for p in probes:
            for c in p.cleared:
                say(f"{p.worker.name}: cleared stale {c['kind']} {c.get('pid') or c['path']}")
            for w in p.warnings():
                say(w)
        t1 = time.monotonic()
        pushed = hosts.push(bundle, probes, install,
                            out=lambda i, line: (out.write(f"[{workers[i].name}] {line}\n"), out.flush()))
        timings["push_s"] = time.monotonic() - t1
        if bundle is not None:
            state = {v.split()[0] if v != "cached" else v for v in pushed.values()}
            say(f"bundle {bundle.short}: " + ("unchanged, install skipped on every host" if state == {"cached"}
                                              else ", ".join(f"{workers[i].name} {v}" for i, v in pushed.items())))
        record["push"] = pushed
        if secret_env:
            hosts.upload_secrets(L.secrets_upload_command(lay, spec.run_id), L.secrets_payload(secret_env))
        wrap = hosts.helpers[L.HOSTWRAP]
        cmds = [_command(spec, workers, i, lay, probes[i], bundle, wrap) for i in range(len(workers))]
        result = _Watcher(hosts, spec, cmds, run_dir, out, secret_env, watch, t0, timings, say).run()
        result.push = pushed
    except BaseException:
        record["returncode"] = None
        write_json(run_dir / "run.json", record)
        hosts.close()
        raise
    record.update(returncode=result.returncode, exit_codes=result.exit_codes, timings=timings,
                  failed_worker=result.failed_worker, finished=time.time())
    write_json(run_dir / "run.json", record)
    hosts.close()
    if not result.ok:
        raise RunFailed(result_message(result, workers), result)
    return result


def live_runs(hosts: Hosts) -> dict[str, dict]:
    """The runs the hosts know, by run id: {tag, started, running (on any host), rc (per host index, once ended),
    hosts (indices that know it), trainer (a live run's command is the trainer's pretrain or lora; None: no host
    could tell)}. Hosts that do not answer are left out."""
    hosts.ensure_helpers()
    cmd = L.runs_command(hosts.layout, wrap_python="python3", wrap_script=hosts.helpers[L.HOSTWRAP])
    out: dict[str, dict] = {}
    for i, r in enumerate(hosts.each(lambda i, c: c.run(cmd, warn=True, timeout=30))):
        line = next((ln for ln in getattr(r, "stdout", "").splitlines() if ln.startswith("TPUCTL_RUNS ")), None)
        for run in json.loads(line[len("TPUCTL_RUNS "):]) if line else []:
            d = out.setdefault(run["run_id"], {"tag": run.get("tag", ""), "started": run.get("started"),
                                               "running": False, "rc": {}, "hosts": [], "trainer": None})
            d["running"] = d["running"] or bool(run.get("running"))
            if run.get("trainer") is not None:  # a live run's command, as its hosts read it
                d["trainer"] = bool(d["trainer"]) or run["trainer"]
            d["tag"] = d["tag"] or run.get("tag", "")
            d["hosts"].append(i)
            if run.get("rc") is not None:
                d["rc"][i] = run["rc"]
    return out


def attach_job(workers: list[L.Worker], run_id: str, *, ssh: SshConfig, run_dir: Path | str,
               layout: L.HostLayout | None = None, watch: Watch = Watch(), out: TextIO | None = None,
               stop_grace_s: float = 10.0) -> RunResult:
    """Follow a run that is already going on the hosts (started from another terminal or machine, or by a tpuctl
    that was killed), as run_job follows its own: each host's log from its first line into run_dir, the first
    failure stops the others, Ctrl-C stops every host. Raises RunFailed like run_job."""
    out = out or sys.stdout
    run_dir = Path(run_dir)
    _private_dirs(run_dir)
    for f in run_dir.glob("*.log"):  # written again from the hosts' logs, whole
        f.unlink()
    t0 = time.monotonic()
    say = lambda msg: (out.write(f"[tpuctl] {msg}\n"), out.flush())  # noqa: E731
    hosts = Hosts(workers, ssh, layout)
    workers = hosts.workers
    path = run_dir / "run.json"
    record = json.loads(path.read_text()) if path.exists() else {"run_id": run_id, "started": None}
    record.update(workers=[asdict(w) for w in workers], attached=time.time())
    record.pop("returncode", None)
    write_json(path, record)
    timings: dict[str, float] = {}
    try:
        hosts.wait_reachable(say)
        hosts.ensure_helpers()
        wrap = hosts.helpers[L.HOSTWRAP]
        cmds = [L.follow_command(hosts.layout, run_id, skip_lines=0, wrap_python="python3", wrap_script=wrap)
                for _ in workers]
        spec = L.LaunchSpec(argv=record.get("argv") or ["?"], run_id=run_id, stop_grace_s=stop_grace_s)
        result = _Watcher(hosts, spec, cmds, run_dir, out, {}, watch, t0, timings, say).run()
    except BaseException:
        hosts.close()
        raise
    record.update(returncode=result.returncode, exit_codes=result.exit_codes, failed_worker=result.failed_worker,
                  finished=time.time())
    write_json(path, record)
    hosts.close()
    if not result.ok:
        raise RunFailed(result_message(result, workers), result)
    return result


def stop_run(hosts: Hosts, run_id: str, grace: float = 10.0) -> dict[int, int | None]:
    """Stop run_id on every host (SIGTERM to its process group, SIGKILL after `grace`); {index: exit of the stop}."""
    hosts.ensure_helpers()
    cmd = L.stop_command(hosts.layout, run_id, wrap_python="python3", grace=grace,
                         wrap_script=hosts.helpers[L.HOSTWRAP])
    return {i: getattr(r, "exited", None) for i, r in hosts.stop(cmd, timeout=grace + 30).items()}


def shared_install(machine_dir: str | Path, bundle: Bundle, python: str | None = None,
                  log=print) -> tuple[InstallOptions, L.HostLayout]:
    """Install options for hosts that share this machine (the local slice): a wheelhouse filled once from
    the package index, one uv cache, and one dependency layer per dependency hash for all of them
    (machine_dir must be visible at the same path on every host: LocalSlice.wheelhouse is)."""
    from orchestrator.jobs.bundle import fill_wheelhouse
    machine_dir = Path(machine_dir)
    wh = fill_wheelhouse(bundle, machine_dir, log=log)
    opts = InstallOptions(wheelhouse=str(wh), uv_cache=str(machine_dir / "uv-cache"), python=python)
    return opts, L.HostLayout(deps_root=str(machine_dir / "deps"))


def all_preempted(exit_codes: dict[int, int | None]) -> bool:
    """Every host exited PREEMPTED: each saved the same step on a preemption notice."""
    return set(exit_codes.values()) == {PREEMPTED}


def result_message(r: RunResult, workers: list[L.Worker]) -> str:
    if r.interrupted:
        return "interrupted: stopped the run on every host"
    if r.cancelled:
        return "cancelled: the run was stopped on its hosts from elsewhere (`tpuctl cancel`, or another terminal)"
    if all_preempted(r.exit_codes):
        return "stopped on a preemption notice after every host saved a checkpoint; run again to resume"
    if r.failed_worker is not None:
        w = workers[r.failed_worker]
        if r.hung:
            return f"worker {w.name} ({w.address}) {r.hung}"
        return f"worker {w.name} ({w.address}) failed: {_describe(r.exit_codes.get(r.failed_worker))}"
    return f"run failed with exit {r.returncode}"


def _command(spec: L.LaunchSpec, workers: list[L.Worker], i: int, lay: L.HostLayout, probe: Probe,
             bundle: Bundle | None, wrap: str) -> str:
    if bundle is None:
        return L.host_command(spec, workers, i, layout=lay, wrap_python="python3", wrap_script=wrap,
                              tag=L.command_tag(spec.argv, spec.env))
    py = lay.python(probe.deps_key)
    app = lay.app(bundle.short)
    path = [app] + ([f"{app}/tpuctl_workdir"] if bundle.has_workdir else [])
    # hostwrap needs only a python3 (stdlib): the host's own, which preflight already used.
    return L.host_command(spec, workers, i, layout=lay, wrap_python="python3", env_python=py, pythonpath=path,
                          cwd=f"{app}/tpuctl_workdir" if bundle.has_workdir else None, wrap_script=wrap,
                          tag=L.command_tag(spec.argv, spec.env))


class _Watcher:
    """One launched run, watched until every host has ended: the first failure stops the others (naming a host
    that stopped advancing rather than the one that noticed), a preemption notice gives the others time to save,
    a run where no host advances is stopped as hung, Ctrl-C stops every host. Ends in a RunResult."""

    def __init__(self, hosts: Hosts, spec: L.LaunchSpec, cmds: list[str], run_dir: Path, out: TextIO,
                 secret_env: dict, watch: Watch, t0: float, timings: dict, say):
        self.hosts, self.spec, self.cmds, self.run_dir, self.out = hosts, spec, cmds, run_dir, out
        self.watch, self.t0, self.timings, self.say = watch, t0, timings, say
        self.n = n = len(cmds)
        self.lock = threading.Lock()
        self.first: dict[int, float] = {}                   # index -> first output (s since t0)
        self.progress: dict[int, tuple[int, float]] = {}   # index -> (last reported step, monotonic time)
        secrets = mask_variants(secret_env.values())
        names = [w.name for w in hosts.workers]
        self.names = names
        self.streams = [_HostStream(i, out, run_dir / f"{names[i]}.log", self.lock, secrets, self.first, t0,
                                    watch.tail_lines, self.progress, name=names[i]) for i in range(n)]
        self.done: queue.Queue = queue.Queue()
        self.codes: dict[int, int | None] = {i: None for i in range(n)}
        self.failed: int | None = None
        self.hung = ""
        self.stopped = self.interrupted = self.cancelled = False
        self.deadline: float | None = None   # set by a preemption notice: when the others must have saved
        self.lost: set[int] = set()   # hosts whose connection dropped and is not back yet
        self.back: set[int] = set()   # hosts reconnected since the last "reconnected" line

    # ---- the hosts
    def _host(self, i: int) -> None:
        s, cmd, rc = self.streams[i], self.cmds[i], None
        try:
            while True:
                err = None
                try:
                    rc = self.hosts.conns[i].run(cmd, out_stream=s, err_stream=s, hide=False, warn=True,
                                                 pty=False).exited
                except Exception as e:  # noqa: BLE001 - the connection dropped (or never opened)
                    err, rc = e, None
                if s.exit_rc is not None:  # hostwrap says how the run ended on this host
                    rc = s.exit_rc
                    break
                if rc not in (None, -1) and not s.following:  # the host command failed before the run began
                    break
                # The connection dropped: the run goes on on the host. Follow its log again on a new one. Also
                # while the others are being stopped: how the run ended on this host is in its log (a trainer
                # killed there reads 137, not a lost connection), so it is looked for, for a while.
                if self.interrupted or not self._reconnect(i, err):
                    s.note(f"tpuctl: lost the SSH connection{': ' + _one_line(err) if err else ''}")
                    rc = 255
                    break
                if self.stopped:  # the stop sent while this host was away never reached it
                    try:
                        self._stop_all(self.watch.fail_grace_s, [i])
                    except Exception:  # noqa: BLE001 - following its log below says how it ended anyway
                        pass
                cmd = L.follow_command(self.hosts.layout, self.spec.run_id, skip_lines=s.lines,
                                       wrap_python="python3", wrap_script=self.hosts.helpers[L.HOSTWRAP])
        finally:
            s.close()
        self.done.put((i, rc))

    def _reconnect(self, i: int, err: BaseException | None) -> bool:
        """Open worker i's connection again, for up to watch.reconnect_s; False when that fails, the run is being
        stopped, or the slice is gone (watch.slice_lost). Says once that connections dropped, once that they
        are back."""
        limit = self.hosts.ssh.wait_s if self.watch.reconnect_s is None else self.watch.reconnect_s
        if not limit:
            return False
        with self.lock:
            if not self.lost:
                why = f" ({_one_line(err)})" if err else ""
                self.say(f"lost the SSH connection to {self.names[i]}{why}: the run goes on on the hosts; "
                         f"reconnecting for up to {limit:.0f} s")
            self.lost.add(i)
        deadline = time.monotonic() + limit
        next_check = 0.0
        while time.monotonic() < deadline and not self.interrupted:
            if self.stopped:  # the run is ending anyway: its end on this host is worth STOP_RECONNECT_S, no more
                deadline = min(deadline, time.monotonic() + STOP_RECONNECT_S)
            if self.watch.slice_lost and time.monotonic() >= next_check:
                next_check = time.monotonic() + 10
                try:
                    if self.watch.slice_lost():
                        return False
                except Exception:  # noqa: BLE001 - the API unreachable too: keep trying the host
                    pass
            try:
                self.hosts.reopen(i)
            except Exception:  # noqa: BLE001 - not yet
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
                continue
            self.streams[i].resume()
            with self.lock:
                self.lost.discard(i)
                self.back.add(i)
                now = time.monotonic()  # the time away is not a hang
                self.progress.update({j: (st, now) for j, (st, _) in self.progress.items()})
                if not self.lost:
                    self.say(f"reconnected to {', '.join(self.names[j] for j in sorted(self.back))}: following "
                             "each host's log from where it left off")
                    self.back.clear()
            return True
        return False

    def _running(self) -> list[int]:
        return [j for j in range(self.n) if self.codes[j] is None]

    def _stop_all(self, grace: float, indices: list[int]) -> None:
        cmd = L.stop_command(self.hosts.layout, self.spec.run_id, wrap_python="python3", grace=grace,
                             wrap_script=self.hosts.helpers[L.HOSTWRAP])
        self.hosts.stop(cmd, indices)

    def _stopped_hosts(self, indices: list[int]) -> list[int]:
        """Hosts whose trainer is stopped (state T) or that do not answer: the ones that stopped advancing."""
        cmd = L.state_command(self.hosts.layout, self.spec.run_id, wrap_python="python3",
                              wrap_script=self.hosts.helpers[L.HOSTWRAP])
        bad = []
        for i, r in self.hosts.stop(cmd, indices, timeout=10).items():
            line = next((ln for ln in getattr(r, "stdout", "").splitlines() if ln.startswith("TPUCTL_STATE ")), None)
            if line is None or any(p["state"] == "T" for p in json.loads(line[len("TPUCTL_STATE "):])["procs"]):
                bad.append(i)
        return bad

    def _step_of(self, i: int) -> str:
        return f"step {self.progress[i][0]}" if i in self.progress else "its first step"

    # ---- what happens while waiting
    def _idle(self) -> None:
        """Nothing ended for a moment: the preemption grace may be over, or the run may be hung."""
        if self.deadline is not None and time.monotonic() >= self.deadline and not self.stopped:
            self.stopped = True
            self._stop_all(self.watch.fail_grace_s, self._running())
        elif (self.watch.hang_timeout_s and self.failed is None and not self.stopped and not self.lost
              and len(self.progress) == self.n
              and time.monotonic() - max(t for _, t in self.progress.values()) > self.watch.hang_timeout_s):
            running = self._running()
            culprits = self._stopped_hosts(running) or [min(running, key=lambda j: self.progress[j][0])]
            self.failed = culprits[0]
            self.hung = (f"stopped advancing at {self._step_of(self.failed)}: no host reported a new step for "
                         f"{self.watch.hang_timeout_s:.0f} s")
            self.say(f"{self.names[self.failed]} {self.hung}; stopping every host")
            self.stopped = True
            self._stop_all(self.watch.fail_grace_s, running)

    def _ended(self, i: int, rc: int | None) -> None:
        self.codes[i] = rc
        if rc and self.streams[i].stopped and not (self.stopped or self.interrupted):
            if not self.cancelled:  # stopped from elsewhere: `tpuctl cancel`, Ctrl-C in another terminal
                self.cancelled = True
                self.say(f"the run was stopped on {self.names[i]} from elsewhere (`tpuctl cancel`, or Ctrl-C in "
                         "another terminal that follows it)")
            return
        if rc == 0 or self.failed is not None or self.cancelled:
            return
        self.failed = i
        others = self._running()
        if not others:
            return
        if rc == PREEMPTED:  # the others are saving the same step: let them finish
            self.say(f"{self.names[i]} stopped on a preemption notice; waiting for the other hosts to save")
            self.deadline = time.monotonic() + self.watch.preempt_grace_s
            return
        # A host that stops (SIGSTOP, a hung VM) makes the others fail at jax's heartbeat: name it.
        stuck = self._stopped_hosts(others) if rc not in (255, -1) else []
        if stuck:
            self.failed = stuck[0]
            self.hung = f"stopped advancing at {self._step_of(self.failed)} (its trainer does not run)"
            self.say(f"{self.names[self.failed]} {self.hung}; {self.names[i]} then failed ({_describe(rc)}): "
                     "stopping every host")
        else:
            # A dropped SSH connection may be a preempted VM, not a failure: the caller tells which.
            what = "lost its SSH connection" if rc in (255, -1) else f"failed ({_describe(rc)})"
            self.say(f"{self.names[i]} {what}: stopping {', '.join(self.names[j] for j in others)}")
        self.stopped = True
        self._stop_all(self.watch.fail_grace_s, others)

    # ---- the whole run
    def run(self) -> RunResult:
        threads = [threading.Thread(target=self._host, args=(i,), daemon=True, name=f"w{i}") for i in range(self.n)]
        self.timings["launch_s"] = time.monotonic() - self.t0
        for t in threads:
            t.start()
        try:
            remaining = self.n
            while remaining:
                wait = 0.2 if self.deadline is None else max(0.05, self.deadline - time.monotonic())
                try:
                    i, rc = self.done.get(timeout=wait)
                except queue.Empty:
                    self._idle()
                    continue
                remaining -= 1
                self._ended(i, rc)
        except KeyboardInterrupt:
            self.interrupted = True
            self.say("interrupted: stopping every host (Ctrl-C again to stop waiting)")
            try:
                self._stop_all(self.spec.stop_grace_s, self._running())
            except KeyboardInterrupt:
                self._stop_all(0, list(range(self.n)))
        for t in threads:
            t.join(timeout=30)
        for i in range(self.n):
            if threads[i].is_alive():  # SSH hung: close it so the thread ends
                self.hosts.conns[i].close()
        while not self.done.empty():
            i, rc = self.done.get()
            self.codes[i] = rc
        return self._result()

    def _result(self) -> RunResult:
        timings, codes, failed = self.timings, self.codes, self.failed
        timings["first_output_s"] = min(self.first.values()) if self.first else float("nan")
        timings["total_s"] = time.monotonic() - self.t0
        # Steps as process 0 reported them (the goodput accounting of supervise): when the first and the last
        # reported step completed, counted from the start of the run.
        if self.streams and self.streams[0].first_progress:
            (s0, f0), (s1, f1) = self.streams[0].first_progress[0], self.progress[0]
            timings.update(first_step=s0, first_step_s=f0 - self.t0, last_step=s1, last_step_s=f1 - self.t0)
        if self.interrupted or self.cancelled:
            rc_all = 130
        elif self.hung:
            rc_all = HUNG
        elif failed is not None:
            rc_all = codes[failed] or 1
        else:
            rc_all = 0
        report = []
        if rc_all != 0 and not self.cancelled:  # a cancel asked for this end: no failure to explain
            for i, s in enumerate(self.streams):
                report.append(f"---- {self.names[i]} ({self.hosts.workers[i].address}): {_describe(codes[i])}, "
                              f"last {len(s.tail)} lines ----")
                report += [f"[{self.names[i]}] {line}" for line in s.tail]
            if all_preempted(codes):
                report.append(f"[tpuctl] preempted: every host saved a checkpoint (exit {PREEMPTED}); run again "
                              f"to resume; logs in {self.run_dir}")
            elif failed is not None and not (self.interrupted or self.cancelled):
                w = self.hosts.workers[failed]
                report.append(f"[tpuctl] FAILED: worker {w.name} ({w.address}) "
                              f"{self.hung or _describe(codes[failed])}; logs in {self.run_dir}")
            if self.watch.report_failure:
                with self.lock:
                    self.out.writelines(line + "\n" for line in report)
                    self.out.flush()
        return RunResult(run_id=self.spec.run_id, run_dir=self.run_dir, returncode=rc_all, exit_codes=codes,
                         failed_worker=None if (self.interrupted or self.cancelled) else failed, timings=timings,
                         interrupted=self.interrupted, cancelled=self.cancelled, report="\n".join(report),
                         hung=self.hung)


def write_json(path: Path, obj: dict) -> None:
    """run.json holds --env values: 0600, written whole or not at all."""
    tmp = path.with_suffix(".tmp")
    with private_open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _private_dirs(run_dir: Path) -> None:
    """runs/, runs/NAME/ and the run's dir, readable by this user only (they hold logs and --env values)."""
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    mine = [run_dir, run_dir.parent, run_dir.parent.parent] if run_dir.parent.parent.name == "runs" else [run_dir]
    for d in mine:
        os.chmod(d, 0o700)
