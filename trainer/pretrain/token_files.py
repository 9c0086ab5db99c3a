"""Where a split's tokens live and how windows of them are read in place: the folder layouts `--data` accepts,
local or on gs:// (docs/data.md).

- format 3 (`prepare`'s output): shards in llm.c's layout listed in meta.json, which also records the largest
  token id; a shard meta.json does not list does not exist here;
- format 2: `train.bin` / `val.bin` raw uint16 + a meta.json without "format": 3;
- nanoGPT: `train.bin` / `val.bin` raw uint16, no meta.json;
- llm.c: `*train*.bin` / `*val*.bin` shards with the 256-int32 header (magic 20240520), no meta.json (a lone
  `train.bin` / `val.bin` with that header too).

A split is the concatenation of its files' tokens in name order; a window may span two of them. Local files are
memory-mapped. On gs:// nothing is copied: each window is a byte-range read through TensorStore's GCS driver,
the windows of a batch issued together (one ts.Batch), so a host reads only the windows it trains on and holds
at most the batches in flight.
"""
from __future__ import annotations

import bisect
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.pretrain.shards import HEADER_BYTES, MAGIC, META, DataError, read_header

SPLITS = ("train", "val")
# A data read is a batch's windows: kilobytes to a few MiB. One that gets no answer for half the storage budget
# stops the run, so that noticing, saying so and exiting still fit in TPUCTL_STORAGE_TIMEOUT_S from the moment
# the bucket went away (the readers ahead of the step are always reading, so they notice first).
STORAGE_TIMEOUT_S = 60.0
# TensorStore retries a GCS request 32 times, up to 32 s apart, by default: a few short retries ride out a blip
# and leave a bucket that is gone to the deadline above (the checkpointer bounds its retries the same way).
GCS_RETRIES = {"max_retries": 5, "initial_delay": "0.5s", "max_delay": "8s"}
GCS_CONCURRENCY = 64  # range reads in flight per host


def storage_budget_s() -> float:
    return float(os.environ.get("TPUCTL_STORAGE_TIMEOUT_S") or STORAGE_TIMEOUT_S)


@dataclass(frozen=True)
class Segment:
    name: str      # file name inside the folder
    offset: int    # bytes before the first token (the llm.c header)
    tokens: int


@dataclass(frozen=True)
class Layout:
    root: str
    kind: str                          # "format 3", "format 2", "nanoGPT", "llm.c"
    splits: dict                       # split -> tuple[Segment, ...]
    max_token_id: int | None = None    # known without reading the tokens (format 3's meta.json)
    vocab_size: int | None = None      # of the tokenizer that made them (meta.json)


class StorageUnavailable(DataError):
    """The bucket holding the data did not answer (or failed) within the storage budget."""


# --- folders -----------------------------------------------------------------------------------------

class LocalFolder:
    def __init__(self, root: str):
        self.root = root.rstrip("/") or "/"

    def list(self) -> dict[str, int]:
        p = Path(self.root)
        if not p.is_dir():
            raise DataError(f"--data {self.root}: no such directory")
        return {e.name: e.stat().st_size for e in os.scandir(p) if e.is_file()}

    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        with open(Path(self.root) / name, "rb") as f:
            f.seek(start)
            return f.read(-1 if stop is None else stop - start)

    def read_many(self, reqs: list[tuple[str, int, int]], what: str) -> list[bytes]:
        return [self.read(*r) for r in reqs]

    @functools.lru_cache(maxsize=None)
    def memmap(self, name: str) -> np.ndarray:
        return np.memmap(Path(self.root) / name, dtype="<u2", mode="r")


