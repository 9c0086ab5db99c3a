"""`python -m bench.lora_chip --model gemma4-e2b`: one LoRA train step of a named Gemma size on this machine's
accelerators, on a random bf16 base (no weights read): whether it fits, its step time, tokens/s, HBM and MFU.

The step is the trainer's own (trainer/finetune/train.py Steps: the base fsdp over data, f32 adapters, the chunked
loss), compiled ahead of time, run once to warm up and then timed over --steps; the batch is random tokens.
MFU = LoRA's model FLOPs (trainer/common/aot.py lora_flops_per_token) per second over the chips' bf16 peak
(trainer/common/chips.py). Prints one JSON line last.

    python -m bench.lora_chip --model gemma4-e2b --batch-size 1 --seq-len 512 [--mesh data=1] [--targets q,v]
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lora_chip", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma4-e2b", help="a size of trainer/models/gemma.py SIZES")
    p.add_argument("--batch-size", type=int, default=1, help="rows per step (global)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q,v")
    p.add_argument("--mesh", default="", help="data=D,model=M (default: every device on data)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up one")
    p.add_argument("--attention", default="auto")
    p.add_argument("--remat", default="none")
    p.add_argument("--loss-chunk", type=int, default=0)
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer.common import mesh as mesh_lib
    from trainer.common.aot import lora_flops_per_token
    from trainer.common.chips import PEAK_FLOPS
    from trainer.finetune import train as finetune
    from trainer.finetune.config import LoraRun
    from trainer.models import gemma, lora as lora_lib

    if a.model not in gemma.SIZES:
        print(f"--model {a.model}: choose one of {', '.join(gemma.SIZES)}", file=sys.stderr)
        return 2
    cfg = gemma.SIZES[a.model]
    run = LoraRun(weights="", data="", ckpt_dir="unused", model=a.model, rank=a.rank, alpha=2.0 * a.rank,
                  targets=a.targets, seq_len=a.seq_len, batch_size=a.batch_size, dtype="bfloat16",
                  base_dtype="bfloat16", lr=1e-4, attention=a.attention, remat=a.remat, loss_chunk=a.loss_chunk)
    mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh(a.mesh, jax.device_count()))
    steps = finetune.Steps(run, cfg, mesh, 1000, a.batch_size)
    base = jax.block_until_ready(gemma.random_params(cfg, 0, jnp.bfloat16, steps.base_sh))
    compile_s = steps.compile(base)
    mem = steps.train_fn.memory_analysis()
    state = list(steps.init())
    rng = np.random.default_rng(0)
    b, t = a.batch_size, a.seq_len
    toks = rng.integers(4, cfg.vocab, (b, t + 1)).astype(np.int32)
    local = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "weights": np.ones((b, t), np.float32),
             "segments": np.ones((b, t), np.int32), "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))}
    lora, opt, m = steps.step(state[0], state[1], base, local, 1)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for s in range(a.steps):
        lora, opt, m = steps.step(lora, opt, base, local, 2 + s)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / a.steps
    tokens = b * t
    flops = lora_flops_per_token(cfg, lora_lib.count(cfg, run.lora), t) * tokens
    kind = jax.devices()[0].device_kind
    peak = PEAK_FLOPS.get(kind, 0.0) * jax.device_count()
    stats = jax.devices()[0].memory_stats() or {}
    out = {"model": a.model, "device_kind": kind, "devices": jax.device_count(), "mesh": mesh_lib.shape_of(mesh),
           "batch": b, "seq_len": t, "targets": ",".join(run.lora.targets), "rank": a.rank,
           "attention": steps.attention, "compile_s": round(compile_s, 1), "step_s": round(step_s, 4),
           "tokens_per_s": round(tokens / step_s, 1), "loss": float(m["loss"]),
           "model_tflop_per_step": round(flops / 1e12, 3), "mfu": round(flops / step_s / peak, 4) if peak else None,
           "base_gib": round(sum(x.nbytes for x in base.values()) / 2**30, 2),
           "compiled_temp_gib": round(mem.temp_size_in_bytes / 2**30, 2) if mem else None,
           "peak_hbm_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2) or None,
           "hbm_limit_gib": round(stats.get("bytes_limit", 0) / 2**30, 2) or None}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
