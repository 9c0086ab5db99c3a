"""`tpuctl plan`: the TPU compiler's verdict on a trainer command, per device, before any slice exists.

The trainer builds and compiles its own train step (`python -m trainer.plan`, run as a process: the
orchestrator never imports the trainer) for the accelerator's topology with libtpu, on this machine, with
no TPU. This module turns the compiler's figures into the plan: per-device HBM against the chip's, a
verdict, what would fit when it does not, FLOPs, step time, tokens/s, wall time and list-price cost.
Without libtpu the CPU compiler stands in and the plan says it is an estimate; a local slice is planned
with the CPU compiler because that is what it runs on. Compiler figures are cached by (accelerator, trainer
argv, compiler, package versions, trainer code); the verdict is recomputed from the catalog every time.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from orchestrator import catalog
from orchestrator.plan import memory_watch
from trainer.common import buffers, calibration, program_counts
from orchestrator.spec import UserError

GIB = 2 ** 30
NOTHING_TO_PLAN = 4  # trainer.common.aot's exit code for a command with no train step (prepare, sample, ...)
TPU, CPU, ESTIMATE = "tpu", "cpu", "cpu-estimate"  # libtpu; a local slice's CPU devices; CPU for a TPU target
INSTALL_HINT = "pip install 'tpuctl[plan]' (libtpu, ~200 MB) for the TPU compiler's exact figures"
VERSIONED = ("tpuctl", "jax", "jaxlib", "libtpu", "flax", "optax")


class PlanError(UserError):
    """The planner could not produce a plan (the trainer rejected the arguments, or the compile failed)."""


class NotPlannable(PlanError):
    """The trainer command has no train step to plan (the trainer says which ones have)."""


@dataclass
class Suggestion:
    change: str                   # trainer flags to add, e.g. "--grad-accum 4" (the last of a repeated flag wins)
    estimate_bytes: int | None    # per-device total it would need (arithmetic from this plan's figures)
    note: str
    compiled_bytes: int | None = None  # the compiler's per-device total for it, when `plan` compiled it
    compiled_fits: bool | None = None
    lever: str = ""               # the LEVERS entry that made it
    compile_wall_s: float | None = None  # what compiling it took this plan (0: cached; None: not compiled)
    compile_peak_rss_bytes: int | None = None  # the host memory its compile process peaked at (None: not compiled)


@dataclass
class Plan:
    accelerator: catalog.AcceleratorType
    compiler: str                 # TPU, CPU or ESTIMATE
    figures: dict                 # trainer/common/aot.py's output: per-device bytes, flops, settings
    mfu: float = 0.5
    steps: int | None = None      # --steps for time and cost; None: the trainer's --steps
    cached: bool = False
    suggestions: list[Suggestion] = field(default_factory=list)
    alternative: "Plan | None" = None  # the next accelerator size that fits, compiled
    # with model > 1: the same step compiled on another mesh of the slice (mesh_check): all of its devices on data,
    # or the mesh asked for (compare_mesh); compared_mesh names it, compared_error is the PlanError's message when
    # the trainer or compiler would not build it
    compared: "Plan | None" = None
    compared_mesh: str | None = None
    compared_error: str | None = None

    # --- memory -------------------------------------------------------------------------------------------
    @property
    def devices(self) -> int:
        return devices_of(self.accelerator)

    @property
    def hbm_bytes(self) -> int:
        """Per device: the slice's HBM over its JAX devices (one per chip on v4/v5p megacore, v5e, v6e)."""
        return int(self.accelerator.hbm_gib * GIB / self.devices)

    @property
    def total_bytes(self) -> int:
        return int(self.figures["total_bytes"])

    @property
    def headroom_bytes(self) -> int:
        return self.hbm_bytes - self.total_bytes

    @property
    def refused(self) -> dict | None:
        """The TPU compiler's own out-of-memory refusal ({message, available_bytes}), when it gave one."""
        return self.figures.get("oom")

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0 and not self.refused

    @property
    def label(self) -> str:
        return {TPU: "TPU compiler (libtpu)",
                CPU: "CPU compiler (the local slice runs on CPU devices)",
                ESTIMATE: "ESTIMATE from the CPU compiler, not the TPU's; " + INSTALL_HINT}[self.compiler]

    @property
    def where(self) -> str:
        """The accelerator, or `N x` it on several slices."""
        n = int(self.figures.get("slices", 1))
        return f"{n} x {self.accelerator.name}" if n > 1 else self.accelerator.name

    def verdict(self) -> str:
        a, f = self.accelerator, self.figures
        word = "fits" if self.fits else "does NOT fit"
        est = " (estimate: CPU compiler)" if self.compiler == ESTIMATE else ""
        if self.refused:
            usable = self.refused.get("available_bytes")
            return (f"{word} on {self.where}: the TPU compiler ran out of HBM, needing about {gib(self.total_bytes)} "
                    f"per device" + (f" of {gib(usable)} usable" if usable else "")
                    + f" (temporaries {gib(f['temp_bytes'])}, params + optimizer "
                      f"{gib(f['params_bytes'] + f['optimizer_bytes'])})")
        return (f"{word} on {self.where}: {gib(self.total_bytes)} of {gib(self.hbm_bytes)} HBM per device{est} "
                f"(params {gib(f['params_bytes'])}, optimizer {gib(f['optimizer_bytes'])}, "
                f"temporaries {gib(f['temp_bytes'])})")

    # --- time and cost --------------------------------------------------------------------------------------
    @property
    def run_steps(self) -> int:
        return int(self.steps or self.figures["settings"].get("steps") or 0)

    @property
    def model_flops(self) -> float:
        """Per device per step, from the model's arithmetic (trainer.common.metrics.flops_per_token)."""
        f = self.figures
        return f["model_flops_per_token"] * f["tokens_per_step"] / f["devices"]

    @property
    def flops(self) -> float:
        """Per device per step for time: the compiler's count (the whole step's: trainer/common/aot.py counts every
        loop's trips), unless the arithmetic is larger: the compiler counts no Pallas kernel (splash attention)."""
        return max(self.figures.get("flops") or 0.0, self.model_flops)

    def step_s(self, mfu: float = 1.0) -> float | None:
        """Step time at the chip's bf16 peak x mfu (None on a local slice's CPU devices)."""
        if self.compiler == CPU:
            return None
        return self.flops * self.devices / (self.accelerator.peak_bf16_tflops * 1e12 * mfu)

    def roofline(self) -> dict | None:
        """Per device per step: the flops at the chip's bf16 peak (compute_s) and the bytes the compiler says the
        step moves at the chip's HBM bandwidth (memory_s, None without a bandwidth figure or a byte count); the
        step takes at least the larger of the two, whichever bounds it. r = memory_s / compute_s: above 1 the
        step waits on memory. None on a local slice's CPU devices. Both counts are the whole step's
        (trainer/common/aot.py counts every loop's trips). The bytes add, to the compiler's count, the operands
        and results of the Pallas kernels it counts as nothing (those with no cost estimate: splash attention)."""
        compute = self.step_s()
        if compute is None:
            return None
        a, f = self.accelerator, self.figures
        bandwidth = a.generation.hbm_bytes_s
        moved = (f.get("bytes_accessed") or 0.0) + (f.get("kernel_bytes_uncounted") or 0.0)
        memory = moved * self.devices / (bandwidth * a.chips) if bandwidth and moved else None
        bound = "memory" if memory is not None and memory > compute else "compute"
        return {"step_s": max(compute, memory or 0.0), "bound": bound, "compute_s": compute, "memory_s": memory,
                "bytes_moved": moved,
                "r": memory / compute if memory is not None else None,
                "hbm_bytes_s_per_device": bandwidth * a.chips / self.devices if bandwidth else None,
                "peak_flops_per_device": a.peak_bf16_tflops * 1e12 / self.devices}

    def calibrated(self) -> dict | None:
        """The step time by class of work at the rates a chip was measured to do each (trainer/common/
        calibration.py): {step_s, terms, measured, source}; None without the compiler's work by class (a CPU
        compile, or figures from before it was counted)."""
        work = self.figures.get("work")
        if self.compiler == CPU or not work:
            return None
        g = self.accelerator.generation
        rates = calibration.for_kind(self.figures.get("device_kind") or g.device_kind,
                                     g.peak_bf16_tflops * 1e12, g.hbm_bytes_s)
        return calibration.estimate(work, rates) if rates else None

    def timing(self) -> dict:
        """Step time, tokens/s, wall time and cost: the calibrated estimate's where there is one (step_s, wall_s,
        usd_*; `estimate` says which), else the roofline's; the roofline's own (roofline_step_s, the lower bound);
        and, labelled as an assumption, at --mfu (*_at_mfu)."""
        roof = self.roofline()
        if roof is None:
            return {}
        cal = self.calibrated()
        peak, at_mfu = self.step_s(), self.step_s(self.mfu)
        step = cal["step_s"] if cal else roof["step_s"]
        roof = {**roof, "roofline_step_s": roof["step_s"], "step_s": step, "calibrated": cal,
                "estimate": "calibrated" if cal else "roofline"}
        tokens = self.figures["tokens_per_step"]
        a = self.accelerator
        hours, hours_at_mfu = self.run_steps * step / 3600, self.run_steps * at_mfu / 3600
        return {**roof, "counted": self.figures.get("counted"), "tokens_per_s": tokens / step,
                "step_s_at_peak": peak, "step_s_at_mfu": at_mfu, "tokens_per_s_at_peak": tokens / peak,
                "tokens_per_s_at_mfu": tokens / at_mfu, "mfu_assumed": self.mfu, "steps": self.run_steps,
                "wall_s": hours * 3600, "usd_on_demand": hours * a.price_per_hour(),
                "usd_spot": hours * a.price_per_hour(spot=True), "wall_s_at_mfu": hours_at_mfu * 3600,
                "usd_on_demand_at_mfu": hours_at_mfu * a.price_per_hour(),
                "usd_spot_at_mfu": hours_at_mfu * a.price_per_hour(spot=True),
                "price_per_hour_on_demand": a.price_per_hour(), "price_per_hour_spot": a.price_per_hour(spot=True)}

    def time_spent(self) -> dict:
        """Where this plan's time went, in seconds of wall time: the step's compile (the planner process, and inside
        it its phases: start = python, jax and libtpu; build = the step's abstract inputs; lower = tracing and
        lowering it; found = its program's figures read from a record of that program instead of compiling
        (trainer/common/program_counts.py); compile = the TPU
        compiler, and inside it step_compile_phases, from when the compiler wrote its dump files (lowering,
        optimizations, code generation, the rest: trainer/common/aot.py compile_phases); count = reading the
        program's figures), each suggestion's check and the next slice size's; a
        figure taken from the cache took 0. Beside each, the host memory its compile process peaked at (*peak_rss_bytes,
        memory_watch; None from the cache), and the most of them."""
        f = self.figures
        step = 0.0 if self.cached else float(f.get("wall_s") or 0.0)
        checks = [{"change": s.change, "wall_s": s.compile_wall_s, "peak_rss_bytes": s.compile_peak_rss_bytes}
                  for s in self.suggestions if s.compile_wall_s is not None]
        alt = self.alternative
        nxt = None if alt is None else {"accelerator": alt.accelerator.name,
                                        "wall_s": 0.0 if alt.cached else float(alt.figures.get("wall_s") or 0.0),
                                        "peak_rss_bytes": _peak_rss(alt)}
        d = self.compared
        data = None if d is None else {"mesh": _mesh_text(d.figures["mesh"]),
                                       "wall_s": 0.0 if d.cached else float(d.figures.get("wall_s") or 0.0),
                                       "peak_rss_bytes": _peak_rss(d)}
        total = step + sum(c["wall_s"] for c in checks) + (nxt["wall_s"] if nxt else 0.0) \
            + (data["wall_s"] if data else 0.0)
        peaks = [b for b in (_peak_rss(self), *(c["peak_rss_bytes"] for c in checks),
                             nxt and nxt["peak_rss_bytes"], data and data["peak_rss_bytes"]) if b]
        return {"total_s": round(total, 2), "step_s": step, "step_phases": f.get("phases") or {},
                "step_compile_phases": f.get("compile_phases") or {},
                "step_peak_rss_bytes": _peak_rss(self), "suggestion_checks": checks, "next_size": nxt,
                "compared": data,
                # the most host memory one of this plan's compile processes held (memory_watch; None: none ran)
                "peak_rss_bytes": max(peaks) if peaks else None}

    def to_json(self) -> dict:
        f = self.figures
        out = {"accelerator": self.accelerator.name, "compiler": self.compiler, "label": self.label,
               "estimate": self.compiler == ESTIMATE, "cached": self.cached, "fits": self.fits,
               "verdict": self.verdict(), "hbm_bytes_per_device": self.hbm_bytes,
               "per_device": {k: f[k] for k in ("params_bytes", "optimizer_bytes", "argument_bytes", "output_bytes",
                                                "alias_bytes", "temp_bytes", "code_bytes", "total_bytes", "flops",
                                                "bytes_accessed", "kernel_bytes_uncounted") if k in f},
               # flops and bytes_accessed count the whole step ("counted" says how), as the TPU compiler counts
               # it: no byte of a Pallas kernel without a cost estimate (kernel_bytes_uncounted: their operands
               # and results, which the roofline adds); program_*: the compiled program's own figures, a loop's
               # body counted once
               "counted": f.get("counted"),
               "program": {k: f[k] for k in ("program_flops", "program_bytes_accessed") if k in f},
               "headroom_bytes": self.headroom_bytes, "devices": f["devices"], "mesh": f["mesh"],
               "dtype": f["dtype"], "compile_s": f["compile_s"], "tokens_per_step": f["tokens_per_step"],
               "model_flops_per_token": f["model_flops_per_token"], "timing": self.timing(),
               "refused": self.refused, "mesh_note": mesh_note(self), "mesh_check": mesh_check(self),
               "suggestions": [s.__dict__ for s in self.suggestions],
               "time_spent": self.time_spent(), "largest_batch": largest_batch(self),
               "alternative": self.alternative.to_json() if self.alternative else None}
        if f.get("counted_earlier"):  # the figures of this very program, read from a record of it (not compiled)
            out["counted_earlier"] = f["counted_earlier"]
        if f.get("settings", {}).get("experts"):  # where the experts are, and how a device's rows are bounded
            out["experts"] = f["settings"]["experts"]
        return out


