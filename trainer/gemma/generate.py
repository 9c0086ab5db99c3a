"""Gemma text generation with a KV cache: prefill + decode in one compiled while-loop on the mesh.

`python -m trainer sample --weights PATH --prompt TEXT [--chat]`. The prompt is padded to a power of two
(so prompts of similar length share one compilation) and written into the cache in one call; each
decode step then feeds one token and reads the cache. Right padding is harmless: a decode step
overwrites the padded slot at its own position before attending, and never attends past itself.
New tokens leave the loop through a host callback as they are sampled, so they print as they come.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trainer.common.config import UsageError
from trainer.models import gemma


@dataclass(frozen=True)
class SampleConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0    # 0 = greedy
    top_k: int = 0              # 0 = no top-k cut
    top_p: float = 1.0          # 1 = no nucleus cut
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens {self.max_new_tokens}: expected at least 1")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UsageError("--temperature and --top-k must not be negative and --top-p must be in (0, 1]")


def pick(logits: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """One token id from f32 logits [V]: greedy when temperature is 0, else a draw at that temperature
    from the top_k best (0 = all) cut to the smallest set reaching probability top_p (1 = all).
    All three are traced values: changing them never recompiles."""
    v = logits.shape[-1]
    lg = logits / jnp.maximum(temperature, 1e-6)
    srt = jnp.sort(lg)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    srt = jnp.where(jnp.arange(v) < k, srt, -jnp.inf)
    probs = jax.nn.softmax(srt)
    n_keep = jnp.clip(jnp.sum(jnp.cumsum(probs) - probs < top_p), 1, k)  # the best token always stays
    lg = jnp.where(lg < srt[n_keep - 1], -jnp.inf, lg)
    drawn = jax.random.categorical(key, lg)
    return jnp.where(temperature == 0, jnp.argmax(logits), drawn).astype(jnp.int32)


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _mask_vocab(logits: jax.Array, n_valid: int) -> jax.Array:
    """Embedding rows past the tokenizer's pieces are padding: never sampled."""
    if n_valid >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < n_valid, logits, -jnp.inf)


_emit: list[Callable[[int], None] | None] = [None]  # where the running loop's tokens go (host side)


def _host_emit(tok) -> None:
    if _emit[0] is not None:
        _emit[0](int(tok))


@functools.lru_cache(maxsize=16)
def _sampler(cfg: gemma.GemmaConfig, max_new: int, p_len: int, stop_ids: tuple[int, ...], n_valid: int, dtype):
    """jitted (params, prompt [p_len], prompt_len, temperature, top_k, top_p, seed) -> (ids [max_new]
    padded with -1, count). Only the shapes are static."""
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def run(params, prompt, prompt_len, temperature, top_k, top_p, seed):
        model = gemma.from_flat(cfg, params)
        cache = gemma.init_cache(cfg, 1, p_len + max_new, dtype)
        logits, cache = model(prompt[None], cache=cache, cache_index=0, dtype=dtype)
        first = jax.lax.dynamic_index_in_dim(logits[0], prompt_len - 1, keepdims=False)
        key = jax.random.key(seed)

        def cond(s):
            i, _, _, _, done = s
            return (i < max_new) & ~done

        def body(s):
            i, lg, cache, out, _ = s
            tok = pick(_mask_vocab(lg, n_valid), jax.random.fold_in(key, i), temperature, top_k, top_p)
            done = jnp.isin(tok, stops)
            jax.debug.callback(_host_emit, tok)
            out = out.at[i].set(jnp.where(done, -1, tok))
            nxt, cache = model(tok.reshape(1, 1), cache=cache, cache_index=prompt_len + i, dtype=dtype)
            return i + 1, nxt[0, 0], cache, out, done

        init = (jnp.int32(0), first, cache, jnp.full((max_new,), -1, jnp.int32), jnp.bool_(False))
        i, _, _, out, done = jax.lax.while_loop(cond, body, init)
        return out, i - done.astype(jnp.int32)

    return jax.jit(run)


