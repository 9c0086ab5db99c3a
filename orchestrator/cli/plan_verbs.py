"""`tpuctl plan`: a click command over orchestrator/plan/step.py (registered into the `tpuctl` group by cli/app.py), and the
plan as text."""
from __future__ import annotations

import json
import signal
import sys
import threading

import click

from orchestrator.cli.options import PassThrough
from orchestrator.plan import memory_watch, step as P
from orchestrator.spec import UserError
from trainer.common import program_counts

DOES_NOT_FIT = 3  # exit code: planned, and the step does not fit (errors exit 1)


@click.command("plan", cls=PassThrough)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("-a", "--accelerator", metavar="TYPE", required=True,
              help="Accelerator type to plan for, e.g. v4-8, v5litepod-8 (alias v5e-8), v5p-8, v6e-4.")
@click.option("--steps", type=int, help="Steps for wall time and cost (default: the command's --steps).")
@click.option("--mfu", type=float, default=0.5, show_default=True,
              help="Assumed model FLOPs utilisation for a second step time, tokens/s, wall time and cost (an "
                   "assumption, stated as one, beside the roofline's: FLOPs at peak or bytes at HBM bandwidth).")
@click.option("--local", is_flag=True, help="Plan for a local slice of that type: the CPU compiler on its emulated "
                                            "devices, what `tpuctl run` on a local slice checks.")
@click.option("--no-cache", is_flag=True, help="Compile again even when this exact plan is cached "
                                               "($TPUCTL_HOME/plans) or its program was counted before "
                                               "($TPUCTL_HOME/plans/programs, and tpuctl's own records of the "
                                               "default Gemma 4 steps whose layers are written out).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout (for scripts).")
@click.option("--num-slices", type=int, default=1, show_default=True,
              help="Multislice: N slices of ACCELERATOR joined by DCN (--mesh is one slice's): the step compiled "
                   "over the hybrid mesh (dcn=N), the collectives that cross slices and their bytes per step, and "
                   "the gradient all-reduce's time over DCN.")
@click.option("--compare-mesh", metavar="data=D,model=M", default=None,
              help="Also compile the same step on this mesh of the slice and say which holds more a device, naming "
                   "the buffers that grew (default for a --mesh with model > 1: all devices on data; e.g. the mesh "
                   "with half the model, to see what one more doubling of `model` costs).")
@click.option("--dcn-gbps", type=float, default=None,
              help="With --num-slices: the DCN bandwidth per host assumed for the all-reduce's time (Gbit/s, "
                   "default 100).")
