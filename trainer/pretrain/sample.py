"""Text from a checkpoint: `python -m trainer sample --ckpt-dir DIR --prompt TEXT`.

No KV cache: each new token re-runs the model over the last seq_len tokens (fixed shape, one compile).
The logits at the last real position are the same as with a cache because attention is causal.
Each sample is recorded with the run (`<ckpt-dir>/samples.jsonl`: step, prompt, options, text), where the
run's report (trainer/experiments/report.py) finds its final sample.
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from trainer.pretrain import tokenizers
from trainer.common.checkpoint import Checkpointer
from trainer.common.config import UsageError
from trainer.common.mesh import compute_dtype
from trainer.models import gpt2


SAMPLES = "samples.jsonl"


def load(ckpt_dir: str, step: int | None = None):
    """(config, params on one device) of `step` (default: the latest finished step)."""
    cfg, params, _ = _load(ckpt_dir, step)
    return cfg, params


def _load(ckpt_dir: str, step: int | None):
    if "://" not in ckpt_dir:
        ckpt_dir = os.path.abspath(ckpt_dir)  # Orbax wants absolute local paths
    if not epath.Path(ckpt_dir).exists():
        raise UsageError(f"--ckpt-dir {ckpt_dir} does not exist; train into it with `python -m trainer pretrain`")
    ckpt = Checkpointer(ckpt_dir, keep=1, read_only=True)
    try:
        steps = ckpt.mngr.all_steps()
        if not steps:
            raise UsageError(f"--ckpt-dir {ckpt_dir} has no finished checkpoint")
        step = max(steps) if step is None else step
        if step not in steps:
            raise UsageError(f"--step {step}: not in {ckpt_dir} (it has {', '.join(map(str, sorted(steps)))})")
        cfg = ckpt.saved_config(step)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shapes = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(gpt2.GPT2(cfg.model, nnx.Rngs(0)), nnx.Param)))
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), shapes)
        params, _ = ckpt.restore(step, target)
    finally:
        ckpt.close()
    return cfg, params, step


def generate(ckpt_dir: str, prompt: str, *, record: bool = False, step: int | None = None, **kw) -> str:
    """Prompt + continuation, decoded (see generate_ids for the options); record: add it to samples.jsonl."""
    _check(**kw)
    cfg, params, step = _load(ckpt_dir, step)
    enc = tokenizer_of(cfg)
    text = enc.decode(_sample(cfg, params, enc.encode_ordinary(prompt), **kw))
    if record:
        _record(ckpt_dir, {"step": step, "prompt": prompt, **kw, "text": text, "time": time.time()})
    return text


def generate_seeds(ckpt_dir: str, prompt: str, seeds, *, step: int | None = None, **kw) -> list[str]:
    """generate's text for each seed, the checkpoint read once (nothing recorded): what a judgement of the model
    over several samples reads."""
    _check(**kw)
    cfg, params, _ = _load(ckpt_dir, step)
    enc = tokenizer_of(cfg)
    return [enc.decode(_sample(cfg, params, enc.encode_ordinary(prompt), seed=s, **kw)) for s in seeds]


def tokenizer_of(cfg):
    """The tokenizer the checkpoint was trained with (checkpoints from before it was recorded: GPT-2's)."""
    return tokenizers.get(cfg.model.tokenizer or "gpt2")


def _record(ckpt_dir: str, rec: dict) -> None:
    """Append to <ckpt-dir>/samples.jsonl (rewritten whole on gs://, which cannot append). A dir this process
    may read but not write keeps no record: the sample itself is still printed."""
    path = epath.Path(ckpt_dir) / SAMPLES
    try:
        old = path.read_text() if path.exists() else ""
        path.write_text(old + json.dumps(rec) + "\n")
    except Exception as e:  # noqa: BLE001 - OSError locally, gcsfs's HttpError on gs://: the sample still prints
        print(f"note: the sample was not recorded in {path} ({e})", file=sys.stderr)


def _check(max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, **_) -> None:
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise UsageError("--max-new-tokens, --temperature and --top-k must not be negative")


def generate_ids(ckpt_dir: str, ids: list[int], *, step: int | None = None, **kw) -> list[int]:
    """Prompt ids + up to max_new_tokens sampled ids (stops at <|endoftext|>). temperature 0 = greedy."""
    _check(**kw)
    cfg, params = load(ckpt_dir, step)
    return _sample(cfg, params, ids, **kw)


def _sample(cfg, params, ids: list[int], *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
            seed: int = 0, dtype: str = "auto") -> list[int]:
    m = cfg.model
    graphdef, _ = gpt2.abstract(m)
    dt = compute_dtype(dtype)
    prompt = list(ids)
    eot = tokenizer_of(cfg).eot_token
    ids = prompt or [eot]  # an empty prompt starts from a document boundary

    @jax.jit
    def next_token(params, window, pos, key):
        logits = nnx.merge(graphdef, params)(window[None], dtype=dt)[0, pos, : m.vocab_size]
        if temperature == 0:
            return jnp.argmax(logits)
        logits = logits / temperature
        if top_k:
            kth = jax.lax.top_k(logits, min(top_k, m.vocab_size))[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits)

    key = jax.random.key(seed)
    out = list(ids)
    for i in range(max_new_tokens):
        ctx = out[-m.seq_len:]
        window = np.zeros(m.seq_len, np.int32)
        window[: len(ctx)] = ctx  # right padding never reaches earlier positions (causal)
        tok = int(next_token(params, window, len(ctx) - 1, jax.random.fold_in(key, i)))
        if tok == eot:
            break
        out.append(tok)
    return out if prompt else out[1:]
