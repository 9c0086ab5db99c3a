"""The managed-jobs controller: `python -m orchestrator.jobs.controller --bucket B --project P --zone Z`, run as a
service on its own VM (controller_vm.py). It supervises every live job of its bucket and region as `tpuctl run`
does in a terminal (jobs.attached.run: recovery from preemption, the first failure stopping every host, bounded
restarts, goodput), and keeps each job's record in the bucket (store.py) as it goes.

It holds nothing that matters on its own disk: a new controller (its VM deleted, rebooted or replaced) reads every
live job from the bucket and follows the run its record names where the hosts still know it: re-attached to a
trainer that is still running, or, for one that ended meanwhile, its end (exit codes) read from the hosts, so the
job ends under the same run id instead of running again. With no live job for --idle-minutes it deletes its own
VM.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from orchestrator import provider, state
from orchestrator.jobs import bundle as B
from orchestrator.jobs import controller_vm as V
from orchestrator.jobs import job_secrets
from orchestrator.jobs.store import LIVE, JobStore, initial_state

_RECREATING = re.compile(r"recreating \S+ \((\d+)/\d+[,)]")  # N: the job's restarts so far, this one included
_READY_AGAIN = re.compile(r"\S+ is READY again; (relaunching|running)")
_BEFORE_RUN = re.compile(r"before this run; recreating|their recreate was not finished")
_TRIAL = re.compile(r"\[(\d+)/(\d+)\] (\S+): tpuctl run")
_FOLLOWING = re.compile(r"run (\S+) of this same command is still going")
_ENDED = re.compile(r"run (\S+) of this same command ended on the hosts while nobody followed it")
_HOST_LOG = re.compile(r"(s\d+)?w\d+\.log")
IN_PROGRESS = ("running", "recovering")  # the outcome of an attempt written while it goes on


class JobLog(io.TextIOBase):
    """What `tpuctl run` would print in a terminal: kept as the job's controller.log (copied to the bucket as it
    grows), and read for the job's state: recovering, re-attached."""

    def __init__(self, job: "JobRunner"):
        self.job, self.buf, self.lock = job, bytearray(), threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self.lock:
            self.buf += s.encode()
        for line in s.splitlines():
            self.job.on_line(line)
        return len(s)

    def note(self, m: str) -> None:
        self.write(f"[tpuctl] {m}\n")

    def data(self) -> bytes:
        with self.lock:
            return bytes(self.buf)


