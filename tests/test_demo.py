"""The demo's training: after the demo's own steps and flags, its sample reads as play text with speaker turns.

The demo trains on 2 local hosts x 4 devices; the global batch and dropout depend on (seed, step) only, so one
process with 8 devices trains the same model (tests/test_run_e2e.py checks that equality). The same run is the
suite's check that gpt2-tiny learns Shakespeare (the loss falls, metrics and TensorBoard events are written) and
that sampling is the model's argmax: one training run of the preset serves all of it."""
from __future__ import annotations

import subprocess
import sys

import jax
import pytest

from _trainer_util import REPO, env, metrics, session_cache, shakespeare, tail
from infra import demo


def test_speaker_turns_are_capitalised_names_alone_on_their_line():
    text = "ROMEO:\nBut soft!\n\nFIRST CITIZEN:\nSpeak, speak.\nThatUC:\nnot: a turn\nEnter ROMEO:\n"
    assert demo.speaker_turns(text) == ["ROMEO", "FIRST CITIZEN"]


@pytest.mark.slow
def test_the_demo_training_learns_and_ends_with_a_sample_that_has_speaker_turns(tmp_path_factory, tmp_path):
    corpus = shakespeare(tmp_path_factory)
    ckpt = tmp_path / "run"
    e = env(session_cache(tmp_path_factory), devices=8)
    p = subprocess.run([sys.executable, "-m", "trainer", "pretrain", *demo.train_flags(), "--data", corpus,
                        "--ckpt-dir", str(ckpt)], cwd=REPO, env=e,
                       stdout=open(tmp_path / "log", "w"), stderr=subprocess.STDOUT, timeout=900)
    assert p.returncode == 0, tail(tmp_path / "log")

    recs = metrics(ckpt)
    # Step 1, every --log-every (50), the last; val loss at --eval-every (250) and the last.
    assert [r["step"] for r in recs] == [1, *range(50, demo.STEPS + 1, 50)]
    assert [r["step"] for r in recs if "val_loss" in r] == [250, 500]
    assert recs[-1]["loss"] <= recs[0]["loss"] - 3.0, recs
    assert recs[-1]["val_loss"] < recs[0]["loss"] - 2.0
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in recs)  # CPU: no peak known
    assert (ckpt / "tensorboard").is_dir() and any((ckpt / "tensorboard").iterdir())

    s = subprocess.run([sys.executable, "-m", "trainer", "sample", "--ckpt-dir", str(ckpt), *demo.SAMPLE],
                       cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert s.returncode == 0, s.stderr[-3000:]
    assert s.stdout.startswith(demo.PROMPT)
    assert "**" not in s.stdout
    assert demo.speaker_turns(s.stdout[len(demo.PROMPT):]), s.stdout
    check_greedy_sampling_is_the_model_argmax(ckpt)


def check_greedy_sampling_is_the_model_argmax(ckpt):
    """sample (fixed-size window, no cache) == argmax of a plain forward over the exact prefix."""
    import jax.numpy as jnp
    from flax import nnx
    from trainer.pretrain import tokenizers
    from trainer.pretrain import sample
    from trainer.models import gpt2
    prompt = tokenizers.gpt2().encode_ordinary("ROMEO:")
    ids = sample.generate_ids(str(ckpt), prompt, max_new_tokens=5, temperature=0)
    assert ids[: len(prompt)] == prompt and len(ids) > len(prompt)
    cfg, params = sample.load(str(ckpt))
    graphdef, _ = gpt2.abstract(cfg.model)
    # One causal forward over the exact sequence: each generated token is the argmax after its prefix.
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    logits = forward(params, jnp.asarray([ids]))[0, :, : cfg.model.vocab_size]
    assert [int(x) for x in jnp.argmax(logits[len(prompt) - 1 : -1], -1)] == ids[len(prompt):]
