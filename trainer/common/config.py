"""Run configuration: a model config and a train config, named presets, CLI overrides.

Jax-free on purpose: `python -m trainer` parses flags before jax is imported (--emulate-devices).
Every field is a flag (`--n-layer`, `--decay-steps`, ...); a flag left out takes the preset's value.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass


class UsageError(ValueError):
    """Bad input. The message is the one-line error the user sees (exit code 2)."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything that fixes the parameter shapes (and the math). A checkpoint must match these."""
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 0  # 0 = 4 * d_model
    seq_len: int = 128  # context length = size of the position table
    vocab_size: int = 50257
    tokenizer: str = ""  # what the ids mean: gpt2 or bytes; "" = the data's (trainer/pretrain/tokenizers.py)
    vocab_multiple: int = 128  # the embedding table is padded to this; padded logits are masked out
    dropout: float = 0.1

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def padded_vocab(self) -> int:
        m = max(1, self.vocab_multiple)
        return -(-self.vocab_size // m) * m

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


@dataclass(frozen=True)
class TrainConfig:
    """How to train: run length, optimizer, data, checkpoints, logging. May change between resumes."""
    steps: int = 200  # absolute step to train up to; a resumed run continues to it
    seed: int = 0
    batch_size: int = 16  # global, in sequences
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 20
    decay_steps: int = 2000  # length of warmup + cosine, independent of --steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    dtype: str = "auto"  # compute dtype: auto (bf16 on TPU/GPU, f32 on CPU), float32, bfloat16
    mesh: str = ""  # "data=D,model=M"; empty = all devices on data
    vocab_parallel: str = "auto"  # tied embedding's vocab over every device: auto (tokens/step < vocab), on, off
    attention: str = "auto"  # auto (on TPU the chip's faster kernel: chip_choices.py; XLA elsewhere), xla, splash, resident
    # How the splash kernel runs (trainer/models/attention.Kernel): q, k, v's layout, its backward kernels, its
    # largest block of positions. GPT-2's head_dim of 64 is half a TPU lane row: with the sequence minor q, k and v
    # are not padded, and one backward kernel reads them once. gpt2-124m on v5e-8 (libtpu 0.0.42.1, --loss-chunk
    # 0, the compiler's count): head-minor + split 43.9 GB and 3.84 GiB of temporaries, seq-minor + fused 39.2 GB
    # and 3.38 GiB. Blocks of 1024 (a whole sequence) take 1.2 GB more off (the fused kernel's partial dq per
    # block of keys, summed outside it) for a third more of the causal scores computed: 4% of the step's FLOPs in
    # a step that waits on memory (with the default loss chunks, 41.3 -> 40.2 GB).
    splash_layout: str = "seq-minor"
    splash_bwd: str = "fused"
    splash_block: int = 1024
    # The forward pass's running statistics in VMEM and its log-sum-exp as [heads, 8, T] (splash_fwd.py), or
    # splash's own forward, which writes them to HBM (the log-sum-exp as [heads, T, 128] f32, then copied).
    # splash stays the default: with compact the kernels move 1.3 GB less, but the compiler's count of the whole
    # gpt2-124m step on v5e-8 (--loss-chunk 0, 2026-12-03, jax 0.10.2, libtpu 0.0.42.1) rises 39.2 -> 47.4 GB:
    # it moves more of the backward pass's operands between HBM and its S(1) memory (docs/verbs.md).
    splash_fwd: str = "splash"
    # The resident kernel's block of positions (--attention resident, trainer/kernels/resident_attention.py):
    # smaller blocks compute less of the causal diagonal's masked half, in more, smaller matmuls.
    resident_block: int = 256
    # Sequence positions whose output logits exist at once; 0 = all [B, T, V]. Each chunk reads the [V, D] table
    # and adds to its gradient, so larger chunks move fewer bytes but hold more temporaries. gpt2-124m, batch 64 x
    # 1024 on v5e-8, per device, counted whole (`python -m trainer.plan --devices 8 --tpu v5e:2x4 -- pretrain
    # --preset gpt2-124m --batch-size 64 --seq-len 1024 ...`, 2026-12-03, jax 0.10.2, libtpu 0.0.42.1): with the
    # splash defaults above and the loss's one pass over each chunk's logits (xent._one_pass), 256 moves 39.2 GB
    # with 2.52 GiB of temporaries, 0 39.2 GB with 3.38 GiB (with the softmax's sum in a pass of its own, 256
    # moved 39.9 GB with 2.45 GiB; with blocks of 512, 41.3 GB); with the
    # head-minor, split kernel before them 128 moved 54.2 GB with 2.71 GiB, 256 46.3 GB with 2.92, 512 45.7 GB
    # with 3.30, 0 43.9 GB with 3.84. 256 takes most of the bytes off for little memory.
    loss_chunk: int = 256
    # The output layer and its loss as two Pallas kernels that keep the logits in VMEM (trainer/models/
    # xent_kernel.py) or as XLA's chunked loss above. auto on TPU: what the chip measured faster
    # (trainer/common/chip_choices.py; on a v5e chip, XLA's: the kernels move fewer bytes, 1.4 GB against 7.7 GB
    # per device for gpt2-124m's output layer and loss on v5e-8, but compute the logits twice, and the step took
    # longer with them).
    loss_kernel: str = "auto"
    remat: str = "none"  # activations recomputed in the backward pass: none, dots, full
    # AdamW's moments replicated, or split over the data axis (ZeRO-1). sharded is not the default: the TPU
    # compiler's gpt2-124m step on v5e-8 (--loss-chunk 0, 2026-12-03, libtpu 0.0.42.1) moves 41.9 GB with 3.93
    # GiB of temporaries against 39.2 GB and 3.38 GiB replicated: the update's 3.6 GB shrink to 0.8, but the
    # split state's layouts cost more elsewhere (before the all-reduce and slice of train.py, 67.2 GB against 43.9:
    # the reduce-scatter became loops of collective permutes). `make bench` section [15] keeps its row.
    optimizer_state: str = "replicated"
    # The tied table's gradient reduced over the batch once per step (its lookup's and output layer's added on
    # each device first, xent.per_shard) or once per use: gpt2-tiny on 2 x v5e-8 sends half the bytes over DCN.
    table_grads: str = "once"
    # The chunked loss's logits written in f32, or in the compute dtype (bf16 on TPU; the softmax still in f32):
    # an experiment measured in `make bench` [15], not the default.
    logits: str = "float32"
    data: str = ""  # prepared dir (local or gs://), text files/dir; empty = embedded Shakespeare
    ckpt_dir: str = ""
    ckpt_every: int = 100
    keep: int = 3
    log_every: int = 10
    eval_every: int = 50  # val loss at these steps (and the last); 0 = only at the last step
    eval_batches: int = 4
    peak_flops: float = 0.0  # peak FLOP/s of ONE device for MFU; 0 = the trainer's table (None on CPU)
    wandb: str = ""  # Weights & Biases project that process 0 logs to (trainer/common/wandb_log.py); empty = off
    profile: str = ""  # START:END: every process traces steps START..END-1 (trainer/common/profiling.py)


@dataclass(frozen=True)
class Config:
    preset: str
    model: ModelConfig
    train: TrainConfig

    def to_dict(self) -> dict:
        return {"preset": self.preset, "model": dataclasses.asdict(self.model),
                "train": dataclasses.asdict(self.train)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(d: dict) -> "Config":
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        tnames = {f.name for f in dataclasses.fields(TrainConfig)}
        return Config(d.get("preset", "?"), ModelConfig(**{k: v for k, v in d["model"].items() if k in names}),
                      TrainConfig(**{k: v for k, v in d.get("train", {}).items() if k in tnames}))


PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    # CPU-sized: a few hundred steps in a few minutes on 2 cores; the 50k-vocab output matmul dominates.
    "gpt2-tiny": (ModelConfig(n_layer=2, n_head=4, d_model=128, seq_len=128, dropout=0.1),
                  TrainConfig(batch_size=8, lr=3e-3, warmup_steps=10, decay_steps=300, steps=300,
                              ckpt_every=100, log_every=10, eval_every=100)),
    # Batch 64 x 1024 tokens fits a 4-chip slice (16 sequences per chip); raise it, or use --grad-accum.
    "gpt2-124m": (ModelConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, dropout=0.0),
                  TrainConfig(batch_size=64, lr=6e-4, warmup_steps=500, decay_steps=20000, steps=20000,
                              ckpt_every=1000, log_every=10, eval_every=500, eval_batches=8)),
    "gpt2-350m": (ModelConfig(n_layer=24, n_head=16, d_model=1024, seq_len=1024, dropout=0.0),
                  TrainConfig(batch_size=64, lr=3e-4, warmup_steps=500, decay_steps=20000, steps=20000,
                              ckpt_every=1000, log_every=10, eval_every=500, eval_batches=8)),
}
DEFAULT_PRESET = "gpt2-tiny"