class JobRunner(threading.Thread):
    """One job, from the controller's pick-up to its end."""

    def __init__(self, ctl: "Controller", job_id: str):
        super().__init__(daemon=True, name=f"job-{job_id}")
        self.ctl, self.id, self.store = ctl, job_id, ctl.store
        self.spec = self.store.spec(job_id)
        self.st = self.store.state(job_id) or initial_state(self.spec)
        self.events = self.store.events(job_id)
        self.log = JobLog(self)
        self.log.buf += (self.store.logs(job_id).get("controller.log") or b"")
        self.lock = threading.RLock()
        self.cancel: dict | None = None
        self.done = threading.Event()       # the job's record is final
        self.ended = threading.Event()      # its run has ended: stop copying
        self.seen_run_ids: set[str] = set()
        # The attempts earlier controllers of this job recorded (a replaced controller's): its goodput counts them.
        # One that was still going when its controller stopped writing (IN_PROGRESS) ended unseen: unfinished.
        self.prior: list[dict] = [{**a, "outcome": "unfinished"} if a["outcome"] in IN_PROGRESS else a
                                  for a in self.st.get("attempts") or []]
        # This controller's attempts as supervise told them when each ended, and the one going on now as this
        # controller watches it (`live`: written with each sync, so a controller that dies mid-attempt leaves the
        # time it watched in the record, productive or lost, for the next one to count).
        self.mine: list[dict] = []
        self.live: dict | None = None if self.spec.get("kind") == "sweep" else {"since": time.time(),
                                                                                "recovering": False}
        # A job that was going when its last controller stopped writing: the stretch from that controller's last
        # write to this one's first attempt was watched by nobody. What it was (the run going on, or the slice
        # being recovered) is told by how this controller picks the job up (on_line), and goes into goodput so.
        self.unwatched_since = self.st.get("updated") if self.st["state"] in ("RUNNING", "RECOVERING") else None
        self.pickup = "starting"     # running | recovering, once the pick-up says which
        self.unwatched: dict | None = None

    # ---- the record
    def event(self, text: str) -> None:
        with self.lock:
            self.events.append({"at": time.time(), "text": text, "controller": self.ctl.host})
            self.store.put_events(self.id, self.events)

    def set(self, **kw) -> None:
        with self.lock:
            changed = {k: v for k, v in kw.items() if self.st.get(k) != v}
            if not changed:
                return
            self.st.update(changed)
            self.store.put_state(self.id, self.st)
        if "state" in changed:
            self.event(f"state {changed['state']}" + (f": {kw['message']}" if kw.get("message") else ""))

    def on_line(self, line: str) -> None:
        if _BEFORE_RUN.search(line):
            self.pickup = "recovering"
            if self.live is not None:
                self.live["recovering"] = True
        if _READY_AGAIN.search(line) and self.live is not None:
            self.live["ready"] = time.time()
        if m := _RECREATING.search(line):
            # Counted job-wide by supervise (RunOptions.restarts_used); pending until the slice is READY again,
            # so a controller that dies in between leaves the next one to finish it as the same restart.
            self.set(state="RECOVERING", recoveries=int(m.group(1)), restart_pending=True)
        elif _READY_AGAIN.search(line):
            self.set(restart_pending=False)
        elif m := _TRIAL.search(line):
            self.set(message=f"trial {m.group(1)}/{m.group(2)}: {m.group(3)}")
        elif m := _FOLLOWING.search(line):
            self.pickup = "running"
            self.set(run_id=m.group(1))
            self.event(f"re-attached to run {m.group(1)}, still going on the hosts")
        elif m := _ENDED.search(line):
            self.pickup = "running"
            self.set(run_id=m.group(1))
            self.event(f"run {m.group(1)} ended while no controller followed it: its end read from the hosts")

    def _run_dirs(self) -> list[Path]:
        base = state.home() / "runs" / self.spec["slice_name"]
        return sorted((d for d in base.glob("*") if d.is_dir() and d.stat().st_mtime >= self.ctl.started - 5),
                      key=lambda d: d.stat().st_mtime) if base.is_dir() else []

    def sync(self) -> None:
        """Copy the logs to the bucket, and read the step, the run id and the slice's record from here."""
        from orchestrator.jobs.supervise import latest_step
        self.store.put_log(self.id, "controller.log", self.log.data())
        dirs = self._run_dirs()
        for d in dirs[-2:]:
            for f in d.glob("*.log"):
                if _HOST_LOG.fullmatch(f.name):
                    self.store.put_log(self.id, f"{d.name}/{f.name}", f.read_bytes())
        if dirs:
            run = dirs[-1]
            step = latest_step(run)
            upd = {"run_id": run.name}
            if step is not None:
                upd["step"] = step
                if self.st["state"] in ("STARTING", "RECOVERING") and run.name not in self.seen_run_ids:
                    upd["state"] = "RUNNING"
                    self.seen_run_ids.add(run.name)
            self.set(**upd)
        with self.lock:
            if self.live is not None:
                if dirs:
                    self._watch_live(dirs[-1], step)
                self.set(attempts=merged_attempts(self.prior, [*self.mine, self._live_attempt(self.live)],
                                                  self.ctl.host))
        rec = state.lookup(self.spec["slice_name"])
        if rec is not None and rec.to_json() != self.ctl.slice_json.get(self.id):
            self.ctl.slice_json[self.id] = rec.to_json()
            self.store.put_slice(self.id, rec.to_json())

    def cancelled(self) -> bool:
        return self.cancel is not None

    def _unwatched_before(self, start: float) -> None:
        """The stretch nobody watched before this controller's first attempt, which began at `start`."""
        if self.unwatched_since is not None and self.unwatched is None:
            self.unwatched = {"unwatched_s": max(0.0, start - self.unwatched_since),
                              # the job was going but its run is run again: what it did meanwhile is lost
                              "unwatched": self.pickup if self.pickup != "starting" else "recovering"}

    def record_attempts(self, mine: list[dict]) -> None:
        """supervise's attempts so far under this controller, kept in the job's record after the earlier ones.
        The first carries the stretch nobody watched before it (unwatched_s), as the pick-up found it. After a
        preemption the next stretch, the slice's recovery, is watched live."""
        with self.lock:
            if mine:
                self._unwatched_before(time.time() - mine[0]["wall_s"])  # told as the attempt ends
            if self.unwatched:
                mine = [{**mine[0], **self.unwatched}, *mine[1:]]
            self.mine = mine
            if self.live is not None:
                more = bool(mine) and mine[-1]["outcome"] == "preempted"
                self.live = {"since": time.time(), "recovering": True} if more else None
            self.set(attempts=merged_attempts(self.prior, mine, self.ctl.host))

    def _watch_live(self, run: Path, step: int | None) -> None:
        """The run of the attempt going on: its id, and when a step was first and last seen (sync's clock)."""
        live = self.live
        if live is None or run.name in {a.get("run_id") for a in self.mine} or \
                run.stat().st_mtime < live["since"] - 5:  # an earlier attempt's run
            return
        now = time.time()
        live.setdefault("began", live.get("ready") or live["since"])
        live["run"] = run
        if step is not None:
            live.setdefault("first", (step, now))
            if live.get("last", (None,))[0] != step:
                live["last"] = (step, now)

    def _live_attempt(self, live: dict) -> dict:
        """The attempt going on, as supervise would record it had it ended now (supervise._attempt's fields):
        recovering its slice (recover_s) until the slice is READY again, then start-up until the first step seen,
        steps until the last, and the tail since. Its outcome says it is IN_PROGRESS."""
        from orchestrator.jobs.supervise import resumed_from
        now = time.time()
        if self.unwatched is None and not self.mine:
            self._unwatched_before(live["since"])
        begun = live.get("began") or live.get("ready") or (None if live.get("recovering") else live["since"])
        a = {"outcome": "running" if begun is not None else "recovering", "run_id": None, "resumed_from": None,
             "last_step": None, "recover_s": (begun if begun is not None else now) - live["since"],
             "wall_s": 0.0, "startup_s": 0.0, "steps_s": 0.0, "tail_s": 0.0, "step_s": 0.0}
        if begun is not None:
            a["wall_s"] = a["startup_s"] = now - begun
        if run := live.get("run"):
            a.update(run_id=run.name, resumed_from=resumed_from(run))
        if "first" in live:
            (s0, t0), (s1, t1) = live["first"], live["last"]
            a.update(last_step=s1, startup_s=t0 - begun, steps_s=t1 - t0, tail_s=now - t1,
                     step_s=(t1 - t0) / (s1 - s0) if s1 > s0 else 0.0)
        if self.unwatched and not self.mine:
            a.update(self.unwatched)
        return a

    def job_goodput(self) -> dict | None:
        """Where the job's wall time went, from its start to now, over every attempt any of its controllers watched
        (a stretch no controller watched counts as what it was: the run going on, or its slice recovered)."""
        from orchestrator.jobs.supervise import goodput
        attempts = self.st.get("attempts") or []
        if not attempts:
            return None
        wall = time.time() - self.st["started"] if self.st.get("started") else sum(a["wall_s"] for a in attempts)
        return goodput(attempts, wall)

    # ---- the job
    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - whatever it was, the job's record says so
            self.log.note(f"controller error: {e}")
            traceback.print_exc()
            try:
                self._close_live("FAILED")
            except Exception:  # noqa: BLE001 - the bucket too: the state below says what it can
                pass
            self._finish("FAILED", f"controller error: {e}")
        finally:
            self.done.set()

    def _run(self) -> None:
        from orchestrator.jobs import attached
        from orchestrator.jobs.runner import RunFailed
        from orchestrator.spec import UserError
        from orchestrator.state import SliceRecord
        spec = self.spec
        rec = SliceRecord.from_json(self.store.slice(self.id))
        rec.claim = ""
        state.save(rec)  # the controller's own record of the slice: what recovery recreates
        self.ctl.slice_json[self.id] = rec.to_json()
        self.cancel = self.store.cancel_request(self.id)
        going = self.st["state"] in ("RUNNING", "RECOVERING")
        self.event(f"taken by the controller on {self.ctl.host}" + (" (the job was going: re-attaching)" if going
                                                                    else ""))
        if self.cancel:
            started = self.st["state"] != "PENDING"
            if started:  # cancelled while no controller was alive: its run may still be going on the hosts
                self._stop_hosts()
            self._finish("CANCELLED", "cancelled" if started else "cancelled before it started")
            return
        if not going:
            self.set(state="STARTING", controller=self.ctl.host, controller_since=self.ctl.started,
                     started=time.time())
        else:
            self.set(controller=self.ctl.host, controller_since=self.ctl.started)
        prov = provider.of(rec)
        secrets = job_secrets.read(spec["secrets"], endpoint=prov.secrets_endpoint(),
                                   credentials=prov.secrets_credentials(self.ctl.member)) if spec.get("secrets") else {}
        run = spec.get("kind") != "sweep"  # a sweep's trials each have --max-restarts of their own
        # A job that was going follows its run where the hosts still know it (re-attach, or its end read there)
        # rather than running the command again.
        opts = attached.RunOptions(**spec["opts"], secrets=secrets, plan=False, bundle=self._bundle(),
                                   cancelled=self.cancelled, follow_run=self.st.get("run_id") if going else None,
                                   on_attempt=self.record_attempts if run else None,
                                   restarts_used=int(self.st.get("recoveries") or 0) if run else 0,
                                   restart_pending=bool(self.st.get("restart_pending")) if run and going else False)
        syncer = threading.Thread(target=self._sync_loop, daemon=True, name=f"sync-{self.id}")
        syncer.start()
        try:
            if spec.get("kind") == "sweep":
                outcome, msg, extra = self._sweep(opts)
            else:
                res = attached.run(spec["slice_name"], spec["command"], self.ctl.flags, opts, out=self.log,
                                   note=self.log.note)
                outcome, msg, extra = "SUCCEEDED", f"done in {res.timings.get('total_s', 0):.0f} s", \
                    {"goodput": self.job_goodput() or res.goodput, "run_id": res.run_id}
        except (RunFailed, UserError, OSError) as e:  # UserError: a preemption past the budget (Preempted) too
            outcome, msg, extra = ("CANCELLED", "cancelled", {}) if self.cancel else ("FAILED", str(e), {})
            if g := self.job_goodput():
                extra["goodput"] = g
        self.ended.set()
        syncer.join(10)
        self.sync()
        self._close_live(outcome)
        if "goodput" in extra:
            extra["goodput"] = self.job_goodput() or extra["goodput"]
        self._finish(outcome, msg, **extra)

    def _close_live(self, outcome: str) -> None:
        """The run ended with an attempt supervise did not tell (a failure before the run, a cancel): the time
        watched stays in the record under the job's outcome; a recovery that never began a run goes."""
        with self.lock:
            live, self.live = self.live, None
            if live is None:
                return
            ran = live.get("began") or live.get("ready") or not live.get("recovering")
            last = [{**self._live_attempt(live), "outcome": outcome.lower()}] if ran else []
            self.set(attempts=merged_attempts(self.prior, [*self.mine, *last], self.ctl.host))

    def _sweep(self, opts) -> tuple[str, str, dict]:
        """`tpuctl sweep`'s job: each unfinished trial of the grid in turn, as the attached sweep runs them, then
        its report."""
        from orchestrator.jobs import attached
        from orchestrator.jobs import sweep as S
        from orchestrator.jobs.runner import RunFailed

        def trial(argv: list[str]) -> tuple[int, dict]:
            try:
                r = attached.run(self.spec["slice_name"], argv, self.ctl.flags, opts, out=self.log, note=self.log.note)
            except RunFailed as e:
                r = e.result
            if self.cancel:  # the sweep stops as on Ctrl-C: the trial is recorded interrupted
                return 130, {"run_dir": str(r.run_dir)}
            return r.returncode, {"run_dir": str(r.run_dir), "failed_worker": r.failed_worker,
                                  "exit_codes": {str(k): v for k, v in r.exit_codes.items()},
                                  "returncode": r.returncode}

        sw, name = self.spec["sweep"], self.spec["slice_name"]
        res = S.sweep(name, sw["grid_args"], sw["out"], self.spec["command"], run_trial=trial, say=self.log.note,
                      report=False)
        if self.cancel:
            return "CANCELLED", "cancelled", {}
        # The report goes beside the sweep, in its bucket: nothing of the job stays on the controller's disk.
        env = S.here_env(provider.of(state.lookup(name)), sw["out"])
        rep = json.loads(S.run_trainer(["report", "--json", "--ckpt-dir", sw["out"], "--out",
                                        f"{sw['out'].rstrip('/')}/report"], env))
        res.report = rep
        self.log.note(f"report: {rep['html']}")
        return ("SUCCEEDED" if res.returncode == 0 else "FAILED"), S.summary(res), \
            {"trials": [t.__dict__ for t in res.trials], "report": rep["html"]}

    def _finish(self, outcome: str, msg: str, **extra) -> None:
        if self.cancel and self.cancel.get("down"):
            from orchestrator import slices
            try:
                slices.delete(self.spec["slice_name"], progress=self.log.note)
                msg += f"; slice {self.spec['slice_name']} deleted"
            except Exception as e:  # noqa: BLE001 - the cancel stands; say what is left
                msg += f"; deleting slice {self.spec['slice_name']} failed: {e}"
        self.set(**extra)
        self.set(state=outcome, message=msg[-2000:], ended=time.time())
        self.store.put_log(self.id, "controller.log", self.log.data())
        if self.spec.get("secrets"):
            rec = state.lookup(self.spec["slice_name"])
            prov = provider.of(rec) if rec else self.ctl.prov
            try:
                job_secrets.drop(self.spec["secrets"], endpoint=prov.secrets_endpoint(),
                                 credentials=prov.secrets_credentials(None))
            except Exception as e:  # noqa: BLE001 - a secret left behind is named, not fatal
                self.event(f"could not delete the job's secrets: {e}")

    def _sync_loop(self) -> None:
        while not self.ended.wait(self.ctl.sync_s):
            try:
                if self.cancel is None and (c := self.store.cancel_request(self.id)) is not None:
                    self.cancel = c
                    self.event("cancel requested: stopping every host")
                    threading.Thread(target=self._stop_hosts, daemon=True).start()
                self.sync()
            except Exception as e:  # noqa: BLE001 - the bucket or the hosts hiccup: next round
                print(f"[controller] {self.id}: sync: {e}", file=sys.stderr, flush=True)

    def _stop_hosts(self) -> None:
        from orchestrator.jobs import attached
        try:
            attached.cancel(self.spec["slice_name"], self.ctl.flags, note=self.log.note, grace=10.0)
        except Exception as e:  # noqa: BLE001 - no run going (between attempts): the cancel check stops the next
            self.log.note(f"cancel: {e}")

    def _bundle(self) -> B.Bundle | None:
        if self.spec["opts"].get("raw"):
            return None
        b = self.spec["bundle"]
        d = state.home() / "bundles" / b["hash"]
        wheel = d / b["uri"].rsplit("/", 1)[-1]
        if not wheel.exists():
            d.mkdir(parents=True, exist_ok=True)
            tmp = wheel.with_suffix(".part")
            self.store.bucket.blob(b["uri"].split("/", 3)[3]).download_to_filename(str(tmp))
            os.replace(tmp, wheel)
        return B.Bundle(hash=b["hash"], wheel=wheel, requirements=b["requirements"], no_deps=b["no_deps"],
                        has_workdir=b["has_workdir"])


