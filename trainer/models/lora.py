"""LoRA adapters on Gemma's projections (trainer/models/gemma.py): W x + (alpha / r) * B(A(dropout(x))).

A target is one projection of every layer: q, k, v, o (attention), gate, up, down (MLP). Its adapter is
A [*in, r] and B [r, *out], where in/out are the projection's input and output dims in the model's own
layout (q: D -> [H, hd]; o: [H, hd] -> D; down: F -> D), so it adds r * (in + out) parameters per layer.
Dims are each layer's own (Gemma 4's global layers have wider heads, its kv-shared layers a wider MLP). A
layer without the projection has no adapter for it: Gemma 4's k=v global layers have no v (their k adapter
feeds both), and its kv-shared layers no k or v (they attend over another layer's).
On Gemma 4's experts (26B-A4B), expert_gate, expert_up and expert_down, only when named (--targets experts):
one A [E, in, r] and B [E, r, out] per layer, each expert its own pair, applied to the rows routed to it; their E
dim carries the experts' `expert` axis, so they are stored split like the experts (the expert-parallel step reads
them whole: trainer/models/moe.py).
As in the LoRA paper (and PEFT): A starts Kaiming-uniform, B at zero (step 0 is the base model), dropout
drops the adapter's input only, and the update is scaled by alpha / r. LoRA params are f32 whatever the
base's dtype, and they carry logical axes so the mesh rules shard them like the matrices they adapt.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from trainer.common.config import UsageError
from trainer.common.mesh import fitted_spec
from trainer.models import gemma


@dataclasses.dataclass(frozen=True)
class Target:
    base: str                    # the base parameter (per layer) it adapts
    index: int | None            # the slice of that parameter (kv: 0 = k, 1 = v; gating: 0 = gate, 1 = up)
    in_axes: tuple[str, ...]     # the projection's input dims (leading dims of A)
    out_axes: tuple[str, ...]    # its output dims (trailing dims of B)
    to_base: tuple[int, ...]     # transposes the [*in, *out] update into the base slice's layout
    hf: str                      # Hugging Face / PEFT module name
    experts: bool = False        # one adapter per expert (a leading E dim; the base sliced on its dim 1)


TARGETS: dict[str, Target] = {
    "q": Target("q", None, ("fsdp",), ("heads", "head_dim"), (1, 0, 2), "self_attn.q_proj"),
    "k": Target("kv", 0, ("fsdp",), ("kv_heads", "head_dim"), (1, 0, 2), "self_attn.k_proj"),
    "v": Target("kv", 1, ("fsdp",), ("kv_heads", "head_dim"), (1, 0, 2), "self_attn.v_proj"),
    "o": Target("o", None, ("heads", "head_dim"), ("fsdp",), (0, 1, 2), "self_attn.o_proj"),
    "gate": Target("gating", 0, ("fsdp",), ("mlp",), (1, 0), "mlp.gate_proj"),
    "up": Target("gating", 1, ("fsdp",), ("mlp",), (1, 0), "mlp.up_proj"),
    "down": Target("linear", None, ("mlp",), ("fsdp",), (0, 1), "mlp.down_proj"),
    "expert_gate": Target("experts_gating", 0, ("fsdp",), ("mlp",), (0, 2, 1), "experts.gate_proj", True),
    "expert_up": Target("experts_gating", 1, ("fsdp",), ("mlp",), (0, 2, 1), "experts.up_proj", True),
    "expert_down": Target("experts_linear", None, ("mlp",), ("fsdp",), (0, 1, 2), "experts.down_proj", True),
}
DENSE = tuple(n for n, t in TARGETS.items() if not t.experts)
EXPERTS = tuple(n for n, t in TARGETS.items() if t.experts)
# Globs and `all` reach the dense projections only: the experts are adapted when named.
ALIASES = {"all": DENSE, "attn": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down"), "experts": EXPERTS}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        if self.rank < 1:
            raise UsageError(f"--rank {self.rank}: must be at least 1 (the adapters' inner width)")
        if self.alpha <= 0:
            raise UsageError(f"--alpha {self.alpha}: must be positive (the update is scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"--dropout {self.dropout}: must be in [0, 1)")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise UsageError(f"LoRA targets {','.join(bad) or '(none)'}: choose from {','.join(TARGETS)}")


def resolve_targets(spec: str) -> tuple[str, ...]:
    """'q,v' / 'all' / 'attn' / 'mlp' / globs ('*_proj', 'gate*') over our and Hugging Face's projection
    names -> our names in model order. Each pattern must match at least one projection."""
    picked: set[str] = set()
    for pat in (p.strip() for p in spec.split(",")):
        if not pat:
            continue
        pats = ALIASES.get(pat, (pat,))
        hits = {n for n, t in TARGETS.items() for p in pats if n == p or not t.experts and (
                fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(t.hf.split(".")[-1], p))}
        if not hits:
            raise UsageError(f"--targets {pat!r} matches no projection of the model; use names from "
                             f"{','.join(TARGETS)} (or q_proj... as Hugging Face names them), attn, mlp, all "
                             "or experts")
        picked |= hits
    if not picked:
        raise UsageError("--targets is empty; name the projections to adapt, e.g. q,v or all")
    return tuple(n for n in TARGETS if n in picked)


def _dims(cfg: gemma.GemmaConfig, i: int) -> dict[str, int]:
    k, hd, _ = cfg.attn_dims(i)
    return {"fsdp": cfg.d_model, "heads": cfg.n_heads, "kv_heads": k, "head_dim": hd, "mlp": cfg.ff_of(i)}


def applies(cfg: gemma.GemmaConfig, i: int, name: str) -> bool:
    """Whether layer i has the projection `name` (module docstring)."""
    if name in ("k", "v") and cfg.kv_source(i) != i:
        return False
    if name == "v" and cfg.attn_dims(i)[2] == 1:
        return False
    return not TARGETS[name].experts or bool(cfg.n_experts)


def check_model(cfg: gemma.GemmaConfig, lc: LoraConfig) -> None:
    if any(TARGETS[t].experts for t in lc.targets) and not cfg.n_experts:
        raise UsageError(f"--targets {','.join(t for t in lc.targets if TARGETS[t].experts)}: this model has no "
                         "experts (only Gemma 4 26B-A4B has); adapt q,k,v,o,gate,up,down")


def param_layout(cfg: gemma.GemmaConfig, lc: LoraConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Flat name ('layers.3.q.a') -> (shape, logical axes) of every LoRA parameter."""
    out = {}
    for i in range(cfg.n_layers):
        dims = dict(_dims(cfg, i), mlp=cfg.expert_ff) if cfg.n_experts else _dims(cfg, i)
        for name in lc.targets:
            if not applies(cfg, i, name):
                continue
            t = TARGETS[name]
            d = dims if t.experts else _dims(cfg, i)
            lead, lead_axes = ((cfg.n_experts,), ("expert",)) if t.experts else ((), ())
            out[f"layers.{i}.{name}.a"] = (lead + tuple(d[a] for a in t.in_axes) + (lc.rank,),
                                           lead_axes + t.in_axes + (None,))
            out[f"layers.{i}.{name}.b"] = (lead + (lc.rank,) + tuple(d[a] for a in t.out_axes),
                                           lead_axes + (None,) + t.out_axes)
    return out


