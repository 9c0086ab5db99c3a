"""`tpuctl data pull`: the click layer over orchestrator/artifacts/datasets.py."""
from __future__ import annotations

import os

import click


@click.group("data")
def data():
    """Training data: pull a Kaggle dataset once, stage it in GCS for every host."""


@data.command("pull")
@click.argument("handle")
@click.option("--to", "dest", required=True, metavar="gs://BUCKET/PREFIX",
              help="Where to stage the dataset: a prefix of its own. Hosts then read only this (no Kaggle "
                   "credentials on hosts); pass it to the trainer as --data.")
@click.option("--file", "files", multiple=True, metavar="PATH",
              help="Fetch only this file of the dataset (repeatable), e.g. --file train.bin --file val.bin. "
                   "Default: the whole version.")
@click.option("--kaggle-endpoint", metavar="URL", default=lambda: os.environ.get("TPUCTL_KAGGLE_ENDPOINT"),
              help="Another Kaggle API (a proxy, the local stand-in infra/fake_kaggle.py). "
                   "Default: env TPUCTL_KAGGLE_ENDPOINT, else Kaggle's.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (progress stays on stderr).")
def pull(handle, dest, files, kaggle_endpoint, as_json):
    """Download HANDLE (OWNER/DATASET[/versions/N], e.g. windmaple/OpenWebText-gpt2) through kagglehub once
    and stage it under gs://BUCKET/PREFIX with a manifest of sizes and md5s.

    \b
    An unversioned handle is resolved to Kaggle's latest version, which is printed.
    Pulling a version that is already staged copies nothing; a pull that was cut short resumes.
    Credentials: KAGGLE_USERNAME / KAGGLE_KEY, or ~/.kaggle/kaggle.json (never passed on the command line).
    """
    from orchestrator.artifacts import datasets as D
    from orchestrator.cli.weights_verbs import run_pull
    run_pull(lambda say: D.pull(handle, dest, files=files, endpoint=kaggle_endpoint, say=say), as_json)
