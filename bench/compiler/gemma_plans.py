"""docs/gemma.md's plan tables: `tpuctl plan` of a Gemma LoRA step for each size on each slice (and, with
--model-sweep, on each data x model mesh of the slice's devices), each compiled cold (--no-cache) in its own
process, timed, and written to a JSON-lines file as it finishes (a run cut short keeps what it planned).

A plan at model > 1 also compiles its step on another mesh and compares the two (its `mesh:` note: which holds
more a device, and what grew). In a sweep that is the mesh before it, with half the model (`--compare-mesh`; at
model=2 data alone), so each step of `model`'s doubling that holds more is explained by the plan itself. A sweep
plans its meshes from model=1 up against a plan cache of its own (TPUCTL_HOME, a fresh temporary directory), so
each mesh's own step is compiled cold and the mesh it is compared with is read from the sweep's cache. Each row
keeps the command a user runs for the same figures (with --no-cache; its wall time then includes the compared
mesh's compile) and `ran`, how the sweep ran it.

    python -m bench.compiler.gemma_plans --out plans.jsonl [--sizes gemma4-e2b,...] [--accelerators v5litepod-8,v4-8]
        [--model-sweep [--models 2,4,8]] [-- EXTRA LORA FLAGS]
    python -m bench.compiler.gemma_plans --table plans.jsonl [--table newer.jsonl]   # the markdown tables
        [--planned-beside OLDER.jsonl]    # and the rows planned when `--lora-impl beside` was the default

The compiler's count (libtpu, no chip). Each row keeps its command, the plan's wall time, the CPU seconds the
plan's processes used (user + sys: what a busier machine does not change) and the 1-minute load before and after:
a wall time counts only at a load under 2 on the 2-core machine the goal names.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time

from trainer.common.program_counts import OWNER

SIZES = ("gemma4-e2b", "gemma4-e4b", "gemma4-31b", "gemma4-26b-a4b")
ACCELERATORS = ("v5litepod-8", "v4-8")
DEVICES = {"v5litepod-8": 8, "v4-8": 4}
LORA = ["--rank", "8", "--targets", "all", "--weights", "gs://b/g", "--data", "gs://b/t.jsonl", "--ckpt-dir", "gs://b/l"]
GIB = 2 ** 30
IMPL = "--lora-impl"


def meshes(devices: int) -> list[str]:
    """data x model over the slice's devices, model from 1 up."""
    out, m = [], 1
    while m <= devices:
        out.append(f"data={devices // m},model={m}")
        m *= 2
    return out


def command(accelerator: str, size: str, extra: list[str], mesh: str = "") -> list[str]:
    return ["tpuctl", "plan", "-a", accelerator, "--json", "--no-cache", *_compare(mesh), "--", "lora", "--model",
            size, *LORA, *(["--mesh", mesh] if mesh else []), *extra]


def _compare(mesh: str) -> list[str]:
    """A sweep's mesh with model >= 4 is compared with the mesh of half its model (model=2's is data alone, the
    plan's own default comparison)."""
    m = re.fullmatch(r"data=(\d+),model=(\d+)", mesh)
    if not m or int(m.group(2)) < 4:
        return []
    return ["--compare-mesh", f"data={2 * int(m.group(1))},model={int(m.group(2)) // 2}"]


def sweep_run(argv: list[str]) -> list[str]:
    """A sweep's way to run a row's command: with the plan cache (the sweep's own, fresh) instead of --no-cache."""
    return [a for a in argv if a != "--no-cache"]


def plan_one(argv: list[str], cache_home: str | None = None) -> dict:
    """Run one plan (argv: the command a user runs for it); its JSON with what it cost. cache_home: run it without
    --no-cache against that TPUCTL_HOME's plan cache (a sweep's own) instead."""
    from bench.tpu.plans import commit  # the commit a plan ran at, as the chip check's plans record theirs
    run = argv if cache_home is None else sweep_run(argv)
    env = None if cache_home is None else {**os.environ, "TPUCTL_HOME": cache_home}
    load0 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # the venv's own tpuctl (its bin beside this python), as the command in the table reads
    exe = os.path.join(os.path.dirname(sys.executable), run[0])
    proc = subprocess.run([exe if os.path.exists(exe) else run[0], *run[1:]], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cost = {"wall_s": round(wall, 1), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime -
                                                      before.ru_stime, 1),
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
            "command": shlex.join(argv), "commit": commit(),
            **({} if cache_home is None else {"ran": "TPUCTL_HOME=(the sweep's fresh plan cache) " + shlex.join(run)})}
    try:
        return {**json.loads(proc.stdout), **cost}
    except json.JSONDecodeError:
        return {**cost, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}


