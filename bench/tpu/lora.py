"""A LoRA step of Gemma on the chip from random bf16 weights (no checkpoint is needed to time a step): rank 8 on
every projection (q, k, v, o and the MLP's three), T 512, the batch each size is measured at. MFU counts
4 N_base + 6 N_lora + 12 L T H head_dim per token (trainer/common/aot.lora_flops_per_token); the plan's
calibrated time is computed from the same compiled step."""
from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench.tpu.common import Row, Settings, block, hbm_of, plan_time, reps_for, time_steps

# batch (rows of 512) each is measured at on one v5e chip: gemma2-2b's and gemma3-1b's as before; gemma4-e2b's the
# batch the plan says fits (10.6 of 15.7 GiB at 1 row; not yet run on a chip)
SIZES = {"gemma2-2b": 4, "gemma3-1b": 8, "gemma4-e2b": 1}
QUICK = dict(family="gemma2", vocab=1024, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ff=1024,
             sliding_window=64, query_pre_attn_scalar=64.0)


def step_row(s: Settings, size: str, batch: int, seq_len: int = 512) -> Row:
    from trainer.common import aot, mesh as mesh_lib
    from trainer.finetune import data as sft_data, train as finetune
    from trainer.finetune.config import LoraRun
    from trainer.models import gemma, lora as lora_lib
    cfg = gemma.GemmaConfig(**QUICK) if s.quick else gemma.SIZES[size]
    seq_len = 128 if s.quick else seq_len
    run = LoraRun(weights="-", data="-", ckpt_dir=tempfile.mkdtemp(dir=s.out), model=size, targets="all",
                  seq_len=seq_len, batch_size=batch, steps=1000, base_dtype="bfloat16")
    mesh = mesh_lib.make_mesh({"data": 1, "model": 1}, jax.devices()[:1])
    steps = finetune.Steps(run, cfg, mesh, 1000, batch)
    # drawn where it lives, then stacked as the step takes it
    base = block(steps.place_base(gemma.random_params(cfg, dtype=jnp.bfloat16, shardings=steps.flat_base_sh),
                                  free=True))
    lora, opt = steps.init()
    compile_s = steps.compile(base)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, cfg.vocab, (batch, seq_len)).astype(np.int32)
    local = {"inputs": ids, "targets": np.roll(ids, -1, axis=1), "weights": np.ones((batch, seq_len), np.float32),
             "segments": np.ones((batch, seq_len), np.int32),
             "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()}
    assert set(local) == set(sft_data.FIELDS)
    state = {"lora": lora, "opt": opt, "n": 0}

    def one():
        state["n"] += 1
        state["lora"], state["opt"], out = steps.step(state["lora"], state["opt"], base, local, state["n"])
        return out["loss"]
    first = time_steps(one, 1, block)
    step_s = time_steps(one, reps_for(first), block)
    tokens = batch * seq_len
    fpt = aot.lora_flops_per_token(cfg, lora_lib.count(cfg, run.lora), seq_len)
    tps = tokens / step_s
    row = Row("lora", f"{size} LoRA r8 all targets, {batch} x {seq_len}", step_s=step_s, tokens_per_s=tps,
              compile_s=compile_s, mfu=tps * fpt / s.peak if s.peak else None, hbm_bytes=hbm_of(steps.train_fn),
              note=f"attention {steps.attention}, random bf16 base", figures={"batch": batch, "seq_len": seq_len})
    # its loss takes the logits whole (no loop): the program counts the whole step
    row.plan_s, work = plan_time(s, steps.train_fn, tokens, aot.splash_flops_per_token(
        cfg.n_layers, seq_len, cfg.n_heads * cfg.head_dim, steps.attention), cfg.head_dim)
    if work:
        row.figures["work"] = work
    return row


def run(s: Settings) -> list[Row]:
    sizes = {k: v for k, v in SIZES.items() if not k.startswith("gemma4")} if s.quick else SIZES  # one tiny config
    return [step_row(s, size, 2 if s.quick else batch) for size, batch in sizes.items()]
