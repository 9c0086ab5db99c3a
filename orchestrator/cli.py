"""The `tpuctl` command: a thin click layer over the orchestrator's Python API."""
from __future__ import annotations

import sys

import click


class TpuctlError(click.ClickException):
    """A user-facing error: one clear line naming what is wrong and how to fix it, exit code 1."""


def _not_built(verb: str):
    def cmd(**_):
        raise TpuctlError(f"`tpuctl {verb}` is not built yet in this version; see the README for what works today.")
    return cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tpuctl")
def cli():
    """Take a JAX training job to a Cloud TPU slice and back.

    \b
      tpuctl up NAME --accelerator v4-16 --zone us-central2-b   create a slice
      tpuctl run NAME -- pretrain --preset gpt2-124m ...         run the trainer on every host
      tpuctl down NAME                                           delete everything it created

    Add --local to any verb to use the local stand-ins (no cloud account needed).
    """


for _verb, _help in [
    ("up", "Create a TPU slice (queued resource) and wait until it is READY."),
    ("run", "Ship the code to every host and run the multi-host trainer."),
    ("down", "Delete a slice and its queued resource (idempotent)."),
    ("status", "Show one slice: state, workers, cost."),
    ("ls", "List the slices tpuctl created."),
    ("ssh", "Open a shell or run a command on one or all workers."),
    ("logs", "Show a run's per-host logs."),
    ("gc", "Find and delete expired or unrecorded tpuctl resources."),
]:
    cli.command(_verb, help=_help + " (not built yet)",
                context_settings={"ignore_unknown_options": True, "allow_extra_args": True})(_not_built(_verb))


def main(argv=None) -> int:
    try:
        cli.main(args=argv, prog_name="tpuctl", standalone_mode=True)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
