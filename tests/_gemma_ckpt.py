"""Tiny random Gemma checkpoints in Kaggle's two layouts, written from our flat params, and Google's
implementation (tunix) loaded from the same files, for parity tests."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from trainer.gemma.export import flax_tree as kaggle_flax_tree, hf_tensors  # noqa: F401 (tests use both)
from trainer.models import gemma

# Sliding window shorter than the test sequences; Gemma 3 with 7 layers = one full 5:1 cycle + a local layer.
TINY = {
    "gemma2": gemma.GemmaConfig("gemma2", vocab=96, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                head_dim=16, ff=96, sliding_window=4, query_pre_attn_scalar=16.0),
    "gemma3": gemma.GemmaConfig("gemma3", vocab=96, d_model=64, n_layers=7, n_heads=4, n_kv_heads=1,
                                head_dim=16, ff=80, sliding_window=4, query_pre_attn_scalar=16.0,
                                global_rope_scale=8.0),
}
# What the flax layout cannot carry (no config file): the loader takes these as overrides.
FLAX_OVERRIDES = {f: dict(sliding_window=c.sliding_window, global_rope_scale=c.global_rope_scale)
                  for f, c in TINY.items()}

# Gemma 4, one tiny config per kind of size. Global heads twice as wide as local ones (how the loader finds the
# global layers); "e": the E sizes' 4:1 pattern, kv sharing over the last 5 of 10 layers (their sources: the
# last global and the last local layer before them) with a wider MLP there, per-layer embeddings; "dense": the
# 31B's k=v global layers with fewer kv heads; "moe": 26B-A4B's experts beside a dense MLP.
_G4 = gemma.GemmaConfig("gemma4", vocab=96, d_model=64, n_layers=7, n_heads=4, n_kv_heads=2, head_dim=16, ff=96,
                        sliding_window=4, query_pre_attn_scalar=1.0, global_head_dim=32)
TINY4 = {
    "e": dataclasses.replace(_G4, n_layers=10, n_kv_heads=1, pattern=(gemma.LOCAL,) * 4 + (gemma.GLOBAL,),
                             kv_shared_layers=5, shared_ff=192, per_layer_dim=8),
    "dense": dataclasses.replace(_G4, global_kv_heads=1, k_eq_v_global=True),
    "moe": dataclasses.replace(_G4, ff=48, global_kv_heads=1, k_eq_v_global=True, n_experts=8, top_k=2,
                               expert_ff=24),
}
FLAX_OVERRIDES4 = {k: dict(sliding_window=c.sliding_window, kv_shared_layers=c.kv_shared_layers, top_k=c.top_k)
                   for k, c in TINY4.items()}


def write_flax(root: str, cfg: gemma.GemmaConfig, flat: dict, variation: str = "tiny", mesh=None) -> str:
    """<root>/<variation>/ (Orbax params) as Kaggle ships it; returns root. With `mesh`, the arrays are saved
    sharded by the rules, so each array is stored in one chunk per shard (else one chunk per array)."""
    import jax
    import orbax.checkpoint as ocp
    from trainer.common.mesh import fitted_spec
    os.makedirs(root, exist_ok=True)
    tree = kaggle_flax_tree(cfg, flat)
    if mesh is not None:
        axes = {shape: ax for shape, ax in gemma.param_layout(cfg).values()}
        axes[(2, cfg.d_model, cfg.ff)] = (None, "fsdp", "mlp")  # Gemma 2's [2, D, F] gating

        def place(x):
            spec = fitted_spec(axes[x.shape], x.shape, dict(mesh.shape))
            return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        tree = jax.tree.map(place, tree)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(os.path.join(root, variation)), tree)
    ckpt.wait_until_finished()
    ckpt.close()
    return root


def hf_config(cfg: gemma.GemmaConfig) -> dict:
    if cfg.family == "gemma4":
        text = dict(
            model_type="gemma4_text", hidden_size=cfg.d_model, intermediate_size=cfg.ff,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, global_head_dim=cfg.global_head_dim or cfg.head_dim,
            num_global_key_value_heads=cfg.global_kv_heads or None, attention_k_eq_v=cfg.k_eq_v_global,
            num_kv_shared_layers=cfg.kv_shared_layers, use_double_wide_mlp=cfg.shared_ff == 2 * cfg.ff,
            hidden_size_per_layer_input=cfg.per_layer_dim, vocab_size=cfg.vocab, vocab_size_per_layer_input=cfg.vocab,
            sliding_window=cfg.sliding_window, final_logit_softcapping=30.0,
            layer_types=["sliding_attention" if t == gemma.LOCAL else "full_attention" for t in cfg.layer_types],
            enable_moe_block=bool(cfg.n_experts), num_experts=cfg.n_experts or None,
            top_k_experts=cfg.top_k or None, moe_intermediate_size=cfg.expert_ff or None, torch_dtype="float32")
        return dict(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", text_config=text)
    common = dict(hidden_size=cfg.d_model, intermediate_size=cfg.ff, num_hidden_layers=cfg.n_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                  vocab_size=cfg.vocab, sliding_window=cfg.sliding_window,
                  query_pre_attn_scalar=cfg.query_pre_attn_scalar, torch_dtype="float32")
    if cfg.family == "gemma2":
        return dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, rope_theta=10000.0, **common)
    scaling = {"rope_type": "linear", "factor": cfg.global_rope_scale} if cfg.global_rope_scale != 1 else None
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", rope_theta=1000000.0,
                rope_local_base_freq=10000.0, rope_scaling=scaling, sliding_window_pattern=6, **common)


def write_hf(root: str, cfg: gemma.GemmaConfig, flat: dict, shards: int = 2) -> str:
    """model-0000N-of-0000M.safetensors + model.safetensors.index.json + config.json; returns root."""
    from safetensors.numpy import save_file
    os.makedirs(root, exist_ok=True)
    tensors = hf_tensors(cfg, flat)
    names = sorted(tensors)
    weight_map = {}
    for j in range(shards):
        fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[j::shards]}
        save_file(part, os.path.join(root, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f)
    return root


def tunix_model(cfg: gemma.GemmaConfig, path: str, layout: str):
    """Google's implementation (tunix) of `cfg`, loaded by tunix's own loaders from `path`, in f32."""
    import jax.numpy as jnp
    if cfg.family == "gemma2":
        from tunix.models.gemma import model as tm, params as tp, params_safetensors as ts
        types = tuple(tm.AttentionType.LOCAL_SLIDING if t == gemma.LOCAL else tm.AttentionType.GLOBAL
                      for t in cfg.layer_types)
        tcfg = tm.ModelConfig(num_layers=cfg.n_layers, num_embed=cfg.vocab, embed_dim=cfg.d_model,
                              hidden_dim=cfg.ff, num_heads=cfg.n_heads, head_dim=cfg.head_dim,
                              num_kv_heads=cfg.n_kv_heads, final_logit_softcap=30.0, use_post_attn_norm=True,
                              use_post_ffw_norm=True, attention_types=types, attn_logits_soft_cap=50.0,
                              sliding_window_size=cfg.sliding_window)
        if layout == "flax":
            # tunix's flax loader takes only named configs: register the tiny one under a version name.
            tm.ModelConfig.gemma2_tiny = classmethod(lambda cls: tcfg)
            params = tp.load_and_format_params(os.path.abspath(os.path.join(path, "tiny")))
            return tm.Gemma.from_params(params, version="2-tiny")
        return ts.create_model_from_safe_tensors(path, tcfg, dtype=jnp.float32)
    from tunix.models.gemma3 import model as tm, params as tp, params_safetensors as ts
    by_width = cfg.query_pre_attn_scalar == cfg.d_model // cfg.n_heads != cfg.head_dim  # as the 27b sizes
    norm = tm.QueryPreAttentionNormalisation
    tcfg = tm.ModelConfig(num_layers=cfg.n_layers, num_embed=cfg.vocab, embed_dim=cfg.d_model,
                          hidden_dim=cfg.ff, num_heads=cfg.n_heads, head_dim=cfg.head_dim,
                          num_kv_heads=cfg.n_kv_heads, sliding_window_size=cfg.sliding_window,
                          local_base_frequency=10_000, global_base_frequency=1_000_000,
                          global_scale_factor=cfg.global_rope_scale, param_dtype=jnp.float32,
                          query_pre_attn_norm=norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS if by_width
                          else norm.BY_ONE_OVER_SQRT_HEAD_DIM)
    if layout == "flax":
        return tp.create_model_from_checkpoint(os.path.abspath(os.path.join(path, "tiny")), tcfg,
                                               dtype=jnp.float32)
    return ts.create_model_from_safe_tensors(path, tcfg, dtype=jnp.float32)


def tunix_gemma4(cfg: gemma.GemmaConfig, path: str, layout: str = "flax"):
    """Google's Gemma 4 (tunix) of `cfg`, loaded by tunix's loader for `layout` (Kaggle's flax checkpoint, or
    the transformers framework's safetensors) from `path`."""
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as tm, params as tp, params_safetensors as ts
    pattern = tuple(tm.AttentionType.GLOBAL if t == gemma.GLOBAL else tm.AttentionType.LOCAL_SLIDING
                    for t in (cfg.pattern or cfg.fam.pattern))
    tcfg = tm.ModelConfig(
        num_layers=cfg.n_layers, num_embed=cfg.vocab, embed_dim=cfg.d_model, hidden_dim=cfg.ff,
        num_heads=cfg.n_heads, head_dim=cfg.head_dim, num_kv_heads=cfg.n_kv_heads,
        sliding_window_size=cfg.sliding_window, per_layer_input_dim=cfg.per_layer_dim,
        num_global_kv_heads=cfg.global_kv_heads or None, global_key_size=cfg.global_head_dim,
        attention_pattern=pattern, frac_shared_layers=cfg.kv_shared_layers / cfg.n_layers,
        k_eq_v_global=cfg.k_eq_v_global, override_kv_shared_ffw_hidden=cfg.shared_ff or None,
        enable_moe=bool(cfg.n_experts), num_experts=cfg.n_experts or None, num_experts_per_tok=cfg.top_k or None,
        expert_dim=cfg.expert_ff or None, moe_dense_hidden_dim=cfg.ff if cfg.n_experts else None,
        param_dtype=jnp.float32, use_sliding_window_kv_cache=False)
    if layout == "transformers":
        return ts.create_model_from_safe_tensors(path, tcfg, dtype=jnp.float32)
    return tp.create_model_from_checkpoint(os.path.abspath(os.path.join(path, "tiny")), tcfg, dtype=jnp.float32)


def tunix_logits_jax(model, tokens):
    """Google's causal forward pass over int tokens [B, T] (traceable)."""
    import jax.numpy as jnp
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    logits, _ = model(jnp.asarray(tokens), positions, None, mask)
    return logits


def tunix_logits(model, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(tunix_logits_jax(model, tokens))


TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
"""


def write_tokenizer(path: str, vocab: int) -> str:
    """A small sentencepiece model with Gemma's special ids (pad 0, eos 1, bos 2, unk 3, turn markers)."""
    import io
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines() * 20), model_writer=buf, vocab_size=vocab, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        add_dummy_prefix=False, minloglevel=2)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


