"""The command line of the fine-tuning job: `lora` (adapters on a frozen Gemma base) and `export` (the adapters
merged into the base, or PEFT-style)."""
from __future__ import annotations

import argparse
import dataclasses

from trainer.common.process import add_process_flags
from trainer.finetune.config import LoraRun


def add_lora(sub) -> None:
    lo = add_process_flags(sub.add_parser(
        "lora", help="LoRA fine-tuning of a Gemma checkpoint on JSONL instructions (resumes from --ckpt-dir)",
        description="Train LoRA adapters on a frozen Gemma base. Checkpoints hold the adapters and their "
                    "optimizer state only; the same command resumes; SIGTERM saves and exits 42."))
    add_lora_flags(lo)


def add_export(sub) -> None:
    ex = add_process_flags(sub.add_parser(
        "export", help="write fine-tuned adapters: merged into the base (--merge) or PEFT-style (--adapters-only)",
        description="--merge writes base + adapters in the base's layout (Kaggle flax Orbax, or safetensors with "
                    "config.json); --adapters-only writes adapter_model.safetensors + adapter_config.json as PEFT does."))
    ex.add_argument("--weights", required=True, help="the base the adapters were trained on (local or gs://)")
    ex.add_argument("--adapters", required=True, help="the --ckpt-dir of a `python -m trainer lora` run")
    ex.add_argument("--out", required=True, help="a new directory, local or gs://")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ex.add_argument("--mesh", default="", help="data=D,model=M over all devices (default: all on data)")
    how = ex.add_mutually_exclusive_group(required=True)
    how.add_argument("--merge", action="store_true", help="base + scale * A @ B, in the base's layout")
    how.add_argument("--adapters-only", action="store_true", help="PEFT-style adapter_model.safetensors + config")


def lora_run(args: argparse.Namespace) -> LoraRun:
    """The parsed `lora` flags as the run's config."""
    fields = {f.name for f in dataclasses.fields(LoraRun)}
    return LoraRun(**{k: v for k, v in vars(args).items() if k in fields})


LORA_HELP = {
    "weights": "the Gemma base (Kaggle flax or transformers layout), local or gs:// (required)",
    "data": "JSONL: {\"prompt\", \"response\"} or {\"messages\": [{\"role\", \"content\"}]} per line (required)",
    "ckpt_dir": "adapter checkpoints, config.json and metrics.jsonl: a local dir or gs://BUCKET/PATH (required)",
    "val_data": "validation JSONL (default: --val-fraction of --data)",
    "val_fraction": "share of --data held out for the validation loss when there is no --val-data",
    "tokenizer": "tokenizer.model / tokenizer.json (default: the one beside --weights)",
    "model": "expected family (gemma2, gemma3, gemma4) or size (gemma2-2b, gemma3-1b, gemma4-e2b, ...; the checkpoint "
             "must be that size): a size lets `tpuctl plan` build the step without reading --weights "
             "(default: from the checkpoint)",
    "weights_config": "KEY=VALUE,...: what a Kaggle flax checkpoint's shapes cannot tell, for a shape that matches "
                      "no named size (sliding_window, query_pre_attn_scalar, global_rope_scale, kv_shared_layers, "
                      "top_k); also read from gemma-config.json beside --weights (the flag wins)",
    "rank": "r: the adapters' inner width",
    "alpha": "the update is scaled by alpha / rank",
    "dropout": "dropout on the adapters' input (the base path is never dropped)",
    "targets": "projections to adapt: q,k,v,o,gate,up,down (or q_proj...), attn, mlp, all, or globs; on Gemma 4 "
               "26B-A4B also its experts, only when named: experts (or expert_gate,expert_up,expert_down)",
    "base_dtype": "dtype the frozen base is held in: auto (bf16 on TPU/GPU, f32 on CPU), float32, bfloat16",
    "dtype": "compute dtype: auto (bf16 on TPU/GPU, f32 on CPU), float32, bfloat16",
    "seq_len": "row length in tokens (examples are packed into rows)",
    "packing": "on: whole examples packed per row (attention stays within each); off: one padded example per row",
    "long": "an example longer than --seq-len: truncate or drop (counts are printed)",
    "batch_size": "global batch in rows (0 = 4 per device)",
    "epochs": "passes over the training rows (when --steps is 0)",
    "steps": "absolute step to train up to (0 = from --epochs)",
    "min_lr_ratio": "cosine decay to lr x this over the run (1 = constant)",
    "mesh": "data=D,model=M (default: every device on data)",
    "ckpt_every": "save every N steps (0 = only at the end and on a preemption notice)",
    "eval_every": "validation loss every N steps (0 = only at the last step)",
    "attention": "auto, xla or splash: splash is the Pallas TPU kernel (sliding windows, soft-capping and packed "
                 "examples in-kernel; interpreted off TPU: slow, for checks); auto = splash on TPU when --seq-len is "
                 "a multiple of 128",
    "remat": "auto, none, dots or full: what each layer keeps for the backward pass (dots: the weight matmuls' "
             "outputs; full: only its input); trades compute for memory. auto = none (the layers written out: the "
             "chip's faster step, 41.4 against 87.8 ms for gemma4-e2b) where its activations fit the devices by an "
             "estimate from the shapes, else full (and full for Gemma 4's experts); a written-out step the compiler "
             "refuses for memory is compiled again with full. Any policy but none runs the layers in scans",
    "loss_chunk": "sequence positions whose logits exist at once in the loss (0 = all: [rows, seq-len, vocab] f32 "
                  "per device, 2 GB for Gemma's 256k vocabulary and 4 rows of 512, held twice); N < seq-len takes "
                  "the largest divisor of seq-len not above N: less memory, the embedding read once more per chunk "
                  "(`tpuctl plan` suggests it when a step does not fit)",
    "expert_capacity": "Gemma 4 26B-A4B under expert parallelism: the rows each device's experts take a layer, as a "
                       "multiple of the even share (tokens x 8 / devices); a device's assignments beyond it are "
                       "dropped; 0 = dropless (a static buffer of the worst case: 8x the even share on 8 devices)",
    "lora_impl": "stacked or beside: how the adapters of k and v, and of gate and up, are applied; stacked adds "
                 "each pair's in one batched matmul to the base's stacked output, beside each apart (the same "
                 "arithmetic; stacked makes fewer passes over the MLP's activations: 2 to 5 percent faster in less "
                 "memory on a v5e chip)",
    "profile": "START:END: every process records a jax.profiler trace of steps START to END-1 into "
               "<ckpt-dir>/profiles/<run id>/ (TensorBoard's profile layout; e.g. 5:8 traces steps 5, 6 and 7)",
}


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(LoraRun):
        kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        required = f.default is dataclasses.MISSING
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, required=required,
                       default=None if required else f.default, metavar={int: "N", float: "X", str: "S"}[kind],
                       help=LORA_HELP.get(f.name, "") + ("" if required or f.default == "" else f" (default {f.default})"))
