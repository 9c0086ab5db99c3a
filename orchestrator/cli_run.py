"""`tpuctl run`, `tpuctl ssh`, `tpuctl logs`: plain click commands, registered into the `tpuctl` group by
orchestrator/cli.py (`cli.add_command(run)` ...); also runnable alone: `python -m orchestrator.cli_run run ...`.

Workers come from the slice's record and the TPU API (orchestrator.slices.workers), or directly from
`--hosts ip[:port],...`. Where the slice's provider knows better than the TPU VM defaults (its hosts' SSH user,
key and port, a shared wheelhouse), `HostAccess` says so; what a run needs on the hosts is the provider's
`run_env`.
"""
from __future__ import annotations

import getpass
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from orchestrator import hostkeys, sshproxy
from orchestrator import launch as L
from orchestrator import provider
from orchestrator.cli_common import errors as _errors
from orchestrator.cli_common import local_option
from orchestrator.cli_common import PassThrough
from orchestrator.hosts import Hosts, SshConfig
from orchestrator.provider import HostAccess, Provider
from orchestrator.spec import UserError
from orchestrator.state import home as _home

DEFAULT_SSH_PORT = 22


# ------------------------------------------------------------------------------ workers and SSH
@dataclass
class Target:
    name: str
    workers: list[L.Worker]
    ssh: SshConfig
    where: Provider
    access: HostAccess = HostAccess()
    devices_per_host: int | None = None  # from the accelerator type, when the slice is recorded
    accelerator: str | None = None  # the recorded slice's type (the plan checks the step against it)
    slices: int = 1                 # a multislice record: one job over this many slices of `accelerator`


def _parse_hosts(spec: str) -> list[L.Worker]:
    out = []
    for i, item in enumerate(x.strip() for x in spec.split(",") if x.strip()):
        host, _, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        if not port.isdigit() and port:
            raise UserError(f"--hosts {item!r}: write ip or ip:port, comma-separated")
        out.append(L.Worker(index=i, internal_ip=host, port=int(port) if port else None))
    if not out:
        raise UserError("--hosts is empty: write --hosts 10.0.0.2,10.0.0.3[:22]")
    return out


def known_hosts_file(name: str, created_at: float | None) -> Path:
    """Where the host keys of slice NAME are pinned. A recreated slice (a new record) gets a file of its own,
    and the files of the slice's earlier incarnations are removed: new VMs, new host keys."""
    d = _home() / "known_hosts"
    stem = f"{name}@{int(created_at * 1000) if created_at else 'hosts'}"
    for old in d.glob(f"{name}@*"):
        if old.name.split(".")[0] != stem:
            old.unlink(missing_ok=True)
    return d / stem


def resolve(name: str, *, hosts: str | None = None, local: bool | None = None, ssh_user: str | None = None,
            ssh_key: str | None = None, ssh_port: int | None = None, ssh_wait: float | None = None,
            internal_ip: bool = False, ssh_proxy_command: str | None = None, iap: bool = False) -> Target:
    """The workers of slice NAME (or --hosts) and how to SSH to them (flags > env > provider > TPU VM defaults;
    the proxy: --ssh-proxy-command > --iap > TPUCTL_SSH_PROXY_COMMAND > what `up` recorded)."""
    if ssh_proxy_command and iap:
        raise UserError("--ssh-proxy-command and --iap exclude each other: --iap is a proxy command; pick one")
    if ssh_proxy_command is not None:
        _checked(ssh_proxy_command, "--ssh-proxy-command")
    from orchestrator import catalog, slices, state
    devices, created, accelerator, n_slices = None, None, None, 1
    rec = state.lookup(name)
    if hosts:
        workers = _parse_hosts(hosts)
        where = provider.chosen(local)  # no record consulted: the user says where these hosts live
        access = where.host_access(name)
    else:
        if rec is None:  # run takes no --zone/--project to look further: the record is where slices are found
            raise UserError(f"no slice named {name} in the local record: `tpuctl ls` lists them, "
                            f"`{' '.join(['tpuctl up', name, '...', *provider.chosen(local).cli_flags])}` creates it, "
                            "or pass --hosts IP,...")
        where = provider.of(rec)
        ws = slices.workers(name)
        created, n_slices = rec.created_at, rec.slices
        try:
            devices = catalog.lookup(rec.accelerator).devices_per_host
            accelerator = rec.accelerator
        except (ValueError, KeyError):
            devices = None
        # A worker without an external IP (--no-external-ips) is reached on its internal one; --internal-ip
        # forces that for all, for a machine inside the VPC.
        workers = [L.Worker(index=w.index, internal_ip=w.internal_ip, slice=w.slice,
                            external_ip=None if internal_ip else w.external_ip) for w in ws]
        access = where.host_access(name)
    user = ssh_user or os.environ.get("TPUCTL_SSH_USER") or access.user or getpass.getuser()
    key = ssh_key or os.environ.get("TPUCTL_SSH_KEY") or access.key
    port = ssh_port or int(os.environ.get("TPUCTL_SSH_PORT") or 0) or access.port or DEFAULT_SSH_PORT
    ssh = SshConfig(user=user, port=port) if key is None else SshConfig(user=user, key=key, port=port)
    ssh.known_hosts = str(known_hosts_file(name, created))
    ssh.slice = name
    if ssh_wait is not None:
        ssh.wait_s = ssh_wait
    env_proxy = os.environ.get(sshproxy.ENV) or None
    if not (ssh_proxy_command or iap) and env_proxy:
        ssh_proxy_command = _checked(env_proxy, sshproxy.ENV)
    elif not (ssh_proxy_command or iap) and rec is not None and not hosts:
        ssh_proxy_command, iap = rec.ssh_proxy_command, rec.iap
    if rec is not None and not hosts:
        ssh.host_keys = _published_keys(where, rec)
        if not (ssh_user or os.environ.get("TPUCTL_SSH_USER")) and _os_login(where, rec, ssh):
            ssh.os_login_project = rec.project
        if iap:
            ssh.proxy_commands = _iap_commands(where, rec)
    elif iap:
        raise UserError("--iap needs a slice tpuctl created (the workers' VM names come from the TPU API), not "
                        "--hosts: pass --ssh-proxy-command instead")
    if ssh_proxy_command:
        ssh.proxy_commands = {w.index: ssh_proxy_command for w in workers}
    return Target(name=name, workers=workers, ssh=ssh, where=where, access=access, devices_per_host=devices,
                  accelerator=accelerator, slices=n_slices)


