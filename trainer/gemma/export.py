"""`python -m trainer export`: fine-tuned adapters out of a LoRA checkpoint dir, merged or on their own.

--merge: base + scale * A @ B in the layout the base came in, so the same loader (trainer/gemma/weights.py) and,
  for safetensors, Hugging Face tools read it: Kaggle flax (an Orbax params dir under OUT, the source's
  qkv fusion and gating orientation kept) or transformers (model.safetensors + the source's config.json).
  The tokenizer files beside the base are copied.
--adapters-only: adapter_model.safetensors + adapter_config.json as PEFT writes them: per module
  `base_model.model.model.layers.{i}.{self_attn|mlp}.{x}_proj.lora_A.weight` [r, in] and `lora_B.weight`
  [out, r] in Hugging Face's flattening of heads, with W' = W + (lora_alpha / r) * B @ A.
"""
from __future__ import annotations

import json
import os

import fsspec
import jax
import numpy as np
from jax.experimental import multihost_utils

from trainer.finetune import train as finetune
from trainer.gemma import tokenizer as tok_lib
from trainer.gemma import weights
from trainer.common import mesh as mesh_lib
from trainer.common.config import UsageError
from trainer.models import gemma, lora as lora_lib


def flax_tree(cfg: gemma.GemmaConfig, flat: dict, fused: bool | None = None, gating_df: bool | None = None,
              nested: bool | None = None) -> dict:
    """Our flat params -> the Orbax tree of a Kaggle flax checkpoint (weights.flax_names). fused: q, k, v in one
    [3, H, D, hd] einsum (default when heads == kv heads, before Gemma 4); gating_df: gating stored [2, D, F]
    (default for Gemma 2); nested: a level per name, as Gemma 4 ships (default for Gemma 4; else one level
    under 'transformer/layer_i/...' keys)."""
    nested = cfg.family == "gemma4" if nested is None else nested
    a = {k: np.asarray(v) for k, v in flat.items()}
    fused = cfg.n_heads == cfg.n_kv_heads and cfg.family != "gemma4" if fused is None else fused
    gating_df = cfg.family == "gemma2" if gating_df is None else gating_df
    t: dict[str, dict] = {}
    for ours, (key, leaf) in weights.flax_names(cfg, fused).items():
        x = a[ours]
        if ours.endswith(".gating") and gating_df:
            x = np.ascontiguousarray(x.transpose(0, 2, 1))
        elif fused and ours.endswith(".q"):
            x = np.concatenate([x[None], a[ours[:-1] + "kv"]])
        elif fused and ours.endswith(".kv"):
            continue  # written with q
        elif key.endswith("attn/k_einsum"):
            x = x[0]
        weights._at(t, key, leaf, nested, x)
    return t


def hf_tensors(cfg: gemma.GemmaConfig, flat: dict) -> dict[str, np.ndarray]:
    """Our flat params -> Hugging Face Gemma tensors (matrices [out, in], heads flattened head-major)."""
    if cfg.family == "gemma4":
        return _hf_tensors4(cfg, flat)
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


def _hf_tensors4(cfg: gemma.GemmaConfig, flat: dict) -> dict[str, np.ndarray]:
    """Gemma 4 as Hugging Face's Gemma4ForConditionalGeneration names its text model (the layout Kaggle's
    transformers framework serves): per-layer tables flattened [V, L*P], experts [E, 2 Fe, D] and [E, D, Fe]."""
    a = {k: np.asarray(v) for k, v in flat.items()}
    h, d, n = cfg.n_heads, cfg.d_model, cfg.n_layers
    m = "model.language_model."
    out = {m + "embed_tokens.weight": a["embed"], m + "norm.weight": a["final_norm"]}
    if cfg.per_layer_dim:
        out.update({m + "embed_tokens_per_layer.weight": a["ple_embed"].reshape(cfg.vocab, -1),
                    m + "per_layer_model_projection.weight": a["ple_in"].transpose(1, 2, 0).reshape(-1, d),
                    m + "per_layer_projection_norm.weight": a["ple_in_norm"]})
    for i in range(n):
        p, s = f"{m}layers.{i}.", f"layers.{i}."
        k, hd, _ = cfg.attn_dims(i)
        kv = a[s + "kv"]
        out.update({
            p + "self_attn.q_proj.weight": a[s + "q"].transpose(0, 2, 1).reshape(h * hd, d),
            p + "self_attn.k_proj.weight": kv[0].transpose(0, 2, 1).reshape(k * hd, d),
            p + "self_attn.o_proj.weight": a[s + "o"].transpose(2, 0, 1).reshape(d, h * hd),
            p + "self_attn.q_norm.weight": a[s + "q_norm"], p + "self_attn.k_norm.weight": a[s + "k_norm"],
            p + "mlp.gate_proj.weight": a[s + "gating"][0], p + "mlp.up_proj.weight": a[s + "gating"][1],
            p + "mlp.down_proj.weight": a[s + "linear"].T, p + "layer_scalar": a[s + "skip_scale"],
            p + "input_layernorm.weight": a[s + "pre_attn_norm"],
            p + "post_attention_layernorm.weight": a[s + "post_attn_norm"],
            p + "pre_feedforward_layernorm.weight": a[s + "pre_ffw_norm"],
            p + "post_feedforward_layernorm.weight": a[s + "post_ffw_norm"],
        })
        if kv.shape[0] == 2:
            out[p + "self_attn.v_proj.weight"] = kv[1].transpose(0, 2, 1).reshape(k * hd, d)
        if cfg.per_layer_dim:
            out.update({p + "per_layer_input_gate.weight": a[s + "ple_gate"].T,
                        p + "per_layer_projection.weight": a[s + "ple_proj"].T,
                        p + "post_per_layer_input_norm.weight": a[s + "ple_norm"]})
        if cfg.n_experts:
            g = a[s + "experts_gating"]
            out.update({p + "post_feedforward_layernorm_1.weight": a[s + "post_mlp_norm"],
                        p + "pre_feedforward_layernorm_2.weight": a[s + "pre_moe_norm"],
                        p + "post_feedforward_layernorm_2.weight": a[s + "post_moe_norm"],
                        p + "router.proj.weight": a[s + "router"].T, p + "router.scale": a[s + "router_scale"],
                        p + "router.per_expert_scale": a[s + "expert_scale"],
                        p + "experts.gate_up_proj": g.reshape(g.shape[0], -1, d),
                        p + "experts.down_proj": a[s + "experts_linear"].transpose(0, 2, 1)})
    return {name: np.ascontiguousarray(v) for name, v in out.items()}


