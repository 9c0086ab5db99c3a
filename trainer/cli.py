"""`python -m trainer prepare|pretrain|sample|lora|export|sweep|report|extras|capture|hoststat ...` (the command line is a contract:
docs/CONTRACTS.md): the process's set-up before jax starts, one parser composed of each job's own flags, and the
dispatch to the jobs (each imported only when its command runs). trainer/plan.py parses the commands it compiles
with the same parser.

Exit codes: 0 done, 2 bad input (`error: ...` on stderr), 42 stopped by a preemption notice after saving,
130 interrupted by Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys

from trainer.common.config import UsageError
from trainer.common.process import (catch_early_interrupt, command_parser, emulate_devices, in_a_multi_process_job,
                                    keep_freed_memory, native_stdout_off, quiet_native_logs)
from trainer.experiments import flags as experiments
from trainer.finetune import flags as finetune
from trainer.pretrain import flags as pretrain


def parser() -> argparse.ArgumentParser:
    return command_parser("GPT-2 pretraining on a JAX device mesh.", pretrain.add_prepare, pretrain.add_pretrain,
                          pretrain.add_sample, finetune.add_lora, finetune.add_export, experiments.add_parsers,
                          _add_extras, _add_capture, _add_hoststat)


TRAINER_PID_ENV = "TPUCTL_TRAINER_PID"  # set by hostwrap's `beside` for what runs beside a host's trainer


def trainer_args() -> argparse.Namespace | None:
    """The command of the trainer this process runs beside (hostwrap's `beside` names its pid), parsed by this
    same parser: where its --ckpt-dir is. None when there is none or it is not a trainer command."""
    import contextlib
    import io
    pid = os.environ.get(TRAINER_PID_ENV, "")
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            words = [w.decode("utf-8", "replace") for w in f.read().split(b"\0") if w]
    except (OSError, ValueError):
        return None
    at = next((i for i in range(len(words) - 1) if words[i] == "-m" and words[i + 1] == "trainer"), None)
    if at is None:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parser().parse_args(words[at + 2:])
    except SystemExit:
        return None


def _add_hoststat(sub) -> None:
    sub.add_parser("hoststat", help="print (one JSON line) this host's step, step time, tokens/s, CPU, memory, "
                                    "chips and the run's straggler, beside its trainer (what `tpuctl top` runs)",
                   description="Run by hostwrap's `beside`: reads the trainer's progress lines from TPUCTL_RUN_LOG, "
                               "the run's metrics.jsonl from the trainer's --ckpt-dir, and libtpu's metrics "
                               "service on TPU_RUNTIME_METRICS_PORTS (\"no TPU\" when it does not answer).")


def hoststat() -> int:
    import json
    from trainer.common import hoststat as hs
    trainer = trainer_args()
    print(json.dumps(hs.snapshot(os.environ.get(hs.LOG_ENV), getattr(trainer, "ckpt_dir", None),
                                 int(os.environ.get("TPUCTL_PROCESS_ID", "0") or 0))))
    return 0


def _add_capture(sub) -> None:
    cp = sub.add_parser("capture", help="trace a running training process of this host for a while, through its "
                                        "profiler server (what TensorBoard's capture profile does)",
                        description="Writes OUT/plugins/profile/SESSION/HOST.xplane.pb (TensorBoard's layout; "
                                    "gs:// too). Exit 1 with one error line when the server does not answer.")
    cp.add_argument("--out", default=None, help="a run's profiles folder, e.g. CKPT_DIR/profiles/RUN_ID (default, "
                                                "beside a trainer: its --ckpt-dir/profiles/TPUCTL_RUN_ID)")
    cp.add_argument("--duration-ms", type=int, required=True, metavar="MS", help="how long to trace")
    cp.add_argument("--port", type=int, default=None, help="the server's port (default: the trainer's, "
                                                             "TPUCTL_PROFILER_PORT or 9999, + TPUCTL_PROCESS_ID)")
    cp.add_argument("--address", default="localhost", help="the server's host (default localhost)")
    cp.add_argument("--session", default=None, help="the session folder (default live_<UTC time>)")
    cp.add_argument("--host", default=None, help="the file's host name (default <hostname>-p<TPUCTL_PROCESS_ID>)")


def capture(args: argparse.Namespace) -> int:
    import time
    from trainer.common import profiling
    if args.duration_ms < 1:
        raise UsageError(f"--duration-ms {args.duration_ms}: must be at least 1")
    process = int(os.environ.get("TPUCTL_PROCESS_ID", "0") or 0)
    port = args.port or profiling.server_port(process)
    if not port:
        raise UsageError(f"no profiler server: {profiling.PORT_ENV}=0 here; pass --port")
    session = args.session or "live_" + time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime())
    if args.out is None:
        trainer = trainer_args()
        run_id = os.environ.get(profiling.RUN_ID_ENV)
        if not getattr(trainer, "ckpt_dir", None) or not run_id:
            raise UsageError("capture: pass --out DIR (no trainer beside this process names its --ckpt-dir and "
                             f"{profiling.RUN_ID_ENV})")
        args.out = f"{trainer.ckpt_dir.rstrip('/')}/{profiling.PROFILES}/{run_id}"
    try:
        path = profiling.capture(args.out, args.duration_ms, port, session, args.host or profiling.host_name(process),
                                 args.address)
    except profiling.CaptureFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"captured {args.duration_ms} ms into {path}")
    return 0


def _add_extras(sub) -> None:
    xs = sub.add_parser("extras", help="print (JSON) the optional dependency groups of this package that a "
                                       "trainer command needs installed, e.g. wandb for --wandb")
    xs.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS, as `python -m trainer` takes them")


def extras_of(args: argparse.Namespace) -> list[str]:
    """The optional dependency groups (pyproject.toml) a parsed command needs where it runs: `tpuctl run` adds
    them to the hosts' environment (the orchestrator never reads the trainer's flags itself)."""
    if args.cmd == "capture":  # xprof's capture client
        return ["profile"]
    if args.cmd == "hoststat":  # tpu-info's client of libtpu's metrics service
        return ["observe"]
    out = ["wandb"] if getattr(args, "wandb", "") else []
    if args.cmd in ("pretrain", "lora"):  # `tpuctl profile` and `top` run capture and hoststat beside them
        out += ["observe", "profile"]
    return sorted(out)


def run(args: argparse.Namespace) -> int:
    if args.cmd == "prepare":
        from trainer.pretrain import prepare
        meta = prepare.prepare(args.data or None, args.out, val_fraction=args.val_fraction, tokenizer=args.tokenizer,
                               workers=args.workers, text_field=args.text_field, shard_tokens=args.shard_tokens,
                               markdown=args.markdown, on_error=args.on_error)
        if meta is None:  # a host other than process 0: its share is written, process 0 writes the shards
            print(f"prepare: this host's pieces are written under {args.out}; process 0 writes the shards")
            return 0
        print(f"prepared {meta['n_train_tokens']:,} train + {meta['n_val_tokens']:,} val tokens in "
              f"{len(meta['train'])} + {len(meta['val'])} shard(s) from {meta['n_documents']:,} documents in "
              f"{meta['n_files']} file(s) into {args.out}"
              + (f" ({meta['n_skipped']} bad record(s)/file(s) skipped, listed in meta.json)" if meta['n_skipped']
                 else ""))
        return 0
    if args.cmd == "pretrain":
        from trainer.common import config, profiling
        from trainer.pretrain import tokenizers, train
        tokenizers.follow_data(args)
        cfg = config.resolve(args)
        profiling.check_window(profiling.parse_window(cfg.train.profile), cfg.train.steps)
        return train.pretrain(cfg)
    if args.cmd == "lora":
        from trainer.common import profiling
        from trainer.finetune.flags import lora_run
        run = lora_run(args)
        window = profiling.parse_window(run.profile)
        if run.steps:  # else the last step follows from --epochs and the data: checked once the data is read
            profiling.check_window(window, run.steps)
        from trainer.finetune import train as finetune
        return finetune.finetune(run)
    if args.cmd == "extras":
        import json
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise UsageError("extras: give the command after --: `python -m trainer extras -- pretrain ...`")
        print(json.dumps(extras_of(parser().parse_args(command))))
        return 0
    if args.cmd == "capture":
        return capture(args)
    if args.cmd == "hoststat":
        return hoststat()
    if args.cmd in ("sweep", "report"):
        from trainer.experiments import flags as experiments
        return experiments.command(args)
    from absl import logging
    if args.cmd == "export":
        from trainer.gemma import export
        from trainer.common import mesh as mesh_lib
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
        from trainer.gemma import generate
        return generate.sample_main(args)
    if args.chat or args.model or args.tokenizer or args.top_p != 1.0 or args.mesh or args.weights_config:
        raise UsageError("sample: --chat, --model, --tokenizer, --top-p, --mesh and --weights-config apply to Gemma "
                         "--weights only")
    from trainer.pretrain import sample
    logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only checkpoint manager is read-only
    print(sample.generate(args.ckpt_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, seed=args.seed, step=args.step,
                          dtype=args.dtype, record=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except BaseException as e:
        if isinstance(e, SystemExit) or not in_a_multi_process_job():
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
        catch_early_interrupt()
        emulate_devices(argv)
        quiet_native_logs()
        native_stdout_off()
        keep_freed_memory()
        args = parser().parse_args(argv)
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C: nothing a save could keep
        print("interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # trainer.pretrain.shards.DataError (imported lazily: it is jax-free but not needed here)
        if "DataError" not in (c.__name__ for c in type(e).__mro__):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2

