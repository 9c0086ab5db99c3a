"""The train step's loops (lax.scan), and the switch that unrolls them for counting.

The TPU compiler's cost analysis counts a while loop's body once, whatever its trip count: a step whose loss
is chunked (--loss-chunk) or whose gradient accumulates over micro-batches (--grad-accum) reports a fraction of
its work. A plan counts the whole step from a twin of it whose loops are unrolled (`unrolled()`), compiled only
for its cost analysis (trainer/common/aot.py). The twin is the same computation written out: every chunk and
micro-batch appears once in the program, so its flops and bytes are the loop's times its trip count. The run
itself always keeps the loops (one body to compile, one chunk's buffers alive at a time).

Every loop of a train step goes through `scan` here, read when the step is traced.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax

_UNROLLED = contextvars.ContextVar("tpuctl_scans_unrolled", default=False)


def scan(f, init, xs, length: int | None = None):
    """jax.lax.scan, unrolled whole inside `unrolled()`."""
    return jax.lax.scan(f, init, xs, length=length, unroll=True if _UNROLLED.get() else 1)


@contextlib.contextmanager
def unrolled():
    """Steps traced inside this have every loop of `scan` written out (a twin for counting, never run)."""
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)
