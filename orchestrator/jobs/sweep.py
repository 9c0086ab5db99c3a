"""`tpuctl sweep NAME`: every trial of a grid on slice NAME, one after another, each as one `tpuctl run`.

The grid, the trial names, their commands and what counts as finished are the trainer's (`python -m trainer
sweep --plan` checks everything and claims the sweep dir before anything runs; `--record` writes how a trial
ended). Each trial then runs as `tpuctl run NAME -- pretrain ... --ckpt-dir DIR/<trial>`: the same preflight,
push, logs, stop-all-on-failure and recreate-on-preemption as any run; its per-host logs are in
$TPUCTL_HOME/runs/NAME/<run id>/. A failed trial is recorded and the next one starts; Ctrl-C stops the trial
in flight (the trainer saves) and the sweep; the same command resumes. The report is the trainer's
(`python -m trainer report`), written next to the sweep dir, or under $TPUCTL_HOME/sweeps/NAME for gs://.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from orchestrator.provider import Provider
from orchestrator.spec import UserError
from orchestrator.state import home

TRAINER = [sys.executable, "-m", "trainer"]
TPUCTL = [sys.executable, "-m", "orchestrator.cli"]


@dataclass
class TrialResult:
    name: str
    status: str  # done | failed | interrupted | skipped
    exit_code: int | None = None
    reason: str = ""
    wall_s: float | None = None
    run_dir: str | None = None


@dataclass
class SweepResult:
    name: str
    out: str
    trials: list[TrialResult] = field(default_factory=list)
    report: dict | None = None
    interrupted: bool = False

    @property
    def failed(self) -> list[TrialResult]:
        return [t for t in self.trials if t.status == "failed"]

    @property
    def returncode(self) -> int:
        return 130 if self.interrupted else (1 if self.failed else 0)

    def to_json(self) -> dict:
        return {"name": self.name, "out": self.out, "returncode": self.returncode,
                "trials": [asdict(t) for t in self.trials], "report": self.report}


def run_trainer(args: list[str], env: dict[str, str]) -> str:
    """Run `python -m trainer ARGS` here (jax-free subcommands); its stdout, or its one error line raised."""
    p = subprocess.run([*TRAINER, *args], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        err = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
        raise UserError(err[-1][len("error: "):] if err else (p.stderr.strip().splitlines() or ["failed"])[-1])
    return p.stdout


def here_env(where: Provider, out: str) -> dict[str, str]:
    """The environment of this machine's trainer calls: the sweep's dir as the slice's provider serves it."""
    return {**os.environ, **where.local_env([out])}


def report_dir(name: str, out: str) -> str:
    return f"{out.rstrip('/')}/report" if "://" not in out else str(home() / "sweeps" / name / "report")


def _reason(res: dict) -> str:
    """`wI exited N: <the trainer's error line or last line>` from `tpuctl run --json` and its host logs."""
    w = res.get("failed_worker")
    codes = res.get("exit_codes") or {}
    if w is None:
        bad = [int(i) for i, rc in codes.items() if rc]
        w = bad[0] if bad else 0
    rc = codes.get(str(w), res.get("returncode"))
    run_dir = Path(res.get("run_dir") or "")
    log = run_dir / f"w{w}.log"
    if not log.is_file():  # a multislice run names its hosts s<slice>w<i>, in process order
        logs = sorted(run_dir.glob("s*w*.log"), key=lambda p: tuple(int(x) for x in p.stem[1:].split("w")))
        log = logs[w] if w < len(logs) else log
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [ln for ln in lines if ln.startswith("error: ")]
    last = errors[-1] if errors else next((ln for ln in reversed(lines) if ln.strip()), "")
    return f"w{w} exited {rc}" + (f": {last.strip()}" if last.strip() else "")


