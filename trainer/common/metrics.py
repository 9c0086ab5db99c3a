"""Training metrics: model FLOPs and MFU, metrics.jsonl, TensorBoard (tensorboardX: no TensorFlow), progress.

metrics.jsonl: one JSON object per logged step with step, loss, val_loss (when evaluated), tokens_per_s
(global, compile excluded), mfu (null when the peak is unknown), step_time_s, lr, grad_norm.
Both live with the run, never in the current folder: `--ckpt-dir/metrics.jsonl` and `--ckpt-dir/tensorboard/`,
so `tensorboard --logdir <ckpt-dir>` works for a gs:// run as for a local one.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from etils import epath

from trainer.common.chips import PEAK_FLOPS
from trainer.common.config import ModelConfig

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
    """Writes on process 0 only. On resume, lines of steps after the restored step are dropped.

    GCS objects cannot be appended to: on gs:// metrics.jsonl is rewritten at each log (a small file), and the
    TensorBoard events are written to a private temp folder and uploaded beside it every `upload_every_s`
    seconds and at close (a kill loses at most that much of the events; metrics.jsonl is always current).
    """

    def __init__(self, ckpt_dir: str, start_step: int, enabled: bool, upload_every_s: float = 30.0):
        self.enabled = enabled
        self.path = epath.Path(ckpt_dir) / "metrics.jsonl"
        self.tb_dir = epath.Path(ckpt_dir) / "tensorboard"
        self.remote = "://" in ckpt_dir
        self.upload_every_s, self._uploaded = upload_every_s, time.monotonic()
        self.lines: list[str] = []
        self.tb = self._staging = None
        if not enabled:
            return
        old = self.path.read_text().splitlines() if self.path.exists() else []
        self.lines = [ln for ln in old if ln.strip() and _step(ln) <= start_step]
        self.path.write_text("".join(ln + "\n" for ln in self.lines))
        from tensorboardX import SummaryWriter
        if self.remote:
            self._staging = tempfile.mkdtemp(prefix="tpuctl-tensorboard-")
        logdir = self._staging or str(self.tb_dir)
        self.tb = SummaryWriter(logdir=logdir, purge_step=start_step + 1 if start_step else None)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(rec)
        self.lines.append(line)
        if self.remote:
            self.path.write_text("".join(ln + "\n" for ln in self.lines))
        else:
            with open(str(self.path), "a") as f:
                f.write(line + "\n")
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(f"train/{k}", v, rec["step"])
        self.tb.flush()
        if self.remote and time.monotonic() - self._uploaded >= self.upload_every_s:
            self._upload()

    def _upload(self) -> None:
        """Copy the staged event files to <ckpt-dir>/tensorboard/ (whole files: each is small, and rewritten)."""
        self.tb_dir.mkdir(parents=True, exist_ok=True)
        for f in sorted(Path(self._staging).iterdir()):
            (self.tb_dir / f.name).write_bytes(f.read_bytes())
        self._uploaded = time.monotonic()

    def close(self) -> None:
        if self.tb is None:
            return
        self.tb.close()
        self.tb = None
        if self._staging:
            try:
                self._upload()
            finally:
                shutil.rmtree(self._staging, ignore_errors=True)


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def progress(rec: dict, total: int) -> str:
    """One terminal line: step, losses, throughput, MFU, step time."""
    parts = [f"step {rec['step']:>{len(str(total))}}/{total}", f"loss {rec['loss']:.4f}"]
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f} (ppl {perplexity(rec['val_loss']):,.1f})")
    if rec.get("tokens_per_s"):
        parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    if rec.get("step_time_s"):
        parts.append(f"{rec['step_time_s']:.3f} s/step")
    if rec.get("expert_dropped") is not None:  # the share of the step's expert assignments over capacity
        parts.append(f"experts dropped {100 * rec['expert_dropped']:.2f}%")
    if rec.get("left_out_s"):
        parts.append(", ".join(f"{k} {v:.2f} s" for k, v in rec["left_out_s"].items()) + " left out")
    return " | ".join(parts)


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy in nats); inf past what a float holds (a diverged run)."""
    return math.exp(loss) if loss < 700 else math.inf


def say(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)