def _compiled_rows(p: dict) -> int | None:
    big = p.get("largest_batch") or {}
    return big.get("compiled_rows", big.get("compiled_rows_per_device"))  # the older records' name


def _cell(p: dict, same: list[dict] = ()) -> str:
    """One plan's table cell; `same`: the plans of the same size, slice and flags but the batch, where the plan's
    largest batch may have been compiled to check it."""
    if "error" in p:
        return f"error: {p['error']}"
    d = p.get("per_device", {})
    total, params, temp = d.get("total_bytes", 0), d.get("params_bytes", 0), d.get("temp_bytes", 0)
    if not p.get("fits"):
        head = f"does not fit: {total / GIB:.2f} GiB needed (params {params / GIB:.2f}, temporaries {temp / GIB:.2f})"
    else:
        head = (f"fits: {total / GIB:.2f} of {p['hbm_bytes_per_device'] / GIB:.0f} GiB (params {params / GIB:.2f}, "
                f"temporaries {temp / GIB:.2f}; headroom {p.get('headroom_bytes', 0) / GIB:.2f})")
    t = p.get("timing") or {}
    step = t.get("step_s")
    parts = [head]
    if step:
        parts.append(f"{step * 1e3:.0f} ms a step ({t.get('bound', '?')}-bound roofline {t.get('roofline_step_s', 0) * 1e3:.0f} "
                     f"ms, compute {t.get('compute_s', 0) * 1e3:.0f} ms)")
    big = p.get("largest_batch") or {}
    # rows a device, a data group or the step (the plan's `per`); the older records' rows_per_device are a device's
    n = big.get("rows", big.get("rows_per_device"))
    if n is not None:
        check = next((q for q in [p, *same] if _compiled_rows(q) == n and "error" not in q), None)
        rows = f"{n} row{'s' if n != 1 else ''} a {big.get('per', 'device')}"
        if big.get("lower_bound") or (p.get("fits") and _compiled_rows(p) == 1):
            # compiled at one row: no share of the temporaries to extrapolate from (orchestrator/plan/step.py)
            parts.append(f"largest batch: at least 1 row a {big.get('per', 'device')} (one row compiled; plan two "
                         "to extrapolate)")
        elif check is None:
            parts.append(f"largest batch {rows} (extrapolated, not compiled)")
        else:
            d = check.get("per_device", {})
            parts.append(f"largest batch {rows} (extrapolated; compiled: "
                         + (f"fits, {d.get('total_bytes', 0) / GIB:.2f} GiB, headroom "
                            f"{check.get('headroom_bytes', 0) / GIB:.2f})" if check.get("fits") else
                            f"does not fit, {d.get('total_bytes', 0) / GIB:.2f} GiB)"))
    parts.append(f"planned in {p['wall_s']:.0f} s ({p['cpu_s']:.0f} CPU s, load {p['load_before']:.1f}-{p['load_after']:.1f})"
                 + (f", its figures read from {_owner(p['counted_earlier']['where'])} record of the program "
                    f"(compiled {p['counted_earlier']['recorded']})" if p.get("counted_earlier") else ""))
    note = _impl_note(p)
    if note:
        parts.append(note)
    return "; ".join(parts)


def extra_flags(row: dict) -> str:
    """The lora flags a row's command adds to the default command (e.g. '--batch-size 8'), '' for the default;
    not its --mesh (the sweep's column) nor its --lora-impl (said in its cell: the same row planned either way)."""
    argv = shlex.split(row.get("command", ""))
    tail = argv[argv.index("gs://b/l") + 1:] if "gs://b/l" in argv else []
    for flag in ("--mesh", IMPL):
        while flag in tail:
            i = tail.index(flag)
            tail = tail[:i] + tail[i + 2:]
    return shlex.join(tail)


def lora_impl(row: dict) -> str | None:
    """The --lora-impl a row's command names (None: the default of the commit it ran at)."""
    argv = shlex.split(row.get("command", ""))
    return argv[argv.index(IMPL) + 1] if IMPL in argv[:-1] else None


