"""`tpuctl plan`: the trainer's real step compiled ahead of time for a TPU topology (libtpu, the `plan` extra) or
for a local slice's CPU devices; its figures against the arithmetic and against a real run; the verdict,
what would fit, time and cost; bad input."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from _local_hosts import TEST_CACHE, local_mode, needs_hosts
from _skips import needs_libtpu
from orchestrator import catalog, state
from orchestrator.cli import run_verbs as cli_run
from orchestrator.plan import step as P
from orchestrator.spec import UserError
from orchestrator.cli.app import cli
from orchestrator.cli.plan_verbs import render
from trainer.common import aot
from trainer.common import config
from trainer.pretrain import train as loop
from trainer.common import mesh as mesh_lib
from trainer.cli import parser
from trainer.finetune import train as finetune
from trainer.finetune import data as sft_data
from trainer.finetune.config import LoraRun
from trainer.models import gemma, gpt2
from trainer.models import lora as lora_lib

TINY = ["pretrain", "--preset", "gpt2-tiny", "--ckpt-dir", "/tmp/plan-ckpt"]
# --weights need not exist: a plan takes the model's size from --model and never reads them
LORA = ["lora", "--weights", "gs://b/gemma", "--data", "gs://b/train.jsonl", "--ckpt-dir", "gs://b/lora", "--rank", "8"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _arithmetic_state_bytes(argv: list[str], devices: int) -> float:
    """params x 4 bytes (f32) divided by the shards its logical axes get from the rules on the mesh the trainer
    makes, and Adam's two moments (f32) likewise, also split over data when --optimizer-state is sharded (ZeRO-1)
    where a dimension the rules leave whole divides by it."""
    cfg = config.resolve(parser().parse_args(argv))
    shape = {"dcn": 1, **mesh_lib.parse_mesh(cfg.train.mesh, devices)}  # one slice
    rules = mesh_lib.VOCAB_PARALLEL_RULES if loop.use_vocab_parallel(cfg, devices) else mesh_lib.RULES
    shapes = gpt2.abstract(cfg.model)[1]
    dims = nnx.to_pure_dict(shapes, extract_fn=lambda v: tuple(v.get_value().shape))
    axes = gpt2.param_axes(cfg.model)
    split = cfg.train.optimizer_state == "sharded"
    total = 0.0
    for dim, ax in zip(jax.tree.leaves(dims, is_leaf=lambda x: isinstance(x, tuple)),
                       jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        shards, whole = 1, []
        for n, a in zip(dim, ax or (None,) * len(dim)):
            mapped = rules.get(a) if a else None
            names = [m for m in (mapped if isinstance(mapped, tuple) else (mapped,)) if m]
            shards *= math.prod(shape[m] for m in names)
            if not names:
                whole.append(n)
        data = shape["data"] if split and any(n % shape["data"] == 0 for n in whole) else 1
        total += math.prod(dim) * 4 / shards * (1 + 2 / data)
    return total


def _state_bytes(p: P.Plan, argv: list[str]) -> int:
    """The compiler's argument bytes less this device's share of the int32 batch and the step counter."""
    cfg = config.resolve(parser().parse_args(argv))
    batch = cfg.train.batch_size // p.figures["mesh"]["data"] * (cfg.model.seq_len + 1) * 4
    return p.figures["argument_bytes"] - batch - 4


# ---- must-show 1: the TPU compiler's parameter and optimizer bytes against the arithmetic ----------------------

@pytest.mark.recorded_plans
@needs_libtpu
@pytest.mark.slow
def test_gpt2_124m_on_v4_8_state_bytes_match_the_arithmetic():
    """gpt2-124m's parameters and Adam state as the TPU compiler holds them on v4-8, against the arithmetic. They
    depend neither on the batch nor on how the loss is computed: one row per device and the loss in one piece (no
    loop, so no unrolled twin to compile for the count) keep the check whole at one compile (the preset's 64 x
    1024 is in the README's table). Nor on how many of its 12 layers, all of one shape, are compiled: two, at the
    preset's width, positions and vocabulary, hold every kind of tensor it has (a layer's repeated) for a fraction
    of the compile."""
    argv = ["pretrain", "--preset", "gpt2-124m", "--n-layer", "2", "--batch-size", "4", "--loss-chunk", "0",
            "--ckpt-dir", "gs://b/run"]
    p = P.plan("v4-8", argv)
    f = p.figures
    assert p.compiler == P.TPU and f["device_kind"] == "TPU v4"
    assert f["devices"] == 4 == catalog.lookup("v4-8").chips  # megacore: one device per chip, as on the VM
    assert f["dtype"] == "bfloat16"  # --dtype auto follows the TPU, not this CPU machine
    want = _arithmetic_state_bytes(argv, 4)
    # 53.6M params (two layers) x 12 bytes: the tied embedding's 38.6M split over the vocab, the rest whole
    assert 0.29e9 < want < 0.30e9, want
    assert abs(_state_bytes(p, argv) - want) / want < 0.10, (_state_bytes(p, argv), want)
    assert abs(f["params_bytes"] + f["optimizer_bytes"] - want) / want < 0.10
    assert f["counted"] == "program"  # one compile: nothing to unroll
    assert p.fits and 0 < f["temp_bytes"] < p.hbm_bytes and 0.5 < f["flops"] / p.model_flops < 2


@pytest.mark.recorded_plans
@needs_libtpu
def test_tiny_sharded_over_the_model_axis_state_bytes_match_the_arithmetic():
    """The same check with most tensors split over model=2 (heads, MLP, vocab): the divisor comes from the rules."""
    argv = [*TINY, "--mesh", "data=2,model=2", "--vocab-parallel", "off"]
    p = P.plan("v4-8", argv)
    want = _arithmetic_state_bytes(argv, 4)
    replicated = _arithmetic_state_bytes([*TINY, "--mesh", "data=4,model=1", "--vocab-parallel", "off",
                                          "--optimizer-state", "replicated"], 4)
    assert want < 0.6 * replicated  # the check has teeth: sharding splits most of the state
    assert abs(_state_bytes(p, argv) - want) / want < 0.10, (_state_bytes(p, argv), want)
    assert p.figures["mesh"] == {"data": 2, "model": 2}


# ---- the whole step counted: a loop's body as many times as the loop runs ----------------------------------

# A one-layer GPT-2 whose 50k-vocabulary output layer is most of its work, 2 x 256 tokens per device: the loss
# chunked over 4 chunks of 64 positions (a scan) or all at once (no loop).
WHOLE = ["pretrain", "--ckpt-dir", "/tmp/unused", "--n-layer", "1", "--n-head", "2", "--d-model", "128", "--seq-len",
         "256", "--batch-size", "16", "--dropout", "0"]


def _compile_v5e(argv: list[str]) -> tuple[dict, int]:
    """(figures, parameter count) of the step compiled for v5e:2x4, as `python -m trainer.plan` does."""
    import argparse
    opts = argparse.Namespace(devices=8, processes=1, num_slices=1, tpu="v5e:2x4", chip_config="default",
                              host_bounds="2,4,1", fallback_cpu=False, run_platform="cpu")
    target = aot.target(opts)
    built = aot.BUILDERS["pretrain"](parser().parse_args(argv), target)
    n_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(built.params))
    return aot.figures(built, built.compile(), target, 0.0), n_params


@needs_libtpu
def test_the_chunked_loss_counts_as_much_work_as_the_full_logits():
    """The TPU compiler counts a while loop's body once: XLA's chunked loss's scan alone reports a quarter of the
    output layer. Counted whole (its unrolled twin), the chunked step does the work of the full-logits one
    within 2%, and both at least 6 x params x tokens per device. The output layer as Pallas kernels (--loss-kernel
    pallas) has no loop, and the compiler counts it from the kernels' cost estimates: nothing at all without
    them. It computes the logits twice (one more [tokens, V, D] matmul) and moves less than either."""
    whole = [*WHOLE, "--vocab-parallel", "off"]  # 4,096 tokens a step: auto would split the vocabulary instead
    xla = [*whole, "--loss-kernel", "xla"]
    chunked, n_params = _compile_v5e([*xla, "--loss-chunk", "64"])
    full, _ = _compile_v5e([*xla, "--loss-chunk", "0"])
    kernels, _ = _compile_v5e([*whole, "--loss-kernel", "pallas"])
    assert chunked["counted"] == "unrolled" and full["counted"] == "program" == kernels["counted"]
    assert chunked["program_flops"] < 0.6 * chunked["flops"]  # the loop's body once: what the plan used to say
    assert abs(chunked["flops"] - full["flops"]) <= 0.02 * full["flops"], (chunked["flops"], full["flops"])
    six_nt = 6 * n_params * chunked["tokens_per_step"] / chunked["devices"]
    assert chunked["flops"] >= six_nt and full["flops"] >= six_nt, (chunked["flops"], full["flops"], six_nt)
    assert chunked["bytes_accessed"] > chunked["program_bytes_accessed"]
    assert kernels["settings"]["loss_kernel"] == "pallas" and full["settings"]["loss_kernel"] == "xla"
    tokens = chunked["tokens_per_step"] / chunked["devices"]
    recompute = 2 * tokens * 50304 * 128  # the logits' matmul once more: 2 N V D
    # (less XLA's elementwise work on the [N, V] logits, the softmax, which the kernels' estimate leaves out)
    assert 0.9 * recompute < kernels["flops"] - full["flops"] <= recompute, (kernels["flops"], full["flops"])
    assert kernels["bytes_accessed"] < 0.7 * min(full["bytes_accessed"], chunked["bytes_accessed"])


# ---- must-show 2: Gemma LoRA from the size's real shapes, no weights -----------------------------------------

def _gemma_state(size: str, base_bytes: int, devices: int, rank: int = 8) -> tuple[float, float]:
    """(params, optimizer) bytes per device by arithmetic: the base split fsdp-style over every device (its
    [D] norms whole), the f32 adapters on q and v (A split like the base, B whole), Adam's two moments."""
    cfg = gemma.SIZES[size]
    lay = gemma.param_layout(cfg)
    base = sum(math.prod(s) * base_bytes / (devices if len(s) > 1 else 1) for s, _ in lay.values())
    lc = lora_lib.LoraConfig(rank, 16.0, 0.0, ("q", "v"))
    adapters = sum(math.prod(s) * 4 / (devices if n.endswith(".a") else 1)
                   for n, (s, _) in lora_lib.param_layout(cfg, lc).items())
    return base + adapters, 2 * adapters


@pytest.fixture(scope="module")
def gemma_plans(tmp_path_factory):
    """One plan cache for the Gemma tests: the gate below reads the plan the test before it compiled."""
    return tmp_path_factory.mktemp("gemma-plans")


