"""The plan's time for each row of the check, compiled ahead on any machine with libtpu (no chip): the chip's time
is for what only the chip can do. `python -m bench.tpu --plan-ahead FILE` runs `python -m trainer.plan --tpu
v5e:1x1` (what `tpuctl plan` runs) on the trainer command that builds each row's step, one process at a time, and
writes each row's work by class to FILE as it finishes; `--plans FILE` (on the chip, or with `--summarize`) joins
them to the rows of the same name, and the report prices them at trainer/common/calibration.py's rates.

A row and its plan are the same program when the row's code is the same at the plan's commit and the chip run's:
both record theirs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from bench.tpu import lora, steps
from bench.tpu.common import wanted

TPU = "v5e:1x1"


def _flags(fields: dict) -> list[str]:
    return [x for k, v in fields.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _lora_argv(size: str, batch: int) -> list[str]:
    return ["lora", "--model", size, "--weights", "-", "--data", "-", "--targets", "all", "--rank", str(lora.RANK),
            "--alpha", str(lora.ALPHA), "--seq-len", "512", "--batch-size", str(batch), "--base-dtype", "bfloat16"]


def commands() -> dict[str, list[str]]:
    """Row name -> the trainer command whose train step is that row's (in `python -m trainer` words)."""
    out = {}
    for b in steps.BATCHES:
        out[f"ours, batch {b}"] = ["pretrain", "--preset", steps.PRESET, "--batch-size", str(b)]
    for name, train in steps.ALTERNATIVES.items():
        out[f"ours, batch 8, {name}"] = ["pretrain", "--preset", steps.PRESET, "--batch-size", "8", *_flags(train)]
    assert not set(lora.SIZES) & set(lora.TWINS), "a size is timed whole or as a twin, not both"
    for size, batch in lora.SIZES.items():
        base = _lora_argv(size, batch)
        out[lora.name_of(size, batch)] = base
        for variant, fields in lora.VARIANTS.items():
            if lora.VOCAB_ROWS in fields:  # a Steps option on one chip, no flag: no trainer command builds that step
                continue
            if not lora._is_default(size, fields, batch):  # a variant that is the size's default is its default row
                out[lora.name_of(size, batch, variant=variant)] = [*base, *_flags(fields)]
    for size, (layers, batch) in lora.TWINS.items():  # the whole size's command: bench.tpu.twin cuts its layers
        out[lora.name_of(size, batch, layers=layers)] = _lora_argv(size, batch)
    for size, batch in lora.SCANNED.items():
        out[lora.name_of(size, batch)] = _lora_argv(size, batch)
    return out


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() + (" (uncommitted changes)" if subprocess.run(
                                  ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                  text=True).stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TPUCTL_COMMIT", "")


def plan_ahead(path: str, rows: tuple = ()) -> int:
    """Plan every row (or those `rows` choose, as --rows chooses the rows a check measures) into `path`, keeping
    what it already holds for rows of the same commit. Returns 0, 1 when a plan failed (its error is written in
    its place), or 2 when `rows` choose no row (nothing planned, nothing written)."""
    every = commands()
    chosen = {name: argv for name, argv in every.items() if wanted(name, rows)}
    if not chosen:
        print(f"--plan-ahead: --rows {' '.join(map(repr, rows))} choose no row (a word a row's name holds, or "
              "'=NAME' for that row exactly); the rows that have a plan:\n  " + "\n  ".join(every), file=sys.stderr)
        return 2
    done = load(path) or {"tpu": TPU, "rows": {}}
    here = commit()
    bad = 0
    for name, argv in chosen.items():
        if done["rows"].get(name, {}).get("work") and done["rows"][name].get("argv") == argv:
            continue  # planned already (at the commit it names: a row's program changes only with its code)
        t0 = time.perf_counter()
        twin = next(((size, layers) for size, (layers, batch) in lora.TWINS.items()
                     if name == lora.name_of(size, batch, layers=layers)), None)
        how = ["-m", "bench.tpu.twin", twin[0], str(twin[1]), "--"] if twin else ["-m", "trainer.plan"]
        print(f"planning {name!r}: python {' '.join(how)} --devices 1 --tpu {TPU} -- {' '.join(argv)}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run([sys.executable, *how, "--devices", "1", "--tpu", TPU, "--",
                                *argv, "--ckpt-dir", os.path.join(tmp, "ckpt")], capture_output=True, text=True)
        took = time.perf_counter() - t0
        if p.returncode:
            bad += 1
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            done["rows"][name] = {"argv": argv, "error": err, "wall_s": took, "commit": here}
            print(f"  failed in {took:.0f} s: {err}", flush=True)
        else:
            got = json.loads(p.stdout)
            done["rows"][name] = {"argv": argv, "work": got["work"], "total_bytes": got.get("total_bytes"),
                                  "temp_bytes": got.get("temp_bytes"), "compile_s": got.get("compile_s"),
                                  "wall_s": took, "commit": here}
            print(f"  done in {took:.0f} s", flush=True)
        _write(path, done)
    return 1 if bad else 0


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def join(rows: list[dict], plans: dict) -> None:
    """Each timed row's work from the plans of the same name (the report prices it); a row's figures say which
    commit its plan was compiled from."""
    for r in rows:
        got = plans.get("rows", {}).get(r["name"])
        if got and "work" in got and r.get("step_s"):
            r["figures"]["work"] = got["work"]
            r["figures"]["plan_from"] = f"python -m trainer.plan --tpu {plans.get('tpu', TPU)} at " \
                                        f"{got.get('commit', '?')}"
