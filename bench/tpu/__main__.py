"""`python -m bench.tpu` (`make tpu-check`): see bench/tpu/__init__.py."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import shutil
import sys
import time

SECTIONS = ("kernels", "classes", "steps", "choices", "cli", "lora", "profile")


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.tpu", description=(__import__("bench.tpu").tpu.__doc__ or "")
                                .split("\n\n")[0])
    p.add_argument("--out", default="", help="folder for the JSON, the trace and the check's runs "
                                             "(default ./tpu-check-DATE)")
    p.add_argument("--json", default="", help="where the JSON goes (default OUT/tpu-check.json)")
    p.add_argument("--only", action="append", default=[], choices=SECTIONS, help="run only these sections")
    p.add_argument("--skip", action="append", default=[], choices=SECTIONS, help="leave out a section")
    p.add_argument("--choice", action="append", default=[], metavar="WORDS",
                   help="in the choices section, only the alternatives whose names hold these words "
                        "(e.g. --choice resident; repeatable)")
    p.add_argument("--rows", action="append", default=[], metavar="WORDS",
                   help="in every section, only the rows whose names hold these words (e.g. --rows 'batch 16' "
                        "--rows gemma; '=NAME': that row exactly; repeatable)")
    p.add_argument("--plans", metavar="FILE", help="the plans of the rows, compiled ahead with --plan-ahead: "
                                                   "joined to the rows of the same name")
    p.add_argument("--plan-ahead", metavar="FILE", help="on any machine with libtpu (no chip): compile each row's "
                                                        "step for one v5e chip and write its plan to FILE "
                                                        "(--rows chooses rows), then exit")
    p.add_argument("--trace", action="store_true", help="the LoRA rows also trace two of their steps into OUT "
                                                         "(trace-ROW.xplane.pb; read by --summarize where xprof "
                                                         "is installed)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that the sections run (no figures)")
    p.add_argument("--cpu", action="store_true", help="run on this host's CPU when it has no TPU (with --quick)")
    p.add_argument("--summarize", metavar="DIR", help="read a check's folder from a TPU host (its tpu-check.json, "
                                                      "or a JSON file) and print its table; a trace kept beside it "
                                                      "is summarized here and its row written into the JSON")
    return p.parse_args(argv)


def versions() -> dict:
    from bench.tpu.common import version_of
    return {name: v for name in ("jax", "jaxlib", "libtpu", "libtpu-nightly") if (v := version_of(name))}


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.summarize:
        return summarize(args.summarize, args.plans)
    if args.plan_ahead:
        from bench.tpu import plans
        return plans.plan_ahead(args.plan_ahead, tuple(args.rows))
    from trainer.common import accelerators
    nodes = accelerators.tpu_nodes()
    if not nodes and not args.cpu:
        print("no TPU on this host (no /dev/accel* or /dev/vfio/<N>): nothing to check here. Run `make tpu-check` "
              "on a TPU host (docs/tpu-check.md); `--cpu --quick` runs the sections on this CPU at tiny sizes.")
        return 0
    if not nodes:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    out = os.path.abspath(args.out or f"tpu-check-{datetime.date.today().isoformat()}")
    os.makedirs(out, exist_ok=True)
    import jax
    from trainer.common import chips, loop, process
    process.check_accelerator()  # a TPU node and no TPU: stop, naming it (as the trainer does)
    loop.enable_compile_cache()
    dev = jax.devices()[0]
    from bench.tpu.common import Settings
    s = Settings(quick=args.quick, out=out, peak=chips.PEAK_FLOPS.get(dev.device_kind),
                 hbm=chips.HBM_BYTES_S.get(dev.device_kind), device_kind=dev.device_kind,
                 pick=tuple(args.choice), rows=tuple(args.rows), trace=args.trace)
    about = {"device_kind": dev.device_kind, "devices": jax.device_count(), "backend": jax.default_backend(),
             "versions": versions(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "quick": args.quick, "commit": os.environ.get("TPUCTL_COMMIT", ""), "argv": sys.argv[1:]}
    print(f"tpu-check: {jax.device_count()} x {dev.device_kind} ({jax.default_backend()}), "
          + ", ".join(f"{k} {v}" for k, v in about["versions"].items()) + f"; output in {out}", flush=True)
    wanted = [x for x in (args.only or SECTIONS) if x not in args.skip]
    rows, failed = [], {}
    from bench.tpu import classes, cli, kernels, lora, profile, report as report_lib, steps
    runs = {"kernels": kernels.run, "classes": classes.run, "steps": steps.run, "choices": steps.choices,
            "cli": cli.run, "lora": lora.run, "profile": profile.run}
    path = args.json or os.path.join(out, "tpu-check.json")
    plans = _plans(args.plans)
    for name in wanted:
        t0 = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        n = 0
        try:
            for row in runs[name](s):  # each row printed and kept as it is measured
                rows.append(row)
                n += 1
                written = _write(path, about, rows, failed, plans)
                print(report_lib.row_line(written["rows"][-1]), flush=True)
        except Exception as e:  # noqa: BLE001 - one section's failure is reported; the others still run
            import traceback
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        print(f"[{name}] {n} row(s) in {time.perf_counter() - t0:.0f} s", flush=True)
        _write(path, about, rows, failed, plans)  # whatever is done is kept, also if a later section is killed
    report = _write(path, about, rows, failed, plans)
    print(render(report))
    print(f"JSON: {path}")
    bad = [r for r in rows if r.ok is False]
    return 1 if bad or failed else 0


def _plans(path: str | None) -> dict:
    from bench.tpu import plans
    return plans.load(path) if path else {}


def _write(path: str, about: dict, rows, failed: dict, plans: dict | None = None) -> dict:
    from bench.tpu import plans as plans_lib, report
    dicts = [dataclasses.asdict(r) for r in rows]
    if plans:
        plans_lib.join(dicts, plans)
    data = report.build(about, dicts, failed)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=float)
    os.replace(tmp, path)
    return data


def render(data: dict) -> str:
    from bench.tpu import report
    return report.render(data)


def summarize(folder: str, plans_path: str | None = None) -> int:
    from bench.tpu import plans, profile, report
    path = folder if folder.endswith(".json") else os.path.join(folder, "tpu-check.json")
    with open(path) as f:
        data = json.load(f)
    here = os.path.dirname(path)
    for gz in sorted(os.listdir(here or ".")):  # traces a TPU host sent back gzipped (bench/tpu/on_host.sh)
        dest = os.path.join(here, gz[:-3])
        if gz.endswith(".xplane.pb.gz") and not os.path.exists(dest):
            with gzip.open(os.path.join(here, gz)) as src, open(dest + ".tmp", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(dest + ".tmp", dest)  # a read cut short leaves no trace half written under its name
    trace = os.path.join(here, profile.TRACE)
    changed = False
    if os.path.exists(trace):
        row = dataclasses.asdict(profile.summarize(trace))
        data["rows"] = [r for r in data["rows"] if r["section"] != "profile"] + [row]
        changed = True
    for r in data["rows"]:  # a row's own trace (--trace), read here where xprof is installed
        kept = os.path.join(here, r.get("figures", {}).get("trace") or "-")
        if os.path.exists(kept) and "profile" not in r["figures"]:
            r["figures"]["profile"] = profile.summarize_ops(kept)
            changed = True
    if plans_path:
        plans.join(data["rows"], plans.load(plans_path))
        changed = True
    data = report.build(data["about"], data["rows"], data.get("failed", {}))
    if changed:
        with open(path, "w") as f:  # the summary and the plans join the record they were read beside
            json.dump(data, f, indent=1, default=float)
    print(report.render(data))
    for r in data["rows"]:
        if "profile" in r.get("figures", {}):
            print(profile.describe_ops(r["name"], r["figures"]["profile"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
