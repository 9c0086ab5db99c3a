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
