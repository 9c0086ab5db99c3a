"""The vocab-parallel embedding lookup and output layer + loss against the plain full-logits math.

On 8 emulated devices: the loss and both gradients of vocab_parallel.xent, whole or a chunk of positions at a time, equal jax.grad of
gpt2.loss_fn on full logits (padding masked), on meshes 8x1 and 4x2, with padding inside one slice and a
slice made of padding only; the lookup and its gradient equal jnp.take; --vocab-parallel resolution.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from trainer.pretrain import train as loop
from trainer.common import mesh as mesh_lib
from trainer.common.config import PRESETS, Config, UsageError
from trainer.models import gpt2, vocab_parallel as vp


def reference(x, table, targets, vocab_size):
    """Full logits on one device, padded columns masked as the model does, mean cross-entropy."""
    logits = jnp.einsum("btd,vd->btv", x, table)
    logits = jnp.where(jnp.arange(table.shape[0]) < vocab_size, logits, -1e9)
    return gpt2.loss_fn(logits, targets)


@pytest.mark.parametrize("shape", [(8, 1), (4, 2)])
@pytest.mark.parametrize("vocab_size,padded,chunk", [(1000, 1024, 0), (100, 128, 0), (512, 512, 0), (1000, 1024, 4),
                                                     (100, 128, 8)])
def test_xent_and_its_gradients_equal_the_full_logits_loss(shape, vocab_size, padded, chunk):
    # (100, 128) over 8 slices of 16 rows: slice 6 is part padding, slice 7 is padding only.
    mesh = mesh_lib.make_mesh({"data": shape[0], "model": shape[1]})
    rng = np.random.default_rng(0)
    b, t, d = 8, 16, 32
    x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((padded, d)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab_size, (b, t)), jnp.int32)

    want, (wdx, wdt) = jax.value_and_grad(reference, argnums=(0, 1))(x, table, targets, vocab_size)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, vp.ACTS), put(table, vp.TABLE), put(targets, vp.IDS))
    with jax.set_mesh(mesh):
        loss = jax.jit(vp.xent, static_argnums=(3, 4))(*args, vocab_size, chunk)  # the forward-only (eval) path
        got, (dx, dt) = jax.jit(jax.value_and_grad(lambda *a: 3.0 * vp.xent(*a, vocab_size, chunk),
                                                   argnums=(0, 1)))(*args)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(float(got), 3.0 * float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), 3.0 * np.asarray(wdx), atol=1e-6)  # upstream cotangent applied
    np.testing.assert_allclose(np.asarray(dt), 3.0 * np.asarray(wdt), atol=1e-6)
    assert not np.asarray(dt)[vocab_size:].any()  # padding rows never learn
    assert dt.sharding.is_equivalent_to(NamedSharding(mesh, vp.TABLE), 2)  # the table's gradient stays put
    assert dx.sharding.is_equivalent_to(NamedSharding(mesh, vp.ACTS), 3)


@pytest.mark.parametrize("shape", [(8, 1), (4, 2)])
def test_lookup_and_its_gradient_equal_take(shape):
    mesh = mesh_lib.make_mesh({"data": shape[0], "model": shape[1]})
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.standard_normal((256, 16)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 256, (8, 12)), jnp.int32)
    weight = jnp.asarray(rng.standard_normal((8, 12, 16)), jnp.float32)
    f_ref = lambda tb: jnp.sum(jnp.take(tb, ids, axis=0) * weight)
    with jax.set_mesh(mesh):
        tb = jax.device_put(table, NamedSharding(mesh, vp.TABLE))
        ids_sh = jax.device_put(ids, NamedSharding(mesh, vp.IDS))
        got = jax.jit(vp.lookup)(tb, ids_sh)
        g = jax.jit(jax.grad(lambda tb, i: jnp.sum(vp.lookup(tb, i) * weight)))(tb, ids_sh)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take(table, ids, axis=0)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(f_ref)(table)), atol=1e-5)


def cfg_with(**train) -> Config:
    m, t = PRESETS["gpt2-tiny"]
    return Config("gpt2-tiny", m, dataclasses.replace(t, ckpt_dir="/unused", **train))


def test_auto_turns_on_when_a_steps_tokens_are_fewer_than_the_vocab():
    small = cfg_with(batch_size=8)  # 8 x 128 tokens < 50304
    assert loop.use_vocab_parallel(small, 8)
    assert not loop.use_vocab_parallel(small, 1)  # one device: nothing to shard
    big = cfg_with(batch_size=512)  # 65536 tokens > 50304: all-gathering them costs more than the table
    assert not loop.use_vocab_parallel(big, 8)
    assert loop.use_vocab_parallel(cfg_with(batch_size=512, grad_accum=8), 8)  # per micro-step
    assert loop.use_vocab_parallel(cfg_with(batch_size=512, vocab_parallel="on"), 8)
    assert not loop.use_vocab_parallel(cfg_with(batch_size=8, vocab_parallel="off"), 8)


def test_on_with_a_vocab_the_devices_do_not_divide_is_a_clear_error():
    m, t = PRESETS["gpt2-tiny"]
    cfg = Config("gpt2-tiny", dataclasses.replace(m, vocab_multiple=4),  # 50260 rows, not a multiple of 8
                 dataclasses.replace(t, ckpt_dir="/unused", vocab_parallel="on"))
    with pytest.raises(UsageError, match="--vocab-parallel on.*--vocab-multiple"):
        loop.check_fits(cfg, {"data": 8, "model": 1}, 1)
    auto = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, vocab_parallel="auto"))
    loop.check_fits(auto, {"data": 8, "model": 1}, 1)  # auto just stays off
    assert not loop.use_vocab_parallel(auto, 8)
