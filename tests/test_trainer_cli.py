"""Bad input: one `error: ...` line on stderr, exit code 2, nothing left behind. And --emulate-devices."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _trainer_util import REPO, TINY, corpus, env  # noqa: F401 (corpus: a fixture)
from trainer.cli import main


def fails(capsys, argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("flags, needles", [
    (["--mesh", "data=3,model=2"], ["--mesh data=3,model=2", "8 devices"]),
    (["--mesh", "data=8,model=1", "--batch-size", "12"], ["--batch-size 12", "data axis (8)"]),
    (["--mesh", "data=2,model=4", "--n-head", "2"], ["--n-head 2", "model axis (4)"]),
    (["--preset", "gpt2-xxl"], ["unknown preset 'gpt2-xxl'", "gpt2-tiny"]),
    (["--mesh", "data=8,model"], ["--mesh"]),
    (["--warmup-steps", "60", "--decay-steps", "50"], ["--warmup-steps 60"]),
    (["--no-such-flag", "1"], ["--no-such-flag"]),
    (["--vocab-size", "1000"], ["--vocab-size 1000", "token id 50256"]),
    (["--vocab-parallel", "yes"], ["--vocab-parallel yes", "auto, on or off"]),
    (["--vocab-parallel", "on", "--vocab-multiple", "4"], ["--vocab-parallel on", "8 devices", "--vocab-multiple"]),
    (["--profile", "5:5"], ["--profile 5:5", "the window is empty"]),
    (["--profile", "8:5"], ["--profile 8:5", "the window is reversed"]),
    (["--profile", "0:3"], ["--profile 0:3", "steps start at 1"]),
    (["--profile", "5-8"], ["--profile 5-8", "expected START:END"]),
    (["--profile", "4:9", "--steps", "6"], ["--profile 4:9", "the run ends at step 6 (--steps)"]),
    (["--resident-block", "100"], ["--resident-block 100", "multiple of 128"]),
    (["--attention", "resident"], ["--attention resident", "2 heads of 16", "--attention splash or xla"]),
])
def test_bad_flags_are_refused_before_anything_is_written(capsys, corpus, tmp_path, flags, needles):
    ckpt = tmp_path / "ckpt"
    fails(capsys, ["pretrain", "--data", corpus, *TINY, "--ckpt-dir", str(ckpt), *flags], *needles)
    assert not ckpt.exists()


def test_wandb_without_a_key_or_offline_mode_is_refused_before_anything_is_written(capsys, corpus, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    ckpt = tmp_path / "ckpt"
    fails(capsys, ["pretrain", "--data", corpus, *TINY, "--ckpt-dir", str(ckpt), "--wandb", "proj"],
          "--wandb proj", "WANDB_API_KEY is not set", "--secret-env WANDB_API_KEY", "WANDB_MODE=offline")
    assert not ckpt.exists()


def test_empty_corpus(capsys, corpus, tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "empty.txt").write_text("")
    fails(capsys, ["pretrain", "--data", str(tmp_path / "texts"), *TINY, "--ckpt-dir", str(tmp_path / "ckpt")],
          "empty")
    assert not (tmp_path / "ckpt").exists()


def test_unwritable_checkpoint_dir(capsys, corpus, tmp_path):
    (tmp_path / "file").write_text("not a directory")  # root ignores permission bits: use a file as parent
    fails(capsys, ["pretrain", "--data", corpus, *TINY, "--ckpt-dir", str(tmp_path / "file" / "ckpt")],
          "--ckpt-dir", "not writable")


def test_checkpoint_of_another_model_is_refused(capsys, corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = ["pretrain", "--data", corpus, *TINY, "--ckpt-dir", str(ckpt), "--log-every", "1", "--eval-batches", "1"]
    assert main([*run, "--steps", "1"]) == 0
    before = sorted(p.name for p in ckpt.iterdir())
    config_before = (ckpt / "config.json").read_text()
    fails(capsys, [*run, "--steps", "2", "--d-model", "64"], "different model", "d_model 32->64")
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert (ckpt / "config.json").read_text() == config_before


def test_sample_without_checkpoint(capsys, tmp_path):
    fails(capsys, ["sample", "--ckpt-dir", str(tmp_path / "nothing"), "--prompt", "hi"], "does not exist")


def run_cli(args, environ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, env=environ, capture_output=True,
                          text=True, timeout=120)


def test_emulate_devices_sets_the_count_and_an_inherited_flag_wins(corpus, tmp_path):
    cache = os.environ["TPUCTL_CACHE"]
    args = ["pretrain", "--emulate-devices", "4", "--mesh", "data=3,model=1", "--data", corpus, *TINY,
            "--ckpt-dir", str(tmp_path / "c")]
    out = run_cli(args, env(cache, devices=None))
    assert out.returncode == 2 and out.stderr.splitlines() == [out.stderr.strip()], out.stderr
    assert "there are 4 devices" in out.stderr
    out = run_cli(args, env(cache, devices=8))  # XLA_FLAGS already has a device count: it wins
    assert out.returncode == 2 and "there are 8 devices" in out.stderr, out.stderr
    assert not (tmp_path / "c").exists()
    no_flag = [a for a in args if a not in ("--emulate-devices", "4")]
    out = run_cli(no_flag, {**env(cache, devices=None), "TPUCTL_EMULATE_DEVICES": "2"})  # what a local slice's hosts get
    assert out.returncode == 2 and "there are 2 devices" in out.stderr, out.stderr
    out = run_cli(args, {**env(cache, devices=None), "TPUCTL_EMULATE_DEVICES": "2"})  # the flag wins over it
    assert out.returncode == 2 and "there are 4 devices" in out.stderr, out.stderr


def _copy_data(corpus: str, dst) -> str:
    """The prepared corpus as a format-2 folder (train.bin / val.bin, raw uint16): the files these checks damage."""
    import json

    import numpy as np

    from trainer.pretrain.shards import read_shard
    dst.mkdir()
    meta = json.loads((Path(corpus) / "meta.json").read_text())
    for split in ("train", "val"):
        np.concatenate([read_shard(Path(corpus) / s["file"]) for s in meta[split]]).tofile(dst / f"{split}.bin")
    # A format-2 meta.json never recorded the largest id: the loader samples the tokens instead.
    (dst / "meta.json").write_text(json.dumps({k: v for k, v in meta.items()
                                               if k not in ("format", "train", "val", "max_token_id")}))
    return str(dst)


def test_bad_token_files_are_refused_at_load(capsys, corpus, tmp_path):
    """Token ids outside the vocabulary, or a file that is not whole uint16 tokens: one line, no checkpoint."""
    import numpy as np
    odd = _copy_data(corpus, tmp_path / "odd")
    with open(f"{odd}/train.bin", "ab") as f:
        f.write(b"\x01")
    fails(capsys, ["pretrain", "--data", odd, *TINY, "--ckpt-dir", str(tmp_path / "c1")],
          f"{odd}/train.bin has", "an odd number", "prepare the data again")
    big = _copy_data(corpus, tmp_path / "big")
    tokens = np.fromfile(f"{big}/train.bin", dtype=np.uint16)
    tokens[123] = 60000
    tokens.tofile(f"{big}/train.bin")
    fails(capsys, ["pretrain", "--data", big, *TINY, "--ckpt-dir", str(tmp_path / "c2")],
          "holds token id 60000", "vocabulary of 50257")
    assert not (tmp_path / "c1").exists() and not (tmp_path / "c2").exists()


def test_prepare_refuses_a_binary_file_by_name(capsys, tmp_path):
    blob = tmp_path / "model.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    fails(capsys, ["prepare", "--data", str(blob), "--out", str(tmp_path / "tok")], f"--data {blob}: not a text file")
    assert not (tmp_path / "tok").exists()


def test_a_diverging_run_stops_and_keeps_the_last_good_step(capsys, corpus, tmp_path):
    """A loss that becomes nan/inf stops the run (exit 2, one line); no diverged step is ever saved."""
    import json
    from trainer.common.checkpoint import Checkpointer
    ckpt = tmp_path / "ckpt"
    err = fails(capsys, ["pretrain", "--data", corpus, *TINY[:-2], "--lr", "1e4", "--warmup-steps", "1",
                         "--ckpt-dir", str(ckpt), "--ckpt-every", "1", "--log-every", "1", "--steps", "40",
                         "--eval-batches", "1"], "training stopped", "nothing diverged was saved")
    bad = int(err.split(" at step ")[1].split(":")[0])
    kept = Checkpointer(str(ckpt), keep=1, read_only=True).latest_step()
    assert kept == bad - 1, (err, kept)
    losses = [json.loads(l)["loss"] for l in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(x) < float("inf") for x in losses)


def test_every_commands_help_renders():
    """argparse expands `%` in help texts: a stray one (say "5% faster") breaks `--help` with a TypeError."""
    import argparse

    from trainer.cli import parser
    top = parser()
    [sub] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"pretrain", "lora", "sample"} <= set(sub.choices)
    for name, p in sub.choices.items():
        text = p.format_help()
        assert "usage: " in text and name in text, name
