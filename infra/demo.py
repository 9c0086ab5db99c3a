"""`make demo`: the whole story in local mode, with the commands a user would type.

    tpuctl up demo --local -a v4-16            # the Cloud TPU API stand-in + 2 real sshd hosts
    python -m trainer prepare --out gs://...   # tokenise Shakespeare once, into the GCS emulator
    tpuctl run demo -- pretrain ...            # 2 hosts x 4 CPU devices = one 8-device mesh over SSH
    python -m trainer sample --ckpt-dir gs://  # back on the laptop: read the checkpoint, generate
    tpuctl down demo                           # always, even after a failure or Ctrl-C

Everything runs under its own TPUCTL_HOME (default ~/.tpuctl/demo) so it never touches your real slices.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

BUCKET = "tpuctl-demo"


def sh(argv: list[str], env: dict[str, str], check: bool = True) -> int:
    print(f"\n$ {shlex.join(argv)}", flush=True)
    rc = subprocess.run(argv, env=env).returncode
    if check and rc != 0:
        raise SystemExit(f"demo: `{shlex.join(argv[:4])} ...` failed with exit code {rc}")
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="demo")
    p.add_argument("--accelerator", default="v4-16", help="v4-16 = 2 local hosts with 4 CPU devices each")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--home", default=str(Path.home() / ".tpuctl" / "demo"))
    args = p.parse_args(argv)

    from infra import gcs

    env = dict(os.environ, TPUCTL_HOME=args.home)
    os.environ["TPUCTL_HOME"] = args.home
    tpuctl = [sys.executable, "-m", "orchestrator.cli"]
    trainer = [sys.executable, "-m", "trainer"]
    data, run = f"gs://{BUCKET}/shakespeare", f"gs://{BUCKET}/{args.name}"

    emu = gcs.start(buckets=(BUCKET,))
    local_env = {**env, **emu.env}  # this machine (the "laptop") reads and writes the same emulated bucket
    print(f"GCS emulator at {emu.endpoint} (bucket {BUCKET})")
    try:
        sh(tpuctl + ["up", args.name, "--local", "-a", args.accelerator], env)
        sh(trainer + ["prepare", "--out", data], local_env)
        sh(tpuctl + ["run", args.name, "--local", "--", "pretrain", "--preset", "gpt2-tiny", "--data", data,
                     "--ckpt-dir", run, "--steps", str(args.steps), "--log-every", "20"], env)
        sh(trainer + ["sample", "--ckpt-dir", run, "--prompt", "ROMEO:", "--max-new-tokens", "40"], local_env)
        print(f"\ndemo done: {args.name} trained on {args.accelerator} (local), checkpoints in {run}")
        return 0
    finally:
        sh(tpuctl + ["down", args.name, "--local", "--yes"], env, check=False)
        gcs.stop()
        from orchestrator import cloud
        cloud.stop_local_api()  # the TPU API stand-in: nothing of the demo keeps running


if __name__ == "__main__":
    sys.exit(main())
