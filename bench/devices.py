"""The bench's CPU devices: set before jax is imported (every bench entry point imports this first)."""
from __future__ import annotations

import os

COUNT_FLAG = "xla_force_host_platform_device_count"


def emulate(n: int) -> None:
    """n CPU devices, set before jax is imported; an inherited device-count flag wins."""
    flags = os.environ.get("XLA_FLAGS", "")
    if COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{COUNT_FLAG}={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
