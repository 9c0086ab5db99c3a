"""A run's life across spot preemptions: run, and when the slice's VMs are preempted, recreate it and run again.

The trainer resumes from the latest Orbax step in --ckpt-dir by itself, so relaunching the same command is
the whole recovery. Only a lost slice is retried: a crash on a READY node is the user's bug and fails as before.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator import slices, state
from orchestrator.access.hosts import HostError
from orchestrator.jobs.runner import PREEMPTED, RunFailed, RunResult, write_json
from orchestrator.spec import UserError

# The VMs are gone: recreate. Under a queued resource the service deletes a preempted node, so a node DELETING,
# or gone with its queued resource SUSPENDING/SUSPENDED, is what a preemption looks like there.
LOST = ("PREEMPTED", "TERMINATED", "DELETING", "SUSPENDING", "SUSPENDED", "GONE")
HOST_LOST = {255, -1}                        # a host whose SSH connection dropped (runner, invoke)
_STEP = re.compile(r"\bstep\s+(\d+)")
_START = re.compile(r"resuming from step (\d+)|(starting from scratch)")
_HOST_LOG = re.compile(r"(s\d+)?w\d+\.log")  # one per host: w<i>.log, or s<slice>w<i>.log for multislice


def _host_logs(run_dir: Path) -> list[Path]:
    return sorted(p for p in Path(run_dir).glob("*.log") if _HOST_LOG.fullmatch(p.name))


def process0_log(run_dir: Path) -> Path:
    """Process 0's log: w0.log, or s0w0.log (slice 0, worker 0) of a multislice run."""
    single = Path(run_dir) / "w0.log"
    return single if single.exists() else Path(run_dir) / "s0w0.log"


@dataclass
class Policy:
    on_preemption: str = "recreate"   # recreate | fail
    max_restarts: int = 3
    settle_s: float = 60.0            # after exit 42 / a lost host, how long the API may lag behind the VMs
    poll_s: float = 2.0               # node state polling while settling
    cancelled: Callable[[], bool] | None = None  # a managed job's cancel: a failure then is the cancel, not a loss
    # Told the attempts so far as each one ends: a managed job's controller keeps them in the job's record, so a
    # controller that replaces it counts them in the job's goodput.
    on_attempt: Callable[[list[dict]], None] | None = None

    def __post_init__(self):
        if self.on_preemption not in ("recreate", "fail"):
            raise UserError(f"--on-preemption {self.on_preemption!r}: use recreate or fail")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts}: use 0 or more")


class Preempted(UserError):
    """The slice was preempted and is not recreated (policy fail, or no restarts left)."""


def node_state(name: str) -> str:
    """READY / PREEMPTED / TERMINATED / DELETING / ...; when the node no longer exists, its queued resource's
    state (SUSPENDED after a preemption), or GONE."""
    st = slices.status(name)
    if st.error:
        raise UserError(st.error)
    return st.state


def latest_step(run_dir: Path | None) -> int | None:
    """The last `step N` any host printed (trainer progress or its preemption save), for the message."""
    best = None
    for log in _host_logs(run_dir) if run_dir else []:
        try:
            steps = _STEP.findall(log.read_text(errors="replace"))
        except OSError:
            continue
        if steps:
            best = max(best or 0, int(steps[-1]))
    return best


def resumed_from(run_dir: Path | None) -> int | None:
    """The step the trainer of this run started from (0: from scratch), as process 0 printed it."""
    try:
        m = _START.search(process0_log(run_dir).read_text(errors="replace")) if run_dir else None
    except OSError:
        return None
    return None if m is None else int(m.group(1) or 0)


def summarize(attempts: list[dict]) -> str:
    """One line: how many preemptions, where each attempt resumed, and the steps done twice."""
    lost = [a for a in attempts if a["outcome"] == "preempted"]
    if not lost:
        return ""
    parts = []
    for prev, nxt in zip(attempts, attempts[1:]):
        if prev["outcome"] == "preempted":
            parts.append(f"lost at step {prev['last_step']}, resumed from step {nxt['resumed_from']}")
    redone = sum(a.get("steps_redone", 0) for a in attempts)
    return f"{len(lost)} preemption(s): " + "; ".join(parts) + f"; {redone} step(s) redone"


