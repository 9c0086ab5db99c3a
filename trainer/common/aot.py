"""Ahead-of-time compile of a trainer command's train step, for devices this machine does not have.

    python -m trainer.plan --devices 4 --tpu v4:2x2x1 --chip-config megacore --host-bounds 2,2,1 \\
        -- pretrain --preset gpt2-124m --ckpt-dir gs://b/run

builds the step that `python -m trainer pretrain ...` would run, on abstract inputs (shapes and the
shardings the rules give: no weights, no data), compiles it for the mesh over the TPU topology's devices
with the TPU compiler (libtpu, no TPU needed) and prints one JSON object on stdout: the compiler's
per-device memory and cost figures. Without --tpu it compiles for --devices CPU devices: what a local
slice runs on. With --fallback-cpu a TPU target without libtpu gets the CPU compiler too; the figures then
say compiler "cpu" for run platform "tpu" (an estimate). The trainer arguments go through the trainer's
own parser and checks: bad ones exit 2 with its one-line `error: ...`, as the run itself would.

A trainer command is planned by one builder in BUILDERS (its parsed args + the target -> Built); for any
other command this exits 4 (nothing to plan) before jax starts.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainer.common.config import UsageError

COUNT_FLAG = "xla_force_host_platform_device_count"
# XLA options of a compile whose program is never run, only read for its memory and cost figures: the CPU
# backend's LLVM optimisation comes after those are fixed (the same figures to the byte)
MEMORY_ONLY = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
NOTHING_TO_PLAN = 4  # exit code: the trainer command has no train step (bad arguments exit 2)


@dataclass(frozen=True)
class Target:
    """The devices to compile for, and the platform the step will really run on."""
    devices: list      # every device of the run, all its slices'
    processes: int     # every host of the run, all its slices'
    run_platform: str  # "tpu" for a TPU target, even when the CPU compiler stands in for it
    slices: int = 1    # slices joined by DCN: the mesh's `dcn` axis (trainer/common/mesh.py job_mesh)

    def mesh(self, spec_text: str):
        """The run's mesh over these devices: --mesh on each slice, the slices on `dcn`, as the run builds it."""
        from trainer.common import mesh as mesh_lib
        return mesh_lib.job_mesh(spec_text, self.devices, self.slices, self.processes)


@dataclass(frozen=True)
class Built:
    """A command's train step, ready to compile, with what the plan reports beside the compiler's figures."""
    # (compiler options, the step as `lower` gave it or None) -> the compiled step (jax.stages.Compiled)
    compile: Callable[..., Any]
    params: Any                 # abstract params: ShapeDtypeStructs carrying their shardings
    opt_state: Any              # abstract optimizer state, likewise
    tokens_per_step: int
    model_flops_per_token: float
    mesh: dict[str, int]
    dtype: str                  # compute dtype the step was built with
    settings: dict              # the flags the plan's suggestions change, as the run has them
    levers: tuple[str, ...]     # suggestions this command can take (orchestrator/plan/step.py knows each kind)
    trained: Any = None         # the abstract params that get gradients, when not all of them do (LoRA)
    lower: Callable[[], Any] | None = None  # -> the step lowered (jax.stages.Lowered): the program compile takes
    # -> the step with its loops unrolled, compiled only to be counted (trainer/common/scans.py); None: the command
    # has no loop of its own
    compile_unrolled: Callable[[], Any] | None = None
    # the splash kernel's work per token by the arithmetic (0 when XLA computes attention: the compiler counts
    # that) and its head_dim: the calibrated time's attention class (trainer/common/calibration.py)
    kernel_attention_flops_per_token: float = 0.0
    head_dim: int = 0
    attention_kernel: str = "splash"  # which kernel does that work (a rate of its own: calibration.py)
    # of model_flops_per_token, the routed experts' grouped matmuls (ragged_dot): a rate of their own, which
    # depends on the rows an expert takes a layer
    grouped_flops_per_token: float = 0.0
    grouped_rows_per_expert: float = 0.0
    # what --remat full runs again in the backward pass, per token, beyond model_flops_per_token (which MFU counts
    # and the calibrated time of a scanned step takes its matmuls from): the layers' forward, of it the experts'
    # grouped matmuls and the splash kernel's forward
    recomputed_flops_per_token: float = 0.0
    recomputed_grouped_flops_per_token: float = 0.0
    recomputed_kernel_attention_flops_per_token: float = 0.0


