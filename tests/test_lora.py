"""LoRA fine-tuning of Gemma (trainer/models/lora.py, trainer/finetune/data.py, trainer/finetune/train.py) on tiny random
checkpoints, 8 emulated CPU devices on a 4x2 mesh."""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _gemma_ckpt as gc
from _trainer_util import Procs, env, metrics, tail
from trainer.finetune import train as finetune
from trainer.finetune import data as sft_data
from trainer.gemma import tokenizer as tok_lib
from trainer.gemma import weights
from trainer.common import checkpoint, mesh as mesh_lib
from trainer.cli import main
from trainer.common.config import UsageError
from trainer.finetune.config import LoraRun
from trainer.models import gemma, lora as lora_lib

MESH = "data=4,model=2"
# Short, repeated answers the adapters can memorise.
FACTS = [("capital of France?", "Paris"), ("two plus two?", "four"), ("colour of the sky?", "blue"),
         ("opposite of hot?", "cold"), ("first letter?", "a"), ("a dog says?", "woof"),
         ("ice is?", "frozen water"), ("to be or not?", "to be that is the question")]
# Wide enough that the adapters' size against the base is like a real model's (the tiny ones are mostly
# embedding and metadata).
WIDE = gemma.GemmaConfig("gemma2", vocab=96, d_model=512, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128,
                         ff=1024, sliding_window=4, query_pre_attn_scalar=128.0)


def _write(root: str, cfg, layout: str, seed: int = 5) -> str:
    params = gemma.random_params(cfg, seed)
    if layout == "flax":
        gc.write_flax(root, cfg, params)
    else:
        gc.write_hf(root, cfg, params)
    gc.write_tokenizer(os.path.join(root, "tokenizer.model"), 96)
    return root


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("bases")
    return {"gemma2": _write(str(d / "g2"), gc.TINY["gemma2"], "transformers"),
            "gemma3": _write(str(d / "g3"), gc.TINY["gemma3"], "flax")}


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "facts.jsonl"
    with open(path, "w") as f:
        for p, r in FACTS:
            f.write(json.dumps({"prompt": p, "response": r}) + "\n")
        f.write(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "name?"},
                                         {"role": "assistant", "content": "Gemma"}]}) + "\n")
    return str(path)


def _run(base, data, ckpt, **kw) -> LoraRun:
    opts = dict(seq_len=48, batch_size=4, steps=30, lr=1e-2, mesh=MESH, log_every=1, ckpt_every=0,
                dtype="float32", base_dtype="float32", val_fraction=0.0, rank=8, alpha=16)
    opts.update(kw)
    return LoraRun(weights=base, data=data, ckpt_dir=str(ckpt), **opts)


def _metrics(ckpt) -> list[dict]:
    return [json.loads(ln) for ln in open(os.path.join(ckpt, "metrics.jsonl"))]


def _mesh():
    return mesh_lib.make_mesh(mesh_lib.parse_mesh(MESH, jax.device_count()))


# ---------------------------------------------------------------- adapters


def test_targets_counts_and_gemma2_2b_sizes():
    assert lora_lib.resolve_targets("v,q") == ("q", "v")
    assert lora_lib.resolve_targets("all") == lora_lib.DENSE == ("q", "k", "v", "o", "gate", "up", "down")
    assert lora_lib.resolve_targets("*_proj") == lora_lib.DENSE  # globs never reach the experts
    assert lora_lib.resolve_targets("attn,experts") == ("q", "k", "v", "o") + lora_lib.EXPERTS
    assert lora_lib.resolve_targets("mlp") == ("gate", "up", "down")
    assert lora_lib.resolve_targets("q_proj,down") == ("q", "down")
    for bad in ("qq", "q,attention", "lm_head"):
        with pytest.raises(UsageError, match="matches no projection"):
            lora_lib.resolve_targets(bad)
    c = gemma.SIZES["gemma2-2b"]
    d, qo, kv, f = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.ff
    io = {"q": (d, qo), "k": (d, kv), "v": (d, kv), "o": (qo, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
    for spec in ("q,v", "all"):
        lc = lora_lib.LoraConfig(8, 16, 0.0, lora_lib.resolve_targets(spec))
        want = c.n_layers * sum(8 * sum(io[t]) for t in lc.targets)
        assert lora_lib.count(c, lc) == want
    assert lora_lib.count(c, lora_lib.LoraConfig(8, 16, 0.0, ("q", "v"))) == 1_597_440
    assert lora_lib.count(c, lora_lib.LoraConfig(8, 16, 0.0, lora_lib.DENSE)) == 10_383_360


def _batch(cfg, b=2, t=12, seed=0):
    rng = np.random.default_rng(seed)
    z = np.zeros((b, t), np.int32)
    return {"inputs": rng.integers(4, cfg.vocab, (b, t)).astype(np.int32), "targets": z,
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)), "segments": z + 1}


def _trained(cfg, lc, seed=1):
    """Adapters with B random too (as after training), so every adapter changes the output."""
    lora = lora_lib.init(cfg, lc, seed)
    return {n: (0.05 * jax.random.normal(jax.random.key(hash(n) % 1000), a.shape) if n.endswith(".b") else a)
            for n, a in lora.items()}


