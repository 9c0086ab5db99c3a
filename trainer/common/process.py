"""What every `python -m trainer` process settles before jax is imported, and the parser all its commands share.

--emulate-devices N (default $TPUCTL_EMULATE_DEVICES) adds N CPU devices to XLA_FLAGS (an inherited device-count
flag wins). On the CPU backend, freed host memory is kept for reuse (trainer/common/hostmem.py;
TPUCTL_KEEP_FREED_MEMORY=0 leaves glibc's defaults).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from trainer.common.config import UsageError

COUNT_FLAG = "xla_force_host_platform_device_count"
EMULATE_ENV = "TPUCTL_EMULATE_DEVICES"


class ArgParser(argparse.ArgumentParser):
    """argparse whose bad-input message is one `error: ...` line, as for every other bad input."""

    def error(self, message):
        raise UsageError(message)


def command_parser(description: str, *adders: Callable, prog: str = "python -m trainer") -> ArgParser:
    """A `python -m trainer` parser holding the subcommands that `adders` add (each takes the subparsers)."""
    p = ArgParser(prog=prog, description=description)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=ArgParser)
    for add in adders:
        add(sub)
    return p


def add_process_flags(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sp.add_argument("--emulate-devices", type=int, default=None, metavar="N",
                    help="N CPU devices per process (set before jax starts; default $TPUCTL_EMULATE_DEVICES, "
                         "which a local slice's hosts get; an inherited XLA flag wins)")
    return sp


def emulate_devices(argv: list[str]) -> None:
    """Read --emulate-devices from raw argv (else $TPUCTL_EMULATE_DEVICES, which a local slice's hosts get)
    and set XLA_FLAGS, before anything imports jax."""
    value, what = None, "--emulate-devices"
    for i, a in enumerate(argv):
        if a == "--emulate-devices" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--emulate-devices="):
            value = a.split("=", 1)[1]
    if value is None and os.environ.get(EMULATE_ENV):
        value, what = os.environ[EMULATE_ENV], EMULATE_ENV
    if value is None:
        return
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{what} {value}: expected a positive integer")
    if "jax" in sys.modules:  # called in-process after jax started (tests): the devices are what they are
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{COUNT_FLAG}={int(value)}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def keep_freed_memory() -> None:
    """On the CPU backend (chosen before jax starts), reuse freed host memory instead of page-faulting
    each step's buffers in again: trainer/common/hostmem.py. Before jax is imported, while there is one thread."""
    if "jax" in sys.modules or os.environ.get("TPUCTL_KEEP_FREED_MEMORY", "1") == "0":
        return
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        from trainer.common import hostmem
        hostmem.keep_freed_memory()


def in_a_multi_process_job() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed
    return distributed.global_state.client is not None


# Native libraries' log levels, unless the environment sets them: XLA's C++ logging (absl/tsl) and libtpu's
# stderr at errors only (their INFO/WARNING lines are about the runtime, not the run); gRPC (the coordination
# service's transport) likewise. A real failure still reaches the user: as an error line, or as the Python
# exception the trainer reports.
QUIET_NATIVE_LOGS = {"TF_CPP_MIN_LOG_LEVEL": "2", "TPU_STDERR_LOG_LEVEL": "2", "TPU_MIN_LOG_LEVEL": "2",
                     "GRPC_VERBOSITY": "ERROR"}
ACCELERATOR_DEVICES = ("/dev/accel0", "/dev/vfio/0", "/dev/nvidia0")  # TPU v4+/v5e+/GPU device nodes


def quiet_native_logs() -> None:
    """Before jax is imported: the native log levels above, and no accelerator probing where there is none.

    With libtpu installed (for `tpuctl plan`) and JAX_PLATFORMS unset, jax asks libtpu for a TPU, and on a machine
    without one libtpu logs its failed search ("Failed to find host bounds", "unexpected worker hostname") before
    jax falls back to the CPU. No TPU or GPU device node here: the CPU is chosen at once."""
    if "jax" in sys.modules:
        return
    for k, v in QUIET_NATIVE_LOGS.items():
        os.environ.setdefault(k, v)
    if "JAX_PLATFORMS" not in os.environ and not any(os.path.exists(d) for d in ACCELERATOR_DEVICES):
        os.environ["JAX_PLATFORMS"] = "cpu"


def native_stdout_off() -> None:
    """A process of a multi-process job on the CPU backend: native code's stdout goes to /dev/null, Python's
    print keeps the real stdout.

    The CPU backend's collectives between processes are Gloo's, and the Gloo that jaxlib bundles writes its
    connection report ("[Gloo] Rank 1 is connected to 1 peer ranks...") to std::cout unconditionally, once per
    communicator, from several threads at once (the lines interleave mid-word). Nothing else native writes to
    stdout (XLA and libtpu log to stderr, which stays as it is), so the report is the only thing silenced."""
    if "jax" in sys.modules or os.environ.get("JAX_PLATFORMS", "").split(",")[0] != "cpu":
        return
    if int(os.environ.get("TPUCTL_NUM_PROCESSES", "1") or 1) < 2:
        return
    sys.stdout.flush()
    keep = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    sys.stdout = os.fdopen(keep, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)
