"""Tiny random Gemma checkpoints in Kaggle's two layouts, written from our flat params, and Google's
implementation (tunix) loaded from the same files, for parity tests."""
from __future__ import annotations

import json
import os

import numpy as np

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


def kaggle_flax_tree(cfg: gemma.GemmaConfig, flat: dict) -> dict:
    """Our flat params -> the Orbax tree of a Kaggle flax checkpoint (Gemma 2 2b keeps gating [2, D, F])."""
    a = {k: np.asarray(v) for k, v in flat.items()}
    t = {"transformer/embedder": {"input_embedding": a["embed"]}, "transformer/final_norm": {"scale": a["final_norm"]}}
    for i in range(cfg.n_layers):
        p, s = f"transformer/layer_{i}/", f"layers.{i}."
        gating = a[s + "gating"]
        if cfg.family == "gemma2":
            gating = np.ascontiguousarray(gating.transpose(0, 2, 1))
        if cfg.n_heads == cfg.n_kv_heads:  # multi-head attention: q, k, v in one [3, H, D, hd] einsum
            t[p + "attn/qkv_einsum"] = {"w": np.concatenate([a[s + "q"][None], a[s + "kv"]])}
        else:
            t[p + "attn/q_einsum"] = {"w": a[s + "q"]}
            t[p + "attn/kv_einsum"] = {"w": a[s + "kv"]}
        t.update({
            p + "attn/attn_vec_einsum": {"w": a[s + "o"]}, p + "mlp/gating_einsum": {"w": gating},
            p + "mlp/linear": {"w": a[s + "linear"]},
            p + "pre_attention_norm": {"scale": a[s + "pre_attn_norm"]},
            p + "post_attention_norm": {"scale": a[s + "post_attn_norm"]},
            p + "pre_ffw_norm": {"scale": a[s + "pre_ffw_norm"]},
            p + "post_ffw_norm": {"scale": a[s + "post_ffw_norm"]},
        })
        if cfg.fam.qk_norm:
            t[p + "attn/_query_norm"] = {"scale": a[s + "q_norm"]}
            t[p + "attn/_key_norm"] = {"scale": a[s + "k_norm"]}
    return t


def write_flax(root: str, cfg: gemma.GemmaConfig, flat: dict, variation: str = "tiny", mesh=None) -> str:
    """<root>/<variation>/ (Orbax params) as Kaggle ships it; returns root. With `mesh`, the arrays are saved
    sharded by the rules, so each array is stored in one chunk per shard (else one chunk per array)."""
    import jax
    import orbax.checkpoint as ocp
    from trainer.mesh import fitted_spec
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


def hf_tensors(cfg: gemma.GemmaConfig, flat: dict) -> dict[str, np.ndarray]:
    a = {k: np.asarray(v) for k, v in flat.items()}
    h, k, d, hd = cfg.n_heads, cfg.n_kv_heads, cfg.d_model, cfg.head_dim
    out = {"model.embed_tokens.weight": a["embed"], "model.norm.weight": a["final_norm"]}
    for i in range(cfg.n_layers):
        p, s = f"model.layers.{i}.", f"layers.{i}."
        kv = a[s + "kv"]
        out.update({
            p + "self_attn.q_proj.weight": a[s + "q"].transpose(0, 2, 1).reshape(h * hd, d),
            p + "self_attn.k_proj.weight": kv[0].transpose(0, 2, 1).reshape(k * hd, d),
            p + "self_attn.v_proj.weight": kv[1].transpose(0, 2, 1).reshape(k * hd, d),
            p + "self_attn.o_proj.weight": a[s + "o"].transpose(2, 0, 1).reshape(d, h * hd),
            p + "mlp.gate_proj.weight": a[s + "gating"][0], p + "mlp.up_proj.weight": a[s + "gating"][1],
            p + "mlp.down_proj.weight": a[s + "linear"].T,
            p + "input_layernorm.weight": a[s + "pre_attn_norm"],
            p + "post_attention_layernorm.weight": a[s + "post_attn_norm"],
            p + "pre_feedforward_layernorm.weight": a[s + "pre_ffw_norm"],
            p + "post_feedforward_layernorm.weight": a[s + "post_ffw_norm"],
        })
        if cfg.fam.qk_norm:
            out[p + "self_attn.q_norm.weight"] = a[s + "q_norm"]
            out[p + "self_attn.k_norm.weight"] = a[s + "k_norm"]
    return {n: np.ascontiguousarray(v) for n, v in out.items()}


def hf_config(cfg: gemma.GemmaConfig) -> dict:
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


def tunix_logits(model, tokens: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    logits, _ = model(jnp.asarray(tokens), positions, None, mask)
    return np.asarray(logits)


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
