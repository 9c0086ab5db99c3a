"""`tpuctl top` and `tpuctl profile`: a live run's hosts seen as it goes (orchestrator/observe/), registered into
the `tpuctl` group by orchestrator/cli/app.py."""
from __future__ import annotations

import json
import sys

import click

from orchestrator.cli.options import errors as _errors
from orchestrator.cli.run_verbs import _note, _ssh_options


@click.command("top")
@click.argument("name")
@click.option("--once", is_flag=True, help="Print one table and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@_ssh_options
@_errors
def top(name, once, as_json, flags):
    """The live run on NAME, one row per host, refreshed every 2 s (Ctrl-C ends it).

    \b
      tpuctl top NAME            step, step time, tokens/s, each chip's duty cycle and HBM used/total,
                                 host CPU and memory; the straggler named, with its lag and cause
      tpuctl top NAME --json     one snapshot

    Chips show "no TPU" where libtpu's metrics service does not answer (CPU hosts, local mode).
    """
    from orchestrator.observe import top as T
    try:
        T.top(name, flags, out=sys.stdout, as_json=as_json, once=once, note=_note)
    except KeyboardInterrupt:
        pass


@click.command("profile")
@click.argument("name")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="How many steps to trace.")
@click.option("--json", "as_json", is_flag=True, help="Print where the traces went as JSON.")
@_ssh_options
@_errors
def profile(name, steps, as_json, flags):
    """Trace N steps of the live run on NAME on every host at once, without restarting it.

    \b
      tpuctl profile NAME --steps 3

    Each host's trace goes to the run's CKPT_DIR/profiles/RUN_ID/plugins/profile/live_<time>/ (TensorBoard's
    profile plugin layout), each then summarised here as `tpuctl report NAME` does: the device step, its split,
    op categories and top ops, each host's from its own trace (needs xprof: the `profile` extra). A host whose
    profiler server does not answer is named and the exit status is 1; the other hosts' traces are kept.
    """
    from orchestrator.observe import live_profile as P
    res = P.profile(name, steps, flags, note=_note)
    P.summarize(res)
    click.echo(json.dumps(res.to_json()) if as_json else P.where(res))
    sys.exit(1 if res.failed else 0)
