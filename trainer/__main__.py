"""`python -m trainer ...`: trainer/cli.py."""
import sys

from trainer.cli import main

sys.exit(main())