def count(cfg: gemma.GemmaConfig, lc: LoraConfig) -> int:
    return sum(math.prod(s) for s, _ in param_layout(cfg, lc).values())


STACKED = "stacked"  # the train state's layout (stacked_layout), as a checkpoint's meta names it


def stacked_layout(cfg: gemma.GemmaConfig, lc: LoraConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """param_layout with the adapters of the layers a step scans stacked as the base's weights are
    ('scan.S.R.q.a': [groups, run length, *shape], gemma.stacked_layout): the train state's layout."""
    return gemma.stacked_layout(cfg, param_layout(cfg, lc))


def layout(cfg: gemma.GemmaConfig, lc: LoraConfig, stacked: bool) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """stacked_layout (a scanned step's train state) or param_layout (per layer)."""
    return stacked_layout(cfg, lc) if stacked else param_layout(cfg, lc)


def abstract(cfg: gemma.GemmaConfig, lc: LoraConfig, mesh, stacked: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """The f32 adapters in `layout`, each with its sharding on the mesh: what a step or a restore takes."""
    sh = shardings(cfg, lc, mesh, stacked)
    return {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh[n]) for n, (s, _) in layout(cfg, lc, stacked).items()}


def flat_of(cfg: gemma.GemmaConfig, lc: LoraConfig, tree, mesh):
    """A tree holding stacked adapters (stacked_layout: the adapters, each of their optimizer moments) -> the same
    tree with each such dict in param_layout's per-layer arrays on the mesh, outside a jit (inside one gemma.unstack
    slices): one small program per stacked shape, called once per layer (a program with every layer's array as an
    output costs the TPU compiler ~0.4 s an output)."""
    names = set(stacked_layout(cfg, lc))
    sh = shardings(cfg, lc, mesh)
    order = list(param_layout(cfg, lc))

    def flat(stacked: dict) -> dict:
        out = {n: a for n, a in stacked.items() if not n.startswith(gemma.SCANNED)}
        for name, a in stacked.items():
            if name.startswith(gemma.SCANNED):
                layers = [flat_name for row in gemma.members(cfg, name) for flat_name in row]
                for j, flat_name in enumerate(layers):
                    out[flat_name] = _layer_of(sh[flat_name])(a, np.int32(j))
        return {n: out[n] for n in order}
    return _map_dicts(flat, names, tree)


@functools.lru_cache(maxsize=None)
def _layer_of(sharding):
    """(stacked [groups, run, ...], j) -> its j-th layer [...] (groups major), placed by sharding."""
    return jax.jit(lambda a, j: jax.lax.dynamic_index_in_dim(a.reshape(-1, *a.shape[2:]), j, keepdims=False),
                   out_shardings=sharding)


def stacked_of(cfg: gemma.GemmaConfig, lc: LoraConfig, tree, mesh):
    """A tree holding per-layer adapters (param_layout: the adapters, each of their optimizer moments) -> the same
    tree with each such dict in stacked_layout, placed on the mesh."""
    sh = shardings(cfg, lc, mesh, stacked=True)

    def stacked(flat: dict) -> dict:
        out = gemma.stack(cfg, flat, sh)
        return {n: a if n.startswith(gemma.SCANNED) else jax.device_put(a, sh[n]) for n, a in out.items()}
    return _map_dicts(stacked, set(param_layout(cfg, lc)), tree)


def _map_dicts(fn, names: set[str], tree):
    """tree with fn applied to each dict in it whose keys are `names`."""
    def match(d) -> bool:
        return isinstance(d, dict) and set(d) == names
    return jax.tree.map(lambda d: fn(d) if match(d) else d, tree, is_leaf=match)


def shardings(cfg: gemma.GemmaConfig, lc: LoraConfig, mesh, stacked: bool = False
              ) -> dict[str, jax.sharding.NamedSharding]:
    return {n: jax.sharding.NamedSharding(mesh, fitted_spec(axes, shape, dict(mesh.shape)))
            for n, (shape, axes) in layout(cfg, lc, stacked).items()}


def init(cfg: gemma.GemmaConfig, lc: LoraConfig, seed: int, mesh=None, stacked: bool = False
         ) -> dict[str, jax.Array]:
    """f32 adapters: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's Kaiming-uniform, a=sqrt(5)), B = 0.
    Each array comes from (seed, its name) alone, placed by the rules when a mesh is given; all of them from
    one compiled program (a model's hundreds of adapters, one compile)."""
    key = jax.random.key(seed)
    lay = param_layout(cfg, lc)

    def make() -> dict[str, jax.Array]:
        out = {}
        for j, (name, (shape, _)) in enumerate(lay.items()):
            if name.endswith(".b"):
                out[name] = jnp.zeros(shape, jnp.float32)
                continue
            fan_in = math.prod(shape[:-1]) // (cfg.n_experts if TARGETS[name.split(".")[2]].experts else 1)
            bound = 1.0 / math.sqrt(fan_in)
            out[name] = jax.random.uniform(jax.random.fold_in(key, j), shape, jnp.float32, -bound, bound)
        return gemma.stack(cfg, out) if stacked else out
    return jax.jit(make, out_shardings=shardings(cfg, lc, mesh, stacked) if mesh is not None else None)()


# How the adapters of projections that share an input and a matmul (k with v, gate with up) are applied:
# beside: each its own pair of matmuls, added to its own slice of the base's stacked output;
# stacked: both in one pair of batched matmuls, added to the stacked output before it is split, which lets the
# TPU compiler add them inside the base matmul's fusion (beside, each sum is a pass of its own over the
# slice: for gate and up, [tokens, mlp] read and written twice a layer). The same arithmetic per element.
# stacked is the default: on a v5e chip it ran every LoRA step timed faster in less memory (gemma2-2b 4 x 512
# 157.1 ms against 163.5, gemma3-1b 8 x 512 146.6 against 150.2, gemma4-e2b 1 x 512 39.4 against 41.4;
# docs/performance.md).
IMPLS = ("beside", "stacked")
DEFAULT_IMPL = "stacked"
_PAIRS = {"kv": ("k", "v"), "gating": ("gate", "up")}


def adapter(lc: LoraConfig, lora: dict[str, jax.Array], dropout_key: jax.Array | None = None,
            impl: str = DEFAULT_IMPL):
    """The model's adapter hook: (layer, projection, input, output[, rows per expert]) -> output +
    scale * B(A(drop(input))); an expert target's rows are grouped by expert (trainer/models/moe.py).
    impl: IMPLS. The model also offers the stacked outputs "kv" and "gating" (trainer/models/gemma.py)."""
    if impl not in IMPLS:
        raise UsageError(f"--lora-impl {impl}: choose one of {', '.join(IMPLS)}")

    def paired(i: int, pair: str) -> bool:
        """Whether impl stacked applies the pair's two adapters together on layer i (both there, no dropout:
        dropout draws each target's mask apart)."""
        return impl == "stacked" and not (dropout_key is not None and lc.dropout > 0) and all(
            f"layers.{i}.{n}.a" in lora for n in _PAIRS[pair])

    def apply(i: int, name: str, x: jax.Array, y: jax.Array, groups: jax.Array | None = None) -> jax.Array:
        if name in _PAIRS:
            if not paired(i, name) or y.shape[0] != 2:
                return y
            a, b = (jnp.stack([lora[f"layers.{i}.{n}.{w}"] for n in _PAIRS[name]]) for w in ("a", "b"))
            a, b = pair_as_applied(TARGETS[_PAIRS[name][0]], a, b, lead=(None,))  # [2, in, r], [2, r, *out]
            h = jnp.einsum("btd,cdr->cbtr", x.astype(jnp.float32), a)
            d = jnp.einsum("cbtr,crf->cbtf", h, b) if b.ndim == 3 else jnp.einsum("cbtr,crkh->cbtkh", h, b)
            return y + (lc.scale * d).astype(y.dtype)
        pair = next((p for p, names in _PAIRS.items() if name in names), None)
        if pair is not None and paired(i, pair):
            return y  # added to the stacked output already
        a = lora.get(f"layers.{i}.{name}.a")
        if a is None:
            return y
        a, b = pair_as_applied(TARGETS[name], a, lora[f"layers.{i}.{name}.b"],
                               lead=() if groups is None else (None,))  # an expert target's E dim
        if dropout_key is not None and lc.dropout > 0:
            k = jax.random.fold_in(jax.random.fold_in(dropout_key, i), list(TARGETS).index(name))
            keep = jax.random.bernoulli(k, 1.0 - lc.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - lc.dropout), 0).astype(x.dtype)
        if groups is not None:  # rows [N, in] grouped by expert; a [E, in, r], b [E, r, out]
            h = jax.lax.ragged_dot(x.astype(jnp.float32), a, group_sizes=groups)
            return y + (lc.scale * jax.lax.ragged_dot(h, b, group_sizes=groups)).astype(y.dtype)
        h = jnp.tensordot(x.astype(jnp.float32), a, axes=a.ndim - 1)
        return y + (lc.scale * jnp.tensordot(h, b, axes=1)).astype(y.dtype)
    return apply


