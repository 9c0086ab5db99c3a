"""The demo's training: after the demo's own steps and flags, its sample reads as play text with speaker turns.

The demo trains on 2 local hosts x 4 devices; the global batch and dropout depend on (seed, step) only, so one
process with 8 devices trains the same model (tests/test_run_e2e.py checks that equality)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from _trainer_util import REPO, env, session_cache, shakespeare, tail
from infra import demo


def test_speaker_turns_are_capitalised_names_alone_on_their_line():
    text = "ROMEO:\nBut soft!\n\nFIRST CITIZEN:\nSpeak, speak.\nThatUC:\nnot: a turn\nEnter ROMEO:\n"
    assert demo.speaker_turns(text) == ["ROMEO", "FIRST CITIZEN"]


@pytest.mark.slow
def test_the_demo_training_ends_with_a_sample_that_has_speaker_turns(tmp_path_factory, tmp_path):
    corpus = shakespeare(tmp_path_factory)
    ckpt = tmp_path / "run"
    e = env(session_cache(tmp_path_factory), devices=8)
    p = subprocess.run([sys.executable, "-m", "trainer", "pretrain", *demo.train_flags(), "--data", corpus,
                        "--ckpt-dir", str(ckpt)], cwd=REPO, env=e,
                       stdout=open(tmp_path / "log", "w"), stderr=subprocess.STDOUT, timeout=900)
    assert p.returncode == 0, tail(tmp_path / "log")
    s = subprocess.run([sys.executable, "-m", "trainer", "sample", "--ckpt-dir", str(ckpt), *demo.SAMPLE],
                       cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert s.returncode == 0, s.stderr[-3000:]
    assert s.stdout.startswith(demo.PROMPT)
    assert "**" not in s.stdout
    assert demo.speaker_turns(s.stdout[len(demo.PROMPT):]), s.stdout
