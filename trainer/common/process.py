"""What every `python -m trainer` process settles before jax is imported, and the parser all its commands share.

--emulate-devices N (default $TPUCTL_EMULATE_DEVICES) adds N CPU devices to XLA_FLAGS (an inherited device-count
flag wins). On the CPU backend, freed host memory is kept for reuse (trainer/common/hostmem.py;
TPUCTL_KEEP_FREED_MEMORY=0 leaves glibc's defaults).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Callable

from trainer.common import accelerators
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


_early_interrupt = False


def catch_early_interrupt() -> None:
    """Ctrl-C before the training loop takes it over (checkpoint.Checkpointer.watch_interrupt): KeyboardInterrupt
    as Python raises it, and remembered. A KeyboardInterrupt raised while a library's callback runs (jax's garbage-
    collection callback, during a compile or an init) is printed and dropped, and the run went on as if no Ctrl-C
    had come; the loop asks `take_early_interrupt` before its first step. A launcher that ignores SIGINT is obeyed."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_early_interrupt)
        previous = sys.unraisablehook

        def unraisable(u) -> None:  # the dropped KeyboardInterrupt is remembered, not a traceback on the console
            if not isinstance(u.exc_value, KeyboardInterrupt):
                previous(u)
        sys.unraisablehook = unraisable


def _on_early_interrupt(signum, frame) -> None:
    global _early_interrupt
    _early_interrupt = True
    raise KeyboardInterrupt


def take_early_interrupt() -> bool:
    """Whether a Ctrl-C came since catch_early_interrupt (or the last call), wherever its KeyboardInterrupt went."""
    global _early_interrupt
    came, _early_interrupt = _early_interrupt, False
    return came


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
RUNTIME_METRICS_ENV, RUNTIME_METRICS_PORT = "TPU_RUNTIME_METRICS_PORTS", "8431"  # tpu-info's default address


def quiet_native_logs() -> None:
    """Before jax is imported: the native log levels above, and no accelerator probing where there is none.

    With libtpu installed (for `tpuctl plan`) and JAX_PLATFORMS unset, jax asks libtpu for a TPU, and on a machine
    without one libtpu logs its failed search ("Failed to find host bounds", "unexpected worker hostname") before
    jax falls back to the CPU. No TPU or GPU device node here (trainer/common/accelerators.py): the CPU is chosen
    at once. With one, jax is left to find it, and check_accelerator() stops the run if it did not."""
    if "jax" in sys.modules:
        return
    for k, v in QUIET_NATIVE_LOGS.items():
        os.environ.setdefault(k, v)
    # libtpu serves its runtime metrics (HBM use, duty cycle: what `tpu-info` and `tpuctl top` read) only when
    # this is set when it starts; a CPU or GPU process ignores it.
    os.environ.setdefault(RUNTIME_METRICS_ENV, RUNTIME_METRICS_PORT)
    if not os.environ.get("JAX_PLATFORMS") and not accelerators.device_nodes():
        os.environ["JAX_PLATFORMS"] = "cpu"
    quiet_tensorstore_when_imported()


class AcceleratorError(UsageError):
    """A TPU host whose chip jax did not find: the run stops rather than train on the CPU."""


def check_accelerator() -> None:
    """After jax has started: on a host with a TPU device node, the run goes on only on the TPU, unless the user
    asked for the CPU (JAX_PLATFORMS=cpu first, or --emulate-devices / $TPUCTL_EMULATE_DEVICES, which set it).

    jax falls back to the CPU silently when libtpu is missing or cannot open the chip; a gpt2-124m step on one
    host's CPU in float32 then ran its 40 GiB of memory out instead of failing."""
    nodes = accelerators.tpu_nodes()
    if not nodes or os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu":
        return
    import jax
    backend = jax.default_backend()
    if backend == "tpu":
        return
    held = (" (/tmp/libtpu_lockfile exists: `lsof /tmp/libtpu_lockfile` names its holder)"
            if os.path.exists("/tmp/libtpu_lockfile") else "")
    raise AcceleratorError(
        f"this host has a TPU device node ({', '.join(nodes)}) but jax found no TPU (backend: {backend}): check "
        f"that libtpu is installed beside jax (pip show libtpu), that no other process holds the chip{held}, and "
        f"that this user can open {nodes[0]} (ls -l {nodes[0]}); to train on the CPU on purpose, set "
        f"JAX_PLATFORMS=cpu")


# tensorstore (Orbax's array I/O on gs://) links its own copy of absl logging, sets it to print INFO lines when
# imported, and names the credentials it picks at INFO on first use ("Using GOOGLE_AUTH_TOKEN_FOR_TESTING" against
# the GCS emulator, "Running on GCE, using GCE Auth Provider" on a TPU VM). No environment variable or flag it
# reads lowers that level, so its own absl::SetMinLogLevel is called, found by name in the module's symbol table.
# Its warnings and errors still reach stderr. A tensorstore built without that symbol is left as it is.
_ABSL_SET_MIN_LOG_LEVEL = b"_ZN4absl14SetMinLogLevelENS_18LogSeverityAtLeastE"
_WARNING = 1  # absl::LogSeverityAtLeast::kWarning


class _QuietTensorstoreOnImport:
    """A finder on sys.meta_path that lets the usual finders find tensorstore and quiets it as soon as its module
    has run: only the processes that use it (Orbax checkpoints, gs:// token files) pay for its import, about 1 s,
    and none misses the setting."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorstore":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_module = spec.loader.exec_module

            def run_then_quiet(module):
                run_module(module)
                quiet_tensorstore()
            spec.loader.exec_module = run_then_quiet
        return spec


def quiet_tensorstore_when_imported() -> None:
    """quiet_tensorstore() now if tensorstore is loaded, else at its first import."""
    if "tensorstore" in sys.modules:
        quiet_tensorstore()
    elif not any(isinstance(f, _QuietTensorstoreOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietTensorstoreOnImport())


def quiet_tensorstore() -> bool:
    """Set tensorstore's absl logging to WARNING and above. True when it was set."""
    try:
        import tensorstore
    except ImportError:
        return False
    import ctypes
    import glob
    so = next(iter(glob.glob(os.path.join(os.path.dirname(tensorstore.__file__), "_tensorstore*.so"))), None)
    if so is None:
        return False
    offset, base = _elf_symbol(so, _ABSL_SET_MIN_LOG_LEVEL), _load_address(so)
    if offset is None or base is None:
        return False
    ctypes.CFUNCTYPE(None, ctypes.c_int)(base + offset)(_WARNING)
    return True


def _elf_symbol(path: str, name: bytes) -> int | None:
    """The value of `name` in a 64-bit little-endian ELF file's static symbol table (.symtab), or None."""
    import mmap
    import struct
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:6] != b"\x7fELF\x02\x01":
            return None
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
        for _, kind, _, _, off, size, link, _, _, entsize in sections:
            if kind != 2 or entsize != 24:  # SHT_SYMTAB
                continue
            strings = sections[link][4]
            at = m.find(name + b"\0", strings, strings + sections[link][5])
            if at < 0:
                return None
            for sym in range(off, off + size, 24):
                if struct.unpack_from("<I", m, sym)[0] == at - strings:
                    return struct.unpack_from("<Q", m, sym + 8)[0]
    return None


def _load_address(path: str) -> int | None:
    """Where this process mapped the start of the shared object at `path`."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    return None


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
