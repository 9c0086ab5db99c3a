"""`make demo`: the whole story in local mode, with the commands a user would type.

    tpuctl up demo --local -a v4-16                 # the Cloud TPU API stand-in + 2 real sshd hosts
    python -m trainer prepare --tokenizer plays-4k  # Shakespeare's plays, a 4,096-id BPE fitted to them, to gs://
    tpuctl run demo --env TPUCTL_EMULATE_DEVICES=2 -- pretrain ...   # 2 hosts x 2 CPU devices over SSH
    python -m trainer sample --ckpt-dir gs://...    # back on the laptop: read the checkpoint, write play text
    tpuctl sweep demo --set d_model=... --env ... --no-plan -- pretrain   # three sizes, one trial after another
    tpuctl sweep report gs://...                    # its table, PNG charts and HTML page
    tpuctl down demo                                # always, even after a failure or Ctrl-C

The tokenizer is a byte-level BPE of 4,096 ids fitted to the plays: on a CPU, GPT-2's 50,257-id output layer
would be most of a small model's work, and with the plays' words and speakers' names as single tokens the sample
is real words and speaker turns after a few hundred steps. Each host emulates 2 CPU devices, not a v4 host's 4:
on a 2-core machine the collectives between 8 emulated devices in 2 processes cost more than the model's
arithmetic (docs/demo.md).
Everything runs under its own TPUCTL_HOME (default ~/.tpuctl/demo) so it never touches your real slices.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

# Its own TPUCTL_HOME; `make setup` fills its wheelhouse (--prefetch), which the tests link theirs from.
HOME = Path.home() / ".tpuctl" / "demo"
BUCKET = "tpuctl-demo"
PROMPT = "ROMEO:\n"
TOKENIZER = "plays-4k"
# Two layers of width 128 over 64 tokens of context: chosen by step time on 2 cores and by what the sample shows
# after STEPS steps (docs/demo.md has the numbers).
MODEL = ["--n-layer", "2", "--n-head", "4", "--d-model", "128", "--seq-len", "64", "--dropout", "0"]
STEPS = 400
# A speech of the plays is about 54 tokens long in plays-4k: 500 tokens hold several turns.
SAMPLE = ["--prompt", PROMPT, "--max-new-tokens", "500", "--temperature", "0.8", "--top-k", "20", "--seed", "0"]
# Devices each local host emulates (a v4 host has 4 chips; see the module's docstring).
DEVICES_PER_HOST = 2
RUN_ENV = ["--env", f"TPUCTL_EMULATE_DEVICES={DEVICES_PER_HOST}"]
# The sweep: one layer at three widths, the same steps and data; its report plots validation loss against compute.
# 64 sequences a step: at 40 steps of 32 the three widths ended within 0.004 of each other (docs/demo.md).
SWEEP = ["--set", "d_model=32,64,128"]
SWEEP_TRIAL = ["--n-layer", "1", "--n-head", "4", "--seq-len", "64", "--dropout", "0", "--batch-size", "64",
               "--steps", "40", "--warmup-steps", "4", "--decay-steps", "40", "--lr", "3e-3", "--log-every", "10",
               "--eval-every", "0", "--eval-batches", "4", "--ckpt-every", "0"]


def train_flags(steps: int = STEPS) -> list[str]:
    """The demo's run: MODEL, its cosine over the whole run."""
    return [*MODEL, "--batch-size", "32", "--steps", str(steps), "--warmup-steps", "10", "--decay-steps", str(steps),
            "--lr", "3e-3", "--log-every", "50", "--eval-every", str(steps // 2), "--eval-batches", "4",
            "--ckpt-every", str(steps)]


HEADINGS = ("ACT ", "SCENE ")  # the plays' act and scene headings: never a speaker, with or without a colon


def speaker_turns(text: str) -> list[str]:
    """The `NAME:` lines of a sample: a speaker's name in capitals alone on its line, as the prepared plays
    have them (`ROMEO:`, `FIRST CITIZEN:`)."""
    return [n for n in re.findall(r"^([A-Z][A-Z .'-]*[A-Z]):$", text, re.M) if not n.startswith(HEADINGS)]


WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def words_of_the_plays() -> set[str]:
    """Every word (lower-cased) of the plays the demo trains on, as `prepare` renders them."""
    from trainer.pretrain import plays, prepare
    return {w.lower() for f in prepare.default_corpus() for w in WORD.findall(plays.render(f.read_text()))}


def play_words(text: str, known: set[str]) -> tuple[int, int]:
    """(words of `text` that are words of the plays, words of `text`)."""
    words = [w.lower() for w in WORD.findall(text)]
    return sum(w in known for w in words), len(words)


def sh(argv: list[str], env: dict[str, str], check: bool = True) -> int:
    print(f"\n$ {shlex.join(argv)}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(argv, env=env).returncode
    if os.environ.get("TPUCTL_DEMO_TIMES"):
        print(f"[{time.monotonic() - t0:.1f} s]", flush=True)
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


def prefetch(home: str) -> int:
    """Fill the wheelhouse under `home` that the demo's local hosts install the trainer's dependencies from: the
    download `tpuctl run` would otherwise do on the demo's first run (once per dependency list)."""
    os.environ["TPUCTL_HOME"] = home
    from orchestrator.jobs import bundle
    from orchestrator.jobs.launch import PYTHON
    b = bundle.build(extras=bundle.trainer_extras([PYTHON, "-m", "trainer", "pretrain"], PYTHON))
    wh = bundle.fill_wheelhouse(b, Path(home) / "wheelhouse", log=lambda m: print(f"demo: {m}", flush=True))
    print(f"demo: the hosts' wheelhouse is ready ({wh})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="demo")
    p.add_argument("--accelerator", default="v4-16", help="v4-16 = 2 local hosts")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--no-sweep", action="store_true", help="skip the sweep at the end")
    p.add_argument("--home", default=str(HOME))
    p.add_argument("--prefetch", action="store_true",
                   help="only download what the demo's hosts install into its home's wheelhouse, and exit "
                        "(`make setup` does this: downloads belong to setup, not to the demo's minutes)")
    args = p.parse_args(argv)
    if args.prefetch:
        return prefetch(args.home)

    from orchestrator import provider
    place = provider.chosen(local=True)  # the demo runs in local mode: the --local of every tpuctl command below

    t0 = time.monotonic()
    env = dict(os.environ, TPUCTL_HOME=args.home)
    os.environ["TPUCTL_HOME"] = args.home
    tpuctl = [sys.executable, "-m", "orchestrator.cli"]
    trainer = [sys.executable, "-m", "trainer"]
    data, run = f"gs://{BUCKET}/shakespeare-{TOKENIZER}", f"gs://{BUCKET}/{args.name}"

    local_env = {**env, **place.local_env([data])}  # this machine (the "laptop") reads and writes the same bucket
    print(f"GCS emulator at {local_env.get('STORAGE_EMULATOR_HOST', '?')} (bucket {BUCKET})")
    print(f"The demo trains a {MODEL[1]}-layer, {MODEL[5]}-wide GPT-2 on Shakespeare's plays, tokenised with "
          f"{TOKENIZER} (a 4,096-id BPE fitted to the plays), {args.steps} steps on the 2 hosts of a local "
          f"{args.accelerator} ({DEVICES_PER_HOST} CPU devices each); then it samples the model here and sweeps "
          f"three widths of a one-layer model.")
    try:
        sh(tpuctl + ["up", args.name, "--local", "-a", args.accelerator], env)
        sh(trainer + ["prepare", "--tokenizer", TOKENIZER, "--out", data], local_env)
        sh(tpuctl + ["run", args.name, *RUN_ENV, "--", "pretrain", *train_flags(args.steps), "--data", data,
                     "--ckpt-dir", run], env)
        text = sh_out(trainer + ["sample", "--ckpt-dir", run, *SAMPLE], local_env)
        written = text[len(PROMPT):]  # what the model wrote, not the prompt
        turns = speaker_turns(written)
        known, total = play_words(written, words_of_the_plays())
        print(f"\n(the model wrote {len(turns)} speaker turn(s){': ' + ', '.join(turns) if turns else ''}; "
              f"{known} of its {total} words ({100 * known / max(total, 1):.0f}%) are words of the plays)")
        print(f"metrics and TensorBoard events: {run}/metrics.jsonl, {run}/tensorboard/")
        if not args.no_sweep:
            sweep = f"gs://{BUCKET}/{args.name}-sweep"
            # A failed trial is recorded and the sweep goes on to the next and to its report, then exits 1: the
            # report is shown either way, and the demo fails with it.
            rc = sh(tpuctl + ["sweep", args.name, *SWEEP, *RUN_ENV, "--no-plan", "--out", sweep, "--", "pretrain",
                              "--data", data, *SWEEP_TRIAL], env, check=False)
            report = Path(args.home) / "sweeps" / args.name / "report"
            print(f"\nsweep report: {report / 'report.html'}")
            print("pictures: " + ", ".join(str(p) for p in sorted(report.glob("*.png"))))
            if rc != 0:
                raise SystemExit(f"demo: the sweep failed with exit code {rc} (its report above says which trial)")
        print(f"\ndemo done in {time.monotonic() - t0:.0f} s: {args.name} trained on {args.accelerator} (local), "
              f"checkpoints in {run}")
        return 0
    finally:
        sh(tpuctl + ["down", args.name, "--local", "--yes"], env, check=False)
        place.stop_services()  # the GCS emulator and the TPU API stand-in: nothing of the demo keeps running


if __name__ == "__main__":
    sys.exit(main())
