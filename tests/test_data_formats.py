"""`--data` names a token folder in any of the layouts trainer/pretrain/token_files.py reads, local or gs://:
the same tokens give the same batches whatever the layout and wherever they live; gs:// is read in place (only
the windows trained on, and a bounded sample for the vocabulary check); bad folders are one line."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from infra import gcs
from trainer.pretrain import data, shards, token_files as tf

SEQ, BATCH = 16, 8


def _stream(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50257, n, dtype=np.uint16)


def write_layouts(root: Path, train: np.ndarray, val: np.ndarray) -> dict[str, Path]:
    """The same two token streams as format 2, nanoGPT, llm.c shards (cut at odd places, so that windows span
    two shards) and format 3."""
    out = {k: root / k for k in ("format2", "nanogpt", "llmc", "format3")}
    for k in out.values():
        k.mkdir(parents=True)
    for d in (out["format2"], out["nanogpt"]):
        train.tofile(d / "train.bin")
        val.tofile(d / "val.bin")
    (out["format2"] / "meta.json").write_text(json.dumps({"tokenizer": "gpt2-r50k", "vocab_size": 50257}))
    meta = {"format": 3, "tokenizer": "gpt2-r50k", "vocab_size": 50257, "eot": 50256, "dtype": "uint16",
            "shard_tokens": 1000, "max_token_id": int(max(train.max(), val.max()))}
    for split, toks in (("train", train), ("val", val)):
        cuts = [0, 997, 2011, toks.size]
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            shards.write_shard(out["llmc"] / f"fineweb_{split}_{i:06d}.bin", toks[a:b])
        meta[split] = []
        for i, a in enumerate(range(0, toks.size, 1000)):
            shards.write_shard(out["format3"] / shards.shard_name(split, i), toks[a:a + 1000])
            meta[split].append({"file": shards.shard_name(split, i), "tokens": int(toks[a:a + 1000].size)})
    # A shard a cut-short prepare left behind: meta.json does not list it, so it does not exist.
    shards.write_shard(out["format3"] / shards.shard_name("train", 99), np.full(5000, 60000, np.uint16))
    (out["format3"] / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    e = gcs.start(home=tmp_path_factory.mktemp("home"), buckets=("tok",), record=False, reuse=False)
    mp = pytest.MonkeyPatch()
    for k, v in e.env.items():
        mp.setenv(k, v)
    yield e
    mp.undo()
    e.stop()


def upload(local: Path, dest: str) -> str:
    from google.cloud import storage
    bucket, _, prefix = dest[5:].partition("/")
    b = storage.Client().bucket(bucket)
    for f in sorted(local.iterdir()):
        b.blob(f"{prefix}/{f.name}").upload_from_filename(str(f))
    return dest


def test_every_layout_local_or_gs_gives_the_same_batches(emu, tmp_path):
    train, val = _stream(5003, 1), _stream(1500, 2)
    layouts = write_layouts(tmp_path, train, val)
    roots = {**{k: str(v) for k, v in layouts.items()},
             **{f"gs-{k}": upload(v, f"gs://tok/{k}") for k, v in layouts.items()}}
    want = {"format2": "format 2", "nanogpt": "nanoGPT", "llmc": "llm.c", "format3": "format 3"}
    for name, root in roots.items():
        assert data.resolve(root) == root and tf.detect(root).kind == want[name.removeprefix("gs-")]
        one = data.BatchLoader(root, "train", SEQ, BATCH, seed=5, vocab_size=50257)
        two = [data.BatchLoader(root, "train", SEQ, BATCH, 5, process_index=p, process_count=2) for p in range(2)]
        assert one.n_tokens == train.size
        for step in (0, 3, 40):  # 40 wraps into the second epoch
            batch = one.local_batch(step)
            starts = one.window_ids(step) * SEQ
            np.testing.assert_array_equal(batch, np.stack([train[s:s + SEQ + 1] for s in starts]).astype(np.int32))
            np.testing.assert_array_equal(np.concatenate([p.local_batch(step) for p in two]), batch, err_msg=name)
        v = data.BatchLoader(root, "val", SEQ, 4, seed=1234)
        np.testing.assert_array_equal(v.local_batch(2), np.stack([val[s:s + SEQ + 1]
                                                                   for s in v.window_ids(2) * SEQ]))


def test_the_vocabulary_check_reads_a_bounded_sample_or_only_meta(emu, tmp_path, monkeypatch):
    """4M tokens of nanoGPT layout on gs:// (8 MB): the check before step 1 reads VOCAB_SAMPLE_TOKENS of each
    split, not the files; an id it samples is refused before step 1, one it does not is refused by the batch
    that reads it. Format 3's meta.json answers without reading a token."""
    n = 4 << 20
    big = tmp_path / "big"
    big.mkdir()
    train = _stream(n, 3) % 50000
    train[7] = 50300  # inside the first sampled chunk
    train.tofile(big / "train.bin")
    _stream(4096, 4).tofile(big / "val.bin")
    root = upload(big, "gs://tok/big")
    read = []
    real = tf.GcsFolder.read_many

    def counting(self, reqs, what):
        out = real(self, reqs, what)
        read.append(sum(len(b) for b in out))
        return out

    monkeypatch.setattr(tf.GcsFolder, "read_many", counting)
    with pytest.raises(data.DataError, match=r"^gs://tok/big/train.bin \(token 7\) holds token id 50300, outside "
                                             r"the model's vocabulary of 50257 \(nanoGPT layout\)"):
        data.check_vocab(root, 50257)
    assert 0 < sum(read) <= 2 * (data.VOCAB_SAMPLE_TOKENS + 4096) * 2  # bytes: a sample per split, not 8 MB
    data.check_vocab(root, 50301)  # a model with a bigger vocabulary takes it
    loader = data.BatchLoader(root, "train", 1024, 8, seed=0, vocab_size=50301)  # passes the sample...
    train[n // 2 + 3] = 50400  # ...an id between the sampled chunks is caught by the batch that reads it
    (big / "train.bin").unlink()
    train.tofile(big / "train.bin")
    upload(big, "gs://tok/big")
    step = next(s for s in range(10000) if (n // 2 + 3) // 1024 in set(loader.window_ids(s).tolist()))
    with pytest.raises(data.DataError, match=r"^gs://tok/big/train.bin \(token 2097155\) holds token id 50400, outside the model's vocabulary of 50301"):
        loader.local_batch(step)

    layouts = write_layouts(tmp_path / "l", _stream(3000, 5), _stream(1200, 6))
    read.clear()
    f3 = upload(layouts["format3"], "gs://tok/f3")
    with pytest.raises(data.DataError, match=r"^--data gs://tok/f3: meta.json records token id \d+, outside the "
                                             r"model's vocabulary of 50000"):
        data.check_vocab(f3, 50000)
    # meta.json and the first shard's header of each split: not one token
    assert sum(read) == (layouts["format3"] / "meta.json").stat().st_size + 2 * shards.HEADER_BYTES


def test_bad_token_folders_are_one_line(tmp_path):
    train, val = _stream(3001, 7), _stream(1000, 8)
    layouts = write_layouts(tmp_path, train, val)
    cases = []
    odd = layouts["nanogpt"]
    with open(odd / "val.bin", "ab") as f:
        f.write(b"\0")
    cases.append((odd, rf"^{odd}/val.bin has 2001 bytes, an odd number: it is not a file of uint16 tokens"))
    bad = layouts["llmc"] / "fineweb_val_000001.bin"
    bad.write_bytes(b"\x01" * 4096)
    cases.append((layouts["llmc"], rf"^{bad}: not a token shard \(header starts 16843009, 16843009; expected "
                                   r"the magic 20240520"))
    gone = layouts["format3"] / shards.shard_name("train", 1)
    gone.unlink()
    cases.append((layouts["format3"], rf"^{gone}: listed in meta.json but not there"))
    cut = layouts["format2"] / "train.bin"
    os.truncate(cut, 3000)
    (layouts["format2"] / "train.bin").rename(layouts["format2"] / "x.bin")
    cases.append((layouts["format2"], r"no train.bin \(format 2 layout"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    for root, message in cases:
        tf.detect.cache_clear()
        with pytest.raises(data.DataError, match=message):
            data.BatchLoader(str(root), "train", SEQ, BATCH, 0)
    tf.detect.cache_clear()
    with pytest.raises(data.DataError, match=r"no token files there \(looked for meta.json, train.bin \+ val.bin, "
                                             r"or llm.c's \*train\*.bin / \*val\*.bin shards; it holds notes.txt\)"):
        tf.detect(str(empty))
