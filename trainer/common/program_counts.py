"""A plan's figures found by the program it compiles, so that a program counted once is not compiled again.

The compiler's figures of a step (its memory and cost analyses, the optimized program a plan reads) follow from
what the compiler is handed and what it is: the lowered step (StableHLO: its shapes, shardings and donations),
the devices, the options, and the compiler's version. A plan lowers its step first (seconds), keys it by all of
these (`Store.key`), and answers from a record of that very program where one is found; otherwise it compiles,
and records what it counted.

Three places hold records, read in this order:
- this machine's: the planner's --counts-dir (`tpuctl plan` gives it the `programs` folder of its plan cache), one
  file a program, written by every plan that compiled one. Unlike the plan cache, which is keyed by the command
  and the trainer's code, a record outlives an edit that leaves the program as it was.
- shared ones, read only: the folders in $TPUCTL_PLAN_RECORDS (os.pathsep between them), e.g. a team's copy of
  the records its machines wrote, on a drive they all mount; the test suite's own (tests/programs/).
- tpuctl's own (`shipped/` beside this module): the default Gemma 4 LoRA steps whose layers are written out, which
  libtpu takes 3 to 5 minutes to compile on 2 cores (docs/gemma.md), recorded by
  `python -m bench.compiler.ship_counts`. A record whose program the code no longer builds is never found (its key
  is the program's), so such a plan compiles; tests/test_program_counts.py fails when a shipped record no longer
  matches the step its command builds.
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import importlib.metadata
import json
import os
import re
from pathlib import Path
from typing import Any

FORMAT = 1  # a record's layout: a new one makes every older key miss
SHIPPED = Path(__file__).with_name("shipped")
VERSIONED = ("jax", "jaxlib", "libtpu")
ENV = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")  # the compiler's flags a process can be given beside its options
THIS_MACHINE, SHARED, TPUCTL = "this machine", "shared", "tpuctl"  # where a record was found
OWNER = {THIS_MACHINE: "this machine's", SHARED: "a shared", TPUCTL: "tpuctl's"}  # a record's, as a plan says it
SHARED_ENV = "TPUCTL_PLAN_RECORDS"
# A Pallas kernel reaches the compiler as a custom call whose backend_config carries the kernel's Mosaic module as
# base64 MLIR bytecode, with the source locations of its Python: the path of the install that traced it
# (.../site-packages/jax/experimental/pallas/ops/tpu/splash_attention/...). The compiler reads no location, so
# the same kernel installed elsewhere (another venv, a CI clone) is the same program: a key reads each kernel as
# its module printed without locations.
KERNEL_BODY = re.compile(r'(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)')


def portable(program_text: str) -> str:
    """The lowered program with each kernel's module read without its source locations (see KERNEL_BODY). A kernel
    that cannot be read so is kept as lowered: its key then also names where it was traced, a record missed, never
    a wrong one found."""
    if "tpu_custom_call" not in program_text:
        return program_text
    try:  # jax's own reader of Mosaic modules (jax._src.tpu_custom_call reads them so to downgrade one)
        from jax._src.interpreters import mlir
        from jax._src.lib import tpu
        from jaxlib.mlir import ir
        ctx = mlir.make_ir_context()
        tpu.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
    except Exception:  # noqa: BLE001 - any jax without that reader
        return program_text

    def body(m: re.Match) -> str:
        try:
            with ctx:
                module = ir.Module.parse(base64.b64decode(m.group(2), validate=True))
                return m.group(1) + module.operation.get_asm(enable_debug_info=False) + m.group(3)
        except Exception:  # noqa: BLE001 - not a module this jax reads
            return m.group(0)
    return KERNEL_BODY.sub(body, program_text)


def shareable(record_text: str) -> str:
    """A record's text as another machine reads it: the buffers' jax sources named from the package on
    (`jax/...`), not from this machine's site-packages."""
    return re.sub(r'"/[^"]*?/site-packages/', '"', record_text)


