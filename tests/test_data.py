"""trainer.pretrain.data: offline tokenizer, prepare/resolve with caching, process-count-invariant batches."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.pretrain import data, prepare, tokenizers
from trainer.pretrain.shards import read_shard


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    words = "the quick brown fox jumps over the lazy dog and then sleeps".split()
    rng = np.random.default_rng(0)
    for i in range(3):  # ~300 KB each: cut into ~16 KiB documents, some of which go to val
        (d / f"doc{i}.txt").write_text("\n\n".join(" ".join(rng.choice(words, 100)) for _ in range(600)))
    (d / ".hidden.txt").write_text("never read")
    (d / "image.png").write_bytes(b"\x89PNG\x00\x01")
    return d


def test_tokenizer_is_gpt2_offline():
    enc = tokenizers.gpt2()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == tokenizers.VOCAB_SIZE
    assert enc.decode(enc.encode("ROMEO: But soft!")) == "ROMEO: But soft!"


def test_prepare_writes_splits_and_meta(corpus, tmp_path):
    out = tmp_path / "tok"
    meta = prepare.prepare([str(corpus)], str(out), workers=1)
    assert meta["n_files"] == 3  # .hidden.txt and image.png are skipped
    train, val = ([read_shard(out / s["file"]) for s in meta[split]] for split in ("train", "val"))
    assert [a.size for a in train] == [meta["n_train_tokens"]] and [a.size for a in val] == [meta["n_val_tokens"]]
    # a text file is cut into ~16 KiB documents at blank lines; each ends with EOT, whole in train or val
    n_eot = int((train[0] == tokenizers.EOT).sum() + (val[0] == tokenizers.EOT).sum())
    assert n_eot == meta["n_documents"] and 50 < n_eot < 70 and (val[0] == tokenizers.EOT).sum() >= 1
    assert json.loads((out / "meta.json").read_text())["content_hash"] == meta["content_hash"]


def test_resolve_caches_by_content(corpus):
    a = data.resolve(str(corpus))
    assert data.resolve(str(corpus)) == a
    assert data.resolve(a) == a  # a prepared dir is used as is
    (corpus / "doc0.txt").write_text("changed text " * 500)
    assert data.resolve(str(corpus)) != a


def test_default_corpus_is_shakespeare():
    files = prepare.default_corpus()
    assert len(files) >= 30 and any("hamlet" in f.name for f in files)


def test_global_batch_does_not_depend_on_process_count(corpus):
    d = data.resolve(str(corpus))
    one = data.BatchLoader(d, "train", seq_len=32, global_batch=8, seed=3)
    parts = [data.BatchLoader(d, "train", 32, 8, 3, process_index=p, process_count=2) for p in range(2)]
    for step in (0, 1, 7, 500):  # 500 wraps into later epochs
        whole = one.local_batch(step)
        assert whole.shape == (8, 33) and whole.dtype == np.int32
        np.testing.assert_array_equal(np.concatenate([p.local_batch(step) for p in parts]), whole)
    assert not np.array_equal(one.local_batch(0), one.local_batch(1))
    other_seed = data.BatchLoader(d, "train", 32, 8, seed=4)
    assert not np.array_equal(one.local_batch(0), other_seed.local_batch(0))


def test_batches_are_shifted_windows_of_the_stream(corpus):
    d = data.resolve(str(corpus))
    loader = data.BatchLoader(d, "train", 16, 4, 0)
    tokens = read_shard(Path(d) / "train_000000.bin")
    ids = loader.window_ids(2)
    batch = loader.local_batch(2)
    for row, w in zip(batch, ids):
        np.testing.assert_array_equal(row, tokens[w * 16: w * 16 + 17])
    # every window is visited once per epoch
    n = loader.n_windows
    seen = np.concatenate([loader.window_ids(s) for s in range(n // 4)])
    assert len(set(seen.tolist())) == len(seen)


def test_iterate_matches_local_batch(corpus):
    d = data.resolve(str(corpus))
    loader = data.BatchLoader(d, "val", 16, 4, 0)
    it = loader.iterate(10)
    for expect_step in (10, 11, 12):
        step, batch = next(it)
        assert step == expect_step
        np.testing.assert_array_equal(batch, loader.local_batch(step))


def test_empty_corpus_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(data.DataError, match="corpus is empty"):
        prepare.prepare([str(empty)], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    binary_only = tmp_path / "binary_only"
    binary_only.mkdir()
    (binary_only / "x.png").write_bytes(b"\x89PNG")
    with pytest.raises(data.DataError, match="no input files found"):
        prepare.prepare([str(binary_only)], str(tmp_path / "o"))


def test_missing_path_and_short_split_errors(corpus, tmp_path):
    with pytest.raises(data.DataError, match="no such file"):
        data.resolve(str(tmp_path / "nope"))
    d = data.resolve(str(corpus))
    with pytest.raises(data.DataError, match="fewer than one sequence"):
        data.BatchLoader(d, "val", seq_len=10**6, global_batch=2, seed=0)
    with pytest.raises(data.DataError, match="not divisible"):
        data.BatchLoader(d, "train", 16, 6, 0, process_index=0, process_count=4)


def test_the_vocabulary_table_is_each_tokenizers_own():
    assert set(tokenizers.VOCABS) == set(tokenizers.NAMES)
    for name, n in tokenizers.VOCABS.items():
        assert tokenizers.get(name).n_vocab == n, name


def test_the_plays_tokenizer_is_rebuilt_identically_and_makes_names_and_line_starts_single_tokens():
    """plays-4k is fitted to the corpus on first use, in every process that needs it (prepare's workers, sample):
    two processes must build the same merges. It is a BPE: it round-trips any text, bytes included."""
    probe = ("import hashlib, sys; from trainer.pretrain import tokenizers; "
             "e = tokenizers.get('plays-4k'); "
             "print(hashlib.sha256(repr(sorted(e._mergeable_ranks.items())).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                              check=True).stdout for _ in range(2)}
    assert len(digests) == 1
    enc = tokenizers.get("plays-4k")
    assert enc.n_vocab == 4096 and enc.eot_token == 4095
    text = "Good night.\n\nROMEO:\nAnd I will kiss thee, 42 times; naïve 日本\n"
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text and max(ids) < 4095
    pieces = [enc.decode([i]) for i in ids]
    assert "\nROMEO" in pieces and "\nAnd" in pieces and " kiss" in pieces, pieces
    assert len(ids) < len(tokenizers.get("gpt2-4k").encode_ordinary(text))
