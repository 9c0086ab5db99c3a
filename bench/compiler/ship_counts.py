"""tpuctl's own records of programs (trainer/common/program_counts.py): the default Gemma 4 LoRA steps whose
layers are written out, each planned cold as a user plans it, its record copied into trainer/common/shipped/ with
the command that builds it. A cold `tpuctl plan` of those commands then lowers the step and reads the compiler's
figures from the record (seconds) instead of compiling it (3 to 5 minutes on 2 cores).

    python -m bench.compiler.ship_counts [--only v4-8:gemma4-e2b,...]

Run it again when tests/test_program_counts.py says a record no longer matches its step (the step's program, the
compiler's version or its flags changed): the records of the commands it plans are replaced, the others kept.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from bench.compiler import gemma_plans
from trainer.common import program_counts

# (slice, size) whose default LoRA step `--remat auto` writes out: the plans over two minutes on 2 cores
DEFAULTS = (("v5litepod-8", "gemma4-e2b"), ("v4-8", "gemma4-e2b"), ("v4-8", "gemma4-e4b"))


def command(accelerator: str, size: str) -> list[str]:
    """The plan a user runs (the docs' tables' command, without --no-cache)."""
    return [a for a in gemma_plans.command(accelerator, size, []) if a != "--no-cache"]


def record(accelerator: str, size: str, shipped: Path = program_counts.SHIPPED, say=print) -> Path:
    """Plan the default step cold in a fresh plan cache and ship its program's record; the path written."""
    argv = command(accelerator, size)
    with tempfile.TemporaryDirectory(prefix="tpuctl-ship-") as home:
        plan = gemma_plans.plan_one(argv, cache_home=home)
        if "error" in plan or not plan.get("fits"):
            raise SystemExit(f"{shlex.join(argv)} failed: {plan.get('error') or plan.get('verdict')}")
        if plan.get("counted_earlier"):
            raise SystemExit(f"{shlex.join(argv)} was answered from a record, not compiled: nothing new to ship")
        found = list(Path(home, "plans", "programs").glob("*.json"))
        if len(found) != 1:  # a plan that compiled more than its step (a suggestion, a larger slice) is no default
            raise SystemExit(f"{shlex.join(argv)} recorded {len(found)} programs, not one: is it still a default "
                             f"that fits?")
        rec = json.loads(found[0].read_text())
    rec["command"] = shlex.join(argv)
    for old in shipped.glob("*.json"):  # the same command's older record: its program is no longer built
        if json.loads(old.read_text()).get("command") == rec["command"]:
            old.unlink()
    shipped.mkdir(parents=True, exist_ok=True)
    path = shipped / f"{rec['key']}.json"
    path.write_text(program_counts.shareable(json.dumps(rec, indent=1, sort_keys=True)) + "\n")
    say(f"{accelerator} {size}: planned in {plan['wall_s']:.0f}s, "
        f"{rec['figures']['total_bytes'] / 2 ** 30:.2f} GiB a device; {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compiler.ship_counts", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="SLICE:SIZE,... of DEFAULTS (default: all of them)")
    args = p.parse_args(argv)
    wanted = [tuple(x.split(":", 1)) for x in args.only.split(",") if x] or list(DEFAULTS)
    unknown = [w for w in wanted if w not in DEFAULTS]
    if unknown:
        p.error(f"--only {args.only}: not a default written out ({', '.join(':'.join(d) for d in DEFAULTS)})")
    for accelerator, size in wanted:
        record(accelerator, size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