def plan(command, accelerator, steps, mfu, local, no_cache, as_json, num_slices, compare_mesh, dcn_gbps):
    """Compile the trainer's real train step for ACCELERATOR's TPU topology on this machine (no TPU, no
    weights, no data) and say whether it fits, what would, and what the run costs.

    \b
      tpuctl plan -a v4-8 -- pretrain --preset gpt2-124m --ckpt-dir gs://BUCKET/run
      tpuctl plan -a v5e-8 --steps 5000 --json -- pretrain --preset gpt2-350m --ckpt-dir gs://BUCKET/run

    The arguments after -- are exactly what `tpuctl run NAME -- ...` would run. The compiler is libtpu
    (install with `pip install 'tpuctl[plan]'`); without it the CPU compiler's figures are shown, labelled
    as an estimate. Per device: parameters, optimizer state, temporaries, total, the chip's HBM, headroom and
    a verdict; when it does not fit, what would (estimated; the first one compiled to check) and the next
    slice size that does (compiled). FLOPs and HBM bytes per step, counted whole (every loop's trips), from
    the compiler, and FLOPs from the model's arithmetic; the step time calibrated by the chip (each class of
    work, matmuls, attention and loss kernels, elementwise bytes, at the rate a chip was measured to do it; for
    a chip kind not measured, v5e's efficiencies at its peak and bandwidth, said so); the roofline beside it as
    a lower bound (the FLOPs at the chip's peak or the bytes at its HBM bandwidth, whichever is longer: which
    one bounds the step, and their ratio r), and at --mfu; tokens/s, wall time and $ (list price, on-demand
    and spot) for both. A --mesh with model > 1 is compared with the same step compiled on data alone (one more
    compile; --compare-mesh names another mesh): which holds more a device, and where this mesh does, the
    buffers that grew, by jax source.
    Exit 0: fits; 3: does not fit; 1: bad input.
    """
    from orchestrator.cli.options import StatusLine, TpuctlError
    # `kill` (SIGTERM) ends the plan as Ctrl-C does: the compile process goes with it (step.compile_figures).
    hook = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if hook:
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        with StatusLine(quiet=False) as line:
            from orchestrator import provider  # the TPU API client: loaded by the verb that asks it
            cpu_devices = provider.chosen(local).cpu_devices
            if compare_mesh is not None and (num_slices != 1 or dcn_gbps is not None):
                raise UserError("--compare-mesh compares meshes of one slice: leave out --num-slices and "
                                "--dcn-gbps, or --compare-mesh")
            if num_slices != 1 or dcn_gbps is not None:
                from orchestrator.plan import dcn as plan_dcn
                p = plan_dcn.plan(accelerator, list(command), num_slices, cpu_devices=cpu_devices, steps=steps,
                                  mfu=mfu, dcn_gbps=dcn_gbps or plan_dcn.DEFAULT_DCN_GBPS, progress=line,
                                  use_cache=not no_cache)
                text = p.render
            else:
                p = P.plan(accelerator, list(command), cpu_devices=cpu_devices, steps=steps, mfu=mfu, progress=line,
                           use_cache=not no_cache, compare_mesh=compare_mesh)
                text = lambda: render(p)  # noqa: E731
    except UserError as e:
        raise TpuctlError(str(e)) from None
    except KeyboardInterrupt:
        click.echo("Error: interrupted", err=True)
        sys.exit(130)
    finally:
        if hook:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    click.echo(json.dumps(p.to_json(), indent=2) if as_json else text())
    sys.exit(0 if p.fits else DOES_NOT_FIT)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def render(p: P.Plan) -> str:
    """The plan as text, for people."""
    return "\n".join([_render(p), *_time_spent(p)])


def _time_spent(p: P.Plan) -> list[str]:
    """Where the plan's time went (none of it when every figure came from the cache)."""
    t = p.time_spent()
    if not t["total_s"]:
        return []
    ph, cp = t["step_phases"], t["step_compile_phases"]
    within = " [" + ", ".join(f"{k} {v:.0f}s" for k, v in cp.items()) + "]" if cp else ""
    inside = ", ".join(f"{k} {v:.0f}s" + (within if k == "compile" else "") for k, v in ph.items())
    what = "its program's record read" if p.figures.get("counted_earlier") else "the step's compile"
    parts = [f"{what} {t['step_s']:.0f}s" + (f" ({inside})" if inside else "")]
    parts += [f"checking {c['change']} {c['wall_s']:.0f}s" for c in t["suggestion_checks"]]
    if t["next_size"]:
        parts.append(f"compiling for {t['next_size']['accelerator']} {t['next_size']['wall_s']:.0f}s")
    if t["compared"]:
        parts.append(f"comparing with {t['compared']['mesh']} {t['compared']['wall_s']:.0f}s")
    peak = (f"; host memory: {memory_watch.gb(t['peak_rss_bytes'])} at the peak of a compile process"
            if t["peak_rss_bytes"] else "")
    out = [f"  this plan took {t['total_s']:.0f}s: " + "; ".join(parts) + peak]
    settings = p.figures.get("settings", {})
    if t["total_s"] > SLOW_PLAN_S and cp.get("code generation", 0.0) > 0.5 * ph.get("compile", 0.0) > 0:
        out.append("  (most of the compile is libtpu generating the TPU's code for the step, after its memory is laid "
                   "out: the plan waits for it, as the compiler's memory figures are final only then; it takes more "
                   "cores where there are, e.g. a third of its time on 13 cores against 2)")
    if t["total_s"] > SLOW_PLAN_S and settings.get("remat") == "none" and "remat_why" in settings:
        out.append("  (the layers written out, one by one, are most of that: with --remat full they compile as scans "
                   "in about two minutes, for a step the chip ran 2.1x slower on gemma4-e2b)")
    return out


