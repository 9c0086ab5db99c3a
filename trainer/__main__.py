"""`python -m trainer prepare|pretrain|sample|sweep|report ...` (the command line is a contract: docs/CONTRACTS.md).

--emulate-devices N is handled before jax is imported: it adds N CPU devices to XLA_FLAGS (an
inherited device-count flag wins). On the CPU backend, freed host memory is kept for reuse
(trainer/hostmem.py; TPUCTL_KEEP_FREED_MEMORY=0 leaves glibc's defaults). Exit codes: 0 done, 2 bad input
(`error: ...` on stderr), 42 stopped by a preemption notice after saving, 130 interrupted by Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys

from trainer.config import UsageError, add_config_flags

COUNT_FLAG = "xla_force_host_platform_device_count"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as for every other bad input
        raise UsageError(message)


def emulate_devices(argv: list[str]) -> None:
    """Read --emulate-devices from raw argv and set XLA_FLAGS, before anything imports jax."""
    value = None
    for i, a in enumerate(argv):
        if a == "--emulate-devices" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--emulate-devices="):
            value = a.split("=", 1)[1]
    if value is None:
        return
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"--emulate-devices {value}: expected a positive integer")
    if "jax" in sys.modules:  # called in-process after jax started (tests): the devices are what they are
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{COUNT_FLAG}={int(value)}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def keep_freed_memory() -> None:
    """On the CPU backend (chosen before jax starts), reuse freed host memory instead of page-faulting
    each step's buffers in again: trainer/hostmem.py. Before jax is imported, while there is one thread."""
    if "jax" in sys.modules or os.environ.get("TPUCTL_KEEP_FREED_MEMORY", "1") == "0":
        return
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        from trainer import hostmem
        hostmem.keep_freed_memory()


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainer", description="GPT-2 pretraining on a JAX device mesh.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp):
        sp.add_argument("--emulate-devices", type=int, default=None, metavar="N",
                        help="N CPU devices per process (set before jax starts; an inherited XLA flag wins)")
        return sp

    pr = common(sub.add_parser("prepare", help="tokenise a corpus once into train.bin/val.bin/meta.json"))
    pr.add_argument("--data", nargs="*", default=None, help="text files or dirs (default: Shakespeare's plays)")
    pr.add_argument("--out", required=True, help="output dir, local or gs://")
    pr.add_argument("--val-fraction", type=float, default=0.05)
    pr.add_argument("--markdown", action="store_true",
                    help="keep the embedded plays' Markdown (default: plain `NAME:` speaker turns)")

    pt = common(sub.add_parser("pretrain", help="train (resumes from the latest checkpoint in --ckpt-dir)"))
    add_config_flags(pt)

    sa = common(sub.add_parser("sample", help="generate text from a checkpoint"))
    sa.add_argument("--ckpt-dir", required=True)
    sa.add_argument("--prompt", default="\n")
    sa.add_argument("--max-new-tokens", type=int, default=200)
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=40)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    sa.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))

    from trainer import sweep  # jax-free: `sweep` and `report`
    sweep.add_parsers(sub)
    return p


def run(args: argparse.Namespace) -> int:
    if args.cmd == "prepare":
        from trainer import data
        meta = data.prepare(args.data or None, args.out, args.val_fraction, markdown=args.markdown)
        print(f"prepared {meta['n_train_tokens']:,} train + {meta['n_val_tokens']:,} val tokens "
              f"from {meta['n_files']} file(s) into {args.out}")
        return 0
    if args.cmd == "pretrain":
        from trainer import config, loop
        return loop.pretrain(config.resolve(args))
    if args.cmd in ("sweep", "report"):
        from trainer import sweep
        return sweep.command(args)
    from absl import logging
    from trainer import sample
    logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only checkpoint manager is read-only
    print(sample.generate(args.ckpt_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, seed=args.seed, step=args.step,
                          dtype=args.dtype))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        emulate_devices(argv)
        keep_freed_memory()
        args = parser().parse_args(argv)
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C: nothing a save could keep
        print("interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # trainer.data.DataError (imported lazily: it is jax-free but not needed here)
        if type(e).__name__ != "DataError":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
