"""`prepare` on a web-shaped corpus (infra/webcorpus.py: parquet + jsonl.gz shards) against tiktoken's bare speed.

In one run, on the same text: tiktoken's `encode_ordinary` on one core with nothing else (the documents are
read first, untimed, a shard at a time), then `python -m trainer prepare` with --workers 1 and 2 (each a fresh
process tree, its peak memory summed over the tree by polling /proc through psutil), at two corpus sizes.
Read: tokens/s per core against bare (the cost of reading, hashing and writing), wall time against one core's
bare tokenise time (the target is at most 0.9x with every core), and the peak at both sizes (it must be flat).

    python -m bench.system.prepare [--mb 300 --small-mb 100] [--quick]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def corpus(mb: float, seed: int = 0) -> Path:
    """The corpus, made once and kept (it takes about as long to make as to tokenise)."""
    from infra import webcorpus
    from bench import test_cache
    cache = test_cache()
    shard_mb = max(0.5, mb / 12)  # a dozen files or more: work for every worker
    d = cache / f"webcorpus-{mb:g}mb-seed{seed}-shard{shard_mb:g}"
    done = d.with_name(d.name + ".done")  # beside it: a file inside would be read as input
    if not done.exists():
        webcorpus.write(d, mb, seed, shard_mb=shard_mb)
        done.write_text("")
    return d


def bare_tokenize(d: Path) -> tuple[int, int, float, float]:
    """(documents, tokens incl. one EOT each, wall and CPU seconds of encode_ordinary on one core)."""
    from trainer.pretrain import corpus as C
    from trainer.pretrain import tokenizers
    enc = tokenizers.get("gpt2")
    srcs = C.collect([str(d)])
    settings = C.Settings()
    docs = tokens = 0
    spent = cpu = 0.0
    for i, s in enumerate(srcs):
        texts = list(C.documents(s, C.Item(i), settings, C.Position(), []))
        t0, c0 = time.perf_counter(), time.process_time()
        for t in texts:
            tokens += len(enc.encode_ordinary(t)) + 1
        spent += time.perf_counter() - t0
        cpu += time.process_time() - c0
        docs += len(texts)
    return docs, tokens, spent, cpu


def run_prepare(d: Path, workers: int) -> tuple[float, float, float, dict]:
    """(wall s, CPU s of the whole tree, peak RSS of the whole process tree in bytes, meta) of one
    `python -m trainer prepare` (CPU: RUSAGE_CHILDREN counts every waited-for descendant, the workers too)."""
    import json
    import resource

    import psutil
    with tempfile.TemporaryDirectory(prefix="tpuctl-bench-prepare-") as out:
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "trainer", "prepare", "--data", str(d), "--out", out,
                              "--workers", str(workers)], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        root, peak = psutil.Process(p.pid), 0
        while p.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
                peak = max(peak, sum(q.memory_info().rss for q in procs if q.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        err = p.stderr.read()
        if p.returncode:
            raise RuntimeError(f"prepare failed ({p.returncode}): {err.strip().splitlines()[-1:]}")
        meta = json.loads((Path(out) / "meta.json").read_text())
    return wall, cpu, peak, meta


def main(argv=None, say=print) -> None:
    a = argparse.ArgumentParser(prog="python -m bench.system.prepare", description=__doc__.splitlines()[0])
    a.add_argument("--mb", type=float, default=300.0)
    a.add_argument("--small-mb", type=float, default=100.0)
    a.add_argument("--quick", action="store_true", help="8 and 4 MB: checks the bench runs")
    args = a.parse_args([] if argv is None else argv)
    big, small = (8.0, 4.0) if args.quick else (args.mb, args.small_mb)
    load = os.getloadavg()[0]
    say(f"[11] corpora: {big:g} MB and {small:g} MB of web-shaped documents (parquet + jsonl.gz); "
        f"{os.cpu_count()} cores, load average {load:.1f}")
    for mb in (small, big):
        d = corpus(mb)
        docs, tokens, bare_s, bare_cpu = bare_tokenize(d)
        say(f"[11] {mb:g} MB: {docs:,} documents, {tokens:,} tokens; bare tiktoken on one core: {bare_s:.1f} s "
            f"= {tokens / bare_s:,.0f} tokens/s ({bare_cpu:.1f} CPU s)")
        for w in (1, 2):
            wall, cpu, peak, meta = run_prepare(d, w)
            n = meta["n_train_tokens"] + meta["n_val_tokens"]
            ok = "== bare count" if n == tokens else f"!= bare count {tokens:,}"
            say(f"[11] {mb:g} MB prepare --workers {w}: {wall:.1f} s, {n / wall:,.0f} tokens/s "
                f"({n / wall / w / (tokens / bare_s):.2f}x bare per core), wall / bare one-core tokenise "
                f"{wall / bare_s:.2f}x; {cpu:.1f} CPU s over the tree ({cpu / bare_cpu:.2f}x bare's: reading, "
                f"hashing, writing, start-up); process-tree peak {peak / 2**20:,.0f} MiB; tokens {ok}")
    say(f"[11] load average at the end {os.getloadavg()[0]:.1f} (numbers on a shared machine are noisy)")


if __name__ == "__main__":
    main(sys.argv[1:])
