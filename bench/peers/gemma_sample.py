"""`python -m bench.peers.gemma_sample`: Gemma greedy decoding tokens/s with the KV-cache loop vs full recompute.

The tiny random Gemma 2 / Gemma 3 of the tests (and a wider one), 8 emulated CPU devices on a 4x2 mesh,
f32, after one warm-up (compilation excluded), alternated rounds, median. Read the ratio, not the values.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(rounds: int = 3, n_new: int = 64) -> int:
    import dataclasses

    import jax

    from trainer.gemma import generate as gen
    from trainer.common import mesh as mesh_lib
    from trainer.models import gemma

    base = gemma.GemmaConfig("gemma2", vocab=96, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                             ff=96, sliding_window=4, query_pre_attn_scalar=16.0)
    models = {
        "gemma2 tiny (L4 D64)": base,
        "gemma3 tiny (L7 D64)": dataclasses.replace(base, family="gemma3", n_layers=7, n_kv_heads=1, ff=80),
        "gemma2 small (L8 D256 V4096)": dataclasses.replace(base, vocab=4096, d_model=256, n_layers=8, ff=1024,
                                                            head_dim=32, sliding_window=64),
    }
    mesh = mesh_lib.make_mesh({"data": 4, "model": 2})
    prompt = list(range(2, 18))
    print(f"greedy, prompt {len(prompt)} tokens, {n_new} new tokens, mesh 4x2 of CPU devices, f32, "
          f"median of {rounds} rounds")
    for name, cfg in models.items():
        sh = gemma.shardings(cfg, mesh)
        params = {k: jax.device_put(v, sh[k]) for k, v in gemma.random_params(cfg, 0).items()}
        sc = gen.SampleConfig(n_new)
        cached = lambda: gen.generate(cfg, params, prompt, sc, mesh=mesh)  # noqa: E731
        full = lambda: gen.generate_recompute(cfg, params, prompt, n_new, mesh=mesh)  # noqa: E731
        assert cached() == full()  # warm-up (compiles both) and the same tokens
        times = {"cache": [], "recompute": []}
        for _ in range(rounds):
            for label, fn in (("cache", cached), ("recompute", full)):
                t0 = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t0)
        tps = {k: n_new / statistics.median(v) for k, v in times.items()}
        print(f"  {name:30s} with cache {tps['cache']:8.1f} tok/s   full recompute {tps['recompute']:8.1f} tok/s"
              f"   ratio {tps['cache'] / tps['recompute']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
