"""Gemma 2 / 3: logits against Google's implementation (tunix) on tiny random checkpoints in both Kaggle
layouts, sharded loading on a 4x2 mesh, sizes from shapes, and the bad checkpoints a user can hand us."""
from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _gemma_ckpt as gc
from trainer.common import mesh as mesh_lib
from trainer.gemma import weights
from trainer.common.config import UsageError
from trainer.models import gemma

SEQ = 12  # longer than the tiny models' sliding window (4)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{(family, layout): (path, flat params)} written once for the module."""
    out = {}
    for fam, cfg in gc.TINY.items():
        flat = gemma.random_params(cfg, seed=len(fam))
        root = tmp_path_factory.mktemp(fam)
        out[fam, "flax"] = (gc.write_flax(str(root / "flax"), cfg, flat), flat)
        out[fam, "transformers"] = (gc.write_hf(str(root / "transformers"), cfg, flat), flat)
    return out


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh({"data": 4, "model": 2})


def _load(ckpts, fam, layout, mesh, **kw):
    path, flat = ckpts[fam, layout]
    overrides = gc.FLAX_OVERRIDES[fam] if layout == "flax" else {}
    return weights.load(path, mesh, **{**overrides, **kw})


def _logits(cfg, params, tokens, mesh):
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(lambda p, t: gemma.from_flat(cfg, p)(t)[0])(params, jnp.asarray(tokens)))


@pytest.mark.parametrize("layout", ["flax", "transformers"])
@pytest.mark.parametrize("fam", ["gemma2", "gemma3"])
def test_logits_match_googles_implementation(ckpts, mesh, fam, layout):
    ck, params = _load(ckpts, fam, layout, mesh)
    assert ck.layout == layout and ck.cfg == gc.TINY[fam]
    assert ck.cfg.sliding_window < SEQ and gemma.LOCAL in ck.cfg.layer_types
    tokens = np.random.RandomState(7).randint(0, ck.cfg.vocab, (2, SEQ))
    ours = _logits(ck.cfg, params, tokens, mesh)
    ref = gc.tunix_logits(gc.tunix_model(ck.cfg, ckpts[fam, layout][0], layout), tokens)
    assert ours.shape == ref.shape == (2, SEQ, ck.cfg.vocab)
    assert np.abs(ours - ref).max() <= 1e-4
    # The comparison can tell layers apart: without the sliding window the late positions change.
    wide = _logits(dataclasses.replace(ck.cfg, sliding_window=SEQ), params, tokens, mesh)
    assert np.abs(wide[:, -1] - ref[:, -1]).max() > 1e-3


def test_fused_qkv_checkpoint_matches_googles_implementation(mesh, tmp_path):
    # Kaggle stores q, k and v as one qkv_einsum when heads == kv heads.
    cfg = dataclasses.replace(gc.TINY["gemma2"], n_kv_heads=4)
    flat = gemma.random_params(cfg, seed=5)
    path = gc.write_flax(str(tmp_path / "mha"), cfg, flat)
    ck, params = weights.load(path, mesh, **gc.FLAX_OVERRIDES["gemma2"])
    assert ck.cfg == cfg
    tokens = np.random.RandomState(3).randint(0, cfg.vocab, (2, SEQ))
    ref = gc.tunix_logits(gc.tunix_model(cfg, path, "flax"), tokens)
    assert np.abs(_logits(cfg, params, tokens, mesh) - ref).max() <= 1e-4


def test_query_scaled_by_width_over_heads_as_the_27b_sizes_match_googles_implementation(mesh, tmp_path):
    # Gemma 2/3 27b scale q by (d_model / heads) ** -0.5, not head_dim ** -0.5 (tunix models it for Gemma 3).
    cfg = dataclasses.replace(gc.TINY["gemma3"], head_dim=8, query_pre_attn_scalar=16.0)
    flat = gemma.random_params(cfg, seed=9)
    path = gc.write_hf(str(tmp_path / "wide"), cfg, flat)
    ck, params = weights.load(path, mesh)
    assert ck.cfg == cfg
    tokens = np.random.RandomState(4).randint(0, cfg.vocab, (2, SEQ))
    ref = gc.tunix_logits(gc.tunix_model(cfg, path, "transformers"), tokens)
    assert np.abs(_logits(cfg, params, tokens, mesh) - ref).max() <= 1e-4
    other = _logits(dataclasses.replace(cfg, query_pre_attn_scalar=8.0), params, tokens, mesh)
    assert np.abs(other - ref).max() > 1e-3


def _per_device_bytes(x) -> set[int]:
    return {s.data.nbytes for s in x.addressable_shards}


