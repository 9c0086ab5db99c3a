"""`tpuctl plan --num-slices N`: a multislice run's plan. `--mesh` describes one slice (ICI); the slices add an
outer data-parallel axis over the data-center network (DCN), so the global batch splits over dcn x data and, once
per step, the slices reduce one set of gradients over DCN.

The step is compiled as the run builds it (orchestrator/plan/step.py with num_slices): over the hybrid mesh of N
slices' devices, the slices on its `dcn` axis, so the per-device figures are the hybrid step's, and the compiler
says which of its collectives cross slices (dcn_send_ops, dcn_send_bytes: what each device hands to them per step,
trainer/common/collectives.py). Beside them, the arithmetic of one gradient all-reduce (a ring over N slices moves
2 (N - 1) / N of the gradient through each slice, split across the slice's hosts) and its time at a stated DCN
bandwidth per host, shown beside the step's compute time: an assumption, labelled as one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from orchestrator.plan import step as P
from orchestrator.spec import UserError, check_num_slices

# A stated assumption, not a measurement: the DCN bandwidth one TPU VM host gets to the other slices.
DEFAULT_DCN_GBPS = 100.0


@dataclass
class MultislicePlan:
    slice_plan: P.Plan       # the hybrid step over every slice, per device
    num_slices: int
    global_batch: int | None  # None: the batch grows with the devices (its share is the same per slice)
    grad_bytes: int          # the whole gradient each slice contributes to the all-reduce
    dcn_gbps: float

    @property
    def fits(self) -> bool:
        return self.slice_plan.fits

    @property
    def hosts_per_slice(self) -> int:
        return self.slice_plan.accelerator.hosts

    @property
    def dcn_bytes_per_host(self) -> float:
        """Bytes each host sends (and receives) over DCN per step: a ring all-reduce's 2 (N - 1) / N of the
        gradient, the slice's hosts each carrying their share."""
        n = self.num_slices
        return 2 * (n - 1) / n * self.grad_bytes / self.hosts_per_slice

    @property
    def dcn_s(self) -> float:
        return self.dcn_bytes_per_host * 8 / (self.dcn_gbps * 1e9)

    @property
    def compute_s(self) -> float | None:
        return self.slice_plan.step_s(self.slice_plan.mfu)

    @property
    def compiled_dcn(self) -> dict:
        """The compiled step's collectives that cross slices (per device per step), as the trainer counted them."""
        f = self.slice_plan.figures
        return {k: f[k] for k in ("dcn_send_ops", "dcn_send_bytes", "dcn_ops_by_kind") if k in f}

    def to_json(self) -> dict:
        return {"num_slices": self.num_slices, "global_batch": self.global_batch,
                "slice": self.slice_plan.to_json(), "fits": self.fits, **self.compiled_dcn,
                "grad_bytes": self.grad_bytes,
                "dcn_bytes_per_host_per_step": self.dcn_bytes_per_host, "dcn_gbps_per_host_assumed": self.dcn_gbps,
                "dcn_s_per_step": self.dcn_s, "compute_s_per_step_at_mfu": self.compute_s}

    def render(self) -> str:
        p, a = self.slice_plan, self.slice_plan.accelerator
        f = p.figures
        n = self.num_slices
        mesh = ",".join(f"{k}={v}" for k, v in f["mesh"].items())
        share = (f"{self.global_batch} / {n} = {self.global_batch // n} sequences per slice" if self.global_batch
                 else "the batch grows with the devices: the same per slice")
        dcn = self.compiled_dcn
        lines = [f"multislice plan: {n} x {a.name} joined by DCN = {a.chips * n} chips, {a.hosts * n} host(s), "
                 f"{f['devices']} devices; mesh {mesh}: --mesh per slice (ICI), dcn={n} across slices (data "
                 "parallel)",
                 f"  the step over the hybrid mesh (dcn={n} x the slice's mesh), the global batch over dcn x data "
                 f"({share}): {p.label}",
                 f"  per device: {P.gib(p.total_bytes)} of {P.gib(p.hbm_bytes)} HBM (parameters "
                 f"{P.gib(f['params_bytes'])}, optimizer {P.gib(f['optimizer_bytes'])}, temporaries "
                 f"{P.gib(f['temp_bytes'])}): {'FITS' if p.fits else 'DOES NOT FIT'}",
                 (f"  DCN per step, compiled: {dcn['dcn_send_ops']} collective(s) cross slices ("
                  + ", ".join(f"{k} x{v}" for k, v in sorted(dcn.get("dcn_ops_by_kind", {}).items()))
                  + f"), {P.gib(dcn['dcn_send_bytes'])} handed to them by each device"
                  if "dcn_send_ops" in dcn else "  DCN per step, compiled: not counted (figures from an older plan)"),
                 f"  DCN per step, arithmetic: one gradient all-reduce over {n} slices ({P.gib(self.grad_bytes)} of "
                 f"gradients): {P.gib(self.dcn_bytes_per_host)} sent and received by each host"]
        c = self.compute_s
        beside = (f"beside a compute step of {c * 1e3:.3g} ms at an assumed MFU of {p.mfu:g}"
                  f" (DCN / compute = {self.dcn_s / c:.2g})" if c else
                  "(no compute time on a local slice's CPU devices)")
        lines.append(f"  at {self.dcn_gbps:g} Gbit/s of DCN per host (an assumption; --dcn-gbps): "
                     f"{self.dcn_s * 1e3:.3g} ms per step" + (", " if c else " ") + beside)
        return "\n".join(lines)


def plan(accelerator: str, argv: list[str], num_slices: int, *, cpu_devices: bool = False, steps: int | None = None,
         mfu: float = 0.5, dcn_gbps: float = DEFAULT_DCN_GBPS, progress: Callable[[str], None] | None = None,
         use_cache: bool = True) -> MultislicePlan:
    """Plan `python -m trainer ARGV` on num_slices slices of ACCELERATOR joined by DCN: the hybrid step compiled
    (a batch that does not split over dcn x data is the trainer's one-line refusal, a PlanError)."""
    try:
        a = P.catalog.lookup(accelerator)
    except P.catalog.UnknownAccelerator as e:
        raise UserError(str(e)) from None
    check_num_slices(num_slices, a)
    if not dcn_gbps > 0:
        raise UserError(f"--dcn-gbps {dcn_gbps}: give the DCN bandwidth per host in Gbit/s, e.g. 100")
    p = P.plan(accelerator, argv, cpu_devices=cpu_devices, num_slices=num_slices, steps=steps, mfu=mfu,
               progress=progress, use_cache=use_cache, alternatives=False)
    f = p.figures
    settings = f.get("settings") or {}
    batch = None if settings.get("batch_per_device") else settings.get("batch_size")
    # The whole gradient: each device holds grad_bytes of it, replicated over --mesh data (and dcn) unless the
    # state is split over every device of a slice (fsdp).
    replicas = int(f["mesh"].get("dcn", 1)) * (1 if settings.get("fsdp") else int(f["mesh"].get("data", 1)))
    grad = int(f.get("grad_bytes", f["params_bytes"])) * int(f["devices"]) // max(1, replicas)
    return MultislicePlan(p, num_slices, batch, grad, dcn_gbps)