def _auto_dtype(cfg, run_platform: str):
    """--dtype auto resolved for the platform the run will have (not the one compiling)."""
    import dataclasses

    import jax.numpy as jnp

    from trainer.common.mesh import compute_dtype
    if cfg.train.dtype != "auto":
        return cfg
    name = "bfloat16" if compute_dtype("auto", run_platform) == jnp.bfloat16 else "float32"
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=name))


def splash_flops_per_token(n_layers: int, seq_len: int, width: int, attention: str) -> float:
    """The splash kernel's work per token by the arithmetic MFU counts (12 x layers x positions x heads x
    head_dim: scores and mixing, forward and backward), 0 when XLA computes attention (the compiler counts it)."""
    return 12.0 * n_layers * seq_len * width if attention != "xla" else 0.0


def _pretrain(args: argparse.Namespace, target: Target) -> Built:
    from trainer.common import config
    from trainer.common import mesh as mesh_lib, metrics
    from trainer.pretrain import tokenizers, train
    tokenizers.follow_data(args)
    cfg = _auto_dtype(config.resolve(args), target.run_platform)
    mesh = target.mesh(cfg.train.mesh)
    train.check_fits(cfg, dict(mesh.shape), target.processes)
    steps = train.Steps(cfg, mesh)
    t, m = cfg.train, cfg.model
    return Built(compile=lambda opts=None, lowered=None: (steps.compile(opts, lowered), steps.train_fn)[1],
                 lower=steps.lower, params=steps.abstract_params,
                 opt_state=steps.abstract_opt, tokens_per_step=t.batch_size * m.seq_len,
                 model_flops_per_token=metrics.flops_per_token(m), mesh=mesh_lib.shape_of(mesh), dtype=t.dtype,
                 settings={"batch_size": t.batch_size, "grad_accum": t.grad_accum, "steps": t.steps,
                           "mesh": t.mesh, "n_head": m.n_head, "n_layer": m.n_layer, "attention": steps.attention,
                           "remat": t.remat,
                           "loss_chunk": t.loss_chunk, "table_grads": t.table_grads,
                           "logits": t.logits, "splash_layout": t.splash_layout, "splash_bwd": t.splash_bwd,
                           "splash_block": t.splash_block, "splash_fwd": t.splash_fwd,
                           "loss_kernel": "xla" if steps.loss_kernel is None else "pallas",
                           "optimizer_state": t.optimizer_state},
                 levers=("grad_accum", "remat", "batch_size", "mesh_model"), compile_unrolled=steps.compile_unrolled,
                 kernel_attention_flops_per_token=splash_flops_per_token(m.n_layer, m.seq_len, m.d_model,
                                                                         steps.attention),
                 head_dim=m.head_dim, attention_kernel="resident" if "resident" in steps.attention else "splash")


def _lora_run(args: argparse.Namespace, run_platform: str):
    """The command's LoraRun, with --dtype / --base-dtype auto resolved for the platform the run will have."""
    import dataclasses

    import jax.numpy as jnp

    from trainer.common.mesh import compute_dtype
    from trainer.finetune.config import LoraRun
    run = LoraRun(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LoraRun)})
    run.check()
    name = lambda d: "bfloat16" if compute_dtype(d, run_platform) == jnp.bfloat16 else "float32"  # noqa: E731
    return dataclasses.replace(run, dtype=name(run.dtype), base_dtype=name(run.base_dtype))


def lora_flops_per_token(cfg, n_adapter: int, seq_len: int) -> float:
    """Training FLOPs per token of LoRA on a frozen base: the base's matmuls forward and back to their inputs
    (2 + 2 per weight; no weight gradient), the adapters' 6 per weight, and attention's scores and mixing
    (forward 4 x T x heads x head_dim per layer, backward twice that)."""
    from trainer.models import gemma
    attention = 12 * seq_len * gemma.attention_width(cfg)
    return 4.0 * gemma.matmul_params(cfg) + 6.0 * n_adapter + attention


def lora_recomputed_flops_per_token(cfg, n_adapter: int, seq_len: int) -> float:
    """What --remat full runs again of lora_flops_per_token's terms, each layer's forward: the base's matmuls but
    the output layer's (2 of their 4), the adapters' (2 of 6) and attention's (4 of 12)."""
    from trainer.models import gemma
    return (2.0 * (gemma.matmul_params(cfg) - cfg.vocab * cfg.d_model) + 2.0 * n_adapter
            + 4.0 * seq_len * gemma.attention_width(cfg))