class Controller:
    def __init__(self, store: JobStore, where: V.Where, prov: provider.Provider, poll_s: float = 2.0,
                 sync_s: float = 3.0, flags=None):
        from orchestrator.access.reach import SshFlags
        self.store, self.where, self.prov, self.poll_s, self.sync_s = store, where, prov, poll_s, sync_s
        # How it reaches its jobs' hosts: by each slice's name, through its record and the TPU API (SshFlags();
        # tests/test_run.py gives a 3-host local slice's --hosts instead).
        self.flags = flags or SshFlags()
        self.host = socket.gethostname()
        self.started = time.time()
        self.runners: dict[str, JobRunner] = {}
        self.finished: set[str] = set()
        self.slice_json: dict[str, dict] = {}
        boot = store.heartbeat(where.region) or {}
        self.boot = {k: boot[k] for k in ("bundle_uri", "project", "zone", "provider", "service_account",
                                          "idle_minutes") if k in boot}
        try:
            self.sa_email = _instance_sa(where)
        except Exception:  # noqa: BLE001 - not on its VM (or the API hiccups): the secrets say so if it matters
            self.sa_email = None
        self.member = f"serviceAccount:{self.sa_email}" if self.sa_email else None

    def live(self) -> list[str]:
        """The live jobs of the bucket, each with a runner here (started for those no runner has yet)."""
        out = []
        for jid in self.store.job_ids():
            if jid in self.finished:
                continue
            r = self.runners.get(jid)
            if r is not None:
                if r.done.is_set():
                    self.finished.add(jid)
                else:
                    out.append(jid)
                continue
            st = self.store.state(jid)
            if st is not None and st["state"] not in LIVE:
                self.finished.add(jid)
                continue
            if self.store.spec(jid) is None:  # being submitted: its spec is the last thing written
                continue
            self.runners[jid] = r = JobRunner(self, jid)
            r.start()
            out.append(jid)
        return out

    def beat(self, live: list[str], idle_since: float | None, **extra) -> None:
        self.store.put_heartbeat(self.where.region, {**self.boot, "host": self.host, "pid": os.getpid(),
                                                     "started": self.started, "jobs": live, "idle_since": idle_since,
                                                     "idle_minutes": self.where.idle_minutes,
                                                     "service_account_email": self.sa_email, **extra})

    def serve(self) -> int:
        idle_since: float | None = None
        while True:
            try:
                live = self.live()
            except Exception as e:  # noqa: BLE001 - the bucket hiccups: the jobs go on; try again
                print(f"[controller] listing jobs: {e}", file=sys.stderr, flush=True)
                time.sleep(self.poll_s)
                continue
            now = time.time()
            idle_since = None if live else (idle_since or now)
            if idle_since is not None and now - idle_since >= self.where.idle_minutes * 60:
                self.beat([], idle_since, stopping=True)
                print(f"[controller] idle for {self.where.idle_minutes:g} minute(s): deleting {self.where.name}",
                      flush=True)
                V.delete(self.where, wait=False)
                return 0
            self.beat(live, idle_since)
            time.sleep(self.poll_s)