HELP = {
    "d_ff": "MLP width (0 = 4 x --d-model)",
    "seq_len": "context length (the position table's size)",
    "vocab_size": "ids the model knows (default: the tokenizer's, 50257 for gpt2, 257 for bytes)",
    "tokenizer": "gpt2 or bytes: what the token ids mean (default: the one --data was prepared with, from its meta.json; gpt2 for text and for data without one); `sample` decodes with it",
    "vocab_multiple": "pad the embedding table to a multiple of this (padded logits are masked)",
    "steps": "absolute step to train up to (a resumed run continues to it)",
    "batch_size": "global batch, in sequences",
    "grad_accum": "micro-batches per step (the batch is split, the gradients summed)",
    "min_lr_ratio": "the cosine decays to lr x this",
    "warmup_steps": "linear warmup length",
    "decay_steps": "warmup + cosine length, independent of --steps",
    "grad_clip": "global-norm clip (0 = off)",
    "dtype": "compute dtype: auto (bf16 on TPU/GPU, f32 on CPU), float32, bfloat16",
    "mesh": "data=D,model=M (default: every device on data)",
    "vocab_parallel": "auto, on or off: shard the tied embedding's vocab rows over every device and compute the "
                      "output layer + loss per vocab slice (moves hidden states instead of the [V, D] gradient; "
                      "auto = on when a step's tokens are fewer than the vocab)",
    "attention": "auto, xla, splash or resident: splash and resident are Pallas TPU kernels that never write the "
                 "[T, T] scores to HBM (off TPU they run interpreted: slow, for checks); resident keeps a whole "
                 "sequence of 128 lanes of heads in on-chip memory per grid step and walks only the causal blocks "
                 "(head_dim 64 or 128, at most 8 blocks of --resident-block); auto = on TPU what the chip measured "
                 "faster (trainer/common/chip_choices.py: resident on v5e at head_dim 64, else splash) when "
                 "--seq-len is a multiple of 128, else xla",
    "resident_block": "the resident attention kernel's block of positions (a multiple of 128 dividing --seq-len, "
                      "or --seq-len itself when smaller)",
    "splash_layout": "head-minor or seq-minor: how q, k and v lie in HBM for the splash kernel ([seq, head_dim] "
                     "per head, padded to 128 lanes on TPU when head_dim is smaller; or [head_dim, seq], unpadded)",
    "splash_bwd": "split or fused: the splash kernel's backward pass as two kernels (dq; dk and dv), each reading "
                  "q, k, v and the output's gradient, or as one",
    "splash_block": "the largest block of positions the splash kernel takes at once (a divisor of --seq-len, a "
                    "multiple of 128): larger blocks read k and v fewer times and compute more masked scores",
    "splash_fwd": "compact or splash: the splash kernel's forward pass with its running max, sum and output "
                  "accumulator kept in on-chip memory and its log-sum-exp written once per position (compact), or "
                  "splash's own, which writes them to HBM (the same numbers)",
    "loss_chunk": "sequence positions whose output-layer logits are computed at once, forward and backward "
                  "(the largest divisor of --seq-len not above N; 0 = the whole [batch, seq, vocab] f32 logits)",
    "loss_kernel": "auto, xla or pallas: the output layer and loss as two Pallas TPU kernels that never write a "
                   "logit to HBM (they compute the logits twice; off TPU they run interpreted: slow, for checks), or "
                   "as XLA's chunked loss (--loss-chunk); auto = on TPU what the chip measured faster "
                   "(trainer/common/chip_choices.py: XLA's on v5e), else XLA's",
    "remat": "none, dots or full: what each layer keeps for the backward pass (dots: the weight matmuls' "
             "outputs; full: only its input) and so recomputes; trades compute for memory",
    "optimizer_state": "replicated or sharded: each parameter's AdamW moments whole on every device, or split "
                       "over the mesh's data axis (ZeRO-1: the gradients are reduce-scattered, each device updates "
                       "its share of the moments and the parameters, then the parameters are gathered)",
    "table_grads": "once or per-use: the tied embedding's gradient reduced over the batch once per step (the "
                   "lookup's and the output layer's added on each device first) or once for each (the same "
                   "numbers; once moves fewer bytes, and on several slices sends the table's share over DCN once)",
    "logits": "float32 or compute: the chunked loss's logits written to memory in f32, or in the compute dtype "
              "(--dtype: bf16 on TPU; half the bytes, the softmax still computed in f32 from them)",
    "data": "prepared token dir (local or gs://) or text files/dir (default: Shakespeare)",
    "ckpt_dir": "checkpoints, config.json and metrics.jsonl: a local dir or gs://BUCKET/PATH (required)",
    "ckpt_every": "save every N steps (0 = only at the end and on a preemption notice)",
    "keep": "checkpoints to keep",
    "log_every": "log every N steps (and at step 1 and the last)",
    "eval_every": "validation loss every N steps (0 = only at the last step)",
    "eval_batches": "validation batches per evaluation",
    "peak_flops": "peak FLOP/s of ONE device for MFU (default: the trainer's table; none on CPU)",
    "wandb": "also log the metrics to this Weights & Biases project (process 0 only; needs tpuctl[wandb]; "
             "WANDB_API_KEY via `tpuctl run --secret-env WANDB_API_KEY`, or WANDB_MODE=offline: files under "
             "<ckpt-dir>/wandb/)",
    "profile": "START:END: every process records a jax.profiler trace of steps START to END-1 into "
               "<ckpt-dir>/profiles/<run id>/ (TensorBoard's profile layout; e.g. 5:8 traces steps 5, 6 and 7)",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_type(cls, f: dataclasses.Field):
    t = typing.get_type_hints(cls)[f.name]
    return {int: int, float: float, str: str}[t]


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per config field, defaulting to None (= take the preset's value)."""
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of {', '.join(PRESETS)} (default {DEFAULT_PRESET})")
    for cls, title in ((ModelConfig, "model (must match a checkpoint)"), (TrainConfig, "training")):
        g = p.add_argument_group(title)
        for f in dataclasses.fields(cls):
            g.add_argument(_flag(f.name), dest=f.name, type=_field_type(cls, f), default=None,
                           metavar={int: "N", float: "X", str: "S"}[_field_type(cls, f)],
                           help=HELP.get(f.name, "(from the preset)"))


def resolve(args: argparse.Namespace) -> Config:
    """Preset + the flags that were given -> a validated Config (device-independent checks only)."""
    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}: choose one of {', '.join(PRESETS)}")
    model, train = PRESETS[args.preset]
    pick = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                        if getattr(args, f.name, None) is not None}
    cfg = Config(args.preset, dataclasses.replace(model, **pick(ModelConfig)),
                 dataclasses.replace(train, **pick(TrainConfig)))
    validate(cfg)
    if "://" not in cfg.train.ckpt_dir:  # Orbax and TensorStore want absolute local paths
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, ckpt_dir=os.path.abspath(cfg.train.ckpt_dir)))
    return cfg


