"""What the TPU compiler says about our train step: compiled ahead of time on this machine (libtpu, the
`plan` extra; no TPU needed) for v5e-8 and v4-8, one variant of the step per row.

    python -m bench.compiler.tpu_compile [--chips v5e-8,v4-8] [--json OUT]

Per device and step: FLOPs from the model's arithmetic (the compiler does not count a Pallas kernel's),
the compiler's bytes accessed (its post-fusion estimate of HBM traffic) and temporaries, the time the
FLOPs take at the chip's bf16 peak and the bytes at its HBM bandwidth, which one bounds the step, and the
MFU ceiling that follows (model FLOPs at peak over the larger of the two). A variant that recomputes
(--remat) runs more FLOPs than the arithmetic counts: its compute time takes the compiler's count when
that is larger.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from trainer.common.chips import HBM_BYTES_S, PEAK_FLOPS

GIB = 2 ** 30


@dataclass(frozen=True)
class Chip:
    devices: int
    tpu: str
    chip_config: str
    peak_flops: float     # bf16 FLOP/s per device
    hbm_bytes_s: float    # HBM bandwidth per device


# Peak bf16 FLOP/s and HBM bandwidth per chip from the one table (trainer/common/chips.py); one JAX device per
# chip (megacore on v4).
CHIPS = {
    "v5e-8": Chip(8, "v5e:2x4", "default", PEAK_FLOPS["TPU v5 lite"], HBM_BYTES_S["TPU v5 lite"]),
    "v4-8": Chip(4, "v4:2x2x1", "megacore", PEAK_FLOPS["TPU v4"], HBM_BYTES_S["TPU v4"]),
}
STEP = ["pretrain", "--preset", "gpt2-124m", "--batch-size", "64", "--ckpt-dir", "gs://bench/run"]
# Gemma LoRA on its real shapes (no weights read: the plan's `lora` builder), rank 8, 8 rows x 512 per step.
LORA_STEP = ["lora", "--model", "gemma2-2b", "--weights", "gs://bench/gemma2-2b", "--data", "gs://bench/t.jsonl",
             "--ckpt-dir", "gs://bench/lora", "--rank", "8", "--batch-size", "8", "--seq-len", "512"]
LORA_VARIANTS = {
    "lora-xla": ("gemma2-2b LoRA r8, xla attention", ["--attention", "xla"]),
    "lora-splash": ("gemma2-2b LoRA r8, splash", ["--attention", "splash"]),
}
# key -> (label, trainer flags): today's step first, then each change alone, then both (today's defaults),
# then the remat policies on top.
VARIANTS = {
    "old": ("old: xla attention, full logits", ["--attention", "xla", "--loss-chunk", "0"]),
    "chunk": ("xla attention, chunked loss", ["--attention", "xla"]),
    "splash": ("splash, full logits", ["--attention", "splash", "--loss-chunk", "0"]),
    "new": ("new: splash, chunked loss (default)", ["--attention", "auto"]),
    "dots": ("new + remat dots", ["--attention", "auto", "--remat", "dots"]),
    "full": ("new + remat full", ["--attention", "auto", "--remat", "full"]),
    "chunk512": ("new, loss chunks of 512", ["--attention", "auto", "--loss-chunk", "512"]),
}


def compile_step(chip: Chip, flags: list[str], step: list[str] = STEP) -> dict:
    """trainer.common.aot's figures for the step with these flags (its own process: libtpu and jax set up there)."""
    cmd = [sys.executable, "-m", "trainer.plan", "--devices", str(chip.devices), "--tpu", chip.tpu,
           "--chip-config", chip.chip_config, "--", *step, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def verdict(chip: Chip, f: dict) -> dict:
    """The roofline figures of one compiled step, per device."""
    model_flops = f["model_flops_per_token"] * f["tokens_per_step"] / f["devices"]
    compute_s = max(model_flops, f["flops"]) / chip.peak_flops
    memory_s = f["bytes_accessed"] / chip.hbm_bytes_s
    return {"model_flops": model_flops, "compiler_flops": f["flops"], "bytes_accessed": f["bytes_accessed"],
            "temp_bytes": f["temp_bytes"], "compute_s": compute_s, "memory_s": memory_s,
            "memory_over_compute": memory_s / compute_s, "bound": "memory" if memory_s > compute_s else "compute",
            "mfu_ceiling": model_flops / chip.peak_flops / max(compute_s, memory_s), "compile_s": f["compile_s"]}


HEADER = (f"  {'variant':<36} {'FLOPs':>9}  {'bytes':>9}  {'temps':>10}  {'compute':>9}  {'memory':>9}  "
          f"{'mem/c':>5}  {'bound':<7}  {'MFU max'}")


def row(label: str, v: dict) -> str:
    return (f"  {label:<36} {v['model_flops'] / 1e12:6.2f} TF  {v['bytes_accessed'] / 1e9:6.1f} GB  "
            f"{v['temp_bytes'] / GIB:6.2f} GiB  {v['compute_s'] * 1e3:6.1f} ms  {v['memory_s'] * 1e3:6.1f} ms  "
            f"{v['memory_over_compute']:5.2f}  {v['bound']:<7}  {v['mfu_ceiling']:5.0%}")


def main(chips: list[str] | None = None, variants: list[str] | None = None, say=print) -> dict:
    from trainer.common.aot import has_libtpu
    if not has_libtpu():
        say("  skipped: libtpu is not installed (pip install 'tpuctl[plan]', or `make setup`, installs it)")
        return {}
    results: dict = {}
    keys = [k for k in variants or list(VARIANTS) if k in VARIANTS]
    if keys:
        say("  gpt2-124m, batch 64 x 1024, bf16, mesh data=all; per device and step "
            "(FLOPs from the arithmetic; bytes and temporaries from the TPU compiler)")
    for name in (chips or list(CHIPS)) if keys else []:
        chip = CHIPS[name]
        say(f"  {name} ({chip.devices} devices, {chip.peak_flops / 1e12:.0f} TFLOP/s, "
            f"{chip.hbm_bytes_s / 1e9:.0f} GB/s per device)")
        say(HEADER)
        for key in keys:
            label, flags = VARIANTS[key]
            t0 = time.perf_counter()
            try:
                v = verdict(chip, compile_step(chip, flags))
            except RuntimeError as e:
                say(f"  {label:<36} failed: {e}")
                continue
            results.setdefault(name, {})[label] = v
            say(row(label, v) + f"   (compiled in {time.perf_counter() - t0:.0f} s)")
    chip = CHIPS["v5e-8"]
    lora_keys = [k for k in variants or list(LORA_VARIANTS) if k in LORA_VARIANTS]
    if lora_keys:
        say("  v5e-8, gemma2-2b LoRA r8, batch 8 x 512, the base fsdp over data; per device and step (FLOPs from the "
            "arithmetic: the base's forward and backward through the activations, the adapters' gradients)")
        say(HEADER)
    for key in lora_keys:
        label, flags = LORA_VARIANTS[key]
        t0 = time.perf_counter()
        try:
            v = verdict(chip, compile_step(chip, flags, LORA_STEP))
        except RuntimeError as e:
            say(f"  {label:<36} failed: {e}")
            continue
        results.setdefault("v5e-8", {})[label] = v
        say(row(label, v) + f"   (compiled in {time.perf_counter() - t0:.0f} s)")
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.compiler.tpu_compile", description=__doc__.splitlines()[0])
    p.add_argument("--chips", default=",".join(CHIPS), help=f"comma-separated, from {', '.join(CHIPS)}")
    p.add_argument("--variants", default=",".join([*VARIANTS, *LORA_VARIANTS]),
                   help=f"comma-separated, from {', '.join([*VARIANTS, *LORA_VARIANTS])} (each is one compile per "
                        "chip: minutes)")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    names = [c for c in a.chips.split(",") if c]
    keys = [v for v in a.variants.split(",") if v]
    for flag, given, known in (("--chips", names, CHIPS), ("--variants", keys, {**VARIANTS, **LORA_VARIANTS})):
        bad = [x for x in given if x not in known]
        if bad:
            print(f"error: {flag} {','.join(bad)}: choose from {', '.join(known)}", file=sys.stderr)
            sys.exit(2)
    res = main(names, keys)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
