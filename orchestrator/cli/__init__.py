"""The `tpuctl` command line: parse, call the API below, print. Nothing below it imports it.

`main` is the console script's entry point (pyproject.toml); the verbs live in `app` (the group and the slice
verbs) and in one `*_verbs` module per family, registered into the group by `app`."""
from orchestrator.cli.app import cli, main  # noqa: F401