def _peak_rss(p: Plan) -> int | None:
    """The host memory the compile of p's figures peaked at, when this plan ran it (None: from the cache)."""
    return None if p.cached else p.figures.get("host_peak_rss_bytes") or None


def _mesh_text(mesh: dict) -> str:
    """One slice's mesh as --mesh spells it (data=4,model=2): the `dcn` axis of several slices is not --mesh's."""
    return ",".join(f"{k}={v}" for k, v in mesh.items() if k != "dcn")


def devices_of(a: catalog.AcceleratorType) -> int:
    """The JAX devices a run on `a` has: the trainer's mesh is built over all of them."""
    return a.hosts * a.devices_per_host


def gib(b: float) -> str:
    """Bytes for people: GiB from 1 GiB up (2 decimals), MiB below, KiB below 1 MiB (a tiny step's buffers)."""
    if abs(b) >= GIB:
        return f"{b / GIB:.2f} GiB"
    return f"{b / 2 ** 20:.1f} MiB" if abs(b) >= 2 ** 20 else f"{b / 2 ** 10:.1f} KiB"


# ---- running the trainer's compile --------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    return program_counts.package_versions(VERSIONED)


def _trainer_code_hash() -> str:
    """The step is built from the trainer's code: an edited model is a different plan."""
    spec = importlib.util.find_spec("trainer")
    h = hashlib.sha256()
    for root in spec.submodule_search_locations or []:
        for p in sorted(Path(root).rglob("*.py")):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


