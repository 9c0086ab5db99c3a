"""Our gpt2-124m step beside the seed's (bench/seed_gpt2.py) at T 1024, and the alternatives of every choice an
`auto` flag or a default makes, each timed on the chip. The plan's calibrated time for the same step is compiled
ahead, off the chip (`python -m bench.tpu --plan-ahead`, bench/tpu/plans.py), and joined by the row's name.

MFU counts (6 N + 12 L T D) per token at the chip's bf16 peak, N without the position table (nanoGPT's and llm.c's
formula, trainer/common/metrics.flops_per_token), the same for the seed's model."""
from __future__ import annotations

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench.tpu.common import Row, Settings, block, hbm_of, reps_for, say, time_steps

PRESET = "gpt2-124m"
BATCHES = (8, 16, 32)
# (row name, TrainConfig fields) at batch 8: each alternative of a choice the trainer makes
ALTERNATIVES = {
    "loss kernel: pallas": {"loss_kernel": "pallas"},
    "attention: xla": {"attention": "xla"},
    "attention: splash": {"attention": "splash"},
    "attention: resident, block 128": {"attention": "resident", "resident_block": 128},
    "attention: resident, block 256": {"attention": "resident", "resident_block": 256},
    "attention: resident, block 512": {"attention": "resident", "resident_block": 512},
    "splash block 512": {"splash_block": 512},
    "remat full": {"remat": "full"},
    "loss chunk 0 (whole logits)": {"loss_chunk": 0, "loss_kernel": "xla"},
    "logits compute (bf16 logits in the loss)": {"logits": "compute", "loss_kernel": "xla"},
}
QUICK_MODEL = {"n_layer": 1, "n_head": 2, "d_model": 128, "seq_len": 128, "dropout": 0.0}


def _model(s: Settings) -> dict:
    return QUICK_MODEL if s.quick else {}


def trainer(s: Settings, batch: int, train: dict | None = None, prefix: str = "ours-"):
    """(our trainer for gpt2-124m at this batch, `one()`: dispatch its next step on a fixed random batch and
    return the step's loss without waiting)."""
    from bench.ours import OursTrainer, config
    cfg = config(PRESET, tempfile.mkdtemp(dir=s.out, prefix=prefix), model=_model(s),
                 train={"batch_size": batch, "steps": 1000, **(train or {})})
    tr = OursTrainer(cfg)
    m = cfg.model
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (batch, m.seq_len + 1)).astype(np.int32)

    def one():
        tr.n += 1
        tr.params, tr.opt, out = tr.steps.step(tr.params, tr.opt, tokens, tr.n)
        return out["loss"]
    return tr, one


def ours(s: Settings, name: str, batch: int, train: dict | None = None) -> Row:
    from trainer.common import metrics
    tr, one = trainer(s, batch, train)
    say(f"  {name}: compiled in {tr.compile_s:.0f} s; timing")
    m = tr.cfg.model
    first = time_steps(one, 1, block)
    step_s = time_steps(one, reps_for(first), block)
    tps = batch * m.seq_len / step_s
    row = Row("steps", name, step_s=step_s, tokens_per_s=tps, compile_s=tr.compile_s,
              mfu=tps * metrics.flops_per_token(m) / (s.peak * jax.device_count()) if s.peak else None,
              hbm_bytes=hbm_of(tr.steps.train_fn),
              note=f"attention {tr.steps.attention}, loss {'xla' if tr.steps.loss_kernel is None else 'pallas'}",
              figures={"batch": batch, "train": train or {}, "loss": float(one())})
    del tr
    return row


def seed(s: Settings, batch: int) -> Row:
    from bench.seed_gpt2 import SeedConfig, SeedTrainer
    from trainer.common import config as config_lib, metrics
    m0, _ = config_lib.PRESETS[PRESET]
    m = dataclasses.replace(m0, **_model(s))
    on_tpu = jax.default_backend() == "tpu"
    cfg = SeedConfig(n_layer=m.n_layer, d_model=m.d_model, n_head=m.n_head, seq_len=m.seq_len, batch_size=batch,
                     dtype=jnp.bfloat16 if on_tpu else jnp.float32)
    try:
        tr = SeedTrainer(cfg)
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg.vocab_size, (batch, m.seq_len)).astype(np.int32)
        y = np.roll(x, -1, axis=1)
        import time
        t0 = time.perf_counter()
        tr.step(x, y)  # its first call compiles (the seed jits on first use)
        compile_s = time.perf_counter() - t0
        first = time_steps(lambda: tr.step(x, y), 1, lambda _: None)
        step_s = time_steps(lambda: tr.step(x, y), reps_for(first), lambda _: None)
    except Exception as e:  # noqa: BLE001 - out of memory at a batch ours fits is a finding, not a crash
        return Row("steps", f"seed, batch {batch}", ok=None, note=f"failed: {str(e).splitlines()[0][:120]}")
    tps = batch * m.seq_len / step_s
    return Row("steps", f"seed, batch {batch}", step_s=step_s, tokens_per_s=tps, compile_s=compile_s,
               mfu=tps * metrics.flops_per_token(m) / (s.peak * jax.device_count()) if s.peak else None,
               note=f"bench/seed_gpt2.py, {jnp.dtype(cfg.dtype).name}", figures={"batch": batch})


def run(s: Settings):
    for b in ((8, 16) if s.quick else BATCHES):
        for who in ("ours", "seed"):
            name = f"{who}, batch {b}"
            if s.wants(name):
                yield ours(s, name, b) if who == "ours" else seed(s, b)


def choices(s: Settings):
    """Every alternative at batch 8 (the default's own row is `ours, batch 8`), and what the table picks."""
    from trainer.common import chip_choices
    row, measured_on = chip_choices.for_kind(s.device_kind)
    for name, train in ALTERNATIVES.items():
        if (s.pick and not any(w in name for w in s.pick)) or not s.wants(f"ours, batch 8, {name}"):
            continue
        r = ours(s, f"ours, batch 8, {name}", 8, train)
        r.section = "choices"
        yield r
    yield Row("choices", "auto picks (trainer/common/chip_choices.py)", ok=None,
              note=f"loss kernel {row.loss_kernel}, attention {row.attention} (measured on {measured_on})",
              figures={"loss_kernel": row.loss_kernel, "attention": row.attention, "measured_on": measured_on})
