"""A run's life on a slice: preflight -> push -> launch everywhere at once -> watch -> stop.

Every host's output streams to the terminal with a [wI] prefix and into run_dir/wI.log. The first
non-zero exit stops every other host's process group (over SSH, through hostwrap's pidfile), shows each
host's last lines and names the failing worker. Ctrl-C stops every host the same way.
"""
from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from orchestrator.host.hostwrap import mask_variants, private_open
from orchestrator import launch as L
from orchestrator.bundle import Bundle
from orchestrator.hosts import HostError, Hosts, InstallOptions, Probe, SshConfig  # noqa: F401 - HostError: raised from here

PREEMPTED = 42  # the trainer saved a checkpoint on a preemption notice (docs/CONTRACTS.md)
HUNG = 124      # a host stopped advancing: every host was stopped
# No host reported a new step for this long (after each had reported one): the run is hung. Compiles and the
# first step are not judged (they come before a host's first report); saves are bounded by the trainer itself.
DEFAULT_HANG_TIMEOUT_S = 300.0
PROGRESS = "TPUCTL_PROGRESS step="  # every trainer process prints it at each logged step (docs/CONTRACTS.md)
# Lines that are noise in the streamed view (libraries' start-up chatter): kept in the per-host logs only.
QUIET = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks|google_auth_provider\.cc.*"
                   r"GOOGLE_AUTH_TOKEN_FOR_TESTING")


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
                 first_output: dict, t0: float, tail: int, progress: dict | None = None):
        self.prefix, self.out, self.lock, self.secrets = f"[w{index}] ", out, lock, secrets
        self.log = io.TextIOWrapper(private_open(log), encoding="utf-8", errors="replace")
        self.buf, self.tail = "", deque(maxlen=tail)
        self.index, self.first_output, self.t0 = index, first_output, t0
        self.progress = progress if progress is not None else {}  # index -> (step, monotonic time)
        self.first_progress: dict = {}                            # index -> (step, monotonic time)

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self._line(line)
        return len(s)

    def _line(self, line: str) -> None:
        line = line.rstrip("\r")
        for v in self.secrets:
            line = line.replace(v, "***")
        self.first_output.setdefault(self.index, time.monotonic() - self.t0)
        if line.startswith(PROGRESS):
            step = line[len(PROGRESS):].strip()
            if step.isdigit():
                self.progress[self.index] = (int(step), time.monotonic())
                self.first_progress.setdefault(self.index, self.progress[self.index])
            return
        self.log.write(line + "\n")
        self.log.flush()
        if QUIET.search(line):
            return
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


def _describe(rc: int | None) -> str:
    if rc is None:
        return "did not finish"
    if rc > 128 and rc - 128 in signal.Signals._value2member_map_:
        return f"exit {rc} (killed by {signal.Signals(rc - 128).name})"
    return f"exit {rc}"


def run_job(workers: list[L.Worker], argv: list[str], *, ssh: SshConfig, run_dir: Path | str,
            env: dict[str, str] | None = None, secret_env: dict[str, str] | None = None,
            kill_stale: bool = False, bundle: Bundle | None = None, install: InstallOptions | None = None,
            coordinator_port: int = L.DEFAULT_COORDINATOR_PORT, heartbeat_timeout_s: int = 10,
            init_timeout_s: int = 60, distributed: bool = True, run_id: str | None = None,
            out: TextIO | None = None, tail_lines: int = 30, stop_grace_s: float = 10.0,
            fail_grace_s: float = 2.0, preempt_grace_s: float = 120.0,
            layout: L.HostLayout | None = None, report_failure: bool = True,
            hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S) -> RunResult:
    """Run argv on every worker at once; argv[0] == "python" is the bundle's Python (needs `bundle`).

    secret_env holds values (read from the user's environment by the caller); they reach the hosts only
    through stdin and are masked in the output. report_failure=False keeps a failed run's host tails out of
    `out` (in RunResult.report): a caller that may find the VMs were preempted prints them only if not. Raises RunFailed (with .result) when a host fails or the
    run is interrupted, HostError when preflight or push fails (nothing was started then).
    """
    out = out or sys.stdout
    env, secret_env = dict(env or {}), dict(secret_env or {})
    for k in env:
        L.check_env_name(k, "--env")
    spec = L.LaunchSpec(argv=list(argv), env=env, secret_names=sorted(secret_env),
                        run_id=run_id or L.new_run_id(), coordinator_port=coordinator_port,
                        heartbeat_timeout_s=heartbeat_timeout_s, init_timeout_s=init_timeout_s,
                        distributed=distributed, stop_grace_s=stop_grace_s)
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
                                 coordinator=L.coordinator(workers, coordinator_port)
                                 if distributed and len(workers) > 1 else None)
        timings["preflight_s"] = time.monotonic() - t0
        for p in probes:
            for c in p.cleared:
                say(f"{p.worker.name}: cleared stale {c['kind']} {c.get('pid') or c['path']}")
            for w in p.warnings():
                say(w)
        t1 = time.monotonic()
        pushed = hosts.push(bundle, probes, install,
                            out=lambda i, line: (out.write(f"[w{i}] {line}\n"), out.flush()))
        timings["push_s"] = time.monotonic() - t1
        if bundle is not None:
            state = {v.split()[0] if v != "cached" else v for v in pushed.values()}
            say(f"bundle {bundle.short}: " + ("unchanged, install skipped on every host" if state == {"cached"}
                                              else ", ".join(f"w{i} {v}" for i, v in pushed.items())))
        record["push"] = pushed
        if secret_env:
            hosts.upload_secrets(L.secrets_upload_command(lay, spec.run_id), L.secrets_payload(secret_env))
        wrap = hosts.helpers[L.HOSTWRAP]
        cmds = [_command(spec, workers, i, lay, probes[i], bundle, wrap) for i in range(len(workers))]
        result = _watch(hosts, spec, cmds, probes, run_dir, out, secret_env, tail_lines, fail_grace_s,
                        preempt_grace_s, t0, timings, say, report_failure, hang_timeout_s)
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