@pytest.mark.parametrize("layout", ["flax", "transformers"])
def test_load_on_a_4x2_mesh_gives_each_param_its_rule_sharding(ckpts, mesh, layout, monkeypatch):
    reads = []
    monkeypatch.setattr(weights, "on_read", lambda name, n: reads.append((name, n)))
    ck, params = _load(ckpts, "gemma3", layout, mesh)
    flat = ckpts["gemma3", layout][1]
    for name, (shape, axes) in gemma.param_layout(ck.cfg).items():
        x = params[name]
        want = mesh_lib.fitted_spec(axes, shape, {"data": 4, "model": 2})
        assert x.sharding.spec == want, name
        n_shards = math.prod({"data": 4, "model": 2}[n] for a in want if a is not None
                             for n in ((a,) if isinstance(a, str) else a))
        assert _per_device_bytes(x) == {x.nbytes // n_shards}, name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat[name]))
    # Fsdp over data and tensor-parallel over model; the single kv head model=2 cannot split stays whole, and its
    # width splits over model as well as data instead.
    assert params["layers.0.q"].sharding.spec == jax.sharding.PartitionSpec("model", "data", None)
    assert params["layers.0.kv"].sharding.spec == jax.sharding.PartitionSpec(None, None, ("data", "model"), None)
    if layout == "transformers":  # no read ever fetched more than one device's block of a tensor
        largest = max(max(_per_device_bytes(x)) for x in params.values())
        assert reads and max(n for _, n in reads) <= largest
        assert sum(n for _, n in reads) == sum(x.nbytes for x in params.values())  # every byte fetched once
        assert max(n for name, n in reads if "o_proj" in name) <= params["layers.0.o"].nbytes // 8


def test_weights_can_be_held_in_bf16(ckpts, mesh):
    ck, params = _load(ckpts, "gemma2", "transformers", mesh, dtype=jnp.bfloat16)
    assert {x.dtype for x in params.values()} == {jnp.dtype(jnp.bfloat16)}
    logits = _logits(ck.cfg, params, np.zeros((1, 4), np.int32), mesh)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


def test_sizes_come_from_shapes_and_the_named_table_has_real_counts():
    for name, cfg in gemma.SIZES.items():
        shapes = {n: s for n, (s, _) in gemma.param_layout(cfg).items()}
        assert gemma.GemmaConfig.from_shapes(cfg.family, shapes) == cfg, name
    assert gemma.count_params(gemma.SIZES["gemma2-2b"]) == 2_614_636_800
    assert gemma.count_params(gemma.SIZES["gemma3-1b"]) == 999_885_952
    assert gemma.SIZES["gemma2-27b"].query_pre_attn_scalar == 144.0
    assert gemma.SIZES["gemma3-1b"].layer_types[:6] == (gemma.LOCAL,) * 5 + (gemma.GLOBAL,)


def test_abstract_model_and_train_step_build_from_shapes_alone():
    cfg = gemma.SIZES["gemma2-27b"]
    _, state = gemma.abstract(cfg)
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
    assert n == gemma.count_params(cfg)
    params = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, (s, _) in gemma.param_layout(cfg).items()}
    tokens = jax.ShapeDtypeStruct((8, 4097), jnp.int32)
    loss, grads = jax.eval_shape(jax.value_and_grad(lambda p, t: gemma.loss(cfg, p, t, jnp.bfloat16)), params, tokens)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert {k: g.shape for k, g in grads.items()} == {k: p.shape for k, p in params.items()}


# ---------------------------------------------------------------- bad input

def test_a_path_without_a_checkpoint_is_named(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        weights.inspect(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("x")
    with pytest.raises(UsageError, match=r"no Gemma checkpoint there .*found: README"):
        weights.inspect(str(tmp_path / "empty"))


def test_shapes_of_no_known_family_are_named(ckpts, tmp_path):
    # A Gemma-1-like checkpoint: no post-norms.
    from safetensors.numpy import save_file
    cfg, flat = gc.TINY["gemma2"], ckpts["gemma2", "flax"][1]
    t = {k: v for k, v in gc.hf_tensors(cfg, flat).items() if "post_" not in k and "pre_feedforward" not in k}
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(UsageError, match=r"matches no known Gemma family.*found layer params: pre_attn_norm"):
        weights.inspect(str(tmp_path))


def test_model_flag_that_contradicts_the_checkpoint(ckpts):
    for layout in ("flax", "transformers"):
        with pytest.raises(UsageError, match=r"--model gemma3: .* is a gemma2 checkpoint; pass --model gemma2"):
            weights.inspect(ckpts["gemma2", layout][0], family="gemma3")
    with pytest.raises(UsageError, match="--model gemma4: .* is a gemma2 checkpoint; pass --model gemma2"):
        weights.inspect(ckpts["gemma2", "flax"][0], family="gemma4")
    with pytest.raises(UsageError, match="--model gemma5: expected one of gemma2, gemma3, gemma4"):
        weights.inspect(ckpts["gemma2", "flax"][0], family="gemma5")


def test_hf_config_json_supplies_what_shapes_cannot(ckpts):
    path = ckpts["gemma3", "transformers"][0]
    conf = json.load(open(os.path.join(path, "config.json")))
    ck = weights.inspect(path)
    assert ck.cfg.sliding_window == conf["sliding_window"] == 4
    assert ck.cfg.global_rope_scale == conf["rope_scaling"]["factor"]


def test_many_narrow_rows_are_read_in_bounded_whole_row_groups(ckpts, monkeypatch):
    path = ckpts["gemma2", "transformers"][0]
    st = weights.SafeTensors(path)
    full = st.read("model.embed_tokens.weight", slice(None))
    reads = []
    monkeypatch.setattr(weights, "on_read", lambda name, n: reads.append(n))
    monkeypatch.setattr(weights, "MAX_ROW_REQUESTS", 8)
    monkeypatch.setattr(weights, "GROUP_BYTES", 10 * 64 * 4)  # 10 rows of 64 f32
    block = st.read("model.embed_tokens.weight", slice(3, 90), slice(16, 32))
    np.testing.assert_array_equal(block, full[3:90, 16:32])
    assert max(reads) == 10 * 64 * 4 and len(reads) == 9