def test_gemma4_adapters_follow_each_layers_projections():
    e, moe = gc.TINY4["e"], gc.TINY4["moe"]
    lay = lora_lib.param_layout(e, lora_lib.LoraConfig(4, 8, 0.0, lora_lib.DENSE))
    assert lay["layers.4.q.b"][0] == (4, 4, 32) and lay["layers.0.q.b"][0] == (4, 4, 16)  # global heads are wider
    assert "layers.4.k.a" in lay and "layers.5.k.a" not in lay and "layers.5.v.a" not in lay  # kv-shared: none
    assert lay["layers.5.down.a"][0] == (192, 4) and lay["layers.0.down.a"][0] == (96, 4)
    lay = lora_lib.param_layout(moe, lora_lib.LoraConfig(4, 8, 0.0, lora_lib.DENSE + lora_lib.EXPERTS))
    assert "layers.5.k.b" in lay and "layers.5.v.a" not in lay  # k=v global layer: its k adapter feeds both
    assert lay["layers.0.expert_gate.a"][0] == (8, 64, 4) and lay["layers.0.expert_down.b"][0] == (8, 4, 64)
    with pytest.raises(UsageError, match="--targets expert_gate,expert_up,expert_down: this model has no experts"):
        lora_lib.check_model(e, lora_lib.LoraConfig(4, 8, 0.0, lora_lib.EXPERTS))


def test_gemma4_peft_adapters_are_the_merge_in_hugging_face_terms():
    """Gemma 4's PEFT modules sit under the text model's path, each layer's heads flattened at its own width."""
    from trainer.gemma import export
    cfg = gc.TINY4["e"]
    lc = lora_lib.LoraConfig(4, 8, 0.0, ("q", "k", "down"))
    base, lora = gemma.random_params(cfg, 3), _trained(cfg, lc)
    peft = export.peft_tensors(lc, lora, cfg.family)
    hb, hm = export.hf_tensors(cfg, base), export.hf_tensors(cfg, lora_lib.merge(cfg, lc, base, lora))
    assert len(peft) == len(lora)  # one lora_A or lora_B each
    for name, w in hb.items():
        stem = name[:-len(".weight")]
        a = peft.get(f"base_model.model.{stem}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(hm[name], w)
            continue
        b = peft[f"base_model.model.{stem}.lora_B.weight"]
        np.testing.assert_allclose(w + lc.scale * b @ a, hm[name], atol=1e-5)
    assert "base_model.model.model.language_model.layers.4.self_attn.q_proj.lora_B.weight" in peft
    with pytest.raises(UsageError, match="PEFT has no layout for per-expert adapters"):
        moe = gc.TINY4["moe"]
        export.peft_tensors(lora_lib.LoraConfig(4, 8, 0.0, lora_lib.EXPERTS), {}, moe.family)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma4-e", "gemma4-moe"])
def test_b_zero_is_the_base_and_merge_equals_adapters(family):
    cfg = gc.TINY4[family[7:]] if family.startswith("gemma4") else gc.TINY[family]
    base = gemma.random_params(cfg, 3)
    lc = lora_lib.LoraConfig(4, 8, 0.0, tuple(lora_lib.TARGETS) if cfg.n_experts else lora_lib.DENSE)
    x = _batch(cfg)
    logits = jax.jit(lambda params, lora=None: gemma.from_flat(cfg, params)(
        jnp.asarray(x["inputs"]), adapter=None if lora is None else lora_lib.adapter(lc, lora))[0])
    plain = logits(base)
    step0 = logits(base, lora_lib.init(cfg, lc, 0))
    np.testing.assert_array_equal(np.asarray(step0), np.asarray(plain))
    lora = _trained(cfg, lc)
    applied = logits(base, lora)
    merged = logits(lora_lib.merge(cfg, lc, base, lora))
    assert float(jnp.max(jnp.abs(applied - plain))) > 1e-2  # every adapter is live
    np.testing.assert_allclose(np.asarray(merged), np.asarray(applied), atol=1e-4)


def test_dropout_scales_kept_inputs_and_is_off_at_eval():
    cfg = gc.TINY["gemma2"]
    base = gemma.random_params(cfg, 3)
    lc = lora_lib.LoraConfig(4, 8, 0.5, ("q", "v"))
    lora = _trained(cfg, lc)
    x = jnp.asarray(_batch(cfg)["inputs"])
    out = lambda key: gemma.from_flat(cfg, base)(x, adapter=lora_lib.adapter(lc, lora, key))[0]
    a, b, off = out(jax.random.key(0)), out(jax.random.key(1)), out(None)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-4
    np.testing.assert_array_equal(np.asarray(off), np.asarray(out(None)))


# ---------------------------------------------------------------- must-show 1: loss falls


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_loss_falls_on_a_memorisable_set(bases, facts, tmp_path, family):
    ckpt = tmp_path / "ck"
    assert finetune.finetune(_run(bases[family], facts, ckpt, targets="all", lr=1e-2, steps=40)) == 0
    losses = [m["loss"] for m in _metrics(ckpt)]
    assert len(losses) == 40
    assert max(losses[-3:]) < 0.5 * losses[0], losses


def _steps(base_root, **kw):
    mesh = _mesh()
    run = _run(base_root, "unused", "unused", **kw)
    ck, base = weights.load(base_root, mesh)
    steps = finetune.Steps(run, ck.cfg, mesh, 10, run.batch_size)
    return steps, steps.place_base(base), ck.cfg


def test_base_frozen_and_optimizer_state_holds_lora_shapes_only(bases, facts):
    steps, base, cfg = _steps(bases["gemma2"], targets="q,v,down")
    before = {n: np.asarray(a).copy() for n, a in base.items()}
    tok = tok_lib.load(bases["gemma2"], cfg.vocab)
    recs = sft_data.read_jsonl(facts)
    rows = sft_data.build_rows([sft_data.encode(tok, m) for m in recs], 48)
    batches = sft_data.Batches(rows, 4, 0)
    lora, opt = steps.init()
    for s in range(1, 4):
        lora, opt, _ = steps.step(lora, opt, base, batches.local_batch(s), s)
    for n, a in base.items():
        assert np.asarray(a).tobytes() == before[n].tobytes(), n  # bit-identical
    shapes = {n: s for n, (s, _) in steps.lora_layout.items()}
    arrays = [x for x in jax.tree.leaves(opt) if x.ndim > 0]
    # Adam's two moments per adapter, nothing base-shaped; rank x (in + out) per target and layer.
    assert sorted(x.shape for x in arrays) == sorted(2 * list(shapes.values()))
    io = {"q": cfg.d_model + cfg.n_heads * cfg.head_dim, "v": cfg.d_model + cfg.n_kv_heads * cfg.head_dim,
          "down": cfg.ff + cfg.d_model}
    assert sum(x.size for x in arrays) == 2 * cfg.n_layers * 8 * sum(io.values())
    assert sum(x.size for x in jax.tree.leaves(opt) if x.ndim == 0) <= 4  # step counters only


def test_adapter_checkpoint_is_under_5_percent_of_the_base(tmp_path, facts):
    root = _write(str(tmp_path / "wide"), WIDE, "transformers")
    ckpt = tmp_path / "ck"
    assert finetune.finetune(_run(root, facts, ckpt, steps=2, targets="q,v")) == 0
    size = lambda d: sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)
    base_bytes = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root) if f.endswith(".safetensors"))
    ratio = size(ckpt / "2") / base_bytes
    assert ratio < 0.05, ratio


