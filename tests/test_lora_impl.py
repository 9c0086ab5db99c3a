"""The LoRA step's alternative ways of applying the adapters (trainer/models/lora.py IMPLS, --lora-impl) against
the plain one (beside): the same loss and the same adapter gradients, on tiny configs, on the CPU."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _gemma_ckpt as gc
from trainer.common.config import UsageError
from trainer.finetune import train as finetune
from trainer.finetune.config import LoraRun
from trainer.models import gemma, lora as lora_lib

CASES = {"gemma2": gc.TINY["gemma2"], "gemma3": gc.TINY["gemma3"], "gemma4 k=v": gc.TINY4["dense"]}


def _batch(cfg, b=2, t=16, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, cfg.vocab, (b, t + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
            "segments": jnp.ones((b, t), jnp.int32), "weights": jnp.ones((b, t), jnp.float32)}


def _trained(cfg, lc, seed=1):
    """Adapters with B random too (as after training), so every adapter changes the output."""
    lora = lora_lib.init(cfg, lc, seed)
    return {n: (0.05 * jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), a.shape)
                if n.endswith(".b") else a) for i, (n, a) in enumerate(sorted(lora.items()))}


def _loss_and_grads(cfg, lc, base, lora, batch, impl, dtype=jnp.float32, remat="none"):
    def loss(lora):
        s, n = finetune.loss_sums(cfg, lc, base, lora, batch, dtype=dtype, lora_impl=impl, remat=remat)
        return s / n
    return jax.jit(jax.value_and_grad(loss))(lora)


@pytest.mark.parametrize("impl", [i for i in lora_lib.IMPLS if i != "beside"])
@pytest.mark.parametrize("case,targets", [("gemma2", "all"), ("gemma4 k=v", "all"), ("gemma3", "k,up,o")])
def test_each_impl_gives_the_plain_adapters_loss_and_gradients(case, targets, impl):
    """All seven targets (pairs applied together; Gemma 4's k=v global layers have no v: their k alone) and a
    subset that splits both pairs (each alone, as beside)."""
    cfg = CASES[case]
    lc = lora_lib.LoraConfig(4, 8.0, 0.0, lora_lib.resolve_targets(targets))
    base, lora, batch = gemma.random_params(cfg, 3), _trained(cfg, lc), _batch(cfg)
    want, g_want = _loss_and_grads(cfg, lc, base, lora, batch, "beside")
    got, g_got = _loss_and_grads(cfg, lc, base, lora, batch, impl)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert set(g_got) == set(g_want)
    for name in g_want:
        scale = float(jnp.abs(g_want[name]).max())
        assert scale > 0, name  # every adapter reaches the loss
        # f32 sums in another order, through every layer
        np.testing.assert_allclose(g_got[name], g_want[name], rtol=1e-3, atol=2e-4 * scale, err_msg=name)


def test_stacked_is_the_default_and_an_unknown_impl_is_refused():
    assert LoraRun(weights="w", data="d", ckpt_dir="c").lora_impl == lora_lib.DEFAULT_IMPL == "stacked"
    with pytest.raises(UsageError, match="--lora-impl inside: choose beside or stacked"):
        LoraRun(weights="w", data="d", ckpt_dir="c", lora_impl="inside").check()
    with pytest.raises(UsageError, match="--lora-impl"):
        lora_lib.adapter(lora_lib.LoraConfig(), {}, impl="inside")


def test_adapters_are_gathered_whole_where_a_mesh_applies_them():
    """A and B are stored split like the weights they adapt; applied under a mesh each is constrained whole (the
    TPU compiler otherwise gathered every device's rows of the layer's input for each adapter, to contract A's
    split dim where it lay), with the numbers of no mesh."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from trainer.common import mesh as mesh_lib
    cfg = CASES["gemma4 k=v"]
    lc = lora_lib.LoraConfig(4, 8.0, 0.0, ("q",))
    lora = _trained(cfg, lc)
    apply = lora_lib.adapter(lc, lora)
    x = jax.random.normal(jax.random.key(0), (8, 16, cfg.d_model))
    y = jnp.zeros((8, 16) + lora["layers.0.q.b"].shape[1:])
    want = apply(0, "q", x, y)
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1})
    placed = {n: jax.device_put(a, NamedSharding(mesh, P("data") if n.endswith(".a") else P())) for n, a in lora.items()}
    f = jax.jit(lambda lo, x, y: lora_lib.adapter(lc, lo)(0, "q", x, y))
    with jax.set_mesh(mesh):
        text = f.lower(placed, x, y).as_text()
        got = f(placed, x, y)
    whole = re.findall(r"sdy.sharding_constraint %\S+ <@mesh, \[\{\}(?:, \{\})*\]>", text)
    assert len(whole) >= 2, "A and B not constrained whole"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
