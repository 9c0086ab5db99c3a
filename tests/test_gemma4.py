"""Gemma 4: logits and greedy tokens against Google's implementation (tunix) on tiny random checkpoints of each
kind of size (E: kv sharing + per-layer embeddings; 31B: k=v global layers; 26B-A4B: experts), written in
Kaggle's flax layout and loaded sharded on a 4x2 mesh; and the named sizes' shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _gemma_ckpt as gc
from trainer.common import mesh as mesh_lib
from trainer.gemma import generate as gen, weights
from trainer.models import gemma

SEQ = 12  # longer than the tiny models' sliding window (4)


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh({"data": 4, "model": 2})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{kind: path} of Kaggle flax checkpoints, {(kind, 'transformers'): path} of safetensors ones."""
    out = {}
    for kind, cfg in gc.TINY4.items():
        flat = gemma.random_params(cfg, seed=3)
        out[kind] = gc.write_flax(str(tmp_path_factory.mktemp(f"gemma4-{kind}")), cfg, flat)
        if kind != "dense":
            out[kind, "transformers"] = gc.write_hf(str(tmp_path_factory.mktemp(f"gemma4-{kind}-hf")), cfg, flat)
    return out


def _greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from Google's forward pass over the whole sequence each time (one compile: fixed length)."""
    from flax import nnx
    total = len(prompt) + n
    step = nnx.jit(lambda m, t: gc.tunix_logits_jax(m, t))
    seq = np.zeros((1, total), np.int32)
    seq[0, : len(prompt)] = prompt
    for i in range(len(prompt), total):
        seq[0, i] = int(np.argmax(np.asarray(step(model, jnp.asarray(seq)))[0, i - 1]))
    return [int(t) for t in seq[0, len(prompt):]]


@pytest.mark.parametrize("kind", list(gc.TINY4))
def test_logits_and_greedy_tokens_match_googles_implementation(ckpts, mesh, kind):
    cfg = gc.TINY4[kind]
    ck, params = weights.load(ckpts[kind], mesh, **gc.FLAX_OVERRIDES4[kind])
    assert ck.cfg == cfg and ck.layout == "flax"
    assert params["layers.0.q"].sharding.spec == jax.sharding.PartitionSpec("model", "data", None)
    ref_model = gc.tunix_gemma4(cfg, ckpts[kind])
    tokens = np.random.RandomState(7).randint(0, cfg.vocab, (2, SEQ))
    ref = gc.tunix_logits(ref_model, tokens)
    with jax.set_mesh(mesh):
        run = jax.jit(lambda p, t, dt: gemma.from_flat(cfg, p)(t, dtype=dt)[0], static_argnums=2)
        ours = np.asarray(run(params, jnp.asarray(tokens), jnp.float32))
    assert ours.shape == ref.shape == (2, SEQ, cfg.vocab)
    assert np.abs(ours - ref).max() <= 1e-4
    if kind == "e":
        # bf16 activations (8 significant bits): Google's implementation computing in bf16 is off its own f32
        # logits by 5% of their mean size here; ours may be 1.5x that. (On the experts the router flips between
        # near-tied experts in bf16, in both implementations: no bound says anything there.)
        with jax.set_mesh(mesh):
            ours_bf16 = np.asarray(run(params, jnp.asarray(tokens), jnp.bfloat16))
        assert np.abs(ours_bf16 - ref).mean() <= 0.08 * np.abs(ref).mean()
    if kind != "e":
        return  # (greedy decoding: on the kind whose cache differs, kv-shared layers reading their source's)
    # Greedy decoding through our KV cache (shared layers read their source's cache) picks Google's tokens.
    prompt = [int(t) for t in tokens[0, :5]]
    ours_tokens = gen.generate(cfg, params, prompt, gen.SampleConfig(max_new_tokens=4), mesh=mesh)
    assert ours_tokens == _greedy_reference(ref_model, prompt, 4)