# Options of a command whose values never reach its planned step: `lora` is planned from its --model size
# (trainer/common/aot.py), never reading its weights, data or checkpoints, and logging changes no program. A plan
# is cached by the step it compiles, so the same step under other paths is the same plan. (`pretrain`'s --data
# picks its tokenizer, so its vocabulary: not among them; its checkpoints' place and cadence and its logging are.)
_RUN_ONLY = ("--ckpt-dir", "--ckpt-every", "--keep", "--log-every", "--eval-every", "--profile")
STEP_NEUTRAL = {"lora": ("--weights", "--data", "--val-data", *_RUN_ONLY), "pretrain": _RUN_ONLY}


def step_argv(argv: list[str]) -> list[str]:
    """argv with each value of its command's step-neutral options written as '*' (--opt v and --opt=v alike)."""
    neutral = STEP_NEUTRAL.get(argv[0] if argv else "", ())
    out, skip = [], False
    for a in argv:
        if skip:
            out.append("*")
            skip = False
        elif a in neutral:
            out.append(a)
            skip = True
        elif a.split("=", 1)[0] in neutral and "=" in a:
            out += [a.split("=", 1)[0], "*"]
        else:
            out.append(a)
    return out


def cache_key(accelerator: str, mode: str, argv: list[str]) -> str:
    blob = json.dumps({"accelerator": accelerator, "mode": mode, "argv": step_argv(argv), "versions": _versions(),
                       "trainer": _trainer_code_hash()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _cache_dir() -> Path:
    from orchestrator.state import home
    return home() / "plans"


def _aot_argv(a: catalog.AcceleratorType, cpu_devices: bool, num_slices: int = 1) -> list[str]:
    """The trainer's planner for `a` (one slice's hosts and devices) x num_slices, joined by DCN."""
    base = [sys.executable, "-m", "trainer.plan", "--processes", str(a.hosts), "--devices", str(devices_of(a)),
            *(["--num-slices", str(num_slices)] if num_slices > 1 else [])]
    if cpu_devices:
        return base
    if not a.aot_topology:  # a generation libtpu has no name for here: the CPU compiler, planned as for TPU
        return [*base, "--run-platform", "tpu"]
    return [*base, "--tpu", a.aot_topology, "--chip-config", a.generation.aot_chip_config,
            "--host-bounds", a.aot_host_bounds, "--fallback-cpu"]


def _counts_argv(use_cache: bool) -> list[str]:
    """The planner's records of programs it counted (trainer/common/program_counts.py): this plan cache's, and
    without the cache (--no-cache) none read, the compile recorded again."""
    return ["--counts-dir", str(_cache_dir() / "programs"), *([] if use_cache else ["--recount"])]


def _trainer_error(stderr: str) -> str | None:
    lines = [ln[len("error: "):] for ln in stderr.splitlines() if ln.startswith("error: ")]
    return lines[-1] if lines else None


WATCH_S = 0.25  # how often a compile's host memory is read: between two reads its growth comes out of the reserve
SMALLER_STEP = "plan a smaller step (e.g. --remat full, whose layers compile as one scan)"
MEMORY_FIX = f"close other programs, plan on a machine with more memory, or {SMALLER_STEP}"
CAP_FIX = f"raise {memory_watch.MAX_RSS_ENV} (or unset it) if this machine has the memory, or {SMALLER_STEP}"


def _step_name(argv: list[str]) -> str:
    """The step as a person names it: the command and its size, e.g. `lora --model gemma4-e4b`."""
    named = [f"{a} {argv[i + 1]}" for i, a in enumerate(argv[:-1]) if a in ("--model", "--preset")]
    return "`" + " ".join([*argv[:1], *named]) + "`"


def compile_figures(a: catalog.AcceleratorType, argv: list[str], *, cpu_devices: bool = False, num_slices: int = 1,
                    progress: Callable[[str], None] | None = None, use_cache: bool = True) -> tuple[dict, bool]:
    """Run the trainer's AOT compile of `python -m trainer ARGV` for accelerator `a` (num_slices of them joined by
    DCN: the hybrid step); (figures, from cache)."""
    key = cache_key(a.name, ("local" if cpu_devices else "slice") + (f" x{num_slices}" if num_slices > 1 else ""),
                    argv)
    path = _cache_dir() / f"{key}.json"
    if use_cache and path.exists():
        try:
            return json.loads(path.read_text()), True
        except ValueError:
            pass  # a damaged entry is compiled again
    what = ("CPU compiler" if cpu_devices or not a.aot_topology else a.aot_topology) + (
        f" x {num_slices} slices" if num_slices > 1 else "")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "TPUCTL_EMULATE_DEVICES")
           and not k.startswith("TPUCTL_COORDINATOR")}
    env["PYTHONUNBUFFERED"] = "1"
    watch = memory_watch.Watch.from_env()
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([*_aot_argv(a, cpu_devices, num_slices), *_counts_argv(use_cache), "--", *argv],
                                stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            watch.attach(proc.pid)  # its own session: the group is the compile and what it starts
            said = None
            while proc.poll() is None:
                waited = int(time.monotonic() - t0) // 30 * 30  # a new line in logs every 30 s
                msg = f"compiling the train step for {a.name} ({what})" + (f", {waited}s so far" if waited else "")
                if progress and msg != said:
                    progress(msg)
                    said = msg
                try:
                    watch.sample()
                except memory_watch.HostMemoryExceeded as e:
                    raise PlanError(f"stopped compiling {_step_name(argv)} for {a.name}: {e}; "
                                    f"{CAP_FIX if e.by_cap else MEMORY_FIX}") from None
                time.sleep(WATCH_S)
        finally:
            if proc.poll() is None:  # Ctrl-C, too much memory or an error here: the compile goes with us
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode in (2, NOTHING_TO_PLAN) and _trainer_error(stderr):
        raise (NotPlannable if proc.returncode == NOTHING_TO_PLAN else PlanError)(_trainer_error(stderr))
    if proc.returncode == -signal.SIGKILL:  # not ours (we raised before killing it): most likely the OOM killer
        raise PlanError(f"the compile of {_step_name(argv)} for {a.name} was killed (SIGKILL) at "
                        f"{memory_watch.gb(watch.peak_bytes)} of host memory, most likely by the kernel for want of "
                        f"memory; {MEMORY_FIX}")
    if proc.returncode != 0:
        tail = " | ".join(stderr.strip().splitlines()[-3:]) or "no output"
        raise PlanError(f"the planner's compile failed (exit {proc.returncode}) for {a.name}: {tail}")
    figures = json.loads(stdout.strip().splitlines()[-1])
    figures["wall_s"] = round(time.monotonic() - t0, 2)  # the planner process, its phases inside (`phases`)
    figures["host_peak_rss_bytes"] = watch.peak_bytes  # its resident peak (0 where /proc cannot tell)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two plans of the same step may finish at once
    tmp.write_text(json.dumps(figures))
    tmp.replace(path)
    return figures, False


def _mode(figures: dict, cpu_devices: bool) -> str:
    if cpu_devices:
        return CPU
    return TPU if figures["compiler"] == "tpu" else ESTIMATE


# ---- what would fit ----------------------------------------------------------------------------------------
# One function per lever a trainer command declares (trainer/common/aot.py Built.levers): plan -> suggestion or None.
# The estimates split the compiled total into what stays (arguments, outputs, code, f32 gradients of the trained
# params, and for an fsdp-sharded base the copy each device gathers of the other devices' shards) and
# activations (the rest of the temporaries), which scale with the per-device micro-batch.

def _batch_axes(f: dict) -> int:
    """The mesh axes the batch splits over: data, and on several slices dcn (trainer/common/mesh.py RULES)."""
    return f["mesh"]["data"] * f["mesh"].get("dcn", 1)


def _slice_devices(f: dict) -> int:
    """One slice's devices: what --mesh describes (f["devices"] counts every slice's)."""
    return f["devices"] // f["mesh"].get("dcn", 1)


def _base(f: dict) -> int:
    """Per device: the params that get no gradient (LoRA's frozen base; 0 for pretraining)."""
    return f["params_bytes"] - f.get("grad_bytes", f["params_bytes"])


SCAN_GATHERED = 2


def _gathered(f: dict, data: int | None = None, scale: float = 1.0) -> int:
    """An fsdp base (settings fsdp) is all-gathered over `data` for the matmuls, and a step written out keeps the
    gathered layers for the backward pass: each device holds the shards of the other data-1 devices besides
    its own (`scale` its own shard's size relative to now). 0 for state that is not fsdp-sharded. Only the
    layers' weights are gathered (settings gathered_share: not the embedding tables, nor the experts that expert
    parallelism keeps in place; counted as gathered, 26B-A4B's experts, 93% of its base, would leave its rows a
    tenth of a GiB of activations and extrapolate a batch of 188 rows a device)."""
    s = f["settings"]
    if not s.get("fsdp"):
        return 0
    share = s.get("gathered_share", 1.0)
    if s.get("scan_layers") and s.get("n_layer"):
        # the layers in a scan: one iteration's layers gathered at a time, twice (the period's forward recomputed
        # and its backward)
        share *= min(1.0, SCAN_GATHERED * s["scan_layers"] / s["n_layer"])
    elif _base(f) * share * (f["mesh"]["data"] - 1) > f["temp_bytes"] - f.get("grad_bytes", f["params_bytes"]):
        return 0  # more than the temporaries hold, and no scan said: not counted
    return int(_base(f) * scale * share * ((data or f["mesh"]["data"]) - 1))


def _split(f: dict) -> tuple[int, int]:
    grads = f.get("grad_bytes", f["params_bytes"])  # LoRA: only the adapters get gradients
    activations = max(f["temp_bytes"] - grads - _gathered(f), 0)
    return f["total_bytes"] - activations, activations


def _on_devices(p: Plan, devices: int) -> int:
    """The per-device total on `devices` devices (the model axis kept), by arithmetic. Sharded over every device
    (settings fsdp: the Gemma base), the state shrinks per device but the gathered base does not; a batch
    that is per device (settings batch_per_device: `lora` without --batch-size) keeps its activations."""
    f = p.figures
    fixed, act = _split(f)
    s, n = f["settings"], _slice_devices(f)
    if s.get("fsdp"):
        fixed = (fixed - _gathered(f)) * n // devices + _gathered(f, devices // f["mesh"]["model"], n / devices)
    return fixed + (act if s.get("batch_per_device") else act * n // devices)


def _rows_unit(f: dict) -> tuple[str, str]:
    """What a step's rows are counted over (the batch splits over dcn x data only): ("device", "a device") where
    each device holds its own rows; on a mesh with model > 1 the devices of a data group hold its rows together
    (the positions and heads split over model): ("data group", "a data group of N devices"), or ("step", ...) where
    one data group holds every row of the step (data=1, one slice, no micro-batches)."""
    group = _slice_devices(f) // f["mesh"]["data"]
    if group == 1:
        return "device", "a device"
    if _batch_axes(f) == 1 and max(f["settings"].get("grad_accum") or 1, 1) == 1:
        return "step", f"a step (data=1: its {group} devices hold every row, split over model)"
    return "data group", f"a data group ({group} devices hold its rows, split over model)"


def largest_batch(p: Plan) -> dict | None:
    """The largest batch whose step fits the chip's HBM, extrapolated from this step's activations (_split: the
    temporaries beyond the gradients and the gathered base, taken as growing with the rows each device's data
    group holds): {rows, per, unit, devices_per_group, batch_size, estimate_bytes, compiled_rows, how}; `rows`
    are counted over `per` (_rows_unit: a device where model=1, else a data group, or the step where data=1).
    None for a step with no rows setting (or whose rows are not split by the batch axes), or a refused one
    (nothing was counted to extrapolate from)."""
    f, s = p.figures, p.figures["settings"]
    if p.refused or not s.get("batch_size"):
        return None
    axes = _batch_axes(f) * max(s.get("grad_accum") or 1, 1)
    rows = s["batch_size"] // axes
    if rows < 1:
        return None
    per, unit = _rows_unit(f)
    about = {"per": per, "unit": unit, "devices_per_group": _slice_devices(f) // f["mesh"]["data"]}
    fixed, act = _split(f)
    if rows == 1 and p.fits:
        # From one row the temporaries' share that grows with the rows cannot be told from the rest (the loss's
        # chunk, a layer's working set): all of it per row said 1 where 4 fit (gemma4-31b on v5litepod-8,
        # docs/gemma.md). So the one row compiled is the figure, a lower bound.
        return {"rows": 1, **about, "batch_size": axes, "estimate_bytes": int(p.total_bytes),
                "compiled_rows": 1, "lower_bound": True,
                "how": f"at least this: compiled at one row a {per}, which cannot tell the rows' share of the "
                       f"temporaries from the rest; plan two rows a {per} (--batch-size {2 * axes}) to extrapolate"}
    per_row = act / rows
    fit = int((p.hbm_bytes - fixed) // per_row) if per_row > 0 else rows
    fit = max(fit, 0)
    return {"rows": fit, **about, "batch_size": fit * axes, "estimate_bytes": int(fixed + per_row * fit),
            "compiled_rows": rows,
            "how": f"extrapolated from this step's activations at {rows} row(s) a {per} (not compiled)"}


def _grad_accum(p: Plan) -> Iterator[Suggestion]:
    f, s = p.figures, p.figures["settings"]
    fixed, act = _split(f)
    for k in (2, 4, 8, 16, 32):
        ga = s["grad_accum"] * k
        if s["batch_size"] % ga or (s["batch_size"] // ga) % _batch_axes(f):
            continue
        est = fixed + f["params_bytes"] * (s["grad_accum"] == 1) + act // k  # + the f32 gradient accumulator
        if est <= p.hbm_bytes:
            yield Suggestion(f"--grad-accum {ga}", est, f"the same batch in {ga} micro-batches: activations "
                                                         f"/{k}, same result, more passes per step")


def _batch_size(p: Plan) -> Iterator[Suggestion]:
    f, s = p.figures, p.figures["settings"]
    fixed, act = _split(f)
    for k in (2, 4, 8, 16, 32):
        b = s["batch_size"] // k
        if s["batch_size"] % k or b < 1 or b % (_batch_axes(f) * s["grad_accum"]):
            continue
        est = fixed + act // k
        if est <= p.hbm_bytes:
            yield Suggestion(f"--batch-size {b}", est, f"a {k}x smaller per-device batch: fewer tokens per step "
                                                        "(changes the optimisation; --grad-accum keeps it)")


# Tensor parallelism as the mesh rules lay it out (trainer/common/mesh.py RULES, trainer/models/gemma.py): the
# residual stream between the layers splits its positions over `model`, the heads and MLP columns split over it,
# so a device's activations stay the same as `model` grows on the same devices, but for the layers' inputs: each
# projection reads its rows' every position whole ([rows of one data group, T, d_model]), and a data group has
# model times the rows. Two such inputs at a time (the attention's and the MLP's, of the layer being recomputed).
GATHERED_INPUTS = 2


def _layer_inputs(f: dict, model: int) -> int:
    """Per device: the layers' inputs gathered over `model` on a mesh of `model` on this plan's slice (0 where
    the plan does not know the model's width)."""
    s = f["settings"]
    if not s.get("d_model") or not s.get("seq_len"):
        return 0
    rows = s["batch_size"] // (s.get("grad_accum") or 1) // (_slice_devices(f) // model * f["mesh"].get("dcn", 1))
    width = 2 if f.get("dtype") in ("bfloat16", "bf16") else 4
    return GATHERED_INPUTS * rows * s["seq_len"] * s["d_model"] * width


def _on_mesh(f: dict, m: int) -> int:
    """The per-device total of this plan's step on the same slice with model=m (data = devices / m), by
    arithmetic: the fsdp base gathered over the smaller data, the layers' inputs over model=m's larger groups."""
    fixed, act = _split(f)
    n = _slice_devices(f)
    if f["settings"].get("fsdp"):
        return fixed - _gathered(f) + _gathered(f, n // m) + act - _layer_inputs(f, f["mesh"]["model"]) \
            + _layer_inputs(f, m)
    return (fixed * f["mesh"]["model"]) // m + act


def _mesh_model(p: Plan) -> Iterator[Suggestion]:
    f, s = p.figures, p.figures["settings"]
    n = _slice_devices(f)  # --mesh is one slice's
    for m in (2, 4, 8, 16):
        if n % m or s.get("n_head", m) % m or m <= f["mesh"]["model"]:
            continue
        est = _on_mesh(f, m)
        if s.get("fsdp"):
            note = (f"the base's heads and MLP split over {m} devices (tensor parallel): less of it gathered, "
                    f"each layer's input gathered over {m} positions' shards")
        else:
            note = f"params, optimizer state and gradients split over {m} devices (tensor parallel)"
        if est <= p.hbm_bytes:
            yield Suggestion(f"--mesh data={n // m},model={m}", est, note)


GROWN_SHOWN = 3  # the buffers a mesh note names: the ones that grew most


def _data_only(mesh: str) -> bool:
    return bool(re.search(r"\bmodel=1\b", mesh))


def mesh_check(p: Plan) -> dict | None:
    """A plan whose mesh has model > 1 against the same step compiled on another mesh of the slice (p.compared:
    all of its devices on data, or the mesh `--compare-mesh` named, e.g. the one with half the model): both
    per-device figures as the compiler counts them, how much more (or less) this mesh holds, and when more, the
    buffers that grew most (the compiler's buffer assignment of each program, by jax source: trainer/common/buffers.py).
    None without that compile."""
    if p.compared is None and p.compared_error is None:
        return None
    f = p.figures
    keys = ("total_bytes", "params_bytes", "optimizer_bytes", "temp_bytes")
    out = {"mesh": _mesh_text(f["mesh"]), "compared_mesh": p.compared_mesh,
           "this": {k: f[k] for k in keys}, "compared": None, "more_bytes": None, "grown": [],
           "error": p.compared_error,
           "how": "the compiler's per-device count of both programs (not a chip measurement); the grown buffers "
                  "from each program's buffer assignment, matched by jax op and source"}
    d = p.compared
    if d is None:
        return out
    out["compared"] = {**{k: d.figures[k] for k in keys}, "refused": d.refused, "cached": d.cached}
    if d.refused:
        return out
    out["more_bytes"] = p.total_bytes - d.total_bytes
    if out["more_bytes"] > 0:
        mine, theirs = f.get("buffers"), d.figures.get("buffers")
        # None: a program jax's persistent compilation cache served, whose buffer assignment nobody wrote
        out["grown"] = None if mine is None or theirs is None else buffers.grown(mine, theirs, GROWN_SHOWN)
    return out


def _buffer_text(b: dict, other: str) -> str:
    was = (f"{gib(b['other_bytes'])} on {other}" if b["other_bytes"] is not None else
           f"not among {other}'s {buffers.KEEP} largest")
    op = re.sub(r"^jit\([^)]*\)/", "", b["op_name"]) or b["instruction"]  # the step's own name, on every op
    return (f"{op} {b['shape']} {gib(b['bytes'])} ({was})"
            + (f" at {b['source']}" if b["source"] else ""))


def mesh_note(p: Plan) -> str | None:
    """A model > 1 plan against the same step compiled on another mesh (mesh_check), in words: which holds more a
    device, by the compiler's count, and when this mesh does (the exception to "more `model` on the same slice,
    fewer bytes a device"), what grew."""
    c = mesh_check(p)
    if c is None:
        return None
    other = c["compared_mesh"]
    called = f"{other} (data alone)" if _data_only(other) else other
    if c["compared"] is None:
        return f"not compared with {other}: {c['error']}"
    d = c["compared"]
    if d["refused"]:
        return (f"{called} is refused by the compiler ({d['refused']['message']}); "
                f"{c['mesh']} is not")
    t = c["this"]
    more = c["more_bytes"]
    figures = (f"{gib(t['total_bytes'])} against {gib(d['total_bytes'])} (params {gib(t['params_bytes'])} against "
               f"{gib(d['params_bytes'])}, temporaries {gib(t['temp_bytes'])} against {gib(d['temp_bytes'])}; "
               "compiled, the compiler's count)")
    if more <= 0:
        return f"{c['mesh']} holds {gib(-more)} less per device than {called}: {figures}"
    head = f"{c['mesh']} holds {gib(more)} MORE per device than {called}: {figures}"
    if c["grown"] is None:
        return (head + ". What grew is not named: a program came from jax's compilation cache "
                       "(JAX_COMPILATION_CACHE_DIR), which keeps no buffer assignment")
    if not c["grown"]:
        return head + ". None of its buffer assignment's largest buffers grew: the growth is in smaller ones"
    return head + ". Grew most, in the compiler's buffer assignment: " + "; ".join(
        _buffer_text(b, other) for b in c["grown"])


def _remat(p: Plan) -> Iterator[Suggestion]:
    """--remat full keeps only each layer's input for the backward pass and recomputes the layer from it. The
    estimate keeps two layers' worth of the activations (the inputs of all of them are about one layer's share;
    one layer is recomputed at a time): a guess for a step whose activations are mostly the layers' (the loss's
    logits are not, and the compile of the first suggestion checks it)."""
    f, s = p.figures, p.figures["settings"]
    if s.get("remat", "none") == "full" or not s.get("n_layer"):
        return
    fixed, act = _split(f)
    est = fixed + act * 2 // max(s["n_layer"], 2)
    if est > p.hbm_bytes:
        return
    yield Suggestion("--remat full", est, "each layer recomputed from its input in the backward pass: the same "
                                           "result for about a third more FLOPs (one more forward pass)")


def _positions(chunk: int, seq_len: int) -> int:
    """The positions a loss chunk of `chunk` takes (the trainer's xent.chunk_of): the largest divisor of seq_len
    not above it; 0 or more than seq_len: all."""
    if chunk <= 0 or chunk >= seq_len:
        return seq_len
    return max(c for c in range(1, chunk + 1) if seq_len % c == 0)


def _loss_chunk(p: Plan) -> Iterator[Suggestion]:
    """LoRA's --loss-chunk: the loss holds two f32 copies of a chunk's logits [rows, chunk, vocab] per device (its
    softmax and the soft-capped logits; gemma2-2b on v5e-8, 4 rows of 512: 10.25 GiB whole, 7.29 GiB in chunks
    of 128, this estimate 7.32). The largest chunk that fits: each chunk reads the embedding once more."""
    f, s = p.figures, p.figures["settings"]
    t, vocab = s.get("seq_len"), s.get("vocab")
    if not t or not vocab:
        return
    # a device's rows (the batch over dcn x data), its share of the vocabulary (split over model), f32 twice
    per_position = 2 * (s["batch_size"] // _batch_axes(f)) * (vocab // f["mesh"]["model"]) * 4
    now = _positions(s.get("loss_chunk", 0), t)
    for c in (512, 256, 128, 64, 32, 16):
        c = _positions(c, t)
        if c >= now:
            continue
        est = f["total_bytes"] - per_position * (now - c)
        if est <= p.hbm_bytes:
            yield Suggestion(f"--loss-chunk {c}", est, f"the loss's logits {c} positions at a time, not {now}: "
                                                        "the same result; the embedding read once more a chunk")


def _base_dtype(p: Plan) -> Iterator[Suggestion]:
    """A frozen base held in f32 (LoRA's --base-dtype): bf16 halves it."""
    f, s = p.figures, p.figures["settings"]
    if s.get("base_dtype") != "float32":
        return
    est = f["total_bytes"] - (_base(f) + _gathered(f)) // 2  # its shard and the gathered copy
    if est > p.hbm_bytes:
        return
    yield Suggestion("--base-dtype bfloat16", est, "the frozen base in bf16: half its bytes (the adapters and "
                                                    "their optimizer state stay f32)")


# Each lever yields every change it could make whose estimate fits, best first; a plan shows the first of each.
LEVERS: dict[str, Callable[[Plan], Iterator[Suggestion]]] = {
    "grad_accum": _grad_accum, "remat": _remat, "batch_size": _batch_size, "mesh_model": _mesh_model,
    "base_dtype": _base_dtype, "loss_chunk": _loss_chunk,
}


def suggest(p: Plan) -> list[Suggestion]:
    out = []
    for name in p.figures.get("levers", ()):
        first = next(LEVERS[name](p), None) if name in LEVERS else None
        if first is not None:
            first.lever = name
            out.append(first)
    return out


def _larger(a: catalog.AcceleratorType) -> list[catalog.AcceleratorType]:
    g = a.generation
    return [catalog.lookup(f"{g.name}-{size}") for size in sorted(g.topologies) if size > int(a.name.rsplit("-", 1)[1])]


def _with_mesh(argv: list[str], devices: int, figures: dict) -> list[str]:
    """An explicit --mesh resized for `devices` (data grows, model stays); none given: none added."""
    model = figures["mesh"]["model"]
    if not any(a == "--mesh" or a.startswith("--mesh=") for a in argv):
        return argv
    return _mesh_argv(argv, f"data={devices // model},model={model}")


def next_size(p: Plan, argv: list[str], *, num_slices: int = 1, progress=None, use_cache=True,
              tries: int = 2) -> Plan | None:
    """The smallest larger slice of the same generation whose compiled step fits (at most `tries` compiles)."""
    for a in _larger(p.accelerator):
        if tries <= 0:
            break
        devices = devices_of(a)
        if _on_devices(p, devices) > a.hbm_gib * GIB / devices:
            continue  # not even the arithmetic fits: no compile
        tries -= 1
        try:
            figs, cached = compile_figures(a, _with_mesh(argv, devices, p.figures), num_slices=num_slices,
                                           progress=progress, use_cache=use_cache)
        except PlanError:
            continue  # e.g. the batch does not split over that many devices
        alt = Plan(a, _mode(figs, False), figs, mfu=p.mfu, steps=p.steps, cached=cached)
        if alt.fits:
            return alt
    return None


# ---- the API ----------------------------------------------------------------------------------------------

def plan(accelerator: str, argv: list[str], *, cpu_devices: bool = False, num_slices: int = 1,
         steps: int | None = None, mfu: float = 0.5, progress: Callable[[str], None] | None = None,
         use_cache: bool = True, alternatives: bool = True, compare_mesh: str | None = None) -> Plan:
    """Plan `python -m trainer ARGV` on ACCELERATOR. cpu_devices: the slice's devices are emulated CPU devices
    (its provider says so), planned with the CPU compiler on them. num_slices: that many slices joined by DCN,
    the step compiled over the hybrid mesh (the slices on `dcn`) as the run builds it; figures stay per device.
    alternatives: when it does not fit, also compile the next accelerator size that does. compare_mesh
    ('data=D,model=M'): the mesh a model > 1 step is compared with (mesh_check; default all devices on data)."""
    try:
        a = catalog.lookup(accelerator)
    except catalog.UnknownAccelerator as e:
        raise UserError(str(e)) from None
    if not argv:
        raise UserError("nothing to plan: put the trainer command after --, e.g. "
                        "`tpuctl plan -a v4-8 -- pretrain --preset gpt2-124m --ckpt-dir gs://BUCKET/run`")
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu {mfu}: give a fraction in (0, 1], e.g. 0.5")
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps}: must be at least 1")
    if compare_mesh is not None and not re.fullmatch(r"data=\d+,model=\d+", compare_mesh):
        raise UserError(f"--compare-mesh {compare_mesh}: give a mesh of the slice as data=D,model=M, "
                        "e.g. --compare-mesh data=4,model=2")
    if compare_mesh is not None and _mesh_argv(argv, compare_mesh) == argv:  # argv's own --mesh already
        raise UserError(f"--compare-mesh {compare_mesh} is the step's own --mesh: name another mesh of the slice")
    figs, cached = compile_figures(a, argv, cpu_devices=cpu_devices, num_slices=num_slices, progress=progress,
                                   use_cache=use_cache)
    p = Plan(a, _mode(figs, cpu_devices), figs, mfu=mfu, steps=steps, cached=cached)
    if alternatives and not p.refused and (figs["mesh"]["model"] > 1 or compare_mesh is not None):
        other = compare_mesh or f"data={_slice_devices(figs)},model=1"
        if other == _mesh_text(figs["mesh"]):  # the trainer's default mesh: nothing else to compile
            p.compared_mesh, p.compared_error = other, "it is the step's own (default) mesh"
        else:
            _compile_compared(p, argv, other, cpu_devices=cpu_devices, num_slices=num_slices, progress=progress,
                              use_cache=use_cache)
    if not p.fits:
        p.suggestions = suggest(p)
        if alternatives and p.suggestions:
            kw = dict(cpu_devices=cpu_devices, num_slices=num_slices, progress=progress, use_cache=use_cache)
            first = p.suggestions[0]
            _compile_suggestion(p, first, argv, **kw)
            # An estimate the compiler refutes: its lever's next change that fits by estimate, compiled too (one
            # more compile at most), shown after it.
            if first.compiled_fits is False and first.lever in LEVERS:
                nxt = next(itertools.islice(LEVERS[first.lever](p), 1, None), None)
                if nxt is not None:
                    nxt.lever = first.lever
                    _compile_suggestion(p, nxt, argv, **kw)
                    p.suggestions.insert(1, nxt)
        if alternatives and not cpu_devices:
            p.alternative = next_size(p, argv, num_slices=num_slices, progress=progress, use_cache=use_cache)
    return p


def _mesh_argv(argv: list[str], mesh: str) -> list[str]:
    """argv with its --mesh (either spelling) set to `mesh`, or --mesh added where it has none."""
    out, i, found = [], 0, False
    while i < len(argv):
        a = argv[i]
        if a == "--mesh" and i + 1 < len(argv):
            out += [a, mesh]
            i, found = i + 2, True
            continue
        if a.startswith("--mesh="):
            a, found = f"--mesh={mesh}", True
        out.append(a)
        i += 1
    return out if found else [*out, "--mesh", mesh]


def _compile_compared(p: Plan, argv: list[str], mesh: str, **kw) -> None:
    """The same step on another mesh of the slice, compiled (or from the cache) for mesh_check."""
    p.compared_mesh = mesh
    try:
        figs, cached = compile_figures(p.accelerator, _mesh_argv(argv, mesh), **kw)
    except PlanError as e:
        p.compared_error = str(e)  # e.g. a batch that does not split over that many rows
        return
    p.compared = Plan(p.accelerator, p.compiler, figs, cached=cached)


def _compile_suggestion(p: Plan, s: Suggestion, argv: list[str], **kw) -> None:
    """Check an estimated suggestion with the compiler (activations do not shrink exactly with the batch)."""
    t0 = time.monotonic()
    try:
        figs, cached = compile_figures(p.accelerator, [*argv, *s.change.split()], **kw)
    except PlanError:
        s.compile_wall_s = round(time.monotonic() - t0, 2)
        return  # the trainer rejects it after all: it stays an estimate
    s.compile_wall_s = 0.0 if cached else figs.get("wall_s", round(time.monotonic() - t0, 2))
    s.compile_peak_rss_bytes = None if cached else figs.get("host_peak_rss_bytes") or None
    checked = Plan(p.accelerator, p.compiler, figs)
    s.compiled_bytes, s.compiled_fits = checked.total_bytes, checked.fits


def gate(accelerator: str, argv: list[str], *, cpu_devices: bool, num_slices: int = 1,
         progress: Callable[[str], None] | None = None, skip_flag: str = "--no-plan",
         on_skip: Callable[[str], None] | None = None) -> Plan | None:
    """The check before `tpuctl up` / `run` creates or launches anything: the plan (None for a trainer command
    the planner cannot build, e.g. one with no train step: on_skip, else progress, gets the reason), or a
    PlanError with its verdict when the step does not fit (nothing else is compiled here: `tpuctl plan` does
    that)."""
    try:
        p = plan(accelerator, argv, cpu_devices=cpu_devices, num_slices=num_slices, progress=progress,
                 alternatives=False)
    except NotPlannable as e:
        if on_skip or progress:
            (on_skip or progress)(f"not planned: {e}")
        return None
    if not p.fits:
        fix = f"; would fit: {p.suggestions[0].change}" if p.suggestions else ""
        slices = f" --num-slices {num_slices}" if num_slices > 1 else ""
        raise PlanError(f"plan: {p.verdict()}{fix}; `tpuctl plan -a {p.accelerator.name}{slices} -- ...` shows the "
                        f"whole plan, {skip_flag} skips this check")
    return p


def check_before_run(accelerator: str | None, slices: int, argv: list[str], storage_env: dict[str, str], *,
                     cpu_devices: bool, say: Callable[[str], None]) -> None:
    """`tpuctl run`'s gate: a trainer step (argv after `python -m trainer`) on a slice of known type is planned
    first and refused (PlanError) when it does not fit. storage_env points the planner at the storage the run
    will use (for a local slice, the GCS emulator): it reads what the trainer would, e.g. the data's meta.json,
    whose tokenizer sets the vocabulary. On several slices the hybrid step is planned, as `tpuctl plan
    --num-slices` does."""
    if not accelerator:
        return
    saved = {k: os.environ.get(k) for k in storage_env}
    os.environ.update(storage_env)
    try:
        p = gate(accelerator, argv, cpu_devices=cpu_devices, num_slices=slices, progress=say)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if p is not None:
        say(f"plan: {p.verdict()}" + (f" ({slices} slices joined by DCN: {p.figures.get('dcn_send_ops', 0)} DCN "
                                      f"collective(s), {gib(p.figures.get('dcn_send_bytes', 0))} per device per step)"
                                      if slices > 1 else ""))
