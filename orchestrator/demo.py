"""`make demo`: the whole story in local mode, with the commands a user would type.

    tpuctl up demo --local -a v4-16                 # the Cloud TPU API stand-in + 2 real sshd hosts
    python -m trainer prepare --tokenizer plays-4k  # Shakespeare's plays, a 4,096-id BPE fitted to them, to gs://
    tpuctl run demo --env TPUCTL_EMULATE_DEVICES=2 -- pretrain ...   # 2 hosts x 2 CPU devices over SSH
    python -m trainer sample --ckpt-dir gs://...    # back on the laptop: read the checkpoint, write play text
    python -m orchestrator.demo --judge gs://...    # does it read like a play, over 8 samples (JUDGE_SEEDS)
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
SAMPLE_OPTIONS = {"max_new_tokens": 500, "temperature": 0.8, "top_k": 20}
SAMPLE = ["--prompt", PROMPT, *(a for k, v in SAMPLE_OPTIONS.items() for a in (f"--{k.replace('_', '-')}", str(v))),
          "--seed", "0"]
# Whether the trained model writes play text is judged over JUDGE_SEEDS samples of SAMPLE_OPTIONS pooled (the demo
# shows seed 0's). One sample is one draw, and a last-bit difference in a logit sends the draw elsewhere: seed 0's
# sample had 96% words of the plays on one 2-core machine and 89% on another, whose CPU rounds differently; on the
# first, seed 1's has 2 speaker turns. Measured on this repository's 2-core machine, pooled: the demo's model (400
# steps) wrote 95.9% words of the plays and 73 turns over seeds 0-9 (93-98% and 2-11 turns a sample); the same
# model untrained (its random init) wrote 53.8% and no turn over 4 seeds; 500 random plays-4k ids, decoded, are
# 47-52% words of the plays (a BPE fitted to the plays decodes to many whole words) and no turn. The bars sit
# midway: 75% is 21 points below the trained model and 21 above the untrained one; one turn a sample on average is
# a seventh of the trained model's rate, and the untrained model writes none.
JUDGE_SEEDS = range(8)
MIN_PLAY_WORDS = 0.75
MIN_TURNS = len(JUDGE_SEEDS)
UNTRAINED = "none and 54%"  # what the untrained model wrote, measured as above: said beside the bars
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


def judge(samples: list[str], known: set[str]) -> tuple[bool, str]:
    """(whether `samples`, each PROMPT and what the model wrote, read like a play by the bars above; one line
    saying what they hold against those bars)."""
    written = [t[len(PROMPT):] if t.startswith(PROMPT) else t for t in samples]
    turns = sum(len(speaker_turns(w)) for w in written)
    counts = [play_words(w, known) for w in written]
    good, total = sum(k for k, _ in counts), sum(n for _, n in counts)
    ok = turns >= MIN_TURNS and total > 0 and good >= MIN_PLAY_WORDS * total
    return ok, (f"{turns} speaker turns, and {good} of {total} words ({100 * good / max(total, 1):.1f}%) are words "
                f"of the plays, over {len(samples)} samples; the bar is {MIN_TURNS} turns and "
                f"{MIN_PLAY_WORDS:.0%} (an untrained model writes {UNTRAINED}): "
                + ("the model reads like a play" if ok else "the model does NOT read like a play"))


def judge_checkpoint(ckpt_dir: str) -> int:
    """`--judge CKPT_DIR`: sample the checkpoint at JUDGE_SEEDS, print judge's line; 0 when it clears the bars."""
    from trainer.common.process import quiet_native_logs
    quiet_native_logs()  # before jax starts, as `python -m trainer` does
    from absl import logging
    from trainer.pretrain import sample
    logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only checkpoint manager is read-only
    ok, line = judge(sample.generate_seeds(ckpt_dir, PROMPT, JUDGE_SEEDS, **SAMPLE_OPTIONS), words_of_the_plays())
    print(f"seeds {JUDGE_SEEDS.start}-{JUDGE_SEEDS.stop - 1}: {line}", flush=True)
    return 0 if ok else 1


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
    p.add_argument("--judge", metavar="CKPT_DIR",
                   help=f"only judge a checkpoint's samples (seeds {JUDGE_SEEDS.start}-{JUDGE_SEEDS.stop - 1}) "
                        "against the demo's bars, and exit 1 when they fall short")
    args = p.parse_args(argv)
    if args.prefetch:
        return prefetch(args.home)
    if args.judge:
        return judge_checkpoint(args.judge)

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
        # One sample is one draw: the bars are judged over several (JUDGE_SEEDS), as tests/test_demo.py judges.
        sh([sys.executable, "-m", "orchestrator.demo", "--judge", run], local_env)
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
