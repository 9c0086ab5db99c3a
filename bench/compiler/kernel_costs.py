"""Where a TPU compile's time goes, kernel by kernel: the step compiled ahead of time as `python -m trainer.plan`
compiles it, with libtpu logging each kernel it generates and that kernel's size in LLO instructions; a compile's
CPU seconds follow the sum of those sizes (docs/gemma.md, "Where a plan's compile goes").

    python -m bench.compiler.kernel_costs --out DIR [--top N] -- <trainer.plan options> -- <trainer command>
    python -m bench.compiler.kernel_costs --read DIR [--top N]

writes DIR/libtpu.log (libtpu's log of the compile), DIR/step.hlo (the optimized program, whose instruction names
the log's kernels carry) and DIR/run.json (compile CPU and wall seconds), then prints the kernels' instructions by
where in the step they come from (the jax op each kernel was made from) and by the computation holding them (the
program's top level, its loops' bodies, the compiler's windowed collective matmul loops). --read prints that again
from a DIR written before. The compiler's count (libtpu), not a chip measurement.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import sys
import time
from dataclasses import dataclass

# libtpu's line for each kernel it optimizes (libtpu 0.0.42.1): `... deepsea_compiler_backend.cc:3769] [fusion.460]
# LLO optimizing 142,480 instructions`
_KERNEL = re.compile(r"deepsea_compiler_backend\.cc:\d+\] \[(.*?)\] LLO optimizing ([\d,]+) instructions")
_STAGE = re.compile(r"\] (\w+) stage duration: (.*)$")
LOG_ENV = {"TPU_MIN_LOG_LEVEL": "0", "TPU_STDERR_LOG_LEVEL": "0", "TPU_VMODULE": "deepsea_compiler_backend=1"}


@dataclass(frozen=True)
class Kernel:
    name: str          # the HLO instruction the kernel was generated for
    instructions: int  # its LLO instructions before libtpu's optimizations
    op_name: str       # the jax op it was made from (the HLO's metadata), "" when not in the program's text
    computation: str   # the HLO computation holding it, "" likewise


def kernels(log_text: str, hlo_text: str = "") -> list[Kernel]:
    """The kernels libtpu's log names, joined with the optimized program's text by instruction name."""
    where, comp = {}, ""
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            comp = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            continue
        m = re.match(r"^\s*(?:ROOT )?%(\S+) = ", line)
        if m:
            on = re.search(r'op_name="([^"]+)"', line)
            where[m.group(1)] = (on.group(1) if on else "", comp)
    out = []
    for m in _KERNEL.finditer(log_text):
        op_name, computation = where.get(m.group(1), ("", ""))
        out.append(Kernel(m.group(1), int(m.group(2).replace(",", "")), op_name, computation))
    return out


def part_of(k: Kernel) -> str:
    """Which part of a train step a kernel comes from, by its jax op name."""
    on = k.op_name
    if not on:
        return "not in the program's text"
    if "shard_map" in on:
        return "loss and embedding lookup"
    if re.search(r"/(cos|sin)$", on):
        return "rotary tables"
    if "jvp" not in on:
        return "outside the differentiated loss (optimizer, update)"
    side = "backward" if "transpose(" in on else "forward"
    return f"{side}: " + ("matmuls" if "dot_general" in on else "other fusions")


def held_by(k: Kernel) -> str:
    if not k.computation:
        return "not in the program's text"
    if "windowed" in k.computation:
        return "the compiler's windowed collective matmul loops"
    return "top level" if k.computation == "ENTRY" else "loop bodies (the layers' scans, the loss's chunks)"


def table(ks: list[Kernel], key) -> list[tuple[str, int, int]]:
    """(group, kernels, instructions), the largest first."""
    n, c = collections.Counter(), collections.Counter()
    for k in ks:
        n[key(k)] += 1
        c[key(k)] += k.instructions
    return [(g, n[g], c[g]) for g, _ in c.most_common()]


def report(ks: list[Kernel], stages: dict[str, str], top: int = 10) -> str:
    total = sum(k.instructions for k in ks) or 1
    lines = [f"{len(ks)} kernels, {total:,} LLO instructions"]
    for title, key in (("by part of the step", part_of), ("by computation", held_by)):
        lines.append(f"-- {title}")
        lines += [f"{c:>12,} {100 * c / total:5.1f}% {n:5d} kernels  {g}" for g, n, c in table(ks, key)]
    lines.append(f"-- the {top} largest kernels")
    lines += [f"{k.instructions:>12,}  {k.name:32s} {k.op_name[-90:]}"
              for k in sorted(ks, key=lambda k: -k.instructions)[:top]]
    lines += [f"{name} stage: {took}" for name, took in stages.items()]
    return "\n".join(lines)


def stages(log_text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in map(_STAGE.search, log_text.splitlines()) if m}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def compile_logged(out: str, plan_argv: list[str]) -> dict:
    """Compile the trainer command's step as trainer.plan does, libtpu logging into out/libtpu.log (this process's
    stderr, from before libtpu loads); out/step.hlo, out/run.json."""
    from trainer import cli
    from trainer.common import aot
    from trainer.plan import _options
    own, targv = plan_argv[:plan_argv.index("--")], plan_argv[plan_argv.index("--") + 1:]
    opts = _options().parse_args(own)
    args = cli.parser().parse_args(targv)
    aot.check(args)
    os.makedirs(out, exist_ok=True)
    os.environ.update(LOG_ENV)
    sys.stderr.flush()
    stderr = os.dup(2)
    fd = os.open(os.path.join(out, "libtpu.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    try:
        target = aot.target(opts)
        built = aot.BUILDERS[args.cmd](args, target)
        c0, w0 = _cpu(), time.time()
        compiled = built.compile()
    finally:  # the log holds libtpu's lines; an error of ours is said where the caller sees it
        sys.stderr.flush()
        os.dup2(stderr, 2)
    run = {"compile_cpu_s": round(_cpu() - c0, 1), "compile_wall_s": round(time.time() - w0, 1),
           "load": round(os.getloadavg()[0], 2), "settings": built.settings}
    with open(os.path.join(out, "step.hlo"), "w") as fh:
        fh.write(compiled.as_text() or "")
    with open(os.path.join(out, "run.json"), "w") as fh:
        json.dump(run, fh)
    return run


def read(out: str, top: int = 10) -> str:
    log = open(os.path.join(out, "libtpu.log"), errors="replace").read()
    hlo_path = os.path.join(out, "step.hlo")
    hlo = open(hlo_path).read() if os.path.exists(hlo_path) else ""
    head = ""
    if os.path.exists(os.path.join(out, "run.json")):
        run = json.load(open(os.path.join(out, "run.json")))
        head = (f"compile: {run['compile_cpu_s']} CPU s, {run['compile_wall_s']} s wall at a load of {run['load']}\n")
    return head + report(kernels(log, hlo), stages(log), top)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m bench.compiler.kernel_costs", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="directory for the log, the program's text and the timings")
    g.add_argument("--read", metavar="DIR", help="print the tables of a directory written before")
    p.add_argument("--top", type=int, default=10, help="the largest kernels listed")
    a = p.parse_args(own)
    if a.out:
        if rest.count("--") != 1:
            p.error("give the plan's options and the trainer command: -- --devices 8 --tpu v5e:2x4 ... -- lora ...")
        from trainer.common.config import UsageError
        try:
            compile_logged(a.out, rest)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(read(a.out or a.read, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