@pytest.mark.recorded_plans
@needs_libtpu
@pytest.mark.slow
def test_gemma2_2b_lora_rank_8_fits_on_v5litepod_8(monkeypatch, gemma_plans):
    """The real gemma2-2b shapes (2.6B params) from --model; --weights is a gs:// path nobody reads. A row of 128
    tokens per device keeps the compile short: the base and adapter bytes do not depend on the batch."""
    monkeypatch.setenv("TPUCTL_HOME", str(gemma_plans))
    argv = [*LORA, "--model", "gemma2-2b", "--batch-size", "8", "--seq-len", "128"]
    p = P.plan("v5litepod-8", argv)
    f = p.figures
    assert p.compiler == P.TPU and f["device_kind"] == "TPU v5 lite" and f["devices"] == 8
    assert f["dtype"] == "bfloat16" and f["settings"]["base_dtype"] == "bfloat16"  # auto, as on the TPU
    params, opt = _gemma_state("gemma2-2b", 2, 8)
    assert params > 0.6e9  # 2.6B params in bf16 over 8 devices
    assert abs(f["params_bytes"] - params) / params < 0.01 and abs(f["optimizer_bytes"] - opt) / opt < 0.01
    assert abs(_lora_state_args(f) - params - opt) / (params + opt) < 0.02  # the compiler's arguments agree
    assert p.fits and 0 < f["temp_bytes"] < p.hbm_bytes, p.verdict()
    assert 0.5 < f["flops"] / p.model_flops < 2


def _lora_state_args(f: dict) -> int:
    """The compiler's argument bytes less this device's share of the batch (int32/f32 [rows, seq] fields)
    and the step counter."""
    return f["argument_bytes"] - len(sft_data.FIELDS) * f["tokens_per_step"] // f["devices"] * 4 - 4


def test_a_plan_is_cached_by_the_step_it_compiles():
    """lora's paths and logging, and pretrain's checkpoints and logging, reach no program: the same step under other
    ones is the same cache entry, in either spelling of an option; what shapes the step (the rank, the batch) and
    pretrain's --data (its tokenizer) are not."""
    argv = [*LORA, "--model", "gemma2-2b"]
    moved = ["lora", "--weights=gs://c/other", "--data", "gs://c/other.jsonl", "--ckpt-dir=gs://c/run2", "--rank", "8",
             "--model", "gemma2-2b", "--log-every", "5"]
    key = lambda a: P.cache_key("v5litepod-8", "slice", a)  # noqa: E731
    assert key(moved) == key([*argv, "--log-every", "1"]) != key(argv)
    assert key([*argv, "--rank", "16"]) != key(argv)
    assert P.step_argv(["pretrain", "--data", "a.txt"]) == ["pretrain", "--data", "a.txt"]
    # pretrain's checkpoints and logging reach no program either: a run into a new --ckpt-dir plans from the cache
    pre = ["pretrain", "--preset", "gpt2-124m", "--ckpt-dir", "gs://b/run1", "--log-every", "10"]
    assert key(pre) == key(["pretrain", "--preset", "gpt2-124m", "--ckpt-dir=gs://b/run2", "--log-every", "1"])
    assert key(pre) != key([*pre, "--batch-size", "16"])


@pytest.mark.recorded_plans
@needs_libtpu
@pytest.mark.slow
def test_the_run_gate_plans_lora_from_the_cache(monkeypatch, gemma_plans):
    """`run` / `up --plan` call the gate: the same lora command is planned (cached, from the test above), passes
    on the real chip and is refused with the verdict on one with too little HBM (the verdict is the catalog's)."""
    monkeypatch.setenv("TPUCTL_HOME", str(gemma_plans))
    argv = [*LORA, "--model", "gemma2-2b", "--batch-size", "8", "--seq-len", "128"]
    p = P.gate("v5litepod-8", argv, cpu_devices=False)
    assert p is not None and p.cached and p.fits
    # cached by the step it compiles: other weights, data and checkpoints (either spelling) are the same plan,
    # another rank is not
    moved = ["lora", "--weights=gs://c/other", "--data", "gs://c/other.jsonl", "--ckpt-dir", "gs://c/run2", *argv[7:]]
    again = P.gate("v5litepod-8", moved, cpu_devices=False)
    assert again.cached and again.figures == p.figures
    monkeypatch.setitem(catalog.GENERATIONS, "v5litepod", dataclasses.replace(
        catalog.GENERATIONS["v5litepod"], hbm_gib_per_chip=p.total_bytes / P.GIB / 2))
    with pytest.raises(P.PlanError, match="plan: does NOT fit on v5litepod-8.*--no-plan skips this check"):
        P.gate("v5litepod-8", argv, cpu_devices=False)


@pytest.mark.recorded_plans
@needs_libtpu
@pytest.mark.slow
def test_gemma2_27b_lora_on_v5litepod_8_fits_with_its_layers_in_scans():
    """The trainer has no full fine-tuning of Gemma, so the 27B case is its LoRA run, one row of 512 per device.
    --remat auto writes the step out by its estimate, the compiler refuses that (the whole base gathered and kept
    for the backward pass), and the plan compiles the step with its layers in scans as the run would (libtpu
    0.0.42.1): 9.35 GiB a device (params 6.35, temporaries 2.95). It needed 16.56 (temporaries 10.15) while each
    period's run of one layer (Gemma 2 alternates a local and a global layer: every run is one layer) took its
    weights as a slice in the outer scan's body, which jax kept for the backward pass stacked over the periods."""
    from trainer.finetune.train import REFUSED_WRITTEN_OUT
    # XLA attention, as the figures above were compiled
    argv = [*LORA, "--model", "gemma2-27b", "--batch-size", "8", "--attention", "xla"]
    p = P.plan("v5litepod-8", argv, alternatives=False)
    f = p.figures
    assert p.fits and p.refused is None, p.verdict()
    assert (f["settings"]["remat"], f["settings"]["remat_why"]) == ("full", REFUSED_WRITTEN_OUT)
    params, opt = _gemma_state("gemma2-27b", 2, 8)
    assert params > 6e9 and abs(f["params_bytes"] - params) / params < 0.01
    assert f["temp_bytes"] < 0.6 * params  # a layer's base gathered at a time, no stacked copy of the layers
    assert p.verdict().startswith("fits on v5litepod-8")
    assert "refused written out" in render(p)  # where the plan's time went: the refused compile too


def test_lora_levers_and_sizes_from_given_figures():
    """The arithmetic of the LoRA levers (no compile). 1 GiB of f32 base per device on data=8: each device also
    holds the 7 GiB it gathers; bf16 halves both; model=2 gathers 3 GiB; a larger slice splits the base further
    but each device still gathers all of it, and keeps its 4 rows (no --batch-size)."""
    gib = P.GIB
    grads = gib // 32
    f = _figures(params_bytes=gib + grads, optimizer_bytes=2 * grads, grad_bytes=grads,
                 temp_bytes=grads + 7 * gib + 2 * gib, total_bytes=17 * gib, mesh={"data": 8, "model": 1}, devices=8,
                 settings={"batch_size": 32, "grad_accum": 1, "steps": 10, "mesh": "", "n_head": 32,
                           "base_dtype": "float32", "fsdp": True, "batch_per_device": True, "seq_len": 512,
                           "d_model": 4096},
                 levers=["base_dtype", "batch_size", "mesh_model"])
    p = P.Plan(catalog.lookup("v5litepod-8"), P.TPU, f)
    assert not p.fits and P._gathered(f) == 7 * gib and P._split(f) == (15 * gib, 2 * gib)
    # temporaries too small to hold the gathered base: the layers in a scan, one period gathered at a time
    scanned = {**f, "temp_bytes": grads + 2 * gib}
    assert P._gathered(scanned) == 0 and P._split(scanned) == (15 * gib, 2 * gib)
    # ... and where the plan says so: one iteration's layers (8 of 32), twice
    scan = {**scanned, "settings": {**f["settings"], "scan_layers": 8, "n_layer": 32}}
    assert P._gathered(scan) == int(gib * 0.5 * 7) and P._gathered(scan, 4) == int(gib * 0.5 * 3)
    by = {s.change: s for s in P.suggest(p)}
    assert list(by) == ["--base-dtype bfloat16", "--batch-size 16", "--mesh data=4,model=2"]  # the first is compiled
    assert by["--base-dtype bfloat16"].estimate_bytes == 17 * gib - 8 * gib // 2
    assert by["--batch-size 16"].estimate_bytes == 16 * gib  # 15 GiB stays, activations / 2
    # the residual's positions split over model: the activations stay, but for the two layer inputs (bf16) each
    # device gathers of twice the rows (8 of 512 positions of 4096, not 4)
    inputs = 2 * 512 * 4096 * 2
    assert by["--mesh data=4,model=2"].estimate_bytes == 17 * gib - 4 * gib + inputs * (8 - 4)
    state = 15 * gib - 7 * gib  # on 16 devices: half of it, and 15 shards of half the size gathered
    assert P._on_devices(p, 16) == state // 2 + int(gib * 0.5 * 15) + 2 * gib
    bf16 = P.Plan(catalog.lookup("v5litepod-8"), P.TPU, {**f, "settings": {**f["settings"], "base_dtype": "bfloat16"}})
    assert "--base-dtype bfloat16" not in {s.change for s in P.suggest(bf16)}
    per_batch = P.Plan(catalog.lookup("v5litepod-8"), P.TPU,
                       {**f, "settings": {**f["settings"], "batch_per_device": False}})
    assert P._on_devices(per_batch, 16) == state // 2 + int(gib * 0.5 * 15) + gib


