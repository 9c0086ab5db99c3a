"""The plan's step time, calibrated by the chip: each class of the step's work at the rate a chip was measured to
do it, added up. Jax-free data and arithmetic.

    step_s = matmul_flops / R_matmul + attention_flops / R_attention(head_dim)
             + loss_kernel_flops / R_loss_kernel + other_bytes / R_other

- matmul_flops: the compiler's count of the whole step (trainer/common/aot.py), less the flops the Pallas kernels
  declare in their cost estimates (the loss kernels'): the MXU work of XLA's fusions.
- attention_flops: the splash kernel's work by the arithmetic (12 x layers x positions x heads x head_dim per token,
  the term MFU counts), which the compiler counts as nothing; 0 when XLA computes attention (then it is matmul).
- grouped_matmul_flops: the routed experts' grouped matmuls (jax.lax.ragged_dot, Gemma 4 26B-A4B) by the
  arithmetic, out of matmul_flops: XLA runs them below a plain matmul's rate on TPU, the further the fewer rows
  an expert takes (grouped_rows_per_expert).
- loss_kernel_flops: what trainer/kernels/xent_kernel.py's kernels declare (8 N V D: the logits twice).
- other_bytes: the bytes of every instruction that is neither a matmul fusion nor a kernel nor a collective
  (trainer/common/hlo_bytes.py op_class): elementwise work, reductions, copies, bound by HBM.

A roofline (the peak for every flop, the whole HBM bandwidth for every byte) promised 43.4 ms for gpt2-124m at 8
sequences on one v5e chip, which took 64.6-66.6 ms: matmul fusions run near the peak, splash at head_dim 64 far
below it, and elementwise work is neither. Each rate below is one class's measured figure, so the sum can be
checked against measured steps that mix them differently (`python -m bench.tpu` prints both side by side).

Other chips: the same efficiencies (rate / the chip's peak or HBM bandwidth) applied to their own peak and
bandwidth, marked measured=False: an extrapolation, not a figure. v4's MXUs and v6e's larger ones may reach a
different share of their peak, and splash's head_dim penalty differs with the MXU width (128 on v4/v5e, 256 on v6e).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Rates:
    matmul_flops_s: float
    attention_flops_s: dict            # head_dim -> FLOP/s of the splash kernel, forward and backward
    loss_kernel_flops_s: float
    other_bytes_s: float
    source: str
    measured: bool = True
    figures: dict = field(default_factory=dict)  # what each rate was read from
    # head_dim -> FLOP/s of the resident attention kernel (trainer/kernels/resident_attention.py); empty until a
    # chip has timed it, and then its steps are planned at splash's rate and said to be
    resident_flops_s: dict = field(default_factory=dict)
    # rows an expert takes a layer -> FLOP/s of the experts' grouped matmuls (ragged_dot) forward and back to their
    # rows; empty: priced as plain matmuls
    grouped_matmul_flops_s: dict = field(default_factory=dict)

    def grouped_at(self, rows_per_expert: float) -> float:
        """The grouped matmuls' rate at these rows an expert: between two measured points along the log of the rows
        (the chip's rate rose by about the same step at each doubling from 128 to 1,024, then fell a little at
        2,048), the nearest end's outside them (fewer rows read the same expert weights for less work: no faster
        than the fewest measured; more: no faster than the most); the matmul rate unmeasured."""
        table = self.grouped_matmul_flops_s
        if not table:
            return self.matmul_flops_s
        rows = sorted(table)
        if rows_per_expert <= rows[0]:
            return table[rows[0]]
        if rows_per_expert >= rows[-1]:
            return table[rows[-1]]
        hi = next(n for n in rows if n >= rows_per_expert)
        lo = rows[rows.index(hi) - 1]
        at = math.log(rows_per_expert / lo) / math.log(hi / lo)
        return table[lo] + at * (table[hi] - table[lo])

    def attention_at(self, head_dim: int, kernel: str = "splash") -> float:
        """The kernel's rate at the nearest measured head_dim (at or above a head_dim between them: larger ones
        fill the MXU better); splash's for the resident kernel until it has rates of its own."""
        table = self.resident_flops_s if kernel == "resident" and self.resident_flops_s else self.attention_flops_s
        dims = sorted(table)
        return table[next((d for d in dims if d >= head_dim), dims[-1])]


V5E_PEAK, V5E_HBM = 197e12, 819e9

