"""The benchmark's sections, in one run on one machine (imported after XLA_FLAGS is set). The seed-vs-ours
contenders each run in a bench.peers.worker process (the host-allocator setting is process-wide); the rest here.

Measured configs are alternated step by step (A B, then B A, ...) so that load from other processes hits
each alike; every figure is a median over timed steps after warm-up, and the comparisons are ratios. Two
clocks: wall time (what a user waits) and the measured process's CPU time (user+system over all its threads),
which load from other processes moves much less, so its ratios are the steadier ones on a shared machine.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import numpy as np

from bench.ours import OursTrainer, config
from trainer.common.config import Config
from bench.peers.peak import MatmulPeak, median, model_flops_per_token

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plan:
    """Sizes of one bench run (`--quick` shrinks every one of them)."""
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    seq_len: int = 256
    batch: int = 16
    rounds: int = 6
    per_round: int = 1
    ckpt_every: int = 5
    ckpt_rounds: int = 3
    m124_batch: int = 8
    m124_seq: int = 128
    m124_steps: int = 2
    m124_mesh: str = "data=2,model=4"
    tiny_seq: int = 0  # 0 = the preset's
    tiny_batch: int = 0
    maxtext: str | None = None  # MaxText's records for [15] (None: bench/compiler/side_by_side.py's default)
    do_124m: bool = True
    vocab: int = 50257
    quick: bool = False


# Smoke-test sizes (a small vocab too: the 50k output matmul is most of a step). Its numbers mean nothing.
QUICK = Plan(n_layer=1, d_model=32, n_head=2, seq_len=16, batch=8, rounds=1, per_round=1, ckpt_every=2,
             ckpt_rounds=1, do_124m=False, vocab=512, quick=True)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def tokens(rng: np.random.Generator, batch: int, seq_len: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, (batch, seq_len + 1), dtype=np.int32)


def ours_config(p: Plan, ckpt_dir: str, **train) -> Config:
    """Our trainer on the plan's model (the seed's config by default): mesh 8x1, f32, dropout 0.1."""
    return config("gpt2-tiny", ckpt_dir, model=dict(
        n_layer=p.n_layer, d_model=p.d_model, n_head=p.n_head, seq_len=p.seq_len, dropout=0.1, vocab_size=p.vocab),
        train=dict(batch_size=p.batch, mesh="data=8,model=1", dtype="float32", keep=2, **train))


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Timings:
    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    rounds: int
    per_round: int

    def round_ratio(self, a: str, b: str, clock: str = "wall") -> list[float]:
        """Per round: median time of a / median time of b (the two ran back to back)."""
        t = getattr(self, clock)
        k = self.per_round
        return [median(t[a][r * k:(r + 1) * k]) / median(t[b][r * k:(r + 1) * k]) for r in range(self.rounds)]


def alternate(runners: dict, rounds: int, per_round: int, on_round=None) -> Timings:
    """Run each runner `per_round` timed times per round, the order reversed every other round. A runner
    that measures itself (a bench.peers.worker process) returns (wall, cpu); otherwise this process's clocks count."""
    names = list(runners)
    out = Timings({n: [] for n in names}, {n: [] for n in names}, rounds, per_round)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for _ in range(per_round):
                c0, t0 = cpu_s(), time.perf_counter()
                own = runners[name]()
                wall, cpu = own if own is not None else (time.perf_counter() - t0, cpu_s() - c0)
                out.wall[name].append(wall)
                out.cpu[name].append(cpu)
        if on_round:
            on_round()
    return out


class Contender:
    """A `python -m bench.peers.worker KIND` process (its own allocator setting); `step()` -> (wall, cpu)."""

    def __init__(self, kind: str, plan: Plan):
        self.kind = kind
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.peers.worker", kind, json.dumps(asdict(plan))],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True)

    def ready(self) -> dict:
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.err.seek(0)
            raise RuntimeError(f"bench worker {self.kind} failed:\n{self.err.read()[-3000:]}")
        return json.loads(line)

    def step(self) -> tuple[float, float]:
        try:
            self.proc.stdin.write("step\n")
            self.proc.stdin.flush()
            wall, cpu = self.proc.stdout.readline().split()
        except (BrokenPipeError, ValueError):  # the worker is gone
            rc = self.proc.wait()
            self.err.seek(0)
            raise RuntimeError(f"bench worker {self.kind} exited with {rc}"
                               + (" (killed: out of memory?)" if rc == -9 else "")
                               + f"\n{self.err.read()[-3000:]}") from None
        return float(wall), float(cpu)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.err.close()