def generate(cfg: gemma.GemmaConfig, params: dict, prompt_ids: list[int], sc: SampleConfig, *,
             stop_ids: tuple[int, ...] = (), n_valid: int | None = None, dtype=jnp.float32,
             emit: Callable[[int], None] | None = None, mesh=None) -> list[int]:
    """The new token ids (without the prompt, without the stop token) for `prompt_ids`."""
    sc.check()
    if not prompt_ids:
        raise UsageError("the prompt is empty: pass some text (the tokenizer adds BOS)")
    p_len = _bucket(len(prompt_ids))
    fn = _sampler(cfg, sc.max_new_tokens, p_len, tuple(stop_ids), n_valid or cfg.vocab, jnp.dtype(dtype))
    prompt = np.zeros(p_len, np.int32)
    prompt[: len(prompt_ids)] = prompt_ids
    _emit[0] = emit
    try:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            out, n = fn(params, jnp.asarray(prompt), jnp.int32(len(prompt_ids)), jnp.float32(sc.temperature),
                        jnp.int32(sc.top_k), jnp.float32(sc.top_p), jnp.uint32(sc.seed))
            out, n = np.asarray(out), int(n)
    finally:
        _emit[0] = None
    return [int(t) for t in out[:n]]


def generate_recompute(cfg: gemma.GemmaConfig, params: dict, prompt_ids: list[int], n_new: int,
                       dtype=jnp.float32, mesh=None) -> list[int]:
    """Greedy without a cache: the full sequence through the model for every new token (the reference
    the cached loop must agree with, and the baseline it is timed against)."""
    total = _bucket(len(prompt_ids) + n_new)

    @jax.jit
    def step(params, seq, last):
        logits, _ = gemma.from_flat(cfg, params)(seq[None], dtype=dtype)
        return jnp.argmax(logits[0, last]).astype(jnp.int32)

    seq = np.zeros(total, np.int32)
    seq[: len(prompt_ids)] = prompt_ids
    n = len(prompt_ids)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        for _ in range(n_new):
            seq[n] = int(step(params, jnp.asarray(seq), n - 1))
            n += 1
    return [int(t) for t in seq[len(prompt_ids): n]]


class Streamer:
    """Prints the decoded text of the tokens seen so far as it grows (only on process 0)."""

    def __init__(self, decode: Callable[[list[int]], str], stop_ids: tuple[int, ...], out=sys.stdout):
        self.decode, self.stop_ids, self.out = decode, set(stop_ids), out
        self.ids: list[int] = []
        self.printed = ""
        self.t0 = time.perf_counter()

    def __call__(self, tok: int) -> None:
        if tok in self.stop_ids or jax.process_index() != 0:
            return
        self.ids.append(tok)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


def sample_main(args) -> int:
    """`python -m trainer sample --weights ...`: load onto the mesh, tokenize, stream the continuation."""
    from trainer.common import mesh as mesh_lib
    from trainer.gemma import tokenizer as tok_lib
    from trainer.gemma import weights
    from trainer.common.mesh import compute_dtype
    sc = SampleConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    sc.check()
    family = weights.check_model(args.model)
    told = weights.parse_config(getattr(args, "weights_config", ""))
    mesh_lib.init_distributed()
    mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh(args.mesh or "", jax.device_count()))
    ck = weights.inspect(args.weights, family=family, **told)
    weights.check_size(args.model, ck.cfg, args.weights)
    tok = tok_lib.load(ck.path, ck.cfg.vocab, args.tokenizer)
    if ck.guessed and jax.process_index() == 0:
        print(ck.guess_note(), file=sys.stderr, flush=True)
    dt = compute_dtype(args.dtype)
    _, params = weights.load(args.weights, mesh, family=family, dtype=jnp.bfloat16 if dt == jnp.bfloat16 else None,
                             **told)
    if getattr(args, "adapters", None):  # fine-tuned: W + scale * A @ B, the same function as applying them
        from trainer.finetune import train as finetune
        from trainer.models import lora
        lc, adapters = finetune.load_adapters(args.adapters, ck.cfg, mesh)
        params = lora.merge(ck.cfg, lc, params, adapters)
    ids = tok.chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    streamer = Streamer(tok.decode, tok.stop_ids)
    t0 = time.perf_counter()
    new = generate(ck.cfg, params, ids, sc, stop_ids=tok.stop_ids, n_valid=tok.vocab_size, dtype=dt,
                   emit=streamer, mesh=mesh)
    dt_s = time.perf_counter() - t0
    if jax.process_index() == 0:
        print(file=sys.stdout)
        print(f"[{len(new)} tokens in {dt_s:.2f} s (compile included); {ck.cfg.family} "
              f"{ck.cfg.n_layers} layers, d_model {ck.cfg.d_model}, mesh {mesh_lib.shape_of(mesh)}]", file=sys.stderr)
    return 0