def _checked(command: str, what: str) -> str:
    try:
        return sshproxy.check(command, what)
    except sshproxy.ProxyError as e:
        raise UserError(str(e)) from None


def _published_keys(where: Provider, rec) -> hostkeys.Published:
    """The workers' host keys as their guest agents published them (TPU API guest attributes, `hostkeys/`)."""
    from orchestrator.cloud import CloudError
    api = []

    def fetch() -> dict[tuple[int, int], list[tuple[str, str]]]:
        try:
            api[:] = api or [where.api_for(rec)]
            # {(slice, worker index): keys}: each slice's node publishes its own workers' (one node on one slice)
            per_node = [api[0].guest_attributes(node, hostkeys.NAMESPACE + "/") for node in rec.nodes]
        except CloudError as e:
            if e.kind == "permission":
                raise hostkeys.Unreadable(
                    f"cannot read the workers' published SSH host keys: your account lacks "
                    f"{hostkeys.PERMISSION} on project {rec.project}; pinning each worker's key on first contact "
                    "instead (grant that permission to have tpuctl check the keys the VMs publish)") from None
            raise hostkeys.Unreadable(f"cannot read the workers' published SSH host keys ({e}); pinning each "
                                      "worker's key on first contact instead") from None
        return {(sl, i): [(k, v) for ns, k, v in items if ns == hostkeys.NAMESPACE]
                for sl, attrs in enumerate(per_node) for i, items in enumerate(attrs)}
    return hostkeys.Published(slice=rec.name, fetch=fetch)


def _os_login(where: Provider, rec, ssh: SshConfig) -> bool:
    """With OS Login on for the slice: register the key (until the slice's expiry) and SSH as the POSIX user."""
    from orchestrator import oslogin, sshkeys
    from orchestrator.spec import LABEL_EXPIRY
    # The node's metadata is what `up` sent (recorded); only when it does not decide is the project asked.
    if not oslogin.applies(rec.project, rec.metadata, where.endpoint(rec.api_endpoint),
                           lambda m: click.echo(f"[tpuctl] {m}", err=True)):
        return False
    try:
        _, pub, _ = sshkeys.ensure_key(ssh.key or None)
    except (sshkeys.SshKeyError, OSError) as e:
        raise UserError(str(e)) from None
    expiry = rec.labels.get(LABEL_EXPIRY, "")
    ttl = max(60.0, float(expiry) - time.time()) if expiry.isdigit() else None
    ssh.user = oslogin.register(pub, project=rec.project, account_email=oslogin.account(), ttl_s=ttl)
    return True


def _iap_commands(where: Provider, rec) -> dict[int, str]:
    """Per worker: the IAP hop to its VM, named as the VM's guest agent publishes it (`hostname`)."""
    try:
        attrs = where.api_for(rec).guest_attributes(rec.node, "")
    except UserError as e:
        raise UserError(f"--iap: cannot read the workers' VM names from their guest attributes ({e})") from None
    out = {}
    for i, items in enumerate(attrs):
        vm = next((v for _ns, k, v in items if k == "hostname"), None)
        if not vm:
            raise UserError(f"--iap: worker {i} of {rec.name} has not published its VM name (guest attribute "
                            "hostname) yet; retry in a minute, or pass --ssh-proxy-command")
        try:
            out[i] = sshproxy.iap_command(vm, rec.zone, rec.project)
        except sshproxy.ProxyError as e:
            raise UserError(str(e)) from None
    return out