@pytest.mark.parametrize("kind", ["e", "moe"])  # (moe's global layers are k=v too)
def test_transformers_layout_matches_googles_implementation(ckpts, mesh, kind):
    """Kaggle's transformers framework (Hugging Face's Gemma4ForConditionalGeneration names, config.json): the
    sizes and what shapes cannot tell from config.json, logits as tunix's safetensors loader makes them."""
    cfg = gc.TINY4[kind]
    path = ckpts[kind, "transformers"]
    ck, params = weights.load(path, mesh)
    assert ck.cfg == cfg and ck.layout == "transformers"
    tokens = np.random.RandomState(7).randint(0, cfg.vocab, (2, SEQ))
    ref = gc.tunix_logits(gc.tunix_gemma4(cfg, path, "transformers"), tokens)
    with jax.set_mesh(mesh):
        ours = np.asarray(jax.jit(lambda p, t: gemma.from_flat(cfg, p)(t)[0])(params, jnp.asarray(tokens)))
    assert np.abs(ours - ref).max() <= 1e-4


def test_checkpoints_without_the_kv_shared_layers_kv(ckpts, mesh, tmp_path):
    """Hugging Face saves no k/v projections or k-norm for layers that attend over another's (unused: kv_source),
    and a flax checkpoint may not either: they load as zeros, everything else as before."""
    import json
    import os
    import shutil
    from safetensors.numpy import load_file, save_file
    cfg, src = gc.TINY4["e"], ckpts["e", "transformers"]
    shutil.copytree(src, tmp_path / "hf")
    first = cfg.n_layers - cfg.kv_shared_layers
    for f in os.listdir(tmp_path / "hf"):
        if f.endswith(".safetensors"):
            t = load_file(tmp_path / "hf" / f)
            gone = [f"layers.{i}.self_attn.{x}" for i in range(first, cfg.n_layers) for x in ("k_proj", "v_proj", "k_norm")]
            keep = {n: v for n, v in t.items() if not any(g in n for g in gone)}
            save_file(keep, tmp_path / "hf" / f, metadata={"format": "pt"})
    assert json.load(open(tmp_path / "hf" / "config.json"))["text_config"]["num_kv_shared_layers"] == 5
    (_, full), (ck, pruned) = weights.load(src, mesh), weights.load(str(tmp_path / "hf"), mesh)
    assert ck.cfg == cfg
    import orbax.checkpoint as ocp
    from trainer.gemma import export
    tree = export.flax_tree(cfg, full)
    for i in range(first, cfg.n_layers):
        for name in ("kv_einsum", "_key_norm"):
            del tree["transformer"][f"layer_{i}"]["attn"][name]
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(str(tmp_path / "flax" / "tiny"), tree)
    ckpt.wait_until_finished()
    ckpt.close()
    flax_ck, flax_pruned = weights.load(str(tmp_path / "flax"), mesh, **gc.FLAX_OVERRIDES4["e"])
    assert flax_ck.cfg == cfg
    gone = {f"layers.{i}.{x}" for i in range(first, cfg.n_layers) for x in ("kv", "k_norm")}
    for name in full:
        want = np.zeros(full[name].shape) if name in gone else np.asarray(full[name])
        np.testing.assert_array_equal(np.asarray(pruned[name]), want)
        np.testing.assert_array_equal(np.asarray(flax_pruned[name]), want)


