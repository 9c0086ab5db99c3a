"""`python -m trainer.plan --devices N [--tpu GEN:TOPOLOGY ...] -- COMMAND ARGS`: the ahead-of-time compile of a
trainer command's train step (trainer/common/aot.py), for devices this machine does not have. It prints one JSON
object on stdout; the trainer arguments go through the trainer's own parser and checks (bad ones exit 2 with its
one-line `error: ...`, as the run itself would); a command with no train step exits 4 before jax starts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from trainer import cli
from trainer.common import aot, program_counts
from trainer.common.config import UsageError
from trainer.common.process import ArgParser

STARTED = time.perf_counter()  # the plan's phases start here (aot.plan): jax and libtpu load after it


def _options() -> argparse.ArgumentParser:
    p = ArgParser(prog="python -m trainer.plan", description=aot.__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, required=True, metavar="N", help="devices each slice of the run will have")
    p.add_argument("--processes", type=int, default=1,
                   help="hosts each slice of the run will have (its batch is split over them)")
    p.add_argument("--num-slices", type=int, default=1, metavar="N",
                   help="slices joined by DCN: the step over the hybrid mesh (the slices on `dcn`), as a multislice "
                        "run builds it, and the collectives that cross slices (dcn_send_ops, dcn_send_bytes)")
    p.add_argument("--tpu", metavar="GEN:TOPOLOGY", help="compile with libtpu for this topology, e.g. v4:2x2x1")
    p.add_argument("--chip-config", default="default", help="libtpu chip config: megacore (v4, v5p) or default")
    p.add_argument("--host-bounds", default="", metavar="X,Y,Z",
                   help="chips per host, as a box (default: 2,2,1, or the whole topology when it is smaller)")
    p.add_argument("--fallback-cpu", action="store_true",
                   help="with --tpu: without libtpu, compile for N CPU devices instead (flagged as an estimate)")
    p.add_argument("--run-platform", default="cpu", choices=("cpu", "tpu"),
                   help="without --tpu: the platform the run will have (its --dtype auto follows it)")
    p.add_argument("--counts-dir", metavar="DIR",
                   help="where this machine keeps the figures of each program it compiled, found by the program "
                        "(trainer/common/program_counts.py); without it only tpuctl's own records are read")
    p.add_argument("--recount", action="store_true",
                   help="compile even when a record of the program is found (and record it again)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, trainer_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    try:
        if not trainer_argv:
            raise UsageError("nothing to plan: put the trainer command after --, e.g. -- pretrain --preset gpt2-124m")
        opts = _options().parse_args(own)
        args = cli.parser().parse_args(trainer_argv)
        aot.check(args)  # before jax starts: a command with nothing to plan is answered at once
        counts = program_counts.Store(opts.counts_dir, recount=opts.recount)
        target = aot.target(opts)
        if any(d.platform == "tpu" for d in target.devices):
            # A program compiled for a topology without its devices cannot be loaded back from jax's persistent
            # cache ("PjRtCompiler must be constructed with a Client"), yet one inherited from the environment
            # (JAX_COMPILATION_CACHE_DIR) would still serialize and write each: 100+ MB for a written-out Gemma step.
            import jax
            jax.config.update("jax_enable_compilation_cache", False)
        out = aot.plan(args, target, STARTED, counts)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return aot.NOTHING_TO_PLAN if isinstance(e, aot.NotPlannable) else 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
