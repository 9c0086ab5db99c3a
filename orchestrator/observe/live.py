"""The run going on a slice's hosts, and a trainer command run beside its trainer on every host at once.

What runs beside is the trainer's own code (`python -m trainer hoststat|capture`) in the trainer's own
environment (hostwrap `beside`): the orchestrator never reads the trainer's flags or imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from orchestrator.access.hosts import Hosts
from orchestrator.access.reach import SshFlags, Target, reach
from orchestrator.jobs import launch as L
from orchestrator.jobs.runner import live_runs
from orchestrator.spec import UserError


@dataclass
class Beside:
    """One host's answer: exit status and output (rc None: the host did not answer; `error` says why)."""
    worker: str
    rc: int | None
    stdout: str = ""
    error: str = ""


@dataclass
class LiveRun:
    name: str
    run_id: str
    target: Target
    hosts: Hosts
    trainer: bool | None = None  # its command is `python -m trainer pretrain|lora` (None: the hosts cannot tell)

    def needs_trainer(self, verb: str, cannot: str) -> None:
        """One line, before anything runs beside it, when the run is not the trainer's (--raw, a script): `verb`
        reads what only the trainer measures and serves, so it would show nothing true."""
        if self.trainer is False:
            raise UserError(f"run {self.run_id} on {self.name} is not a trainer run (`tpuctl run {self.name} -- "
                            f"pretrain|lora ...`; this one is --raw or a script): {verb} cannot show {cannot}; "
                            f"`tpuctl logs {self.name} --follow` shows its output")

    def beside(self, args: list[str], timeout: float) -> list[Beside]:
        """`python ARGS` beside the trainer on every host at once; answers in worker (= process) order."""
        cmd = L.beside_command(self.hosts.layout, self.run_id, args, wrap_python="python3",
                               wrap_script=self.hosts.helpers[L.HOSTWRAP])
        out = []
        for w, r in zip(self.hosts.workers, self.hosts.each(lambda i, c: c.run(cmd, warn=True, timeout=timeout))):
            if isinstance(r, Exception):
                out.append(Beside(w.name, None, error=" ".join(str(r).split())[:300] or type(r).__name__))
            else:
                last = (r.stdout.strip().splitlines() or [""])[-1]
                err = [ln for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.startswith(("error:", "hostwrap:"))]
                out.append(Beside(w.name, r.exited, r.stdout, "" if r.exited == 0 else (err[-1] if err else last)))
        return out

    def close(self) -> None:
        self.hosts.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_live(name: str, flags: SshFlags = SshFlags(), note: Callable[[str], None] = lambda m: None) -> LiveRun:
    """Connect to slice NAME's workers and find its live run (the newest, should there be several); UserError
    with one line when none is going."""
    target = reach(name, flags, say=note)
    hosts = Hosts(target.workers, target.ssh)
    try:
        hosts.wait_reachable(note)
        hosts.ensure_helpers()
        runs = {r: d for r, d in live_runs(hosts).items() if d["running"]}
        if not runs:
            raise UserError(f"no live run on {name}: `tpuctl run {name} -- pretrain ...` starts one, "
                            f"`tpuctl logs {name}` shows the last one")
        run_id = max(runs, key=lambda r: runs[r].get("started") or 0)
    except BaseException:
        hosts.close()
        raise
    return LiveRun(name, run_id, target, hosts, runs[run_id].get("trainer"))