V5E = Rates(
    matmul_flops_s=189.2e12,
    attention_flops_s={64: 52.1e12, 256: 76.6e12},
    loss_kernel_flops_s=180.8e12,
    other_bytes_s=954e9,
    resident_flops_s={64: 105.2e12},
    grouped_matmul_flops_s={128: 30.5e12, 256: 48.1e12, 512: 63.7e12, 1024: 83.0e12, 2048: 78.6e12},
    source="one TPU v5 lite chip, jax 0.10.2, libtpu 0.0.42.1, 2026-12-05 (python -m bench.tpu: its classes "
           "section, and the default gpt2-124m step at batch 16 for elementwise work; "
           "bench/tpu_records/v5e-2026-12-05.json)",
    figures={
        "matmul": "bf16 MLP matmuls at gpt2-124m's shapes (8192 x 768 x 3072) 188.9 TFLOP/s and gemma2-2b's "
                  "(2048 x 2304 x 9216) 189.5 TFLOP/s: their mean",
        "attention 64": "splash forward and backward, 16 x 1024 positions, 12 heads of 64, by the arithmetic "
                        "(12 T heads head_dim per token): 52.1 TFLOP/s, 26% of the peak",
        "resident 64": "the resident kernel (block 256) on the same work: 105.2 TFLOP/s, 53% of the peak "
                       "(2026-12-06, bench/tpu_records/v5e-2026-12-06-b7ab3c2.json)",
        "grouped matmul": "the experts' gated MLP of Gemma 4 26B-A4B (D 2816, Fe 704) by jax.lax.ragged_dot, forward "
                          "and back to its rows: 16,384 rows over 128 experts, 128 an expert (a chip holding every "
                          "expert at 4 x 512 tokens), 12.77 ms for 390 GFLOP, 30.5 TFLOP/s, 15.5% of the peak; "
                          "32,768 rows over 128, 256 an expert (8 x 512 tokens), 16.21 ms, 48.1 TFLOP/s, 24.4%; "
                          "16,384 routed rows in a 32,768-row buffer over 32 experts, 512 an expert (a device of v4-8 "
                          "under expert parallelism), 6.12 ms, 63.7 TFLOP/s, 32.3%; the same over 16 experts, 1,024 "
                          "an expert (a device of v5litepod-8), 4.70 ms, 83.0 TFLOP/s, 42.1%; 32,768 routed in a "
                          "65,536-row buffer over 16, 2,048 an expert (v5litepod-8 at 8 rows of 512), 9.92 ms, "
                          "78.6 TFLOP/s, 39.9%: no faster past 1,024 (megablox's grouped matmul at 128-square "
                          "tiles: 66.7 and 39.2 ms at 128 and 1,024); 2026-12-06, "
                          "bench/tpu_records/v5e-2026-12-06-k5.json, -l.json, -m.json and -n.json",
        "attention 256": "the same for 8 x 512 positions, 4 heads of 256 on one kv head (gemma3-1b's): 76.6 TFLOP/s",
        "loss kernel": "the two loss kernels forward and backward, 8 x 1024 tokens, vocabulary 50304: 180.8 TFLOP/s "
                       "of their 8 N V D",
        "other": "gpt2-124m at batch 16: the 121.2 ms step less its matmuls, splash and loss at the rates above "
                 "leaves 20.9 ms for 20.0 GB of elementwise bytes by the compiler's count: 954 GB/s, above the "
                 "681 GB/s that a * x + b over 1 GiB arrays reaches (libtpu keeps some of what it counts on chip). "
                 "The one rate set from a step: batches 8 and 32 and both LoRA steps check it (within 10%)",
    })


def scaled(base: Rates, peak: float, hbm: float, kind: str) -> Rates:
    """base's efficiencies on a chip of this peak and HBM bandwidth: not measured."""
    f, b = peak / V5E_PEAK, hbm / V5E_HBM
    return replace(base, matmul_flops_s=base.matmul_flops_s * f,
                   attention_flops_s={d: r * f for d, r in base.attention_flops_s.items()},
                   resident_flops_s={d: r * f for d, r in base.resident_flops_s.items()},
                   loss_kernel_flops_s=base.loss_kernel_flops_s * f, other_bytes_s=base.other_bytes_s * b,
                   grouped_matmul_flops_s={n: r * f for n, r in base.grouped_matmul_flops_s.items()},
                   measured=False, source=f"{kind}: not measured; v5e's efficiencies at its peak and bandwidth "
                                          f"({base.source})")


MEASURED = {"TPU v5 lite": V5E, "TPU v5e": V5E}


def for_kind(device_kind: str, peak: float | None, hbm: float | None) -> Rates | None:
    if device_kind in MEASURED:
        return MEASURED[device_kind]
    if not peak or not hbm:
        return None
    return scaled(V5E, peak, hbm, device_kind)


def estimate(work: dict, rates: Rates) -> dict:
    """{step_s, terms: {class: seconds}, measured, unmeasured: what of it no chip timed, source} for one
    device's step from its work by class (aot.py's `work`: matmul_flops, attention_flops, head_dim,
    attention_kernel, loss_kernel_flops, other_bytes)."""
    kernel = work.get("attention_kernel") or "splash"
    grouped = work.get("grouped_matmul_flops", 0.0)
    terms = {"matmul": work.get("matmul_flops", 0.0) / rates.matmul_flops_s,
             "grouped matmul": grouped / rates.grouped_at(work.get("grouped_rows_per_expert", 0.0)) if grouped
             else 0.0,
             "attention": (work.get("attention_flops", 0.0) / rates.attention_at(int(work.get("head_dim") or 64),
                                                                                 kernel)
                           if work.get("attention_flops") else 0.0),
             "loss kernel": work.get("loss_kernel_flops", 0.0) / rates.loss_kernel_flops_s,
             "other": work.get("other_bytes", 0.0) / rates.other_bytes_s if rates.other_bytes_s else 0.0}
    unmeasured = [] if rates.measured else ["this chip kind: v5e's efficiencies scaled to its peak and bandwidth"]
    if kernel == "resident" and not rates.resident_flops_s:
        unmeasured.append("the resident attention kernel, at splash's rate")
    return {"step_s": sum(terms.values()), "terms": terms, "measured": not unmeasured, "unmeasured": unmeasured,
            "source": rates.source}
