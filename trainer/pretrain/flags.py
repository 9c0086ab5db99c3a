"""The command line of the pretraining job: `prepare`, `pretrain` and `sample` (GPT-2 checkpoints, and Gemma
weights through trainer/gemma/generate.py)."""
from __future__ import annotations

import argparse

from trainer.common.config import add_config_flags
from trainer.common.process import add_process_flags, command_parser


def add_prepare(sub) -> None:
    pr = add_process_flags(sub.add_parser(
        "prepare", help="tokenise a corpus once into token shards + meta.json (format 3), on every core",
        description="Tokenise text, .jsonl[.gz|.zst] and .parquet files (local or gs://, folders and globs) into "
                    "fixed-size token shards (llm.c's layout) and meta.json, written last. Each document's tokens "
                    "end with one end-of-text token; a whole document goes to val by a stable hash of its text. "
                    "The same input gives the same bytes whatever --workers; a rerun after a kill finishes the "
                    "work. Under `tpuctl run` every host takes its share of the files (TPUCTL_PROCESS_ID) and "
                    "process 0 writes the shards. Progress (documents, tokens/s, ETA) goes to stderr."))
    pr.add_argument("--data", nargs="*", default=None,
                    help="files, folders or globs, local or gs://: text (a file is cut into ~16 KiB documents at "
                         "blank lines), .jsonl/.jsonl.gz/.jsonl.zst and .parquet (one document per record); "
                         "a local copy of a Hugging Face dataset's parquet files works as it is "
                         "(default: Shakespeare's plays)")
    pr.add_argument("--out", required=True, help="output folder, local or gs:// (new, empty, or this prepare's own "
                                                 "unfinished or finished output)")
    pr.add_argument("--val-fraction", type=float, default=0.05, metavar="X",
                    help="share of documents that go to val, chosen by a hash of each document (default 0.05)")
    pr.add_argument("--tokenizer", default="gpt2", choices=("gpt2", "gpt2-4k", "plays-4k", "bytes"),
                    help="gpt2: GPT-2 BPE (tiktoken); gpt2-4k: its first 4,096 ids; plays-4k: a 4,096-id BPE "
                         "fitted to the default corpus (Shakespeare's plays; the demo's); bytes: UTF-8 bytes, 257 ids "
                         "(default gpt2)")
    pr.add_argument("--text-field", default="text", metavar="NAME",
                    help="the jsonl field / parquet column that holds a document's text (default text)")
    pr.add_argument("--workers", type=int, default=None, metavar="N",
                    help="tokenising processes on this host (default: one per core)")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                    help="tokens per shard; the last of each split is shorter (default 100000000, as llm.c)")
    pr.add_argument("--on-error", default="fail", choices=("fail", "skip"),
                    help="a corrupt file or a bad record: fail (default), or skip it (the rest of a corrupt "
                         "compressed file) and list it in meta.json")
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
    sa.add_argument("--model", help="expected family (gemma2, gemma3, gemma4) or size (gemma2-2b, gemma4-e2b, ...; "
                                    "the checkpoint must be that size) (default: from the checkpoint)")
    sa.add_argument("--weights-config", default="", metavar="KEY=VALUE,...",
                    help="what a Kaggle flax checkpoint's shapes cannot tell, for a shape that matches no named size "
                         "(sliding_window, query_pre_attn_scalar, global_rope_scale, kv_shared_layers, top_k); also "
                         "read from gemma-config.json beside --weights (the flag wins)")
    sa.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: the one beside --weights)")
    sa.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling cut (1 = off; --temperature 0 = greedy)")
    sa.add_argument("--mesh", default="", help="data=D,model=M over all devices (default: all on data)")
    sa.add_argument("--adapters", help="with --weights: a `lora` --ckpt-dir whose adapters are applied (merged in)")


def pretrain_parser() -> argparse.ArgumentParser:
    """The parser of `pretrain ...` alone: what a sweep checks each trial's command with."""
    return command_parser("GPT-2 pretraining on a JAX device mesh.", add_pretrain)
