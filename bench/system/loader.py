"""Bench [12]: the pretraining loader's tokens/s from gs:// (the GCS emulator, TensorStore range reads of the
windows of each batch) beside the same data read from a local file (memory-mapped), measured in the same run.

The trainer's path: BatchLoader.iterate (grain's read-ahead threads) over a nanoGPT-layout train.bin, windows of
1025 tokens. The target is 2M tokens/s per host, more than a v6e-8 host trains GPT-2 124M at (about 1.5M).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

TARGET = 2_000_000


def _rate(loader, steps: int) -> float:
    it = loader.iterate(0)
    try:
        next(it)  # the read-ahead threads start
        t = time.perf_counter()
        for _ in range(steps):
            _, batch = next(it)
        return steps * batch.size / (time.perf_counter() - t)
    finally:
        loader.close()  # a read-ahead that outlives the emulator must not stop this process
        it.close()


def main(say=print, quick: bool = False) -> None:
    from infra import gcs
    from trainer.pretrain import data, token_files

    n_tokens = (2 << 20) if quick else (32 << 20)
    seq, batch, steps = 1024, 64 if quick else 128, 5 if quick else 40
    with tempfile.TemporaryDirectory(prefix="tpuctl-bench-loader-") as tmp:
        local = Path(tmp) / "owt"
        local.mkdir()
        rng = np.random.default_rng(0)
        rng.integers(0, 50257, n_tokens, dtype=np.uint16).tofile(local / "train.bin")
        rng.integers(0, 50257, 1 << 16, dtype=np.uint16).tofile(local / "val.bin")
        emu = gcs.start(home=Path(tmp) / "home", buckets=("bench-data",), record=False, reuse=False)
        saved = {k: os.environ.get(k) for k in emu.env}
        os.environ.update(emu.env)
        try:
            from google.cloud import storage
            b = storage.Client().bucket("bench-data")
            for name in ("train.bin", "val.bin"):
                b.blob(f"owt/{name}").upload_from_filename(str(local / name))
            rates = {}
            for where in (str(local), "gs://bench-data/owt"):
                loader = data.BatchLoader(where, "train", seq, batch, seed=0, vocab_size=50257)
                rates[where] = _rate(loader, steps)
            token_files.detect.cache_clear()
        finally:
            emu.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    gs, mm = rates["gs://bench-data/owt"], rates[str(local)]
    say(f"[12] loader, {n_tokens / 2**20:.0f}M-token train.bin, batches of {batch} x {seq + 1} tokens, {steps} "
        f"steps: gs:// (GCS emulator, range reads) {gs:,.0f} tokens/s, local memmap {mm:,.0f} tokens/s")
    say(f"[12] ratio gs/local: {gs / mm:.2f}x; gs:// against the 2M tokens/s a host needs: {gs / TARGET:.2f}x"
        + ("  (--quick: sizes too small to mean anything)" if quick else ""))
