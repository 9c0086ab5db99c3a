"""What each `auto` flag picks on a TPU: the choice the chip measured faster, one row per chip kind, each naming
its source. `python -m bench.tpu` (`make tpu-check`) measures every alternative again on a TPU host and prints
beside each row what this table picks, so a new chip or a new libtpu can be read against it. Jax-free.

Only one kind has been measured (one TPU v5 lite chip). Other kinds take its row and say so (`measured_on`):
the byte counts that chose before (the compiler's, `make bench`) favoured the Pallas loss there too, and the chip
did not agree with them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choices:
    loss_kernel: str      # --loss-kernel auto on TPU: "xla" (xent.chunked) or "pallas" (trainer/kernels/xent_kernel.py)
    attention: str        # --attention auto on TPU (a sequence of whole 128-position blocks): "splash" or "xla"
    source: str           # where the figures below were measured
    evidence: dict = field(default_factory=dict)  # per flag: the measured rows the choice rests on


V5E = Choices(
    loss_kernel="xla", attention="splash",
    source="one TPU v5 lite chip, jax 0.10.2, libtpu 0.0.42.1, 2026-12-05: gpt2-124m, T 1024, the trainer's step "
           "(python -m bench.tpu, bench/tpu_records/v5e-2026-12-05.json) and the trainer CLI",
    evidence={
        "loss_kernel": "xla against pallas: batch 8 60.4 against 62.5 ms a step (the check), batch 32 248.3 against "
                       "253.5 ms, the CLI at batch 16 135.0k against 133.3k tok/s; the loss and its gradients alone "
                       "for 8 x 1024 tokens: 12.0 ms (XLA, chunks of 256) against 14.0 ms (the kernels)",
        "attention": "splash against xla: batch 8 60.4 against 118.1 ms a step",
        "kept defaults": "--splash-block 1024 (512: 60.4 ms, the same), --remat none (full: 73.1 ms), "
                         "--loss-chunk 256 (0: 64.3 ms), all at batch 8",
    })

MEASURED = {"TPU v5 lite": V5E, "TPU v5e": V5E}


def for_kind(device_kind: str) -> tuple[Choices, str]:
    """(the choices for a TPU of this kind, the kind they were measured on)."""
    row = MEASURED.get(device_kind)
    return (row, device_kind) if row else (V5E, "TPU v5 lite")