def peft_tensors(lc: lora_lib.LoraConfig, lora: dict, family: str = "gemma2") -> dict[str, np.ndarray]:
    """Our adapters -> PEFT's lora_A [r, in] / lora_B [out, r], in and out flattened as HF flattens heads, under
    the module path of the family's Hugging Face model (Gemma 4's text model: model.language_model)."""
    experts = [t for t in lc.targets if lora_lib.TARGETS[t].experts]
    if experts:
        raise UsageError(f"adapters on {','.join(experts)}: PEFT has no layout for per-expert adapters; export them "
                         "merged (--merge)")
    out = {}
    for name, a in lora.items():
        _, i, target, which = name.split(".")
        x = np.asarray(a, np.float32)
        mat = x.reshape(-1, lc.rank).T if which == "a" else x.reshape(lc.rank, -1).T
        model = "model.language_model" if family == "gemma4" else "model"
        key = f"base_model.model.{model}.layers.{i}.{lora_lib.TARGETS[target].hf}.lora_{which.upper()}.weight"
        out[key] = np.ascontiguousarray(mat)
    return out


def peft_config(lc: lora_lib.LoraConfig, base: str) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lc.rank,
            "lora_alpha": lc.alpha, "lora_dropout": lc.dropout, "bias": "none", "fan_in_fan_out": False,
            "target_modules": [lora_lib.TARGETS[t].hf.split(".")[-1] for t in lc.targets]}


def _gather(tree: dict) -> dict:
    return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in tree.items()}


def _copy_tokenizer(root: str, out: str) -> None:
    path = tok_lib.find(root)
    if path:
        with fsspec.open(path, "rb") as src, fsspec.open(f"{out.rstrip('/')}/{path.rsplit('/', 1)[-1]}", "wb") as dst:
            dst.write(src.read())


def export(weights_path: str, adapters: str, out: str, *, merge: bool, mesh_spec: str = "", step: int | None = None) -> str:
    """Write the merged model or the PEFT adapters of `adapters` (on the base at `weights_path`) to `out`."""
    fs, p = fsspec.core.url_to_fs(out)
    if fs.exists(p) and fs.ls(p):
        raise UsageError(f"--out {out} is not empty; pass a new directory (nothing is overwritten)")
    mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh(mesh_spec, jax.device_count()))
    ck = weights.inspect(weights_path)
    lc, lora = finetune.load_adapters(adapters, ck.cfg, mesh, step)
    primary = jax.process_index() == 0
    if not merge:
        host = _gather(lora)  # every process takes part in the gather
        if primary:
            from safetensors.numpy import save
            fs.makedirs(p, exist_ok=True)
            with fs.open(f"{p}/adapter_model.safetensors", "wb") as f:
                f.write(save(peft_tensors(lc, host, ck.cfg.family), metadata={"format": "pt"}))
            with fs.open(f"{p}/adapter_config.json", "w") as f:
                json.dump(peft_config(lc, weights_path), f, indent=1)
        return "peft"
    _, base = weights.load(weights_path, mesh)
    merged = lora_lib.merge(ck.cfg, lc, base, lora)
    if ck.layout == "flax":
        import orbax.checkpoint as ocp
        meta = weights._flax_meta(ck.path)
        fused = "transformer/layer_0/attn/qkv_einsum" in meta
        g = tuple(meta["transformer/layer_0/mlp/gating_einsum"]["w"].shape)
        tree = flax_tree(ck.cfg, _gather(merged), fused=fused, gating_df=g[1] == ck.cfg.d_model != ck.cfg.ff,
                         nested=weights.is_nested(ck.path))
        target = out.rstrip("/") + "/" + ck.path.rstrip("/").rsplit("/", 1)[-1]
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(target if "://" in target else os.path.abspath(target), tree)
        ckpt.wait_until_finished()
        ckpt.close()
    else:
        host = _gather(merged)
        if primary:
            from safetensors.numpy import save
            fs.makedirs(p, exist_ok=True)
            with fs.open(f"{p}/model.safetensors", "wb") as f:
                f.write(save(hf_tensors(ck.cfg, host), metadata={"format": "pt"}))
            src_fs, src = fsspec.core.url_to_fs(ck.path)
            with src_fs.open(f"{src}/config.json", "rb") as a, fs.open(f"{p}/config.json", "wb") as b:
                b.write(a.read())
    if primary:
        _copy_tokenizer(ck.root, out)
    return ck.layout