class GcsFolder:
    """gs://BUCKET/PREFIX: listing through google-cloud-storage, reads through TensorStore's GCS kvstore (both
    follow the GCS emulator's variables, infra/gcs.py)."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self.bucket, _, self.prefix = self.root[5:].partition("/")
        self._kv = None

    @property
    def kv(self):
        if self._kv is None:
            import tensorstore as ts
            self._kv = ts.KvStore.open({
                "driver": "gcs", "bucket": self.bucket, "path": f"{self.prefix}/" if self.prefix else "",
                "context": {"gcs_request_retries": dict(GCS_RETRIES),
                            "gcs_request_concurrency": {"limit": GCS_CONCURRENCY}}}).result()
        return self._kv

    def list(self) -> dict[str, int]:
        from google.api_core import exceptions as gx
        from google.api_core.retry import Retry
        from google.cloud import storage
        budget = storage_budget_s() / 2
        prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            blobs = storage.Client().list_blobs(self.bucket, prefix=prefix, delimiter="/", timeout=budget / 4,
                                                retry=Retry(deadline=budget))
            return {b.name[len(prefix):]: int(b.size) for b in blobs}
        except gx.NotFound:
            raise DataError(f"--data {self.root}: bucket {self.bucket} does not exist") from None
        except gx.Forbidden:
            raise DataError(f"--data {self.root}: no read access to bucket {self.bucket}; grant this host's "
                            "service account storage.objects.list and storage.objects.get on it") from None
        except Exception as e:  # connection refused, timeouts: the bucket is not answering
            raise StorageUnavailable(self._outage(f"failed ({type(e).__name__})", "listing the data")) from None

    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        return self.read_many([(name, start, stop)], f"reading {name}")[0]

    def read_many(self, reqs: list[tuple[str, int, int | None]], what: str) -> list[bytes]:
        """Every range at once (one TensorStore batch); all within half the storage budget or none."""
        import tensorstore as ts
        budget = storage_budget_s() / 2
        deadline = time.monotonic() + budget
        kv = self.kv
        with ts.Batch() as batch:
            futs = [kv.read(name, byte_range=slice(start, stop), batch=batch) for name, start, stop in reqs]
        out = []
        for f, (name, start, stop) in zip(futs, reqs):
            try:
                r = f.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise StorageUnavailable(self._outage(f"did not answer for {budget:.0f} s "
                                                      "(TPUCTL_STORAGE_TIMEOUT_S sets the budget)", what)) from None
            except Exception as e:
                text = (str(e).strip().splitlines() or [""])[0][:160]
                raise StorageUnavailable(self._outage(f"failed ({text})", what)) from None
            if r.state != "value":
                raise DataError(f"{self.root}/{name}: missing (it was listed a moment ago): the data changed "
                                "under the run; point --data at a folder nothing rewrites")
            out.append(r.value)
        return out

    def _outage(self, why: str, what: str) -> str:
        return f"the bucket gs://{self.bucket} {why} while {what} from {self.root}"


def folder(root: str):
    return GcsFolder(root) if root.startswith("gs://") else LocalFolder(root)


# --- layouts -----------------------------------------------------------------------------------------

def looks_like_tokens(root: str) -> bool:
    """A local folder `--data` can train on as it is (else it is text for prepare)."""
    p = Path(root)
    return p.is_dir() and ((p / META).is_file() or (p / "train.bin").is_file()
                           or any(f.name.endswith(".bin") and "train" in f.name for f in p.iterdir()))


@functools.lru_cache(maxsize=8)
def detect(root: str) -> Layout:
    """The layout of the token folder `root` from its listing, meta.json and shard headers (never the tokens)."""
    f = folder(root)
    names = f.list()
    if META in names:
        meta = json.loads(f.read(META))
        if meta.get("format") == 3:
            return _format3(f, names, meta)
        splits = {s: (_raw(f, names, f"{s}.bin", "format 2"),) for s in SPLITS}
        return Layout(f.root, "format 2", splits, meta.get("max_token_id"), meta.get("vocab_size"))
    if "train.bin" in names:
        if names["train.bin"] >= HEADER_BYTES and np.frombuffer(f.read("train.bin", 0, 4), "<i4")[0] == MAGIC:
            return _llmc(f, names, {s: [f"{s}.bin"] for s in SPLITS})
        return Layout(f.root, "nanoGPT", {s: (_raw(f, names, f"{s}.bin", "nanoGPT"),) for s in SPLITS})
    shards = {s: sorted(n for n in names if n.endswith(".bin") and s in n) for s in SPLITS}
    if shards["train"]:
        return _llmc(f, names, shards)
    have = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
    raise DataError(f"--data {f.root}: no token files there (looked for meta.json, train.bin + val.bin, or "
                    f"llm.c's *train*.bin / *val*.bin shards; it holds {have}); make some with "
                    f"`python -m trainer prepare --data TEXT --out {f.root}`")


def _raw(f, names: dict, name: str, kind: str) -> Segment:
    if name not in names:
        raise DataError(f"--data {f.root}: no {name} ({kind} layout: train.bin and val.bin side by side)")
    size = names[name]
    if size % 2:
        raise DataError(f"{f.root}/{name} has {size} bytes, an odd number: it is not a file of uint16 tokens "
                        "(truncated, or not tokens at all); fetch or prepare the data again")
    return Segment(name, 0, size // 2)


def _format3(f, names: dict, meta: dict) -> Layout:
    splits = {}
    for split in SPLITS:
        segs = []
        for e in meta.get(split, []):
            name, n = e["file"], int(e["tokens"])
            if name not in names:
                raise DataError(f"{f.root}/{name}: listed in {META} but not there; copy the whole prepared folder "
                                "or prepare it again")
            if names[name] != HEADER_BYTES + 2 * n:
                raise DataError(f"{f.root}/{name}: {names[name]} bytes, but {META} lists {n} tokens "
                                f"({HEADER_BYTES + 2 * n} bytes): truncated or replaced; prepare it again")
            segs.append(Segment(name, HEADER_BYTES, n))
        splits[split] = tuple(segs)
    firsts = [segs[0].name for segs in splits.values() if segs]
    for name, raw in zip(firsts, f.read_many([(n, 0, HEADER_BYTES) for n in firsts], "reading shard headers")):
        read_header(raw, f"{f.root}/{name}")
    return Layout(f.root, "format 3", splits, meta.get("max_token_id"), meta.get("vocab_size"))


def _llmc(f, names: dict, shards: dict) -> Layout:
    if not shards.get("val"):
        raise DataError(f"--data {f.root}: train shards but no *val*.bin shard (llm.c layout); add one")
    flat = [n for s in SPLITS for n in shards[s]]
    heads = f.read_many([(n, 0, HEADER_BYTES) for n in flat], "reading shard headers")
    count = {}
    for name, raw in zip(flat, heads):
        n = read_header(raw, f"{f.root}/{name}")
        if names[name] != HEADER_BYTES + 2 * n:
            raise DataError(f"{f.root}/{name}: {names[name]} bytes, but its header says {n} tokens "
                            f"({HEADER_BYTES + 2 * n} bytes): truncated; fetch it again")
        count[name] = n
    return Layout(f.root, "llm.c", {s: tuple(Segment(n, HEADER_BYTES, count[n]) for n in shards[s]) for s in SPLITS})


# --- reading windows ---------------------------------------------------------------------------------

class SplitReader:
    """The token stream of one split: read(starts, length) -> uint16 [len(starts), length]."""

    def __init__(self, layout: Layout, split: str):
        self.layout, self.split = layout, split
        self.folder = folder(layout.root)
        self.segments = layout.splits[split]
        self.cum = np.cumsum([0] + [s.tokens for s in self.segments]).tolist()
        self.n_tokens = self.cum[-1]

    def where(self, pos: int) -> str:
        i = bisect.bisect_right(self.cum, pos) - 1
        return f"{self.layout.root}/{self.segments[i].name} (token {pos - self.cum[i]})"

    def _pieces(self, starts, length: int):
        """(row, column, segment, first token in it, count) covering each window."""
        cum = self.cum
        for r, a in enumerate(int(x) for x in starts):
            b, col = a + length, 0
            s = bisect.bisect_right(cum, a) - 1
            while a < b:
                n = min(b, cum[s + 1]) - a
                yield r, col, s, a - cum[s], n
                col, a, s = col + n, a + n, s + 1

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        out = np.empty((len(starts), length), "<u2")
        pieces = list(self._pieces(starts, length))
        if isinstance(self.folder, LocalFolder):
            maps = [self.folder.memmap(s.name)[s.offset // 2:] for s in self.segments]
            if len(maps) == 1:  # one file: one gather
                idx = np.asarray(starts, np.int64)[:, None] + np.arange(length)[None, :]
                return np.asarray(maps[0][idx])
            for r, c, s, x, n in pieces:
                out[r, c:c + n] = maps[s][x:x + n]
            return out
        segs = self.segments
        blobs = self.folder.read_many([(segs[s].name, segs[s].offset + 2 * x, segs[s].offset + 2 * (x + n))
                                       for _, _, s, x, n in pieces], f"reading {self.split} windows")
        for (r, c, _, _, n), raw in zip(pieces, blobs):
            out[r, c:c + n] = np.frombuffer(raw, "<u2")
        return out
