"""`python -m trainer prepare|pretrain|sample|sweep|report ...` (the command line is a contract: docs/CONTRACTS.md).

--emulate-devices N (default $TPUCTL_EMULATE_DEVICES) is handled before jax is imported: it adds N CPU
devices to XLA_FLAGS (an inherited device-count flag wins). On the CPU backend, freed host memory is kept for reuse
(trainer/hostmem.py; TPUCTL_KEEP_FREED_MEMORY=0 leaves glibc's defaults). Exit codes: 0 done, 2 bad input
(`error: ...` on stderr), 42 stopped by a preemption notice after saving, 130 interrupted by Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys

from trainer.config import UsageError, add_config_flags

COUNT_FLAG = "xla_force_host_platform_device_count"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as for every other bad input
        raise UsageError(message)


EMULATE_ENV = "TPUCTL_EMULATE_DEVICES"


def emulate_devices(argv: list[str]) -> None:
    """Read --emulate-devices from raw argv (else $TPUCTL_EMULATE_DEVICES, which a local slice's hosts get)
    and set XLA_FLAGS, before anything imports jax."""
    value, what = None, "--emulate-devices"
    for i, a in enumerate(argv):
        if a == "--emulate-devices" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--emulate-devices="):
            value = a.split("=", 1)[1]
    if value is None and os.environ.get(EMULATE_ENV):
        value, what = os.environ[EMULATE_ENV], EMULATE_ENV
    if value is None:
        return
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{what} {value}: expected a positive integer")
    if "jax" in sys.modules:  # called in-process after jax started (tests): the devices are what they are
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{COUNT_FLAG}={int(value)}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def keep_freed_memory() -> None:
    """On the CPU backend (chosen before jax starts), reuse freed host memory instead of page-faulting
    each step's buffers in again: trainer/hostmem.py. Before jax is imported, while there is one thread."""
    if "jax" in sys.modules or os.environ.get("TPUCTL_KEEP_FREED_MEMORY", "1") == "0":
        return
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        from trainer import hostmem
        hostmem.keep_freed_memory()


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainer", description="GPT-2 pretraining on a JAX device mesh.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp):
        sp.add_argument("--emulate-devices", type=int, default=None, metavar="N",
                        help="N CPU devices per process (set before jax starts; default $TPUCTL_EMULATE_DEVICES, "
                             "which a local slice's hosts get; an inherited XLA flag wins)")
        return sp

    pr = common(sub.add_parser("prepare", help="tokenise a corpus once into train.bin/val.bin/meta.json"))
    pr.add_argument("--data", nargs="*", default=None, help="text files or dirs (default: Shakespeare's plays)")
    pr.add_argument("--out", required=True, help="output dir, local or gs://")
    pr.add_argument("--val-fraction", type=float, default=0.05)
    pr.add_argument("--markdown", action="store_true",
                    help="keep the embedded plays' Markdown (default: plain `NAME:` speaker turns)")

    pt = common(sub.add_parser("pretrain", help="train (resumes from the latest checkpoint in --ckpt-dir)"))
    add_config_flags(pt)

    sa = common(sub.add_parser("sample", help="generate text from a checkpoint (GPT-2 --ckpt-dir or Gemma --weights)"))
    sa.add_argument("--ckpt-dir", help="a GPT-2 checkpoint dir trained by pretrain")
    sa.add_argument("--prompt", default="\n")
    sa.add_argument("--max-new-tokens", type=int, default=200)
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=40)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    sa.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    # Gemma (trainer/generate.py): KV-cache decoding in one compiled loop on the mesh, streamed.
    sa.add_argument("--weights", help="a Gemma checkpoint (Kaggle flax or transformers layout), local or gs://")
    sa.add_argument("--chat", action="store_true", help="wrap the prompt in Gemma's chat turns; stop at <end_of_turn>")
    sa.add_argument("--model", choices=("gemma2", "gemma3"), help="expected family (default: from the checkpoint)")
    sa.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: the one beside --weights)")
    sa.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling cut (1 = off; --temperature 0 = greedy)")
    sa.add_argument("--mesh", default="", help="data=D,model=M over all devices (default: all on data)")
    lo = common(sub.add_parser(
        "lora", help="LoRA fine-tuning of a Gemma checkpoint on JSONL instructions (resumes from --ckpt-dir)",
        description="Train LoRA adapters on a frozen Gemma base. Checkpoints hold the adapters and their "
                    "optimizer state only; the same command resumes; SIGTERM saves and exits 42."))
    add_lora_flags(lo)
    sa.add_argument("--adapters", help="with --weights: a `lora` --ckpt-dir whose adapters are applied (merged in)")

    ex = common(sub.add_parser(
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

    from trainer import sweep  # jax-free: `sweep` and `report`
    sweep.add_parsers(sub)
    xs = sub.add_parser("extras", help="print (JSON) the optional dependency groups of this package that a "
                                       "trainer command needs installed, e.g. wandb for --wandb")
    xs.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS, as `python -m trainer` takes them")
    return p


def extras_of(args: argparse.Namespace) -> list[str]:
    """The optional dependency groups (pyproject.toml) a parsed command needs where it runs: `tpuctl run` adds
    them to the hosts' environment (the orchestrator never reads the trainer's flags itself)."""
    return ["wandb"] if getattr(args, "wandb", "") else []


LORA_HELP = {
    "weights": "the Gemma base (Kaggle flax or transformers layout), local or gs:// (required)",
    "data": "JSONL: {\"prompt\", \"response\"} or {\"messages\": [{\"role\", \"content\"}]} per line (required)",
    "ckpt_dir": "adapter checkpoints, config.json and metrics.jsonl: a local dir or gs://BUCKET/PATH (required)",
    "val_data": "validation JSONL (default: --val-fraction of --data)",
    "val_fraction": "share of --data held out for the validation loss when there is no --val-data",
    "tokenizer": "tokenizer.model / tokenizer.json (default: the one beside --weights)",
    "model": "expected family (gemma2, gemma3) or size (gemma2-2b, gemma2-27b, gemma3-1b, ...; the checkpoint "
             "must be that size): a size lets `tpuctl plan` build the step without reading --weights "
             "(default: from the checkpoint)",
    "rank": "r: the adapters' inner width",
    "alpha": "the update is scaled by alpha / rank",
    "dropout": "dropout on the adapters' input (the base path is never dropped)",
    "targets": "projections to adapt: q,k,v,o,gate,up,down (or q_proj...), attn, mlp, all, or globs",
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
    "remat": "none, dots or full: what each layer keeps for the backward pass (dots: the weight matmuls' outputs; "
             "full: only its input); trades compute for memory",
}


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    import dataclasses
    from trainer.lora_config import LoraRun
    for f in dataclasses.fields(LoraRun):
        kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        required = f.default is dataclasses.MISSING
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, required=required,
                       default=None if required else f.default, metavar={int: "N", float: "X", str: "S"}[kind],
                       help=LORA_HELP.get(f.name, "") + ("" if required or f.default == "" else f" (default {f.default})"))


def run(args: argparse.Namespace) -> int:
    if args.cmd == "prepare":
        from trainer import data
        meta = data.prepare(args.data or None, args.out, args.val_fraction, markdown=args.markdown)
        print(f"prepared {meta['n_train_tokens']:,} train + {meta['n_val_tokens']:,} val tokens "
              f"from {meta['n_files']} file(s) into {args.out}")
        return 0
    if args.cmd == "pretrain":
        from trainer import config, loop
        return loop.pretrain(config.resolve(args))
    if args.cmd == "lora":
        import dataclasses
        from trainer import finetune
        from trainer.lora_config import LoraRun
        fields = {f.name for f in dataclasses.fields(LoraRun)}
        return finetune.finetune(LoraRun(**{k: v for k, v in vars(args).items() if k in fields}))
    if args.cmd == "extras":
        import json
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise UsageError("extras: give the command after --: `python -m trainer extras -- pretrain ...`")
        print(json.dumps(extras_of(parser().parse_args(command))))
        return 0
    if args.cmd in ("sweep", "report"):
        from trainer import sweep
        return sweep.command(args)
    from absl import logging
    if args.cmd == "export":
        from trainer import export, mesh as mesh_lib
        mesh_lib.init_distributed()
        logging.set_verbosity(logging.ERROR)
        what = export.export(args.weights, args.adapters, args.out, merge=args.merge, mesh_spec=args.mesh,
                             step=args.step)
        print(f"exported {'merged ' + what if args.merge else 'PEFT adapters'} to {args.out}")
        return 0
    if args.adapters and not args.weights:
        raise UsageError("sample: --adapters applies to Gemma --weights only")
    if bool(args.weights) == bool(args.ckpt_dir):
        raise UsageError("sample: pass either --ckpt-dir (a GPT-2 checkpoint) or --weights (a Gemma checkpoint)")
    if args.weights:
        from trainer import generate
        return generate.sample_main(args)
    if args.chat or args.model or args.tokenizer or args.top_p != 1.0 or args.mesh:
        raise UsageError("sample: --chat, --model, --tokenizer, --top-p and --mesh apply to Gemma --weights only")
    from trainer import sample
    logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only checkpoint manager is read-only
    print(sample.generate(args.ckpt_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, seed=args.seed, step=args.step,
                          dtype=args.dtype, record=True))
    return 0


def _in_a_multi_process_job() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed
    return distributed.global_state.client is not None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except BaseException as e:
        if isinstance(e, SystemExit) or not _in_a_multi_process_job():
            raise
        # One process of a multi-process job failed on its own (a collective that timed out, a bug, an error
        # only it met): the others wait in a collective for it. A normal exit would now wait at jax.distributed's
        # shutdown barrier, which they never reach, and the whole job would hang. Exit at once instead: the
        # others' heartbeat notices, and `tpuctl run` stops every host and names this one.
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def _main(argv: list[str]) -> int:
    try:
        emulate_devices(argv)
        keep_freed_memory()
        args = parser().parse_args(argv)
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C: nothing a save could keep
        print("interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # trainer.data.DataError (imported lazily: it is jax-free but not needed here)
        if type(e).__name__ != "DataError":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
