"""`tpuctl weights pull`: the click layer over orchestrator/artifacts/weights.py."""
from __future__ import annotations

import contextlib
import json
import os
import sys

import click

from orchestrator.spec import UserError


@click.group("weights")
def weights():
    """Model weights: pull from Kaggle once, stage in GCS for every host."""


@weights.command("pull")
@click.argument("handle")
@click.option("--to", "dest", required=True, metavar="gs://BUCKET/PREFIX",
              help="Where to stage the model: a prefix of its own. Hosts then read only this (no Kaggle "
                   "credentials on hosts); pass it to the trainer as --weights.")
@click.option("--kaggle-endpoint", metavar="URL", default=lambda: os.environ.get("TPUCTL_KAGGLE_ENDPOINT"),
              help="Another Kaggle API (a proxy, the local stand-in infra/fake_kaggle.py). "
                   "Default: env TPUCTL_KAGGLE_ENDPOINT, else Kaggle's.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (progress stays on stderr).")
def pull(handle, dest, kaggle_endpoint, as_json):
    """Download HANDLE (OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION], e.g. google/gemma-2/flax/gemma2-2b-it/1)
    through kagglehub once and stage it under gs://BUCKET/PREFIX with a manifest of sizes and md5s.

    \b
    An unversioned handle is resolved to Kaggle's latest version, which is printed.
    Pulling a version that is already staged copies nothing; a pull that was cut short resumes.
    Credentials: KAGGLE_USERNAME / KAGGLE_KEY, or ~/.kaggle/kaggle.json (never passed on the command line).
    Gemma needs its licence accepted once on kaggle.com by the account whose key is used.
    """
    from orchestrator.artifacts import weights as W
    run_pull(lambda say: W.pull(handle, dest, endpoint=kaggle_endpoint, say=say), as_json)


def run_pull(pull_fn, as_json: bool) -> None:
    """Run a Kaggle pull (weights or data): progress on stdout, or on stderr with --json; errors one line."""
    from orchestrator.artifacts import weights as W
    say = (lambda m: click.echo(m, err=True)) if as_json else click.echo
    try:
        if as_json:  # stdout carries only the JSON: kagglehub's console log and notices go to stderr
            W.kagglehub_logs_to(sys.stderr)
            with contextlib.redirect_stdout(sys.stderr):
                res = pull_fn(say)
        else:
            res = pull_fn(say)
    except UserError as e:
        raise click.ClickException(" ".join(str(e).split())) from None
    except KeyboardInterrupt:
        click.echo("Error: interrupted; run the same pull again to resume", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(res.to_json()))