def test_loras_loss_chunk_is_suggested_from_the_logits_it_holds():
    """LoRA's loss holds two f32 copies of its logits per device: rows x positions x vocab (over model). 4 rows of
    512 with Gemma's 256,000 tokens on data=8 hold 7.8 MiB a position: chunks of 256 free 1.95 GiB, enough for
    17 -> 15.05 GiB (the largest chunk that fits is named: the fewest extra reads of the embedding); 128 positions
    are needed at 18.5 GiB; none is named when even 16 positions do not fit, or without the vocabulary. Checked
    against compiles of gemma2-2b on v5e-8 (4 rows of 512): 10.25 GiB whole, 7.29 GiB in chunks of 128, this
    arithmetic 7.32."""
    gib = P.GIB
    settings = {"batch_size": 32, "grad_accum": 1, "steps": 10, "mesh": "", "n_head": 8, "base_dtype": "bfloat16",
                "fsdp": True, "batch_per_device": True, "loss_chunk": 0, "seq_len": 512, "vocab": 256_000}

    def plan(total, **over):
        f = _figures(total_bytes=total, temp_bytes=total - gib, mesh={"data": 8, "model": 1}, devices=8,
                     settings={**settings, **over}, levers=["base_dtype", "loss_chunk"])
        return P.Plan(catalog.lookup("v5litepod-8"), P.TPU, f)
    per_position = 2 * 4 * 256_000 * 4
    by = {s.change: s for s in P.suggest(plan(17 * gib))}
    assert list(by) == ["--loss-chunk 256"] and by["--loss-chunk 256"].estimate_bytes == 17 * gib - 256 * per_position
    assert [s.change for s in P.suggest(plan(int(18.5 * gib)))] == ["--loss-chunk 128"]
    assert P.suggest(plan(int(10.25 * gib) + 3 * gib, loss_chunk=512))[0].estimate_bytes == \
        int(10.25 * gib) + 3 * gib - 256 * per_position  # --loss-chunk 512 of 512 is the whole sequence
    assert [s.change for s in P.suggest(plan(int(16.5 * gib), loss_chunk=256))] == ["--loss-chunk 128"]  # from 256
    assert P.suggest(plan(30 * gib)) == [] and P.suggest(plan(17 * gib, vocab=None)) == []
    assert [s.change for s in P.suggest(plan(17 * gib, seq_len=384))] == ["--loss-chunk 192"]  # a divisor of 384
    # gemma2-2b's measured step: 10.25 GiB whole; chunks of 128 estimated 7.32 GiB, compiled 7.29
    assert abs((int(10.25 * gib) - 384 * per_position) / gib - 7.32) < 0.01


def test_lora_without_a_model_size_is_not_planned_and_runs_unplanned():
    """A plan never reads --weights: without --model SIZE it says how to plan it (before jax starts); the gate
    lets `run` launch unplanned with that reason. A size the trainer does not know is its own one-line error."""
    res = CliRunner().invoke(cli, ["plan", "-a", "v5litepod-8", "--", *LORA, "--model", "gemma2"])
    assert res.exit_code == 1
    assert _error_lines(res) == ["Error: `lora` is planned from its model size, without reading --weights: add "
                                 "--model SIZE (e.g. --model gemma2-2b; the run checks the checkpoint is that size); "
                                 "--model gemma2 names a family only"]
    said = []
    assert P.gate("v5litepod-8", LORA, cpu_devices=False, on_skip=said.append) is None
    assert said[0].startswith("not planned: `lora` is planned from its model size")
    _planner_answers_before_jax("v5litepod-8", LORA)
    res = CliRunner().invoke(cli, ["plan", "-a", "v5litepod-8", "--local", "--", *LORA, "--model", "gemma2-3b"])
    assert res.exit_code == 1 and _error_lines(res)[0].startswith("Error: --model gemma2-3b: choose a family "
                                                                  "(gemma2, gemma3, gemma4) or a size (gemma2-2b, ")


def test_the_run_checks_the_checkpoint_is_the_size_model_names():
    cfg = gemma.SIZES["gemma2-9b"]
    run = LoraRun(weights="gs://b/w", data="d.jsonl", ckpt_dir="/tmp/c", model="gemma2-2b")
    assert (run.family, run.size) == ("gemma2", "gemma2-2b")
    with pytest.raises(config.UsageError, match=r"--model gemma2-2b: --weights gs://b/w holds a gemma2-9b checkpoint "
                                                r"\(42 layers, width 3584\); pass --model gemma2-9b"):
        finetune.check_size(run, cfg)
    finetune.check_size(dataclasses.replace(run, model="gemma2-9b"), dataclasses.replace(cfg, vocab=256000))
    finetune.check_size(dataclasses.replace(run, model="gemma2"), cfg)  # a family: the checkpoint's size


# ---- must-show 3: a local slice's plan (the CPU compiler) against the same step actually run ------------------

@pytest.fixture(scope="module")
def tiny_plans(tmp_path_factory):
    """One plan cache for the tests that plan TINY on a local v5litepod-8: compiled once, by whichever runs first."""
    return tmp_path_factory.mktemp("tiny-plans")


def test_local_plan_matches_the_run_it_plans(monkeypatch, tiny_plans):
    """gpt2-tiny on a local v5litepod-8 (8 CPU devices, as conftest gives this process). The plan comes from the
    trainer's AOT process; the run builds the trainer's Steps here, initialises and takes two real steps.
    The CPU runtime has no memory_stats(), so the run is measured by its live arrays on device 0 after the steps
    (params, optimizer state, the last batch): within 2% of the plan's arguments. The run's own compiled step
    reports the same temporaries as the plan's (tolerance 2%: the same program), and its total is the plan's."""

    monkeypatch.setenv("TPUCTL_HOME", str(tiny_plans))
    p = P.plan("v5litepod-8", TINY, cpu_devices=True)
    f = p.figures
    assert p.compiler == P.CPU and f["devices"] == 8 and f["dtype"] == "float32"
    again = P.plan("v5litepod-8", TINY, cpu_devices=True)  # the same (accelerator, argv, versions, code): cached
    assert again.cached and again.figures == f

    cfg = config.resolve(parser().parse_args(TINY))
    shape = mesh_lib.parse_mesh(cfg.train.mesh, jax.device_count())
    steps = loop.Steps(cfg, mesh_lib.make_mesh(shape))
    steps.compile()
    params, opt = steps.init()
    rng = np.random.default_rng(0)
    for step in (1, 2):
        batch = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1), dtype=np.int32)
        params, opt, out = steps.step(params, opt, batch, step)
    assert np.isfinite(float(out["loss"]))
    dev = jax.devices()[0]
    live = sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device == dev)
    assert abs(live - f["argument_bytes"]) / f["argument_bytes"] < 0.02, (live, f["argument_bytes"])
    run_mem = steps.train_fn.memory_analysis()
    assert abs(run_mem.temp_size_in_bytes - f["temp_bytes"]) <= 0.02 * f["temp_bytes"]
    assert p.total_bytes >= live


# ---- verdict, suggestions, time and cost (arithmetic on given figures: no compile) ----------------------------

def _figures(**over) -> dict:
    f = {"compiler": "tpu", "device_kind": "TPU v4", "devices": 4, "processes": 1, "run_platform": "tpu",
         "mesh": {"data": 4, "model": 1}, "dtype": "bfloat16", "compile_s": 1.0,
         "params_bytes": 2 * P.GIB, "optimizer_bytes": 4 * P.GIB, "argument_bytes": 6 * P.GIB,
         "output_bytes": 6 * P.GIB, "alias_bytes": 6 * P.GIB, "temp_bytes": 34 * P.GIB, "code_bytes": 0,
         "total_bytes": 40 * P.GIB, "flops": 275e12, "bytes_accessed": 1e9, "tokens_per_step": 65536,
         "model_flops_per_token": 1e9, "settings": {"batch_size": 64, "grad_accum": 1, "steps": 3600, "mesh": "",
                                                    "n_head": 12},
         "levers": ["grad_accum", "batch_size", "mesh_model"]}
    f.update(over)
    return f


def test_does_not_fit_names_what_would_and_costs_add_up():
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(), mfu=0.5)
    assert not p.fits and p.headroom_bytes == -8 * P.GIB and "does NOT fit on v4-8" in p.verdict()
    p.suggestions = P.suggest(p)
    by = {s.change.split()[0]: s for s in p.suggestions}
    # fixed = 40 - (34 - 2) = 8 GiB; activations 32 GiB: /2 gives 24 GiB, + a 2 GiB gradient accumulator for
    # --grad-accum: both fit 32 GiB
    assert by["--grad-accum"].change == "--grad-accum 2" and by["--grad-accum"].estimate_bytes == 26 * P.GIB
    assert by["--batch-size"].change == "--batch-size 32" and by["--batch-size"].estimate_bytes == 24 * P.GIB
    assert "--mesh" not in by  # model=2: 8/2 + 32 = 36 GiB, model=4: 34 GiB; neither fits, so neither is named
    assert p.model_flops < p.figures["flops"] == p.flops  # the compiler's count when it is the larger
    t = p.timing()
    # 1 GB at 1,200 GB/s is 0.8 ms: the 275 TFLOP at 275 TFLOP/s per device bound the step
    assert t["bound"] == "compute" and t["step_s"] == pytest.approx(1.0) and t["r"] == pytest.approx(1 / 1200)
    assert t["step_s_at_peak"] == pytest.approx(1.0) and t["step_s_at_mfu"] == pytest.approx(2.0)
    assert t["tokens_per_s_at_mfu"] == pytest.approx(65536 / 2) and t["tokens_per_s"] == pytest.approx(65536)
    assert t["wall_s"] == pytest.approx(3600) and t["wall_s_at_mfu"] == pytest.approx(7200)  # 3600 steps x 1 s, 2 s
    assert t["usd_on_demand"] == pytest.approx(4 * 3.22) and t["usd_spot"] == pytest.approx(4 * 0.92)
    assert t["usd_on_demand_at_mfu"] == pytest.approx(2 * 4 * 3.22)
    text = render(p)
    assert "DOES NOT FIT" in text and "--grad-accum 2" in text and "$12.88 on-demand" in text
    assert "bound by compute" in text and "at MFU 0.5: $25.76" in text
    fits = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(temp_bytes=10 * P.GIB, total_bytes=16 * P.GIB))
    assert fits.fits and P.suggest(fits) and "FITS" in render(fits)


def test_remat_full_is_suggested_from_the_layers_count_and_only_where_it_is_not_on():
    """--remat full keeps two layers' worth of the 32 GiB of activations (12 layers: 32 * 2 / 12), after the
    batch-preserving --grad-accum and before the smaller batch; a step already at --remat full, or one that does
    not say how many layers it has, gets no such suggestion. Checked against a compile: gpt2-124m on v5e-8 keeps
    1.43 GB of activations (1.93 GB of temporaries, 0.50 GB of them gradients); this guess gives 0.74 GB of
    temporaries at --remat full, and the compiler 0.80 GB."""
    settings = {"batch_size": 64, "grad_accum": 1, "steps": 10, "mesh": "", "n_head": 12, "n_layer": 12,
                "remat": "none"}
    levers = ["grad_accum", "remat", "batch_size", "mesh_model"]
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(settings=settings, levers=levers))
    p.suggestions = P.suggest(p)
    changes = [s.change for s in p.suggestions]
    assert changes[:3] == ["--grad-accum 2", "--remat full", "--batch-size 32"], changes
    remat = p.suggestions[1]
    assert remat.estimate_bytes == 8 * P.GIB + 32 * P.GIB * 2 // 12 and "a third more FLOPs" in remat.note
    assert "would fit: --remat full (about 13.33 GiB per device, estimated)" in render(p)
    for other in ({"remat": "full"}, {"n_layer": None}):
        q = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(settings={**settings, **other}, levers=levers))
        assert "--remat full" not in [s.change for s in P.suggest(q)]
    dots = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(settings={**settings, "remat": "dots"}, levers=levers))
    assert "--remat full" in [s.change for s in P.suggest(dots)]
    # 40 GiB of activations over 2 layers keep all 40: over v4's 32 GiB, so not named
    two = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(settings={**settings, "n_layer": 2}, levers=levers,
                                                         temp_bytes=42 * P.GIB, total_bytes=48 * P.GIB))
    assert "--remat full" not in [s.change for s in P.suggest(two)]


