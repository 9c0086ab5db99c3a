"""Where a TPU step's HBM bytes go: the step compiled once for a TPU topology (libtpu ahead of time, as `tpuctl
plan` compiles it), its optimized HLO charged per instruction and per jax source (trainer/common/hlo_bytes.py).

    python -m bench.compiler.tpu_bytes [--tpu v5e:2x4 --devices 8] [--json OUT] [--hlo OUT.hlo] -- pretrain --preset \\
        gpt2-124m --batch-size 64 --seq-len 1024 --ckpt-dir gs://b/run [FLAGS]

Prints one table, per device and step: bucket, GB, share; then the cross-check against the compiler's own
`bytes accessed` (which counts a loop's body once: compared with this count of the bodies once) and the loops
and trip counts found. Buckets are named from the jax source of each instruction: the model's modules forward
and backward, the loss, the optimizer, collectives, and "[async slices/copies]" for what libtpu moves on its own
(charged to the first instruction that uses it).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def compile_text(tpu: str, devices: int, trainer_argv: list[str], host_bounds: str = "") -> tuple[str, dict]:
    """The optimized HLO of the command's train step for the topology, and the compiler's figures.
    host_bounds: the chips a host holds ('' for the topology's own, as `python -m trainer.plan` takes it)."""
    from trainer import cli
    from trainer.common import aot
    opts = argparse.Namespace(devices=devices, processes=1, num_slices=1, tpu=tpu, chip_config="default",
                              host_bounds=host_bounds, fallback_cpu=False, run_platform="tpu")
    args = cli.parser().parse_args(trainer_argv)
    aot.check(args)
    target = aot.target(opts)
    built = aot.BUILDERS[args.cmd](args, target)
    t0 = time.perf_counter()
    compiled = built.compile()
    cost = aot._cost(compiled)
    return compiled.as_text() or "", {"program_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                                      "program_flops": float(cost.get("flops", 0.0)),
                                      "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                                      "compile_s": round(time.perf_counter() - t0, 1), "settings": built.settings}


def render(result: dict, compiler: dict, say=print) -> None:
    total = result["total"]
    say(f"  {'bucket':<58} {'GB':>7} {'share':>6}")
    for name, b in sorted(result["buckets"].items(), key=lambda kv: -kv[1]):
        if b >= 1e6:
            say(f"  {name:<58} {b / 1e9:7.2f} {b / total:6.1%}")
    say(f"  {'whole step (every loop its trip count times)':<58} {total / 1e9:7.2f}")
    prog = compiler["program_bytes_accessed"]
    say(f"  cross-check: the compiler's bytes accessed (loop bodies once) {prog / 1e9:.2f} GB, this count of the same "
        f"{result['once'] / 1e9:.2f} GB ({result['once'] / prog - 1:+.1%}); loops (body, trips): {result['loops']}; "
        f"temporaries {compiler['temp_bytes'] / 2 ** 30:.2f} GiB; compiled in {compiler['compile_s']} s")


BENCH_STEP = ["pretrain", "--preset", "gpt2-124m", "--batch-size", "64", "--seq-len", "1024",
              "--ckpt-dir", "gs://bench/run"]


def bench(say=print) -> None:
    """`make bench`'s section: the default gpt2-124m step on v5e-8, in a process of its own (libtpu set up there)."""
    import os
    import subprocess
    from trainer.common.aot import has_libtpu
    if not has_libtpu():
        say("  skipped: libtpu is not installed (pip install 'tpuctl[plan]', or `make setup`, installs it)")
        return
    out = subprocess.run([sys.executable, "-m", "bench.compiler.tpu_bytes", "--", *BENCH_STEP], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    for line in out.stdout.splitlines():
        say(line)
    if out.returncode:
        say(f"  failed (exit {out.returncode}): {(out.stderr.strip().splitlines() or ['no output'])[-1][:160]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, trainer_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m bench.compiler.tpu_bytes", description=__doc__.splitlines()[0])
    p.add_argument("--tpu", default="v5e:2x4", help="libtpu topology (default v5e:2x4)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--host-bounds", default="", metavar="X,Y,Z",
                   help="chips a host holds (default: the topology's own; 1,1,1 for v5e:1x1)")
    p.add_argument("--json", help="also write the table and the compiler's figures to this file")
    p.add_argument("--hlo", help="also keep the optimized HLO text here")
    p.add_argument("--from-hlo", help="count this saved HLO text instead of compiling (no compiler figures)")
    a = p.parse_args(own)
    from trainer.common import hlo_bytes
    if a.from_hlo:
        text, compiler = open(a.from_hlo).read(), None
    else:
        if not trainer_argv:
            print("error: put the trainer command after --, e.g. -- pretrain --preset gpt2-124m --ckpt-dir gs://b/r",
                  file=sys.stderr)
            return 2
        from trainer.common.aot import has_libtpu
        if not has_libtpu():
            print("error: libtpu is not installed: pip install 'tpuctl[plan]'", file=sys.stderr)
            return 2
        from trainer.common.config import UsageError
        try:
            text, compiler = compile_text(a.tpu, a.devices, trainer_argv, a.host_bounds)
        except UsageError as e:  # the trainer command's own refusal (a flag missing, a batch the mesh cannot split)
            print(f"error: {e}", file=sys.stderr)
            return 2
    if a.hlo:
        with open(a.hlo, "w") as fh:
            fh.write(text)
    result = hlo_bytes.table(text)
    if compiler is None:
        compiler = {"program_bytes_accessed": result["once"] or 1.0, "temp_bytes": 0, "compile_s": "-"}
    render(result, compiler)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"argv": trainer_argv, **compiler, **result}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
