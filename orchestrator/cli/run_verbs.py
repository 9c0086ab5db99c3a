"""`tpuctl run`, `attach`, `cancel`, `ssh`, `logs`: plain click commands, registered into the `tpuctl` group by
orchestrator/cli/app.py (`cli.add_command(run)` ...); also runnable alone: `python -m orchestrator.cli.run_verbs run ...`.

They parse their flags and call the API: `orchestrator.access.reach` turns a slice's name into its workers and
how to reach them; `orchestrator.jobs` runs the job on them.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import functools
from pathlib import Path

import click

from orchestrator.cli.options import PassThrough, local_option
from orchestrator.cli.options import errors as _errors
from orchestrator.jobs import launch as L
from orchestrator.spec import UserError
from orchestrator.state import home as _home


def _note(m: str) -> None:
    click.echo(f"[tpuctl] {m}", err=True)

_SSH_FLAGS = ("hosts", "local", "ssh_user", "ssh_key", "ssh_port", "ssh_wait", "internal_ip", "ssh_proxy_command",
              "iap")


def _ssh_options(verb):
    """The flags of every verb that crosses SSH, handed to it as one `flags: SshFlags`."""
    @functools.wraps(verb)
    def f(*args, **kwargs):
        from orchestrator.access.reach import SshFlags  # fabric and the TPU client load only for a verb that runs
        return verb(*args, flags=SshFlags(**{k: kwargs.pop(k) for k in _SSH_FLAGS}), **kwargs)
    f = click.option("--internal-ip", is_flag=True,
                     help="Connect to the workers' internal IPs even where they have external ones (this machine "
                          "is inside the VPC). Workers without an external IP are always reached internally.")(f)
    f = click.option("--ssh-wait", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
                     help="How long to keep trying to reach a worker that refuses or drops the connection (a new "
                          "VM starts sshd some time after READY; a run's connection that drops is opened again "
                          "for this long while the run goes on). Default 180. A refused key fails at once.")(f)
    f = click.option("--ssh-port", type=int, help="SSH port (default 22, or what the slice's provider says).")(f)
    f = click.option("--ssh-key", type=click.Path(dir_okay=False),
                     help="Private key (default ~/.ssh/google_compute_engine, as gcloud makes; env TPUCTL_SSH_KEY).")(f)
    f = click.option("--ssh-user", help="SSH user (default: your user name; env TPUCTL_SSH_USER).")(f)
    f = click.option("--iap", is_flag=True,
                     help="Reach the workers through Cloud IAP TCP forwarding: `gcloud compute start-iap-tunnel VM "
                          "22 --listen-on-stdin --zone=Z --project=P` per worker (docs/access.md).")(f)
    f = click.option("--ssh-proxy-command", metavar="CMD",
                     help="Connect through CMD (OpenSSH ProxyCommand: %h %p = the worker's address and port, %r = "
                          "the user); default: what `up` recorded, or $TPUCTL_SSH_PROXY_COMMAND.")(f)
    f = click.option("--hosts", metavar="IP[:PORT],...",
                     help="Connect to these hosts (worker order) instead of looking the slice up.")(f)
    f = local_option(f)
    return f


# ------------------------------------------------------------------------------ run
@click.command("run", cls=PassThrough)
@click.argument("name")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--env", "env_pairs", multiple=True, metavar="K=V", help="Set K=V in the trainer's environment on "
              "every host (repeatable).")
@click.option("--secret-env", "secret_names", multiple=True, metavar="K",
              help="Pass $K from your environment to the trainer on every host, through stdin into a 0600 file: "
                   "never in argv or state (repeatable). Output lines that show it are masked (***) on the hosts "
                   "and here: the value as it is, JSON-escaped or as Python's repr, and each line of a multi-line "
                   "value that is 6 characters or longer.")
@click.option("--kill-stale", is_flag=True, help="Kill processes that hold the accelerator (and stale lockfiles, "
              "earlier tpuctl trainers) instead of stopping at preflight.")
@click.option("--workdir", type=click.Path(file_okay=False, exists=True),
              help="Also ship this directory (the trainer runs in it, and it is on PYTHONPATH).")
@click.option("--raw", is_flag=True, help="Run COMMAND as it is (no bundle, no Python environment needed).")
@click.option("--coordinator-port", type=int, default=L.DEFAULT_COORDINATOR_PORT, show_default=True)
@click.option("--heartbeat-timeout", type=int, default=None,
              help="Seconds before jax.distributed declares a silent host dead (default 10; 60 on several slices).")
@click.option("--init-timeout", type=int, default=None,
              help="Seconds jax.distributed waits for every host to join (default 60; 600 on several slices).")
@click.option("--json", "as_json", is_flag=True, help="Stream the hosts' output to stderr and print the result as "
              "JSON on stdout.")
@click.option("--on-preemption", type=click.Choice(["recreate", "fail"]), default="recreate", show_default=True,
              help="When the slice's VMs are preempted mid-run (not for --hosts): recreate the slice and run the "
                   "same command again (the trainer resumes from the latest step), or stop and say so.")
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=300, show_default=True, metavar="SECONDS",
              help="Stop every host when no host has reported a new step for this long (each must have reported one: "
                   "compiles and the first step are not judged), naming the host that stopped advancing. 0: never.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              help="At most this many recreations per run.")
@click.option("--no-plan", is_flag=True, help="Launch without first checking the train step against the slice "
              "(`tpuctl plan`: compiled for its accelerator, refused when it does not fit; cached).")
@click.option("--detach", is_flag=True, help="A managed job: hand the run to the tpuctl controller (a small VM of its "
              "own, created on first use) and return once it has taken it. It supervises the run as this command "
              "would, with this machine off. Needs a gs:// --ckpt-dir; `tpuctl jobs`, `logs JOB`, `cancel JOB` "
              "follow it from any machine (docs/jobs.md).")
@click.option("--controller-service-account", default="default", show_default=True, metavar="EMAIL",
              help="With --detach: the service account the controller's VM runs as (default: the project's default "
                   "compute one). It needs roles/storage.objectAdmin on the bucket and roles/tpu.admin.")
@click.option("--controller-idle", type=click.FloatRange(min=0), default=10, show_default=True, metavar="MINUTES",
              help="With --detach: the controller deletes its own VM after this long with no live job.")
@_ssh_options
@_errors
def run(name, command, env_pairs, secret_names, kill_stale, workdir, raw, coordinator_port, heartbeat_timeout,
        init_timeout, as_json, on_preemption, hang_timeout, max_restarts, no_plan, detach, controller_service_account,
        controller_idle, flags):
    """Ship the code to every worker of NAME and run COMMAND there, all at once.

    \b
      tpuctl run NAME -- pretrain --preset gpt2-124m --ckpt-dir gs://BUCKET/run1
      tpuctl run NAME -- python my_script.py --flag      (the bundle's Python; with --workdir .)
      tpuctl run NAME --raw -- nvidia-smi                 (as it is, nothing installed)

    Preflight (reachable, Python, disk, accelerator held by a stale process, clock), push (one wheel, installed
    once per content hash), launch with jax.distributed settings, prefixed output per host. A trainer step on a
    slice of known type is planned first (`tpuctl plan`, cached) and refused if it does not fit (--no-plan
    skips). The first host
    to fail stops all others; Ctrl-C stops every host. If the slice is preempted, it is recreated and the
    command runs again (--on-preemption, --max-restarts); a crash on a healthy slice is not retried.

    The run belongs to the hosts, not to this terminal's SSH connections: a dropped connection (a laptop asleep,
    the network gone, tpuctl killed) leaves the trainer running; tpuctl reconnects for up to --ssh-wait and
    streams on from where each host's log left off. `tpuctl attach NAME` follows a run from another terminal or
    machine (the same `tpuctl run` given again does too); `tpuctl cancel NAME` stops it.
    """
    from orchestrator.jobs import attached
    from orchestrator.jobs.runner import RunFailed
    opts = attached.RunOptions(env=L.parse_env(env_pairs), secrets=L.read_secrets(secret_names, dict(os.environ)),
                               kill_stale=kill_stale, workdir=workdir, raw=raw, coordinator_port=coordinator_port,
                               heartbeat_timeout=heartbeat_timeout, init_timeout=init_timeout,
                               on_preemption=on_preemption, hang_timeout=hang_timeout, max_restarts=max_restarts,
                               plan=not no_plan)
    out = sys.stderr if as_json else sys.stdout
    if detach:
        _detach(name, list(command), opts, flags, controller_service_account, controller_idle, as_json)
        return
    try:
        res = attached.run(name, list(command), flags, opts, out=out, note=_note)
    except RunFailed as e:  # not a preemption (that is recreated, or raised as Preempted)
        res = e.result
        if res.report and not flags.hosts:
            click.echo(res.report, file=out)
        click.echo(f"Error: {e}", err=True)
    except KeyboardInterrupt:  # outside a run (recreating, asking the API): up/down clean up after themselves
        click.echo("Error: interrupted", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps({"name": name, "run_id": res.run_id, "run_dir": str(res.run_dir),
                               "returncode": res.returncode, "exit_codes": res.exit_codes,
                               "failed_worker": res.failed_worker, "push": res.push, "timings": res.timings,
                               "attempts": res.attempts, "goodput": res.goodput,
                               "steps_redone": sum(a.get("steps_redone", 0) for a in res.attempts)}))
    elif res.ok:
        click.echo(f"[tpuctl] done on {len(res.exit_codes)} host(s) in {res.timings.get('total_s', 0):.1f} s; "
                   f"logs: {res.run_dir}", file=out)
    sys.exit(res.returncode)


def _detach(name, command, opts, flags, service_account, idle, as_json) -> None:
    from orchestrator.jobs import managed
    if flags.hosts:
        raise UserError("--detach and --hosts exclude each other: a managed job runs on a slice `tpuctl up` made "
                        "(its controller recreates it when preempted)")
    job = managed.submit(name, command, opts, managed.DetachOptions(controller_service_account=service_account,
                                                                    controller_idle=idle), say=_note)
    if as_json:
        click.echo(json.dumps(job))
        return
    click.echo(f"job {job['id']} taken by the controller ({job['controller']}); this machine can go.\n"
               f"  tpuctl jobs --bucket {job['bucket']}          state, step, recoveries, goodput, cost\n"
               f"  tpuctl logs {job['id']} --follow --bucket {job['bucket']}\n"
               f"  tpuctl cancel {job['id']} --bucket {job['bucket']}   [--down: delete the slice too]")


# ------------------------------------------------------------------------------ attach, cancel
@click.command("attach")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Stream the hosts' output to stderr and print the result as "
              "JSON on stdout.")
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=300, show_default=True, metavar="SECONDS",
              help="As for `tpuctl run`: stop every host when none has reported a new step for this long. 0: never.")
@_ssh_options
@_errors
def attach(name, as_json, hang_timeout, flags):
    """Follow the run going on NAME's hosts, started from another terminal or machine, to its end.

    \b
      tpuctl attach NAME

    Each host's log is streamed from its start (and kept under ~/.tpuctl/runs/NAME/RUN_ID, as for `run`), the
    first failure stops every host, and Ctrl-C stops the run, as in the terminal that started it. Exits with the
    run's status.
    """
    from orchestrator.jobs import attached
    from orchestrator.jobs.runner import RunFailed
    out = sys.stderr if as_json else sys.stdout
    try:
        res = attached.attach(name, flags, out=out, note=_note, hang_timeout=hang_timeout)
    except RunFailed as e:
        res = e.result
        click.echo(f"Error: {e}", err=True)
    if as_json:
        click.echo(json.dumps({"name": name, "run_id": res.run_id, "run_dir": str(res.run_dir),
                               "returncode": res.returncode, "exit_codes": res.exit_codes,
                               "failed_worker": res.failed_worker}))
    elif res.ok:
        click.echo(f"[tpuctl] run {res.run_id} done on {len(res.exit_codes)} host(s); logs: {res.run_dir}", file=out)
    sys.exit(res.returncode)


@click.command("cancel")
@click.argument("name")
@click.option("--grace", type=click.FloatRange(min=0), default=10, show_default=True, metavar="SECONDS",
              help="Time the trainer gets after SIGTERM (it saves a checkpoint on it when it can) before SIGKILL.")
@click.option("--json", "as_json", is_flag=True, help="Print the stopped run ids (or the job's state) as JSON.")
@click.option("--down", is_flag=True, help="For a managed job: also delete its slice once every host stopped.")
@click.option("--bucket", "buckets", multiple=True, metavar="BUCKET",
              help="For a managed job: the bucket it was submitted to (default: $TPUCTL_JOBS_BUCKET, else those "
                   "this machine submitted to).")
@_ssh_options
@_errors
def cancel(name, grace, as_json, down, buckets, flags):
    """Stop the run going on NAME's hosts, or managed job JOB, from any terminal or machine; the slice stays
    (unless --down, for a job).

    \b
      tpuctl cancel NAME
      tpuctl cancel JOB [--down]       (job-YYYYMMDD-HHMMSS-xxxx, from `tpuctl jobs`)
    """
    from orchestrator.jobs.store import is_job_id
    if is_job_id(name):
        from orchestrator import provider
        from orchestrator.jobs import managed
        prov = provider.chosen(flags.local)
        store, spec = managed.find(name, managed.buckets(buckets), prov)
        st = managed.cancel(store, spec, prov, down=down, say=_note)
        if as_json:
            click.echo(json.dumps(st))
        else:
            click.echo(f"[tpuctl] job {name} {st['state']}: {st.get('message', '')}")
        return
    if down:
        raise UserError("--down is for a managed job (cancel JOB --down); for a slice: `tpuctl cancel NAME` then "
                        "`tpuctl down NAME`")
    from orchestrator.jobs import attached
    stopped = attached.cancel(name, flags, note=_note, grace=grace)
    if as_json:
        click.echo(json.dumps({"name": name, "cancelled": stopped}))
    else:
        click.echo(f"[tpuctl] stopped run {', '.join(stopped)} on every host of {name}; the slice is kept "
                   f"(`tpuctl down {name}` deletes it)")


# ------------------------------------------------------------------------------ ssh
def _select(workers: list[L.Worker], worker: str) -> list[int]:
    if worker == "all":
        return list(range(len(workers)))
    if not worker.isdigit() or int(worker) >= len(workers):
        raise UserError(f"--worker {worker}: pick 0..{len(workers) - 1} or all")
    return [int(worker)]


@click.command("ssh", cls=PassThrough)
@click.argument("name")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--worker", "-w", default="0", show_default=True, help="Worker index, or all.")
@_ssh_options
@_errors
def ssh(name, command, worker, flags):
    """Run COMMAND on one or all workers of NAME (output prefixed [wI]), or open a shell on one.

    \b
      tpuctl ssh NAME --worker all -- nproc
      tpuctl ssh NAME --worker 1
    """
    from orchestrator.access.hosts import Hosts
    from orchestrator.access.reach import reach
    target = reach(name, flags, say=_note)
    idx = _select(target.workers, worker)
    if not command:
        if len(idx) != 1:
            raise UserError("a shell needs one worker: --worker N (or give a command for --worker all)")
        w = target.workers[idx[0]]
        args = ["ssh", "-p", str(w.port or target.ssh.port), f"{target.ssh.user}@{w.address}"]
        if target.ssh.key:
            args[1:1] = ["-i", target.ssh.key, "-o", "IdentitiesOnly=yes"]
        published = False
        if target.ssh.host_keys is not None:  # the keys the VM published, written to the slice's known_hosts
            with Hosts([w], target.ssh) as h:
                h.pin_published(_note)
                published = bool(h.published)
        # The slice's own pins (the same file `run` checks): exactly the published keys where there are some,
        # else first contact pins; a changed key is refused.
        args[1:1] = ["-o", f"StrictHostKeyChecking={'yes' if published else 'accept-new'}",
                     "-o", f"UserKnownHostsFile={target.ssh.known_hosts}", "-o", "LogLevel=ERROR"]
        if target.ssh.proxy_commands.get(w.index):  # OpenSSH expands %h %p %r %% itself, the same way
            args[1:1] = ["-o", f"ProxyCommand={target.ssh.proxy_commands[w.index]}"]
        Path(target.ssh.known_hosts).parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        os.execvp("ssh", args)
    # Only the chosen workers are reached: `-w 0` never waits on, or needs, another worker.
    with Hosts([target.workers[i] for i in idx], target.ssh) as h:
        h.wait_reachable(_note)
        codes = h.stream(" ".join(command) if len(command) == 1 else _join(command),
                         prefix=len(target.workers) > 1 or len(idx) > 1)
        names = [w.name for w in h.workers]
    bad = {names[i]: rc for i, rc in codes.items() if rc}
    if bad:
        click.echo("Error: " + ", ".join(f"{n} exited {rc}" for n, rc in bad.items()), err=True)
        sys.exit(max(bad.values()) if max(bad.values()) < 256 else 1)


def _join(command: list[str]) -> str:
    import shlex
    return " ".join(shlex.quote(c) for c in command)


# ------------------------------------------------------------------------------ logs
def _run_dir(name: str, run_id: str | None) -> Path:
    base = _home() / "runs" / name
    if run_id:
        d = base / run_id
        if not d.is_dir():
            raise UserError(f"no run {run_id} of {name} in {base}")
        return d
    runs = sorted(d for d in base.glob("*") if d.is_dir()) if base.is_dir() else []
    if not runs:
        raise UserError(f"no runs of {name} yet (they are kept in {base}): `tpuctl run {name} -- ...`")
    return runs[-1]


@click.command("logs")
@click.argument("name")
@click.option("--worker", "-w", default="all", show_default=True,
              help="Worker index, a multislice run's host (s1w0), or all. For a managed job: that host's own log "
                   "from the job's bucket, each run of the job in turn (--run: one), instead of the controller's "
                   "stream.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the run ends (Ctrl-C to stop).")
@click.option("--run", "run_id", help="Run id (default: the latest run of NAME).")
@click.option("--tail", type=click.IntRange(min=0), default=0, help="Only the last N lines of each host (0: all).")
@click.option("--bucket", "buckets", multiple=True, metavar="BUCKET",
              help="For a managed job: the bucket it was submitted to (default: $TPUCTL_JOBS_BUCKET, else those "
                   "this machine submitted to).")
@local_option
@_errors
def logs(name, worker, follow, run_id, tail, buckets, local):
    """Show the per-host logs of NAME's latest (or --run) run, prefixed [wI]; or managed job JOB's log, read from
    its bucket (from any machine): every attempt's host lines [wI] and the controller's own [tpuctl], in order.

    \b
      tpuctl logs NAME [--follow] [--worker N]
      tpuctl logs JOB [--follow]              (job-YYYYMMDD-HHMMSS-xxxx, from `tpuctl jobs`)
      tpuctl logs JOB --worker N [--follow]   one host's own log, as it wrote it: each run of the job in turn
                                              (a `[tpuctl] run RUN_ID` line before the next attempt's), or
                                              --run RUN_ID's only; --follow goes on to the run after a recovery
    """
    from orchestrator.jobs.store import is_job_id
    if is_job_id(name):
        from orchestrator import provider
        from orchestrator.jobs import managed
        prov = provider.chosen(local)
        if run_id and worker == "all":
            raise UserError(f"--run {run_id} with a job: add --worker N for that run's host log (the job's own log "
                            "has every run)")
        if tail:
            raise UserError(f"--tail is for a slice's runs: `tpuctl logs {name} | tail -n {tail}`")
        store, spec = managed.find(name, managed.buckets(buckets), prov)
        try:
            if worker != "all":
                st = managed.host_logs(store, spec, managed.job_host(store, spec, worker), follow=follow,
                                       out=click.echo, run_id=run_id)
            else:
                st = managed.logs(store, spec, follow=follow, out=click.echo)
        except KeyboardInterrupt:
            return
        if follow:
            click.echo(f"[tpuctl] job {name} {st['state']}", err=True)
        return
    d = _run_dir(name, run_id)
    # One log per host: w<i>.log, or s<slice>w<i>.log on several slices (in process order).
    files = sorted((f for f in d.glob("*.log") if re.fullmatch(r"(s\d+)?w\d+", f.stem)),
                   key=lambda p: tuple(int(x) for x in re.findall(r"\d+", p.stem)))
    if worker != "all":
        if not re.fullmatch(r"(s\d+)?w?\d+", worker):
            raise UserError(f"--worker {worker}: pick a worker index, a host such as s1w0, or all")
        want = worker if not worker.isdigit() else f"w{worker}"
        files = [f for f in files if f.stem == want]
        if not files:
            raise UserError(f"no log of worker {worker} in {d}")
    prefix = len(files) > 1 or worker == "all"
    handles = []
    for f in files:
        h = open(f, encoding="utf-8", errors="replace")
        lines = h.readlines()
        for line in lines[-tail:] if tail else lines:
            click.echo((f"[{f.stem}] " if prefix else "") + line.rstrip("\n"))
        handles.append((f.stem, h))
    if not follow:
        return
    try:
        while True:
            got = False
            for stem, h in handles:
                for line in h.readlines():
                    got = True
                    click.echo((f"[{stem}] " if prefix else "") + line.rstrip("\n"))
            if not got and _finished(d):
                for stem, h in handles:  # what arrived between the last read and the end
                    for line in h.readlines():
                        click.echo((f"[{stem}] " if prefix else "") + line.rstrip("\n"))
                return
            time.sleep(0.2)
    except KeyboardInterrupt:
        return


def _finished(d: Path) -> bool:
    """The run ended: its record says so, or the tpuctl that ran it is gone (killed before it could record)."""
    try:
        if "returncode" in json.loads((d / "run.json").read_text()):
            return True
    except (OSError, ValueError):
        pass
    try:
        from orchestrator.jobs.attached import RUNNER_PID
        pid = int((d / RUNNER_PID).read_text())
    except (OSError, ValueError):
        return False
    from orchestrator.jobs.procs import pid_alive
    if pid_alive(pid):
        return False
    click.echo(f"[tpuctl] the tpuctl that ran {d.name} (pid {pid}) is gone without recording the end of the run",
               err=True)
    return True


@click.group()
def main():
    """tpuctl run / attach / cancel / ssh / logs on their own (the `tpuctl` command registers the same commands)."""


for _cmd in (run, attach, cancel, ssh, logs):
    main.add_command(_cmd)

if __name__ == "__main__":
    main()