def test_the_step_time_is_a_roofline_that_names_its_bound():
    """2.4 TB per device at v4's 1,200 GB/s take 2 s, the 275 TFLOP at its 275 TFLOP/s take 1 s: memory bounds the
    step, r = 2; the assumed MFU's time stays beside it, labelled. A local slice's CPU devices get no time."""
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(bytes_accessed=2.4e12, counted="unrolled"), mfu=0.5)
    t = p.timing()
    assert t["bound"] == "memory" and t["memory_s"] == pytest.approx(2.0) and t["compute_s"] == pytest.approx(1.0)
    assert t["step_s"] == pytest.approx(2.0) and t["r"] == pytest.approx(2.0) and t["step_s_at_mfu"] == pytest.approx(2.0)
    assert t["wall_s"] == pytest.approx(3600 * 2.0) and t["hbm_bytes_s_per_device"] == 1200e9
    out = p.to_json()
    assert out["timing"]["bound"] == "memory" and out["counted"] == "unrolled"
    text = render(p)
    assert "bound by memory" in text and "r = memory/compute = 2.00" in text and "every loop's trips" in text
    assert "an assumed MFU of 0.5" in text
    v6e = P.Plan(catalog.lookup("v6e-8"), P.TPU, _figures(devices=8, bytes_accessed=1638e9))
    assert v6e.roofline()["memory_s"] == pytest.approx(1.0)  # 1,638 GB/s per v6e chip
    assert P.Plan(catalog.lookup("v4-8"), P.CPU, _figures()).timing() == {}


def test_the_roofline_adds_the_bytes_of_kernels_the_compiler_does_not_count():
    """libtpu counts no byte of a Pallas kernel that declares no cost estimate (splash attention's): the plan adds
    their operands and results, read from the compiled program's text, to the compiler's bytes for the roofline,
    and keeps the compiler's own count apart (it is what MaxText's figures are). A kernel with an estimate
    (the loss kernels') is the compiler's to count: not added again."""
    hlo = ('  %splash.1 = (f32[8,1024,128]{2,1,0:T(8,128)}, bf16[8,12,1024,64]{3,2,1,0:T(8,128)(2,1)}) custom-call(%a, %b), '
           'custom_call_target="tpu_custom_call", operand_layout_constraints={bf16[8,12,64,1024]{3,2,1,0}, s32[1024,128]{1,0}}, '
           'backend_config={"custom_call_config":{"body":"x"}}\n'
           '  %xent.2 = f32[50304,768]{1,0} custom-call(%c), custom_call_target="tpu_custom_call", operand_layout_'
           'constraints={bf16[50304,768]{1,0}}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"1"}}}\n')
    want = 8 * 1024 * 128 * 4 + 8 * 12 * 1024 * 64 * 2 + 8 * 12 * 64 * 1024 * 2 + 1024 * 128 * 4
    assert aot.uncounted_kernel_bytes(hlo) == want
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(bytes_accessed=1.2e12, kernel_bytes_uncounted=1.2e12))
    t = p.timing()
    assert t["bytes_moved"] == 2.4e12 and t["memory_s"] == pytest.approx(2.0) and t["bound"] == "memory"
    assert p.to_json()["per_device"]["bytes_accessed"] == 1.2e12
    assert p.to_json()["per_device"]["kernel_bytes_uncounted"] == 1.2e12
    assert "1.2e+03 GB + 1.2e+03 GB of Pallas kernels the compiler does not count" in render(p)


def test_time_uses_the_arithmetic_when_the_compiler_counts_less():
    """The compiler counts a scanned loop's body once (--grad-accum) and no Pallas kernel."""
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(flops=1e12, model_flops_per_token=4 * 275e12 / 65536))
    assert p.model_flops == pytest.approx(275e12) and p.timing()["step_s_at_peak"] == pytest.approx(1.0)
    assert "times below use the arithmetic's" in render(p)


def test_a_batch_that_does_not_split_is_not_suggested():
    f = _figures(settings={"batch_size": 4, "grad_accum": 1, "steps": 10, "mesh": "", "n_head": 3})
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, f)
    assert P.suggest(p) == []
    assert "nothing this plan could try fits" in render(p)


def test_the_first_suggestion_is_compiled_too(monkeypatch):
    """On a local v4-8 whose chips have 28 MiB: a 1-layer model with batch 16 (~34 MiB per device) does not fit;
    the plan's first suggestion is compiled with the flags it names, and its compiled total is what it reports."""
    monkeypatch.setitem(catalog.GENERATIONS, "v4", dataclasses.replace(catalog.GENERATIONS["v4"],
                                                                       hbm_gib_per_chip=28 / 1024))
    argv = ["pretrain", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32", "--batch-size", "16",
            "--ckpt-dir", "/tmp/plan-ckpt"]
    p = P.plan("v4-8", argv, cpu_devices=True)
    assert not p.fits and p.suggestions and p.alternative is None  # a local slice is not resized
    first = p.suggestions[0]
    assert first.compiled_bytes is not None and first.compiled_bytes < p.total_bytes
    direct = P.plan("v4-8", [*argv, *first.change.split()], cpu_devices=True)
    assert direct.cached and direct.total_bytes == first.compiled_bytes and direct.fits == first.compiled_fits
    assert "(compiled: " in render(p)


def test_a_suggestion_the_compiler_refutes_is_followed_by_its_levers_next(monkeypatch):
    """Tensor parallelism over 2 is estimated to fit (18 GiB of state halved, 18 of activations: 27 of 32 GiB) but
    compiled needs 40; the plan then compiles the same lever's next change, model=4 (estimated 22.5), and shows
    both with their compiled totals: one more compile, only when the first is refuted (here compile_figures
    answers from given figures)."""
    levers = ["mesh_model"]
    main = _figures(temp_bytes=20 * P.GIB, total_bytes=36 * P.GIB, levers=levers)
    compiled = {"model=2": 40 * P.GIB, "model=4": 20 * P.GIB}
    asked = []

    def fake(a, argv, **kw):
        asked.append(argv[-1])
        mesh = next((m for m in compiled if argv[-1].endswith(m)), None)
        return (main if mesh is None else {**main, "total_bytes": compiled[mesh]}), False
    monkeypatch.setattr(P, "compile_figures", fake)
    p = P.plan("v4-8", ["pretrain", "--mesh", "data=4,model=1"], cpu_devices=True)
    assert asked == ["data=4,model=1", "data=2,model=2", "data=1,model=4"]
    assert [(s.change, s.estimate_bytes, s.compiled_bytes, s.compiled_fits) for s in p.suggestions] == [
        ("--mesh data=2,model=2", 27 * P.GIB, 40 * P.GIB, False),
        ("--mesh data=1,model=4", int(22.5 * P.GIB), 20 * P.GIB, True)]
    text = render(p)
    assert "estimated to fit, but compiled it does NOT: --mesh data=2,model=2" in text
    assert "would fit: --mesh data=1,model=4 (compiled: 20.00 GiB" in text
    # A first suggestion the compiler confirms: nothing more is compiled.
    compiled["model=2"] = 30 * P.GIB
    asked.clear()
    p = P.plan("v4-8", ["pretrain", "--mesh", "data=4,model=1"], cpu_devices=True)
    assert asked == ["data=4,model=1", "data=2,model=2"] and len(p.suggestions) == 1


# A 1-layer step with gpt2's dropout, 16 rows of 32 positions, on a local v4-8 (4 CPU devices).
TP_TINY = ["pretrain", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32", "--batch-size", "16",
           "--ckpt-dir", "/tmp/plan-ckpt"]


