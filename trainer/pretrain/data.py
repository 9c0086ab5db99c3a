"""Text -> GPT-2 tokens on disk -> global batches that do not depend on how many hosts load them.

`prepare` (trainer/pretrain/prepare.py) tokenises a corpus once into token shards + `meta.json` (format 3);
format 2's `train.bin` / `val.bin` (raw uint16) are still read.
`BatchLoader` derives the global batch of step s from (seed, s) alone; process p reads its contiguous share.
That is what makes 1 process x 8 devices and 2 processes x 4 devices train on the same examples in the same
order (grain's per-process sharding of the whole dataset would not).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from trainer.pretrain.prepare import DEFAULT_VAL_FRACTION, cache_key, prepare
from trainer.pretrain.shards import META, DataError, read_shard


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
            names = [s["file"] for split in ("train", "val") for s in meta[split]] if meta.get("format") == 3 \
                else ["train.bin", "val.bin"]
            for name in (*names, META):
                (tmp / name).write_bytes((root / name).read_bytes())
            _replace_dir(tmp, local)
        return str(local)
    if data and (Path(data) / META).is_file():
        return data
    local = cache_root() / cache_key([data] if data else None, val_fraction)
    if not (local / META).exists():  # prepared aside and renamed: processes resolving at once never share a folder
        tmp = Path(tempfile.mkdtemp(prefix=".prep.", dir=_mkdir(cache_root())))
        try:
            prepare([data] if data else None, str(tmp), val_fraction=val_fraction, progress=False)
            _replace_dir(tmp, local)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
        meta_path = Path(data_dir) / META
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if meta.get("format") == 3:  # token shards: read as one stream (the loader's streaming reader replaces this)
            parts = [read_shard(Path(data_dir) / s["file"]) for s in meta[split]]
            self.tokens = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.uint16)
            path = Path(data_dir) / (meta[split][0]["file"] if meta[split] else f"{split}_000000.bin")
        elif not path.is_file():
            raise DataError(f"--data {data_dir}: no {split}.bin; prepare it with `python -m trainer prepare`")
        else:
            size = path.stat().st_size
            if size % 2:
                raise DataError(f"{path} has {size} bytes, an odd number: it is not a file of uint16 tokens "
                                "(truncated or not made by `python -m trainer prepare`); prepare the data again")
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