def test_named_sizes():
    s = gemma.SIZES
    # Google's published totals (text weights): E2B 2.3B effective + per-layer embeddings, E4B 4.5B + them,
    # 31B, 26B-A4B.
    counts = {n: gemma.count_params(s[n]) / 1e9 for n in ("gemma4-e2b", "gemma4-e4b", "gemma4-31b", "gemma4-26b-a4b")}
    assert 4.5 < counts["gemma4-e2b"] < 4.8 and 7.3 < counts["gemma4-e4b"] < 7.7
    assert 30 < counts["gemma4-31b"] < 31.5 and 25 < counts["gemma4-26b-a4b"] < 25.5
    e2b = s["gemma4-e2b"]
    assert e2b.layer_types[:5] == (gemma.LOCAL,) * 4 + (gemma.GLOBAL,) and e2b.layer_types[-1] == gemma.GLOBAL
    # The last 20 layers attend over layer 13's (local) or 14's (global) keys, with a doubled MLP.
    assert {e2b.kv_source(i) for i in range(15, 35)} == {13, 14} and e2b.ff_of(34) == 2 * e2b.ff_of(0)
    assert gemma.init_cache(e2b, 1, 4)[20] is None
    shapes = {n: shape for n, (shape, _) in gemma.param_layout(s["gemma4-31b"]).items()}
    assert shapes["layers.5.kv"] == (1, 4, 5376, 512) and shapes["layers.0.kv"] == (2, 16, 5376, 256)
    # Each named size is found again from its shapes alone.
    for name in counts:
        shapes = {n: shape for n, (shape, _) in gemma.param_layout(s[name]).items()}
        assert gemma.GemmaConfig.from_shapes("gemma4", shapes) == s[name]


# ---- Gemma 4 checkpoints as Google writes them

def _respelled(cfg, flat, root: str, *, transformer_root: bool, qk: str) -> str:
    """The tiny checkpoint in Kaggle's nested flax layout with one of Google's spellings: with or without the
    `transformer` root (Google's gemma library writes none), QK-norms `_query_norm` (Gemma 3's name) or
    `query_norm` (the gemma library's Gemma 4 modules). Returns root (its params in root/tiny)."""
    import os
    import orbax.checkpoint as ocp
    tree = gc.kaggle_flax_tree(cfg, flat)["transformer"]
    for layer in tree.values():
        if "attn" in layer and qk == "query_norm":
            layer["attn"] = {{"_query_norm": "query_norm", "_key_norm": "key_norm"}.get(k, k): v
                             for k, v in layer["attn"].items()}
    tree = {"transformer": tree} if transformer_root else tree
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(os.path.join(root, "tiny")), tree)
    ckpt.wait_until_finished()
    ckpt.close()
    return root


SPELLINGS = {"root, query_norm": (True, "query_norm"), "no root, query_norm": (False, "query_norm"),
             "no root, _query_norm": (False, "_query_norm")}


@pytest.fixture(scope="module")
def as_written(ckpts, mesh, tmp_path_factory):
    """The E kind's flat params as loaded from the standard spelling (root, _query_norm), and the same model in
    each other spelling Google's loaders take."""
    cfg = gc.TINY4["e"]
    flat = gemma.random_params(cfg, seed=3)  # the params ckpts["e"] holds
    paths = {name: _respelled(cfg, flat, str(tmp_path_factory.mktemp("spelt")), transformer_root=r, qk=qk)
             for name, (r, qk) in SPELLINGS.items()}
    return weights.load(ckpts["e"], mesh, **gc.FLAX_OVERRIDES4["e"])[1], paths


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_each_of_googles_spellings_loads_and_samples_greedily_as_tunix_does(as_written, mesh, spelling):
    """tunix's Gemma 4 loader reads each spelling (its map_from_upstream_checkpoint); ours reads the same params
    from it, and greedy decoding through our KV cache picks the tokens tunix's forward pass picks."""
    cfg, (standard, paths) = gc.TINY4["e"], as_written
    ck, params = weights.load(paths[spelling], mesh, **gc.FLAX_OVERRIDES4["e"])
    assert ck.cfg == cfg and not ck.guessed and set(params) == set(standard)
    for name in standard:
        np.testing.assert_array_equal(np.asarray(params[name]), np.asarray(standard[name]), err_msg=name)
    prompt = [5, 17, 42, 9, 60]
    ours = gen.generate(cfg, params, prompt, gen.SampleConfig(max_new_tokens=4), mesh=mesh)
    assert ours == _greedy_reference(gc.tunix_gemma4(cfg, paths[spelling]), prompt, 4)


