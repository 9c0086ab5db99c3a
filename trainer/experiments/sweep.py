"""Sweeps: a grid (or zip) of config values over a base `pretrain` command, one trial per point.

Layout of a sweep dir (local or gs://):

    DIR/sweep.json          the grid, the base command and the trial names (a second sweep into DIR must match)
    DIR/<trial>/            the trial's --ckpt-dir: checkpoints, config.json, metrics.jsonl, tensorboard/
    DIR/<trial>/trial.json  how its last attempt ended: done | failed | interrupted, exit code, reason, wall time

A finished trial is skipped; any other runs again with the same command, and the trainer resumes it from its
latest checkpoint. Jax-free: the sweep starts trials as processes (`python -m trainer pretrain ...` here, or
through `tpuctl run` on a slice, which uses `--plan` and `--record`).
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from trainer.common.config import ModelConfig, TrainConfig, UsageError

SWEEP_JSON = "sweep.json"
TRIAL_JSON = "trial.json"
FORMAT = 1
_FIELDS = {f.name: f for cls in (ModelConfig, TrainConfig) for f in dataclasses.fields(cls)}
# Set per trial by the sweep itself, never a grid axis.
_RESERVED = {"ckpt_dir"}


@dataclass(frozen=True)
class Trial:
    name: str
    overrides: dict  # config field -> value
    argv: list  # the full `pretrain ...` argv, --ckpt-dir included
    ckpt_dir: str


@dataclass(frozen=True)
class Sweep:
    out: str
    mode: str  # grid | zip
    axes: dict  # field -> [values]
    base: list  # `pretrain ...` without --ckpt-dir
    trials: list

    def record(self) -> dict:
        return {"format": FORMAT, "mode": self.mode, "axes": self.axes, "base": self.base,
                "trials": [t.name for t in self.trials]}


# --- the grid ------------------------------------------------------------------------------------

def _field(key: str) -> str:
    name = key.strip().lstrip("-").replace("-", "_")
    if name in _RESERVED:
        raise UsageError(f"grid key {key!r}: the sweep sets --ckpt-dir per trial (under --out); remove it")
    if name not in _FIELDS:
        close = difflib.get_close_matches(name, list(_FIELDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown grid key {key!r}{hint}: use a `pretrain` flag name such as n_layer, d_model, "
                         "lr, batch_size (`python -m trainer pretrain --help` lists them)")
    return name


def _value(name: str, raw) -> int | float | str:
    typ = {int: int, float: float, str: str}[_type(name)]
    what = {int: "an integer", float: "a number", str: "a string"}[typ]
    if isinstance(raw, bool) or (typ is not str and not isinstance(raw, (int, float, str))):
        raise UsageError(f"grid key {name}: {raw!r} is not {what}")
    try:
        v = typ(raw)
        if typ is int and isinstance(raw, float) and raw != int(raw):
            raise ValueError
        if typ is int and isinstance(raw, str) and not re.fullmatch(r"[+-]?\d+", raw.strip()):
            raise ValueError
        return v
    except ValueError:
        raise UsageError(f"grid key {name}: {raw!r} is not {what}") from None


def _type(name: str) -> type:
    import typing
    cls = ModelConfig if name in {f.name for f in dataclasses.fields(ModelConfig)} else TrainConfig
    return typing.get_type_hints(cls)[name]


def parse_sets(sets: list[str]) -> dict[str, list]:
    """`--set n_layer=2,4,8` (repeatable) -> {field: [values]}."""
    axes: dict[str, list] = {}
    for s in sets:
        key, eq, vals = s.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--set {s!r}: write KEY=V1,V2,... (e.g. --set n_layer=2,4)")
        name = _field(key)
        values = [v.strip() for v in vals.split(",") if v.strip()]
        if not values:
            raise UsageError(f"--set {s!r}: no values; write {key}=V1,V2,...")
        axes[name] = axes.get(name, []) + [_value(name, v) for v in values]
    return axes


def load_grid(path: str) -> dict[str, list]:
    """A YAML mapping of key -> value or list of values (`n_layer: [2, 4]`)."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise UsageError(f"--grid {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--grid {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise UsageError(f"--grid {path}: expected a mapping of key: [values], e.g. `n_layer: [2, 4]`")
    axes = {}
    for key, vals in doc.items():
        name = _field(str(key))
        vals = vals if isinstance(vals, list) else [vals]
        if not vals:
            raise UsageError(f"--grid {path}: {key} has no values; give a list, e.g. `{key}: [2, 4]`")
        axes[name] = [_value(name, v) for v in vals]
    return axes


def _fmt(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def trial_name(overrides: dict) -> str:
    """n_layer=2, d_model=128 -> `n_layer-2_d_model-128` (a path component on any filesystem and gs://)."""
    return "_".join(f"{k}-{re.sub(r'[^A-Za-z0-9.+-]', '', _fmt(v))}" for k, v in overrides.items())


def points(axes: dict[str, list], mode: str) -> list[dict]:
    if not axes:
        raise UsageError("the grid is empty: give --grid FILE or --set KEY=V1,V2 (e.g. --set n_layer=2,4)")
    keys = list(axes)
    if mode == "zip":
        lengths = {k: len(v) for k, v in axes.items()}
        if len(set(lengths.values())) != 1:
            raise UsageError(f"--zip needs lists of one length: {', '.join(f'{k} has {n}' for k, n in lengths.items())}")
        combos = list(zip(*axes.values()))
    else:
        combos = list(itertools.product(*axes.values()))
    out = [dict(zip(keys, c)) for c in combos]
    names = [trial_name(p) for p in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"the grid repeats a trial ({dup[0]}): list each value once")
    return out


# --- the plan ------------------------------------------------------------------------------------

def _flag_in(argv: list[str], name: str) -> bool:
    flag = "--" + name.replace("_", "-")
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def plan(axes: dict[str, list], mode: str, out: str, base: list[str]) -> Sweep:
    """Check everything before anything runs: the grid, the base command, every trial's config."""
    from trainer.common import config
    from trainer.pretrain.flags import pretrain_parser
    if not base or base[0] != "pretrain":
        raise UsageError("give the base command after --: `... --out DIR -- pretrain --preset gpt2-tiny ...`")
    if not out:
        raise UsageError("--out DIR is required: the sweep's dir (local or gs://), one --ckpt-dir per trial in it")
    if _flag_in(base, "ckpt_dir"):
        raise UsageError("the base command sets --ckpt-dir: the sweep gives each trial its own under --out; remove it")
    for k in axes:
        if _flag_in(base, k):
            raise UsageError(f"--{k.replace('_', '-')} is both a grid key and in the base command; keep one")
    out = out.rstrip("/") if "://" in out else os.path.abspath(out)
    trials = []
    for p in points(axes, mode):
        name = trial_name(p)
        ckpt = f"{out}/{name}"
        argv = [*base]
        for k, v in p.items():
            argv += ["--" + k.replace("_", "-"), _fmt(v)]
        argv += ["--ckpt-dir", ckpt]
        try:
            config.resolve(pretrain_parser().parse_args(argv))
        except UsageError as e:
            raise UsageError(f"trial {name}: {e}") from None
        trials.append(Trial(name, p, argv, ckpt))
    return Sweep(out, mode, axes, list(base), trials)


def claim(sw: Sweep) -> None:
    """Write DIR/sweep.json, or check that the one there is this sweep's (a resume)."""
    from etils import epath
    root = epath.Path(sw.out)
    rec = root / SWEEP_JSON
    if rec.exists():
        have = json.loads(rec.read_text())
        if have.get("trials") != [t.name for t in sw.trials] or have.get("base") != sw.base:
            raise UsageError(f"--out {sw.out} holds another sweep (trials {', '.join(have.get('trials', []))}; "
                             f"base `{' '.join(have.get('base', []))}`): use another --out, or the same grid and "
                             "base command to resume it")
        return
    if root.exists() and any(True for _ in root.iterdir()):
        raise UsageError(f"--out {sw.out} is not empty and holds no sweep ({SWEEP_JSON} is missing): "
                         "use a new or empty dir")
    root.mkdir(parents=True, exist_ok=True)
    rec.write_text(json.dumps(sw.record(), indent=1) + "\n")


def load(out: str) -> dict | None:
    from etils import epath
    rec = epath.Path(out) / SWEEP_JSON
    return json.loads(rec.read_text()) if rec.exists() else None


def status(trial_dir: str) -> dict:
    from etils import epath
    p = epath.Path(trial_dir) / TRIAL_JSON
    return json.loads(p.read_text()) if p.exists() else {"status": "pending"}


def record(trial_dir: str, state: str, exit_code: int | None = None, reason: str = "",
           wall_s: float | None = None) -> dict:
    from etils import epath
    rec = {"status": state, "exit_code": exit_code, "reason": reason, "wall_s": wall_s, "at": time.time()}
    d = epath.Path(trial_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / TRIAL_JSON).write_text(json.dumps(rec) + "\n")
    return rec


def pending(sw: Sweep) -> list[Trial]:
    return [t for t in sw.trials if status(t.ckpt_dir).get("status") != "done"]


def reason_from(lines: list[str], rc: int) -> str:
    """The trainer's own `error: ...` line when it printed one, else its last line, with the exit code."""
    errors = [ln[len("error: "):] for ln in lines if ln.startswith("error: ")]
    last = errors[-1] if errors else next((ln for ln in reversed(lines) if ln.strip()), "")
    what = f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"
    return f"{what}: {last.strip()}" if last.strip() else what


# --- running on this machine ---------------------------------------------------------------------

def run_local(sw: Sweep, say=print) -> int:
    """Each unfinished trial in turn as `python -m trainer pretrain ...`. A failure is recorded and the
    sweep goes on; Ctrl-C stops after the current trial saved (the trainer's own Ctrl-C save). Returns
    0 when every trial is done, 1 when some failed, 130 when interrupted."""
    claim(sw)
    todo = pending(sw)
    say(f"sweep {sw.out}: {len(sw.trials)} trial(s), {len(sw.trials) - len(todo)} done, {len(todo)} to run")
    failed = {}
    for i, t in enumerate(todo, 1):
        say(f"[{i}/{len(todo)}] {t.name}: python -m trainer {' '.join(t.argv)}")
        t0 = time.monotonic()
        rc, lines = _run_prefixed([sys.executable, "-m", "trainer", *t.argv], f"[{t.name}] ")
        wall = time.monotonic() - t0
        if rc == 0:
            record(t.ckpt_dir, "done", 0, "", wall)
        elif rc in (130, -signal.SIGINT):
            record(t.ckpt_dir, "interrupted", rc, "interrupted (Ctrl-C); rerun the sweep to resume", wall)
            say(f"sweep interrupted in {t.name}: the same command resumes it")
            return 130
        else:
            failed[t.name] = record(t.ckpt_dir, "failed", rc, reason_from(lines, rc), wall)["reason"]
            say(f"trial {t.name} failed ({failed[t.name]}); going on")
    say(summary(sw, failed))
    return 1 if failed else 0


def summary(sw: Sweep, failed: dict[str, str]) -> str:
    ok = len(sw.trials) - len(failed)
    lines = [f"sweep {sw.out}: {ok}/{len(sw.trials)} trial(s) done"]
    lines += [f"  failed: {n}: {why}" for n, why in failed.items()]
    lines.append(f"report: python -m trainer report --ckpt-dir {sw.out}")
    return "\n".join(lines)


def _run_prefixed(argv: list[str], prefix: str) -> tuple[int, list[str]]:
    """Run argv, its output prefixed on our stdout; a Ctrl-C reaches it (same process group) and we wait
    for it to save and exit."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    while True:
        try:
            for line in p.stdout:
                line = line.rstrip("\n")
                lines.append(line)
                lines[:] = lines[-200:]
                print(prefix + line, flush=True)
            return p.wait(), lines
        except KeyboardInterrupt:  # the trainer got the same SIGINT: let it finish its save
            continue