def gflops(x: float) -> str:
    return f"{x / 1e9:,.1f} GFLOP/s"


def fmt_times(ts: list[float]) -> str:
    return "[" + " ".join(f"{t:.2f}" for t in ts) + "]"


def section_seed_vs_ours(plan: Plan) -> dict:
    p = plan
    cfg_txt = f"L{p.n_layer} D{p.d_model} H{p.n_head} T{p.seq_len} B{p.batch} vocab {p.vocab}, mesh 8x1, f32"
    say(f"== [1-3] seed (bench/seed_gpt2.py) vs ours, same config: {cfg_txt}")
    say("   each in its own process (bench/peers/worker.py), steps alternated: the seed's code as it ships; the seed's "
        "code with the host-allocator setting our trainer applies at start (trainer/common/hostmem.py); ours; then ours "
        "against ours with --vocab-parallel off")
    t0 = time.perf_counter()
    # Two alternations, so that at most three workers hold their memory at once (each keeps its peak, up to
    # ~8 GB for the seed's step): seed, seed with the setting and ours; then ours and dp.
    cs = {k: Contender(k, p) for k in ("seed", "seed+keep", "ours")}
    try:
        facts = {k: c.ready() for k, c in cs.items()}
        say(f"   setup + compile + warm-up, in parallel: {time.perf_counter() - t0:.0f} s (ours compiled ahead of "
            f"time in {facts['ours']['compile_s']:.1f} s; vocab-parallel: {facts['ours']['vocab_parallel']}; "
            "allocator setting applied: " + ", ".join(f"{k} {f['kept_freed_memory']}" for k, f in facts.items()) + ")")
        peak = MatmulPeak(n=512 if p.quick else 2048)
        peaks: dict[str, list[float]] = {}

        def sample_peak():
            for k, v in peak.sample().items():
                peaks.setdefault(k, []).append(v)

        sample_peak()
        tm = alternate({k: c.step for k, c in cs.items()}, p.rounds, p.per_round, sample_peak)
        for k in ("seed", "seed+keep"):
            cs.pop(k).close()
        cs["dp"] = Contender("dp", p)
        facts["dp"] = cs["dp"].ready()
        tm_dp = alternate({k: c.step for k, c in cs.items()}, p.rounds, p.per_round)
    finally:
        for c in cs.values():
            c.close()
    times, cpu = tm.wall, tm.cpu
    tok = p.batch * p.seq_len
    med = {k: median(v) for k, v in times.items()}
    medc = {k: median(v) for k, v in cpu.items()}

    def line(tag: str, k: str, what: str) -> None:
        say(f"{tag} {what}{tok / med[k]:,.0f} tokens/s, step {med[k]:.3f} s, {medc[k]:.2f} CPU-s/step  "
            f"(wall, median of {len(times[k])}: {fmt_times(times[k])})")

    def ratio(a: str, b: str) -> str:  # speed of b over a
        rr, rc = tm.round_ratio(a, b), tm.round_ratio(a, b, "cpu")
        return (f"{med[a] / med[b]:.2f}x wall (median of per-round ratios {median(rr):.2f}x: "
                + " ".join(f"{x:.2f}" for x in rr) + f"); {medc[a] / medc[b]:.2f}x by CPU time (per round median "
                f"{median(rc):.2f}x)")

    line("[1] seed", "seed", "(article's code as it ships: nnx MHA + mask, dropout never runs):   ")
    line("[1b] seed", "seed+keep", "with the trainer's allocator setting (freed host memory reused):     ")
    line("[2] ours", "ours", "(trainer.pretrain.train.Steps, defaults, dropout on, as `python -m trainer` runs): ")
    say(f"    ratio ours/seed tokens/s: {ratio('seed', 'ours')}  [target >= 1.3x]")
    say(f"    ratio ours/seed with the same allocator setting (like for like): {ratio('seed+keep', 'ours')}")
    say(f"    the allocator setting alone, on the seed's code: {ratio('seed', 'seed+keep')}")
    dpw, dpc = median(tm_dp.wall["dp"]), median(tm_dp.cpu["dp"])
    say(f"    ours with --vocab-parallel off (table replicated, its gradient all-reduced), alternated with ours "
        f"after the above: step {dpw:.3f} s, {dpc:.2f} CPU-s -> speed of the default over this: "
        f"{median(tm_dp.round_ratio('dp', 'ours')):.2f}x wall, {median(tm_dp.round_ratio('dp', 'ours', 'cpu')):.2f}x "
        f"CPU (per-round medians)")

    pk = {k: median(v) for k, v in peaks.items()}
    best = max(pk, key=pk.get)
    n_seed = facts["seed"]["n_params"] - p.seq_len * p.d_model  # minus the position table (no matmul)
    n_ours = facts["ours"]["n_params"] - p.seq_len * p.d_model
    f_seed = model_flops_per_token(n_seed, p.n_layer, p.seq_len, p.d_model)
    f_ours = model_flops_per_token(n_ours, p.n_layer, p.seq_len, p.d_model)
    # Useful work is the same model on both sides: count ours with the unpadded vocab as well.
    ot = med["ours"]
    say(f"[3] CPU peak, f32 {peak.n}x{peak.n} jnp.dot, median over rounds: "
        + ", ".join(f"{k} {gflops(v)}" for k, v in pk.items())
        + f"; peak = the higher ({best})")
    say("    model FLOPs/token = 6*N + 12*L*T*D (PaLM; N = params in matmuls = all but the position table, "
        "tied embedding included; attention not halved for causality)")
    for k, what in (("seed", "seed"), ("seed+keep", "seed with the setting")):
        say(f"    {what}: N={n_seed:,}, {f_seed / 1e6:.1f} MFLOP/token -> {gflops(f_seed * tok / med[k])} = "
            f"{100 * f_seed * tok / med[k] / pk[best]:.0f}% of peak")
    say(f"    ours: N={n_ours:,} (vocab padded to {facts['ours']['padded_vocab']}), counted at the seed's "
        f"{f_seed / 1e6:.1f} MFLOP/token of useful work -> {gflops(f_seed * tok / ot)} = "
        f"{100 * f_seed * tok / ot / pk[best]:.0f}% of peak "
        f"(with the padded rows: {100 * f_ours * tok / ot / pk[best]:.0f}%)")
    return {"peak": pk[best]}


