"""`tpuctl plan`: a click command over orchestrator/plan.py, registered into the `tpuctl` group by cli.py."""
from __future__ import annotations

import json
import sys

import click

from orchestrator.spec import UserError

DOES_NOT_FIT = 3  # exit code: planned, and the step does not fit (errors exit 1)


@click.command("plan", context_settings={"ignore_unknown_options": True})
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("-a", "--accelerator", metavar="TYPE", required=True,
              help="Accelerator type to plan for, e.g. v4-8, v5litepod-8 (alias v5e-8), v5p-8, v6e-4.")
@click.option("--steps", type=int, help="Steps for wall time and cost (default: the command's --steps).")
@click.option("--mfu", type=float, default=0.5, show_default=True,
              help="Assumed model FLOPs utilisation for step time, tokens/s, wall time and cost (an assumption, "
                   "stated as one; the compiler's FLOPs at the chip's peak are shown too).")
@click.option("--local", is_flag=True, help="Plan for a local slice of that type: the CPU compiler on its emulated "
                                            "devices, what `tpuctl run` on a local slice checks.")
@click.option("--no-cache", is_flag=True, help="Compile again even when this exact plan is cached "
                                               "($TPUCTL_HOME/plans).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout (for scripts).")
def plan(command, accelerator, steps, mfu, local, no_cache, as_json):
    """Compile the trainer's real train step for ACCELERATOR's TPU topology on this machine (no TPU, no
    weights, no data) and say whether it fits, what would, and what the run costs.

    \b
      tpuctl plan -a v4-8 -- pretrain --preset gpt2-124m --ckpt-dir gs://BUCKET/run
      tpuctl plan -a v5e-8 --steps 5000 --json -- pretrain --preset gpt2-350m --ckpt-dir gs://BUCKET/run

    The arguments after -- are exactly what `tpuctl run NAME -- ...` would run. The compiler is libtpu
    (install with `pip install 'tpuctl[plan]'`); without it the CPU compiler's figures are shown, labelled
    as an estimate. Per device: parameters, optimizer state, temporaries, total, the chip's HBM, headroom and
    a verdict; when it does not fit, what would (estimated; the first one compiled to check) and the next
    slice size that does (compiled). FLOPs per step from the compiler and from the model's arithmetic; step
    time, tokens/s, wall time and $ (list price, on-demand and spot) at the chip's peak and at --mfu.
    Exit 0: fits; 3: does not fit; 1: bad input.
    """
    from orchestrator import plan as P
    from orchestrator.cli import StatusLine, TpuctlError
    try:
        with StatusLine(quiet=False) as line:
            p = P.plan(accelerator, list(command), local=local, steps=steps, mfu=mfu, progress=line,
                       use_cache=not no_cache)
    except UserError as e:
        raise TpuctlError(str(e)) from None
    except KeyboardInterrupt:
        click.echo("Error: interrupted", err=True)
        sys.exit(130)
    click.echo(json.dumps(p.to_json(), indent=2) if as_json else P.render(p))
    sys.exit(0 if p.fits else DOES_NOT_FIT)
