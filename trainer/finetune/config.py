"""The flags of `python -m trainer lora` as one frozen config (jax-free: the CLI builds its parser from it
before jax is imported)."""
from __future__ import annotations

import dataclasses

from trainer.common.config import UsageError


def size_of(model: str) -> str | None:
    """--model names a size ("gemma2-2b") or a family ("gemma2"): the size, or None."""
    return model if "-" in (model or "") else None


@dataclasses.dataclass(frozen=True)
class LoraRun:
    weights: str
    data: str
    ckpt_dir: str
    val_data: str = ""
    val_fraction: float = 0.1
    tokenizer: str = ""
    model: str = ""                 # expected family or named size ("" = from the checkpoint)
    weights_config: str = ""        # KEY=VALUE,...: what a flax checkpoint's shapes cannot tell (gemma/weights.py)
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "q,v"
    base_dtype: str = "auto"        # auto (bf16 on TPU/GPU, f32 on CPU), float32, bfloat16
    dtype: str = "auto"             # compute dtype, as for pretraining
    seq_len: int = 512
    packing: str = "on"
    long: str = "truncate"
    batch_size: int = 0             # global, in rows; 0 = 4 per device
    epochs: float = 3.0
    steps: int = 0                  # absolute step to train up to; 0 = from --epochs
    lr: float = 1e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0       # 1 = constant after warmup
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    mesh: str = ""
    ckpt_every: int = 100
    keep: int = 3
    log_every: int = 10
    eval_every: int = 0             # val loss every N steps (and at the last); 0 = only at the last
    attention: str = "auto"         # auto (splash kernel on TPU, XLA elsewhere), xla, splash
    remat: str = "auto"             # what each layer recomputes in the backward pass: auto, none, dots, full
    loss_chunk: int = 0             # positions whose logits exist at once in the loss (0: all)
    expert_capacity: float = 2.0    # rows a device's experts take, x the even share (trainer/models/moe.py; 0: dropless)
    lora_impl: str = "stacked"      # how paired projections' adapters are applied (trainer/models/lora.py IMPLS)
    profile: str = ""               # START:END: steps every process traces (trainer/common/profiling.py)

    @property
    def family(self) -> str | None:
        """The family --model names ("gemma2-2b" -> "gemma2"), or None: whatever the checkpoint is."""
        return self.model.split("-", 1)[0] if self.model else None

    @property
    def size(self) -> str | None:
        """The named size --model gives (trainer/models/gemma.py SIZES), if it names one: the step can be built
        from it without reading --weights (`tpuctl plan`), and the run checks the checkpoint is that size."""
        return size_of(self.model)

    @property
    def lora(self):
        from trainer.models import lora as lora_lib
        return lora_lib.LoraConfig(self.rank, self.alpha, self.dropout, lora_lib.resolve_targets(self.targets))

    def check(self) -> None:
        from trainer.models import gemma
        self.lora.check()
        if self.model and self.model not in gemma.FAMILIES and self.model not in gemma.SIZES:
            raise UsageError(f"--model {self.model}: choose a family ({', '.join(gemma.FAMILIES)}) or a size "
                             f"({', '.join(gemma.SIZES)})")
        for flag, v in {"--seq-len": self.seq_len, "--keep": self.keep, "--log-every": self.log_every}.items():
            if v < 1:
                raise UsageError(f"{flag} {v}: must be at least 1")
        for flag, v in {"--batch-size": self.batch_size, "--loss-chunk": self.loss_chunk, "--steps": self.steps,
                        "--lr": self.lr, "--warmup-steps": self.warmup_steps, "--ckpt-every": self.ckpt_every,
                        "--eval-every": self.eval_every, "--weight-decay": self.weight_decay,
                        "--grad-clip": self.grad_clip,
                        "--expert-capacity": self.expert_capacity}.items():
            if v < 0:
                raise UsageError(f"{flag} {v}: must not be negative")
        if self.epochs <= 0 and not self.steps:
            raise UsageError(f"--epochs {self.epochs}: must be positive (or pass --steps)")
        if self.packing not in ("on", "off"):
            raise UsageError(f"--packing {self.packing}: choose on or off")
        for flag, v in {"--dtype": self.dtype, "--base-dtype": self.base_dtype}.items():
            if v not in ("auto", "float32", "bfloat16"):
                raise UsageError(f"{flag} {v}: choose auto, float32 or bfloat16")
        if self.attention not in ("auto", "xla", "splash"):
            raise UsageError(f"--attention {self.attention}: choose auto, xla or splash")
        from trainer.models.lora import IMPLS
        if self.lora_impl not in IMPLS:
            raise UsageError(f"--lora-impl {self.lora_impl}: choose {' or '.join(IMPLS)}")
        if self.remat not in ("auto", "none", "dots", "full"):
            raise UsageError(f"--remat {self.remat}: choose auto, none, dots or full")
        if not self.ckpt_dir:
            raise UsageError("--ckpt-dir is required: a local directory or gs://BUCKET/PATH for the adapters")

    def to_dict(self) -> dict:  # what Checkpointer.save stores as the run's config
        return dataclasses.asdict(self)