def test_a_model_mesh_that_holds_more_than_data_alone_names_what_grew(monkeypatch):
    """data=2,model=2 against the same step compiled on data=4 (the plan compiles both): model=2 holds more a
    device, because the dropout's keep masks are drawn for a data group's rows, twice data=4's, and its params
    shrink by less. The plan says so from the two compiled totals, and names the buffers that grew from the two
    programs' buffer assignments: the masks ([layers, rows, T, T] u32) at twice data=4's size, at their jax source.
    The comparison's compile is the data=4 plan's, from the cache; the pre-run gate compiles no comparison. Both
    compiled cold: a program from jax's compilation cache comes with no buffer assignment."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    p = P.plan("v4-8", [*TP_TINY, "--mesh", "data=2,model=2"], cpu_devices=True)
    d = P.plan("v4-8", [*TP_TINY, "--mesh", "data=4,model=1"], cpu_devices=True)
    assert d.cached and p.compared.figures == d.figures
    c = p.to_json()["mesh_check"]
    assert (c["mesh"], c["compared_mesh"]) == ("data=2,model=2", "data=4,model=1")
    assert c["this"]["total_bytes"] == p.total_bytes and c["compared"]["total_bytes"] == d.total_bytes
    assert c["more_bytes"] == p.total_bytes - d.total_bytes > 0
    assert c["this"]["params_bytes"] < c["compared"]["params_bytes"] and c["this"]["temp_bytes"] > \
        c["compared"]["temp_bytes"]
    grown = c["grown"]
    assert 1 <= len(grown) <= P.GROWN_SHOWN and all(b["grown_bytes"] > 0 for b in grown)
    top = grown[0]
    assert top["source"].startswith("trainer/models/gpt2.py:") and top["source"].endswith("(keep_masks)"), top
    assert top["shape"].startswith("u32[") and top["bytes"] == 2 * top["other_bytes"], top
    assert any((b["op_name"], b["bytes"]) == (top["op_name"], top["other_bytes"]) for b in d.figures["buffers"])
    note = P.mesh_note(p)
    assert note.startswith(f"data=2,model=2 holds {P.gib(c['more_bytes'])} MORE per device than data=4,model=1 "
                           f"(data alone): {P.gib(p.total_bytes)} against {P.gib(d.total_bytes)}")
    assert f"{top['shape']} {P.gib(top['bytes'])} ({P.gib(top['other_bytes'])} on data=4,model=1) at " \
        f"{top['source']}" in note
    text = render(p)
    assert f"  mesh: {note}" in text
    spent = p.time_spent()
    assert spent["compared"]["mesh"] == "data=4,model=1" and spent["compared"]["wall_s"] > 0
    assert spent["total_s"] == round(spent["step_s"] + spent["compared"]["wall_s"], 2)
    assert f"comparing with data=4,model=1 {spent['compared']['wall_s']:.0f}s" in text
    gate = P.plan("v4-8", [*TP_TINY, "--mesh", "data=2,model=2"], cpu_devices=True, alternatives=False)
    assert gate.cached and gate.compared is None and P.mesh_note(gate) is None and "mesh:" not in render(gate)


def test_a_model_mesh_that_holds_less_than_data_alone_says_so_and_names_nothing(monkeypatch):
    """Given figures: model=2 holds 2 GiB less than data alone; the note says so, names no buffer (one of its
    buffers is larger than data alone's, but nothing is an exception). A data-only step the trainer refuses is
    said, with the trainer's words; a model=1 plan compiles no comparison."""
    asked = []
    big = {"bytes": 2 * P.GIB, "shape": "bf16[8,512,2048]", "instruction": "fusion.1", "op_name": "jit(f)/dot",
           "source": "trainer/models/gemma.py:10 (mlp)"}

    def fake(a, argv, **kw):
        i = next(i for i, a in enumerate(argv) if a.startswith("--mesh"))
        mesh = argv[i].split("=", 1)[1] if "=" in argv[i] else argv[i + 1]
        asked.append(mesh)
        model = int(mesh.split("model=")[1])
        gib = P.GIB
        return _figures(mesh={"data": 4 // model, "model": model}, total_bytes=(22 - 2 * model) * gib,
                        temp_bytes=(16 - 2 * model) * gib, params_bytes=(4 - model) * gib,
                        buffers=[{**big, "bytes": big["bytes"] * model}]), False

    monkeypatch.setattr(P, "compile_figures", fake)
    p = P.plan("v4-8", ["pretrain", "--mesh", "data=2,model=2"], cpu_devices=True)
    assert asked == ["data=2,model=2", "data=4,model=1"]
    c = P.mesh_check(p)
    assert c["more_bytes"] == -2 * P.GIB and c["grown"] == []
    assert P.mesh_note(p) == ("data=2,model=2 holds 2.00 GiB less per device than data=4,model=1 (data alone): "
                              "18.00 GiB against 20.00 GiB (params 2.00 GiB against 3.00 GiB, temporaries 12.00 GiB "
                              "against 14.00 GiB; compiled, the compiler's count)")
    asked.clear()
    P.plan("v4-8", ["pretrain", "--mesh=data=4,model=1"], cpu_devices=True)
    assert asked == ["data=4,model=1"]

    def refuses(a, argv, **kw):
        if "data=4,model=1" in argv:
            raise P.PlanError("--batch-size 6 does not split over data=4")
        return fake(a, argv, **kw)

    monkeypatch.setattr(P, "compile_figures", refuses)
    p = P.plan("v4-8", ["pretrain", "--mesh", "data=2,model=2"], cpu_devices=True)
    assert p.compared is None and P.mesh_check(p)["error"] == "--batch-size 6 does not split over data=4"
    assert P.mesh_note(p) == "not compared with data=4,model=1: --batch-size 6 does not split over data=4"


def test_compare_mesh_sets_the_mesh_a_step_is_compared_with(monkeypatch):
    """--compare-mesh: a model=4 step against the mesh with half the model (what one more doubling of `model`
    costs: the model sweep's question), named as it is (not "data alone"), the grown buffers against it. A mesh
    that is not data=D,model=M, or the step's own --mesh, is refused before anything compiles; the trainer's
    default mesh named as the comparison compiles nothing more."""
    asked = []
    big = {"bytes": P.GIB, "shape": "f32[2,32,64,10240]", "instruction": "fusion.7", "op_name": "jit(f)/dot",
           "source": "trainer/models/lora.py:204 (apply)"}

    def fake(a, argv, **kw):
        mesh = next((argv[i + 1] for i, x in enumerate(argv) if x == "--mesh"), "data=4,model=1")
        asked.append(mesh)
        model = int(mesh.split("model=")[1])
        return _figures(mesh={"data": 4 // model, "model": model}, total_bytes=(10 + model) * P.GIB,
                        temp_bytes=(6 + model) * P.GIB, params_bytes=2 * P.GIB,
                        buffers=[{**big, "bytes": big["bytes"] * model}]), False

    monkeypatch.setattr(P, "compile_figures", fake)
    p = P.plan("v4-8", ["pretrain", "--mesh", "data=1,model=4"], cpu_devices=True, compare_mesh="data=2,model=2")
    assert asked == ["data=1,model=4", "data=2,model=2"]
    c = P.mesh_check(p)
    assert (c["compared_mesh"], c["more_bytes"]) == ("data=2,model=2", 2 * P.GIB)
    note = P.mesh_note(p)
    assert note.startswith("data=1,model=4 holds 2.00 GiB MORE per device than data=2,model=2: 14.00 GiB against "
                           "12.00 GiB"), note
    assert "data alone" not in note and "f32[2,32,64,10240] 4.00 GiB (2.00 GiB on data=2,model=2) at " \
        "trainer/models/lora.py:204 (apply)" in note
    assert p.time_spent()["compared"]["mesh"] == "data=2,model=2"
    for bad, says in (("2x4", "give a mesh of the slice as data=D,model=M"), ("data=1,model=4", "own --mesh")):
        asked.clear()
        with pytest.raises(UserError, match=says):
            P.plan("v4-8", ["pretrain", "--mesh", "data=1,model=4"], cpu_devices=True, compare_mesh=bad)
        assert asked == []
    asked.clear()
    p = P.plan("v4-8", ["pretrain"], cpu_devices=True, compare_mesh="data=4,model=1")
    assert asked == ["data=4,model=1"] and p.compared is None and "own (default) mesh" in P.mesh_note(p)
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--compare-mesh", "2x4", "--", "pretrain"])
    assert res.exit_code == 1 and _error_lines(res) == [
        "Error: --compare-mesh 2x4: give a mesh of the slice as data=D,model=M, e.g. --compare-mesh data=4,model=2"]
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--compare-mesh", "data=4,model=1", "--num-slices", "2",
                                   "--", "pretrain"])
    assert res.exit_code == 1 and "--compare-mesh compares meshes of one slice" in res.output
    assert asked == ["data=4,model=1"]  # neither compiled anything


def test_the_buffers_that_grew_are_matched_by_jax_source_across_meshes():
    """The buffer assignment as the TPU compiler writes it: arguments, thread-local scalars and other memory
    spaces (VMEM: color 1) are not a device's HBM temporaries; an aliased output is one place. Across meshes a
    buffer is matched by its jax op and source (shapes differ); one not among the other's listed is compared with
    the smallest listed there."""
    from trainer.common import buffers as B
    text = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <2 reduce_sum.2 @0> (size=512,offset=0): f32[]{:T(128)}
allocation 1: size 1048576, parameter 0, shape |f32[256,1024]| at ShapeIndex {}:
 value: <20 param @0> (size=1048576,offset=0): f32[256,1024]{1,0:T(8,128)}
allocation 2: size 512, output shape is |f32[]|, maybe-live-out:
 value: <36 convolution_reduce_fusion @0> (size=512,offset=0): f32[]{:T(128)}
 value: <37 all-reduce @0> (size=512,offset=0): f32[]{:T(128)}
allocation 8: size 115200, preallocated-temp:
 value: <23 slice-start{} @0> (size=512,offset=114688): ((f32[256,1024]{1,0:T(8,128)}), s32[]{:S(2)})
 value: <24 copy.3 @0> (size=98304,offset=0): bf16[48,1024]{1,0:T(8,128)(2,1)}
allocation 10: size 3670016, color 1, preallocated-temp:
 value: <22 all-gather.6 @1> (size=2097152,offset=0): bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)}
