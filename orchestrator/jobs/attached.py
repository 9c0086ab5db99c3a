"""An attached run: `tpuctl run`, `attach` and `cancel` as one Python API (the command line only parses and calls).

The terminal that runs it supervises it: the first failure stops every host, Ctrl-C stops every host, and a
preempted slice is recreated and the command run again (supervise). The run itself belongs to the hosts (hostwrap
keeps it, detached from any SSH session): a dropped connection is opened again and each host's log followed on
from where it left off; a killed tpuctl leaves the run going, and `attach` (or the same `run` again) follows it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, TextIO

from orchestrator.access.hosts import Hosts, RunGoing
from orchestrator.access.reach import SshFlags, Target, reach
from orchestrator.jobs import bundle as B
from orchestrator.jobs import launch as L
from orchestrator.jobs.runner import RunResult, Watch, attach_job, live_runs, run_job, shared_install, stop_run
from orchestrator.spec import UserError
from orchestrator.state import home

RUNNER_PID = "tpuctl.pid"  # in a run's directory: the tpuctl process that follows it (`logs --follow` watches it)


@dataclass(frozen=True)
class RunOptions:
    """`tpuctl run`'s flags past the SSH ones (docs/verbs.md)."""
    env: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)  # values read from the user's environment: never recorded
    kill_stale: bool = False
    workdir: str | None = None
    raw: bool = False
    coordinator_port: int = L.DEFAULT_COORDINATOR_PORT
    heartbeat_timeout: int | None = None
    init_timeout: int | None = None
    on_preemption: str = "recreate"
    hang_timeout: float = 300.0
    max_restarts: int = 3
    plan: bool = True
    bundle: B.Bundle | None = None   # built already (a managed job's, fetched from its bucket): pushed as it is
    cancelled: Callable[[], bool] | None = None  # a managed job's cancel request: its end is not a preemption
    # A managed job's run as its record last named it: a new controller follows that run where the hosts still
    # know it (going, or ended while no controller watched) instead of running the command again.
    follow_run: str | None = None
    on_attempt: Callable[[list[dict]], None] | None = None  # supervise's Policy.on_attempt (a managed job's record)
    # A managed job's restarts so far, as its record counts them across controllers: --max-restarts is one budget
    # for the whole job. restart_pending: the last one was begun and its controller died before the slice was
    # READY again (recover_before_run finishes it without counting it again).
    restarts_used: int = 0
    restart_pending: bool = False


def command_argv(command: list[str], raw: bool = False) -> list[str]:
    """What runs on the hosts: a trainer command (`pretrain ...`), a script on the bundle's Python
    (`python x.py`), or with --raw the command as it is."""
    if not command:
        raise UserError("nothing to run: `tpuctl run NAME -- pretrain --preset gpt2-tiny ...`")
    if raw:
        return list(command)
    if command[0] in ("python", "python3"):
        return [L.PYTHON, *command[1:]]
    return [L.PYTHON, "-m", "trainer", *command]


def run_dir_for(name: str, run_id: str) -> Path:
    d = home() / "runs" / name / run_id
    d.mkdir(parents=True, exist_ok=True)
    (d / RUNNER_PID).write_text(str(os.getpid()))
    return d


def _slice_lost(name: str) -> Callable[[], bool]:
    """While a connection is away: is the slice itself gone (preempted, deleted)? Then supervise recovers it now
    instead of after the whole --ssh-wait."""
    from orchestrator.jobs import supervise
    return lambda: supervise.lost(name) is not None


