"""trainer.pretrain.prepare: a web-shaped corpus (parquet + jsonl.gz + jsonl.zst) into fixed-size shards.

Counts checked against tiktoken run directly over the documents (read here with pyarrow/gzip, not through
prepare's readers); shards byte-identical for 1 and 2 workers, after a SIGKILL a third of the way and a rerun,
and when two "hosts" share the pieces through gs:// (the GCS emulator).
"""
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from infra import webcorpus
from trainer.pretrain import corpus as corpus_mod
from trainer.pretrain import prepare as P
from trainer.pretrain import tokenizers

ROOT = Path(__file__).resolve().parents[1]
SHARD = 60_000  # small shards, so a few hundred thousand tokens make several of them per split


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("web")
    webcorpus.write(d, mb=2.4, seed=7, shard_mb=0.2, row_group_rows=40)
    # one shard as .jsonl.zst too (FineWeb's other layout), under a subfolder: folders mix formats
    import zstandard
    gz = sorted(d.glob("*.jsonl.gz"))[-1]
    (d / "more").mkdir()
    (d / "more" / "extra.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(gzip.decompress(gz.read_bytes())))
    return d


def _independent_count(d: Path) -> tuple[int, int]:
    """(documents, sum of GPT-2 tokens + 1) over every document, read without prepare's code."""
    import pyarrow.parquet as pq
    import zstandard
    enc = tokenizers.get("gpt2")
    texts = []
    for f in sorted(d.rglob("*")):
        if f.name.endswith(".parquet"):
            texts += pq.read_table(f, columns=["text"]).column("text").to_pylist()
        elif f.name.endswith(".jsonl.gz"):
            texts += [json.loads(line)["text"] for line in gzip.open(f, "rt")]
        elif f.name.endswith(".jsonl.zst"):
            raw = zstandard.ZstdDecompressor().stream_reader(f.open("rb")).read()
            texts += [json.loads(line)["text"] for line in raw.decode().splitlines()]
    return len(texts), sum(len(enc.encode_ordinary(t)) + 1 for t in texts)


def _shards(out: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(out.glob("*.bin"))}


def _stream(out: Path, meta: dict, split: str) -> np.ndarray:
    parts = []
    for s in meta[split]:
        raw = (out / s["file"]).read_bytes()
        header = np.frombuffer(raw[:1024], "<i4")
        assert (header[0], header[1], header[2]) == (20240520, 1, s["tokens"])
        parts.append(np.frombuffer(raw[1024:], "<u2"))
        assert parts[-1].size == s["tokens"]
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One uninterrupted prepare with 2 workers: the output the other runs must equal byte for byte."""
    out = tmp_path_factory.mktemp("ref") / "tok"
    meta = P.prepare([str(corpus)], str(out), val_fraction=0.1, workers=2, shard_tokens=SHARD, progress=False)
    return out, meta


def test_counts_split_and_shards_match_an_independent_count(corpus, reference):
    out, meta = reference
    n_docs, n_tokens = _independent_count(corpus)
    assert meta["n_documents"] == n_docs
    assert meta["n_train_tokens"] + meta["n_val_tokens"] == n_tokens
    assert 0.06 < meta["n_val_tokens"] / n_tokens < 0.14, meta  # a whole document per hash draw, ~500 draws
    assert json.loads((out / "meta.json").read_text()) == meta
    assert not (out / "_pieces").exists() and not (out / "prepare.json").exists()
    for split in ("train", "val"):
        sizes = [s["tokens"] for s in meta[split]]
        assert all(n == SHARD for n in sizes[:-1]) and 0 < sizes[-1] <= SHARD, sizes
        stream = _stream(out, meta, split)
        assert stream.size == meta[f"n_{split}_tokens"] and stream[-1] == 50256
    assert len(meta["train"]) >= 4
    both = np.concatenate([_stream(out, meta, "train"), _stream(out, meta, "val")])
    assert (both == 50256).sum() == n_docs  # one EOT per document, none lost at shard cuts
    assert meta["max_token_id"] == int(both.max())
    assert (meta["format"], meta["tokenizer"], meta["eot"], meta["vocab_size"]) == (3, "gpt2-r50k", 50256, 50257)


def test_one_worker_and_other_piece_cuts_write_the_same_bytes(corpus, reference, tmp_path, monkeypatch):
    out, meta = reference
    whole_files = len(P.plan(P.collect([str(corpus)])))
    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 60_000)  # parquet files cut at row groups into several pieces each
    assert len(P.plan(P.collect([str(corpus)]))) > whole_files + 5
    one = P.prepare([str(corpus)], str(tmp_path / "w1"), val_fraction=0.1, workers=1, shard_tokens=SHARD,
                    progress=False)
    assert one == meta and _shards(tmp_path / "w1") == _shards(out)


def test_sigkill_a_third_of_the_way_then_rerun_is_byte_identical(corpus, reference, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "tok"
    cmd = [sys.executable, "-m", "trainer", "prepare", "--data", str(corpus), "--out", str(out),
           "--val-fraction", "0.1", "--workers", "2", "--shard-tokens", str(SHARD)]
    n_pieces = len(P.plan(P.collect([str(corpus)])))
    p = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if len(list((out / "_pieces").glob("*.json"))) >= n_pieces // 3:
            break
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)  # the parent and its workers, mid-write
    p.wait()
    done = len(list((out / "_pieces").glob("*.json")))
    assert not (out / "meta.json").exists() and 0 < done < n_pieces, (done, n_pieces)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr and "ETA" in r.stderr  # the progress line
    assert _shards(out) == _shards(ref_out)
    assert sorted(os.listdir(out)) == sorted(os.listdir(ref_out))  # no leftover pieces or temp files


def test_an_output_folder_of_another_prepare_is_refused(corpus, reference, tmp_path):
    out, _ = reference
    with pytest.raises(P.DataError, match=r"holds another prepare's output .* pick an empty folder"):
        P.prepare([str(corpus)], str(out), val_fraction=0.2, workers=1, shard_tokens=SHARD, progress=False)


def test_bad_input_is_named_with_its_file_and_line_and_skipped_on_request(tmp_path):
    good = [json.dumps({"text": t}) for _, _, t in webcorpus.documents(seed=1, n_bytes=400_000)]
    body = gzip.compress(("\n".join(good) + "\n").encode())
    import zstandard
    zstd = zstandard.ZstdCompressor().compress(("\n".join(good) + "\n").encode())
    cases = {  # file -> (bytes, the error it gets)
        "a.jsonl.gz": (body[: len(body) // 2], r"a\.jsonl\.gz: line \d+: corrupt compressed data"),
        "b.jsonl": ((json.dumps({"content": "x", "url": "u"}) + "\n" + good[0] + "\n").encode(),
                    r"b\.jsonl: line 1: the record has no string field 'text' \(it has: content, url\); "
                    r"name the text with --text-field"),
        "c.parquet": (b"PAR1" + b"\0" * 100 + b"not a footer", r"c\.parquet: not a readable parquet file"),
        "d.jsonl.zst": (zstd[: len(zstd) // 2], r"d\.jsonl\.zst: line \d+: corrupt compressed data"),
    }
    both = tmp_path / "all"
    both.mkdir()
    for name, (data, error) in cases.items():
        d = tmp_path / name.split(".")[0]
        d.mkdir()
        (d / name).write_bytes(data)
        (both / name).write_bytes(data)
        out = tmp_path / f"out-{name}"
        with pytest.raises(P.DataError, match=error + r".*\(--on-error skip leaves it out and goes on\)$"):
            P.prepare([str(d)], str(out), workers=1, progress=False)
        assert not out.exists()  # nothing half-written stays behind
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": [1], "content": ["x"]}), tmp_path / "c" / "other.parquet")
    (tmp_path / "c" / "c.parquet").unlink()
    with pytest.raises(P.DataError, match=r"other\.parquet: no column 'text' \(it has: id, content\); name the "
                                          r"text column with --text-field"):
        P.prepare([str(tmp_path / "c")], str(tmp_path / "o"), workers=1, progress=False, on_error="skip")
    meta = P.prepare([str(both)], str(tmp_path / "skip"), workers=1, progress=False, on_error="skip")
    cuts = [int(next(m for m in meta["skipped"] if f"{f}: line" in m).split("line ")[1].split(":")[0])
            for f in ("a.jsonl.gz", "d.jsonl.zst")]
    assert all(1 < cut < len(good) for cut in cuts)  # the lines before a cut are kept
    assert meta["n_skipped"] == 4 and meta["n_documents"] == sum(cut - 1 for cut in cuts) + 1, meta  # + b's good one


def test_text_files_by_glob_with_the_bytes_tokenizer_are_cut_into_documents_at_blank_lines(tmp_path):
    d = tmp_path / "books"
    d.mkdir()
    rng = np.random.default_rng(0)
    paras = ["\n".join(" ".join(rng.choice(["tea", "café", "moon"], 20)) for _ in range(3)) for _ in range(900)]
    (d / "big.txt").write_text("\n\n".join(paras))  # ~280 KB: 16 KiB blocks, a document each
    (d / "small.md").write_text("a short note\n")
    (d / "skip.log").write_text("not matched by the glob")
    meta = P.prepare([str(d / "*.[tm]*")], str(tmp_path / "tok"), tokenizer="bytes", val_fraction=0.3,
                     workers=1, progress=False)
    train, val = (_stream(tmp_path / "tok", meta, split) for split in ("train", "val"))
    assert (meta["tokenizer"], meta["eot"], meta["vocab_size"], meta["n_files"]) == ("bytes", 256, 257, 2)
    raw = (d / "big.txt").read_bytes() + (d / "small.md").read_bytes()
    assert meta["n_train_tokens"] + meta["n_val_tokens"] == len(raw) + meta["n_documents"]
    docs = [bytes(x[:-1].tolist()) for part in (train, val) for x in np.split(part, np.flatnonzero(part == 256) + 1)
            if x.size]
    big = (d / "big.txt").read_bytes()
    assert meta["n_documents"] == len(docs) == -(-len(big) // 16384) + 1 and val.size > 0  # a document per block
    # whole pieces of the input, cut after a blank line, together all of it
    assert sum(map(len, docs)) == len(raw) and all(doc in raw for doc in docs)
    cut = [doc for doc in docs if doc != b"a short note\n" and not big.endswith(doc)]
    assert len(cut) == len(docs) - 2 and all(doc.endswith(b"\n\n") and len(doc) < 2 * 16384 for doc in cut)


def test_two_hosts_share_the_pieces_through_gcs(corpus, reference, tmp_path, monkeypatch):
    from infra import gcs
    emu = gcs.start(home=tmp_path / "gcs-home", buckets=("data",), record=False, reuse=False)
    try:
        for k, v in emu.env.items():
            monkeypatch.setenv(k, v)
        import gcsfs
        fs = gcsfs.GCSFileSystem()
        fs.put(str(corpus), "data/raw", recursive=True)
        kw = dict(val_fraction=0.1, workers=1, shard_tokens=SHARD, progress=False, process_count=2)
        assert P.prepare(["gs://data/raw"], "gs://data/tok", process_index=1, **kw) is None  # host 1: its pieces
        meta = P.prepare(["gs://data/raw"], "gs://data/tok", process_index=0, wait_poll_s=0.1, **kw)
        ref_out, ref_meta = reference
        assert {k: v for k, v in meta.items() if k != "sources"} == \
            {k: v for k, v in ref_meta.items() if k != "sources"}
        for name, data in _shards(ref_out).items():
            assert fs.cat(f"data/tok/{name}") == data
        fs.invalidate_cache()
        assert fs.ls("data/tok", detail=False) == sorted(f"data/tok/{n}" for n in [*_shards(ref_out), "meta.json"])
    finally:
        emu.stop()
