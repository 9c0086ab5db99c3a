"""`python -m bench.peers.profile`: where a step's time goes, seed vs ours, from a jax.profiler trace.

Traces a couple of steps of each (after warm-up) and sums the XLA:CPU op events by op name, so the two
steps can be compared op by op (names are XLA's fusion / custom-call names; the totals are thread time
summed over the 8 emulated devices, not wall time).
"""
from __future__ import annotations

import collections
import glob
import os
import re
import sys
import tempfile

from bench.devices import emulate


def aggregate(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    prof = ProfileData.from_file(path)
    by_name: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for plane in prof.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                by_name[ev.name] += ev.duration_ns
                count[ev.name] += 1
    return by_name, count


def op_names(dump_dir: str, module_substr: str) -> dict[str, str]:
    """Instruction name -> the jax op it came from (metadata op_name), from XLA's optimized-HLO dump."""
    files = [f for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")) if module_substr in f]
    out: dict[str, str] = {}
    pat = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"")
    for f in sorted(files, key=os.path.getsize)[-1:]:  # the train step is the biggest module
        for line in open(f):
            m = pat.match(line)
            if m:
                out[m.group(1)] = f"{m.group(3)} {m.group(2)}"
    return out


def main(argv: list[str]) -> int:
    dump = tempfile.mkdtemp(prefix="bench-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=.*train_step.*").strip()
    emulate(8)
    import jax
    import numpy as np

    from bench import seed_gpt2
    from bench.ours import OursTrainer, config

    steps = int(argv[0]) if argv else 2
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 50257, (16, 257), dtype=np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        seed = seed_gpt2.SeedTrainer(seed_gpt2.SeedConfig())
        ours = OursTrainer(config("gpt2-tiny", tmp, model=dict(n_layer=4, d_model=256, n_head=4, seq_len=256),
                                  train=dict(batch_size=16, mesh="data=8,model=1", dtype="float32")))
        run = {"seed": lambda: seed.step(tok[:, :-1], tok[:, 1:]), "ours": lambda: ours.step(tok)}
        for f in (run["seed"], run["seed"], run["ours"]):
            f()
        for name, f in run.items():
            d = os.path.join(tmp, "trace-" + name)
            with jax.profiler.trace(d):
                for _ in range(steps):
                    f()
            by_name, count = aggregate(d)
            total = sum(by_name.values())
            print(f"== {name}: top ops by summed thread time over {steps} steps (total {total / 1e9:.1f} s)")
            names = op_names(dump, "jit__train_step" if name == "ours" else "jit_train_step")
            for k, v in by_name.most_common(int(os.environ.get("TOP", 30))):
                print(f"  {v / 1e9 / steps:8.3f} s/step  x{count[k] // steps:<5d} {k[:40]:40s} {names.get(k, '')[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