def _owner(where: str) -> str:
    return OWNER.get(where, f"{where}'s")


def _impl_note(row: dict) -> str:
    impl = lora_impl(row)
    return "" if impl is None else f"planned with `{IMPL} {impl}`" + (", the default before" if impl == "beside" else "")


def planned_beside(row: dict) -> dict:
    """A row planned when `beside` was the default (before `stacked`): its command with `--lora-impl beside`, the
    command that plans the same step now."""
    return row if lora_impl(row) else {**row, "command": row["command"] + f" {IMPL} beside"}


def _rows_label(row: dict) -> str:
    """extra_flags with --batch-size B said as rows a device (B over the slice's devices)."""
    argv = shlex.split(extra_flags(row))
    if "--batch-size" in argv:
        i = argv.index("--batch-size")
        n = int(argv[i + 1]) // DEVICES[row["accelerator"]]
        argv = argv[:i] + argv[i + 2:] + [f"{n} row{'s' if n != 1 else ''} a device"]
    return " ".join(argv)


def _without_rows(label: str) -> str:
    return re.sub(r"\s*\d+ rows? a device", "", label).strip()


def table(rows: list[dict]) -> str:
    """The default-mesh table (size and the flags added to the default command x accelerator; the newest row of
    each), then the model sweep (the newest row of each mesh), as markdown."""
    out = ["| size | " + " | ".join(ACCELERATORS) + " |", "|---|" + "---|" * len(ACCELERATORS)]
    default = {(r["size"], extra_flags(r), r["accelerator"]): r for r in rows if not r.get("sweep_mesh")}
    # a 1-row-a-device plan is --batch-size 8 on v5litepod-8's 8 chips and 4 on v4-8's 4: one line, by rows a device
    per_device = {k: (k[0], _rows_label(default[k]), k[2]) for k in default}
    cells = {per_device[k]: default[k] for k in default}
    for size in SIZES:
        for label in sorted({lab for (s, lab, _) in cells if s == size}, key=lambda x: (x != "", x)):
            name = size + (f" ({label})" if label else "")
            out.append(f"| {name} | " + " | ".join(
                _cell(cells[(size, label, a)], [q for (s2, lab2, a2), q in cells.items() if s2 == size and a2 == a
                                                and _without_rows(lab2) == _without_rows(label)])
                if (size, label, a) in cells else "" for a in ACCELERATORS) + " |")
    # the newest plan of each size, slice, mesh and flags (a mesh planned again, e.g. after the plan's pricing
    # changed, replaces its older row)
    sweep = list({(r["size"], r["accelerator"], r["sweep_mesh"], extra_flags(r)): r
                  for r in rows if r.get("sweep_mesh")}.values())
    # model=1 is the default mesh's step: a sweep takes the newest default-command row for it where that row is
    # newer than the sweep's own row of it (or the sweep has none)
    order = {id(r): i for i, r in enumerate(rows)}
    for size, acc in dict.fromkeys((r["size"], r["accelerator"]) for r in sweep):
        one = f"data={DEVICES[acc]},model=1"
        own = [r for r in sweep if (r["size"], r["accelerator"], r["sweep_mesh"]) == (size, acc, one)]
        newest = default.get((size, "", acc))
        if newest is not None and all(order[id(r)] < order[id(newest)] for r in own):
            sweep = [r for r in sweep if not any(r is o for o in own)]
            sweep.append({**newest, "sweep_mesh": one + " (the default command's row)"})
    sweep.sort(key=lambda r: (SIZES.index(r["size"]) if r["size"] in SIZES else 99, r["accelerator"],
                              int(re.search(r"model=(\d+)", r["sweep_mesh"]).group(1))))
    if sweep:
        out += ["", "| size | slice | mesh | per device: total (params, temporaries) | step | against the mesh before "
                "(the plan's `mesh:` note) |", "|---|---|---|---|---|---|"]
        for r in sweep:
            d = r.get("per_device", {})
            step = (r.get("timing") or {}).get("step_s")
            note = _impl_note(r)
            out.append(f"| {r['size']} | {r['accelerator']} | {r['sweep_mesh']} | "
                       + (f"error: {r['error']}" if "error" in r else
                          f"{d.get('total_bytes', 0) / GIB:.2f} GiB ({d.get('params_bytes', 0) / GIB:.2f}, "
                          f"{d.get('temp_bytes', 0) / GIB:.2f}){'' if r.get('fits') else ', does not fit'}"
                          + (f"; {note}" if note else ""))
                       + f" | {'' if not step else f'{step * 1e3:.0f} ms'} | {against(r)} |")
    return "\n".join(out)


