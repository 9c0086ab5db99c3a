"""`--data` -> global batches that do not depend on how many hosts load them.

`resolve` turns `--data` into a token folder: one of the layouts of trainer/pretrain/token_files.py, local or
gs:// (read in place, never copied), else text that `prepare` tokenises once into the cache.
`BatchLoader` derives the global batch of step s from (seed, s) alone; process p reads its contiguous share.
That is what makes 1 process x 8 devices and 2 processes x 4 devices train on the same examples in the same
order (grain's per-process sharding of the whole dataset would not).
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from trainer.pretrain import token_files as tf
from trainer.pretrain.prepare import DEFAULT_VAL_FRACTION, cache_key, prepare
from trainer.pretrain.shards import META, DataError  # noqa: F401  (DataError: the loader's error, re-exported)

# A folder without meta.json (nanoGPT, llm.c) says nothing about its largest token id: before step 1 the loader
# reads this many tokens per split, spread over it in VOCAB_SAMPLE_CHUNKS pieces, and then checks every batch
# as it reads it. Bounded whatever the dataset's size.
VOCAB_SAMPLE_TOKENS = 1 << 20
VOCAB_SAMPLE_CHUNKS = 64
EXIT_STORAGE = 3  # as the checkpointer's (docs/CONTRACTS.md): a bucket that stopped answering


def cache_root() -> Path:
    return Path(os.environ.get("TPUCTL_CACHE", Path.home() / ".cache" / "tpuctl")) / "tokens"


def resolve(data: str | None, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
    """`--data` -> a token folder (local or gs://).

    gs:// and local token folders are used as they are; raw text files/dirs (or None, the default corpus) are
    tokenised once, cached by content hash.
    """
    if data and data.startswith("gs://"):
        tf.detect(data.rstrip("/"))  # its layout, now: a bad folder is one line before anything compiles
        return data.rstrip("/")
    if data and tf.looks_like_tokens(data):
        return data
    local = cache_root() / cache_key([data] if data else None, val_fraction)
    if not (local / META).exists():  # prepared aside and renamed: processes resolving at once never share a folder
        tmp = Path(tempfile.mkdtemp(prefix=".prep.", dir=_mkdir(cache_root())))
        try:
            # Into this host's own cache, whole: under tpuctl every host resolves the same text itself, so the
            # split of the work over hosts (TPUCTL_PROCESS_ID) that `prepare` does on a slice must not apply.
            prepare([data] if data else None, str(tmp), val_fraction=val_fraction, progress=False,
                    process_index=0, process_count=1)
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


def check_vocab(data_dir: str, vocab_size: int) -> None:
    """Refuse token ids the model has no embedding for, before step 1 and without reading the dataset: from
    meta.json where it says (format 3's max_token_id, format 2's tokenizer vocabulary), else from a bounded
    sample of each split (format 2's meta.json has no max_token_id; the batches are checked as they are read)."""
    lay = tf.detect(data_dir)
    fix = f"the data was made with another tokenizer, or --vocab-size {vocab_size} is too small"
    if lay.max_token_id is not None:
        if lay.max_token_id >= vocab_size:
            raise DataError(f"--data {data_dir}: {META} records token id {lay.max_token_id}, outside the model's "
                            f"vocabulary of {vocab_size}: {fix}")
        return
    if lay.vocab_size is not None and lay.vocab_size > vocab_size:
        raise DataError(f"--data {data_dir}: its tokenizer's vocabulary ({lay.vocab_size}, {META}) is larger "
                        f"than the model's ({vocab_size}): {fix}")
    for split in tf.SPLITS:
        r = tf.SplitReader(lay, split)
        if not r.n_tokens:
            continue
        chunk = max(1, min(r.n_tokens, VOCAB_SAMPLE_TOKENS) // VOCAB_SAMPLE_CHUNKS)
        starts = np.unique(np.linspace(0, r.n_tokens - chunk, VOCAB_SAMPLE_CHUNKS).astype(np.int64))
        sample = r.read(starts, chunk)
        if int(sample.max()) >= vocab_size:
            row, col = np.unravel_index(int(sample.argmax()), sample.shape)
            raise DataError(f"{r.where(int(starts[row]) + int(col))} holds token id {int(sample.max())}, outside "
                            f"the model's vocabulary of {vocab_size} ({lay.kind} layout): {fix}")


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
        self.reader = tf.SplitReader(tf.detect(data_dir), split)
        self.vocab_size = vocab_size
        if vocab_size is not None and split == "train":
            check_vocab(data_dir, vocab_size)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.local_size = global_batch // process_count
        self.offset = process_index * self.local_size
        self.n_tokens = self.reader.n_tokens
        self.n_windows = (self.n_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"the {split} split of {data_dir} has {self.n_tokens} tokens, fewer than one "
                            f"sequence of --seq-len {seq_len} + 1: use more text or a shorter --seq-len")
        self._split = split
        self._closed = False

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
        if self._closed:
            raise DataError("the loader was closed")
        starts = self.window_ids(step) * self.seq_len
        try:
            batch = self.reader.read(starts, self.seq_len + 1)
        except tf.StorageUnavailable as e:
            if self._closed:  # a read-ahead that outlived its reader's user: nobody waits for it
                raise
            stop_on_outage(str(e))
        if self.vocab_size is not None and int(batch.max()) >= self.vocab_size:
            row, col = np.unravel_index(int(batch.argmax()), batch.shape)
            raise DataError(f"{self.reader.where(int(starts[row]) + int(col))} holds token id {int(batch.max())}, "
                            f"outside the model's vocabulary of {self.vocab_size}: the data was made with another "
                            f"tokenizer, or --vocab-size {self.vocab_size} is too small")
        return batch.astype(np.int32)

    def close(self) -> None:
        """Stop reading: read-ahead threads still running fail quietly instead of stopping the process."""
        self._closed = True

    def iterate(self, start_step: int, prefetch: int = 4) -> Iterator[tuple[int, np.ndarray]]:
        """(step, local_batch) from start_step on, read ahead on background threads by grain."""
        import grain

        ds = grain.MapDataset.range(start_step, start_step + 10**12).map(lambda s: (s, self.local_batch(s)))
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=prefetch)))


def stop_on_outage(line: str) -> None:
    """The data's bucket stopped answering mid-run: one line, then exit at once (the read-ahead threads, Orbax's
    and jax.distributed's would otherwise keep the process waiting); the same command resumes from the latest
    checkpoint."""
    import os
    sys.stdout.flush()
    sys.stderr.write(f"error: {line}: stopping; the same command resumes from the latest complete checkpoint "
                     "once the bucket answers again\n")
    sys.stderr.flush()
    os._exit(EXIT_STORAGE)