def shared_install(machine_dir: str | Path, bundle: Bundle, python: str | None = None,
                  log=print) -> tuple[InstallOptions, L.HostLayout]:
    """Install options for hosts that share this machine (the local slice): a wheelhouse filled once from
    the package index, one uv cache, and one dependency layer per dependency hash for all of them
    (machine_dir must be visible at the same path on every host: LocalSlice.wheelhouse is)."""
    from orchestrator.bundle import fill_wheelhouse
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
        return L.host_command(spec, workers, i, layout=lay, wrap_python="python3", wrap_script=wrap)
    py = lay.python(probe.deps_key)
    app = lay.app(bundle.short)
    path = [app] + ([f"{app}/tpuctl_workdir"] if bundle.has_workdir else [])
    # hostwrap needs only a python3 (stdlib): the host's own, which preflight already used.
    return L.host_command(spec, workers, i, layout=lay, wrap_python="python3", env_python=py, pythonpath=path,
                          cwd=f"{app}/tpuctl_workdir" if bundle.has_workdir else None, wrap_script=wrap)


def _watch(hosts: Hosts, spec: L.LaunchSpec, cmds: list[str], probes: list[Probe], run_dir: Path,
           out: TextIO, secret_env: dict, tail_lines: int, fail_grace_s: float, preempt_grace_s: float,
           t0: float, timings: dict, say, report_failure: bool = True,
           hang_timeout_s: float | None = None) -> RunResult:
    n = len(cmds)
    lock = threading.Lock()
    first: dict[int, float] = {}
    progress: dict[int, tuple[int, float]] = {}
    secrets = mask_variants(secret_env.values())
    streams = [_HostStream(i, out, run_dir / f"w{i}.log", lock, secrets, first, t0, tail_lines, progress)
               for i in range(n)]
    hung = ""

    def stopped_hosts(indices: list[int]) -> list[int]:
        """Hosts whose trainer is stopped (state T) or that do not answer: the ones that stopped advancing."""
        cmd = L.state_command(hosts.layout, spec.run_id, wrap_python="python3", wrap_script=hosts.helpers[L.HOSTWRAP])
        out_ = hosts.stop(cmd, indices, timeout=10)
        bad = []
        for i, r in out_.items():
            line = next((l for l in getattr(r, "stdout", "").splitlines() if l.startswith("TPUCTL_STATE ")), None)
            if line is None or any(p["state"] == "T" for p in json.loads(line[len("TPUCTL_STATE "):])["procs"]):
                bad.append(i)
        return bad

    def step_of(i: int) -> str:
        return f"step {progress[i][0]}" if i in progress else "its first step"
    done: queue.Queue = queue.Queue()
    codes: dict[int, int | None] = {i: None for i in range(n)}

    def host(i: int) -> None:
        try:
            r = hosts.conns[i].run(cmds[i], out_stream=streams[i], err_stream=streams[i], hide=False,
                                   warn=True, pty=False)
            rc = r.exited
        except Exception as e:  # noqa: BLE001 - the connection dropped: that host failed
            streams[i].write(f"tpuctl: lost the SSH connection: {e}\n")
            rc = 255
        finally:
            streams[i].close()
        done.put((i, rc))

    threads = [threading.Thread(target=host, args=(i,), daemon=True, name=f"w{i}") for i in range(n)]
    timings["launch_s"] = time.monotonic() - t0
    for t in threads:
        t.start()
    failed, interrupted, stopped = None, False, False

    def stop_all(grace: float, indices: list[int]) -> None:
        cmd = L.stop_command(hosts.layout, spec.run_id, wrap_python="python3", grace=grace,
                             wrap_script=hosts.helpers[L.HOSTWRAP])
        hosts.stop(cmd, indices)

    try:
        remaining = n
        deadline = None
        while remaining:
            try:
                i, rc = done.get(timeout=0.2 if deadline is None else max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline and not stopped:
                    stopped = True
                    stop_all(fail_grace_s, [j for j in range(n) if codes[j] is None])
                elif (hang_timeout_s and failed is None and not stopped and len(progress) == n
                      and time.monotonic() - max(t for _, t in progress.values()) > hang_timeout_s):
                    running = [j for j in range(n) if codes[j] is None]
                    culprits = stopped_hosts(running) or [min(running, key=lambda j: progress[j][0])]
                    failed = culprits[0]
                    hung = (f"stopped advancing at {step_of(failed)}: no host reported a new step for "
                            f"{hang_timeout_s:.0f} s")
                    say(f"w{failed} {hung}; stopping every host")
                    stopped = True
                    stop_all(fail_grace_s, running)
                continue
            codes[i] = rc
            remaining -= 1
            if rc != 0 and failed is None:
                failed = i
                others = [j for j in range(n) if codes[j] is None]
                if rc == PREEMPTED and others:  # the others are saving the same step: let them finish
                    say(f"w{i} stopped on a preemption notice; waiting for the other hosts to save")
                    deadline = time.monotonic() + preempt_grace_s
                elif others:
                    # A host that stops (SIGSTOP, a hung VM) makes the others fail at jax's heartbeat: name it.
                    stuck = stopped_hosts(others) if rc not in (255, -1) else []
                    if stuck:
                        failed = stuck[0]
                        hung = f"stopped advancing at {step_of(failed)} (its trainer does not run)"
                        say(f"w{failed} {hung}; w{i} then failed ({_describe(rc)}): stopping every host")
                    else:
                        # A dropped SSH connection may be a preempted VM, not a failure: the caller tells which.
                        what = "lost its SSH connection" if rc in (255, -1) else f"failed ({_describe(rc)})"
                        say(f"w{i} {what}: stopping {', '.join(f'w{j}' for j in others)}")
                    stopped = True
                    stop_all(fail_grace_s, others)
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: stopping every host (Ctrl-C again to stop waiting)")
        try:
            stop_all(spec.stop_grace_s, [j for j in range(n) if codes[j] is None])
        except KeyboardInterrupt:
            stop_all(0, list(range(n)))
    for t in threads:
        t.join(timeout=30)
    for i in range(n):
        if threads[i].is_alive():  # SSH hung: close it so the thread ends
            hosts.conns[i].close()
    while not done.empty():
        i, rc = done.get()
        codes[i] = rc
    timings["first_output_s"] = min(first.values()) if first else float("nan")
    timings["total_s"] = time.monotonic() - t0
    # Steps as process 0 reported them (the goodput accounting of supervise): when the first and the last
    # reported step completed, counted from the start of the run.
    if streams and streams[0].first_progress:
        (s0, f0), (s1, f1) = streams[0].first_progress[0], progress[0]
        timings.update(first_step=s0, first_step_s=f0 - t0, last_step=s1, last_step_s=f1 - t0)
    if interrupted:
        rc_all = 130
    elif hung:
        rc_all = HUNG
    elif failed is not None:
        rc_all = codes[failed] or 1
    else:
        rc_all = 0
    report = []
    if rc_all != 0:
        for i, s in enumerate(streams):
            report.append(f"---- w{i} ({hosts.workers[i].address}): {_describe(codes[i])}, "
                          f"last {len(s.tail)} lines ----")
            report += [f"[w{i}] {line}" for line in s.tail]
        if all_preempted(codes):
            report.append(f"[tpuctl] preempted: every host saved a checkpoint (exit {PREEMPTED}); run again to "
                          f"resume; logs in {run_dir}")
        elif failed is not None and not interrupted:
            w = hosts.workers[failed]
            report.append(f"[tpuctl] FAILED: worker {w.name} ({w.address}) "
                          f"{hung or _describe(codes[failed])}; logs in {run_dir}")
        if report_failure:
            with lock:
                out.writelines(line + "\n" for line in report)
                out.flush()
    return RunResult(run_id=spec.run_id, run_dir=run_dir, returncode=rc_all, exit_codes=codes,
                     failed_worker=None if interrupted else failed, timings=timings, interrupted=interrupted,
                     report="\n".join(report), hung=hung)


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
