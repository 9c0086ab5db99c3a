"""`python -m bench.tpu.twin SIZE LAYERS -- <python -m trainer.plan's arguments>`: the plan of a named Gemma size cut
to its first LAYERS layers. The chip check times such a twin where the whole size does not fit one chip
(bench/tpu/lora.py TWINS); its plan, compiled ahead off the chip, must be the same program, so both take the
config from `config` here."""
from __future__ import annotations

import dataclasses
import sys


def config(size: str, layers: int):
    from trainer.models import gemma
    return dataclasses.replace(gemma.SIZES[size], n_layers=layers)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--" or not argv[1].isdigit():
        print("usage: python -m bench.tpu.twin SIZE LAYERS -- <python -m trainer.plan's arguments>", file=sys.stderr)
        return 2
    from trainer.models import gemma
    size, layers = argv[0], int(argv[1])
    gemma.SIZES[size] = config(size, layers)  # every lookup of the size in this process is the twin's
    from trainer import plan
    return plan.main(argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
