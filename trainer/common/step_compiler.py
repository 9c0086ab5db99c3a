"""The compiler options a LoRA train step is compiled with: the same for its run and for its plan, so that a plan
counts the program the run will run (both compile through finetune.Steps.compile).

No collective matmuls on a TPU mesh of more than one device. XLA's SPMD partitioner may compute a matmul whose
weight is sharded over the contracting dimension (a layer's weights over `data`, as every Gemma LoRA step holds
its base) as a windowed einsum: a loop that passes the weight's shards round the ring of devices and adds each
shard's partial product into the whole output, so the output is read and written once a trip (4 trips on 8
devices). Inside a scanned layer it chose that for the projections, where the written-out step gathers the
weights instead. By the TPU compiler's count (libtpu 0.0.42.1, jax 0.10.2; `python -m bench.compiler.tpu_bytes
--tpu v5e:2x4 --devices 8`, 4 rows of 512 a device, --targets all), with the threshold below, which no
matmul reaches:
- gemma4-e2b with --remat dots (its layers in scans): 409 -> 182 GB a step (the MLP's projections 171 -> 27 GB,
  the ring's collective-permutes 48 -> 0), temporaries 9.68 -> 9.56 GiB;
- gemma4-31b's default step on v5litepod-8: 1,830 -> 1,153 GB by the plan's count (its roofline 2235 -> 1408 ms),
  and at --mesh data=1,model=8 4,166 -> 1,340 GB (12.80 -> 12.51 GiB a device);
- gemma4-26b-a4b's default step (scans, full recompute): 535 -> 472 GB, temporaries 2.90 GiB either way.
gpt2-124m's default pretraining step on v5e-8 forms no windowed einsum either way (38.64 GB, 2.45 GiB), so
pretraining keeps the compiler's default. One device partitions nothing: the one-chip step is unchanged (the chip
check's options row: the same step to the bit). The LoRA eval step, the train step's forward, takes them too.
"""
from __future__ import annotations

# MiB a matmul's operands must reach before the partitioner makes it a windowed einsum (libtpu's flag, which
# MaxText's and MaxDiffusion's TPU scripts set this high to turn collective matmuls off)
WINDOWED_EINSUM_THRESHOLD_MIB = "xla_jf_spmd_threshold_for_windowed_einsum_mib"
NO_WINDOWED_EINSUM = {WINDOWED_EINSUM_THRESHOLD_MIB: 1_000_000}


def options(platform: str, devices: int) -> dict:
    """The step's own compiler options on `devices` devices of `platform` (the devices compiled for: "tpu" for a
    TPU plan from a CPU host too). The CPU compiler knows no libtpu flag: nothing there."""
    return dict(NO_WINDOWED_EINSUM) if platform == "tpu" and devices > 1 else {}
