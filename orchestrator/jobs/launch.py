"""The per-host command line and environment of a run (pure functions: no SSH here).

Every host gets the same command except for its process id: the `jax.distributed` settings of
docs/CONTRACTS.md (coordinator = worker 0's internal IP), the user's --env values, and the trainer argv,
each shell-quoted so that spaces, quotes, `$()` and `;` reach the trainer unchanged and run nothing.
Secrets never appear here: they go through stdin into a 0600 file that hostwrap reads and deletes.
"""
from __future__ import annotations

import json
import re
import shlex
import time
import uuid
from dataclasses import dataclass, field

from orchestrator.state import Worker  # noqa: F401 - the one worker type, used here and by callers as L.Worker

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED = ("TPUCTL_COORDINATOR", "TPUCTL_NUM_PROCESSES", "TPUCTL_PROCESS_ID", "TPUCTL_RUN_ID",
            "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")
DEFAULT_COORDINATOR_PORT = 8476
HOST_ROOT = ".tpuctl-host"  # relative to the SSH user's home on every host
HOSTWRAP = "hostwrap.py"
PYTHON = "python"           # argv[0] == "python" means the host's environment for the bundle


class LaunchError(ValueError):
    """One clear line about a bad --env / --secret-env / command."""


@dataclass
class HostLayout:
    """Paths on a host, relative to the SSH user's home (absolute ones are kept as they are)."""
    root: str = HOST_ROOT
    # Where the dependency layer lives. Default: per host, under root. Hosts that share a machine (the
    # local slice) share one, so the jax stack is installed once per machine and dependency hash.
    deps_root: str | None = None

    def app(self, bundle_hash: str) -> str:
        return f"{self.root}/app/{bundle_hash}"

    def deps_dir(self) -> str:
        return self.deps_root or f"{self.root}/deps"

    def deps(self, deps_key: str) -> str:
        return f"{self.deps_dir()}/{deps_key}"

    def python(self, deps_key: str) -> str:
        return f"{self.deps(deps_key)}/bin/python"

    def bin(self, name: str = "") -> str:
        return f"{self.root}/bin/{name}" if name else f"{self.root}/bin"

    def pidfile(self, run_id: str) -> str:
        return f"{self.root}/run/{run_id}.pid"

    def secrets(self, run_id: str) -> str:
        return f"{self.root}/run/{run_id}.secrets"

    def log(self, run_id: str) -> str:
        return f"{self.root}/logs/{run_id}.log"


@dataclass
class LaunchSpec:
    argv: list[str]                                  # argv[0] == "python": the bundle's Python on the host
    env: dict[str, str] = field(default_factory=dict)
    secret_names: list[str] = field(default_factory=list)  # names only: values never live here
    run_id: str = field(default_factory=lambda: new_run_id())
    coordinator_port: int = DEFAULT_COORDINATOR_PORT
    heartbeat_timeout_s: int = 10   # a dead host is noticed in seconds (JAX's default is 100)
    init_timeout_s: int = 60        # a host that never starts fails the run in a minute (default 300)
    distributed: bool = True        # set the TPUCTL_* jax.distributed variables
    stop_grace_s: float = 10.0


# A multislice job's slices become reachable at different times and its compiles are longer: its processes get
# more patient jax.distributed timeouts (tpuctl's own watch still stops every host at the first failure, so a
# dead slice is not waited for).
MULTISLICE_HEARTBEAT_TIMEOUT_S = 60
MULTISLICE_INIT_TIMEOUT_S = 600


def timeouts(workers: list[Worker], heartbeat_s: int | None, init_s: int | None) -> dict[str, int]:
    """LaunchSpec's heartbeat_timeout_s / init_timeout_s: the user's, else the defaults for one slice or
    several."""
    multi = num_slices(workers) > 1
    return {"heartbeat_timeout_s": heartbeat_s or (MULTISLICE_HEARTBEAT_TIMEOUT_S if multi else 10),
            "init_timeout_s": init_s or (MULTISLICE_INIT_TIMEOUT_S if multi else 60)}


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def command_tag(argv: list[str], env: dict[str, str]) -> str:
    """What names a job's command on the hosts (hostwrap's --tag): its argv and --env, not its run id. The same
    `tpuctl run` given while that run is going attaches to it instead of starting a second run."""
    import hashlib
    return hashlib.sha256(json.dumps([list(argv), sorted(env.items())]).encode()).hexdigest()[:16]


