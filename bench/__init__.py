"""`python -m bench`: side-by-side speed of our trainer vs the seed GPT-2 trainer in bench/seed_gpt2.py (see bench/__main__.py)."""
import os
from pathlib import Path


def test_cache() -> Path:
    """The machine's test cache, which bench shares with the suite (wheelhouse, generated corpora): the suite's
    conftest.py sets TPUCTL_TEST_CACHE for its processes; bench runs without it, so the default is also here."""
    return Path(os.environ.get("TPUCTL_TEST_CACHE") or Path.home() / ".cache" / "tpuctl-test")
