"""What every section of the chip check shares: its settings, a row of the table, timing steps on the device."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax


@dataclass(frozen=True)
class Settings:
    quick: bool          # tiny sizes (a CPU check that the sections run; their figures mean nothing)
    out: str             # folder for the JSON, the trace and the runs' checkpoints
    peak: float | None   # bf16 FLOP/s of one device (trainer/common/chips.py), None off TPU
    hbm: float | None    # HBM bytes/s of one device
    device_kind: str
    pick: tuple = ()     # the choices section's alternatives whose names hold one of these (all when empty)
    rows: tuple = ()     # in every section, only the rows whose names hold one of these (all when empty; "=NAME":
    #                      that name exactly)
    trace: bool = False  # the LoRA rows also trace two of their steps (profile.row_trace), read by --summarize


    def wants(self, name: str) -> bool:
        """Whether the row of this name is to be measured in this run (asked before it is built)."""
        return wanted(name, self.rows)


def wanted(name: str, rows: tuple) -> bool:
    """Whether `--rows` (rows) choose the row of this name: all when none given; "=NAME" that name exactly, any
    other word a row whose name holds it."""
    return not rows or any(name == w[1:] if w.startswith("=") else w in name for w in rows)


def version_of(dist: str) -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def say(line: str) -> None:
    """A progress line of the check, at once (a run cut short by a time limit shows where it was)."""
    print(line, flush=True)


@dataclass
class Row:
    section: str
    name: str
    step_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    plan_s: float | None = None      # the plan's calibrated step time for the same step
    hbm_bytes: float | None = None   # the compiled step's HBM: arguments + outputs not aliased + temporaries
    compile_s: float | None = None
    ok: bool | None = None           # a check's verdict (None: a measurement, nothing to pass)
    note: str = ""
    figures: dict = field(default_factory=dict)

    @property
    def plan_error(self) -> float | None:
        return self.plan_s / self.step_s - 1 if self.plan_s and self.step_s else None


def time_steps(run, n: int, block) -> float:
    """Seconds per call of run() over n calls dispatched back to back, waited for once at the end (as the
    training loop keeps the device busy), after one warm-up call."""
    block(run())
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
        out = run()
    block(out)
    return (time.perf_counter() - t0) / n


def reps_for(seconds: float, budget: float = 2.0, low: int = 3, high: int = 20) -> int:
    return max(low, min(high, int(budget / max(seconds, 1e-4))))


def hbm_of(compiled) -> float | None:
    try:
        m = compiled.memory_analysis()
        return float(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                     + m.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis: the column stays empty
        return None


def block(x):
    return jax.block_until_ready(x)
