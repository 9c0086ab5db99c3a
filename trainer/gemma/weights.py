"""Gemma weights in Kaggle's two layouts -> sharded params on the mesh, each process reading its slices.

- flax: an Orbax params dir beside `tokenizer.model`, its keys `transformer/layer_i/...` one level deep
  (Gemma 2, 3) or the same path nested a level per name (Gemma 4: transformer -> layer_i -> attn -> ...). Every
  spelling Google's own loaders take is read (tunix's Gemma 4 loader, gemma4/params.py): the `transformer` root or
  none (Google's gemma library writes none), and Gemma 4's QK-norms as `attn/query_norm` (that library) or
  `attn/_query_norm` (Gemma 3's name). What the shapes cannot tell (the window; for Gemma 4 an E size's kv sharing
  without a wider MLP, experts per token) comes from the named size with those shapes, else from --weights-config
  or a `gemma-config.json` beside the weights, else a default the run names (Checkpoint.guessed). Restored by
  Orbax/tensorstore with the target shardings, so each process fetches only the chunks its devices hold.
  Chunks are what the checkpoint was written with: an array saved from one host is one chunk, which every
  process reads whole (one array at a time, never the whole model at once).
- transformers: `*.safetensors` (Hugging Face names, matrices stored [out, in]) with `config.json`.
  Read with byte-range requests: each device's block is assembled from the rows (or row pieces) it
  needs, never from a whole tensor (`on_read` sees every request).

Both work on a local path or gs:// (fsspec/gcsfs and tensorstore, pointed at an emulator by the same
environment variables as checkpoints). The sizes come from the arrays' shapes; the family from which
parameters exist (Gemma 3 has QK-norm, Gemma 2 post-norms without it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass
from typing import Callable

import fsspec
import jax
import jax.numpy as jnp
import numpy as np

from trainer.common.config import UsageError
from trainer.models import gemma

MANIFEST = "tpuctl-manifest.json"  # written last by `tpuctl weights pull` (orchestrator/artifacts/weights.py)
CONFIG_FILE = "gemma-config.json"  # beside the weights: the constants a flax checkpoint's shapes cannot tell
# Those constants, per family (--weights-config KEY=VALUE,... and CONFIG_FILE set them; types as GemmaConfig's).
UNTOLD = {"gemma2": ("sliding_window", "query_pre_attn_scalar"),
          "gemma3": ("sliding_window", "query_pre_attn_scalar", "global_rope_scale"),
          "gemma4": ("sliding_window", "kv_shared_layers", "top_k")}
_UNTOLD_TYPES = {"sliding_window": int, "query_pre_attn_scalar": float, "global_rope_scale": float,
                 "kv_shared_layers": int, "top_k": int}
# Google's gemma library names Gemma 4's QK-norms without the underscore Gemma 3's checkpoints have.
_QK_NORMS = {"query_norm": "_query_norm", "key_norm": "_key_norm"}
# Test hook: called as on_read(tensor_name, n_bytes) for every byte range read from a safetensors file.
on_read: Callable[[str, int], None] | None = None

# A block narrower than its rows is read one range per row, up to this many rows; past that, in whole-row
# groups of at most GROUP_BYTES (more bytes fetched, far fewer requests, memory still bounded).
MAX_ROW_REQUESTS = 4096
GROUP_BYTES = 64 << 20
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}
_NORMS = {"pre_attn_norm": "pre_attention_norm", "post_attn_norm": "post_attention_norm",
          "pre_ffw_norm": "pre_ffw_norm", "post_ffw_norm": "post_ffw_norm"}
_HF_NORMS = {"pre_attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class Checkpoint:
    path: str           # the params dir (flax) or the folder of *.safetensors (transformers)
    layout: str         # "flax" | "transformers"
    root: str           # the folder as given (where tokenizer files live)
    cfg: gemma.GemmaConfig
    guessed: tuple[str, ...] = ()  # the cfg fields that are defaults: no named size, flag or config file told them

    def guess_note(self) -> str:
        """One line naming what was guessed and how to set it ("" when nothing was)."""
        if not self.guessed:
            return ""
        vals = ", ".join(f"{k}={getattr(self.cfg, k)}" for k in self.guessed)
        return (f"note: --weights {self.root}: its shapes match no named {self.cfg.family} size, so these are "
                f"guessed: {vals}; if they are wrong, pass --weights-config KEY=VALUE,... or put them in "
                f"{CONFIG_FILE} beside the weights")


def parse_config(text, where: str = "--weights-config") -> dict:
    """KEY=VALUE,... (or a dict, as CONFIG_FILE holds) -> the constants it sets, typed; one line when wrong."""
    items = text.items() if isinstance(text, dict) else \
        [kv.partition("=")[::2] for kv in (text or "").split(",") if kv.strip()]
    out = {}
    for k, v in items:
        k = str(k).strip().replace("-", "_")
        if k not in _UNTOLD_TYPES:
            raise UsageError(f"{where}: {k or '(empty)'} is not a constant the weights cannot tell; use "
                             f"{', '.join(_UNTOLD_TYPES)}")
        try:
            out[k] = _UNTOLD_TYPES[k](str(v).strip())
        except ValueError:
            raise UsageError(f"{where}: {k}={str(v).strip()}: expected a number") from None
    return out


def config_beside(params_path: str) -> dict:
    """CONFIG_FILE in the params dir or the folder above it (where Kaggle's tokenizer is), parsed; {} if none."""
    fs, p = _fs(params_path)
    for d in (p.rstrip("/"), p.rstrip("/").rsplit("/", 1)[0]):
        f = _join(d, CONFIG_FILE)
        if fs.exists(f):
            try:
                data = json.loads(fs.cat(f))
            except ValueError as e:
                raise UsageError(f"{f}: not JSON ({e})") from None
            if not isinstance(data, dict):
                raise UsageError(f"{f}: expected an object of constants, e.g. {{\"sliding_window\": 512}}")
            return parse_config(data, f)
    return {}


def _fs(path: str):
    fs, p = fsspec.core.url_to_fs(path)
    return fs, p


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _is_orbax_dir(fs, p: str) -> bool:
    return fs.exists(_join(p, "_METADATA")) or fs.exists(_join(p, "_CHECKPOINT_METADATA"))


def locate(path: str) -> tuple[str, str]:
    """(layout, params path) of the checkpoint at `path`: a safetensors folder, an Orbax params dir, or a
    folder holding one Orbax params dir (Kaggle's flax layout)."""
    if "://" not in path:
        path = os.path.abspath(path)
    fs, p = _fs(path)
    if not fs.exists(p):
        raise UsageError(f"--weights {path} does not exist; pull a model with `tpuctl weights pull HANDLE --to "
                         "gs://BUCKET/PREFIX` and pass that gs:// path (or a local download)")
    if not fs.isdir(p):
        raise UsageError(f"--weights {path} is a file; pass the folder that holds the checkpoint")
    if path.startswith("gs://") and not any(fs.exists(f"{d}/{MANIFEST}") for d in (p.rstrip("/"), p.rstrip("/").rsplit("/", 1)[0])):
        raise UsageError(f"--weights {path}: no {MANIFEST} there, so the `tpuctl weights pull` that staged it did "
                         "not finish; run the same pull again (it resumes)")
    entries = fs.ls(p, detail=True)
    if any(e["name"].endswith(".safetensors") for e in entries):
        return "transformers", path
    if _is_orbax_dir(fs, p):
        return "flax", path
    subs = [e["name"] for e in entries if e["type"] == "directory" and _is_orbax_dir(fs, e["name"])]
    if len(subs) == 1:
        return "flax", path.rstrip("/") + "/" + subs[0].rstrip("/").rsplit("/", 1)[-1]
    names = sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries)[:8]
    raise UsageError(f"--weights {path}: no Gemma checkpoint there (no *.safetensors, no Orbax params dir; "
                     f"found: {', '.join(names) or 'nothing'}); pass the folder `tpuctl weights pull` staged")


