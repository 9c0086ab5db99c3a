"""Keep freed host memory in the process for the next step (glibc), for runs on the CPU backend.

XLA:CPU allocates each device's temporary buffer afresh at every execution: for the bench config that is
209 MB per device (the [vocab slice, tokens] logits). glibc serves any allocation over 32 MB with a fresh
mmap and unmaps it on free, and allocations of threads other than the main one come from 64 MB arenas that
cannot hold such a buffer either. So every step the kernel page-faults and zero-fills all of it again:
measured ~430k page faults (1.7 GB) per step of ours, ~820k of the seed's (`make bench` prints the
setting's effect on the seed's step).
One arena, no mmap and no trimming make a freed buffer the next step's allocation instead. The cost is
that the process keeps its peak memory, which a training run reaches at every step anyway.
"""
from __future__ import annotations

import ctypes
import sys

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# A trim threshold of -1 disables trimming (mallopt(3)); 2**31 - 1 still let a free top over 2 GB go back.
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))


def keep_freed_memory() -> bool:
    """Apply the settings (before jax starts its threads, for the arena one to hold). True if applied:
    False off Linux/glibc, where the allocator is left as it is."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: musl has a mallopt that ignores everything
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
