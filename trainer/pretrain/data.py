"""Text -> GPT-2 tokens on disk -> global batches that do not depend on how many hosts load them.

`prepare` tokenises a corpus once into `train.bin` / `val.bin` (uint16) + `meta.json`, locally or on gs://.
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

from trainer.pretrain.prepare import DEFAULT_VAL_FRACTION, _collect, _content_hash, prepare
from trainer.pretrain.shards import META, DataError


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