def run(name: str, command: list[str], flags: SshFlags = SshFlags(), opts: RunOptions = RunOptions(), *,
        out: TextIO, note: Callable[[str], None] = lambda m: None) -> RunResult:
    """Run `command` on every worker of slice NAME (or --hosts) at once and follow it to its end; returns the
    RunResult, raises RunFailed (with .result) when it fails or is interrupted. The same command given while its
    run is still going on the hosts follows that run instead of starting another."""
    from orchestrator.jobs.supervise import Policy, recover_before_run, supervise
    argv = command_argv(command, opts.raw)
    say = lambda m: print(f"[tpuctl] {m}", file=out, flush=True)  # noqa: E731
    policy = Policy(on_preemption=opts.on_preemption, max_restarts=opts.max_restarts, cancelled=opts.cancelled,
                    on_attempt=opts.on_attempt)
    # Preempted since the last run: the same --on-preemption policy as during a run.
    restarts_used = opts.restarts_used
    if not flags.hosts:
        restarts_used += recover_before_run(name, policy=policy, progress=say, used=opts.restarts_used,
                                            pending=opts.restart_pending)
    target = reach(name, flags, say=note)
    if target.slices > 1:
        per = len(target.workers) // target.slices
        say(f"one job over {target.slices} slices of {target.accelerator} joined by DCN: {len(target.workers)} "
            f"hosts, process = slice x {per} + worker, coordinator s0w0")
    if opts.plan and argv[:3] == [L.PYTHON, "-m", "trainer"]:
        from orchestrator.plan import step as P
        P.check_before_run(target.accelerator, target.slices, argv[3:], target.where.local_env(argv),
                           cpu_devices=target.where.cpu_devices, say=say)
    env = {**target.where.run_env(name, argv, target.devices_per_host), **opts.env}
    bundle = install = layout = None
    if not opts.raw:
        bundle = opts.bundle or B.build(workdir=opts.workdir, extras=B.trainer_extras(argv, L.PYTHON))
        if target.access.wheelhouse:  # hosts that share this machine's wheelhouse install from it
            install, layout = shared_install(target.access.wheelhouse, bundle, python=target.access.python, log=say)
    watch = Watch(report_failure=bool(flags.hosts), hang_timeout_s=opts.hang_timeout or None,
                  slice_lost=None if flags.hosts else _slice_lost(name))

    follow = [opts.follow_run] if opts.follow_run else []  # asked of the first attempt's hosts only

    def attempt(n: int) -> RunResult:
        nonlocal target
        if n:  # a recreated slice: new workers (and, where the provider says so, new SSH settings)
            target = reach(name, replace(flags, hosts=None, local=None), say=note)
        if follow and (known := _known_run(target, follow.pop(), L.command_tag(argv, env))):
            run_id, going = known
            if going:
                say(f"run {run_id} of this same command is still going on the hosts: following it (Ctrl-C stops "
                    "it; `tpuctl cancel` from anywhere)")
            else:  # its exit codes are on the hosts: a rerun would only resume and end, under another run id
                say(f"run {run_id} of this same command ended on the hosts while nobody followed it: reading how "
                    "it ended (no rerun)")
            return attach_job(target.workers, run_id, ssh=target.ssh, run_dir=run_dir_for(name, run_id),
                              layout=layout, watch=watch, out=out)
        run_id = L.new_run_id()
        spec = L.LaunchSpec(argv=argv, env=env, run_id=run_id, coordinator_port=opts.coordinator_port,
                            **L.timeouts(target.workers, opts.heartbeat_timeout, opts.init_timeout))
        try:
            return run_job(target.workers, spec, ssh=target.ssh, run_dir=run_dir_for(name, run_id),
                           secret_env=opts.secrets, bundle=bundle, install=install, layout=layout,
                           kill_stale=opts.kill_stale, out=out, watch=watch)
        except RunGoing as e:
            _drop_unstarted(name, run_id)
            tag = L.command_tag(argv, env)
            same = [r for r, t in e.runs.items() if t == tag]
            if len(e.runs) == 1 and same:
                say(f"run {same[0]} of this same command is still going on the hosts: following it (Ctrl-C stops "
                    "it; `tpuctl cancel` from anywhere)")
                return attach_job(target.workers, same[0], ssh=target.ssh, run_dir=run_dir_for(name, same[0]),
                                  layout=layout, watch=watch, out=out)
            raise UserError(f"{e}: `tpuctl attach {name}` follows it, `tpuctl cancel {name}` stops it (or run with "
                            "--kill-stale to stop it first)") from None

    if flags.hosts:  # no slice to ask about or recreate
        return attempt(0)
    return supervise(name, attempt, policy=policy, progress=say, restarts_used=restarts_used)


