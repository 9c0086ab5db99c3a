"""Gemma 4's experts under expert parallelism (trainer/models/moe.py) on the emulated CPU mesh: each device holds
only its experts, and the step gives the numbers of every expert on every device, forward and gradients,
LoRA adapters on the experts included."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _gemma_ckpt as gc
from trainer.common import mesh as mesh_lib
from trainer.finetune import train as finetune
from trainer.models import gemma, lora as lora_lib, moe

CFG = gc.TINY4["moe"]  # 8 experts, 2 a token
MESHES = [{"data": 8, "model": 1}, {"data": 4, "model": 2}, {"data": 1, "model": 8}]
LC = lora_lib.LoraConfig(4, 8, 0.0, ("q", "v") + lora_lib.EXPERTS)


def _trained(cfg, lc, seed=1):
    lora = lora_lib.init(cfg, lc, seed)
    return {n: (0.05 * jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), a.shape)
                if n.endswith(".b") else a) for i, (n, a) in enumerate(lora.items())}


def _batch(cfg, b=8, t=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"inputs": jnp.asarray(rng.integers(4, cfg.vocab, (b, t)), jnp.int32),
            "targets": jnp.asarray(rng.integers(4, cfg.vocab, (b, t)), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
            "segments": jnp.ones((b, t), jnp.int32), "weights": jnp.ones((b, t), jnp.float32)}


def test_the_expert_rule_places_each_devices_share_whole():
    lay = gemma.param_layout(CFG)
    for shape in ({"data": 8, "model": 1}, {"data": 4, "model": 2}):
        spec = mesh_lib.fitted_spec(lay["layers.0.experts_gating"][1], lay["layers.0.experts_gating"][0], shape)
        assert spec == jax.sharding.PartitionSpec(("data", "model"), None, None, None)  # 1 expert a device, whole
        assert moe.expert_axes(CFG.n_experts, shape) == ("data", "model")
    # experts that do not divide over the devices keep the fsdp / mlp sharding of their other dims
    spec = mesh_lib.fitted_spec(lay["layers.0.experts_linear"][1], (6, 24, 64), {"data": 4, "model": 2})
    assert spec == jax.sharding.PartitionSpec(None, "model", "data") and not moe.expert_axes(6, {"data": 4, "model": 2})
    a = lora_lib.param_layout(CFG, LC)["layers.0.expert_gate.a"]
    assert mesh_lib.fitted_spec(a[1], a[0], {"data": 4, "model": 2})[0] == ("data", "model")


def test_capacity_is_the_worst_case_when_dropless_and_bounded_otherwise():
    # 26B-A4B on 8 devices, 4 rows of 512 each: 16,384 tokens gathered, 16 experts a device
    assert moe.capacity_rows(16384, 8, 128, 8, 0.0) == 16384 * 8  # dropless: every token's 8 could land here
    assert moe.capacity_rows(16384, 8, 128, 8, 2.0) == 2 * 16384  # twice the even share
    assert moe.capacity_rows(64, 2, 8, 8, 100.0) == 64  # never above the worst case (1 expert a device)


def _layer(cfg):
    base = gemma.random_params(cfg, seed=3)
    return {n: base[f"layers.0.{n}"] for n in ("router", "router_scale", "expert_scale", "experts_gating",
                                                "experts_linear")}


@pytest.mark.parametrize("capacity", [2.0, 0.0])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data={s['data']},model={s['model']}")
def test_expert_parallel_experts_equal_replicated_forward_and_gradients(shape, capacity):
    """One layer's experts with LoRA on all three expert projections (B nonzero): the output and the gradients of
    the input and of every adapter, the experts placed by the rules (one a device, whole) against every expert on
    one device; at a run's default capacity (2x the even share: nothing dropped on these tokens) and dropless."""
    cfg = CFG
    p = _layer(cfg)
    lora = {n[len("layers.0."):]: a for n, a in _trained(cfg, LC).items() if n.startswith("layers.0.expert")}
    x = jax.random.normal(jax.random.key(0), (8, 16, cfg.d_model))
    _, ids = moe.route(x.reshape(-1, cfg.d_model), p["router"], p["router_scale"], cfg.top_k)
    assert int(jnp.bincount(ids.reshape(-1)).max()) <= moe.capacity_rows(x.shape[0] * x.shape[1], cfg.top_k, 8, 8,
                                                                           2.0)

    def out(x, lora, p, parallel):
        ad = functools.partial(lora_lib.adapter(LC, {f"layers.0.{n}": a for n, a in lora.items()}), 0)
        return (moe.experts(x, p, cfg.top_k, ad, capacity)[0] if parallel else moe.replicated(x, p, cfg.top_k, ad))

    def run(parallel, *args):
        f = lambda x, lora, p: jnp.sum(jnp.sin(out(x, lora, p, parallel)))  # noqa: E731
        return jax.jit(lambda *a: (out(*a, parallel), jax.grad(f, argnums=(0, 1))(*a)))(*args)
    want, (gx_want, gl_want) = run(False, x, lora, p)
    mesh = mesh_lib.make_mesh(shape)
    sh = {n: s for n, s in gemma.shardings(cfg, mesh).items() if n.startswith("layers.0.")}
    placed = {n: jax.device_put(a, sh[f"layers.0.{n}"]) for n, a in p.items()}
    assert placed["experts_gating"].addressable_shards[0].data.shape == (1, 2, 24, 64)
    lsh = lora_lib.shardings(cfg, LC, mesh)
    on_mesh = {n: jax.device_put(a, lsh[f"layers.0.{n}"]) for n, a in lora.items()}
    xs = jax.device_put(x, mesh_lib.sharding(mesh, ("batch", "residual_seq", None)))
    with jax.set_mesh(mesh):
        got, (gx, gl) = run(True, xs, on_mesh, placed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_want), atol=1e-5)
    for n in gl_want:
        np.testing.assert_allclose(np.asarray(gl[n]), np.asarray(gl_want[n]), atol=1e-5, err_msg=n)


