"""`python -m bench` (what `make bench` runs): our trainer's step side by side with bench/seed_gpt2.py's.

Prints, from one run on this machine: the seed's and our tokens/s and step time on the seed's config
(L4 D256 H4 T256 B16, 8 emulated CPU devices, mesh 8x1, f32) and their ratios (the seed as it ships, and the
seed given our trainer's host-allocator setting; each contender in its own process, steps alternated); a same-run f32 matmul
"peak" and each model's achieved FLOP/s against it; gpt2-tiny and a gpt2-124m step; the step-time cost of
async Orbax saves; `tpuctl run` on a local slice of 1, 4 and 16 hosts (push+install, run -> first step); and Gemma
greedy sampling with the KV-cache loop vs full recompute; a Gemma LoRA step against tunix's PeftTrainer +
qwix; a 2-host spot run through 0, 1 and 2 preemptions (steps redone, time to recover, goodput); and the TPU
compiler's verdict on a gpt2-124m step for v5e-8 and v4-8 (XLA vs splash attention, full vs chunked loss,
remat policies: bytes accessed, temporaries, memory vs compute time; needs libtpu, the `plan` extra); `prepare`
on a 300 MB web-shaped corpus against tiktoken's bare one-core speed (--workers 1 and 2, process-tree peak memory
at two corpus sizes); the pretraining loader's tokens/s from gs:// beside a local file; one job's step time on 2 slices against
1 slice of the same devices and global batch (the multislice mesh's extra axis); the step time outside a
`--profile` window against unprofiled runs (with and without the profiler server); and our gpt2-124m step beside
the seed's and MaxText's for the same work on v5e-8 and v6e-8, counted whole by the TPU compiler (bytes,
temporaries, FLOPs, the roofline; MaxText's figures read from its bench scripts' records, --maxtext), and where
that step's HBM bytes go, by jax source (bench/compiler/tpu_bytes.py). Numbers on a
shared machine are noisy: read the ratios, not the absolute values. Each section's module is in bench/peers/,
bench/system/ or bench/compiler/, by what it measures (docs/layout.md).
"""
from __future__ import annotations

import argparse
import sys

from bench.devices import emulate

SECTIONS = ("ckpt", "124m", "launch", "gemma", "lora", "preempt", "tpu", "prepare", "loader", "multislice",
            "profile", "side", "bytes")


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, one round: checks the bench runs (its numbers mean nothing)")
    p.add_argument("--rounds", type=int, default=None, help="alternation rounds for seed vs ours (default 3)")
    p.add_argument("--per-round", type=int, default=None, help="timed steps per config per round (default 2)")
    p.add_argument("--ckpt-every", type=int, default=None, help="K for the checkpoint-cost section (default 5)")
    p.add_argument("--maxtext", metavar="PATH",
                   help="MaxText's compile records for the side-by-side table (a JSON file or a folder of them; "
                        "default $TPUCTL_MAXTEXT_FIGURES, else the shared maxtext bench folder; "
                        "bench/maxtext_records/, v6e-8's, is read too)")
    p.add_argument("--skip", action="append", default=[], choices=SECTIONS,
                   help="leave out a section (repeatable)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    for name in ("rounds", "per_round", "ckpt_every"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"error: --{name.replace('_', '-')} {v}: must be at least 1", file=sys.stderr)
            return 2
    emulate(8)
    from trainer.common import hostmem
    kept = hostmem.keep_freed_memory()  # as `python -m trainer` does on the CPU backend: this process runs ours
    import dataclasses

    from bench import run  # imports jax: after XLA_FLAGS

    plan = run.QUICK if args.quick else run.Plan()
    plan = dataclasses.replace(plan, **{k: v for k, v in (("rounds", args.rounds), ("per_round", args.per_round),
                                                           ("ckpt_every", args.ckpt_every),
                                                           ("maxtext", args.maxtext)) if v is not None})
    run.main(plan, set(SECTIONS) - set(args.skip), kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