def _attempt(n: int, result: RunResult | None, outcome: str, before: dict | None, spent_s: float = 0.0) -> dict:
    """One attempt's record. spent_s: the attempt's whole time here, reaching the workers before the run and the
    provider's watch after it included: what the run itself did not time counts as start-up."""
    run_dir = result.run_dir if result else None
    t = result.timings if result else {}
    wall = t.get("total_s", 0.0)
    around = max(0.0, spent_s - wall)
    a = {"attempt": n + 1, "run_id": result.run_id if result else None, "outcome": outcome,
         "resumed_from": resumed_from(run_dir), "last_step": latest_step(run_dir), "wall_s": wall + around,
         # startup: reaching the workers, preflight, push, launch, restore, compile, first step; steps: first to
         # last reported step
         "startup_s": t.get("first_step_s", wall) + around, "steps_s": 0.0, "tail_s": 0.0, "recover_s": 0.0,
         "step_s": 0.0}
    if "last_step_s" in t:
        a["steps_s"] = t["last_step_s"] - t["first_step_s"]
        a["tail_s"] = wall - t["last_step_s"]
        if t["last_step"] > t["first_step"]:
            a["step_s"] = a["steps_s"] / (t["last_step"] - t["first_step"])
    if (redone := steps_redone(before, a)) is not None:
        a["steps_redone"] = redone
    return a


def steps_redone(before: dict | None, a: dict) -> int | None:
    """The steps attempt `a` trained again after a preemption ended `before`: from the step it resumed from to
    the last one `before` reached. None when `before` was not a preemption, or either step is unknown."""
    if before and before["outcome"] == "preempted" and before.get("last_step") is not None and \
            a.get("resumed_from") is not None:
        return max(0, before["last_step"] - a["resumed_from"])
    return None


def goodput(attempts: list[dict], wall_s: float) -> dict:
    """Where a run's wall time went, across its attempts. The parts add up to the wall time:
    productive (steps kept) + lost to preemptions (recovering, the later attempts' start-up: push, restore,
    compile; the redone steps; what a preempted attempt did after its last step) + overhead (the first start-up,
    the last attempt's end: final save, shutdown) + unaccounted (bookkeeping between attempts).
    A managed job's attempt may carry a stretch no controller watched before it (unwatched_s, controller.py):
    productive when the run went on meanwhile, lost when its slice was being recovered, overhead before a start.
    An attempt whose controller died in it (outcome unfinished) counts as far as that controller watched it."""
    redone_s = sum(a.get("steps_redone", 0) * attempts[i - 1]["step_s"] for i, a in enumerate(attempts) if i)
    steps_s = sum(a["steps_s"] for a in attempts)
    unwatched = {k: sum(a.get("unwatched_s", 0.0) for a in attempts if a.get("unwatched") == k)
                 for k in ("running", "recovering", "starting")}
    lost = (sum(a["recover_s"] for a in attempts) + sum(a["startup_s"] for a in attempts[1:]) + redone_s
            + sum(a["tail_s"] for a in attempts if a["outcome"] == "preempted") + unwatched["recovering"])
    overhead = attempts[0]["startup_s"] + (attempts[-1]["tail_s"] if attempts[-1]["outcome"] != "preempted" else 0) \
        + unwatched["starting"]
    productive = steps_s - redone_s + unwatched["running"]
    return {"wall_s": wall_s, "productive_s": productive, "time_to_first_step_s": attempts[0]["startup_s"],
            "lost_to_preemptions_s": lost, "redone_s": redone_s, "overhead_s": overhead,
            "unwatched_s": sum(unwatched.values()), "unaccounted_s": wall_s - productive - lost - overhead,
            # an attempt follows each preemption; one a managed job's controller died in is no restart
            "restarts": sum(a["outcome"] == "preempted" for a in attempts[:-1]),
            "goodput": productive / wall_s if wall_s > 0 else 0.0}