def as_applied(w: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """An adapter's A or B (logical axes `axes`) laid out where it is used: whole over the `fsdp` split it is
    stored with, split over `model` like the projection's side it meets (heads, MLP columns). Stored split like the
    weights they adapt (fsdp), left to itself the partitioner contracted A's split dim where it lay: it gathered a
    layer's input over `data` for each adapter ([rows of every device, D], in windowed loops) to save gathering A
    ([D, r]: kilobytes). Fully whole instead, under `model` > 1 the product with B was computed whole over the
    columns `model` splits and gathered for the data group's rows (gemma4-31b at data=2,model=4: the MLP's
    [16, 512, 21504] up and gate outputs, 336 MiB each; gemma4-26b-a4b at model=8: q's [32, 512, 16, 512]):
    kept split over `model`, B's product is the output's own shard and A's a partial sum over it. On a mesh of
    data alone this is whole, as before. Not inside a shard_map (the experts' step), where they enter whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return w
    shape = dict(mesh.shape)
    spec = fitted_spec(tuple(None if a == "fsdp" else a for a in axes), w.shape, shape)
    # an axis of one device splits nothing: the same constraint as whole, so a data-only step is unchanged
    spec = [None if all(shape[n] == 1 for n in ((p,) if isinstance(p, str) else p or ())) else p for p in spec]
    return jax.lax.with_sharding_constraint(w, jax.sharding.PartitionSpec(*spec))


def pair_as_applied(t: Target, a: jax.Array, b: jax.Array, lead: tuple = ()) -> tuple[jax.Array, jax.Array]:
    """A and B of target t, each as_applied; lead: their leading dims' axes (an expert's E, a stacked pair's 2)."""
    return as_applied(a, (*lead, *t.in_axes, None)), as_applied(b, (*lead, None, *t.out_axes))


def delta(lc: LoraConfig, lora: dict[str, jax.Array], i: int, name: str) -> jax.Array:
    """scale * A @ B of one projection (per expert for an expert target), in the layout of the base slice it
    adds to."""
    a, b = lora[f"layers.{i}.{name}.a"], lora[f"layers.{i}.{name}.b"]
    if TARGETS[name].experts:
        return (lc.scale * jnp.einsum("eir,ero->eio", a, b)).transpose(TARGETS[name].to_base)
    return (lc.scale * jnp.tensordot(a, b, axes=1)).transpose(TARGETS[name].to_base)


def merge(cfg: gemma.GemmaConfig, lc: LoraConfig, base: dict[str, jax.Array],
          lora: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Base params with every adapter folded in (W + scale * A @ B), each in its base dtype and sharding."""
    out = dict(base)
    for i in range(cfg.n_layers):
        for name in lc.targets:
            if f"layers.{i}.{name}.a" not in lora:
                continue
            t = TARGETS[name]
            key = f"layers.{i}.{t.base}"
            w = out[key]
            d = delta(lc, lora, i, name)
            upd = w.astype(jnp.float32)
            if t.index is None:
                upd = upd + d
            elif t.experts:
                upd = upd.at[:, t.index].add(d)
            else:
                upd = upd.at[t.index].add(d)
            out[key] = jax.device_put(upd.astype(w.dtype), w.sharding) if hasattr(w, "sharding") else upd.astype(w.dtype)
    return out


def check_matches(cfg: gemma.GemmaConfig, lc: LoraConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Adapters (name -> shape) against the base model they are applied to: one line naming the mismatch."""
    want = {n: s for n, (s, _) in param_layout(cfg, lc).items()}
    missing = sorted(set(want) - set(shapes))
    if missing:
        raise UsageError(f"{where}: the adapters have no {missing[0]} for this base ({cfg.n_layers} layers); "
                         "they were trained on a different base model")
    for n, s in want.items():
        if tuple(shapes[n]) != tuple(s):
            raise UsageError(f"{where}: adapter {n} has shape {tuple(shapes[n])} but this base needs {tuple(s)} "
                             f"(d_model {cfg.d_model}, heads {cfg.n_heads}/{cfg.n_kv_heads}, ff {cfg.ff}); "
                             "they were trained on a different base model")