@pytest.mark.parametrize("shape", MESHES[:2], ids=lambda s: f"data={s['data']},model={s['model']}")
def test_expert_parallel_step_equals_replicated_experts(shape):
    """The LoRA step's loss and its adapters' gradients (q, v and the experts'), the layers in scans as a run with
    a remat policy takes them and the base placed by the rules, against the same with no mesh (every expert on one
    device), at a run's default capacity (nothing dropped on this batch)."""
    cfg = dataclasses.replace(CFG, n_layers=13, expert_capacity=2.0)  # 13: two periods in a scan and one more
    base, lora, batch = gemma.random_params(cfg, seed=3), _trained(cfg, LC), _batch(cfg)
    x = jnp.take(base["embed"], batch["inputs"], axis=0).reshape(-1, cfg.d_model)
    _, ids = moe.route(x, base["layers.0.router"], base["layers.0.router_scale"], cfg.top_k)
    assert int(jnp.bincount(ids.reshape(-1)).max()) <= moe.capacity_rows(x.shape[0], cfg.top_k, 8, 8, 2.0)

    def loss(lora, base):
        s, w = finetune.loss_sums(cfg, LC, base, lora, batch, remat="full")
        return s / w
    stacked = gemma.stack(cfg, base)
    want, g_want = jax.jit(jax.value_and_grad(loss))(lora, stacked)
    mesh = mesh_lib.make_mesh(shape)
    placed = gemma.stack(cfg, base, gemma.stacked_shardings(cfg, mesh))
    # [periods, the period's run of local layers, experts: one of 8 a device, gate|up, Fe, D]
    assert placed["scan.0.0.experts_gating"].addressable_shards[0].data.shape == (2, 5, 1, 2, 24, 64)
    on_mesh = {k: jax.device_put(v, lora_lib.shardings(cfg, LC, mesh)[k]) for k, v in lora.items()}
    with jax.set_mesh(mesh):
        got, g_got = jax.jit(jax.value_and_grad(loss))(on_mesh, placed)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for name in g_want:
        scale = float(jnp.abs(g_want[name]).max()) + 1e-3
        assert float(jnp.abs(g_got[name] - g_want[name]).max()) <= 1e-3 * scale, name  # f32 sums in another order