def section_tiny_and_ckpt(plan: Plan, rng, tmp: str, peak: float) -> None:
    p = plan
    if not p.quick:
        cfg = config("gpt2-tiny", os.path.join(tmp, "tiny"), train=dict(mesh="data=8,model=1", keep=2))
        title = "gpt2-tiny preset"
    else:  # --quick: the section 1-3 config (a small compile)
        cfg = ours_config(p, os.path.join(tmp, "quick"))
        title = "--quick: the config above"
    tr = OursTrainer(cfg)
    ckdir = cfg.train.ckpt_dir
    m, t = cfg.model, cfg.train
    say(f"== [4,5] {title}: L{m.n_layer} D{m.d_model} H{m.n_head} T{m.seq_len} B{t.batch_size}, "
        f"mesh 8x1, dtype {t.dtype} (f32 on CPU), dropout {m.dropout}")
    batches = [tokens(rng, t.batch_size, m.seq_len, m.vocab_size) for _ in range(4)]
    for b in batches[:2]:
        tr.step(b)
    k = p.ckpt_every

    def window(save: bool):
        def run():
            if save:  # the loop saves after a --ckpt-every step; steady state = one save per K steps
                tr.save()
            for j in range(k):
                tr.step(batches[j % len(batches)])
            if save:  # a save still running would hold up the next one: count it
                tr.ckpt.wait()
        return run

    tr.save()  # the first save creates the manager and directory: keep that out of the timings
    tr.ckpt.wait()
    tm = alternate({"plain": window(False), "save": window(True)}, p.ckpt_rounds * 2, 1)
    times = tm.wall
    tok = t.batch_size * m.seq_len
    plain = median(times["plain"]) / k
    saved = median(times["save"]) / k
    n = tr.n_params() - m.seq_len * m.d_model
    f = model_flops_per_token(n - (m.padded_vocab - m.vocab_size) * m.d_model, m.n_layer, m.seq_len, m.d_model)
    say(f"[4] {'quick config' if p.quick else 'gpt2-tiny'}: {tok / plain:,.0f} tokens/s, step {plain:.3f} s "
        f"(median window of {k} steps over {len(times['plain'])} windows), "
        f"{gflops(f * tok / plain)} = {100 * f * tok / plain / peak:.0f}% of peak")
    say(f"[5] async Orbax save every {k} steps to a local tmp dir ({_size(ckdir)}/step): "
        f"step {saved:.3f} s vs {plain:.3f} s without saves")
    say(f"    ratio save-every-{k}/no-save step time: {saved / plain:.2f}x wall (per-round median "
        f"{median(tm.round_ratio('save', 'plain')):.2f}x), {median(tm.cpu['save']) / median(tm.cpu['plain']):.2f}x "
        f"CPU time  (windows of {k} steps, s: plain {fmt_times(times['plain'])}, save {fmt_times(times['save'])})")
    tr.close()