def _known_run(target: Target, run_id: str, tag: str) -> tuple[str, bool] | None:
    """(run_id, going) when every host knows run_id as this command's run (hostwrap's pidfile or exit file):
    going on some host, or ended with an exit status on all of them. None when the hosts do not know it (a
    recreated slice), it is another command's, or a host lost it without a status (its VM restarted): then the
    command runs again and the trainer resumes."""
    n = len(target.workers)
    with Hosts(target.workers, target.ssh) as h:
        h.wait_reachable()
        run = live_runs(h).get(run_id)
    if run is None or run["tag"] != tag or len(run["hosts"]) != n or not (run["running"] or len(run["rc"]) == n):
        return None
    return run_id, run["running"]


def _drop_unstarted(name: str, run_id: str) -> None:
    """The run directory of a run that never launched (preflight found another going)."""
    d = home() / "runs" / name / run_id
    for f in d.glob("*"):
        f.unlink()
    d.rmdir()


def _going(name: str, hosts: Hosts) -> dict[str, dict]:
    runs = {r: d for r, d in live_runs(hosts).items() if d["running"]}
    if not runs:
        raise UserError(f"no tpuctl run is going on the hosts of {name}: `tpuctl logs {name}` shows the last one")
    return runs


def attach(name: str, flags: SshFlags = SshFlags(), *, out: TextIO, note: Callable[[str], None] = lambda m: None,
           hang_timeout: float = 300.0) -> RunResult:
    """Follow the run that is going on slice NAME's hosts, started from another terminal or machine (or by a
    tpuctl that was killed), to its end, as `run` follows its own: Ctrl-C stops it, the first failure stops
    every host. Raises RunFailed like `run`, UserError when no run is going."""
    target: Target = reach(name, flags, say=note)
    with Hosts(target.workers, target.ssh) as h:
        h.wait_reachable(note)
        runs = _going(name, h)
    if len(runs) > 1:  # hostwrap's preflight never lets two start: only another tool could have
        raise UserError(f"{len(runs)} tpuctl runs are going on the hosts of {name} ({', '.join(sorted(runs))}): "
                        f"`tpuctl cancel {name}` stops them")
    run_id = next(iter(runs))
    started = runs[run_id].get("started")
    when = time.strftime(" (started %H:%M:%S)", time.localtime(started)) if started else ""
    print(f"[tpuctl] attached to run {run_id}{when} on {len(target.workers)} host(s): Ctrl-C stops it",
          file=out, flush=True)
    watch = Watch(report_failure=True, hang_timeout_s=hang_timeout or None,
                  slice_lost=None if flags.hosts else _slice_lost(name))
    return attach_job(target.workers, run_id, ssh=target.ssh, run_dir=run_dir_for(name, run_id), watch=watch,
                      out=out)


def cancel(name: str, flags: SshFlags = SshFlags(), *, note: Callable[[str], None] = lambda m: None,
           grace: float = 10.0) -> list[str]:
    """Stop every tpuctl run going on slice NAME's hosts (SIGTERM, SIGKILL after `grace`: the trainer saves on
    SIGTERM when it can); the slice stays. Returns the run ids stopped; UserError when none was going."""
    target = reach(name, flags, say=note)
    with Hosts(target.workers, target.ssh) as h:
        h.wait_reachable(note)
        runs = _going(name, h)
        for run_id in runs:
            stop_run(h, run_id, grace=grace)
        left = [r for r, d in live_runs(h).items() if d["running"] and r in runs]
    if left:
        raise UserError(f"run {', '.join(left)} on {name} did not stop: `tpuctl ssh {name} --worker all -- ps -ef` "
                        "shows what is left")
    return sorted(runs)