# ---------------------------------------------------------------- flax (Orbax params dir)

_FLAX_GEMMA4 = {  # per layer: ours -> (module under transformer/layer_i, leaf)
    "post_mlp_norm": ("dense_post_ffw_norm", "scale"), "pre_moe_norm": ("moe_pre_ffw_norm", "scale"),
    "post_moe_norm": ("moe_post_ffw_norm", "scale"), "router": ("moe", "router_logits"),
    "router_scale": ("moe", "router_scale"), "expert_scale": ("moe", "per_expert_scale"),
    "experts_gating": ("moe", "gating_einsum"), "experts_linear": ("moe", "linear"),
    "ple_gate": ("per_layer_input_gate", "w"), "ple_proj": ("per_layer_projection", "w"),
    "ple_norm": ("post_per_layer_input_norm", "scale"), "skip_scale": ("", "skip_scale"),
}


def flax_names(cfg: gemma.GemmaConfig, fused: bool = False) -> dict[str, tuple[str, str]]:
    """Our flat name -> (Orbax key, leaf) in a Kaggle flax checkpoint. Gemma 4's global layers with one k=v
    projection hold it as attn/k_einsum [K, D, hd] (ours: kv [1, K, D, hd])."""
    out = {"embed": ("transformer/embedder", "input_embedding"), "final_norm": ("transformer/final_norm", "scale")}
    if cfg.per_layer_dim:
        out.update({"ple_embed": ("transformer/embedder", "per_layer_embeddings"),
                    "ple_in": ("transformer/embedder/per_layer_model_projection", "w"),
                    "ple_in_norm": ("transformer/embedder/per_layer_projection_norm", "scale")})
    lay = gemma.param_layout(cfg)
    for i in range(cfg.n_layers):
        p = f"transformer/layer_{i}/"
        out[f"layers.{i}.q"] = (p + ("attn/qkv_einsum" if fused else "attn/q_einsum"), "w")
        kv = "attn/qkv_einsum" if fused else "attn/k_einsum" if cfg.attn_dims(i)[2] == 1 else "attn/kv_einsum"
        out[f"layers.{i}.kv"] = (p + kv, "w")
        out[f"layers.{i}.o"] = (p + "attn/attn_vec_einsum", "w")
        out[f"layers.{i}.gating"] = (p + "mlp/gating_einsum", "w")
        out[f"layers.{i}.linear"] = (p + "mlp/linear", "w")
        for ours, theirs in _NORMS.items():
            out[f"layers.{i}.{ours}"] = (p + theirs, "scale")
        if cfg.fam.qk_norm:
            out[f"layers.{i}.q_norm"] = (p + "attn/_query_norm", "scale")
            out[f"layers.{i}.k_norm"] = (p + "attn/_key_norm", "scale")
        for ours, (module, leaf) in _FLAX_GEMMA4.items():
            if f"layers.{i}.{ours}" in lay:
                out[f"layers.{i}.{ours}"] = ((p + module).rstrip("/"), leaf)
    return out


