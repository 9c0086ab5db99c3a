"""`python -m bench.peers.gemma_lora`: a LoRA train step's tokens/s, ours (trainer/finetune/train.py) vs tunix's
PeftTrainer step with qwix LoRA, on the same Gemma 2 config, mesh (4x2 of emulated CPU devices), batch and targets.

Each contender runs in its own process (`python -m bench.peers.gemma_lora worker KIND`) and is compiled and warmed
up before timing; the parent alternates them: it writes a step count on stdin and the worker answers the
wall seconds those steps took. Also prints the share of a same-run f32 matmul peak our step reaches, with
LoRA training FLOPs = 4 N_base (forward + input gradients; the frozen base gets no weight gradient) +
6 N_lora per token + 12 L T D attention. Shared machine: read the ratio, not the values.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

B, T, RANK, ALPHA = 8, 128, 8, 16.0
CFG = dict(family="gemma2", vocab=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ff=1024,
           sliding_window=64, query_pre_attn_scalar=64.0)
# The projections both sides adapt: attention q, k, v, o and the MLP's three.
OURS_TARGETS = "all"
TUNIX_PATH = ".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|.*down_proj"


def _emulate() -> None:
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _batch():
    import numpy as np
    rng = np.random.default_rng(0)
    return rng.integers(4, CFG["vocab"], (B, T)).astype(np.int32)


def ours():
    """(one step, facts) of our LoRA step."""
    import jax
    import numpy as np

    from trainer.finetune import train as finetune
    from trainer.common import mesh as mesh_lib
    from trainer.finetune.config import LoraRun
    from trainer.models import gemma, lora as lora_lib
    cfg = gemma.GemmaConfig(**CFG)
    mesh = mesh_lib.make_mesh({"data": 4, "model": 2})
    run = LoraRun(weights="", data="", ckpt_dir="unused", rank=RANK, alpha=ALPHA, targets=OURS_TARGETS,
                  seq_len=T, batch_size=B, dtype="float32", base_dtype="float32", lr=1e-4)
    sh = gemma.shardings(cfg, mesh)
    base = {k: jax.device_put(v, sh[k]) for k, v in gemma.random_params(cfg, 0).items()}
    steps = finetune.Steps(run, cfg, mesh, 1000, B)
    base = steps.place_base(base)  # as the run holds it (the embedding by its vocab rows)
    steps.compile(base)
    state = list(steps.init())
    toks = _batch()
    local = {"inputs": toks, "targets": np.roll(toks, -1, 1), "weights": np.ones((B, T), np.float32),
             "segments": np.ones((B, T), np.int32), "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))}
    count = [0]

    def step():
        count[0] += 1
        state[0], state[1], out = steps.step(state[0], state[1], base, local, count[0])
        return out["loss"]
    n_base = gemma.count_params(cfg)
    return step, {"n_lora": lora_lib.count(cfg, steps.lc), "n_base": n_base}


def tunix():
    """(one step, facts) of tunix's PeftTrainer train step on a qwix-LoRA Gemma 2, sharded by its rules."""
    import jax
    import jax.numpy as jnp
    import optax
    import qwix
    from flax import nnx
    from tunix.models.gemma import model as tm
    from tunix.sft import peft_trainer

    c = CFG
    types = tuple(tm.AttentionType.LOCAL_SLIDING if i % 2 == 0 else tm.AttentionType.GLOBAL
                  for i in range(c["n_layers"]))
    tcfg = tm.ModelConfig(num_layers=c["n_layers"], num_embed=c["vocab"], embed_dim=c["d_model"],
                          hidden_dim=c["ff"], num_heads=c["n_heads"], head_dim=c["head_dim"],
                          num_kv_heads=c["n_kv_heads"], final_logit_softcap=30.0, use_post_attn_norm=True,
                          use_post_ffw_norm=True, attention_types=types, attn_logits_soft_cap=50.0,
                          sliding_window_size=c["sliding_window"])
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    toks = jnp.asarray(_batch())
    positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))
    with jax.set_mesh(mesh):
        base = tm.Gemma(tcfg, rngs=nnx.Rngs(0))
        provider = qwix.LoraProvider(module_path=TUNIX_PATH, rank=RANK, alpha=ALPHA)
        model = qwix.apply_lora_to_model(base, provider, toks, positions, None, mask, rngs=nnx.Rngs(1))
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    cfg = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
    trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-4), cfg)
    with mesh:  # the trainer shards its optimizer state by the mesh of this context, as its train() does
        step_fn, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)  # its fastest path
    inputs = {"input_tokens": toks, "input_mask": jnp.ones((B, T), bool), "positions": positions,
              "attention_mask": mask}
    n_lora = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))

    def step():
        with mesh:
            loss, _, _ = step_fn(inputs)
        return loss
    return step, {"n_lora": int(n_lora)}


def worker(kind: str, n_layers: int) -> int:
    _emulate()
    CFG["n_layers"] = n_layers
    step, facts = {"ours": ours, "tunix": tunix}[kind]()
    for _ in range(2):  # compile (tunix) and warm up
        float(step())
    print(json.dumps({"ready": True, **facts}), flush=True)
    for line in sys.stdin:
        n = int(line)
        t0 = time.perf_counter()
        for _ in range(n):
            out = step()
        float(out)  # waits for the last step (each step depends on the one before)
        print(f"{time.perf_counter() - t0:.6f}", flush=True)
    return 0


def main(rounds: int = 3, per_round: int = 3, n_layers: int = CFG["n_layers"]) -> int:
    """n_layers: the config's depth (the suite's smoke run takes 1: every adapter is per layer, so the counts
    scale with it, and the compiles are a quarter)."""
    _emulate()
    CFG["n_layers"] = n_layers
    procs = {k: subprocess.Popen([sys.executable, "-m", "bench.peers.gemma_lora", "worker", k, str(n_layers)],
                                 stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=os.environ.copy()) for k in ("ours", "tunix")}
    try:
        facts = {}
        for k, p in procs.items():
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"the {k} worker died before it was ready")
            facts[k] = json.loads(line)
        times = {k: [] for k in procs}
        for _ in range(rounds):
            for k, p in procs.items():
                p.stdin.write(f"{per_round}\n")
                p.stdin.flush()
                times[k].append(float(p.stdout.readline()) / per_round)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=60)
    from bench.peers.peak import MatmulPeak, median
    peak = max(MatmulPeak().sample().values())
    tps = {k: B * T / median(v) for k, v in times.items()}
    n_base, n_lora = facts["ours"]["n_base"], facts["ours"]["n_lora"]
    flops = 4.0 * n_base + 6.0 * n_lora + 12.0 * CFG["n_layers"] * T * CFG["d_model"]
    print(f"LoRA rank {RANK} on q,k,v,o,gate,up,down of a Gemma 2 (L{CFG['n_layers']} D{CFG['d_model']} "
          f"V{CFG['vocab']}), batch {B} x {T}, mesh 4x2 CPU devices, f32, median of {rounds} rounds x {per_round}")
    print(f"  adapter params: ours {n_lora:,}, tunix+qwix {facts['tunix']['n_lora']:,}")
    print(f"  ours {tps['ours']:9.0f} tok/s   tunix PeftTrainer+qwix {tps['tunix']:9.0f} tok/s   "
          f"ratio {tps['ours'] / tps['tunix']:.2f}x")
    print(f"  ours reaches {100 * tps['ours'] * flops / peak:.1f}% of a same-run f32 matmul peak "
          f"({peak / 1e9:.0f} GFLOP/s)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        sys.exit(worker(sys.argv[2], int(sys.argv[3])))
    sys.exit(main())
