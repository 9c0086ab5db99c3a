"""What each `auto` flag picks on a TPU: the choice the chip measured faster, one row per chip kind, each naming
its source. `python -m bench.tpu` (`make tpu-check`) measures every alternative again on a TPU host and prints
beside each row what this table picks, so a new chip or a new libtpu can be read against it. Jax-free.

Only one kind has been measured (one TPU v5 lite chip). Other kinds take its loss choice and say so
(`measured_on`): the byte counts that chose before (the compiler's, `make bench`) favoured the Pallas loss there too,
and the chip did not agree with them. Their attention stays splash: the resident kernel's blocks are sized for v5e's
VMEM and no other kind has timed it."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Choices:
    loss_kernel: str      # --loss-kernel auto on TPU: "xla" (xent.chunked) or "pallas" (trainer/kernels/xent_kernel.py)
    attention: str        # --attention auto on TPU (a sequence of whole 128-position blocks): "resident" (where the
    #                       model's attention is one the kernel takes, else splash), "splash" or "xla"
    source: str           # where the figures below were measured
    resident_head_dims: tuple = (64,)  # auto's resident kernel only at the head widths the chip timed it at
    evidence: dict = field(default_factory=dict)  # per flag: the measured rows the choice rests on


V5E = Choices(
    loss_kernel="xla", attention="resident",
    source="one TPU v5 lite chip, jax 0.10.2, libtpu 0.0.42.1, 2026-12-05 and 2026-12-06: gpt2-124m, T 1024, the "
           "trainer's step (python -m bench.tpu: bench/tpu_records/v5e-2026-12-05.json, "
           "bench/tpu_records/v5e-2026-12-06-b7ab3c2.json) and the trainer CLI",
    evidence={
        "loss_kernel": "xla against pallas: batch 8 60.4 against 62.5 ms a step (the check), batch 32 248.3 against "
                       "253.5 ms, the CLI at batch 16 135.0k against 133.3k tok/s; the loss and its gradients alone "
                       "for 8 x 1024 tokens: 12.0 ms (XLA, chunks of 256) against 14.0 ms (the kernels)",
        "attention": "resident (block 256) against splash: batch 8 52.1 against 60.4 ms a step (blocks 128 and 512: "
                     "57.4 and 52.8 ms), the CLI at batch 16 160.3k against 135.3k tok/s; one layer's attention "
                     "forward and backward (16 x 1024, 12 heads of 64) 1.47 ms against 2.98 ms; splash against xla: "
                     "batch 8 60.4 against 118.1 ms. The resident kernel takes GPT-2's plain causal attention at "
                     "head_dim 64; Gemma's (windows, soft-capping, packed rows) stays splash",
        "kept defaults": "--resident-block 256, --splash-block 1024 (512: 60.4 ms, the same), --remat none (full: 73.1 ms), "
                         "--loss-chunk 256 (0: 64.3 ms), all at batch 8",
    })

MEASURED = {"TPU v5 lite": V5E, "TPU v5e": V5E}
# A kind no chip has measured: v5e's loss choice; splash for attention (the resident kernel is v5e's measurement)
UNMEASURED = replace(V5E, attention="splash")


def for_kind(device_kind: str) -> tuple[Choices, str]:
    """(the choices for a TPU of this kind, the kind they were measured on)."""
    row = MEASURED.get(device_kind)
    return (row, device_kind) if row else (UNMEASURED, "TPU v5 lite")
