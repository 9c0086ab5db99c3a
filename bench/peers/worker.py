"""`python -m bench.peers.worker KIND PLAN_JSON`: one contender of the seed-vs-ours comparison, in its own process.

How host memory is allocated is a process-wide setting (trainer/common/hostmem.py, which our trainer applies at
start on the CPU backend), so the seed's code as it ships and the seed's code with that setting each need a
process. The parent (bench/run.py) alternates the contenders' steps: it writes `step` on stdin and the worker
answers `WALL CPU` (seconds, its own clock and its own CPU time) on stdout. After warm-up the worker prints
one JSON line: `{"ready": true, ...}`.

KIND: seed (as it ships) | seed+keep (with the trainer's allocator setting) | ours | dp (ours with the
table replicated, --vocab-parallel off).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

KINDS = ("seed", "seed+keep", "ours", "dp")


def build(kind: str, plan, tmp: str):
    """(step function taking a [B, T+1] token batch, facts for the parent). plan: a bench.run.Plan."""
    import numpy as np

    from bench import run
    if kind.startswith("seed"):
        from bench import seed_gpt2
        seed = seed_gpt2.SeedTrainer(seed_gpt2.SeedConfig(
            n_layer=plan.n_layer, d_model=plan.d_model, n_head=plan.n_head, seq_len=plan.seq_len,
            batch_size=plan.batch, vocab_size=plan.vocab))
        # the notebook's get_batch gives int64
        return (lambda b: seed.step(b[:, :-1].astype(np.int64), b[:, 1:].astype(np.int64)),
                {"n_params": seed.n_params()})
    tr = run.OursTrainer(run.ours_config(plan, os.path.join(tmp, kind),
                                         **({"vocab_parallel": "off"} if kind == "dp" else {})))
    return tr.step, {"n_params": tr.n_params(), "padded_vocab": tr.cfg.model.padded_vocab,
                     "compile_s": tr.compile_s, "vocab_parallel": tr.steps.vocab_parallel}


def main(argv: list[str]) -> int:
    kind, plan = argv[0], json.loads(argv[1])
    if kind not in KINDS:
        print(f"error: unknown contender {kind!r}; one of {', '.join(KINDS)}", file=sys.stderr)
        return 2
    from bench.devices import emulate
    emulate(8)
    kept = False
    if kind != "seed":  # before jax starts its threads, as `python -m trainer` does
        from trainer.common import hostmem
        kept = hostmem.keep_freed_memory()
    import numpy as np

    from bench import run  # imports jax: after the allocator setting

    plan = run.Plan(**plan)
    rng = np.random.default_rng(0)
    batches = [run.tokens(rng, plan.batch, plan.seq_len, plan.vocab) for _ in range(4)]
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind.replace('+', '-')}-") as tmp:
        step, facts = build(kind, plan, tmp)
        for i in range(2):  # the seed compiles twice (its params come back replicated after step 1)
            step(batches[i])
        print(json.dumps({"ready": True, "kept_freed_memory": kept, **facts}), flush=True)
        i = 0
        for line in sys.stdin:
            if line.strip() != "step":
                break
            i += 1
            c0, t1 = run.cpu_s(), time.perf_counter()
            step(batches[i % len(batches)])
            print(f"{time.perf_counter() - t1:.6f} {run.cpu_s() - c0:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