def flag_value(argv: list[str], flag: str) -> str | None:
    """A command line's `FLAG X` or `FLAG=X` (the first), or None."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def parse_env(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """--env K=V values (V may hold anything, '=' included)."""
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep:
            raise LaunchError(f"--env {p!r} is not K=V: write --env NAME=value")
        check_env_name(k, "--env")
        out[k] = v
    return out


def check_env_name(k: str, flag: str) -> None:
    if not ENV_NAME.match(k):
        raise LaunchError(f"{flag} {k!r}: an environment variable name is letters, digits and _, "
                          "not starting with a digit")
    if k in RESERVED:
        raise LaunchError(f"{flag} {k}: tpuctl sets {k} itself for every host; drop it")


def read_secrets(names: list[str] | tuple[str, ...], environ: dict[str, str]) -> dict[str, str]:
    """--secret-env K: the value comes from the user's environment, never from the command line."""
    out = {}
    for k in names:
        check_env_name(k, "--secret-env")
        if k not in environ:
            raise LaunchError(f"--secret-env {k}: {k} is not set in your environment; export it first")
        out[k] = environ[k]
    return out


def process_order(w: Worker) -> tuple[int, int]:
    """JAX process order: slice-major (process = slice x hosts_per_slice + worker), as a bare
    jax.distributed.initialize() computes it on TPU VMs from MEGASCALE_SLICE_ID."""
    return (w.slice or 0, w.index)


def num_slices(workers: list[Worker]) -> int:
    return 1 + max((w.slice or 0 for w in workers), default=0)


def coordinator(workers: list[Worker], port: int = DEFAULT_COORDINATOR_PORT) -> str:
    """Process 0's internal IP (slice 0, worker 0) and the coordination service's port."""
    w0 = min(workers, key=process_order)
    return f"{w0.internal_ip}:{port}"


def host_env(spec: LaunchSpec, workers: list[Worker], index: int) -> dict[str, str]:
    """The environment of worker `index`'s process (user --env, then the distributed settings)."""
    env = {"PYTHONUNBUFFERED": "1", **spec.env, "TPUCTL_RUN_ID": spec.run_id}  # the trainer keeps profiles under it
    if spec.distributed and len(workers) > 1:
        env.update({
            "TPUCTL_COORDINATOR": coordinator(workers, spec.coordinator_port),
            "TPUCTL_NUM_PROCESSES": str(len(workers)),
            "TPUCTL_PROCESS_ID": str(index),
            "TPUCTL_HEARTBEAT_TIMEOUT_S": str(spec.heartbeat_timeout_s),
            "TPUCTL_INIT_TIMEOUT_S": str(spec.init_timeout_s),
        })
    elif spec.distributed:
        env.update({"TPUCTL_NUM_PROCESSES": "1", "TPUCTL_PROCESS_ID": "0"})
    if spec.distributed and num_slices(workers) > 1:
        # What a multislice queued resource's VMs have in their tpu-env metadata, which a bare
        # jax.distributed.initialize() and libtpu's DCN transport read: set here, before Python starts, since
        # once jax is imported they are not read again. The address is process 0's host (JAX keeps the host
        # part and adds its own port).
        env.update({"MEGASCALE_COORDINATOR_ADDRESS": coordinator(workers).split(":")[0],
                    "MEGASCALE_NUM_SLICES": str(num_slices(workers)),
                    "MEGASCALE_SLICE_ID": str(workers[index].slice or 0)})
    return env


def _home_path(path: str) -> str:
    """A shell word for a path relative to $HOME (quoted part after "$HOME"/)."""
    if path.startswith("/") or "/" not in path:  # absolute, or a command name looked up in PATH
        return shlex.quote(path)
    return '"$HOME"/' + shlex.quote(path)