def run_trial_with_tpuctl(name: str, run_flags: list[str]) -> Callable[[list[str]], tuple[int, dict]]:
    """A trial = `tpuctl run NAME --json RUN_FLAGS -- ARGV`; the hosts' output streams to our stderr."""
    def run(argv: list[str]) -> tuple[int, dict]:
        with tempfile.TemporaryFile("w+") as stdout:
            p = subprocess.Popen([*TPUCTL, "run", name, "--json", *run_flags, "--", *argv], stdout=stdout,
                                 text=True, stdin=subprocess.DEVNULL)
            while True:
                try:
                    rc = p.wait()
                    break
                except KeyboardInterrupt:  # tpuctl run got the same Ctrl-C: it stops every host; wait for it
                    continue
            stdout.seek(0)
            lines = stdout.read().strip().splitlines()
        try:
            res = json.loads(lines[-1])
        except (ValueError, IndexError):  # refused before it ran (its one error line went to stderr)
            res = {}
        return rc, res
    return run


def sweep(name: str, grid_args: list[str], out: str, base: list[str], *,
          run_trial: Callable[[list[str]], tuple[int, dict]] | None = None, report: bool = True,
          run_flags: list[str] | None = None,
          say: Callable[[str], None] = lambda m: print(f"[tpuctl] {m}", file=sys.stderr, flush=True)) -> SweepResult:
    """Plan (everything checked, nothing run), then each unfinished trial in turn, then the report."""
    if not out:
        raise UserError("--out DIR is required: the sweep's dir, gs://BUCKET/PATH or a path every host shares")
    from orchestrator import provider, state
    rec = state.lookup(name)
    if rec is None:
        raise UserError(f"no slice named {name} in the local record: `tpuctl ls` lists them, "
                        f"`tpuctl up {name} ...` creates it")
    env = here_env(provider.of(rec), out)
    plan = json.loads(run_trainer(["sweep", "--plan", "--json", *grid_args, "--out", out, "--", *base], env))
    out = plan["out"]
    run_trial = run_trial or run_trial_with_tpuctl(name, list(run_flags or []))
    result = SweepResult(name, out)
    todo = [t for t in plan["trials"] if t["status"] != "done"]
    say(f"sweep {out}: {len(plan['trials'])} trial(s), {len(plan['trials']) - len(todo)} done, {len(todo)} to run "
        f"on {name}")
    result.trials = [TrialResult(t["name"], "skipped") for t in plan["trials"] if t["status"] == "done"]
    for i, t in enumerate(todo, 1):
        say(f"[{i}/{len(todo)}] {t['name']}: tpuctl run {name} -- {' '.join(t['argv'])}")
        t0 = time.monotonic()
        rc, res = run_trial(t["argv"])
        wall = time.monotonic() - t0
        if rc == 0:
            tr = TrialResult(t["name"], "done", 0, "", wall, res.get("run_dir"))
        elif rc == 130:
            tr = TrialResult(t["name"], "interrupted", rc, "interrupted; the same command resumes it", wall,
                             res.get("run_dir"))
        else:
            tr = TrialResult(t["name"], "failed", rc, _reason(res) if res else f"tpuctl run exited {rc}", wall,
                             res.get("run_dir"))
        run_trainer(["sweep", "--out", out, "--record", tr.name, "--status", tr.status, "--exit-code", str(rc),
                  "--reason", tr.reason, "--wall-s", f"{wall:.3f}"], env)
        result.trials.append(tr)
        if tr.status == "interrupted":
            result.interrupted = True
            say(f"sweep interrupted in {tr.name}: the same command resumes it")
            return result
        if tr.status == "failed":
            say(f"trial {tr.name} failed ({tr.reason}); going on")
    if report:
        result.report = make_report(name, out, env)
    return result


def make_report(name: str, out: str, env: dict[str, str] | None = None) -> dict:
    return json.loads(run_trainer(["report", "--json", "--ckpt-dir", out, "--out", report_dir(name, out)],
                               env or {**os.environ}))


def summary(res: SweepResult) -> str:
    done = sum(t.status in ("done", "skipped") for t in res.trials)
    lines = [f"sweep {res.name}: {done}/{len(res.trials)} trial(s) done in {res.out}"]
    lines += [f"  failed: {t.name}: {t.reason}" for t in res.failed]
    if res.report:
        lines.append(f"report: {res.report['html']}")
        lines.append("pictures: " + ", ".join(f for f in res.report["files"] if f.endswith(".png")))
    return "\n".join(lines)