def _ssh_options(f):
    f = click.option("--internal-ip", is_flag=True,
                     help="Connect to the workers' internal IPs even where they have external ones (this machine "
                          "is inside the VPC). Workers without an external IP are always reached internally.")(f)
    f = click.option("--ssh-wait", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
                     help="How long to keep trying to reach a worker that refuses or drops the connection (a new "
                          "VM starts sshd some time after READY). Default 180. A refused key fails at once.")(f)
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


# ------------------------------------------------------------------------------ the trainer's own answers
def trainer_extras(argv: list[str]) -> list[str]:
    """The optional dependency groups a trainer command needs on the hosts (e.g. wandb for --wandb), as the
    trainer itself reads its flags (`python -m trainer extras`, jax-free). A command it refuses stops here,
    with its message, before anything is pushed."""
    if argv[:3] != [L.PYTHON, "-m", "trainer"]:
        return []
    import subprocess
    p = subprocess.run([sys.executable, "-m", "trainer", "extras", "--", *argv[3:]], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        err = [ln[len("error: "):] for ln in p.stderr.splitlines() if ln.startswith("error: ")]
        raise UserError(f"the trainer refuses the command: {err[-1] if err else p.stderr.strip()[-300:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ plan
def plan_gate(argv: list[str], target: Target, out) -> None:
    """A trainer step on a slice of known type is planned first, and refused when it does not fit."""
    from orchestrator import plan as P
    if argv[:3] != [L.PYTHON, "-m", "trainer"] or not target.accelerator:
        return
    say = lambda m: print(f"[tpuctl] {m}", file=out, flush=True)  # noqa: E731
    if target.slices > 1:
        say(f"plan: not checked here for {target.slices} slices (`tpuctl plan -a {target.accelerator} --num-slices "
            f"{target.slices} -- ...` plans one)")
        return
    # The planner reads what the trainer would (the data's meta.json: its tokenizer sets the vocabulary) from
    # the storage the run will use: for a local slice, the GCS emulator.
    storage = target.where.local_env(argv)
    saved = {k: os.environ.get(k) for k in storage}
    os.environ.update(storage)
    try:
        p = P.gate(target.accelerator, argv[3:], cpu_devices=target.where.cpu_devices, progress=say)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if p is not None:
        say(f"plan: {p.verdict()}")


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
@_ssh_options
@_errors
def run(name, command, env_pairs, secret_names, kill_stale, workdir, raw, coordinator_port, heartbeat_timeout,
        init_timeout, as_json, on_preemption, hang_timeout, max_restarts, no_plan, internal_ip, ssh_wait, ssh_port,
        ssh_key, ssh_user, hosts, ssh_proxy_command, iap, local):
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
    """
    from orchestrator import bundle as B
    from orchestrator.runner import RunFailed, Watch, run_job, shared_install
    command = list(command)
    if not command:
        raise UserError("nothing to run: `tpuctl run NAME -- pretrain --preset gpt2-tiny ...`")
    env = L.parse_env(env_pairs)
    secrets = L.read_secrets(secret_names, dict(os.environ))
    if raw:
        argv = command
    elif command[0] in ("python", "python3"):
        argv = [L.PYTHON, *command[1:]]
    else:
        argv = [L.PYTHON, "-m", "trainer", *command]
    out = sys.stderr if as_json else sys.stdout
    restarts_used = 0
    if not hosts:  # preempted since the last run: the same --on-preemption policy as during a run
        from orchestrator.supervise import Policy, recover_before_run
        restarts_used = recover_before_run(name, policy=Policy(on_preemption=on_preemption, max_restarts=max_restarts),
                                           progress=lambda m: print(f"[tpuctl] {m}", file=out, flush=True))
    target = resolve(name, hosts=hosts, local=local, ssh_user=ssh_user, ssh_key=ssh_key, ssh_port=ssh_port,
                     ssh_wait=ssh_wait, internal_ip=internal_ip, ssh_proxy_command=ssh_proxy_command, iap=iap)
    if target.slices > 1:
        per = len(target.workers) // target.slices
        print(f"[tpuctl] one job over {target.slices} slices of {target.accelerator} joined by DCN: "
              f"{len(target.workers)} hosts, process = slice x {per} + worker, coordinator s0w0", file=out, flush=True)
    if not no_plan:
        plan_gate(argv, target, out)
    env = {**target.where.run_env(name, argv, target.devices_per_host), **env}
    bundle = install = layout = None
    if not raw:
        bundle = B.build(workdir=workdir, extras=trainer_extras(argv))
        if target.access.wheelhouse:  # hosts that share this machine's wheelhouse install from it
            install, layout = shared_install(target.access.wheelhouse, bundle, python=target.access.python,
                                            log=lambda m: print(f"[tpuctl] {m}", file=out))

    def attempt(n: int):
        nonlocal target
        if n:  # a recreated slice: new workers (and, where the provider says so, new SSH settings)
            target = resolve(name, ssh_user=ssh_user, ssh_key=ssh_key, ssh_port=ssh_port, ssh_wait=ssh_wait,
                             internal_ip=internal_ip, ssh_proxy_command=ssh_proxy_command, iap=iap)
        run_dir = _home() / "runs" / name / L.new_run_id()
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUNNER_PID).write_text(str(os.getpid()))  # `logs --follow` stops once this process is gone
        spec = L.LaunchSpec(argv=argv, env=env, run_id=run_dir.name, coordinator_port=coordinator_port,
                            **L.timeouts(target.workers, heartbeat_timeout, init_timeout))
        return run_job(target.workers, spec, ssh=target.ssh, run_dir=run_dir, secret_env=secrets, bundle=bundle,
                       install=install, layout=layout, kill_stale=kill_stale, out=out,
                       watch=Watch(report_failure=bool(hosts), hang_timeout_s=hang_timeout or None))

    try:
        if hosts:  # no slice to ask about or recreate
            res = attempt(0)
        else:
            from orchestrator.supervise import Policy, supervise
            res = supervise(name, attempt, policy=Policy(on_preemption=on_preemption, max_restarts=max_restarts),
                            progress=lambda m: (print(f"[tpuctl] {m}", file=out, flush=True)),
                            restarts_used=restarts_used)
    except RunFailed as e:  # not a preemption (that is recreated, or raised as Preempted)
        res = e.result
        if res.report and not hosts:
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
        click.echo(f"[tpuctl] done on {len(target.workers)} host(s) in {res.timings.get('total_s', 0):.1f} s; "
                   f"logs: {res.run_dir}", file=out)
    sys.exit(res.returncode)


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
def ssh(name, command, worker, internal_ip, ssh_wait, ssh_port, ssh_key, ssh_user, hosts, ssh_proxy_command, iap,
        local):
    """Run COMMAND on one or all workers of NAME (output prefixed [wI]), or open a shell on one.

    \b
      tpuctl ssh NAME --worker all -- nproc
      tpuctl ssh NAME --worker 1
    """
    target = resolve(name, hosts=hosts, local=local, ssh_user=ssh_user, ssh_key=ssh_key, ssh_port=ssh_port,
                     ssh_wait=ssh_wait, internal_ip=internal_ip, ssh_proxy_command=ssh_proxy_command, iap=iap)
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
                h.pin_published(lambda m: click.echo(f"[tpuctl] {m}", err=True))
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
    with Hosts(target.workers, target.ssh) as h:
        h.wait_reachable(lambda m: click.echo(f"[tpuctl] {m}", err=True))
        codes = h.stream(" ".join(command) if len(command) == 1 else _join(command), idx,
                         prefix=len(target.workers) > 1 or len(idx) > 1)
    bad = {i: rc for i, rc in codes.items() if rc}
    if bad:
        click.echo("Error: " + ", ".join(f"w{i} exited {rc}" for i, rc in bad.items()), err=True)
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
              help="Worker index, a multislice run's host (s1w0), or all.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the run ends (Ctrl-C to stop).")
@click.option("--run", "run_id", help="Run id (default: the latest run of NAME).")
@click.option("--tail", type=click.IntRange(min=0), default=0, help="Only the last N lines of each host (0: all).")
@_errors
def logs(name, worker, follow, run_id, tail):
    """Show the per-host logs of NAME's latest (or --run) run, prefixed [wI]."""
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


RUNNER_PID = "tpuctl.pid"  # in a run's directory: the tpuctl process that runs it


def _finished(d: Path) -> bool:
    """The run ended: its record says so, or the tpuctl that ran it is gone (killed before it could record)."""
    try:
        if "returncode" in json.loads((d / "run.json").read_text()):
            return True
    except (OSError, ValueError):
        pass
    try:
        pid = int((d / RUNNER_PID).read_text())
    except (OSError, ValueError):
        return False
    from orchestrator.procs import pid_alive
    if pid_alive(pid):
        return False
    click.echo(f"[tpuctl] the tpuctl that ran {d.name} (pid {pid}) is gone without recording the end of the run",
               err=True)
    return True


@click.group()
def main():
    """tpuctl run / ssh / logs on their own (the `tpuctl` command registers the same commands)."""


main.add_command(run)
main.add_command(ssh)
main.add_command(logs)

if __name__ == "__main__":
    main()