def _size(d: str) -> str:
    steps = [os.path.join(d, s) for s in os.listdir(d) if s.isdigit()] if os.path.isdir(d) else []
    if not steps:
        return "?"
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(steps[-1]) for f in fs)
    return f"{total / 2**20:.0f} MiB"


def section_124m(plan: Plan, rng, tmp: str, peak: float) -> None:
    p = plan
    cfg = config("gpt2-124m", os.path.join(tmp, "m124"), model=dict(seq_len=p.m124_seq),
                 train=dict(batch_size=p.m124_batch, mesh=p.m124_mesh, dtype="float32"))
    m = cfg.model
    say(f"== [4b] gpt2-124m preset, small batch: L{m.n_layer} D{m.d_model} H{m.n_head} T{m.seq_len} "
        f"(preset 1024, cut so a step takes about a minute here) B{p.m124_batch}, mesh {p.m124_mesh} "
        f"(params sharded 4 ways: 8 replicas of 124M + Adam would not fit beside others), f32")
    t0 = time.perf_counter()
    tr = OursTrainer(cfg)
    b = tokens(rng, p.m124_batch, m.seq_len, m.vocab_size)
    tr.step(b)
    warm = time.perf_counter() - t0
    ts = []
    for _ in range(p.m124_steps):
        t1 = time.perf_counter()
        tr.step(b)
        ts.append(time.perf_counter() - t1)
    st = median(ts)
    tok = p.m124_batch * m.seq_len
    n = tr.n_params() - m.seq_len * m.d_model - (m.padded_vocab - m.vocab_size) * m.d_model
    f = model_flops_per_token(n, m.n_layer, m.seq_len, m.d_model)
    say(f"[4b] gpt2-124m ({tr.n_params() / 1e6:.0f}M params): step {st:.2f} s, {tok / st:,.0f} tokens/s, "
        f"{gflops(f * tok / st)} = {100 * f * tok / st / peak:.0f}% of peak  (timed {fmt_times(ts)}; "
        f"compile {tr.compile_s:.0f} s, setup+compile+first step {warm:.0f} s)")
    tr.close()
    del tr
    gc.collect()


