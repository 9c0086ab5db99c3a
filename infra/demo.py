"""`make demo`: the whole story in local mode, with the commands a user would type.

    tpuctl up demo --local -a v4-16            # the Cloud TPU API stand-in + 2 real sshd hosts
    python -m trainer prepare --out gs://...   # tokenise Shakespeare once (plain `NAME:` turns), into the GCS emulator
    tpuctl run demo -- pretrain ...            # 2 hosts x 4 CPU devices = one 8-device mesh over SSH
    python -m trainer sample --ckpt-dir gs://  # back on the laptop: read the checkpoint, generate play text
    tpuctl sweep demo --set d_model=... -- pretrain ...   # a tiny sweep, one trial after another
    tpuctl sweep report gs://...               # its table, PNG charts and HTML page
    tpuctl down demo                           # always, even after a failure or Ctrl-C

Everything runs under its own TPUCTL_HOME (default ~/.tpuctl/demo) so it never touches your real slices.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

BUCKET = "tpuctl-demo"
PROMPT = "ROMEO:"
# Long enough that the sample reads as play text (capitalised speaker turns, verse lines: at 300 steps the model
# writes lines but no names yet), short enough for a demo on 2 cores.
STEPS = 500
SAMPLE = ["--prompt", PROMPT, "--max-new-tokens", "120", "--seed", "0"]
# The sweep: three widths of a one-layer model, a few dozen steps each.
SWEEP = ["--set", "d_model=32,64,128"]
SWEEP_TRIAL = ["--n-layer", "1", "--n-head", "2", "--seq-len", "64", "--batch-size", "8", "--steps", "40",
               "--warmup-steps", "4", "--decay-steps", "40", "--lr", "1e-2", "--log-every", "10",
               "--eval-every", "0", "--eval-batches", "2", "--ckpt-every", "0"]


def train_flags(steps: int = STEPS) -> list[str]:
    """gpt2-tiny with its cosine over the whole run."""
    return ["--preset", "gpt2-tiny", "--steps", str(steps), "--decay-steps", str(steps), "--log-every", "50",
            "--eval-every", "250"]


def speaker_turns(text: str) -> list[str]:
    """The `NAME:` lines of a sample: a speaker's name in capitals alone on its line, as the prepared plays
    have them (`ROMEO:`, `FIRST CITIZEN:`)."""
    return re.findall(r"^([A-Z][A-Z .'-]*[A-Z]):$", text, re.M)


def sh(argv: list[str], env: dict[str, str], check: bool = True) -> int:
    print(f"\n$ {shlex.join(argv)}", flush=True)
    rc = subprocess.run(argv, env=env).returncode
    if check and rc != 0:
        raise SystemExit(f"demo: `{shlex.join(argv[:4])} ...` failed with exit code {rc}")
    return rc


def sh_out(argv: list[str], env: dict[str, str]) -> str:
    """Like sh, and return what the command printed (it is shown as well)."""
    print(f"\n$ {shlex.join(argv)}", flush=True)
    p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
    print(p.stdout, end="", flush=True)
    if p.returncode != 0:
        raise SystemExit(f"demo: `{shlex.join(argv[:4])} ...` failed with exit code {p.returncode}")
    return p.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="demo")
    p.add_argument("--accelerator", default="v4-16", help="v4-16 = 2 local hosts with 4 CPU devices each")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--no-sweep", action="store_true", help="skip the sweep at the end")
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
        sh(tpuctl + ["run", args.name, "--local", "--", "pretrain", *train_flags(args.steps), "--data", data,
                     "--ckpt-dir", run], env)
        text = sh_out(trainer + ["sample", "--ckpt-dir", run, *SAMPLE], local_env)
        turns = speaker_turns(text[len(PROMPT):])  # the turns the model wrote, not the prompt
        print(f"\n(the sample has {len(turns)} speaker turn(s){': ' + ', '.join(turns) if turns else ''})")
        print(f"metrics and TensorBoard events: {run}/metrics.jsonl, {run}/tensorboard/")
        if not args.no_sweep:
            sweep = f"gs://{BUCKET}/{args.name}-sweep"
            sh(tpuctl + ["sweep", args.name, "--local", *SWEEP, "--out", sweep, "--", "pretrain", "--data", data,
                         *SWEEP_TRIAL], env, check=False)
            report = Path(args.home) / "sweeps" / args.name / "report"
            print(f"\nsweep report: {report / 'report.html'}")
            print("pictures: " + ", ".join(str(p) for p in sorted(report.glob("*.png"))))
        print(f"\ndemo done: {args.name} trained on {args.accelerator} (local), checkpoints in {run}")
        return 0
    finally:
        sh(tpuctl + ["down", args.name, "--local", "--yes"], env, check=False)
        gcs.stop()
        from orchestrator.provider import local as local_provider
        local_provider.stop_api()  # the TPU API stand-in: nothing of the demo keeps running


if __name__ == "__main__":
    sys.exit(main())
