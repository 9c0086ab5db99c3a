"""The demo's training: after the demo's own steps and flags, its sample reads like a play.

The demo trains on 2 local hosts x 2 devices; the global batch and dropout depend on (seed, step) only, so one
process with 8 devices trains the same model (tests/test_run_e2e.py checks that equality). The same run is the
suite's check that a small-vocabulary model learns Shakespeare (the loss falls, metrics and TensorBoard events are
written), that pretrain and sample follow the data's tokenizer, and that sampling is the model's argmax: one
training run serves all of it."""
from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from _trainer_util import REPO, env, metrics, session_cache, tail
from orchestrator import demo


def test_speaker_turns_are_capitalised_names_alone_on_their_line():
    text = "ROMEO:\nBut soft!\n\nFIRST CITIZEN:\nSpeak, speak.\nThatUC:\nnot: a turn\nEnter ROMEO:\nSCENE III:\n"
    assert demo.speaker_turns(text) == ["ROMEO", "FIRST CITIZEN"]
    known = demo.words_of_the_plays()
    assert {"romeo", "speak", "soft", "o'er"} <= known and "thatuc" not in known
    assert demo.play_words("But soft! Thatuc speaks o'er", known) == (4, 5)
    # judge pools its samples: one with no turn and words half of the plays' does not sink a set that clears the bar
    play = demo.PROMPT + "But soft!\n\nJULIET:\nAy me.\n\nROMEO:\nShe speaks.\n"
    pool = [play] * (demo.MIN_TURNS // 2) + [demo.PROMPT + "Thatuc soft qzx speaks"]
    assert demo.judge(pool, known)[0] and "words of the plays" in demo.judge(pool, known)[1]
    assert not demo.judge(pool[:1] * (demo.MIN_TURNS // 2 - 1), known)[0]  # too few turns
    assert not demo.judge([demo.PROMPT + "Thatuc qzx soft\n\nJULIET:\nAy.\n"] * demo.MIN_TURNS, known)[0]


@pytest.mark.slow
def test_the_demo_training_writes_a_sample_that_reads_like_a_play(tmp_path_factory, tmp_path):
    e = env(session_cache(tmp_path_factory), devices=8)
    data = tmp_path / "tokens"
    p = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--tokenizer", demo.TOKENIZER, "--out", str(data)],
                       cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trainer", "pretrain", *demo.train_flags(), "--data", str(data),
                        "--ckpt-dir", str(ckpt)], cwd=REPO, env=e,
                       stdout=open(tmp_path / "log", "w"), stderr=subprocess.STDOUT, timeout=900)
    assert p.returncode == 0, tail(tmp_path / "log")

    # --vocab-size and --tokenizer were left out: the data's meta.json decided them, and the checkpoint says so.
    model = json.loads((ckpt / "config.json").read_text())["model"]
    assert (model["tokenizer"], model["vocab_size"]) == (demo.TOKENIZER, 4096)
    recs = metrics(ckpt)
    assert [r["step"] for r in recs] == [1, *range(50, demo.STEPS + 1, 50)]
    assert [r["step"] for r in recs if "val_loss" in r] == [demo.STEPS // 2, demo.STEPS]
    # From ln(4096) = 8.3 at the start, the demo's run ends 2.7 lower on its last batch and 2.9 on validation (5.62
    # and 5.47 on this repository's machine); an untrained model ends where it began. The bar sits midway, 1.2
    # below the trained losses: one batch's loss moves by 0.1-0.2 from one logged step to the next here.
    assert recs[-1]["loss"] <= recs[0]["loss"] - 1.5, recs
    assert recs[-1]["val_loss"] < recs[0]["loss"] - 1.5
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in recs)  # CPU: no peak known
    assert (ckpt / "tensorboard").is_dir() and any((ckpt / "tensorboard").iterdir())

    s = subprocess.run([sys.executable, "-m", "trainer", "sample", "--ckpt-dir", str(ckpt), *demo.SAMPLE],
                       cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert s.returncode == 0, s.stderr[-3000:]
    assert s.stdout.startswith(demo.PROMPT)
    # The demo's judgement, over its seeds pooled (demo.JUDGE_SEEDS: the bars and their margins are written there);
    # the sample the demo shows is the first of them.
    from trainer.pretrain import sample
    samples = sample.generate_seeds(str(ckpt), demo.PROMPT, demo.JUDGE_SEEDS, **demo.SAMPLE_OPTIONS)
    assert s.stdout == samples[0] + "\n"
    ok, line = demo.judge(samples, demo.words_of_the_plays())
    assert ok, line + "\n" + "\n\n".join(samples)
    check_greedy_sampling_is_the_model_argmax(ckpt)


def check_greedy_sampling_is_the_model_argmax(ckpt):
    """sample (fixed-size window, no cache) == argmax of a plain forward over the exact prefix."""
    import jax.numpy as jnp
    from flax import nnx
    from trainer.pretrain import sample
    from trainer.models import gpt2
    cfg, params = sample.load(str(ckpt))
    prompt = sample.tokenizer_of(cfg).encode_ordinary("ROMEO:")
    from trainer.pretrain import tokenizers
    assert prompt == tokenizers.get(demo.TOKENIZER).encode_ordinary("ROMEO:") and max(prompt) < 4096
    ids = sample.generate_ids(str(ckpt), prompt, max_new_tokens=5, temperature=0)
    assert ids[: len(prompt)] == prompt and len(ids) > len(prompt)
    graphdef, _ = gpt2.abstract(cfg.model)
    # One causal forward over the exact sequence: each generated token is the argmax after its prefix.
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    logits = forward(params, jnp.asarray([ids]))[0, :, : cfg.model.vocab_size]
    assert [int(x) for x in jnp.argmax(logits[len(prompt) - 1 : -1], -1)] == ids[len(prompt):]