def merged_attempts(prior: list[dict], mine: list[dict], host: str) -> list[dict]:
    """A job's attempts across its controllers: those earlier ones recorded, then this one's (host), numbered on.
    This controller's first attempt after an earlier one's preemption counts the steps it redid, as supervise
    counts them between its own attempts (an attempt before it that never reached a run is passed over: the
    recovery its controller died in)."""
    from orchestrator.jobs.supervise import steps_redone
    out = [dict(a) for a in prior]
    for a in mine:
        a = {**a, "attempt": len(out) + 1, "controller": host}
        ran = [b for b in out if b.get("run_id") is not None or b["outcome"] not in ("unfinished", *IN_PROGRESS)]
        if "steps_redone" not in a and (redone := steps_redone(ran[-1] if ran else None, a)) is not None:
            a["steps_redone"] = redone
        out.append(a)
    return out


def _instance_sa(where: V.Where) -> str | None:
    """The service account the VM runs as (the API resolves "default" to the project's)."""
    inst_c, _ = V._clients(where.endpoint)  # noqa: SLF001 - the same client the VM module uses
    i = inst_c.get(project=where.project, zone=where.zone, instance=where.name, timeout=30)
    return i.service_accounts[0].email if i.service_accounts else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.jobs.controller", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--project", required=True)
    ap.add_argument("--zone", required=True)
    ap.add_argument("--provider", default=provider.GCP)
    ap.add_argument("--idle-minutes", type=float, default=10.0)
    ap.add_argument("--poll-s", type=float, default=2.0)
    a = ap.parse_args(argv)
    prov = provider.get(a.provider)
    os.environ.update(prov.storage_env(a.bucket))
    where = V.Where(a.project, a.zone, a.bucket, prov.kind, prov.compute_endpoint(), idle_minutes=a.idle_minutes)
    ctl = Controller(JobStore(a.bucket), where, prov, poll_s=a.poll_s)
    print(f"[controller] {where.name} on {ctl.host} serving gs://{a.bucket} ({where.region}); idle after "
          f"{a.idle_minutes:g} minute(s)", flush=True)
    return ctl.serve()


if __name__ == "__main__":
    sys.exit(main())
