"""The host memory of a plan's compile process, watched while it compiles (step.compile_figures polls it).

A written-out Gemma 4 step takes the compiler 17.7 GB of host memory (gemma4-e4b on v4-8, docs/gemma.md). On a
smaller machine, or beside other work, the kernel's OOM killer would end it, or something else, with no word of
why. So the plan keeps some of the machine's memory free (MemAvailable in /proc/meminfo, above `reserve`), and
optionally caps the compile's own resident memory; past either, the caller stops the compile's process group and
fails with `HostMemoryExceeded`'s one line. The compile is also the kernel's first choice should it run out anyway
(oom_score_adj). Linux only: elsewhere nothing is read and nothing is stopped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from orchestrator.spec import UserError

RESERVE_ENV = "TPUCTL_PLAN_RESERVE_MB"  # host memory a plan leaves free (default: RESERVE_SHARE of it, 1 GB or more)
MAX_RSS_ENV = "TPUCTL_PLAN_MAX_RSS_MB"  # most host memory a plan's compile may hold (default: no cap)
RESERVE_SHARE = 0.05
MIN_RESERVE = 10 ** 9
MB = 10 ** 6


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}
    except OSError:
        return {}


def _status(pid: int) -> dict[str, int]:
    """A process's VmRSS and VmHWM (its resident peak, kept by the kernel), in bytes ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in f)
                    if k in ("VmRSS", "VmHWM")}
    except (OSError, ValueError):
        return {}


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid` (the compile and anything it started)."""
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid:
                out.append(int(name))
    return out


def _mb(env: str) -> int | None:
    v = os.environ.get(env, "").strip()
    if not v:
        return None
    try:
        return int(float(v) * MB)
    except ValueError:
        raise UserError(f"{env}={v}: give megabytes, e.g. {env}=2048") from None


def gb(b: float) -> str:
    """Bytes as GB, to a tenth above 10 GB and a hundredth below (a cap of 150 MB reads 0.15 GB, not 0.2)."""
    return f"{b / 1e9:.1f} GB" if b >= 10e9 else f"{b / 1e9:.2f} GB"


class HostMemoryExceeded(Exception):
    """The compile reached the machine's limit (the caller names the step and stops it). by_cap: the user's own
    MAX_RSS_ENV stopped it, not the machine's free memory (the fix differs: the cap is theirs to raise)."""

    def __init__(self, message: str, by_cap: bool = False):
        super().__init__(message)
        self.by_cap = by_cap


@dataclass
class Watch:
    """One compile's memory: `attach` its process group, then `sample()` each poll; `peak_bytes` its resident peak
    so far."""
    reserve: int
    max_rss: int | None = None
    pgid: int = 0
    peak_bytes: int = 0

    @classmethod
    def from_env(cls) -> "Watch":
        """The thresholds from the environment (RESERVE_ENV, MAX_RSS_ENV: a bad one is a UserError, before any
        compile starts)."""
        reserve = _mb(RESERVE_ENV)
        if reserve is None:
            reserve = max(MIN_RESERVE, int(meminfo().get("MemTotal", 0) * RESERVE_SHARE))
        return cls(reserve, _mb(MAX_RSS_ENV))

    def attach(self, pgid: int) -> None:
        """Watch process group `pgid`, its leader made the OOM killer's first choice should memory run out before
        a sample sees it (raising one's own process's score needs no privilege)."""
        self.pgid = pgid
        try:
            with open(f"/proc/{pgid}/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass

    def sample(self) -> None:
        """Read the group's resident memory and the machine's available memory; HostMemoryExceeded past either
        threshold (the group is still running: the caller stops it)."""
        rss, hwm = 0, 0
        for pid in group_pids(self.pgid):
            s = _status(pid)
            rss += s.get("VmRSS", 0)
            hwm = max(hwm, s.get("VmHWM", 0))
        self.peak_bytes = max(self.peak_bytes, rss, hwm)
        info = meminfo()
        available, total = info.get("MemAvailable"), info.get("MemTotal", 0)
        machine = f"this machine has {gb(available)} of its {gb(total)} available" if available is not None else ""
        if self.max_rss is not None and rss > self.max_rss:
            raise HostMemoryExceeded(f"it reached {gb(rss)} of host memory, over the {gb(self.max_rss)} "
                                     f"{MAX_RSS_ENV} allows" + (f" ({machine})" if machine else ""), by_cap=True)
        if available is not None and available < self.reserve:
            raise HostMemoryExceeded(f"it reached {gb(rss)} of host memory and {machine}, under the "
                                     f"{gb(self.reserve)} a plan leaves free ({RESERVE_ENV})")