# ---------------------------------------------------------------- must-show 2: exact resume


def test_exact_resume_and_no_base_state_in_the_checkpoint(bases, facts, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert finetune.finetune(_run(bases["gemma2"], facts, straight, steps=6, dropout=0.1)) == 0
    assert finetune.finetune(_run(bases["gemma2"], facts, split, steps=3, dropout=0.1)) == 0
    assert finetune.finetune(_run(bases["gemma2"], facts, split, steps=6, dropout=0.1)) == 0
    a, b = _metrics(straight), _metrics(split)
    assert [m["step"] for m in b] == list(range(1, 7))
    np.testing.assert_allclose([m["loss"] for m in b], [m["loss"] for m in a], atol=1e-6, rtol=0)
    cfg = gc.TINY["gemma2"]
    lc_a, la = finetune.load_adapters(str(straight), cfg, _mesh())
    _, lb = finetune.load_adapters(str(split), cfg, _mesh())
    for n in la:
        np.testing.assert_allclose(np.asarray(lb[n]), np.asarray(la[n]), atol=1e-6, rtol=0)
    # What a step holds: the adapters, their optimizer state and the run's config; no base name or shape.
    assert sorted(os.listdir(split / "6")) == ["_CHECKPOINT_METADATA", "commit_success.txt", "meta", "opt", "params"]
    meta = json.load(open(split / "6" / "params" / "_METADATA"))
    names = {".".join(ast.literal_eval(k)) for k in meta["tree_metadata"]}
    assert names and all(n.endswith((".a", ".b")) for n in names), sorted(names)[:5]
    assert set(la) == {n for n, _ in lora_lib.param_layout(cfg, lc_a).items()}
    # The written-out step's checkpoint (adapters per layer, as every checkpoint before the scanned step held them
    # stacked) read by the scanned step (--remat full: lora.stacked_layout): the same adapters, stacked
    assert json.load(open(split / "3" / "meta" / "metadata"))["config"]["adapter_layout"] == "layers"
    full = _run(bases["gemma2"], facts, split, steps=6, dropout=0.1, remat="full")
    steps = finetune.Steps(full, cfg, _mesh(), 6, full.batch_size)
    ck = checkpoint.Checkpointer(str(split), 3, read_only=True)
    try:
        lo, opt = finetune.restore_state(ck, 3, steps, finetune.adapter_meta(ck, 3))
    finally:
        ck.close()
    _, l3 = finetune.load_adapters(str(split), cfg, _mesh(), step=3)
    want = gemma.stack(cfg, {n: np.asarray(a) for n, a in l3.items()})
    assert steps.scanned and set(lo) == set(want) and any(n.startswith(gemma.SCANNED) for n in want)
    assert all(np.array_equal(np.asarray(lo[n]), want[n]) for n in want)
    assert jax.tree.structure(opt) == jax.tree.structure(steps.abstract_opt)
    # ... and resumed by it: the run goes on from step 3 (its dropout masks are the scan's own, so near the straight
    # run's losses, not equal); its checkpoint says stacked and loads per layer
    mixed = tmp_path / "mixed"
    shutil.copytree(split, mixed, ignore=lambda d, names: [n for n in names if n.isdigit() and n != "3"
                                                           or n == "metrics.jsonl"])
    assert finetune.finetune(dataclasses.replace(full, ckpt_dir=str(mixed))) == 0
    c = _metrics(mixed)
    assert [m["step"] for m in c] == [4, 5, 6]
    np.testing.assert_allclose([m["loss"] for m in c], [m["loss"] for m in a[3:]], rtol=0.02)
    assert json.load(open(mixed / "6" / "meta" / "metadata"))["config"]["adapter_layout"] == "stacked"
    _, lm = finetune.load_adapters(str(mixed), cfg, _mesh())
    assert list(lm) == list(la) and all(lm[n].shape == la[n].shape for n in la)


@pytest.mark.slow
def test_preemption_notice_saves_the_adapters_exits_42_and_the_next_run_resumes(bases, facts, tmp_path):
    ckpt = tmp_path / "ck"
    args = ["lora", "--emulate-devices", "8", "--weights", bases["gemma2"], "--data", facts, "--mesh", MESH,
            "--seq-len", "48", "--batch-size", "4", "--dtype", "float32", "--base-dtype", "float32",
            "--log-every", "1", "--ckpt-every", "0", "--val-fraction", "0"]
    procs = Procs()
    try:
        p = procs.start([*args, "--steps", "100000", "--ckpt-dir", str(ckpt)],
                        env(str(tmp_path / "cache"), devices=None), tmp_path / "log")
        deadline = time.time() + 240
        while not any(r["step"] >= 2 for r in metrics(ckpt)):
            assert p.poll() is None and time.time() < deadline, tail(p.log)
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 42, tail(p.log)
    finally:
        procs.close()
    log = p.log.read_text()
    assert "Traceback" not in log, tail(p.log)
    saved = int(re.search(r"preemption notice: saved step (\d+)", log).group(1))
    assert saved >= 2 and (ckpt / str(saved) / "params").is_dir()
    assert main(["lora", *args[3:], "--steps", str(saved + 1), "--ckpt-dir", str(ckpt)]) == 0
    steps = [r["step"] for r in metrics(ckpt)]
    assert steps[-1] == saved + 1 and max(steps[:-1]) == saved


# ---------------------------------------------------------------- must-show 5 and 6: masking, packing


def _tok(bases):
    return tok_lib.load(bases["gemma2"], 96)


def test_loss_weights_cover_the_model_turns_only(bases):
    tok = _tok(bases)
    ex = sft_data.encode(tok, [{"role": "user", "content": "to be"}, {"role": "assistant", "content": "or not"},
                               {"role": "user", "content": "the question"}, {"role": "model", "content": "to be"}])
    assert ex.ids == tok.chat([{"role": "user", "content": "to be"}, {"role": "model", "content": "or not"},
                               {"role": "user", "content": "the question"}, {"role": "model", "content": "to be"}],
                              add_generation_prompt=False)
    runs, cur = [], []
    for i, w in zip(ex.ids, ex.loss):
        if w:
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    texts = [tok.decode(r) for r in runs + [cur] if r]
    # The model turns' text and their end marker (a piece spanning the turn's opening newline may lead).
    assert len(texts) == 2 and texts[0].endswith("or not<end_of_turn>") and texts[1].endswith("to be<end_of_turn>")
    assert len(texts[0]) <= len("\nor not<end_of_turn>") and len(texts[1]) <= len("\nto be<end_of_turn>")


def test_prompt_targets_do_not_change_the_loss(bases):
    cfg = gc.TINY["gemma2"]
    tok = _tok(bases)
    rows = sft_data.build_rows([sft_data.encode(tok, [{"role": "user", "content": p}, {"role": "model", "content": r}])
                                for p, r in FACTS[:3]], 64)
    batch = rows.take(np.arange(len(rows)))
    base, lc = gemma.random_params(cfg, 3), lora_lib.LoraConfig(4, 8, 0.0, ("q", "v"))
    lora = _trained(cfg, lc)

    def loss(b):
        ce = finetune.token_losses(cfg, lc, base, lora, {k: jnp.asarray(v) for k, v in b.items()})
        return float(jnp.sum(ce * b["weights"]) / jnp.sum(b["weights"]))
    changed = dict(batch)
    prompt = (batch["weights"] == 0)
    assert prompt.sum() > 10
    changed["targets"] = np.where(prompt, (batch["targets"] + 7) % cfg.vocab, batch["targets"])
    assert loss(changed) == loss(batch)
    resp = dict(batch)
    resp["targets"] = np.where(~prompt, (batch["targets"] + 7) % cfg.vocab, batch["targets"])
    assert abs(loss(resp) - loss(batch)) > 1e-3  # the response targets do count


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_the_chunked_loss_equals_the_full_logits_and_gives_the_base_no_gradient(bases, family):
    """A step's loss_sums take the output layer a chunk of positions at a time (Gemma 2 soft-caps its logits,
    Gemma 3 does not): the same weighted sum, weight total and adapter gradients as token_losses' full logits,
    in chunks of 16 of 64 and whole (--loss-chunk 0); the frozen embedding's gradient is zero."""
    cfg = gc.TINY[family]
    tok = _tok(bases)
    rows = sft_data.build_rows([sft_data.encode(tok, [{"role": "user", "content": p}, {"role": "model", "content": r}])
                                for p, r in FACTS[:3]], 64)
    batch = {k: jnp.asarray(v) for k, v in rows.take(np.arange(len(rows))).items()}
    base, lc = gemma.random_params(cfg, 3), lora_lib.LoraConfig(4, 8, 0.0, ("q", "v"))
    lora = _trained(cfg, lc)

    def full(lora, base):
        ce = finetune.token_losses(cfg, lc, base, lora, batch)
        return jnp.sum(ce * batch["weights"]) / jnp.sum(batch["weights"])
    want, (g_lora, g_full_base) = jax.value_and_grad(full, argnums=(0, 1))(lora, base)
    for chunk in (16, 0):
        def chunked(lora, base):
            s, n = finetune.loss_sums(cfg, lc, base, lora, batch, loss_chunk=chunk)
            assert float(n) == float(jnp.sum(batch["weights"])) > 0
            return s / n
        got, (g, g_base) = jax.value_and_grad(chunked, argnums=(0, 1))(lora, base)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
        for name in g_lora:
            np.testing.assert_allclose(g[name], g_lora[name], rtol=1e-4,
                                       atol=1e-5 * float(jnp.abs(g_lora[name]).max()))  # f32 sums in another order
        # The embedding's gradient comes from the input lookup alone: rows of tokens not in the inputs get none
        # (through the full logits every row gets some: the softmax touches them all).
        unused = np.setdiff1d(np.arange(cfg.vocab), np.asarray(batch["inputs"]))
        assert float(jnp.abs(g_base["embed"][unused]).max()) == 0.0 < float(jnp.abs(g_full_base["embed"][unused]).max())


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_packed_examples_lose_as_each_alone(bases, family):
    cfg = gc.TINY[family]
    tok = _tok(bases)
    exs = [sft_data.encode(tok, [{"role": "user", "content": p}, {"role": "model", "content": r}])
           for p, r in FACTS[:3]]
    packed = sft_data.build_rows(exs, 96, packing=True)
    alone = sft_data.build_rows(exs, 96, packing=False)
    assert len(packed) == 1 and len(alone) == 3
    assert packed.segments.max() == 3 and packed.positions[0, packed.segments[0] == 2][0] == 0
    base, lc = gemma.random_params(cfg, 3), lora_lib.LoraConfig(4, 8, 0.0, tuple(lora_lib.TARGETS))
    lora = _trained(cfg, lc)
    ce = lambda rows: np.asarray(finetune.token_losses(cfg, lc, base, lora, {
        k: jnp.asarray(v) for k, v in rows.take(np.arange(len(rows))).items()}))
    cp, ca = ce(packed), ce(alone)
    for s in range(3):
        sel = packed.segments[0] == s + 1
        per_packed = (cp[0] * packed.weights[0])[sel].sum() / packed.weights[0][sel].sum()
        per_alone = (ca[s] * alone.weights[s]).sum() / alone.weights[s].sum()
        np.testing.assert_allclose(per_packed, per_alone, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- data


def test_long_examples_truncated_or_dropped_with_counts():
    ex = [sft_data.Example(list(range(n)), [True] * n) for n in (5, 30, 8)]
    t = sft_data.build_rows(ex, 12, long="truncate")
    assert (t.truncated, t.dropped) == (1, 0)
    assert [int((r > 0).sum()) for r in t.segments] == [4, 12, 7]  # the long one fills a row by itself
    np.testing.assert_array_equal(t.inputs[1], np.arange(12))
    d = sft_data.build_rows(ex, 12, long="drop")
    assert (d.truncated, d.dropped) == (0, 1)
    assert len(d) == 1 and d.segments[0].tolist() == [1] * 4 + [2] * 7 + [0]  # the other two packed
    with pytest.raises(UsageError, match="all 1 are longer"):
        sft_data.build_rows(ex[1:2], 12, long="drop")


class _OnProcess:
    """A CPU device that says it belongs to process `process_index`: one process of 8 emulated devices stands in
    for 4 processes of 2, as local multislice runs have them (CPU devices carry no slice_index)."""

    def __init__(self, device, process_index: int):
        self.device, self.process_index = device, process_index

    def __getattr__(self, name):
        return getattr(self.device, name)


def test_lora_on_two_slices_builds_pretrains_hybrid_mesh_and_steps_as_on_one(bases, facts, monkeypatch):
    """MEGASCALE_NUM_SLICES=2 over 4 processes x 2 devices: `lora` lays the devices out as `pretrain` does
    (dcn over the slices, each slice's processes together), checks the batch against dcn x data, and its step
    on that hybrid mesh gives the losses of the same step on one slice's mesh."""
    from trainer.common.config import PRESETS, Config
    from trainer.pretrain import train as pretrain
    real = jax.devices()
    fake = [_OnProcess(d, d.id // 2) for d in real]
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "0")
    with monkeypatch.context() as m:
        m.setattr(jax, "devices", lambda *a: list(fake))
        m.setattr(jax, "process_count", lambda *a: 4)
        m_cfg, t_cfg = PRESETS["gpt2-tiny"]
        theirs = pretrain.setup_mesh(Config("gpt2-tiny", m_cfg, dataclasses.replace(t_cfg, mesh="data=2,model=2")))
        run = _run(bases["gemma2"], facts, "unused", mesh="data=2,model=2", batch_size=8)
        ours, batch = finetune.setup_mesh(run)
        with pytest.raises(UsageError, match=r"--batch-size 6 is not divisible by the mesh's data axis \(4 over 2 "
                                             r"slices\)"):
            finetune.setup_mesh(dataclasses.replace(run, batch_size=6))
    ids = lambda mesh: np.vectorize(lambda d: d.id)(mesh.devices).tolist()  # noqa: E731
    assert dict(ours.shape) == {"dcn": 2, "data": 2, "model": 2} and ours.axis_names == theirs.axis_names
    assert ids(ours) == ids(theirs) and batch == 8
    assert ids(ours)[0] == [[0, 1], [2, 3]]  # slice 0: processes 0 and 1
    assert mesh_lib.describe(ours) == "2 slices x data=2,model=2"

    hybrid = jax.sharding.Mesh(np.vectorize(lambda d: d.device)(ours.devices), ours.axis_names,
                               axis_types=ours.axis_types)
    losses = {}
    for name, mesh in (("one slice", mesh_lib.make_mesh({"data": 4, "model": 2})), ("two slices", hybrid)):
        ck, base = weights.load(bases["gemma2"], mesh)
        steps = finetune.Steps(run, ck.cfg, mesh, 10, batch)
        base = steps.place_base(base)
        assert steps.batch_sh.spec[0] == ("dcn", "data")
        tok = tok_lib.load(bases["gemma2"], ck.cfg.vocab)
        rows = sft_data.build_rows([sft_data.encode(tok, r) for r in sft_data.read_jsonl(facts)], 48)
        batches = sft_data.Batches(rows, batch, 0)
        lora, opt = steps.init()
        losses[name] = []
        for s in range(1, 4):
            lora, opt, out = steps.step(lora, opt, base, batches.local_batch(s), s)
            losses[name].append(float(out["loss"]))
    np.testing.assert_allclose(losses["two slices"], losses["one slice"], rtol=1e-5)
    assert losses["one slice"][-1] < losses["one slice"][0]


def test_global_batch_is_a_function_of_seed_and_step_only():
    ex = [sft_data.Example(list(range(3 + i % 5)), [True] * (3 + i % 5)) for i in range(40)]
    rows = sft_data.build_rows(ex, 8, packing=False)
    one = sft_data.Batches(rows, 8, seed=3)
    two = [sft_data.Batches(rows, 8, seed=3, process_index=p, process_count=2) for p in (0, 1)]
    for step in (1, 5, 6, 11):  # 40 rows / 8 = 5 steps an epoch: 6 and 11 start new epochs
        whole = one.local_batch(step)
        halves = [b.local_batch(step) for b in two]
        for f in sft_data.FIELDS:
            np.testing.assert_array_equal(np.concatenate([h[f] for h in halves]), whole[f])
    ids = np.concatenate([one.row_ids(s) for s in range(1, 6)])
    assert sorted(ids.tolist()) == list(range(40))  # an epoch sees every row once
    assert not np.array_equal(one.row_ids(1), sft_data.Batches(rows, 8, seed=4).row_ids(1))


# ---------------------------------------------------------------- must-show 7: bad input


def _cli(capsys, *args) -> str:
    rc = main(["lora", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_bad_input_one_line_each(bases, facts, tmp_path, capsys):
    common = ["--weights", bases["gemma2"], "--data", facts, "--mesh", MESH, "--steps", "1", "--seq-len", "48"]
    ck = str(tmp_path / "ck")
    assert "--rank 0" in _cli(capsys, *common, "--ckpt-dir", ck, "--rank", "0")
    assert "'qkv' matches no projection" in _cli(capsys, *common, "--ckpt-dir", ck, "--targets", "q,qkv")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": \n')
    assert f"{broken} line 3: not valid JSON" in _cli(capsys, "--weights", bases["gemma2"], "--data", str(broken),
                                                      "--ckpt-dir", ck)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"prompt": "a", "answer": "b"}\n')
    assert "line 1: expected" in _cli(capsys, "--weights", bases["gemma2"], "--data", str(wrong), "--ckpt-dir", ck)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no Gemma checkpoint there" in _cli(capsys, "--weights", str(empty), "--data", facts, "--ckpt-dir", ck)
    assert "--profile 2:2: the window is empty" in _cli(capsys, *common, "--ckpt-dir", ck, "--profile", "2:2")
    assert "the run ends at step 1" in _cli(capsys, *common, "--ckpt-dir", ck, "--profile", "1:3")
    # --epochs sets the last step: the window is checked against it once the data is read, before any step.
    epochs = ["--weights", bases["gemma2"], "--data", facts, "--mesh", MESH, "--seq-len", "48", "--epochs", "0.5"]
    assert "--profile 50:52: the run ends at step" in _cli(capsys, *epochs, "--ckpt-dir", ck, "--profile", "50:52")
    assert not os.path.exists(ck)  # nothing was written for any of them


def test_base_held_in_bf16_with_f32_adapters_and_a_validation_loss(bases, facts, tmp_path):
    f32, bf16 = tmp_path / "f32", tmp_path / "bf16"
    assert finetune.finetune(_run(bases["gemma2"], facts, f32, steps=2, val_fraction=0.3)) == 0
    assert finetune.finetune(_run(bases["gemma2"], facts, bf16, steps=2, val_fraction=0.3, base_dtype="bfloat16")) == 0
    a, b = _metrics(f32), _metrics(bf16)
    assert a[0]["loss"] != b[0]["loss"] and abs(a[0]["loss"] - b[0]["loss"]) < 2e-2  # the base, rounded to bf16
    assert math.isfinite(a[-1]["val_loss"]) and "val_loss" not in a[0]  # held-out examples, at the last step
    _, lora = finetune.load_adapters(str(bf16), gc.TINY["gemma2"], _mesh())
    assert {str(x.dtype) for x in lora.values()} == {"float32"}


def test_adapters_from_a_different_base_are_refused(bases, facts, tmp_path):
    ckpt = tmp_path / "ck"
    assert finetune.finetune(_run(bases["gemma2"], facts, ckpt, steps=0, epochs=0.5)) == 0
    tok = tok_lib.load(bases["gemma2"], 96)
    rows = sft_data.build_rows([sft_data.encode(tok, m) for m in sft_data.read_jsonl(facts)], 48)
    assert [m["step"] for m in _metrics(ckpt)] == list(range(1, math.ceil(0.5 * len(rows) / 4) + 1))  # --epochs
    with pytest.raises(UsageError, match="different base model"):
        finetune.load_adapters(str(ckpt), gc.TINY["gemma3"], _mesh())
    other = dataclasses.replace(gc.TINY["gemma2"], d_model=32)
    with pytest.raises(UsageError, match=r"has shape \(64, 8\) but this base needs \(32, 8\)"):
        finetune.load_adapters(str(ckpt), other, _mesh())
    # Resuming into the same dir with other LoRA settings is refused too.
    with pytest.raises(UsageError, match="--rank 8, not 4"):
        finetune.finetune(_run(bases["gemma2"], facts, ckpt, steps=2, rank=4))


# ---------------------------------------------------------------- must-show 4: merge and export


@pytest.fixture(scope="module")
def trained(bases, facts, tmp_path_factory):
    """Adapters on every projection after a few steps (B no longer zero), for each base."""
    out = {}
    for family in ("gemma2", "gemma3"):
        ckpt = tmp_path_factory.mktemp(f"trained_{family}")
        assert finetune.finetune(_run(bases[family], facts, ckpt, steps=3, targets="all", ckpt_every=0)) == 0
        out[family] = str(ckpt)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [("gemma2", "transformers"), ("gemma3", "flax")])
def test_merged_export_gives_the_logits_of_base_plus_adapters(bases, trained, tmp_path, capsys, family, layout):
    out = str(tmp_path / "merged")
    assert main(["export", "--weights", bases[family], "--adapters", trained[family], "--out", out, "--merge"]) == 0
    assert f"exported merged {layout} to {out}" in capsys.readouterr().out
    mesh = _mesh()
    ck, base = weights.load(bases[family], mesh)
    lc, lora = finetune.load_adapters(trained[family], ck.cfg, mesh)
    ck2, merged = weights.load(out, mesh)  # the same loader reads the export
    assert ck2.layout == layout and ck2.cfg == ck.cfg
    assert tok_lib.find(out)  # the tokenizer travels with it
    x = jnp.asarray(_batch(ck.cfg, t=16)["inputs"])
    applied = gemma.from_flat(ck.cfg, base)(x, adapter=lora_lib.adapter(lc, lora))[0]
    plain = gemma.from_flat(ck.cfg, base)(x)[0]
    again = gemma.from_flat(ck.cfg, merged)(x)[0]
    assert float(jnp.max(jnp.abs(applied - plain))) > 1e-3
    np.testing.assert_allclose(np.asarray(again), np.asarray(applied), atol=1e-4, rtol=0)
    with pytest.raises(UsageError, match="is not empty"):
        from trainer.gemma import export
        export.export(bases[family], trained[family], out, merge=True)


@pytest.mark.slow
def test_peft_adapters_are_the_merge_in_hugging_face_terms(bases, trained, tmp_path):
    from safetensors.numpy import load_file
    from trainer.gemma import export
    out = str(tmp_path / "peft")
    assert main(["export", "--weights", bases["gemma2"], "--adapters", trained["gemma2"], "--out", out,
                 "--adapters-only"]) == 0
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    assert conf["peft_type"] == "LORA" and conf["r"] == 8 and conf["lora_alpha"] == 16
    assert conf["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = load_file(os.path.join(out, "adapter_model.safetensors"))
    cfg = gc.TINY["gemma2"]
    mesh = _mesh()
    _, base = weights.load(bases["gemma2"], mesh)
    lc, lora = finetune.load_adapters(trained["gemma2"], cfg, mesh)
    hb, hm = export.hf_tensors(cfg, base), export.hf_tensors(cfg, lora_lib.merge(cfg, lc, base, lora))
    assert len(peft) == 2 * cfg.n_layers * 7
    for name, w in hb.items():
        stem = name[len("model."):-len(".weight")]
        a = peft.get(f"base_model.model.model.{stem}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(hm[name], w)
            continue
        b = peft[f"base_model.model.model.{stem}.lora_B.weight"]
        assert a.shape == (8, w.shape[1]) and b.shape == (w.shape[0], 8)
        np.testing.assert_allclose(w + conf["lora_alpha"] / conf["r"] * b @ a, hm[name], atol=1e-5)


@pytest.mark.slow
def test_sample_with_adapters_equals_sampling_the_merged_export(bases, trained, tmp_path, capsys):
    out = str(tmp_path / "merged")
    assert main(["export", "--weights", bases["gemma2"], "--adapters", trained["gemma2"], "--out", out, "--merge"]) == 0
    capsys.readouterr()
    gen = ["--prompt", "to be", "--chat", "--temperature", "0", "--max-new-tokens", "6", "--mesh", MESH]
    assert main(["sample", "--weights", bases["gemma2"], "--adapters", trained["gemma2"], *gen]) == 0
    with_adapters = capsys.readouterr().out
    assert main(["sample", "--weights", out, *gen]) == 0
    assert capsys.readouterr().out == with_adapters
    # (That the adapters change the model is checked on logits in the merge tests: six greedy tokens of a tiny
    # random model can decode to the same text, even to nothing, with and without them.)
    assert main(["sample", "--weights", bases["gemma3"], "--adapters", trained["gemma2"], *gen]) == 2
    assert "they were trained on a different base model" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_runs_ours_and_tunix_lora_steps_side_by_side():
    import subprocess
    import sys
    code = "import bench.peers.gemma_lora as g; g.main(rounds=1, per_round=1, n_layers=1)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"ours +(\d+) tok/s +tunix PeftTrainer\+qwix +(\d+) tok/s +ratio ([\d.]+)x", p.stdout)
    assert m and float(m.group(3)) > 0, p.stdout
    # one layer: a quarter of make bench's 4 (180,224 and 172,032), as every adapter is per layer
    assert re.search(r"adapter params: ours 45,056, tunix\+qwix 43,008", p.stdout), p.stdout


def test_adapters_are_laid_out_as_applied_whole_over_fsdp_split_over_model():
    """A and B are whole over the fsdp split they are stored with and split over `model` like the projection's side
    they meet (B's MLP columns and heads, A's input columns): on a mesh of data alone, whole; the same values."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    w = {"gate_b": (jnp.ones((8, 64)), (None, *lora_lib.TARGETS["gate"].out_axes)),
         "down_a": (jnp.ones((64, 8)), (*lora_lib.TARGETS["down"].in_axes, None)),
         "q_b": (jnp.ones((8, 4, 16)), (None, *lora_lib.TARGETS["q"].out_axes)),
         "q_a": (jnp.ones((32, 8)), (*lora_lib.TARGETS["q"].in_axes, None))}
    for shape, want in (({"data": 4, "model": 2}, {"gate_b": P(None, "model"), "down_a": P("model", None),
                                                      "q_b": P(None, "model", None), "q_a": P(None, None)}),
                        ({"data": 8, "model": 1}, {n: P(*(None,) * len(a.shape)) for n, (a, _) in w.items()})):
        mesh = mesh_lib.make_mesh(shape, jax.devices()[:8])  # the run's mesh: dcn, data, model
        with jax.set_mesh(mesh):
            for name, (a, axes) in w.items():
                stored = jax.device_put(a, NamedSharding(mesh, P(*(("data" if x == "fsdp" else None) for x in axes))))
                out = jax.jit(lambda x, axes=axes: lora_lib.as_applied(x, axes))(stored)
                assert out.sharding.is_equivalent_to(NamedSharding(mesh, want[name]), a.ndim), (shape, name)
                np.testing.assert_array_equal(np.asarray(out), np.asarray(a))
