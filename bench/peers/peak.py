"""A same-machine f32 "peak": the FLOP/s of a large matmul, and the model-FLOPs formula used against it."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


class MatmulPeak:
    """Compiled once; `sample()` times one 2048^3 f32 matmul each way and returns FLOP/s per way.

    `single`: one device's jnp.dot (XLA:CPU runs it on the shared intra-op thread pool, all cores).
    `sharded8`: A's rows split over all devices, B replicated: every emulated device multiplies its slice,
    the way a data-parallel step's matmuls run.
    """

    def __init__(self, n: int = 2048, reps: int = 3):
        self.n, self.reps = n, reps
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        dev = jax.devices()
        self.ways = {"single": (jax.device_put(a, dev[0]), jax.device_put(b, dev[0]))}
        if len(dev) > 1 and n % len(dev) == 0:
            mesh = jax.make_mesh((len(dev),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
            self.ways[f"sharded{len(dev)}"] = (jax.device_put(a, NamedSharding(mesh, P("d", None))),
                                                jax.device_put(b, NamedSharding(mesh, P())))
        self.dot = jax.jit(jnp.dot)
        for x, y in self.ways.values():  # compile + warm up
            self.dot(x, y).block_until_ready()

    def sample(self) -> dict[str, float]:
        flops = 2.0 * self.n ** 3
        out = {}
        for name, (x, y) in self.ways.items():
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                self.dot(x, y).block_until_ready()
                ts.append(time.perf_counter() - t0)
            out[name] = flops / min(ts)  # best of reps: a peak, not an average
        return out


def model_flops_per_token(n_matmul_params: int, n_layer: int, seq_len: int, d_model: int) -> float:
    """PaLM-style (Chowdhery et al. 2022, app. B): 6*N + 12*L*T*D training FLOPs per token.

    N counts every parameter that takes part in a matmul, here all parameters except the position table
    (the tied token embedding counts: it is the output projection). 12*L*T*D is the attention score and
    value matmuls (forward + backward), counted in full, not halved for the causal mask.
    """
    return 6.0 * n_matmul_params + 12.0 * n_layer * seq_len * d_model


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")