def _family(found: set[str], where: str) -> str:
    """Gemma 4 has a scalar per layer; Gemma 3 QK-norm; Gemma 2 post-attention/post-ffw norms without it."""
    if "skip_scale" in found and "q_norm" in found:
        return "gemma4"
    if "q_norm" in found and "post_ffw_norm" in found:
        return "gemma3"
    if "post_ffw_norm" in found and "post_attn_norm" in found and "q_norm" not in found:
        return "gemma2"
    raise UsageError(f"{where}: matches no known Gemma family (Gemma 2: post-norms; Gemma 3: post-norms + "
                     f"QK-norm; Gemma 4: QK-norm + a scalar per layer); found layer params: "
                     f"{', '.join(sorted(found)) or 'none'}")


def _canonical(path: tuple[str, ...]) -> str:
    """A module's path in the checkpoint's tree -> our key for it: 'transformer/layer_0/attn/_query_norm' whether
    the tree has the transformer root or not, is one level deep or nested, and spells the QK-norms either way."""
    parts = [x for seg in path for x in seg.split("/")]
    if parts and parts[0] == "transformer":
        parts = parts[1:]
    if parts:
        parts[-1] = _QK_NORMS.get(parts[-1], parts[-1])
    return "/".join(["transformer", *parts])


def _flax_tree(params_path: str) -> tuple[dict[str, dict], dict[tuple[str, str], tuple[str, ...]]]:
    """(our key ('transformer/layer_0/attn/q_einsum') -> {leaf: array metadata}, (our key, leaf) -> the leaf's path
    of names in the checkpoint's own tree). Two names for one parameter (both QK-norm spellings) are refused."""
    import orbax.checkpoint as ocp
    meta = ocp.PyTreeCheckpointer().metadata(params_path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    out: dict[str, dict] = {}
    paths: dict[tuple[str, str], tuple[str, ...]] = {}

    def walk(node, path):
        for k, v in node.items():
            if isinstance(v, dict) or hasattr(v, "items"):
                walk(v, path + (k,))
            elif path:
                key = _canonical(path)
                if (key, k) in paths:
                    raise UsageError(f"--weights {params_path}: {'/'.join(paths[key, k])} and "
                                     f"{'/'.join(path + (k,))} are the same parameter; keep one")
                out.setdefault(key, {})[k] = v
                paths[key, k] = path + (k,)
    walk(tree, ())
    return out, paths


def _flax_meta(params_path: str) -> dict[str, dict]:
    """Our key ('transformer/layer_0/attn/q_einsum') -> {leaf: array metadata}, however the checkpoint spells it."""
    return _flax_tree(params_path)[0]


def is_nested(params_path: str) -> bool:
    """A level per name (no key of the tree's top holds a '/'), as Gemma 4 ships, with or without its root."""
    import orbax.checkpoint as ocp
    meta = ocp.PyTreeCheckpointer().metadata(params_path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", getattr(meta, "item_metadata", meta))
    return not any("/" in k for k in tree)


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for name in path:
        tree = tree[name]
    return tree


def _at(tree: dict, key: str, leaf: str, nested: bool, value=None):
    """tree[key][leaf] (one level deep) or tree[a][b]...[leaf] (nested): set it to value, or get it."""
    path = (key.split("/") if nested else [key]) + [leaf]
    for name in path[:-1]:
        tree = tree.setdefault(name, {}) if value is not None else tree[name]
    if value is not None:
        tree[path[-1]] = value
    return tree[path[-1]]


def _found_names(paths: dict, under: str = "") -> str:
    """The checkpoint's own names (under a module of ours, e.g. 'transformer/layer_0/'), for a refusal."""
    names = sorted({"/".join(p[:-1]) for (key, _), p in paths.items() if key.startswith(under)})
    return ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "") or "none"


def _spellings(key: str) -> str:
    """Our key as a checkpoint may spell it ('layer_0/attn/query_norm or layer_0/attn/_query_norm')."""
    key = key.removeprefix("transformer/")
    theirs = next((k for k, v in _QK_NORMS.items() if key.endswith("/" + v)), None)
    return key if theirs is None else f"{key.rsplit('/', 1)[0]}/{theirs} or {key}"


def _flax_config(params_path: str, family: str | None, overrides: dict):
    meta, paths = _flax_tree(params_path)
    where = f"--weights {params_path}"
    if "transformer/embedder" not in meta or "transformer/layer_0/attn/attn_vec_einsum" not in meta:
        raise UsageError(f"{where}: matches no known Gemma family (no embedder or layer_0/attn/attn_vec_einsum, "
                         f"with or without a transformer root; found: {_found_names(paths)})")
    found = set()
    for key in meta:
        if key.startswith("transformer/layer_0/"):
            leaf = key[len("transformer/layer_0/"):]
            found.add({"pre_attention_norm": "pre_attn_norm", "post_attention_norm": "post_attn_norm",
                       "attn/_query_norm": "q_norm", "attn/_key_norm": "k_norm"}.get(leaf, leaf.split("/")[-1]))
    if "skip_scale" in meta.get("transformer/layer_0", {}):
        found.add("skip_scale")
    if "skip_scale" in found and "q_norm" not in found:  # Gemma 4 by its scalar, yet no QK-norm we know
        raise UsageError(f"{where}: a Gemma 4 layer (it has skip_scale) without a QK-norm named attn/query_norm "
                         f"or attn/_query_norm; its layer 0 holds: {_found_names(paths, 'transformer/layer_0/')}")
    fam = _family(found, where)
    _check_family(family, fam, where)
    shape = lambda k, leaf: tuple(meta[k][leaf].shape)  # noqa: E731
    n = sum(1 for k in meta if k.startswith("transformer/layer_") and k.endswith("/attn/attn_vec_einsum"))
    fused = "transformer/layer_0/attn/qkv_einsum" in meta
    shapes = {"embed": shape("transformer/embedder", "input_embedding")}
    for i in range(n):
        p = f"transformer/layer_{i}/"
        if fused:
            _, h, d, hd = shape(p + "attn/qkv_einsum", "w")
            shapes[f"layers.{i}.q"], shapes[f"layers.{i}.kv"] = (h, d, hd), (2, h, d, hd)
        else:
            shapes[f"layers.{i}.q"] = shape(p + "attn/q_einsum", "w")
            if p + "attn/kv_einsum" in meta:
                shapes[f"layers.{i}.kv"] = shape(p + "attn/kv_einsum", "w")
            elif p + "attn/k_einsum" in meta:
                shapes[f"layers.{i}.kv"] = (1,) + shape(p + "attn/k_einsum", "w")
            else:  # a kv-shared layer saved without its (unused) kv: shaped as an earlier layer of its width
                width = shapes[f"layers.{i}.q"][2]
                shapes[f"layers.{i}.kv"] = next(shapes[f"layers.{j}.kv"] for j in range(i)
                                                if shapes[f"layers.{j}.q"][2] == width)
        shapes[f"layers.{i}.linear"] = shape(p + "mlp/linear", "w")
    if "per_layer_embeddings" in meta["transformer/embedder"]:
        shapes["ple_embed"] = shape("transformer/embedder", "per_layer_embeddings")
    if "transformer/layer_0/moe" in meta:
        shapes["layers.0.experts_gating"] = shape("transformer/layer_0/moe", "gating_einsum")
    overrides = {**config_beside(params_path), **overrides}
    cfg = gemma.GemmaConfig.from_shapes(fam, shapes, **overrides)
    plain = gemma.GemmaConfig.from_shapes(fam, shapes)
    named = any(dataclasses.replace(plain, vocab=c.vocab) == c for c in gemma.SIZES.values())
    told = {"kv_shared_layers": plain.kv_shared_layers > 0, "top_k": not cfg.n_experts}  # by shapes, or moot
    guessed = () if named else tuple(k for k in UNTOLD[fam] if k not in overrides and not told.get(k))
    missing = [_spellings(key) for ours, (key, leaf) in flax_names(cfg, fused).items()
               if (key, leaf) not in paths and not ours.endswith((".kv", ".k_norm"))]
    if missing:
        raise UsageError(f"{where}: a {fam} checkpoint of these shapes needs {missing[0]}"
                         f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which it does not have "
                         f"under any name Google's loaders use; found: {_found_names(paths)}")
    return cfg, meta, fused, paths, guessed


def check_model(model: str | None) -> str | None:
    """--model names a family or a named size: its family (None: whatever the checkpoint is)."""
    if not model:
        return None
    if model not in gemma.FAMILIES and model not in gemma.SIZES:
        raise UsageError(f"--model {model}: choose a family ({', '.join(gemma.FAMILIES)}) or a size "
                         f"({', '.join(gemma.SIZES)})")
    return model.split("-", 1)[0]


def check_size(model: str | None, cfg: gemma.GemmaConfig, weights_path: str) -> None:
    """--model SIZE against the checkpoint's shapes (the vocab aside: Hugging Face copies drop its padding)."""
    if not model or model not in gemma.SIZES:
        return
    dims = ("family", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ff")
    same = lambda c: all(getattr(c, k) == getattr(cfg, k) for k in dims)  # noqa: E731
    if not same(gemma.SIZES[model]):
        found = next((n for n, c in gemma.SIZES.items() if same(c)), cfg.family)
        raise UsageError(f"--model {model}: --weights {weights_path} holds a {found} checkpoint ({cfg.n_layers} "
                         f"layers, width {cfg.d_model}); pass --model {found} or leave --model out")


def _check_family(wanted: str | None, found: str, where: str) -> None:
    if wanted and wanted != found:
        raise UsageError(f"--model {wanted}: {where} is a {found} checkpoint; pass --model {found} "
                         "or leave --model out")


def _load_flax(ck: Checkpoint, meta, fused: bool, paths: dict, mesh, dtype) -> dict[str, jax.Array]:
    import orbax.checkpoint as ocp
    cfg = ck.cfg
    names = flax_names(cfg, fused)
    lay = gemma.param_layout(cfg)
    mshape = dict(mesh.shape)
    target, args, post = {}, {}, {}
    shardings = gemma.shardings(cfg, mesh)
    absent = {}  # a kv-shared layer's unused kv / k-norm, when the checkpoint has none: zeros
    for ours, (key, leaf) in names.items():
        shape, axes = lay[ours]
        if key not in meta and ours.endswith((".kv", ".k_norm")):
            absent[ours] = jax.jit(lambda shape=shape: jnp.zeros(shape, dtype or jnp.float32),
                                   out_shardings=shardings[ours])()
            continue
        raw_shape = tuple(meta[key][leaf].shape)
        raw_axes, fix = axes, None
        if ours.endswith(".gating") and raw_shape != shape:  # Gemma 2 2b stores [2, D, F]
            raw_axes, fix = (None, "fsdp", "mlp"), lambda x: x.transpose(0, 2, 1)
        elif fused and ours.endswith((".q", ".kv")):  # [3, H, D, hd] when heads == kv heads
            raw_axes = (None, "heads", "fsdp", "head_dim")
            fix = (lambda x: x[0]) if ours.endswith(".q") else (lambda x: x[1:])
        elif key.endswith("attn/k_einsum"):  # Gemma 4's k=v projection: [K, D, hd]
            raw_axes, fix = axes[1:], lambda x: x[None]
        sh = jax.sharding.NamedSharding(mesh, gemma.fitted_spec(raw_axes, raw_shape, mshape))
        dt = dtype or meta[key][leaf].dtype
        _put(target, paths[key, leaf], jax.ShapeDtypeStruct(raw_shape, dt, sharding=sh))
        _put(args, paths[key, leaf], ocp.ArrayRestoreArgs(sharding=sh, dtype=dt))
        post[ours] = (key, leaf, fix)
    raw = ocp.PyTreeCheckpointer().restore(
        ck.path, args=ocp.args.PyTreeRestore(item=target, restore_args=args, partial_restore=True))
    out = {}
    for ours, (key, leaf, fix) in post.items():
        x = _get(raw, paths[key, leaf])
        out[ours] = x if fix is None else jax.jit(fix, out_shardings=shardings[ours])(x)
    return {**out, **absent}


# ---------------------------------------------------------------- transformers (safetensors)

class SafeTensors:
    """Tensor index over a folder of .safetensors files; reads blocks by byte ranges."""

    def __init__(self, folder: str):
        self.fs, p = _fs(folder)
        self.index: dict[str, tuple[str, str, tuple[int, ...], int]] = {}  # name -> (file, dtype, shape, offset)
        for f in sorted(self.fs.glob(_join(p, "*.safetensors"))):
            with self.fs.open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    self.index[name] = (f, info["dtype"], tuple(info["shape"]), 8 + n + info["data_offsets"][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name][2]

    def read(self, name: str, rows: slice, cols: slice | None = None) -> np.ndarray:
        """tensor[rows] (1-D) or tensor[rows, cols] (2-D; a tensor of more dims as [all but the last, last]),
        fetching only those bytes."""
        f, dt, shape, off = self.index[name]
        if len(shape) > 2:
            shape = (int(np.prod(shape[:-1])), shape[-1])
        dtype = np.dtype(_ST_DTYPES[dt])
        item = dtype.itemsize
        r0, r1, _ = rows.indices(shape[0])
        if len(shape) == 1:
            starts, ends = [off + r0 * item], [off + r1 * item]
            width = r1 - r0
        else:
            ncol = shape[1]
            c0, c1, _ = (cols or slice(None)).indices(ncol)
            if c0 == 0 and c1 == ncol:  # whole rows: one contiguous range
                starts, ends = [off + r0 * ncol * item], [off + r1 * ncol * item]
            elif r1 - r0 > MAX_ROW_REQUESTS:  # e.g. a vocab's rows: whole-row groups, cut as they arrive
                step = max(1, GROUP_BYTES // (ncol * item))
                return np.concatenate([self.read(name, slice(r, min(r + step, r1)))[:, c0:c1].reshape(-1, c1 - c0)
                                       for r in range(r0, r1, step)])
            else:
                starts = [off + (r * ncol + c0) * item for r in range(r0, r1)]
                ends = [s + (c1 - c0) * item for s in starts]
            width = c1 - c0
        parts = self.fs.cat_ranges([f] * len(starts), starts, ends)
        if on_read:
            for part in parts:
                on_read(name, len(part))
        arr = np.frombuffer(b"".join(parts), dtype)
        return arr.reshape(r1 - r0, width) if len(shape) == 2 else arr


def _hf_prefix(st: SafeTensors) -> str:
    for prefix in ("model.", "language_model.model.", "model.language_model."):
        if prefix + "embed_tokens.weight" in st.index:
            return prefix
    raise UsageError("safetensors: no model.embed_tokens.weight (found: "
                     f"{', '.join(sorted(st.index)[:5])}); matches no known Gemma family")


def _hf_config(folder: str, family: str | None, overrides: dict):
    st = SafeTensors(folder)
    where = f"--weights {folder}"
    if not st.index:
        raise UsageError(f"{where}: the .safetensors files hold no tensors")
    try:
        pre = _hf_prefix(st)
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    lp = pre + "layers.0."
    found = {ours for ours, theirs in _HF_NORMS.items() if lp + theirs + ".weight" in st.index}
    if lp + "self_attn.q_norm.weight" in st.index:
        found.add("q_norm")
    if lp + "layer_scalar" in st.index:
        found.add("skip_scale")
    fam = _family(found, where)
    _check_family(family, fam, where)
    if fam == "gemma4":
        return _hf_gemma4_config(st, pre, folder, overrides)
    conf = {}
    fs, p = _fs(folder)
    if fs.exists(_join(p, "config.json")):
        with fs.open(_join(p, "config.json")) as fh:
            conf = json.load(fh)
        conf = conf.get("text_config", conf)
    v, d = st.shape(pre + "embed_tokens.weight")
    # head_dim: config.json, else Gemma 3's per-head QK-norm, else Gemma 2's 256 (all but 27b)
    hd = conf.get("head_dim") or (st.shape(lp + "self_attn.q_norm.weight")[0] if "q_norm" in found else 256)
    h = st.shape(lp + "self_attn.q_proj.weight")[0] // hd
    k = st.shape(lp + "self_attn.k_proj.weight")[0] // hd
    f = st.shape(lp + "mlp.down_proj.weight")[1]
    n = sum(1 for name in st.index if name.startswith(pre + "layers.") and name.endswith("self_attn.o_proj.weight"))
    shapes = {"embed": (v, d), "layers.0.kv": (2, k, d, hd), "layers.0.linear": (f, d),
              **{f"layers.{i}.q": (h, d, hd) for i in range(n)}}
    from_conf = {}
    if conf.get("sliding_window"):
        from_conf["sliding_window"] = int(conf["sliding_window"])
    if conf.get("query_pre_attn_scalar"):
        from_conf["query_pre_attn_scalar"] = float(conf["query_pre_attn_scalar"])
    scaling = conf.get("rope_scaling") or {}
    if fam == "gemma3" and "rope_scaling" in conf:
        from_conf["global_rope_scale"] = float(scaling.get("factor", 1.0))
    cfg = gemma.GemmaConfig.from_shapes(fam, shapes, **{**from_conf, **overrides})
    return cfg, st, pre


def _hf_conf(folder: str) -> dict:
    fs, p = _fs(folder)
    if not fs.exists(_join(p, "config.json")):
        return {}
    with fs.open(_join(p, "config.json")) as fh:
        conf = json.load(fh)
    return conf.get("text_config", conf)


def _hf_gemma4_config(st: SafeTensors, pre: str, folder: str, overrides: dict):
    """Gemma 4's sizes from the tensors (each layer's head width from its q_norm; the kv-shared layers may
    have no k/v projections: theirs are shaped as the first layer's of the same width) and what they cannot
    tell from config.json (layer_types, sliding_window, num_kv_shared_layers, top_k_experts)."""
    v, d = st.shape(pre + "embed_tokens.weight")
    n = sum(1 for name in st.index if name.startswith(pre + "layers.") and name.endswith("self_attn.o_proj.weight"))
    shapes: dict[str, tuple] = {"embed": (v, d)}
    kv_by_width: dict[int, tuple] = {}
    for i in range(n):
        lp = f"{pre}layers.{i}."
        hd = st.shape(lp + "self_attn.q_norm.weight")[0]
        shapes[f"layers.{i}.q"] = (st.shape(lp + "self_attn.q_proj.weight")[0] // hd, d, hd)
        if lp + "self_attn.k_proj.weight" in st.index:
            c = 2 if lp + "self_attn.v_proj.weight" in st.index else 1
            kv_by_width.setdefault(hd, (c, st.shape(lp + "self_attn.k_proj.weight")[0] // hd, d, hd))
        shapes[f"layers.{i}.kv"] = kv_by_width[hd]
        shapes[f"layers.{i}.linear"] = (st.shape(lp + "mlp.down_proj.weight")[1], d)
    if pre + "embed_tokens_per_layer.weight" in st.index:
        shapes["ple_embed"] = (v, n, st.shape(pre + "embed_tokens_per_layer.weight")[1] // n)
    if pre + "layers.0.experts.gate_up_proj" in st.index:
        e, f2, _ = st.shape(pre + "layers.0.experts.gate_up_proj")
        shapes["layers.0.experts_gating"] = (e, 2, f2 // 2, d)
    conf = _hf_conf(folder)
    from_conf: dict = {}
    if conf.get("sliding_window"):
        from_conf["sliding_window"] = int(conf["sliding_window"])
    if "num_kv_shared_layers" in conf:
        from_conf["kv_shared_layers"] = int(conf["num_kv_shared_layers"])
    if conf.get("top_k_experts"):
        from_conf["top_k"] = int(conf["top_k_experts"])
    cfg = gemma.GemmaConfig.from_shapes("gemma4", shapes, **{**from_conf, **overrides})
    return cfg, st, pre


_HF4 = {"post_mlp_norm": "post_feedforward_layernorm_1", "pre_moe_norm": "pre_feedforward_layernorm_2",
        "post_moe_norm": "post_feedforward_layernorm_2", "ple_norm": "post_per_layer_input_norm"}


def _hf_block(st: SafeTensors, pre: str, cfg: gemma.GemmaConfig, ours: str, idx: tuple[slice, ...]) -> np.ndarray:
    """Our parameter's block at `idx` (slices of our shape), from the Hugging Face tensors."""
    full = lambda s, n: slice(*s.indices(n)[:2])  # noqa: E731
    shape = gemma.param_layout(cfg)[ours][0]
    idx = tuple(full(s, n) for s, n in zip(idx, shape))
    if ours == "ple_embed":  # [V, L*P] -> [V, L, P]
        vv, n, pp = idx
        raw = st.read(pre + "embed_tokens_per_layer.weight", vv)
        return raw.reshape(raw.shape[0], cfg.n_layers, -1)[:, n, pp]
    if ours == "ple_in":  # [L*P, D] -> [D, L, P]
        d, n, pp = idx
        raw = st.read(pre + "per_layer_model_projection.weight", slice(n.start * cfg.per_layer_dim,
                                                                         n.stop * cfg.per_layer_dim), d)
        return raw.reshape(n.stop - n.start, cfg.per_layer_dim, -1)[:, pp].transpose(2, 0, 1)
    if ours == "ple_in_norm":
        return st.read(pre + "per_layer_projection_norm.weight", idx[0])
    if ours.startswith("layers."):
        _, i, kind = ours.split(".")
        lp = f"{pre}layers.{i}."
        if kind in _HF4:
            return st.read(lp + _HF4[kind] + ".weight", idx[0])
        if kind == "skip_scale":
            return st.read(lp + "layer_scalar", idx[0])
        if kind in ("router_scale", "expert_scale"):
            return st.read(lp + ("router.scale" if kind == "router_scale" else "router.per_expert_scale"), idx[0])
        if kind in ("ple_gate", "ple_proj", "router"):  # [out, in] stored -> ours [in, out]
            a, b = idx
            name = {"ple_gate": "per_layer_input_gate.weight", "ple_proj": "per_layer_projection.weight",
                    "router": "router.proj.weight"}[kind]
            return st.read(lp + name, b, a).T
        if kind == "experts_gating":  # [E, 2 Fe, D] -> [E, 2, Fe, D]
            e, c, f, d = idx
            fe = cfg.expert_ff
            raw = st.read(lp + "experts.gate_up_proj", slice(e.start * 2 * fe, e.stop * 2 * fe), d)
            return raw.reshape(e.stop - e.start, 2, fe, -1)[:, c, f]
        if kind == "experts_linear":  # [E, D, Fe] -> [E, Fe, D]
            e, f, d = idx
            dm = cfg.d_model
            raw = st.read(lp + "experts.down_proj", slice(e.start * dm, e.stop * dm), f)
            return raw.reshape(e.stop - e.start, dm, -1)[:, d].transpose(0, 2, 1)
        if kind in ("kv", "k_norm") and lp + "self_attn.k_proj.weight" not in st.index:
            return np.zeros(tuple(s.stop - s.start for s in idx), np.float32)  # a kv-shared layer's: never used
    hd = cfg.attn_dims(int(ours.split(".")[1]))[1] if ours.startswith("layers.") else cfg.head_dim
    if ours == "embed":
        return st.read(pre + "embed_tokens.weight", idx[0], idx[1])
    if ours == "final_norm":
        return st.read(pre + "norm.weight", idx[0])
    _, i, kind = ours.split(".")
    lp = f"{pre}layers.{i}."
    if kind in _HF_NORMS:
        return st.read(lp + _HF_NORMS[kind] + ".weight", idx[0])
    if kind in ("q_norm", "k_norm"):
        return st.read(lp + f"self_attn.{kind}.weight", idx[0])

    def heads(name, h, d, e):  # [N*hd, D] -> [n, D, hd] block
        raw = st.read(name, slice(h.start * hd, h.stop * hd), d)
        return raw.reshape(h.stop - h.start, hd, -1)[:, e].transpose(0, 2, 1)

    if kind == "q":
        return heads(lp + "self_attn.q_proj.weight", *idx)
    if kind == "kv":  # (Gemma 4's k=v layers: [1, K, D, hd] from k_proj alone)
        c, k, d, e = idx
        return np.stack([heads(lp + f"self_attn.{'kv'[j]}_proj.weight", k, d, e) for j in range(c.start, c.stop)])
    if kind == "o":  # [D, H*hd] -> [h, hd, D] block
        h, e, d = idx
        raw = st.read(lp + "self_attn.o_proj.weight", d, slice(h.start * hd, h.stop * hd))
        return raw.reshape(d.stop - d.start, h.stop - h.start, hd)[:, :, e].transpose(1, 2, 0)
    if kind == "gating":
        c, f, d = idx
        return np.stack([st.read(lp + f"mlp.{('gate', 'up')[j]}_proj.weight", f, d) for j in range(c.start, c.stop)])
    if kind == "linear":  # [D, F] stored -> [F, D]
        f, d = idx
        return st.read(lp + "mlp.down_proj.weight", d, f).T
    raise AssertionError(ours)


def _load_hf(ck: Checkpoint, st: SafeTensors, pre: str, mesh, dtype) -> dict[str, jax.Array]:
    cfg = ck.cfg
    lay = gemma.param_layout(cfg)
    dt = dtype or jnp.dtype(_ST_DTYPES[st.index[pre + "embed_tokens.weight"][1]])
    out = {}
    for ours, sh in gemma.shardings(cfg, mesh).items():
        shape = lay[ours][0]
        blocks: dict[tuple, np.ndarray] = {}  # devices of this process holding the same block read it once

        def block(idx, ours=ours, shape=shape, blocks=blocks):
            key = tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
            if key not in blocks:
                blocks[key] = np.ascontiguousarray(_hf_block(st, pre, cfg, ours, idx)).astype(dt)
            return blocks[key]
        out[ours] = jax.make_array_from_callback(shape, sh, block)
    return out


# ---------------------------------------------------------------- entry points

def inspect(path: str, *, family: str | None = None, **overrides) -> Checkpoint:
    """Layout, family and sizes of the checkpoint at `path`, from metadata only (no array is read)."""
    ck, _ = _inspect(path, family, overrides)
    return ck


def _inspect(path: str, family: str | None, overrides: dict):
    if family is not None and family not in gemma.FAMILIES:
        raise UsageError(f"--model {family}: expected one of {', '.join(gemma.FAMILIES)}")
    layout, params_path = locate(path)
    if layout == "flax":
        cfg, meta, fused, paths, guessed = _flax_config(params_path, family, overrides)
        return Checkpoint(params_path, layout, path, cfg, guessed), (meta, fused, paths)
    cfg, st, pre = _hf_config(params_path, family, overrides)
    return Checkpoint(params_path, layout, path, cfg), (st, pre)


def load(path: str, mesh, *, family: str | None = None, dtype=None, **overrides) -> tuple[Checkpoint, dict]:
    """(checkpoint info, flat params as global arrays in the rules' shardings on `mesh`).

    dtype: the dtype params are held in (default: as stored), e.g. jnp.bfloat16. `overrides` set config
    fields the files cannot tell (the flax layout has no config: sliding_window, global_rope_scale)."""
    ck, extra = _inspect(path, family, overrides)
    if ck.layout == "flax":
        return ck, _load_flax(ck, *extra, mesh, dtype)
    return ck, _load_hf(ck, *extra, mesh, dtype)
