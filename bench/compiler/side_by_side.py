"""Our GPT-2 124M step beside the seed's and MaxText's, for the same work, as the TPU compiler counts them.

    python -m bench.compiler.side_by_side [--maxtext PATH] [--chips v5e-8,v6e-8]

The same work: GPT-2 124M, batch 64 x 1024, bf16 compute over f32 weights, AdamW, on the 8 chips of a v5e-8 or
a v6e-8. Each step is compiled ahead of time by libtpu on this machine (no TPU): ours through `tpuctl plan`
(orchestrator/plan.py; every loop counted by its trip count), the seed's by bench/compiler/seed_plan.py (no loop), and
MaxText's by the maxtext bench scripts, which need their own Python 3.12 venv (MaxText is not installed by the
project): their JSON records are read from PATH (a record file or a folder of them; --maxtext, else
$TPUCTL_MAXTEXT_FIGURES, else the shared bench folder beside the checkout, which holds v5e-8's) and from
bench/maxtext_records/ (committed: v6e-8's, made by the same scripts; its README says how); a record named
alike in both is PATH's. A chip with no MaxText record in either gets a "not measured" row. Only records that
count every layer (scan_layers false) are shown: a scanned layer stack is counted once by the compiler.

Per device and step: temporaries, bytes accessed (the compiler's estimate of HBM traffic), the compiler's FLOPs,
r = (bytes / HBM bandwidth) / (6 N T / peak) (above 1 the step waits on memory; 6 N T is the model's own
arithmetic, N its parameters), the roofline step time max(FLOPs / peak, bytes / bandwidth) and which bound it
is, and the jax and libtpu that compiled it.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.common.chips import HBM_BYTES_S, PEAK_FLOPS

GIB = 2 ** 30
ROOT = Path(__file__).resolve().parents[2]
MAXTEXT_ENV = "TPUCTL_MAXTEXT_FIGURES"
DEFAULT_MAXTEXT = ROOT.parent / "shared" / "bench" / "maxtext" / "out"
# MaxText's records kept with the code: the shared folder has v5e-8's only, so v6e-8's live here (JSON records and
# the venv's pip freeze, for their jax and libtpu); read beside whatever PATH is given.
COMMITTED_MAXTEXT = ROOT / "bench" / "maxtext_records"
STEP = ["pretrain", "--preset", "gpt2-124m", "--batch-size", "64", "--seq-len", "1024", "--ckpt-dir", "gs://bench/run"]


@dataclass(frozen=True)
class Chip:
    accelerator: str   # the catalog's name (tpuctl plan -a)
    topology: str      # libtpu's
    device_kind: str
    maxtext: str       # MaxText's compile_topology


CHIPS = {"v5e-8": Chip("v5litepod-8", "v5e:2x4", "TPU v5 lite", "v5e-8"),
         "v6e-8": Chip("v6e-8", "v6e:2x4", "TPU v6 lite", "v6e-8")}
# label -> our trainer flags: the default, then each change undone on its own (its own row)
OURS = {
    "ours, default (the output layer and loss as Pallas kernels)": [],
    "ours, --remat full (each layer recomputed in the backward pass, as MaxText's remat full)": ["--remat", "full"],
    "ours, --loss-kernel xla (XLA's loss in chunks of 256: the default before)": ["--loss-kernel", "xla"],
    "ours, --loss-kernel xla --loss-chunk 0 (no loss chunks)": ["--loss-kernel", "xla", "--loss-chunk", "0"],
    "ours, --loss-kernel xla --loss-chunk 128 (the default before 256)": ["--loss-kernel", "xla", "--loss-chunk", "128"],
    "ours, --loss-kernel xla --loss-chunk 512": ["--loss-kernel", "xla", "--loss-chunk", "512"],
    "ours, splash head-minor, split, blocks of 512 (the default before)": [
        "--splash-layout", "head-minor", "--splash-bwd", "split", "--splash-block", "512"],
    "ours, --splash-block 512": ["--splash-block", "512"],
    "ours, --optimizer-state sharded (ZeRO-1)": ["--optimizer-state", "sharded"],
    "ours, --loss-kernel xla --loss-chunk 0 --optimizer-state sharded": [
        "--loss-kernel", "xla", "--loss-chunk", "0", "--optimizer-state", "sharded"],
    "ours, --loss-kernel xla --table-grads per-use (the default before once)": [
        "--loss-kernel", "xla", "--table-grads", "per-use"],
    "ours, --loss-kernel xla --logits compute (bf16 logits in the chunked loss)": [
        "--loss-kernel", "xla", "--logits", "compute"],
    "ours, --splash-fwd compact (the forward's statistics in VMEM)": ["--splash-fwd", "compact"],
}
V6E_OURS = tuple(list(OURS)[:4])  # the default, remat full, XLA's chunked loss, XLA's loss in one piece


@dataclass(frozen=True)
class Row:
    label: str
    temp_bytes: float | None = None
    bytes_accessed: float | None = None
    flops: float | None = None
    n_params: int = 0
    tokens: int = 0
    devices: int = 8
    counted: str = ""
    jax: str = "-"
    libtpu: str = "-"
    note: str = ""


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def ours(chip: Chip, label: str, flags: list[str]) -> Row:
    """Our step as `tpuctl plan -a ACCELERATOR` compiles it (its cache reused: keyed by the code and versions)."""
    from orchestrator.plan import step as P
    try:
        p = P.plan(chip.accelerator, [*STEP, *flags], alternatives=False)
    except P.PlanError as e:
        return Row(label, note=f"failed: {e}")
    f = p.figures
    if p.compiler != P.TPU:
        return Row(label, note=f"not compiled by libtpu ({p.label})")
    n_params = f["params_bytes"] // 4  # f32 master weights, replicated: every device holds all of them
    return Row(label, f["temp_bytes"], f["bytes_accessed"], f["flops"], n_params, f["tokens_per_step"], f["devices"],
               f.get("counted", ""), _version("jax"), _version("libtpu"))


def seed_cache(chip: Chip) -> Path:
    """Where the seed's figures for this chip are kept, as `tpuctl plan` keeps ours: keyed by its code (the seed
    and its compile), the topology and the versions; a compile of it takes many minutes."""
    from orchestrator.state import home
    h = hashlib.sha256(json.dumps([chip.topology, _version("jax"), _version("libtpu"), _version("flax")]).encode())
    for name in ("seed_gpt2.py", "compiler/seed_plan.py"):
        h.update((ROOT / "bench" / name).read_bytes())
    return home() / "plans" / f"seed-{h.hexdigest()[:24]}.json"


def seed(chip: Chip) -> Row:
    label = "seed's step (bench/seed_gpt2.py)"
    cached = seed_cache(chip)
    if cached.is_file():
        f = json.loads(cached.read_text())
    else:
        out = subprocess.run([sys.executable, "-m", "bench.compiler.seed_plan", "--tpu", chip.topology],
                             capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if out.returncode:
            return Row(label, note=f"failed: {(out.stderr.strip().splitlines() or ['no output'])[-1][:120]}")
        f = json.loads(out.stdout.strip().splitlines()[-1])
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(f))
    return Row(label, f["temp_bytes"], f["bytes_accessed"], f["flops"], f["n_params"], f["tokens_per_step"],
               f["devices"], f["counted"], _version("jax"), _version("libtpu"))


def maxtext_path(given: str | None = None) -> Path:
    return Path(given or os.environ.get(MAXTEXT_ENV) or DEFAULT_MAXTEXT)


def maxtext_paths(given: str | None = None) -> list[Path]:
    """Where MaxText's records are read: PATH (--maxtext, $TPUCTL_MAXTEXT_FIGURES or the shared folder), then the
    committed ones (once, when PATH is that folder)."""
    first = maxtext_path(given)
    same = first.resolve() == COMMITTED_MAXTEXT.resolve()
    return [first] if same else [first, COMMITTED_MAXTEXT]


def _freeze_versions(folder: Path) -> dict[str, str]:
    """jax and libtpu from a pip freeze (venv_freeze.txt) the maxtext scripts keep beside their records."""
    for d in (folder, folder.parent):
        f = d / "venv_freeze.txt"
        if f.is_file():
            pins = dict(ln.strip().split("==", 1) for ln in f.read_text().splitlines() if "==" in ln)
            return {k: pins[k] for k in ("jax", "libtpu") if k in pins}
    return {}


def _maxtext_label(rec: dict) -> str:
    block = str(rec.get("decoder_block", "")).rsplit(".", 1)[-1].lower() or "?"
    fsdp = rec.get("ici_fsdp_parallelism")
    sharding = "data=8 (params replicated)" if fsdp == 1 else "fsdp=8 (its default)"
    attention = "xla attention" if rec.get("attention") == "dot_product" else "splash"
    return f"MaxText, {block} block, {attention}, remat {rec.get('remat_policy', '?')}, {sharding}"


def _records(paths: list[Path]):
    """(file, versions from its folder's pip freeze) for each JSON record under `paths`; a record named as one
    already read (same file name) is left out, so a given PATH's record wins over the committed one."""
    seen = set()
    for path in paths:
        files = sorted(path.glob("*.json")) if path.is_dir() else [path] if path.is_file() else []
        versions = _freeze_versions(path if path.is_dir() else path.parent)
        for file in files:
            if file.name not in seen:
                seen.add(file.name)
                yield file, versions


def maxtext(chip: Chip, path: Path | list[Path]) -> list[Row]:
    """MaxText's records for this chip and the same work, counted whole (unscanned layers), from a record file or
    folder, or from each of a list of them (maxtext_paths())."""
    paths = list(path) if isinstance(path, (list, tuple)) else [path]
    rows = []
    for file, versions in _records(paths):
        try:
            rec = json.loads(file.read_text())
        except ValueError:
            continue
        over = " ".join(rec.get("overrides", [])) if isinstance(rec.get("overrides"), list) else str(rec.get("overrides"))
        topo = re.search(r"compile_topology=([\w-]+)", over)
        if not topo or topo.group(1) != chip.maxtext or rec.get("scan_layers", True):
            continue
        if rec.get("global_batch") != 64 or rec.get("max_target_length") != 1024:
            continue
        n = rec.get("n_params_model_state")
        rows.append(Row(f"{_maxtext_label(rec)} [{file.stem}]", rec["temp_bytes"], rec["bytes_accessed"], rec["flops"],
                        n if isinstance(n, int) else 124_475_910, 64 * 1024, 8, "program (layers unscanned)",
                        rec.get("jax", versions.get("jax", "-")), rec.get("libtpu", versions.get("libtpu", "-"))))
    if not rows:
        where = ", ".join(str(p) if p.exists() else f"{p} (missing)" for p in paths)
        rows.append(Row("MaxText", note=f"not measured: no unscanned {chip.maxtext} record in {where}; the maxtext "
                                        f"bench scripts write one (compile_topology={chip.maxtext})"))
    return rows


# The step's label goes last: labels run long (a flag and why), and the figures stay in their columns.
HEADER = (f"  {'temps':>9} {'bytes':>8} {'TFLOP':>6} {'r':>5} {'roofline':>13}  {'counted':<26} {'jax':<9} "
          f"{'libtpu':<9} step")


def render(chip: Chip, r: Row) -> str:
    if r.note:
        return f"  {r.note}: {r.label}"
    peak, bandwidth = PEAK_FLOPS[chip.device_kind], HBM_BYTES_S[chip.device_kind]
    six_nt = 6 * r.n_params * r.tokens / r.devices
    memory, compute = r.bytes_accessed / bandwidth, max(r.flops, six_nt) / peak
    ratio = memory / (six_nt / peak)
    bound = "memory" if memory > compute else "compute"
    return (f"  {r.temp_bytes / GIB:5.2f} GiB {r.bytes_accessed / 1e9:5.1f} GB {r.flops / 1e12:6.2f} {ratio:5.2f} "
            f"{max(memory, compute) * 1e3:5.1f} ms {bound:<7} {r.counted:<26} {r.jax:<9} {r.libtpu:<9} {r.label}")


def main(chips: list[str] | None = None, maxtext_at: str | None = None, say=print) -> dict:
    from trainer.common.aot import has_libtpu
    if not has_libtpu():
        say("  skipped: libtpu is not installed (pip install 'tpuctl[plan]', or `make setup`, installs it)")
        return {}
    paths = maxtext_paths(maxtext_at)
    say(f"  gpt2-124m, batch 64 x 1024, bf16 over f32 weights, AdamW; per device and step. r = (bytes / HBM "
        f"bandwidth) / (6NT / peak). MaxText records: {', '.join(map(str, paths))}")
    out: dict = {}
    for name in chips or list(CHIPS):
        chip = CHIPS[name]
        say(f"  {name} ({PEAK_FLOPS[chip.device_kind] / 1e12:.0f} TFLOP/s, {HBM_BYTES_S[chip.device_kind] / 1e9:.0f} "
            "GB/s per chip)")
        say(HEADER)
        labels = OURS if name == "v5e-8" else {k: OURS[k] for k in V6E_OURS}
        rows = [ours(chip, label, flags) for label, flags in labels.items()]
        for row in rows:
            say(render(chip, row))
        for row in [seed(chip), *maxtext(chip, paths)]:
            rows.append(row)
            say(render(chip, row))
        out[name] = [r.__dict__ for r in rows]
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.compiler.side_by_side", description=__doc__.splitlines()[0])
    p.add_argument("--chips", default=",".join(CHIPS), help=f"comma-separated, from {', '.join(CHIPS)}")
    p.add_argument("--maxtext", help=f"MaxText's records: a JSON file or a folder of them (default: ${MAXTEXT_ENV}, "
                                     f"else {DEFAULT_MAXTEXT}); {COMMITTED_MAXTEXT.relative_to(ROOT)}/ is read too")
    a = p.parse_args()
    bad = [c for c in a.chips.split(",") if c and c not in CHIPS]
    if bad:
        print(f"error: --chips {','.join(bad)}: choose from {', '.join(CHIPS)}", file=sys.stderr)
        sys.exit(2)
    main([c for c in a.chips.split(",") if c], a.maxtext)