def goodput_table(attempts: list[dict], g: dict) -> str:
    rows = ["attempt  outcome    start-up  steps      tail     recover  redone",
            *(f"{a['attempt']:>7}  {a['outcome']:<9}  {a['startup_s']:7.1f}s  {a['steps_s']:7.1f}s  "
              f"{a['tail_s']:6.1f}s  {a['recover_s']:6.1f}s  {a.get('steps_redone', 0):>6}" for a in attempts)]
    rows.append(f"goodput {g['goodput']:.1%}: {g['productive_s']:.1f} s of steps kept in {g['wall_s']:.1f} s wall "
                f"(first step after {g['time_to_first_step_s']:.1f} s; {g['lost_to_preemptions_s']:.1f} s lost to "
                f"{g['restarts']} preemption(s))")
    return "\n".join(rows)


def recover_before_run(name: str, *, policy: Policy, progress: Callable[[str], None] = print, used: int = 0,
                       pending: bool = False) -> int:
    """A slice preempted *between* runs gets the same policy as one preempted during a run: recreated (returns
    the restarts this used: 1, or 0 for a restart already counted) or, with --on-preemption fail or no restart
    left, a Preempted error. 0 when it is not lost. used: the restarts already used of --max-restarts (a managed
    job's, across its controllers); pending: the last of them was begun and not seen through (its controller
    died between the preemption and the recreate), so a lost slice now is that restart's, not a new one."""
    try:
        st = node_state(name)
    except UserError:
        return 0  # no record or no answer: resolving the workers says what is wrong
    if st not in LOST:
        return 0
    if pending and used:
        progress(f"{name}'s VMs were {_verb(st)} and their recreate was not finished; recreating {name} "
                 f"({used}/{policy.max_restarts}, the same restart)")
        _recreate(name, st, progress)
        progress(f"{name} is READY again; running")
        return 0
    what = f"{name}'s VMs were {_verb(st)} before this run"
    if policy.on_preemption == "fail":
        raise Preempted(f"{what} (--on-preemption fail): `tpuctl down {name}` and `tpuctl up {name} ...` again, "
                        "then rerun, or pass --on-preemption recreate")
    if used >= policy.max_restarts:
        raise Preempted(f"{what}; not recreating {name}: {used} restart(s) used of --max-restarts "
                        f"{policy.max_restarts}; `tpuctl down {name}`, `tpuctl up` again and rerun, or raise "
                        "--max-restarts")
    progress(f"{what}; recreating {name} ({used + 1}/{policy.max_restarts})")
    _recreate(name, st, progress)
    progress(f"{name} is READY again; running")
    return 1


def _recreate(name: str, st: str, progress: Callable[[str], None]) -> None:
    try:
        slices.recreate(name, progress=progress)
    except UserError as e:
        raise UserError(f"{name} was {_verb(st)} and recreating it failed: {e}") from None