def validate(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    positive = {"--n-layer": m.n_layer, "--n-head": m.n_head, "--d-model": m.d_model, "--seq-len": m.seq_len,
                "--steps": t.steps, "--batch-size": t.batch_size, "--grad-accum": t.grad_accum,
                "--decay-steps": t.decay_steps, "--keep": t.keep, "--log-every": t.log_every,
                "--eval-batches": t.eval_batches}
    for flag, v in positive.items():
        if v < 1:
            raise UsageError(f"{flag} {v}: must be at least 1")
    for flag, v in {"--warmup-steps": t.warmup_steps, "--ckpt-every": t.ckpt_every, "--eval-every": t.eval_every,
                    "--d-ff": m.d_ff, "--lr": t.lr, "--weight-decay": t.weight_decay, "--peak-flops": t.peak_flops,
                    "--grad-clip": t.grad_clip}.items():
        if v < 0:
            raise UsageError(f"{flag} {v}: must not be negative")
    if m.d_model % m.n_head:
        raise UsageError(f"--d-model {m.d_model} is not divisible by --n-head {m.n_head}")
    if not 0.0 <= m.dropout < 1.0:
        raise UsageError(f"--dropout {m.dropout}: must be in [0, 1)")
    if t.warmup_steps >= t.decay_steps:
        raise UsageError(f"--warmup-steps {t.warmup_steps} must be below --decay-steps {t.decay_steps}")
    if t.batch_size % t.grad_accum:
        raise UsageError(f"--batch-size {t.batch_size} is not divisible by --grad-accum {t.grad_accum}")
    if t.vocab_parallel not in ("auto", "on", "off"):
        raise UsageError(f"--vocab-parallel {t.vocab_parallel}: choose auto, on or off")
    if t.attention not in ("auto", "xla", "splash", "resident"):
        raise UsageError(f"--attention {t.attention}: choose auto, xla, splash or resident")
    if t.resident_block < LANES or t.resident_block % LANES:
        raise UsageError(f"--resident-block {t.resident_block}: use a multiple of {LANES}")
    check_splash(t.splash_layout, t.splash_bwd, t.splash_block, t.splash_fwd)
    if t.remat not in ("none", "dots", "full"):
        raise UsageError(f"--remat {t.remat}: choose none, dots or full")
    if t.optimizer_state not in ("sharded", "replicated"):
        raise UsageError(f"--optimizer-state {t.optimizer_state}: choose sharded or replicated")
    if t.table_grads not in ("once", "per-use"):
        raise UsageError(f"--table-grads {t.table_grads}: choose once or per-use")
    if t.logits not in ("float32", "compute"):
        raise UsageError(f"--logits {t.logits}: choose float32 or compute")
    if t.loss_kernel not in ("auto", "xla", "pallas"):
        raise UsageError(f"--loss-kernel {t.loss_kernel}: choose auto, xla or pallas")
    if t.loss_chunk < 0:
        raise UsageError(f"--loss-chunk {t.loss_chunk}: must not be negative (0 = no chunks)")
    if t.dtype not in ("auto", "float32", "bfloat16"):
        raise UsageError(f"--dtype {t.dtype}: choose auto, float32 or bfloat16")
    if not t.ckpt_dir:
        raise UsageError("--ckpt-dir is required: a local directory or gs://BUCKET/PATH for checkpoints and metrics")


SPLASH_LAYOUTS, SPLASH_BWD, LANES = ("head-minor", "seq-minor"), ("split", "fused"), 128
SPLASH_FWD = ("compact", "splash")


def check_splash(layout: str, bwd: str, block: int, fwd: str = "splash") -> None:
    """--splash-layout, --splash-bwd, --splash-block, --splash-fwd (trainer/models/attention.Kernel)."""
    if fwd not in SPLASH_FWD:
        raise UsageError(f"--splash-fwd {fwd}: choose {' or '.join(SPLASH_FWD)}")
    if layout not in SPLASH_LAYOUTS:
        raise UsageError(f"--splash-layout {layout}: choose {' or '.join(SPLASH_LAYOUTS)}")
    if bwd not in SPLASH_BWD:
        raise UsageError(f"--splash-bwd {bwd}: choose {' or '.join(SPLASH_BWD)}")
    if block < LANES or block % LANES:
        raise UsageError(f"--splash-block {block}: use a multiple of {LANES}")


def model_diff(saved: ModelConfig, wanted: ModelConfig) -> list[str]:
    """Model fields that differ, as 'name saved->wanted' (empty when they match)."""
    a, b = dataclasses.asdict(saved), dataclasses.asdict(wanted)
    same = lambda k: a[k] == b[k] or (k == "tokenizer" and {a[k], b[k]} <= {"", "gpt2"})  # noqa: E731 - unrecorded = gpt2
    return [f"{k} {a[k]}->{b[k]}" for k in a if not same(k)]
