"""The command line of the pretraining job: `prepare`, `pretrain` and `sample` (GPT-2 checkpoints, and Gemma
weights through trainer/gemma/generate.py)."""
from __future__ import annotations

import argparse

from trainer.common.config import add_config_flags
from trainer.common.process import add_process_flags, command_parser


def add_prepare(sub) -> None:
    pr = add_process_flags(sub.add_parser("prepare", help="tokenise a corpus once into train.bin/val.bin/meta.json"))
    pr.add_argument("--data", nargs="*", default=None, help="text files or dirs (default: Shakespeare's plays)")
    pr.add_argument("--out", required=True, help="output dir, local or gs://")
    pr.add_argument("--val-fraction", type=float, default=0.05)
    pr.add_argument("--markdown", action="store_true",
                    help="keep the embedded plays' Markdown (default: plain `NAME:` speaker turns)")


def add_pretrain(sub) -> None:
    pt = add_process_flags(sub.add_parser("pretrain", help="train (resumes from the latest checkpoint in --ckpt-dir)"))
    add_config_flags(pt)


def add_sample(sub) -> None:
    sa = add_process_flags(sub.add_parser(
        "sample", help="generate text from a checkpoint (GPT-2 --ckpt-dir or Gemma --weights)"))
    sa.add_argument("--ckpt-dir", help="a GPT-2 checkpoint dir trained by pretrain")
    sa.add_argument("--prompt", default="\n")
    sa.add_argument("--max-new-tokens", type=int, default=200)
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=40)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    sa.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    # Gemma (trainer/gemma/generate.py): KV-cache decoding in one compiled loop on the mesh, streamed.
    sa.add_argument("--weights", help="a Gemma checkpoint (Kaggle flax or transformers layout), local or gs://")
    sa.add_argument("--chat", action="store_true", help="wrap the prompt in Gemma's chat turns; stop at <end_of_turn>")
    sa.add_argument("--model", choices=("gemma2", "gemma3"), help="expected family (default: from the checkpoint)")
    sa.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: the one beside --weights)")
    sa.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling cut (1 = off; --temperature 0 = greedy)")
    sa.add_argument("--mesh", default="", help="data=D,model=M over all devices (default: all on data)")
    sa.add_argument("--adapters", help="with --weights: a `lora` --ckpt-dir whose adapters are applied (merged in)")


def pretrain_parser() -> argparse.ArgumentParser:
    """The parser of `pretrain ...` alone: what a sweep checks each trial's command with."""
    return command_parser("GPT-2 pretraining on a JAX device mesh.", add_pretrain)
