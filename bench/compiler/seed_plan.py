"""The seed's train step (bench/seed_gpt2.py) compiled ahead of time for a TPU topology, as `tpuctl plan` compiles
ours: libtpu on this machine, abstract inputs, no TPU. Prints one JSON object with the same per-device figures
trainer/common/aot.py gives (memory analysis; flops and bytes accessed: the seed's step has no loop, so the
compiler's count is the whole step).

    python -m bench.compiler.seed_plan --tpu v5e:2x4 [--batch-size 64 --seq-len 1024]

The seed as its notebook ran it on TPU: GPT-2 124M (12 layers, width 768, 12 heads, the 50257 vocabulary),
bf16 compute over f32 parameters, its params and AdamW state replicated on every device (its sharding
annotations are never applied), the batch split over the devices.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compiler.seed_plan", description=__doc__.splitlines()[0])
    p.add_argument("--tpu", required=True, metavar="GEN:TOPOLOGY", help="libtpu topology, e.g. v5e:2x4, v6e:2x4")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--host-bounds", default="2,4,1")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from trainer.common import aot
    opts = argparse.Namespace(devices=a.devices, processes=1, num_slices=1, tpu=a.tpu, chip_config="default",
                              host_bounds=a.host_bounds, fallback_cpu=False, run_platform="tpu")
    target = aot.target(opts)  # libtpu's devices for the topology (jax set up for an AOT compile)

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bench import seed_gpt2 as seed
    cfg = seed.SeedConfig(n_layer=12, d_model=768, n_head=12, seq_len=a.seq_len, batch_size=a.batch_size,
                          dtype=jnp.bfloat16)
    n = len(target.devices)
    mesh = jax.make_mesh((n, 1), ("batch", "model"), devices=target.devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def build():
        with nnx.use_eager_sharding(False):
            model = seed.GPT2(cfg, rngs=nnx.Rngs(0))
        tx = optax_adamw(cfg)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.metrics.Average("loss")
    graphdef, state = nnx.split(nnx.eval_shape(build))
    rep = NamedSharding(mesh, P())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32, sharding=NamedSharding(mesh, P("batch")))

    def step(state, x, y):  # the notebook's train_step on the objects it updates in place
        model, optimizer, metrics = nnx.merge(graphdef, state)
        seed.train_step(model, optimizer, metrics, (x, y))
        return nnx.state((model, optimizer, metrics))

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=0, out_shardings=rep).lower(abstract, tokens, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = aot._cost(compiled)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)))
    print(json.dumps({
        "step": "seed", "device_kind": target.devices[0].device_kind, "devices": n, "compile_s": round(compile_s, 2),
        "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
        "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "counted": "loop bodies once" if aot.has_loop(compiled) else "program", "n_params": int(n_params),
        "tokens_per_step": cfg.batch_size * cfg.seq_len}))
    return 0


def optax_adamw(cfg):
    """The notebook's optimizer: AdamW with cosine decay."""
    import optax
    schedule = optax.cosine_decay_schedule(init_value=cfg.lr, decay_steps=cfg.max_steps)
    return optax.chain(optax.adamw(learning_rate=schedule, weight_decay=cfg.weight_decay))


if __name__ == "__main__":
    sys.exit(main())