SLOW_PLAN_S = 120  # a plan a user waits for before paying: longer says why


def _how_counted(p: P.Plan) -> str:
    """Whether the step was compiled for this plan, taken from the plan cache, or counted from a record of the very
    program it lowers to (trainer/common/program_counts.py)."""
    f = p.figures
    if p.cached:
        return " [cached]"
    earlier = f.get("counted_earlier")
    if not earlier:
        return f" [compiled in {f['compile_s']:.0f}s]"
    where = earlier["where"]
    owner = program_counts.OWNER.get(where, program_counts.OWNER[program_counts.THIS_MACHINE])
    whose = f"{owner} record" + (f", ${program_counts.SHARED_ENV}" if where == program_counts.SHARED else "")
    versions = earlier.get("versions", {})
    by = f"libtpu {versions['libtpu']}" if versions.get("libtpu", "-") != "-" else "the same compiler"
    return (f" [the very program this step lowers to was counted by {by} on {earlier['recorded']} ({whose}; its "
            f"compile took {earlier.get('compile_s') or 0:.0f}s): not compiled again; --no-cache compiles it]")


def _render(p: P.Plan) -> str:
    f, a = p.figures, p.accelerator
    mesh = ",".join(f"{k}={v}" for k, v in f["mesh"].items())
    other = f["total_bytes"] - f["temp_bytes"] - f["params_bytes"] - f["optimizer_bytes"]
    lines = [f"plan for {a.name}: {a.chips} chips, {a.hosts} host(s), {f['devices']} devices, mesh {mesh}, "
             f"{f['dtype']} compute",
             f"  compiler: {p.label}" + _how_counted(p),
             *([f"  step: remat {f['settings']['remat']} ({f['settings']['remat_why']})"]
               if f.get("settings", {}).get("remat_why") else []),
             "  per device:",
             f"    parameters          {P.gib(f['params_bytes']):>12}",
             f"    optimizer state     {P.gib(f['optimizer_bytes']):>12}",
             f"    temporaries         {P.gib(f['temp_bytes']):>12}   (activations, gradients, workspace)",
             f"    program + other     {P.gib(other):>12}",
             f"    total               {P.gib(f['total_bytes']):>12}",
             f"    chip HBM            {P.gib(p.hbm_bytes):>12}"
             + (f"   (the compiler: {P.gib(p.refused['available_bytes'])} usable)"
                if p.refused and p.refused.get("available_bytes") else ""),
             f"    headroom            {P.gib(p.headroom_bytes):>12}",
             f"  verdict: {'FITS' if p.fits else 'DOES NOT FIT'}"
             + (f": the compiler refused the step ({p.refused['message']})" if p.refused else "")]
    big = P.largest_batch(p)
    if big is not None:
        seq = f.get("settings", {}).get("seq_len")
        rows = f"{big['rows']} row(s)" + (f" of {seq}" if seq else "")
        lines.append(f"  largest batch that fits: {rows} {big['unit']} (--batch-size {big['batch_size']}), about "
                     f"{P.gib(big['estimate_bytes'])} per device: {big['how']}" if big["rows"] else
                     f"  largest batch that fits: none at this mesh ({big['how']})")
    note = P.mesh_note(p)
    if note:
        lines.append(f"  mesh: {note}")
    if f["settings"].get("experts"):
        lines.append(f"  experts: {f['settings']['experts']['note']}")
    if not p.fits:
        for s in p.suggestions:
            if s.compiled_bytes is not None:
                word = "would fit" if s.compiled_fits else "estimated to fit, but compiled it does NOT"
                est = f" (compiled: {P.gib(s.compiled_bytes)} per device; estimated {P.gib(s.estimate_bytes)})"
            else:
                word, est = "would fit", f" (about {P.gib(s.estimate_bytes)} per device, estimated)"
            lines.append(f"  {word}: {s.change}{est}: {s.note}")
        if p.alternative is not None:
            alt = p.alternative
            t = alt.timing()
            cost = (f"; {t['steps']:,} steps in {t['wall_s'] / 3600:.2f} h at its roofline: "
                    f"${t['usd_on_demand']:,.2f} on-demand, ${t['usd_spot']:,.2f} spot") if t else ""
            lines.append(f"  would fit: -a {alt.accelerator.name} (compiled: {P.gib(alt.total_bytes)} of "
                         f"{P.gib(alt.hbm_bytes)} per device, ${alt.accelerator.price_per_hour():.2f}/hour{cost})")
        if not p.suggestions and p.alternative is None:
            lines.append("  nothing this plan could try fits: shrink the model or pick another generation")
    if p.refused:  # no program was built: nothing was counted, so no step time or cost either
        lines.append(f"  compute, step time and cost: none: the compiler refused the step before counting it "
                     f"({p.refused['message']}); {p.model_flops / 1e12:.3g} TFLOP per device per step by the "
                     "model's arithmetic")
        return "\n".join(lines)
    used = "compiler" if p.flops == f["flops"] else "arithmetic"
    counted = {"unrolled": "counted whole: every loop's trips", "program": "counted whole",
               "loop bodies once": "a loop's body counted once: LOW"}.get(
        f.get("counted"), "counted whole: the loops' matmuls by their trips" if "trip count" in
        (f.get("counted") or "") else "")
    lines.append(f"  compute per device per step: {f['flops'] / 1e12:.3g} TFLOP (compiler{', ' + counted if counted else ''}"
                 f"), {p.model_flops / 1e12:.3g} TFLOP (model arithmetic); times below use the {used}'s")
    t = p.timing()
    if t:
        a_peak = f"{a.generation.peak_bf16_tflops:g} TFLOP/s/chip"
        if t["memory_s"] is not None:
            kernels = f.get("kernel_bytes_uncounted") or 0.0
            extra = f" + {kernels / 1e9:.3g} GB of Pallas kernels the compiler does not count" if kernels else ""
            cal = t.get("calibrated")
            if cal:
                terms = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in cal["terms"].items() if v)
                lines.append(f"  step time: {t['step_s'] * 1e3:.3g} ms, calibrated ({terms}; each class of work at "
                             f"the rate a chip did it: "
                             + ("measured on this chip kind" if cal["measured"] else
                                "NOT measured: " + "; ".join(cal.get("unmeasured") or ["this chip kind"])) + ")")
            lines.append(f"  {'roofline (a lower bound)' if cal else 'step time'}: {t['roofline_step_s'] * 1e3:.3g} ms, "
                         f"bound by {t['bound']} ("
                         f"{f['bytes_accessed'] / 1e9:.3g} GB{extra} at {a.generation.hbm_bytes_s / 1e9:g} GB/s/chip = "
                         f"{t['memory_s'] * 1e3:.3g} ms; FLOPs at {a_peak} = {t['compute_s'] * 1e3:.3g} ms; "
                         f"r = memory/compute = {t['r']:.2f})")
        else:
            cal = None
            lines.append(f"  step time: {t['step_s'] * 1e3:.3g} ms at peak ({a_peak}; no HBM bandwidth figure for "
                         f"{a.generation.name}: compute only)")
        lines += [f"  at an assumed MFU of {p.mfu:g} (an assumption, --mfu): {t['step_s_at_mfu'] * 1e3:.3g} ms",
                  f"  tokens/s: {t['tokens_per_s']:,.0f} at the {t['estimate']} step, {t['tokens_per_s_at_mfu']:,.0f} at "
                  f"MFU {p.mfu:g}",
                  f"  steps: --steps not given (the run goes by --epochs): per step only" if not t["steps"] else
                  f"  {t['steps']:,} steps: {t['wall_s'] / 3600:.2f} h at the {t['estimate']} step: ${t['usd_on_demand']:,.2f} "
                  f"on-demand, ${t['usd_spot']:,.2f} spot; {t['wall_s_at_mfu'] / 3600:.2f} h at MFU {p.mfu:g}: "
                  f"${t['usd_on_demand_at_mfu']:,.2f} / ${t['usd_spot_at_mfu']:,.2f} (list prices "
                  f"${t['price_per_hour_on_demand']:.2f}/${t['price_per_hour_spot']:.2f} per hour; estimates)"]
    return "\n".join(lines)