def package_versions(names) -> dict[str, str]:
    """Each installed package's version ("-": not installed)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def versions() -> dict[str, str]:
    return {**package_versions(VERSIONED), **{k: os.environ.get(k, "") for k in ENV}}


class Store:
    """Where a planner looks for records and writes them. folder: this machine's (None: it keeps none);
    recount: look nowhere (a plan that must compile, e.g. `tpuctl plan --no-cache`), still recording; shared:
    folders read, never written (None: $TPUCTL_PLAN_RECORDS's)."""

    def __init__(self, folder: str | os.PathLike | None = None, recount: bool = False, shipped: Path = SHIPPED,
                 shared: list[Path] | None = None):
        self.folder = Path(folder) if folder else None
        self.recount = recount
        self.shipped = shipped
        self.shared = shared if shared is not None else [
            Path(p) for p in os.environ.get(SHARED_ENV, "").split(os.pathsep) if p]

    @staticmethod
    def key(program_text: str, devices: list, compiler_options: dict, processes: int, slices: int,
            run_platform: str) -> str:
        """The program's key: what the compiler is handed (the lowered text, the devices it is compiled for, each
        as jax names it: id and coordinates on a TPU topology, and the step's compiler options), the hosts and
        slices it spans, and the compiler's versions and flags; not where the program's Python is installed
        (`portable`). Not the command: `--mesh data=8,model=1` on
        v5litepod-8 builds the program the default mesh builds, and is found by it (a model > 1 plan compares
        with it)."""
        h = hashlib.sha256()
        about = {"format": FORMAT, "versions": versions(), "devices": [str(d) for d in devices],
                 "device_kind": devices[0].device_kind if devices else "", "processes": processes, "slices": slices,
                 "run_platform": run_platform, "compiler_options": compiler_options}
        h.update(json.dumps(about, sort_keys=True, default=str).encode())
        h.update(b"\0")
        h.update(portable(program_text).encode())
        return h.hexdigest()[:40]

    def find(self, key: str) -> dict | None:
        """The record of the program keyed `key`, with `where` it was found, or None."""
        if self.recount:
            return None
        for where, folder in ((THIS_MACHINE, self.folder), *((SHARED, f) for f in self.shared),
                              (TPUCTL, self.shipped)):
            path = folder / f"{key}.json" if folder else None
            if path is None or not path.exists():
                continue
            try:
                record = json.loads(path.read_text())
            except (ValueError, OSError):
                continue  # a damaged or unreadable record: compiled again, and written over where it can be
            if record.get("format") == FORMAT and record.get("key") == key and "figures" in record:
                return {**record, "where": where}
        return None

    def save(self, key: str, figures: dict, phases: dict) -> Path | None:
        """Record what compiling the program counted (phases: its lowering, compile and count, in seconds); the path,
        or None where nothing could be kept (no folder, or one that cannot be written: the plan goes on without)."""
        if self.folder is None:
            return None
        record = {"format": FORMAT, "key": key, "recorded": datetime.date.today().isoformat(),
                  "versions": versions(), "phases": phases, "figures": figures}
        path = self.folder / f"{key}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two plans of one program may finish at once
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
        except OSError:
            with contextlib.suppress(OSError):  # no half-written record left behind
                tmp.unlink(missing_ok=True)
            return None
        return path


def answer(record: dict, own: dict) -> dict[str, Any]:
    """A plan's figures from a record: the compiler's as counted then, the step's own (own: its settings, mesh,
    state bytes and work, as this command builds them: the same program under another spelling) over them, with
    `counted_earlier` saying where the record was found, when it was made and what its compile took (the plan's
    own phases are the caller's)."""
    figures = {**record["figures"], **{k: v for k, v in own.items() if k != "compile_s"}}
    figures["counted_earlier"] = {"where": record["where"], "recorded": record["recorded"],
                                  "versions": record.get("versions", {}), "compile_s": figures.get("compile_s"),
                                  "phases": record.get("phases", {}),
                                  "compile_phases": figures.get("compile_phases", {})}
    figures["compile_phases"] = {}
    return figures