def _lora(args: argparse.Namespace, target: Target) -> Built:
    """`lora`: the frozen base held as the run holds it (fsdp over data, its --base-dtype), the adapters and
    their optimizer state; the base's size is --model SIZE (checked before jax starts: `_needs_size`)."""
    import jax

    from trainer.common import mesh as mesh_lib
    from trainer.finetune import train as finetune
    from trainer.models import gemma, lora as lora_lib, moe
    run = _lora_run(args, target.run_platform)
    cfg = gemma.SIZES[run.size]
    mesh = target.mesh(run.mesh)
    batch = finetune.batch_of(run, len(target.devices), mesh.shape["data"] * target.slices, target.slices)
    steps = finetune.Steps(run, cfg, mesh, max(run.steps, 1), batch)
    n_adapter = lora_lib.count(cfg, run.lora)
    kernel_attention = splash_flops_per_token(cfg.n_layers, run.seq_len, cfg.n_heads * cfg.head_dim, steps.attention)
    again = steps.remat == "full"  # each layer's forward runs again in the backward pass
    base_dtype = mesh_lib.compute_dtype(run.base_dtype)
    base = steps.abstract_base(base_dtype)
    return Built(compile=lambda opts=None, lowered=None: (steps.compile(base, opts, lowered), steps.train_fn)[1],
                 lower=lambda: steps.lower(base),
                 params={"base": base, "adapters": steps.abstract_lora}, opt_state=steps.abstract_opt,
                 trained=steps.abstract_lora, tokens_per_step=batch * run.seq_len,
                 model_flops_per_token=lora_flops_per_token(cfg, n_adapter, run.seq_len),
                 mesh=mesh_lib.shape_of(mesh), dtype=run.dtype,
                 settings={"batch_size": batch, "grad_accum": 1, "steps": run.steps, "mesh": run.mesh,
                           "base_dtype": run.base_dtype, "n_head": cfg.n_heads, "n_layer": cfg.n_layers,
                           "d_model": cfg.d_model,
                           # layers a scan iteration runs (the nested scans: one), 0 written out
                           "scan_layers": 1 if steps.scanned and gemma.segments(cfg) else 0,
                           "remat": steps.remat, "remat_why": steps.remat_why, "loss_chunk": steps.loss_chunk,
                           "seq_len": run.seq_len,
                           "lora_impl": run.lora_impl,
                           "vocab": cfg.vocab,
                           "compiler_options": steps.compiler_options,
                           "fsdp": True, "batch_per_device": not run.batch_size,
                           "gathered_share": gemma.gathered_share(
                               cfg, bool(cfg.n_experts and moe.expert_axes(cfg.n_experts, dict(mesh.shape)))),
                           **({"experts": moe.describe(cfg.n_experts, cfg.top_k, dict(mesh.shape),
                                                       batch * run.seq_len // target.slices, run.expert_capacity)}
                              if cfg.n_experts else {})},
                 levers=("base_dtype", "loss_chunk", "remat", "batch_size", "mesh_model"),
                 # no twin: the layers' scans and the loss's chunks are counted by their trips from the program's
                 # text (whole_count), not from a second compile of the step written out
                 compile_unrolled=None,
                 kernel_attention_flops_per_token=kernel_attention,
                 head_dim=cfg.head_dim,
                 # frozen experts: forward and back to their input, as lora_flops_per_token counts every base weight
                 grouped_flops_per_token=4.0 * gemma.expert_matmul_params(cfg),
                 grouped_rows_per_expert=_rows_per_expert(cfg, mesh, batch * run.seq_len // target.slices),
                 recomputed_flops_per_token=lora_recomputed_flops_per_token(cfg, n_adapter, run.seq_len)
                 if again else 0.0,
                 recomputed_grouped_flops_per_token=2.0 * gemma.expert_matmul_params(cfg) if again else 0.0,
                 recomputed_kernel_attention_flops_per_token=kernel_attention / 3 if again else 0.0)


def _rows_per_expert(cfg, mesh, slice_tokens: int) -> float:
    """The rows an expert takes a layer at the even share: expert parallel, each expert sees every token of the
    slice (gathered to it); else each device runs its own data shard's tokens through every expert."""
    from trainer.models import moe
    if not cfg.n_experts:
        return 0.0
    shape = dict(mesh.shape)
    tokens = slice_tokens if moe.expert_axes(cfg.n_experts, shape) else slice_tokens // max(shape.get("data", 1), 1)
    return tokens * cfg.top_k / cfg.n_experts


def _needs_size(args: argparse.Namespace) -> None:
    """A plan never reads --weights (it may be a gs:// path, or not there yet): the size is --model SIZE."""
    from trainer.finetune.config import size_of
    if not size_of(args.model):
        raise NotPlannable("`lora` is planned from its model size, without reading --weights: add --model SIZE "
                           "(e.g. --model gemma2-2b; the run checks the checkpoint is that size)"
                           + (f"; --model {args.model} names a family only" if args.model else ""))


BUILDERS: dict[str, Callable[[argparse.Namespace, Target], Built]] = {"pretrain": _pretrain, "lora": _lora}
# Checks of a command's arguments that need no jax: answered before jax (and libtpu) start.
PRECHECKS: dict[str, Callable[[argparse.Namespace], None]] = {"lora": _needs_size}


def per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract tree: each leaf's shard shape under its sharding."""
    import jax
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return cost or {}


def _about(built: Built, target: Target, compile_s: float) -> dict:
    """What every plan states besides the compiler's memory and cost figures."""
    dev = target.devices[0]
    return {"compiler": dev.platform, "device_kind": dev.device_kind, "devices": len(target.devices),
            "processes": target.processes, "slices": target.slices, "run_platform": target.run_platform, "mesh": built.mesh,
            "dtype": built.dtype, "compile_s": round(compile_s, 2),
            "params_bytes": per_device_bytes(built.params), "optimizer_bytes": per_device_bytes(built.opt_state),
            "grad_bytes": per_device_bytes(built.params if built.trained is None else built.trained),
            "tokens_per_step": built.tokens_per_step, "model_flops_per_token": built.model_flops_per_token,
            "settings": built.settings, "levers": list(built.levers)}


def has_loop(compiled) -> bool:
    """Whether the compiled program keeps a while loop (a scan the compiler did not unroll itself)."""
    return any(" while(" in line for line in (compiled.as_text() or "").splitlines())


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def _arrays_bytes(text: str) -> int:
    return sum(_ITEMSIZE.get(t, 0) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(text))


def _braced(line: str, opening: str) -> str:
    """What the brace that `opening` ends with encloses in line (nested braces included); "" without it."""
    start = line.find(opening)
    if start < 0:
        return ""
    depth, i = 0, start + len(opening) - 1
    for j in range(i, len(line)):
        depth += {"{": 1, "}": -1}.get(line[j], 0)
        if depth == 0:
            return line[i + 1:j]
    return line[i + 1:]


def uncounted_kernel_bytes(hlo_text: str) -> float:
    """Bytes of the Pallas kernels that the TPU compiler's cost analysis counts as nothing: every kernel that
    declares no cost estimate (splash attention's do not; trainer/kernels/xent_kernel.py's do, and are counted).
    Their operands and results, once each: a lower bound of what they move (a kernel reads each input at least
    once and writes each output), exact for one that streams every block once."""
    total = 0
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line or '"cost_estimate"' in line:
            continue
        result = line.split(" custom-call(", 1)[0].split(" = ", 1)[-1]
        total += _arrays_bytes(result) + _arrays_bytes(_braced(line, "operand_layout_constraints={"))
    return float(total)


_DECLARED_FLOPS = re.compile(r'"cost_estimate":\{[^}]*?"flops":"?(\d+)')


def declared_kernel_flops(hlo_text: str) -> float:
    """The flops the Pallas kernels declare in their cost estimates (the loss kernels'), which the compiler adds to
    its count as they are."""
    return float(sum(int(m.group(1)) for line in hlo_text.splitlines()
                     if 'custom_call_target="tpu_custom_call"' in line for m in [_DECLARED_FLOPS.search(line)] if m))


def work(built: Built, figures: dict, hlo_text: str) -> dict:
    """One device's step by class of work, for the calibrated time (trainer/common/calibration.py): XLA's matmul
    flops, the splash kernel's and the loss kernels' flops, and the bytes of the rest (elementwise, reductions,
    copies; trainer/common/hlo_bytes.py), counted from the same program as flops and bytes_accessed."""
    from trainer.common import hlo_bytes
    kernel = declared_kernel_flops(hlo_text)
    by_class = _hlo_table(hlo_text)["by_class"] if hlo_text else {}
    devices = max(1, figures["devices"])
    per_device = built.tokens_per_step / devices
    # the kernel's arithmetic, its forward again under full recompute
    attention = (built.kernel_attention_flops_per_token
                 + built.recomputed_kernel_attention_flops_per_token) * per_device
    matmul = max(0.0, figures["flops"] - kernel)
    extra = {}
    if figures.get("counted") == "loop bodies once":
        # the compiler's count has each loop body's matmuls once (a scanned Gemma step: one layer of a kind for
        # all of them): the model's arithmetic is the better count, with what full recompute runs again (gemma4-e2b
        # on one v5e chip, 1 and 4 rows of 512: -21% and -26% against the chip without it, -0.2% and -5% with)
        arithmetic = (built.model_flops_per_token + built.recomputed_flops_per_token) * per_device - attention
        if arithmetic > matmul:
            matmul, extra = arithmetic, {"matmul_flops_from": "model arithmetic (the loops' bodies counted once)"
                                         + (", the recomputed forward with it" if built.recomputed_flops_per_token
                                            else "")}
    # the experts' grouped matmuls by the arithmetic (the compiler's count of a ragged_dot inside a scan is not
    # separable from the loop's other dots), taken out of the matmul class
    grouped = min((built.grouped_flops_per_token + built.recomputed_grouped_flops_per_token) * per_device, matmul)
    if grouped:
        matmul -= grouped
        extra.update(grouped_matmul_flops=grouped, grouped_rows_per_expert=built.grouped_rows_per_expert)
    return {"matmul_flops": matmul, "loss_kernel_flops": kernel, **extra,
            "attention_flops": attention,
            "head_dim": built.head_dim, "attention_kernel": built.attention_kernel,
            "other_bytes": by_class.get(hlo_bytes.OTHER, 0.0),
            "bytes_by_class": by_class}


@functools.lru_cache(maxsize=2)
def _hlo_table(text: str) -> dict:
    """hlo_bytes.table of a program's text, read once per plan (whole_count and work both use it)."""
    from trainer.common import hlo_bytes
    return hlo_bytes.table(text)


def whole_count(built: Built, compiled, twin: bool = True) -> tuple[dict, Any]:
    """The step's flops and bytes accessed counted whole, per device.

    The compiler's cost analysis counts a while loop's body once, whatever its trip count. Its optimized HLO
    keeps no trip counts to multiply by (libtpu 0.0.42 writes none), and it has no cost analysis of one body on
    its own; so a step with a loop is counted from its twin with every loop unrolled (Built.compile_unrolled),
    compiled for that alone: one more compile, only when the program has a loop. `counted` says which:
    "program" (no loop), "unrolled" (the twin's figures), "loop bodies once" (a loop and no twin, or
    `twin` False: a low count). program_* are the compiled program's own figures either way.

    The cost analysis also has `optimal_seconds`; it is left out: on one matmul or one elementwise op it is that
    op's roofline time, but on a train step it comes back negative (-221 s for gpt2-124m on v5e-8, libtpu
    0.0.42.1), so it is no step time.

    Returns (the figures, the program they were counted from: the twin when one was compiled)."""
    cost = _cost(compiled)
    program = {"program_flops": float(cost.get("flops", 0.0)),
               "program_bytes_accessed": float(cost.get("bytes accessed", 0.0))}
    if not has_loop(compiled):
        return {"flops": program["program_flops"], "bytes_accessed": program["program_bytes_accessed"],
                "counted": "program", **program}, compiled
    if built.compile_unrolled is None or not twin:
        # the loops' trips from the program's text: every instruction's bytes counted each trip
        # (trainer/common/hlo_bytes.py), added to the compiler's count of each body once. The flops stay the
        # compiler's (a body once: low; the plan takes the model's arithmetic when it is larger): the text's
        # matmul count (hlo_bytes matmul_flops) is not yet checked against a written-out twin.
        t = _hlo_table(compiled.as_text() or "")
        if not t.get("loops"):
            return {"flops": program["program_flops"], "bytes_accessed": program["program_bytes_accessed"],
                    "counted": "loop bodies once", **program}, compiled
        return {"flops": program["program_flops"],
                "bytes_accessed": program["program_bytes_accessed"] + t["total"] - t["once"],
                "counted": "loop bodies once", "bytes_counted": "loops by trip count (the program's text)",
                **program}, compiled
    t0 = time.perf_counter()
    twin_compiled = built.compile_unrolled()
    counted = _cost(twin_compiled)
    # A loop the compiler makes itself (e.g. a collective matmul it windows) is not ours to unroll: still low.
    how = "unrolled, a compiler's loop left: low" if has_loop(twin_compiled) else "unrolled"
    return {"flops": float(counted.get("flops", 0.0)), "bytes_accessed": float(counted.get("bytes accessed", 0.0)),
            "counted": how, "count_compile_s": round(time.perf_counter() - t0, 2), **program}, twin_compiled


def figures(built: Built, compiled, target: Target, compile_s: float) -> dict:
    """The plan's raw figures, per device. total = what the step holds at its peak: arguments + outputs that
    are not donated buffers reused in place + temporaries + the program itself. flops and bytes_accessed: the
    whole step (whole_count); on several slices dcn_*: the collectives that cross slices, counted from the same
    program (trainer/common/collectives.py)."""
    mem = compiled.memory_analysis()
    arg, out, alias = mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes
    temp, code = mem.temp_size_in_bytes, mem.generated_code_size_in_bytes
    # a run on CPU devices (a local slice) gets no step time from its plan: no twin compiled to count it
    whole, counted_from = whole_count(built, compiled, twin=target.run_platform != "cpu")
    text = counted_from.as_text() or ""
    out_fig = {**_about(built, target, compile_s),
               "argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
               "code_bytes": code, "total_bytes": arg + out - alias + temp + code, **whole,
               "kernel_bytes_uncounted": uncounted_kernel_bytes(text)}
    if target.run_platform == "tpu":
        out_fig["work"] = work(built, out_fig, text)
    if target.slices > 1:
        from trainer.common import collectives
        out_fig.update(collectives.crossing(counted_from.as_text() or "", len(target.devices), target.slices))
    return out_fig


class NotPlannable(UsageError):
    """The trainer command has no train step (prepare, sample, ...)."""


def check(args: argparse.Namespace) -> None:
    """Before jax starts: a parsed trainer command with no builder is NotPlannable; the builder's own prechecks."""
    if args.cmd not in BUILDERS:
        raise NotPlannable(f"`{args.cmd}` has no train step to plan; plannable commands: {', '.join(BUILDERS)}")
    PRECHECKS.get(args.cmd, lambda a: None)(args)


def plan(args: argparse.Namespace, target: Target, started: float | None = None, counts=None) -> dict:
    """Build the command's step for the target, compile it, and return the figures (jax already set up).
    started: time.perf_counter() when the planner started (its imports and the target before this): the figures'
    `phases` say where the plan's time went, in seconds (start, build, lower, then compile and count, or found: the
    program's figures read from a record of it); `buffers` are the step's largest, from the compiler's buffer
    assignment (trainer/common/buffers.py). counts: a program_counts.Store, where a program counted before is
    found and one compiled now is recorded (None: none)."""
    t_build = time.perf_counter()
    built = BUILDERS[args.cmd](args, target)
    phases = {"start": t_build - started if started is not None else None, "build": time.perf_counter() - t_build}
    out, own = _counted(built, target, counts)
    if "oom" in out and _falls_back(args, built):
        # as the run does (finetune.compile_fitting): --remat auto's written-out step refused, the scanned one
        phases["refused written out"] = sum(own.values())
        args = argparse.Namespace(**{**vars(args), "remat": "full"})
        built = BUILDERS[args.cmd](args, target)
        from trainer.finetune.train import REFUSED_WRITTEN_OUT
        built.settings["remat_why"] = REFUSED_WRITTEN_OUT
        out, own = _counted(built, target, counts)
    return {**out, "phases": _rounded({**phases, **own})}


def _counted(built: Built, target: Target, counts) -> tuple[dict, dict]:
    """(the step's figures, or its refusal's (out_of_memory), and the phases of getting them: lower, then compile
    and count, or found). A program with a record in counts is not compiled; one compiled is recorded there."""
    from trainer.common import program_counts
    t0 = time.perf_counter()
    lowered = built.lower() if built.lower is not None else None
    key = None
    if counts is not None and lowered is not None:
        key = counts.key(lowered.as_text(), target.devices, built.settings.get("compiler_options") or {},
                         target.processes, target.slices, target.run_platform)
        t_key = time.perf_counter()
        found = counts.find(key)
        if found is not None:
            return program_counts.answer(found, _about(built, target, 0.0)), {
                "lower": t_key - t0, "found": time.perf_counter() - t_key}
    t1 = time.perf_counter()
    compiled, refusal, largest, inside = _compile(built, lowered)
    t2 = time.perf_counter()
    if refusal:
        out = {**out_of_memory(built, target, refusal, t2 - t1), "compile_phases": _rounded(inside)}
        own = {"lower": t1 - t0, "compile": t2 - t1}
    else:
        out = {**figures(built, compiled, target, t2 - t1), "buffers": largest, "compile_phases": _rounded(inside)}
        own = {"lower": t1 - t0, "compile": t2 - t1, "count": time.perf_counter() - t2}
    if key is not None:
        counts.save(key, out, _rounded(own))
    return out, own


def _compile(built: Built, lowered=None) -> tuple[Any, str | None, list | None, dict]:
    """(the compiled step, None, its largest buffers, compile_phases), or (None, the compiler's message, None,
    compile_phases) when it refuses the step for want of HBM. lowered: the step as built.lower() gave it (None:
    compiled from the start). The buffers are read from the compiler's buffer assignment, dumped for this compile
    (trainer/common/buffers.py): what a plan names when one mesh holds more than another; compile_phases from
    when the compiler wrote its dump files."""
    from trainer.common import buffers
    with tempfile.TemporaryDirectory(prefix="tpuctl-plan-") as dump:
        began = time.time()  # the dump files' times are the wall clock's
        try:
            compiled = built.compile(buffers.options(dump), lowered)
        except Exception as e:  # noqa: BLE001  (jax raises its runtime error type for a compiler's refusal)
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return None, str(e), None, compile_phases(dump, began, time.time())
        return compiled, None, buffers.largest(dump), compile_phases(dump, began, time.time())


# The files the compiler dumps as it goes (xla_dump_to), each suffix after the program's name: the program handed
# to it, the buffer assignment of its program after the optimizations, the TPU's generated program.
_HANDED, _ASSIGNED, _GENERATED = (".before_optimizations.txt", ".after_optimizations-buffer-assignment.txt",
                                  ".after_codegen.txt")


def compile_phases(dump_dir: str, began: float, ended: float) -> dict:
    """Where a compile's wall time went, in seconds, from when the compiler wrote its dump files into dump_dir
    (the largest program's, the step's: jax may compile small helpers too): `lowering` until it was handed the
    program, `optimizations` until its buffer assignment was written (its HLO passes, the SPMD partitioner's
    among them), `code generation` until the TPU's program was written (libtpu's LLO: on a TPU plan most of
    the compile, e.g. 52 of 76 s for gemma4-26b-a4b on v4-8; the memory analysis a plan reads is final only after
    it), `the rest` to the end. A phase whose file is not there (the CPU compiler writes no generated program;
    a refused step none after its refusal) is left out and its time goes to the next one there."""
    files = sorted(Path(dump_dir).glob("*" + _ASSIGNED), key=lambda p: p.stat().st_size)
    module = files[-1].name[:-len(_ASSIGNED)] if files else None
    marks = []
    for name, suffix in (("lowering", _HANDED), ("optimizations", _ASSIGNED), ("code generation", _GENERATED)):
        f = Path(dump_dir) / f"{module}{suffix}" if module else next(Path(dump_dir).glob("*" + suffix), None)
        if f is not None and f.exists():
            marks.append((name, f.stat().st_mtime))
    out, last = {}, began
    for name, at in marks:
        out[name] = max(0.0, at - last)
        last = max(last, at)
    if marks:
        out["the rest"] = max(0.0, ended - last)
    return out


def _falls_back(args: argparse.Namespace, built: Built) -> bool:
    """Whether a refused step is one --remat auto chose written out on an estimate (lora's remat_of)."""
    return args.cmd == "lora" and getattr(args, "remat", "") == "auto" and built.settings.get("remat") == "none"


def _rounded(phases: dict) -> dict:
    return {k: round(v, 2) for k, v in phases.items() if v is not None}


_UNIT = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
# The TPU compiler refuses a program that does not fit its HBM, in one of these words (libtpu 0.0.42):
_OOM = (re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
        re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"))


def out_of_memory(built: Built, target: Target, message: str, compile_s: float) -> dict:
    """The figures of a step the compiler refused for lack of HBM: its own numbers where it gives them, the
    state's bytes from the shardings (there is no memory analysis of a program that was not built)."""
    first = next((ln for ln in message.splitlines() if "RESOURCE_EXHAUSTED" in ln), message).strip()
    state = per_device_bytes(built.params) + per_device_bytes(built.opt_state)
    temp, total, available = 0, state, None
    for pattern in _OOM:
        m = pattern.search(message)
        if m:
            need = int(float(m.group(1)) * _UNIT[m.group(2)])
            available = int(float(m.group(3)) * _UNIT[m.group(4)])
            # "HLO temporaries (N)" counts temporaries only; "Used N of M hbm" counts everything
            temp, total = (need, need + state) if pattern is _OOM[0] else (max(need - state, 0), need)
            break
    return {**_about(built, target, compile_s),
            "argument_bytes": state, "output_bytes": state, "alias_bytes": state, "temp_bytes": temp,
            "code_bytes": 0, "total_bytes": total, "flops": 0.0, "bytes_accessed": 0.0,
            "oom": {"message": first, "available_bytes": available}}


def has_libtpu() -> bool:
    """The TPU compiler is libtpu.so, found through the `libtpu` package (the `plan` extra) as jax finds it."""
    try:
        import libtpu
    except ImportError:
        return False
    return os.path.exists(libtpu.get_library_path())


def _cpu_target(n: int, processes: int, run_platform: str, slices: int = 1) -> Target:
    """n CPU devices (set before jax is imported), and no attempt to find an accelerator; on several slices,
    consecutive devices make a slice (trainer/common/mesh.py slice_groups)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if COUNT_FLAG not in f]
    # a plan never runs what it compiles (MEMORY_ONLY: about 40% less compile time on tiny steps); a flag the
    # caller set wins
    given = {f.split("=")[0] for f in flags}
    flags += [f"--{k}={str(v).lower()}" for k, v in MEMORY_ONLY.items() if f"--{k}" not in given]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--{COUNT_FLAG}={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    return Target(jax.devices("cpu")[:n], processes, run_platform, slices)


def host_bounds(tpu: str, given: str = "") -> tuple[int, ...]:
    """Chips per host as libtpu's X,Y,Z box: `given` ("X,Y,Z") when set, else a 4-chip host's 2,2,1 cut down to
    the topology ("v5e:1x1" is one chip on one host)."""
    if given:
        try:
            return tuple(int(x) for x in given.split(","))
        except ValueError:
            raise UsageError(f"--host-bounds {given}: write it as X,Y,Z, e.g. 2,2,1") from None
    try:
        dims = [int(x) for x in tpu.split(":", 1)[-1].split("x")]
    except ValueError:
        raise UsageError(f"--tpu {tpu}: write it as GEN:TOPOLOGY, e.g. v5e:2x4 or v4:2x2x1") from None
    return tuple(min(d, b) for d, b in zip((dims + [1, 1])[:3], (2, 2, 1)))


def target(opts: argparse.Namespace) -> Target:
    """opts.devices and opts.processes are one slice's; opts.num_slices such slices joined by DCN."""
    if opts.devices < 1 or opts.processes < 1 or opts.num_slices < 1:
        raise UsageError("--devices, --processes and --num-slices must be at least 1")
    n = opts.num_slices
    if not opts.tpu:
        return _cpu_target(opts.devices * n, opts.processes * n, opts.run_platform, n)
    if not has_libtpu():
        if not opts.fallback_cpu:
            raise UsageError("libtpu is not installed: pip install 'tpuctl[plan]' for the TPU compiler")
        return _cpu_target(opts.devices * n, opts.processes * n, "tpu", n)
    os.environ["JAX_PLATFORMS"] = "cpu"  # the TPU compiler needs no TPU; never look for one
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata server to ask about the host
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) meant for a real TPU's owner; compiling only,
    # several plans at once are fine.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    bounds = host_bounds(opts.tpu, opts.host_bounds)
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=opts.tpu,
                                            chip_config_name=opts.chip_config, chips_per_host_bounds=bounds,
                                            num_slices=n)
    except Exception as e:  # noqa: BLE001 - libtpu's refusal of a topology, in its words
        raise UsageError(f"--tpu {opts.tpu} with --host-bounds {','.join(map(str, bounds))}: libtpu refuses it: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if len(desc.devices) != opts.devices * n:
        raise UsageError(f"topology {opts.tpu} ({opts.chip_config}) x {n} slice(s) has {len(desc.devices)} devices, "
                         f"not the {opts.devices * n} the run will have")
    return Target(list(desc.devices), opts.processes * n, "tpu", n)