def against(row: dict) -> str:
    """A sweep row's plan against the mesh it was compared with (its mesh_check), short enough for a table cell:
    more or less a device, and where more, the buffer that grew most (the plan's `mesh:` note has up to three)."""
    c = row.get("mesh_check")
    if not c:
        return ""
    other = c.get("compared_mesh") or c.get("data_only_mesh")  # the older records' name
    if c.get("more_bytes") is None:
        return f"not compared with {other}: {c.get('error') or 'refused'}"
    more = c["more_bytes"] / 2 ** 20
    head = f"{'+' if more > 0 else '-'}{abs(more):,.0f} MiB against {other}"
    if more <= 0 or not c.get("grown"):
        return head + ("; what grew is not named" if more > 0 and c.get("grown") is None else "")
    b = c["grown"][0]
    op = "/".join(b["op_name"].replace("\\'", "'").split("/")[-2:]) or b["instruction"]  # the jax op, its holder
    was = "new" if b.get("other_bytes") is None else f"{b['other_bytes'] / 2 ** 20:,.0f} MiB before"
    return (f"{head}; grew most: {op} {b['shape']} {b['bytes'] / 2 ** 20:,.0f} MiB ({was})"
            + (f" at {b['source']}" if b.get("source") else ""))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m bench.compiler.gemma_plans", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON-lines file the plans are appended to")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--accelerators", default=",".join(ACCELERATORS))
    p.add_argument("--model-sweep", action="store_true", help="also every data x model mesh of each slice")
    p.add_argument("--models", default="", metavar="M,...",
                   help="with --model-sweep, only the meshes of these model sizes (model=1 is the default mesh's "
                        "step: the table takes the default row for it when the sweep has none)")
    p.add_argument("--table", metavar="FILE", action="append", default=[],
                   help="print the tables of JSON-lines files and exit (repeatable: a later file's rows are newer)")
    p.add_argument("--planned-beside", metavar="FILE", action="append", default=[],
                   help="with --table, also the rows of FILE, planned when `--lora-impl beside` was the default: "
                        "their commands say it; a row of --table's FILE replaces the one of the same command")
    opts = p.parse_args(own)
    if opts.table:
        old = [planned_beside(json.loads(line)) for f in opts.planned_beside for line in open(f) if line.strip()]
        print(table(old + [json.loads(line) for f in opts.table for line in open(f) if line.strip()]))
        return 0
    if not opts.out:
        p.error("--out FILE (or --table FILE)")
    if not re.fullmatch(r"(\d+(,\d+)*)?", opts.models):
        p.error(f"--models {opts.models}: give model sizes separated by commas, e.g. --models 2,4,8")
    rows = []
    with (tempfile.TemporaryDirectory(prefix="gemma-sweep-") if opts.model_sweep else contextlib.nullcontext()) as home:
        for size, acc, mesh in jobs(opts.sizes.split(","), opts.accelerators.split(","), opts.model_sweep,
                                    [int(m) for m in opts.models.split(",") if m]):
            row = {"size": size, "accelerator": acc, "sweep_mesh": mesh,
                   **plan_one(command(acc, size, extra, mesh), cache_home=home)}
            rows.append(row)
            with open(opts.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{size} {acc} {mesh or 'default mesh'}: {_cell(row)}", flush=True)
    print(table(rows))
    return 0


def jobs(sizes: list[str], accelerators: list[str], sweep: bool, models: list[int] = ()) -> list[tuple[str, str, str]]:
    """(size, accelerator, mesh) in the order planned: each slice's meshes from model=1 up ('' the default mesh),
    so the data-only step a model > 1 plan compiles is the sweep's model=1 row (or its first plan's) already cached."""
    return [(size, acc, mesh) for size in sizes for acc in accelerators
            for mesh in ([m for m in meshes(DEVICES[acc]) if not models or int(m.split("model=")[1]) in models]
                         if sweep else [""])]


if __name__ == "__main__":
    sys.exit(main())