def test_a_spelling_no_loader_takes_is_one_line_naming_what_it_found(tmp_path):
    """Both QK-norm spellings at once, or QK-norms under a name Google's loaders do not use: refused in one line
    that names the names found, before any array is read."""
    import orbax.checkpoint as ocp
    cfg = gc.TINY4["dense"]
    tree = gc.kaggle_flax_tree(cfg, gemma.random_params(cfg, seed=1))["transformer"]

    def refusal(name: str) -> str:
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(str(tmp_path / name / "tiny"), tree)
        ckpt.wait_until_finished()
        ckpt.close()
        with pytest.raises(weights.UsageError) as e:
            weights.inspect(str(tmp_path / name))
        assert "\n" not in str(e.value), e.value
        return str(e.value)
    attn = tree["layer_0"]["attn"]
    attn["query_norm"] = attn["_query_norm"]  # two names, one parameter
    msg = refusal("both")
    assert "layer_0/attn/_query_norm/scale and layer_0/attn/query_norm/scale are the same parameter" in msg, msg
    for layer in tree.values():  # one name each, neither of Google's
        if isinstance(layer, dict) and "attn" in layer:
            layer["attn"].pop("query_norm", None)
            layer["attn"]["q_norm"] = layer["attn"].pop("_query_norm")
    msg = refusal("odd")
    assert "a gemma4 checkpoint of these shapes needs layer_0/attn/query_norm or layer_0/attn/_query_norm and 6 " \
           "more, which it does not have under any name Google's loaders use; found: " in msg, msg
    assert "layer_0/attn/q_norm" in msg, msg


def test_what_the_shapes_cannot_tell_is_named_and_taken_from_flags_or_a_config_beside_the_weights(tmp_path):
    """An E-like shape without the wider MLP in its kv-shared layers (what the loader finds them by) matches no
    named size: the window and the kv sharing are guessed, and said; --weights-config or gemma-config.json beside
    the weights set them (the flag wins), and nothing is guessed then."""
    import dataclasses
    import json
    cfg = dataclasses.replace(gc.TINY4["e"], shared_ff=0)
    root = gc.write_flax(str(tmp_path / "e"), cfg, gemma.random_params(cfg, seed=2))
    ck = weights.inspect(root)
    assert ck.guessed == ("sliding_window", "kv_shared_layers") and ck.cfg.kv_shared_layers == 0
    assert ck.guess_note() == (
        f"note: --weights {root}: its shapes match no named gemma4 size, so these are guessed: sliding_window=1024, "
        "kv_shared_layers=0; if they are wrong, pass --weights-config KEY=VALUE,... or put them in "
        "gemma-config.json beside the weights")
    told = weights.parse_config("sliding_window=4,kv_shared_layers=5")
    assert weights.inspect(root, **told).cfg == cfg and not weights.inspect(root, **told).guessed
    (tmp_path / "e" / "gemma-config.json").write_text(json.dumps({"sliding_window": 4, "kv_shared_layers": 5}))
    beside = weights.inspect(root)
    assert beside.cfg == cfg and not beside.guessed
    assert weights.inspect(root, sliding_window=6).cfg.sliding_window == 6  # the flag wins
    (tmp_path / "e" / "gemma-config.json").write_text(json.dumps({"window": 4}))
    with pytest.raises(weights.UsageError, match="gemma-config.json: window is not a constant the weights cannot "
                                                 "tell; use sliding_window"):
        weights.inspect(root)
    with pytest.raises(weights.UsageError, match="--weights-config: top_k=many: expected a number"):
        weights.parse_config("top_k=many")
    # --model, on `sample` as on `lora`: a family or a named size
    assert weights.check_model("gemma4") == weights.check_model("gemma4-e2b") == "gemma4"
    with pytest.raises(weights.UsageError, match=r"--model gemma5: choose a family \(gemma2, gemma3, gemma4\)"):
        weights.check_model("gemma5")