"""
    assert B.assigned(text) == [
        {"instruction": "convolution_reduce_fusion", "index": "", "bytes": 512, "shape": "f32[]"},
        {"instruction": "slice-start", "index": "{}", "bytes": 512, "shape": "((f32[256,1024]), s32[])"},
        {"instruction": "copy.3", "index": "", "bytes": 98304, "shape": "bf16[48,1024]"}]
    one = lambda n, op, src="a.py:1 (f)": {"bytes": n, "shape": "f32[n]", "instruction": "x", "op_name": op,  # noqa
                                           "source": src}
    fewer = [one(400, "jit(f)/dot"), one(300, "copy of a loop's carried value (get-tuple-element.12)", ""),
             *[one(100, f"op{i}") for i in range(B.KEEP - 2)]]
    more = [one(800, "jit(f)/dot"), one(900, "copy of a loop's carried value (get-tuple-element.70)", ""),
            one(350, "jit(f)/new"), one(80, "op3")]
    got = B.grown(more, fewer)
    assert [(g["op_name"], g["other_bytes"], g["grown_bytes"]) for g in got] == [
        ("copy of a loop's carried value (get-tuple-element.70)", 300, 600), ("jit(f)/dot", 400, 400),
        ("jit(f)/new", None, 250)]


def test_larger_sizes_and_a_resized_mesh_for_the_next_slice():
    assert [a.name for a in P._larger(catalog.lookup("v4-256"))] == ["v4-512", "v4-1024", "v4-2048", "v4-4096"]
    assert P._larger(catalog.lookup("v5litepod-256")) == []
    f = _figures(mesh={"data": 2, "model": 2})
    assert P._with_mesh(["pretrain", "--mesh", "data=2,model=2", "--x"], 8, f) == \
        ["pretrain", "--mesh", "data=4,model=2", "--x"]
    assert P._with_mesh(["pretrain", "--mesh=data=2,model=2"], 16, f) == ["pretrain", "--mesh=data=8,model=2"]
    assert P._with_mesh(["pretrain"], 16, f) == ["pretrain"]  # no --mesh: the trainer puts every device on data


def test_plan_help_explains_every_flag_and_the_exit_codes():
    cmd = cli.commands["plan"]
    text = CliRunner().invoke(cli, ["plan", "--help"]).stdout
    for p in cmd.params:
        if p.param_type_name == "option":
            assert p.help and len(p.help) > 10 and p.opts[-1] in text, p.opts
    flat = " ".join(text.split())
    assert "Exit 0: fits; 3: does not fit" in flat and "tpuctl[plan]" in flat


# ---- must-show 5: bad input ------------------------------------------------------------------------------------

def _planner_answers_before_jax(accelerator: str, argv: list[str]) -> None:
    """The planner process the gate starts (P._aot_argv), run as the gate runs it: it says there is nothing to plan
    (exit NOTHING_TO_PLAN) with jax never imported, so neither jax nor libtpu started for the answer."""
    planner = P._aot_argv(catalog.lookup(accelerator), cpu_devices=False)
    assert planner[1:3] == ["-m", "trainer.plan"], planner
    r = subprocess.run([sys.executable, "-c", "import sys; from trainer import plan; rc = plan.main(sys.argv[1:]); "
                        "print(rc, 'jax' in sys.modules)", *planner[3:], "--", *argv], capture_output=True,
                       text=True, timeout=120, cwd=Path(P.__file__).resolve().parents[2])
    from trainer.common.aot import NOTHING_TO_PLAN
    assert r.stdout.split() == [str(NOTHING_TO_PLAN), "False"], r.stdout + r.stderr


def _error_lines(res) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]


def test_unknown_accelerator_is_one_line_with_the_closest_names():
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-9", "--", *TINY])
    assert res.exit_code == 1 and _error_lines(res) == ["Error: unknown accelerator type 'v4-9'; did you mean "
                                                        "v4-8, v4-4096, v4-64?"]


def test_trainer_args_the_trainer_rejects_give_its_own_message_once():
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--local", "--", *TINY, "--n-head", "3"])
    assert res.exit_code == 1, res.output
    assert _error_lines(res) == ["Error: --d-model 128 is not divisible by --n-head 3"]
    assert res.output.count("not divisible by --n-head") == 1 and "Traceback" not in res.output
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--local", "--", "pretrain", "--no-such-flag"])
    assert res.exit_code == 1 and _error_lines(res) == ["Error: unrecognized arguments: --no-such-flag"]
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--local", "--", "prepare", "--out", "/tmp/x"])
    assert res.exit_code == 1 and "`prepare` has no train step to plan" in _error_lines(res)[0]
    assert P.gate("v4-8", ["prepare", "--out", "/tmp/x"], cpu_devices=False) is None  # run/up launch it unplanned
    _planner_answers_before_jax("v4-8", ["prepare", "--out", "/tmp/x"])
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--mfu", "0", "--", *TINY])
    assert res.exit_code == 1 and "--mfu 0.0: give a fraction in (0, 1]" in _error_lines(res)[0]
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8"])
    assert res.exit_code == 1 and "nothing to plan" in _error_lines(res)[0]


def test_without_the_plan_extra_the_cpu_compiler_stands_in_and_says_so(tmp_path, monkeypatch):
    """libtpu hidden from the planner's process (a package of that name that fails to import, first on its path)."""
    shim = tmp_path / "no-libtpu" / "libtpu"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('the plan extra is not installed')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim.parent), str(Path(__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--no-cache", "--", *TINY])
    assert res.exit_code == 0, res.output
    assert "ESTIMATE from the CPU compiler" in res.stdout and "pip install 'tpuctl[plan]'" in res.stdout
    assert "bfloat16 compute" in res.stdout  # planned as the TPU run will be, not as this CPU would run it
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--json", "--", *TINY])  # the estimate, from the cache
    out = json.loads(res.stdout)
    assert out["estimate"] is True and out["compiler"] == P.ESTIMATE and "tpuctl[plan]" in out["label"]
    assert out["fits"] is True and "estimate" in out["verdict"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_while_compiling_stops_the_compile_too(home, sig):
    """SIGINT (Ctrl-C) or SIGTERM (`kill`) to `tpuctl plan` mid-compile: one line, exit 130, and the trainer's
    compile process is gone."""
    env = {**os.environ, "TPUCTL_HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "plan", "-a", "v4-8", "--local", "--", *TINY],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, child = time.monotonic() + 60, None
    while child is None and time.monotonic() < deadline:  # wait until the compile process runs
        out = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "trainer.plan"], capture_output=True, text=True)
        child = int(out.stdout.split()[0]) if out.stdout.split() else None
        time.sleep(0.1)
    assert child is not None
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "Error: interrupted", err
    deadline = time.monotonic() + 60  # waits for the event (no measure): a loaded machine's room
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}")
    assert not list(home.glob("plans/*.json"))  # nothing cached from a compile that did not finish


def _processes_with(env_entry: str) -> list[int]:
    """This user's processes whose environment holds env_entry (e.g. a test's own TPUCTL_HOME)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if env_entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append(int(pid))
        except OSError:
            continue
    return out


def test_a_compile_past_the_hosts_memory_is_stopped_in_one_line_with_no_process_left(home, monkeypatch):
    """The plan's compile watched for host memory (orchestrator/plan/memory_watch.py): past a cap on its resident
    memory (here 150 MB, which the tiny CPU plan's process passes while jax loads), or with the machine's available
    memory under the reserve a plan keeps free (here more than the machine has), its process group is stopped and
    the plan fails in one line naming the step, what it reached, what the machine has and what to do; exit 1,
    nothing cached, no process left. A compile killed from outside (the OOM killer's first choice: its
    oom_score_adj is 1000) is said to be so. A plan that finishes says what its compile held at its peak."""
    from orchestrator.plan import memory_watch
    monkeypatch.setenv(memory_watch.MAX_RSS_ENV, "150")
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--local", "--", *TINY])
    assert res.exit_code == 1, res.output
    [line] = _error_lines(res)
    assert line.startswith("Error: stopped compiling `pretrain --preset gpt2-tiny` for v4-8: it reached "), line
    assert f"GB of host memory, over the 0.15 GB {memory_watch.MAX_RSS_ENV} allows (this machine has " in line
    # the user's own cap stopped it: the fix is theirs to raise, not other programs to close
    assert f"available); raise {memory_watch.MAX_RSS_ENV} (or unset it) if this machine has the memory, or plan a " \
           "smaller step" in line and "close other programs" not in line
    marker = f"TPUCTL_HOME={home}"
    assert not _processes_with(marker) and not list(home.glob("plans/*.json"))
    monkeypatch.delenv(memory_watch.MAX_RSS_ENV)
    monkeypatch.setenv(memory_watch.RESERVE_ENV, str(memory_watch.meminfo()["MemTotal"] // memory_watch.MB + 1))
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--local", "--", *TINY])
    assert res.exit_code == 1 and "GB a plan leaves free (TPUCTL_PLAN_RESERVE_MB); close other" in _error_lines(res)[0]
    assert not _processes_with(marker)
    monkeypatch.setenv(memory_watch.RESERVE_ENV, "lots")
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--local", "--", *TINY])
    assert _error_lines(res) == ["Error: TPUCTL_PLAN_RESERVE_MB=lots: give megabytes, e.g. "
                                 "TPUCTL_PLAN_RESERVE_MB=2048"] and not _processes_with(marker)
    monkeypatch.delenv(memory_watch.RESERVE_ENV)
    # killed by someone else (the kernel's OOM killer, whose first choice the compile is): said so, in one line

    scores = []

    def kill_the_compile(msg):
        for pid in _processes_with(marker):
            if b"trainer.plan" in Path(f"/proc/{pid}/cmdline").read_bytes():
                scores.append(int(Path(f"/proc/{pid}/oom_score_adj").read_text()))
                os.kill(pid, signal.SIGKILL)
    with pytest.raises(P.PlanError, match=r"^the compile of `pretrain --preset gpt2-tiny` for v4-8 was killed \(SIGKILL\) "
                                          r"at .* GB of host memory, most likely by the kernel for want of memory; "
                                          "close other programs"):
        P.compile_figures(catalog.lookup("v4-8"), TINY, cpu_devices=True, progress=kill_the_compile, use_cache=False)
    assert scores == [1000] and not _processes_with(marker)
    res = CliRunner().invoke(cli, ["plan", "-a", "v4-8", "--local", "--json", "--", *TINY])
    spent = json.loads(res.stdout)["time_spent"]
    assert 150 * memory_watch.MB < spent["peak_rss_bytes"] == spent["step_peak_rss_bytes"] < 20e9
    assert f"host memory: {memory_watch.gb(spent['peak_rss_bytes'])} at the peak of a compile process" in render(
        P.Plan(catalog.lookup("v4-8"), P.CPU, {**_figures(), "wall_s": 9.0,
                                                "host_peak_rss_bytes": spent["peak_rss_bytes"]}))


# ---- the gate before `up` creates a slice ---------------------------------------------------------------------

def test_up_with_plan_refuses_a_step_that_does_not_fit_and_creates_nothing(monkeypatch, tiny_plans):
    """The step's figures are the local plan's above (cached); the verdict is against the catalog, 10 MiB a chip."""
    home = tiny_plans
    monkeypatch.setenv("TPUCTL_HOME", str(home))
    tiny = dataclasses.replace(catalog.GENERATIONS["v5litepod"], hbm_gib_per_chip=0.01)
    monkeypatch.setitem(catalog.GENERATIONS, "v5litepod", tiny)
    res = CliRunner().invoke(cli, ["up", "planned", "--local", "-a", "v5litepod-8", "--plan", "--", *TINY])
    assert res.exit_code == 1, res.output
    line = _error_lines(res)[0]
    assert "plan: does NOT fit on v5litepod-8" in line and "of 10.2 MiB HBM per device" in line
    assert "leaving out --plan skips this check" in line
    assert state.records() == {} and not (home / "local").exists()  # no slice, not even the stand-in started


def test_the_tpu_compilers_out_of_memory_refusal_becomes_a_plan():
    """libtpu's words when a step does not fit (seen compiling gpt2-350m for v4-8) -> figures plan.py can judge."""

    sds = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)  # 4 MiB, no sharding: all on the one device
    built = aot.Built(compile=lambda: None, params={"w": sds}, opt_state={"m": sds, "v": sds}, tokens_per_step=8,
                      model_flops_per_token=1.0, mesh={"data": 1, "model": 1}, dtype="bfloat16",
                      settings={"batch_size": 8, "grad_accum": 1, "steps": 1, "mesh": "", "n_head": 1}, levers=())
    target = aot.Target(jax.devices()[:1], 1, "tpu")
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (34.18G) "
           "exceeds available HBM (30.75G).")
    f = aot.out_of_memory(built, target, msg, 1.0)
    assert f["temp_bytes"] == int(34.18 * P.GIB) and f["total_bytes"] == int(34.18 * P.GIB) + 12 * 2 ** 20
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, f)
    assert not p.fits and "usable" in p.verdict() and "30.75 GiB usable" in render(p)
    f = aot.out_of_memory(built, target, "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 40.5G of "
                                         "15.48G hbm. Exceeded hbm capacity by 25.02G.", 1.0)
    assert f["total_bytes"] == int(40.5 * P.GIB) and f["oom"]["available_bytes"] == int(15.48 * P.GIB)


# ---- must-show 4: `tpuctl run` on a local slice, refused by the plan; --no-plan overrides ----------------------

