"""The prepared-data format both `prepare` (writer) and the loader (reader) rely on: a folder of token shards in
llm.c's layout (a 256-int32 header: magic, version, token count; then uint16 tokens) listed in meta.json, which is
written last (a shard that meta.json does not list does not exist for the loader)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

META = "meta.json"
MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4


class DataError(ValueError):
    """Bad corpus or data dir. The message is the one-line error the user sees."""


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def header(n_tokens: int) -> bytes:
    h = np.zeros(HEADER_INTS, "<i4")
    h[:3] = (MAGIC, VERSION, n_tokens)
    return h.tobytes()


def read_header(raw: bytes, where: str) -> int:
    """The token count of a shard whose first HEADER_BYTES are `raw`; a bad header names `where`."""
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{where}: {len(raw)} bytes, shorter than a token shard's {HEADER_BYTES}-byte header")
    h = np.frombuffer(raw[:HEADER_BYTES], "<i4")
    if h[0] != MAGIC or h[1] != VERSION:
        raise DataError(f"{where}: not a token shard (header starts {int(h[0])}, {int(h[1])}; expected the magic "
                        f"{MAGIC} and version {VERSION})")
    return int(h[2])


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """One shard, written under a temporary name and renamed: a shard on disk is always whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(header(int(tokens.size)))
        f.write(np.ascontiguousarray(tokens, "<u2").tobytes())
    tmp.replace(path)


def read_shard(path: Path) -> np.ndarray:
    """A shard's tokens (memory-mapped: nothing is read until used)."""
    with open(path, "rb") as f:
        n = read_header(f.read(HEADER_BYTES), str(path))
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,)) if n else np.zeros(0, "<u2")