def main(plan: Plan, sections: set[str], kept_freed_memory: bool = False) -> None:
    t0 = time.perf_counter()
    dev = jax.devices()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    say(f"bench: {len(dev)} {dev[0].device_kind} devices (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}), "
        f"{os.cpu_count()} cores {platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"load average {load:.1f} at start; freed host memory kept for reuse (trainer/common/hostmem.py): "
        f"{kept_freed_memory}")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="tpuctl-bench-") as tmp:
        peak = section_seed_vs_ours(plan)["peak"]
        if "ckpt" in sections:
            section_tiny_and_ckpt(plan, rng, tmp, peak)
            gc.collect()
        if "124m" in sections and plan.do_124m:
            section_124m(plan, rng, tmp, peak)
        else:
            say("[4b] gpt2-124m: skipped" + (" (--quick)" if not plan.do_124m else ""))
    if "launch" in sections and not plan.quick:
        say("== [6] tpuctl run on a local slice: push+install and run -> first step, 1/4/16 hosts")
        from bench.system import launch
        launch.bench(say=say)
    else:
        say("[6] launch bench: skipped" + (" (--quick)" if plan.quick else ""))
    if "gemma" in sections and not plan.quick:
        say("== [7] Gemma sampling: KV-cache loop vs full recompute (bench/peers/gemma_sample.py)")
        from bench.peers import gemma_sample
        gemma_sample.main()
    else:
        say("[7] Gemma sampling: skipped" + (" (--quick)" if plan.quick else ""))
    if "lora" in sections and not plan.quick:
        say("== [8] Gemma LoRA step: ours vs tunix PeftTrainer + qwix (bench/peers/gemma_lora.py)")
        from bench.peers import gemma_lora
        gemma_lora.main()
    else:
        say("[8] Gemma LoRA step: skipped" + (" (--quick)" if plan.quick else ""))
    if "preempt" in sections and not plan.quick:
        say("== [9] spot run through preemptions: steps redone, time to recover, goodput (bench/system/preempt.py)")
        from bench.system import preempt
        preempt.main()
    else:
        say("[9] preemptions: skipped" + (" (--quick)" if plan.quick else ""))
    if "tpu" in sections and not plan.quick:
        say("== [10] the TPU compiler's verdict on a gpt2-124m step: attention, loss, remat "
            "(bench/compiler/tpu_compile.py)")
        from bench.compiler import tpu_compile
        tpu_compile.main(say=say)
    else:
        say("[10] TPU compile: skipped" + (" (--quick)" if plan.quick else ""))
    if "prepare" in sections:
        say("== [11] prepare on a web-shaped corpus vs tiktoken's bare one-core speed (bench/system/prepare.py)")
        from bench.system import prepare
        prepare.main(["--quick"] if plan.quick else [], say=say)
    else:
        say("[11] prepare: skipped")
    if "loader" in sections:
        say("== [12] pretraining loader: tokens/s from gs:// vs a local file (bench/system/loader.py)")
        from bench.system import loader
        loader.main(say=say, quick=plan.quick)
    else:
        say("[12] loader: skipped")
    if "multislice" in sections and not plan.quick:
        say("== [13] multislice: step time on 2 slices vs 1 slice, same devices and global batch "
            "(bench/system/multislice.py)")
        from bench.system import multislice
        multislice.main(say=say)
    else:
        say("[13] multislice: skipped" + (" (--quick)" if plan.quick else ""))
    if "profile" in sections:
        say("== [14] --profile: step time outside the traced window vs unprofiled runs (bench/system/profile_cost.py)")
        from bench.system import profile_cost
        profile_cost.main(say=say, quick=plan.quick)
    else:
        say("[14] profile: skipped")
    if "side" in sections and not plan.quick:
        say("== [15] side by side, the same work counted whole: ours, the seed's step, MaxText "
            "(bench/compiler/side_by_side.py)")
        from bench.compiler import side_by_side
        side_by_side.main(maxtext_at=plan.maxtext, say=say)
    else:
        say("[15] side by side: skipped" + (" (--quick)" if plan.quick else ""))
    if "bytes" in sections and not plan.quick:
        say("== [16] where the gpt2-124m step's HBM bytes go, v5e-8, default flags (bench/compiler/tpu_bytes.py)")
        from bench.compiler import tpu_bytes
        tpu_bytes.bench(say=say)
    else:
        say("[16] bytes: skipped" + (" (--quick)" if plan.quick else ""))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    say(f"bench: done in {time.perf_counter() - t0:.0f} s (load average {load:.1f} at the end)")