@pytest.mark.recorded_plans
@pytest.mark.e2e
@needs_hosts
def test_run_on_a_local_slice_refused_by_the_plan_and_no_plan_overrides(tmp_path, monkeypatch, home):
    """A local v4-8 (one real sshd host, 4 emulated devices) whose catalog entry has 1 MiB of HBM per chip: the
    trainer step is planned for it (the CPU compiler, as the host runs it) and refused before anything reaches
    the host; with --no-plan the same command runs to the end."""
    home.mkdir(parents=True)
    (TEST_CACHE / "wheelhouse").mkdir(parents=True, exist_ok=True)
    (home / "wheelhouse").symlink_to(TEST_CACHE / "wheelhouse")  # the machine's dependency wheels, filled once
    with local_mode(home, monkeypatch) as (environ, _):
        up = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", "planrun", "--local", "-a", "v4-8"],
                            capture_output=True, text=True, timeout=120, env=environ)
        assert up.returncode == 0, up.stderr
        real = catalog.GENERATIONS["v4"]
        monkeypatch.setitem(catalog.GENERATIONS, "v4", dataclasses.replace(real, hbm_gib_per_chip=1 / 1024))
        cmd = ["planrun", "--local", "--", "pretrain", "--n-layer", "1", "--n-head", "2", "--d-model", "32",
               "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--warmup-steps", "1", "--decay-steps", "10",
               "--log-every", "1", "--eval-batches", "1", "--ckpt-dir", "/tmp/planrun"]
        res = CliRunner().invoke(cli_run.run, cmd)
        assert res.exit_code == 1, res.output
        assert "plan: does NOT fit on v4-8" in res.output and "of 1.0 MiB HBM per device" in res.output
        assert "--no-plan skips this check" in res.output
        assert not (home / "runs").exists()  # nothing was launched
        res = CliRunner().invoke(cli_run.run, ["--no-plan", *cmd])
        assert res.exit_code == 0, res.output
        assert "done: step 2" in res.output and "plan:" not in res.output
        monkeypatch.setitem(catalog.GENERATIONS, "v4", real)  # 32 GiB again: the same plan (cached) passes
        res = CliRunner().invoke(cli_run.run, cmd)
        assert res.exit_code == 0 and "[tpuctl] plan: fits on v4-8" in res.output, res.output
        assert "already at step 2" in res.output


def test_the_step_time_is_the_calibrated_estimate_by_class_of_work_and_the_roofline_its_lower_bound(monkeypatch):
    """gpt2-124m at 8 sequences on one v5e chip, as the compiler counted it (work by class: XLA's matmuls 6.115
    TFLOP, splash 0.928 TFLOP at head_dim 64, 13.5 GB of elementwise bytes; 37.0 GB in all): each class at the
    rate the chip did it (trainer/common/calibration.py) gives the 60.4 ms the chip measured within 10%, where the
    roofline gave 45 ms. On v6e, not measured, the same efficiencies at its peak, and said so."""
    from trainer.common import calibration
    work = {"matmul_flops": 6.115e12, "attention_flops": 0.928e12, "head_dim": 64, "loss_kernel_flops": 0.0,
            "other_bytes": 13.5e9}
    f = _figures(device_kind="TPU v5 lite", devices=1, mesh={"data": 1, "model": 1}, flops=6.115e12,
                 bytes_accessed=37.0e9, tokens_per_step=8192, model_flops_per_token=854e6, work=work,
                 total_bytes=4 * P.GIB)
    p = P.Plan(catalog.lookup("v5litepod-1"), P.TPU, f)
    t = p.timing()
    assert t["estimate"] == "calibrated" and t["calibrated"]["measured"]
    assert abs(t["step_s"] / 0.0604 - 1) <= 0.10, t["step_s"]
    assert t["roofline_step_s"] == pytest.approx(37.0e9 / 819e9) and t["roofline_step_s"] < t["step_s"]
    terms = t["calibrated"]["terms"]
    assert terms["matmul"] == pytest.approx(6.115e12 / calibration.V5E.matmul_flops_s)
    assert terms["attention"] == pytest.approx(0.928e12 / calibration.V5E.attention_flops_s[64])
    text = render(p)
    assert "calibrated (matmul" in text and "measured on this chip kind" in text and "roofline (a lower bound)" in text
    v6e = P.Plan(catalog.lookup("v6e-1"), P.TPU, {**f, "device_kind": "TPU v6 lite"}).timing()
    assert not v6e["calibrated"]["measured"] and v6e["step_s"] < t["step_s"]
    # The resident attention kernel at the rate v5e timed it at (faster than splash), measured.
    resident = {**f, "work": {**work, "attention_kernel": "resident"}}
    res = P.Plan(catalog.lookup("v5litepod-1"), P.TPU, resident).timing()
    assert res["calibrated"]["measured"] and res["step_s"] < t["step_s"]
    assert res["calibrated"]["terms"]["attention"] == pytest.approx(0.928e12 / calibration.V5E.resident_flops_s[64])
    # Rates without the resident kernel's (a chip that has not timed it): splash's, and said so.
    monkeypatch.setitem(calibration.MEASURED, "TPU v5 lite",
                        dataclasses.replace(calibration.V5E, resident_flops_s={}))
    untimed = P.Plan(catalog.lookup("v5litepod-1"), P.TPU, resident)
    assert untimed.timing()["step_s"] == pytest.approx(t["step_s"]) and not untimed.timing()["calibrated"]["measured"]
    assert "NOT measured: the resident attention kernel, at splash's rate" in render(untimed)
    # The experts' grouped matmuls (ragged_dot) at their own measured rate, out of the matmul class: slower
    # (the rate the chip measured at the step's rows an expert: 128 on one chip, 512 a device's experts under
    # expert parallelism on v4-8, 1,024 on v5litepod-8; between two measured points along the log of the rows, the
    # ends' rates outside them)
    for rows, rate in ((128, 30.5e12), (512, 63.7e12), (1024, 83.0e12), (4096, 78.6e12), (64, 30.5e12),
                       (512 * 2 ** 0.5, 63.7e12 + 0.5 * (83.0e12 - 63.7e12))):
        moe = {**f, "work": {**work, "matmul_flops": 4.115e12, "grouped_matmul_flops": 2e12,
                             "grouped_rows_per_expert": rows}}
        g = P.Plan(catalog.lookup("v5litepod-1"), P.TPU, moe).timing()
        assert g["calibrated"]["terms"]["grouped matmul"] == pytest.approx(2e12 / rate)
        assert g["calibrated"]["measured"] and g["step_s"] > t["step_s"]


def test_host_bounds_fit_a_topology_smaller_than_a_4_chip_host():
    """libtpu refuses chips-per-host bounds larger than the topology: one chip is a 1,1,1 host."""
    from trainer.common.config import UsageError
    assert aot.host_bounds("v5e:1x1") == (1, 1, 1)
    assert aot.host_bounds("v5e:2x4") == aot.host_bounds("v4:2x2x1") == (2, 2, 1)
    assert aot.host_bounds("v5e:2x4", "2,4,1") == (2, 4, 1)
    with pytest.raises(UsageError, match="GEN:TOPOLOGY"):
        aot.host_bounds("v5e")
    with pytest.raises(UsageError, match="X,Y,Z"):
        aot.host_bounds("v5e:1x1", "two")


def test_a_refused_step_says_what_was_refused_not_zero_tflop_or_cost():
    """The compiler refused the step (out of HBM): nothing was counted, so the plan shows the refusal where the
    compute, step time and cost would be, never 0 TFLOP or $0.00; a run without --steps gets no total."""
    msg = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 40G of 15.75G hbm."
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(flops=0.0, bytes_accessed=0.0,
                                                       oom={"message": msg, "available_bytes": 15 * P.GIB}))
    text = render(p)
    assert "0 TFLOP" not in text and "$0.00" not in text and "0.00 h" not in text
    assert f"the compiler refused the step before counting it ({msg})" in text
    no_steps = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(temp_bytes=10 * P.GIB, total_bytes=16 * P.GIB,
                                                               settings={**_figures()["settings"], "steps": 0}))
    text = render(no_steps)
    assert "--steps not given" in text and "0 steps" not in text


def test_the_largest_batch_that_fits_and_where_the_plans_time_went():
    """fixed 8 GiB + 32 GiB of activations for 16 rows a device (64 over data=4): 2 GiB a row, so 12 rows fill
    the 32 GiB of a v4 device; the line says it is extrapolated. The plan's time: the step's planner process with
    its phases inside, then each compiled suggestion."""
    p = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(
        wall_s=70.0, phases={"start": 5.0, "compile": 60.0},
        compile_phases={"lowering": 2.0, "optimizations": 14.0, "code generation": 40.0, "the rest": 4.0}))
    big = P.largest_batch(p)
    assert (big["rows"], big["per"], big["batch_size"], big["estimate_bytes"]) == (12, "device", 48, 32 * P.GIB)
    assert "extrapolated" in big["how"] and "not compiled" in big["how"]
    p.suggestions = [P.Suggestion("--grad-accum 2", 26 * P.GIB, "", compile_wall_s=50.0)]
    spent = p.time_spent()
    assert spent["total_s"] == 120.0 and spent["step_phases"] == {"start": 5.0, "compile": 60.0}
    text = render(p)
    assert "largest batch that fits: 12 row(s) a device (--batch-size 48), about 32.00 GiB" in text
    assert ("this plan took 120s: the step's compile 70s (start 5s, compile 60s [lowering 2s, optimizations 14s, code "
            "generation 40s, the rest 4s]); checking --grad-accum 2 50s") in text
    assert "most of the compile" not in text  # within the two minutes: nothing to explain
    slow = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(wall_s=130.0, phases={"compile": 120.0},
                                                          compile_phases={"code generation": 90.0}))
    assert "most of the compile is libtpu generating the TPU's code" in render(slow)
    assert P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(wall_s=70.0), cached=True).time_spent()["total_s"] == 0
    # one row a device compiled: that row is the figure, said to be a lower bound (nothing to extrapolate from)
    one = P.Plan(catalog.lookup("v4-8"), P.TPU, _figures(settings={**_figures()["settings"], "batch_size": 4},
                                                          temp_bytes=10 * P.GIB, total_bytes=16 * P.GIB))
    low = P.largest_batch(one)
    assert one.fits and (low["rows"], low["batch_size"], low["lower_bound"]) == (1, 4, True)
    assert "at least this" in low["how"] and "--batch-size 8" in low["how"]


