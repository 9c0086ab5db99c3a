"""What the slice verbs share: progress callbacks and durations in words."""
from __future__ import annotations

from typing import Callable

Progress = Callable[[str], None]

# FAILED and SUSPENDED queued resources keep counting against the project's TPU quota until someone deletes them.
HOLDS_QUOTA = ("FAILED", "SUSPENDED")


def noop(_: str) -> None:
    pass


def fmt_duration(s: float) -> str:
    if s < 10:
        return f"{s:.1f}s"
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