def test_a_capacity_below_the_load_drops_rows_and_changes_the_output():
    """The bound is real: at a capacity under the busiest expert's load the output differs (and is finite), and
    the layer counts what it dropped: with one expert a device, each expert's assignments beyond the device's
    capacity, of the 128 tokens' 2 each (from the routing, counted here apart); dropless, none."""
    cfg = CFG
    p = _layer(cfg)
    x = jax.random.normal(jax.random.key(0), (8, 16, cfg.d_model))
    want = jax.jit(lambda x: moe.replicated(x, p, cfg.top_k))(x)
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1})
    with jax.set_mesh(mesh):
        full, none = jax.jit(lambda x: moe.experts(x, p, cfg.top_k, capacity=0.0))(x)
        small, drops = jax.jit(lambda x: moe.experts(x, p, cfg.top_k, capacity=0.25))(x)
    np.testing.assert_allclose(np.asarray(full), np.asarray(want), atol=1e-5)
    assert np.isfinite(np.asarray(small)).all() and float(jnp.abs(small - want).max()) > 1e-3
    _, ids = moe.route(x.reshape(-1, cfg.d_model), p["router"], p["router_scale"], cfg.top_k)
    cap = moe.capacity_rows(128, cfg.top_k, 8, 8, 0.25)
    over = int(np.maximum(np.bincount(np.asarray(ids).reshape(-1), minlength=8) - cap, 0).sum())
    assert over > 0 and drops.tolist() == [over, 128 * cfg.top_k] and none.tolist() == [0, 128 * cfg.top_k]


def test_the_step_counts_its_dropped_assignments_through_the_scans_and_logs_them():
    """The LoRA step's count of dropped expert assignments, summed over its 13 layers (two periods in a scan and one
    more written out), on data=4,model=2 (tokens gathered over data, split over model): none at a run's default
    capacity, where the loss is the replicated experts' (checked above); at a capacity under the load, the train
    step with its layers in scans (remat full) logs as a fraction of its assignments (expert_dropped) the count of
    the same step written out (the model's own forward)."""
    cfg = dataclasses.replace(CFG, n_layers=13)
    base, lora, batch = gemma.random_params(cfg, seed=3), _trained(cfg, LC), _batch(cfg)
    mesh = mesh_lib.make_mesh({"data": 4, "model": 2})
    assigned = cfg.n_layers * 8 * 16 * cfg.top_k  # layers x tokens x top_k
    on_mesh = {k: jax.device_put(v, lora_lib.shardings(cfg, LC, mesh)[k]) for k, v in lora.items()}

    def drops(capacity, remat):
        c = dataclasses.replace(cfg, expert_capacity=capacity)
        placed = (gemma.stack(c, base, gemma.stacked_shardings(c, mesh)) if remat != "none" else
                  jax.device_put(base, gemma.shardings(c, mesh)))
        with jax.set_mesh(mesh):
            return jax.jit(lambda lo, b: finetune.loss_terms(c, LC, b, lo, batch, remat=remat)[2])(on_mesh, placed)
    assert drops(2.0, "full").tolist() == [0, assigned]
    written_out = drops(0.25, "none")
    assert 0 < int(written_out[0]) < assigned and int(written_out[1]) == assigned
    from trainer.finetune.config import LoraRun
    run = LoraRun(weights="-", data="-", ckpt_dir="-", rank=4, alpha=8, targets=",".join(LC.targets), remat="full",
                  seq_len=16, batch_size=8, expert_capacity=0.25)
    steps = finetune.Steps(run, cfg, mesh, 1, 8)
    stacked = steps.place_base(jax.device_put(base, steps.flat_base_sh))
    lo, opt = steps.init()
    *_, out = steps.step(lo, opt, stacked, {f: np.asarray(batch[f]) for f in batch}, 1)
    assert steps.scanned and float(out["expert_dropped"]) == pytest.approx(int(written_out[0]) / assigned)


def test_the_plan_states_the_experts_placement_and_bound():
    d = moe.describe(128, 8, {"dcn": 1, "data": 8, "model": 1}, 16384, 2.0)
    assert (d["parallel_over"], d["per_device"], d["rows_per_device"]) == ("data", 16, 32768)
    assert "at most 32,768 rows a device a layer" in d["note"] and "dropped" in d["note"]
    assert "dropless" in moe.describe(128, 8, {"data": 8, "model": 1}, 16384, 0.0)["note"]
    assert moe.describe(6, 2, {"data": 4, "model": 2}, 1024, 2.0)["per_device"] == 6  # not divisible: every expert
