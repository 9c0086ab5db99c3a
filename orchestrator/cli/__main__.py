"""`python -m orchestrator.cli ...`: the `tpuctl` command, for a process that has the package but not the script."""
import sys

from orchestrator.cli.app import main

sys.exit(main())