def test_a_compiles_phases_are_read_from_when_the_compiler_wrote_its_dump_files(tmp_path):
    """lowering until the program was handed over, optimizations until its buffer assignment, code generation until
    the TPU's program, the rest to the end; the step's files, not a small helper's compiled beside it; a file the
    compiler did not write (the CPU compiler's generated program) gives its time to the next phase there."""
    def write(name, at, size=1):
        f = tmp_path / name
        f.write_text("x" * size)
        os.utime(f, (at, at))
    began = 1000.0
    step, helper = "module_0001.jit__train_step", "module_0000.jit_helper"
    write(helper + ".before_optimizations.txt", 1001.0)
    write(helper + ".after_optimizations-buffer-assignment.txt", 1001.5)
    write(step + ".before_optimizations.txt", 1003.0)
    write(step + ".after_optimizations-buffer-assignment.txt", 1020.0, size=100)
    write(step + ".after_codegen.txt", 1070.0)
    assert aot.compile_phases(str(tmp_path), began, 1076.0) == {
        "lowering": 3.0, "optimizations": 17.0, "code generation": 50.0, "the rest": 6.0}
    (tmp_path / (step + ".after_codegen.txt")).unlink()
    assert aot.compile_phases(str(tmp_path), began, 1076.0) == {"lowering": 3.0, "optimizations": 17.0,
                                                                "the rest": 56.0}
    assert aot.compile_phases(str(tmp_path / "none"), began, 1076.0) == {}


def test_the_largest_batch_counts_rows_over_what_holds_them_on_any_data_by_model_mesh():
    """The batch splits over data only: with model > 1 a data group's devices hold its rows together, so the
    figure is rows a data group, and with data=1 the whole step's (gemma4-26b-a4b at data=1,model=8 had said "94
    rows a device" for 94 rows of the step). Each mesh here compiled 16 rows of what holds them into 32 GiB of a
    device's activations (2 GiB a row): 12 rows fit the 32 GiB chip beside the 8 GiB fixed, and --batch-size is
    12 times the data groups (and micro-batches)."""
    def big(mesh, batch, **settings):
        f = _figures(mesh=mesh, settings={**_figures()["settings"], "batch_size": batch, **settings})
        p = P.Plan(catalog.lookup("v4-8"), P.TPU, f)
        return P.largest_batch(p), render(p)
    by_device, text = big({"data": 4, "model": 1}, 64)
    assert (by_device["rows"], by_device["per"], by_device["batch_size"]) == (12, "device", 48)
    assert "12 row(s) a device (--batch-size 48)" in text
    step, text = big({"data": 1, "model": 4}, 16)
    assert (step["rows"], step["per"], step["devices_per_group"], step["batch_size"]) == (12, "step", 4, 12)
    assert step["estimate_bytes"] == 32 * P.GIB and "at 16 row(s) a step" in step["how"]
    assert ("largest batch that fits: 12 row(s) a step (data=1: its 4 devices hold every row, split over model) "
            "(--batch-size 12)") in text and "a device (--batch-size" not in text
    group, text = big({"data": 2, "model": 2}, 32)
    assert (group["rows"], group["per"], group["devices_per_group"], group["batch_size"]) == (12, "data group", 2, 24)
    assert "12 row(s) a data group (2 devices hold its rows, split over model) (--batch-size 24)" in text
    # micro-batches at data=1: a data group's rows (a micro-batch's), no longer the step's
    accum, _ = big({"data": 1, "model": 4}, 32, grad_accum=2)
    assert (accum["rows"], accum["per"], accum["batch_size"]) == (12, "data group", 24)


def test_a_scanned_step_gathers_one_layers_base_at_a_time():
    """settings scan_layers 1 (Gemma's layers in nested scans, recomputed): of a 2 GiB base shard on data=4, the
    gathered copy is one of 12 layers' 6 GiB twice (the layer's forward recomputed, and its backward), not all."""
    s = {"batch_size": 64, "grad_accum": 1, "fsdp": True, "n_layer": 12}
    whole = _figures(params_bytes=2 * P.GIB, grad_bytes=0, settings=s)
    layer = _figures(params_bytes=2 * P.GIB, grad_bytes=0, settings={**s, "scan_layers": 1})
    assert P._gathered(whole) == 6 * P.GIB and P._gathered(layer) == P.GIB
    assert P._split(layer)[1] - P._split(whole)[1] == 6 * P.GIB - P.GIB
    # only the layers' weights are gathered (settings gathered_share): not the embedding tables, nor the experts
    # that expert parallelism keeps on their devices, most of 26B-A4B's base
    quarter = _figures(params_bytes=2 * P.GIB, grad_bytes=0, settings={**s, "scan_layers": 1, "gathered_share": 0.25})
    assert P._gathered(quarter) == P.GIB // 4
    from trainer.models import gemma
    moe, e2b = gemma.SIZES["gemma4-26b-a4b"], gemma.SIZES["gemma4-e2b"]
    assert gemma.gathered_share(moe, True) < 0.1 and 0.9 < gemma.gathered_share(moe, False) < 1
    assert 0.3 < gemma.gathered_share(e2b, False) < 0.5  # its per-layer embedding table is half its base


@needs_libtpu
def test_remat_auto_writes_the_step_out_where_it_fits_and_scans_it_where_not():
    """--remat auto on the TPU topologies the plan compiles for (libtpu's devices, nothing compiled): Gemma 4's
    written-out step (the chip's faster one) where its estimated bytes fit under AUTO_FIT of a chip's HBM, its
    layers in scans with full recompute where not and for the experts; Gemma 2 and 3 always written out; a named
    policy as it is. The estimate stands beside the compiler's counts at 4 rows of 512 on v5litepod-8: the
    written-out steps of e2b (11.49 GiB, fits) and e4b (15.91 of 16 GiB: no headroom) and 31B (46 GiB)."""
    from jax.experimental import topologies

    def resolved(topology, chips, size, rows, remat="auto"):
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name="default",
                                            chips_per_host_bounds=aot.host_bounds(topology), num_slices=1)
        mesh = mesh_lib.make_mesh({"data": chips, "model": 1}, list(desc.devices))
        run = LoraRun(weights="-", data="-", ckpt_dir="-", model=size, batch_size=rows * chips,
                      base_dtype="bfloat16", remat=remat)
        return finetune.remat_of(run, gemma.SIZES[size], mesh, rows * chips)

    assert resolved("v5e:2x4", 8, "gemma4-e2b", 4)[0] == "none"
    remat, why = resolved("v5e:2x4", 8, "gemma4-e4b", 4)
    assert remat == "full" and "would need" in why and "of 16 a device" in why
    assert resolved("v5e:2x4", 8, "gemma4-31b", 1)[0] == "full"
    assert resolved("v5e:2x4", 8, "gemma4-26b-a4b", 1)[0] == "full"
    assert resolved("v5e:1x1", 1, "gemma4-e2b", 1)[0] == "none"  # the chip's row: 41.4 ms written out
    assert resolved("v5e:2x4", 8, "gemma3-1b", 64)[0] == "none"
    assert resolved("v5e:2x4", 8, "gemma4-31b", 4, remat="dots") == ("dots", "--remat dots")
    assert finetune.written_out_bytes(gemma.SIZES["gemma4-e2b"], 2048) / 2 ** 30 == pytest.approx(12.2, abs=0.1)


@needs_libtpu
def test_a_lora_step_on_a_tpu_slice_is_compiled_without_collective_matmuls():
    """finetune.Steps.compile (the run's compile and the plan's) hands the compiler step_compiler's options: on
    v5e:2x4 a tiny scanned Gemma 4 LoRA step (2 layers, 2 rows of 512 a device) has no windowed einsum, where the
    same step with the partitioner's threshold at 0 has their loops (the proof the option is what keeps them
    out); the eval step too. One device or the CPU compiler gets no libtpu flag."""
    from jax.experimental import topologies
    from _gemma_ckpt import TINY4
    from trainer.common import step_compiler
    assert step_compiler.options("cpu", 8) == {} and step_compiler.options("tpu", 1) == {}
    desc = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4", chip_config_name="default",
                                        chips_per_host_bounds=aot.host_bounds("v5e:2x4"), num_slices=1)
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1}, list(desc.devices))
    cfg = dataclasses.replace(TINY4["dense"], d_model=64, ff=256, vocab=1024, n_layers=2)
    run = LoraRun(weights="-", data="-", ckpt_dir="-", model="gemma4-31b", targets="all", rank=8, seq_len=512,
                  batch_size=16, base_dtype="bfloat16", remat="full")

    def windowed_loops(options):
        steps = finetune.Steps(run, cfg, mesh, 10, 16)
        steps.compile(steps.abstract_base(jnp.bfloat16), options)
        return steps.compiler_options, steps.train_fn.as_text().count("windowed_dot_general")

    own, none = windowed_loops(None)
    assert own == step_compiler.NO_WINDOWED_EINSUM and none == 0
    assert windowed_loops({step_compiler.WINDOWED_EINSUM_THRESHOLD_MIB: 0})[1] > 0
    # the eval step (jit-compiled at its first call) takes the same options (its forward has such loops without)
    steps = finetune.Steps(run, cfg, mesh, 10, 16)
    lora, _, base, batch, _ = steps._train_args(steps.abstract_base(jnp.bfloat16))
    with jax.set_mesh(mesh):
        lowered = steps._eval.lower(lora, base, batch)
        assert lowered.compile().as_text().count("windowed_dot_general") == 0
        assert lowered.compile({step_compiler.WINDOWED_EINSUM_THRESHOLD_MIB: 0}).as_text().count(
            "windowed_dot_general") > 0


def test_a_step_counted_a_loop_body_once_takes_its_matmuls_from_the_arithmetic():
    """A scanned step's compiler count has one layer of each kind's matmuls: the calibrated time's matmul work is
    then the model's arithmetic (less the splash kernel's share), and says so; a program counted whole keeps the
    compiler's."""
    from trainer.common import aot
    built = aot.Built(compile=None, params=None, opt_state=None, tokens_per_step=1000, model_flops_per_token=1e9,
                      mesh={}, dtype="bfloat16", settings={}, levers=(), kernel_attention_flops_per_token=1e8,
                      head_dim=256)
    figures = {"devices": 4, "flops": 1e11, "counted": "loop bodies once"}
    low = aot.work(built, figures, "")
    assert low["matmul_flops"] == pytest.approx((1e9 - 1e8) * 1000 / 4) and "arithmetic" in low["matmul_flops_from"]
    whole = aot.work(built, {**figures, "counted": "program"}, "")
    assert whole["matmul_flops"] == 1e11 and "matmul_flops_from" not in whole
    # under --remat full the layers' forward runs again: the arithmetic counts it (MFU's model flops do not)
    again = dataclasses.replace(built, recomputed_flops_per_token=4e8, recomputed_kernel_attention_flops_per_token=3e7)
    full = aot.work(again, figures, "")
    assert full["attention_flops"] == pytest.approx((1e8 + 3e7) * 1000 / 4)
    assert full["matmul_flops"] == pytest.approx((1e9 + 4e8 - 1e8 - 3e7) * 1000 / 4)
    assert "recomputed" in full["matmul_flops_from"]
