"""A web-shaped test corpus: what FineWeb / OpenWebText look like to `prepare`, made offline from a seed.

Documents of varied length (log-normal, a few hundred bytes to tens of KiB) built from English words drawn
with a Zipf-like law, in sentences and paragraphs, with numbers, punctuation and some non-ASCII text, so GPT-2
BPE sees the mix of merges it sees on the web (about 4-5 bytes per token). Written as Hugging Face-style
parquet shards (`id`, `url`, `text` columns, several row groups) plus jsonl.gz shards (`text` and a `meta`
object per line). The same seed and size give the same bytes, so tests and bench can count tokens against it.

    python -m infra.webcorpus OUT_DIR --mb 300        (bench's corpus; tests call write() at a few hundred KiB)
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

_COMMON = """the of and to a in is that for it as was with be by on not he I this are or his from at which but
have an they you were her she there been one all we their has would when if so no will more out up what about
into them can only other its time new some could these two may first then do any like my now over such our man
me even most made after also did many before must through back years where much your way well down should
because each just those people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old year off come since
against go came right used take three states himself few house use during without again place American around
however home small found thought went say part once general high upon school every don't does got united left
number course war until always away something fact though water less public put think almost hand enough far
took head yet government system better set told nothing night end why called didn't eyes find going look asked
later point knew city next program business give group toward young days let room president side social given
present several order national possible rather second face per among form important often things looked early
white case John become large big need four within felt along children saw best church ever least power
development light thing seemed family interest want members mind country area others done turned although open
problem Mr God service certain kind different thus began door help sense whole matter perhaps itself York times
human law line above name example action company local show whether five history gave today either act feet
across taken past quite anything seen having death experience body week half really field word information
market data model training energy research music story water policy health science language network""".split()
_SYLLABLES = ("ka ri to ne mo sa lu ve pa di fo ga ze ni ro ma li te ba su ko mi re da po fa ta ve lo ha "
              "shi tra ber con pro ment ing tion al er est ly ous ive ful less ness").split()
_UNICODE = ["café", "naïve", "Zürich", "São Paulo", "—", "“quoted”", "½", "Ω", "東京", "München", "piñata", "🙂"]
_DOMAINS = ["example.com", "news.example.org", "blog.example.net", "wiki.example.edu", "forum.example.io"]


def _vocabulary(rng: np.random.Generator, size: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Common words first (most frequent), then made-up words from syllables: a long tail, as on the web."""
    made = {"".join(rng.choice(_SYLLABLES, rng.integers(2, 5))) for _ in range(size * 2)}
    words = list(dict.fromkeys(_COMMON + sorted(made)))[:size]
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.05
    return np.array(words, dtype=object), p / p.sum()


def documents(seed: int, n_bytes: int):
    """Yield (id, url, text) until about n_bytes of text were made. Deterministic in (seed, n_bytes)."""
    rng = np.random.default_rng(seed)
    words, p = _vocabulary(rng)
    made = i = 0
    while made < n_bytes:
        n_words = int(np.clip(rng.lognormal(6.0, 1.0), 20, 12000))
        ids = rng.choice(len(words), size=n_words, p=p)
        toks = words[ids]
        # sentence ends, commas, numbers and the odd non-ASCII word, at fixed per-word rates
        r = rng.random(n_words)
        paragraphs, sentence, para = [], [], []
        for w, x in zip(toks.tolist(), r.tolist()):
            if x < 0.01:
                w = str(int(x * 1e6))
            elif x < 0.012:
                w = _UNICODE[int(x * 1e5) % len(_UNICODE)]
            sentence.append(w)
            if x > 0.93:
                sentence[-1] += ","
            elif x > 0.88 and len(sentence) > 4:
                s = " ".join(sentence)
                para.append(s[0].upper() + s[1:] + ("?" if x > 0.925 else "."))
                sentence = []
                if x > 0.915:
                    paragraphs.append(" ".join(para))
                    para = []
        if sentence:
            para.append(" ".join(sentence) + ".")
        if para:
            paragraphs.append(" ".join(para))
        text = "\n\n".join(paragraphs)
        url = f"https://{_DOMAINS[i % len(_DOMAINS)]}/{seed}/{i}"
        yield f"<urn:doc:{seed}:{i}>", url, text
        made += len(text.encode())
        i += 1


def write(out: str | Path, mb: float, seed: int = 0, parquet_share: float = 0.6,
          shard_mb: float = 32.0, row_group_rows: int = 1000) -> list[Path]:
    """Write about `mb` MB of documents into `out` as parquet shards (the first `parquet_share` of the bytes)
    then jsonl.gz shards, each about `shard_mb` MB of text. Returns the files written, in sorted order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    total = int(mb * 1e6)
    shard_bytes = max(1, int(shard_mb * 1e6))
    files: list[Path] = []
    batch: list[tuple[str, str, str]] = []
    size = done = 0

    def flush():
        nonlocal batch, size
        if not batch:
            return
        k = len(files)
        if done < parquet_share * total:
            path = out / f"train-{k:05d}.parquet"
            table = pa.table({"id": [b[0] for b in batch], "url": [b[1] for b in batch],
                              "text": [b[2] for b in batch]})
            pq.write_table(table, path, row_group_size=row_group_rows)
        else:
            path = out / f"web-{k:05d}.jsonl.gz"
            with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
                for doc_id, url, text in batch:
                    f.write(json.dumps({"text": text, "meta": {"id": doc_id, "url": url}}) + "\n")
        files.append(path)
        batch, size = [], 0

    for doc in documents(seed, total):
        batch.append(doc)
        n = len(doc[2].encode())
        size += n
        done += n
        if size >= shard_bytes:
            flush()
    flush()
    return sorted(files)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.webcorpus", description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mb", type=float, default=300.0, help="MB of document text (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=32.0)
    a = p.parse_args(argv)
    files = write(a.out, a.mb, a.seed, shard_mb=a.shard_mb)
    print(f"wrote {len(files)} shards ({sum(f.stat().st_size for f in files) / 1e6:.1f} MB on disk) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
