"""Trainer pieces in-process on 8 emulated CPU devices: shardings, model math, optimizer, config."""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _trainer_util import TINY, session_cache
from trainer.common import config
from trainer.common import loop as common_loop
from trainer.pretrain import train as loop
from trainer.common import optim
from trainer.models import gpt2


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TPUCTL_CACHE", session_cache(tmp_path_factory))
    common_loop.enable_compile_cache()
    yield
    mp.undo()


def tiny_cfg(*extra: str) -> config.Config:
    p = argparse.ArgumentParser()
    config.add_config_flags(p)
    return config.resolve(p.parse_args([*TINY, "--ckpt-dir", "/unused", *extra]))


def get(tree, key):
    for k in (key,) if isinstance(key, str) else key:
        tree = tree[k]
    return tree


def spec_of(x) -> P:
    s = x.sharding.spec
    return P(*(tuple(s) + (None,) * (x.ndim - len(s))))  # normalise trailing Nones


@pytest.mark.parametrize("vocab_parallel", ["off", "on"])
@pytest.mark.parametrize("mesh", ["data=8,model=1", "data=4,model=2"])
def test_params_optimizer_state_and_batch_carry_the_rule_shardings(mesh, vocab_parallel):
    cfg = tiny_cfg("--mesh", mesh, "--vocab-parallel", vocab_parallel)
    steps = loop.Steps(cfg, loop.setup_mesh(cfg))
    params, opt_state = steps.init()
    model = "model"  # the rules name mesh axes whatever their size (on 8x1 the model axis has size 1)
    vocab = ("dcn", "data", "model") if vocab_parallel == "on" else model  # dcn: the slices (size 1 here)
    want = {
        "wte": P(vocab, None),  # vocab -> model, or every device with --vocab-parallel
        "wpe": P(None, None),
        ("blocks", 0, "attn", "qkv_kernel"): P(None, None, model, None),  # heads -> model
        ("blocks", 0, "attn", "out_kernel"): P(model, None, None),
        ("blocks", 0, "mlp", "fc_kernel"): P(None, model),  # mlp -> model
        ("blocks", 0, "mlp", "fc_bias"): P(model),
        ("blocks", 0, "mlp", "proj_kernel"): P(model, None),
        ("blocks", 0, "ln1", "scale"): P(None),
    }
    for key, spec in want.items():
        assert spec_of(get(params, key)) == spec, key
    # Adam's moments live where their parameters live: read them out of the real optimizer state.
    adam = next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    for key, spec in want.items():
        assert spec_of(get(adam.mu, key)) == spec, key
        assert spec_of(get(adam.nu, key)) == spec, key
    assert spec_of(adam.count) == P()
    # Really split, not just labelled: on 4x2 a vocab-sharded table holds half the rows per device,
    # an eighth with --vocab-parallel.
    n_slices = 8 if vocab_parallel == "on" else steps.mesh.shape["model"]
    wte = params["wte"]
    assert {s.data.shape for s in wte.addressable_shards} == {(wte.shape[0] // n_slices, wte.shape[1])}
    batch = steps.global_batch(np.zeros((8, cfg.model.seq_len + 1), np.int32))
    assert spec_of(batch) == P(("dcn", "data"), None)  # the batch over the slices, then data
    assert {s.data.shape[0] for s in batch.addressable_shards} == {8 // steps.mesh.shape["data"]}
    # The compiled step keeps every parameter in its sharding (outputs = inputs: nothing gathered).
    steps.compile()
    out_params, _, _ = steps.step(params, opt_state, np.zeros((8, cfg.model.seq_len + 1), np.int32), 1)
    for key, spec in want.items():
        assert spec_of(get(out_params, key)) == spec, key


def forward(cfg, key=None):
    """Jitted logits of a fresh tiny model (eager NNX on 8 devices would compile op by op)."""
    from flax import nnx
    params = gpt2.init_params(cfg, 0, loop.setup_mesh(tiny_cfg()))
    graphdef, _ = gpt2.abstract(cfg)
    f = jax.jit(lambda p, tok, k: nnx.merge(graphdef, p)(tok, dropout_key=k))
    return lambda tok, k=None: f(params, tok, k)


def test_model_is_causal_and_never_predicts_padding():
    cfg = tiny_cfg().model
    assert cfg.padded_vocab % 128 == 0 and cfg.padded_vocab > cfg.vocab_size
    model = forward(cfg)
    a = jnp.arange(cfg.seq_len)[None] % 1000
    b = a.at[0, 10].set(999)  # change one token: positions before it must not see the change
    la, lb = model(a), model(b)
    np.testing.assert_allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not np.allclose(la[0, 10:], lb[0, 10:])
    assert float(la[..., cfg.vocab_size:].max()) < -1e8  # padded rows are masked out of the softmax
    p = jax.nn.softmax(la, -1)[..., : cfg.vocab_size].sum(-1)
    np.testing.assert_allclose(p, 1.0, atol=1e-5)


def test_dropout_runs_only_with_a_key():
    cfg = tiny_cfg().model
    model = forward(cfg)
    tok = jnp.arange(cfg.seq_len)[None]
    det1, det2 = model(tok), model(tok)
    np.testing.assert_array_equal(det1, det2)
    k = jax.random.key(0)
    d1, d2 = model(tok, k), model(tok, jax.random.fold_in(k, 1))
    assert not np.allclose(d1, det1) and not np.allclose(d1, d2)
    np.testing.assert_array_equal(d1, model(tok, k))


def test_dropout_masks_keep_the_right_fraction_whatever_the_sharding():
    from jax.sharding import NamedSharding
    key, shape = jax.random.key(3), (3, 8, 64, 256)
    masks = np.asarray(gpt2.keep_masks(key, 0.1, shape))
    assert gpt2.keep_prob(0.1) == pytest.approx(0.9, abs=1e-5)
    assert abs(masks.mean() - gpt2.keep_prob(0.1)) < 0.002  # 393k draws: the std of the mean is 0.0005
    assert abs(masks[..., :128].mean() - masks[..., 128:].mean()) < 0.004  # both 16-bit halves are random
    mesh = loop.setup_mesh(tiny_cfg("--mesh", "data=4,model=2"))
    sharded = jax.jit(lambda k: gpt2.keep_masks(k, 0.1, shape),
                      out_shardings=NamedSharding(mesh, P(None, "data", None, "model")))(key)
    np.testing.assert_array_equal(np.asarray(sharded), masks)


def test_schedule_and_weight_decay_mask():
    t = tiny_cfg("--lr", "1.0", "--warmup-steps", "4", "--decay-steps", "20").train
    lr = optim.schedule(t)
    np.testing.assert_allclose([float(lr(c)) for c in range(4)], [0.25, 0.5, 0.75, 1.0])
    assert float(lr(4)) == pytest.approx(1.0) and float(lr(12)) == pytest.approx(0.55)
    assert float(lr(20)) == pytest.approx(0.1) and float(lr(1000)) == pytest.approx(0.1)  # --steps is not involved
    shapes = jax.eval_shape(lambda: gpt2.init_params(tiny_cfg().model, 0, loop.setup_mesh(tiny_cfg())))
    mask = dict(jax.tree_util.tree_flatten_with_path(optim.decay_mask(shapes))[0])
    names = {"/".join(str(getattr(k, "key", k)) for k in path): v for path, v in mask.items()}
    assert names["blocks/0/mlp/fc_kernel"] and names["blocks/0/attn/qkv_kernel"]
    assert not any(v for n, v in names.items() if n.endswith(("bias", "scale")) or n in ("wte", "wpe"))


def test_grad_accumulation_matches_one_big_batch():
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 50257, (16, 33), dtype=np.int32)
    results = []
    for accum in ("1", "2"):
        cfg = tiny_cfg("--grad-accum", accum, "--dropout", "0", "--batch-size", "16")
        steps = loop.Steps(cfg, loop.setup_mesh(cfg))
        steps.compile()
        params, opt = steps.init()
        params, opt, out = steps.step(params, opt, batch, 1)
        results.append((float(out["loss"]), jax.device_get(params)))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-5)
    for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_presets_and_overrides():
    p = argparse.ArgumentParser()
    config.add_config_flags(p)
    cfg = config.resolve(p.parse_args(["--preset", "gpt2-124m", "--n-layer", "2", "--steps", "7", "--ckpt-dir", "x"]))
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.train.steps, cfg.train.decay_steps) == (2, 768, 7, 20000)
    assert config.Config.from_dict(cfg.to_dict()) == cfg
    assert config.model_diff(cfg.model, cfg.model) == []
    with pytest.raises(config.UsageError, match="unknown preset 'gpt2-xl'"):
        config.resolve(p.parse_args(["--preset", "gpt2-xl", "--ckpt-dir", "x"]))
