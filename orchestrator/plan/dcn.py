"""`tpuctl plan --num-slices N`: a multislice run's plan. `--mesh` describes one slice (ICI); the slices add an
outer data-parallel axis over the data-center network (DCN), so each slice runs the step on its share of the global
batch and, once per step, the slices all-reduce one set of gradients over DCN.

The per-device figures are one slice's step compiled (orchestrator/plan/step.py) at batch / N. The DCN traffic is
arithmetic on the compiler's gradient bytes: a ring all-reduce over N slices moves 2 (N - 1) / N of the gradient
through each slice, split across the slice's hosts (each host carries its devices' part). Its time is at a stated
DCN bandwidth per host, shown beside the step's compute time: an assumption, labelled as one.
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
    slice_plan: P.Plan       # one slice's step on its share of the global batch
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

    def to_json(self) -> dict:
        return {"num_slices": self.num_slices, "global_batch": self.global_batch,
                "slice": self.slice_plan.to_json(), "fits": self.fits, "grad_bytes": self.grad_bytes,
                "dcn_bytes_per_host_per_step": self.dcn_bytes_per_host, "dcn_gbps_per_host_assumed": self.dcn_gbps,
                "dcn_s_per_step": self.dcn_s, "compute_s_per_step_at_mfu": self.compute_s}

    def render(self) -> str:
        p, a = self.slice_plan, self.slice_plan.accelerator
        f = p.figures
        n = self.num_slices
        mesh = ",".join(f"{k}={v}" for k, v in f["mesh"].items())
        share = (f"{self.global_batch} / {n} = {self.global_batch // n} sequences per slice" if self.global_batch
                 else "the batch grows with the devices: the same per slice")
        lines = [f"multislice plan: {n} x {a.name} joined by DCN = {a.chips * n} chips, {a.hosts * n} host(s), "
                 f"{f['devices'] * n} devices; --mesh {mesh} per slice (ICI), dcn={n} across slices (data parallel)",
                 f"  each slice's step, on its share of the global batch ({share}): {p.label}",
                 f"  per device: {P.gib(p.total_bytes)} of {P.gib(p.hbm_bytes)} HBM (parameters "
                 f"{P.gib(f['params_bytes'])}, optimizer {P.gib(f['optimizer_bytes'])}, temporaries "
                 f"{P.gib(f['temp_bytes'])}): {'FITS' if p.fits else 'DOES NOT FIT'}",
                 f"  DCN per step: the gradient all-reduce over {n} slices ({P.gib(self.grad_bytes)} of gradients): "
                 f"{P.gib(self.dcn_bytes_per_host)} sent and received by each host"]
        c = self.compute_s
        beside = (f"beside a compute step of {c * 1e3:.3g} ms at an assumed MFU of {p.mfu:g}"
                  f" (DCN / compute = {self.dcn_s / c:.2g})" if c else
                  "(no compute time on a local slice's CPU devices)")
        lines.append(f"  at {self.dcn_gbps:g} Gbit/s of DCN per host (an assumption; --dcn-gbps): "
                     f"{self.dcn_s * 1e3:.3g} ms per step" + (", " if c else " ") + beside)
        return "\n".join(lines)


def plan(accelerator: str, argv: list[str], num_slices: int, *, local: bool = False, steps: int | None = None,
         mfu: float = 0.5, dcn_gbps: float = DEFAULT_DCN_GBPS, progress: Callable[[str], None] | None = None,
         use_cache: bool = True) -> MultislicePlan:
    """Plan `python -m trainer ARGV` on num_slices slices of ACCELERATOR joined by DCN."""
    try:
        a = P.catalog.lookup(accelerator)
    except P.catalog.UnknownAccelerator as e:
        raise UserError(str(e)) from None
    check_num_slices(num_slices, a)
    if not dcn_gbps > 0:
        raise UserError(f"--dcn-gbps {dcn_gbps}: give the DCN bandwidth per host in Gbit/s, e.g. 100")
    whole = P.plan(accelerator, argv, local=local, steps=steps, mfu=mfu, progress=progress, use_cache=use_cache,
                   alternatives=False)
    settings = whole.figures.get("settings") or {}
    batch = None if settings.get("batch_per_device") else settings.get("batch_size")
    per_slice = whole
    if batch and num_slices > 1:
        if batch % num_slices:
            raise UserError(f"--batch-size {batch} does not split over {num_slices} slices: give a multiple of "
                            f"{num_slices} (the global batch goes over the slices, then over --mesh data)")
        per_slice = P.plan(accelerator, [*argv, "--batch-size", str(batch // num_slices)], local=local, steps=steps,
                           mfu=mfu, progress=progress, use_cache=use_cache, alternatives=False)
    f = per_slice.figures
    # The whole gradient: each device holds grad_bytes of it, replicated over --mesh data unless the state is
    # split over every device (fsdp).
    replicas = 1 if settings.get("fsdp") else int(f["mesh"].get("data", 1))
    grad = int(f.get("grad_bytes", f["params_bytes"])) * int(f["devices"]) // max(1, replicas)
    return MultislicePlan(per_slice, num_slices, batch, grad, dcn_gbps)
