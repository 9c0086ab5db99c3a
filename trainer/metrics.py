"""Training metrics: model FLOPs and MFU, metrics.jsonl, TensorBoard (tensorboardX: no TensorFlow), progress.

metrics.jsonl: one JSON object per logged step with step, loss, val_loss (when evaluated), tokens_per_s
(global, compile excluded), mfu (null when the peak is unknown), step_time_s, lr, grad_norm.
"""
from __future__ import annotations

import json
import math
import os
import sys

from etils import epath

from trainer.config import ModelConfig

# Peak dense bf16 FLOP/s per chip, by jax `device_kind`.
PEAK_FLOPS = {
    "TPU v2": 45e12,
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
}


def flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token: 6 x matmul params (output projection included) + causal-free attention."""
    per_layer = m.d_model * 3 * m.d_model + m.d_model * m.d_model + 2 * m.d_model * m.ff
    matmul_params = m.n_layer * per_layer + m.d_model * m.vocab_size
    attention = 12 * m.n_layer * m.seq_len * m.d_model
    return 6.0 * matmul_params + attention


def peak_flops(device_kind: str, override: float) -> float | None:
    """Per-device peak: --peak-flops when given, else the table (None on CPU and unknown kinds)."""
    if override:
        return override
    return PEAK_FLOPS.get(device_kind)


class MetricsLog:
    """Writes on process 0 only. On resume, lines of steps after the restored step are dropped."""

    def __init__(self, ckpt_dir: str, start_step: int, enabled: bool):
        self.enabled = enabled
        self.targets: list[epath.Path] = [epath.Path(ckpt_dir) / "metrics.jsonl"]
        self.remote = ckpt_dir.startswith("gs://")
        if self.remote:
            self.targets.append(epath.Path(os.getcwd()) / "metrics.jsonl")
        self.lines: dict[str, list[str]] = {}
        self.tb = None
        if not enabled:
            return
        for t in self.targets:
            old = t.read_text().splitlines() if t.exists() else []
            self.lines[str(t)] = [ln for ln in old if ln.strip() and _step(ln) <= start_step]
            t.write_text("".join(ln + "\n" for ln in self.lines[str(t)]))
        from tensorboardX import SummaryWriter
        logdir = "tensorboard" if self.remote else str(epath.Path(ckpt_dir) / "tensorboard")
        self.tb = SummaryWriter(logdir=logdir, purge_step=start_step + 1 if start_step else None)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(rec)
        for t in self.targets:
            self.lines[str(t)].append(line)
            if str(t).startswith("gs://"):  # objects cannot be appended to: rewrite (small file)
                t.write_text("".join(ln + "\n" for ln in self.lines[str(t)]))
            else:
                with open(str(t), "a") as f:
                    f.write(line + "\n")
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(f"train/{k}", v, rec["step"])
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def progress(rec: dict, total: int) -> str:
    """One terminal line: step, losses, throughput, MFU, step time."""
    parts = [f"step {rec['step']:>{len(str(total))}}/{total}", f"loss {rec['loss']:.4f}"]
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    if rec.get("tokens_per_s"):
        parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    if rec.get("step_time_s"):
        parts.append(f"{rec['step_time_s']:.3f} s/step")
    return " | ".join(parts)


def say(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)