def supervise(name: str, run_once: Callable[[int], RunResult], *, policy: Policy | None = None,
              progress: Callable[[str], None] = print, restarts_used: int = 0) -> RunResult:
    """run_once(attempt) runs the command on NAME's current workers (attempt 0 first; later attempts must
    re-read the workers and SSH settings, the slice being new). Returns the successful RunResult; raises
    the run's own error (RunFailed, HostError, UserError) when the slice is still READY, Preempted when the
    slice is lost and the policy or the restart budget says stop. Ctrl-C propagates as it is."""
    policy = policy or Policy()
    restarts = restarts_used
    attempts: list[dict] = []
    t_start = time.monotonic()
    recover = 0.0  # time from an attempt's end to the next one's start (settling, recreating)
    while True:
        rec = state.lookup(name)
        if rec is None:
            raise UserError(f"no slice named {name} in the local record (see `tpuctl ls`)")
        try:
            t_attempt = time.monotonic()
            result = run_once(restarts)
            attempts.append(_attempt(len(attempts), result, "done", attempts[-1] if attempts else None,
                                     time.monotonic() - t_attempt))
            attempts[-1]["recover_s"] = recover
            _told(policy, attempts)
            result.attempts = attempts
            result.goodput = goodput(attempts, time.monotonic() - t_start)
            write_json(Path(result.run_dir) / "goodput.json",
                        {"run_id": result.run_id, "attempts": attempts, "goodput": result.goodput})
            if summary := summarize(attempts):
                progress(summary)
            table = goodput_table(attempts, result.goodput).splitlines()
            for line in table if result.goodput["restarts"] else table[-1:] if "first_step_s" in result.timings else []:
                progress(line)
            return result
        except RunFailed as e:
            if e.result.interrupted:
                raise
            failure, result = e, e.result
        except (HostError, UserError) as e:  # hosts unreachable, or the slice is not READY any more
            failure, result = e, None
        finally:
            t_lost = time.monotonic()
        if policy.cancelled is not None and policy.cancelled():
            raise failure
        st = _settled_state(name, result, policy, failure)
        if st not in LOST:
            if result is not None:
                attempts.append(_attempt(len(attempts), result, "failed", attempts[-1] if attempts else None,
                                         t_lost - t_attempt))
                _told(policy, attempts)
                result.attempts = attempts
            raise failure
        attempts.append(_attempt(len(attempts), result, "preempted", attempts[-1] if attempts else None,
                                 t_lost - t_attempt))
        attempts[-1]["recover_s"] = recover
        if result is None:  # preflight or push never got to run: the whole attempt went to recovering
            attempts[-1]["startup_s"] = attempts[-1]["wall_s"] = t_lost - t_attempt
        _told(policy, attempts)
        step = latest_step(result.run_dir if result else None)
        what = _what_was_lost(name, rec, result) + f" {_verb(st)}" + (f" at step {step}" if step is not None else "")
        if policy.on_preemption == "fail":
            raise Preempted(f"{what} (--on-preemption fail): `tpuctl down {name}` and `tpuctl up {name} ...` again, "
                            f"then rerun (the trainer resumes from the latest step in --ckpt-dir), or pass "
                            f"--on-preemption recreate") from None
        if restarts >= policy.max_restarts:
            raise Preempted(f"{what}; not recreating {name}: {restarts} restart(s) used of --max-restarts "
                            f"{policy.max_restarts}; `tpuctl down {name}`, `tpuctl up` again and rerun, or "
                            "raise --max-restarts") from None
        restarts += 1
        progress(f"{what}; recreating {name} ({restarts}/{policy.max_restarts}); the trainer resumes from the "
                 "latest complete checkpoint in --ckpt-dir")
        _recreate(name, st, progress)
        recover = time.monotonic() - t_lost
        progress(f"{name} is READY again; relaunching (attempt {restarts + 1})")


def _told(policy: Policy, attempts: list[dict]) -> None:
    if policy.on_attempt is not None:
        policy.on_attempt(list(attempts))


def _what_was_lost(name: str, rec, result: RunResult | None) -> str:
    """The subject of the preemption line: the lost slice(s) of a multislice job (every slice's job stops with
    one), else the host whose connection dropped first, else the slice's VMs."""
    if rec.slices > 1:
        try:
            lost = [d for d in slices.status(name).nodes if d["state"] != "READY"]
        except UserError:
            lost = []
        if lost:
            which = ", ".join(f"{d['slice']} ({d['node'].rsplit('/', 1)[-1]})" for d in lost)
            return f"{name}'s slice{'s' if len(lost) > 1 else ''} {which} of {rec.slices} {'were' if len(lost) > 1 else 'was'}"
        return f"{name}'s VMs ({rec.slices} slices) were"
    if result and result.failed_worker is not None:
        return f"w{result.failed_worker}'s VM was"
    return f"{name}'s VMs were"


def _verb(state: str) -> str:
    return {"GONE": "deleted"}.get(state, "preempted" if state in ("DELETING", "SUSPENDING", "SUSPENDED")
                                    else state.lower())


def lost(name: str) -> str | None:
    """The slice's state when its VMs are gone (preempted, terminated, deleted), else None."""
    st = node_state(name)
    return st if st in LOST else None


def _settled_state(name, result, policy, failure) -> str:
    """The node's state; after exit 42 or a dropped host, give the API time to notice the VMs' end."""
    try:
        st = node_state(name)
    except UserError:
        raise failure from None  # cannot tell (no record, API down): the run's own error says more
    codes = set(result.exit_codes.values()) if result else set()
    if st != "READY" or not codes & {PREEMPTED, *HOST_LOST}:
        return st
    deadline = time.monotonic() + policy.settle_s
    while st == "READY" and time.monotonic() < deadline:
        time.sleep(policy.poll_s)
        st = node_state(name)
    return st