def tiny_gemma_on_gcs(tmp_path, monkeypatch):
    """TINY["gemma2"] (seed 2) in Kaggle's flax layout, pulled by `weights pull` from the Kaggle stand-in into
    gs://e2e/gemma on a GCS emulator started here, whose variables (and Kaggle's) monkeypatch sets. The stand-in
    is stopped once pulled: what runs after reads gs:// only. Returns the emulator; the caller stops it."""
    from infra import gcs
    from infra.fake_kaggle import FakeKaggle
    from orchestrator.artifacts import weights
    cfg = TINY["gemma2"]
    vdir = tmp_path / "kaggle" / "google/gemma-2/flax/tiny/1"
    write_flax(str(vdir), cfg, gemma.random_params(cfg, seed=2))
    write_tokenizer(str(vdir / "tokenizer.model"), cfg.vocab)
    emu = gcs.start(home=tmp_path / "home", buckets=("e2e",), record=False)
    fake = FakeKaggle(tmp_path / "kaggle", {"alice": "key"})
    try:
        url = fake.start()
        for k, v in {**emu.env, "KAGGLE_USERNAME": "alice", "KAGGLE_KEY": "key",
                     "KAGGLEHUB_CACHE": str(tmp_path / "kh")}.items():
            monkeypatch.setenv(k, v)
        weights.pull("google/gemma-2/flax/tiny/1", "gs://e2e/gemma", endpoint=url, say=lambda m: None,
                     progress=False)
    except BaseException:
        emu.stop()
        raise
    finally:
        fake.stop()
    return emu
