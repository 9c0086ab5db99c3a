"""The LoRA step's figures from the TPU compiler, ahead of time, for one chip (v5e:1x1 by default): bytes
accessed, flops, memory (arguments, temporaries), the bytes by class of work (trainer/common/hlo_bytes.py) and
the plan's calibrated step time, for a model size, batch and any LoraRun fields (the step's levers).

    python -m bench.compiler.lora_counts gemma3-1b 8 [--set lora_impl=stacked --set loss_chunk=256] [--hlo OUT] [--json OUT]

The compiler's count (libtpu), not a chip measurement: compare variants of the step side by side.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def _value(field: dataclasses.Field, text: str):
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    return {"int": int, "float": float}.get(kind, str)(text)


def count(size: str, batch: int, sets: dict, tpu: str = "v5e:1x1", seq_len: int = 512, hlo: str | None = None) -> dict:
    from trainer.common import aot, calibration, chips, hlo_bytes, mesh as mesh_lib
    from trainer.finetune import train as finetune
    from trainer.finetune.config import LoraRun
    from trainer.models import gemma, lora as lora_lib
    import jax
    fields = {f.name: f for f in dataclasses.fields(LoraRun)}
    run = LoraRun(weights="-", data="-", ckpt_dir="/tmp/unused", model=size, targets="all", seq_len=seq_len,
                  batch_size=batch, steps=1000, base_dtype="bfloat16", dtype="bfloat16",
                  **{k: _value(fields[k], v) for k, v in sets.items()})
    run.check()
    opts = argparse.Namespace(devices=1, processes=1, num_slices=1, tpu=tpu, chip_config="default",
                              host_bounds="1,1,1", fallback_cpu=False, run_platform="tpu")
    target = aot.target(opts)
    cfg = gemma.SIZES[size]
    mesh = target.mesh(run.mesh)
    steps = finetune.Steps(run, cfg, mesh, 1000, batch)
    base = steps.abstract_base(jax.numpy.bfloat16)
    t0 = time.perf_counter()
    steps.compile(base)
    compiled = steps.train_fn
    took = time.perf_counter() - t0
    text = compiled.as_text() or ""
    if hlo:
        with open(hlo, "w") as fh:
            fh.write(text)
    cost = aot._cost(compiled)
    mem = compiled.memory_analysis()
    tokens = batch * seq_len
    fpt = aot.lora_flops_per_token(cfg, lora_lib.count(cfg, run.lora), seq_len)
    built = aot.Built(compile=None, params=None, opt_state=None, tokens_per_step=tokens, model_flops_per_token=fpt,
                      mesh={}, dtype="", settings={}, levers=(),
                      kernel_attention_flops_per_token=aot.splash_flops_per_token(
                          cfg.n_layers, seq_len, cfg.n_heads * cfg.head_dim, steps.attention), head_dim=cfg.head_dim)
    kind = "TPU v5 lite"
    work = aot.work(built, {"flops": float(cost.get("flops", 0.0)), "devices": 1}, text)
    rates = calibration.for_kind(kind, chips.PEAK_FLOPS[kind], chips.HBM_BYTES_S[kind])
    est = calibration.estimate(work, rates)["step_s"] if rates else None
    table = hlo_bytes.table(text)
    hbm = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    return {"size": size, "batch": batch, "sets": sets, "compile_s": round(took, 1),
            "flops_T": round(float(cost.get("flops", 0)) / 1e12, 3),
            "bytes_accessed_GB": round(float(cost.get("bytes accessed", 0)) / 1e9, 2),
            "hlo_bytes_total_GB": round(table["total"] / 1e9, 2),
            "by_class_GB": {k: round(v / 1e9, 2) for k, v in table["by_class"].items()},
            "temp_GiB": round(mem.temp_size_in_bytes / 2 ** 30, 2), "hbm_GiB": round(hbm / 2 ** 30, 2),
            "calibrated_step_ms": round(1e3 * est, 1) if est else None,
            "mfu_at_calibrated": round(fpt * tokens / est / chips.PEAK_FLOPS[kind], 3) if est else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compiler.lora_counts", description=__doc__.splitlines()[0])
    p.add_argument("size")
    p.add_argument("batch", type=int)
    p.add_argument("--set", action="append", default=[], help="a LoraRun field, NAME=VALUE (repeatable)")
    p.add_argument("--tpu", default="v5e:1x1")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--hlo")
    p.add_argument("--json")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sets = dict(s.split("=", 1) for s in a.set)
    out = count(a.size, a.batch, sets, a.tpu, a.seq_len, a.hlo)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