def host_command(spec: LaunchSpec, workers: list[Worker], index: int, *, layout: HostLayout,
                 wrap_python: str, env_python: str | None = None, pythonpath: list[str] = (),
                 cwd: str | None = None, wrap_script: str = HOSTWRAP, tag: str = "") -> str:
    """The shell command that runs worker `index`'s part of the job under hostwrap: it starts the run's keeper,
    detached from the SSH session, and follows its log (docs/CONTRACTS.md). `tag` names the command (the same
    command given again attaches to the run instead of starting another).

    wrap_python: the interpreter that runs hostwrap (any python3); env_python: the bundle environment's
    interpreter that replaces argv[0] == "python" (None: the command needs no environment).
    """
    argv = list(spec.argv)
    if not argv:
        raise LaunchError("nothing to run: give the command after --")
    env = host_env(spec, workers, index)
    words = []
    if argv[0] == PYTHON:
        if env_python is None:
            raise LaunchError("the command runs `python` but no bundle was pushed")
        words.append(_home_path(env_python))
        argv = argv[1:]
    if pythonpath:
        env["PYTHONPATH"] = ":".join(pythonpath)  # resolved below against $HOME
    words += [shlex.quote(a) for a in argv]
    assigns = []
    for k, v in env.items():
        if k == "PYTHONPATH":
            assigns.append("PYTHONPATH=" + ":".join(_home_path(p) for p in pythonpath))
        else:
            assigns.append(shlex.quote(f"{k}={v}"))
    wrap = [_home_path(wrap_python), _home_path(layout.bin(wrap_script)), "run",
            "--pidfile", _home_path(layout.pidfile(spec.run_id)), "--run-id", shlex.quote(spec.run_id),
            "--log", _home_path(layout.log(spec.run_id)), "--grace", str(spec.stop_grace_s)]
    if tag:
        wrap += ["--tag", shlex.quote(tag)]
    if spec.secret_names:
        wrap += ["--secrets", _home_path(layout.secrets(spec.run_id))]
    if cwd:
        wrap += ["--cwd", _home_path(cwd)]
    dirs = " ".join(_home_path(d) for d in (f"{layout.root}/run", f"{layout.root}/logs"))
    # `env` takes the assignments as its own argv: nothing in a value is ever seen by a shell.
    return f"cd && mkdir -p {dirs} && exec env {' '.join(assigns)} {' '.join(wrap)} -- {' '.join(words)} 2>&1"


def secrets_payload(secrets: dict[str, str]) -> str:
    """What goes through stdin into the host's 0600 secrets file."""
    return json.dumps(secrets)


def secrets_upload_command(layout: HostLayout, run_id: str) -> str:
    """Reads stdin into a fresh 0600 file (umask before the file exists: never readable by others)."""
    path = _home_path(layout.secrets(run_id))
    return f"umask 077 && mkdir -p {_home_path(layout.root + '/run')} && cat > {path}.tmp && mv {path}.tmp {path}"


def state_command(layout: HostLayout, run_id: str, *, wrap_python: str, wrap_script: str = HOSTWRAP) -> str:
    """Prints `TPUCTL_STATE {json}`: the run's processes on the host and their state (R, S, T stopped, ...)."""
    return (f"{_home_path(wrap_python)} {_home_path(layout.bin(wrap_script))} state "
            f"--pidfile {_home_path(layout.pidfile(run_id))}")


def follow_command(layout: HostLayout, run_id: str, *, skip_lines: int, wrap_python: str,
                   wrap_script: str = HOSTWRAP) -> str:
    """Follows a run's host log from line `skip_lines` on, until the run ends: `TPUCTL_EXIT <rc>` then."""
    return (f"{_home_path(wrap_python)} {_home_path(layout.bin(wrap_script))} follow "
            f"--pidfile {_home_path(layout.pidfile(run_id))} --log {_home_path(layout.log(run_id))} "
            f"--skip-lines {int(skip_lines)} 2>&1")


def runs_command(layout: HostLayout, *, wrap_python: str, wrap_script: str = HOSTWRAP) -> str:
    """Prints `TPUCTL_RUNS [{run_id, tag, started, running, rc, ended}]`: the runs the host knows."""
    return (f"{_home_path(wrap_python)} {_home_path(layout.bin(wrap_script))} runs "
            f"--dir {_home_path(layout.root + '/run')}")


def beside_command(layout: HostLayout, run_id: str, args: list[str], *, wrap_python: str,
                   wrap_script: str = HOSTWRAP) -> str:
    """Runs the trainer's Python with `args` (e.g. `-m trainer hoststat`) beside run_id's live trainer: its
    environment (less the run's secrets), its working directory (hostwrap `beside`). Exit 3: no live run."""
    return (f"{_home_path(wrap_python)} {_home_path(layout.bin(wrap_script))} beside "
            f"--pidfile {_home_path(layout.pidfile(run_id))} --log {_home_path(layout.log(run_id))} -- "
            + " ".join(shlex.quote(x) for x in args))


def stop_command(layout: HostLayout, run_id: str, *, wrap_python: str, grace: float = 3.0,
                 wrap_script: str = HOSTWRAP) -> str:
    return (f"{_home_path(wrap_python)} {_home_path(layout.bin(wrap_script))} stop "
            f"--pidfile {_home_path(layout.pidfile(run_id))} --grace {grace}; "
            f"rm -f {_home_path(layout.secrets(run_id))}")
