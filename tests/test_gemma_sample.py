"""Gemma sampling: the KV-cache loop against full recompute, the sampling options, stopping, and the CLI."""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _gemma_ckpt as gc
from _trainer_util import REPO, env, session_cache
from trainer.gemma import generate as gen
from trainer.common import mesh as mesh_lib
from trainer.models import gemma

PROMPT = [2, 5, 9, 11, 3, 40, 41]


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh({"data": 4, "model": 2})


def _params(cfg, mesh, seed=3):
    sh = gemma.shardings(cfg, mesh)
    return {k: jax.device_put(v, sh[k]) for k, v in gemma.random_params(cfg, seed).items()}


@pytest.mark.parametrize("fam", ["gemma2", "gemma3"])
def test_cached_greedy_equals_full_recompute_for_32_tokens(mesh, fam):
    cfg = gc.TINY[fam]  # sliding window 4: the cache holds more than a local layer may see
    params = _params(cfg, mesh)
    emitted = []
    cached = gen.generate(cfg, params, PROMPT, gen.SampleConfig(32), emit=emitted.append, mesh=mesh)
    full = gen.generate_recompute(cfg, params, PROMPT, 32, mesh=mesh)
    assert cached == full and len(cached) == 32
    assert len(set(cached)) >= 3  # not a degenerate constant run
    assert emitted == cached  # streamed once each, in order, across the 8 devices


def test_sampling_options(mesh):
    cfg = gc.TINY["gemma3"]
    params = _params(cfg, mesh)
    greedy = gen.generate(cfg, params, PROMPT, gen.SampleConfig(12), mesh=mesh)
    assert gen.generate(cfg, params, PROMPT, gen.SampleConfig(12, temperature=1.0, top_k=1), mesh=mesh) == greedy
    assert gen.generate(cfg, params, PROMPT, gen.SampleConfig(12, temperature=1.0, top_p=1e-6), mesh=mesh) == greedy
    hot = [gen.generate(cfg, params, PROMPT, gen.SampleConfig(12, temperature=2.0, seed=s), mesh=mesh)
           for s in (0, 0, 1)]
    assert hot[0] == hot[1] != hot[2]
    # Hot top-k 2 strays from greedy but only ever picks one of its step's 2 best tokens (full forward).
    out = gen.generate(cfg, params, PROMPT, gen.SampleConfig(12, temperature=50.0, top_k=2, seed=4), mesh=mesh)
    assert out != greedy
    logits, _ = gemma.from_flat(cfg, params)(jnp.asarray([PROMPT + out]))
    for i, t in enumerate(out):
        assert t in np.argsort(-np.asarray(logits[0, len(PROMPT) - 1 + i]))[:2]


def test_stops_at_a_stop_id_and_never_samples_padding_rows(mesh):
    cfg = gc.TINY["gemma2"]
    params = _params(cfg, mesh)
    greedy = gen.generate(cfg, params, PROMPT, gen.SampleConfig(16), mesh=mesh)
    stop = greedy[5]
    first = greedy.index(stop)
    assert gen.generate(cfg, params, PROMPT, gen.SampleConfig(16), stop_ids=(stop,), mesh=mesh) == greedy[:first]
    hot = gen.generate(cfg, params, PROMPT, gen.SampleConfig(64, temperature=3.0), n_valid=40, mesh=mesh)
    assert hot and max(hot) < 40


@pytest.fixture(scope="module")
def tiny_flax(tmp_path_factory):
    cfg = gc.TINY["gemma2"]
    root = str(tmp_path_factory.mktemp("g2") / "flax")
    gc.write_flax(root, cfg, gemma.random_params(cfg, 5))
    gc.write_tokenizer(root + "/tokenizer.model", cfg.vocab)
    return root


def _sample(tmp_path_factory, *args):
    e = env(session_cache(tmp_path_factory), devices=8)
    return subprocess.run([sys.executable, "-m", "trainer", "sample", *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=300)


def test_cli_samples_a_chat_turn_on_the_mesh(tiny_flax, tmp_path_factory):
    p = _sample(tmp_path_factory, "--weights", tiny_flax, "--prompt", "To be or not", "--chat",
                "--max-new-tokens", "10", "--temperature", "0", "--mesh", "data=4,model=2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "gemma2 4 layers" in p.stderr and "mesh {'data': 4, 'model': 2}" in p.stderr
    assert p.stdout.strip()
    # the tiny shapes are no named size: what they cannot tell was guessed, and the run says so
    assert f"note: --weights {tiny_flax}: its shapes match no named gemma2 size, so these are guessed: " \
           "sliding_window=4096, query_pre_attn_scalar=16.0; " in p.stderr, p.stderr


def test_cli_samples_gemma4_named_by_its_family_with_what_its_shapes_cannot_tell(tmp_path_factory):
    """`sample --model gemma4` (a family, as `lora` takes; a size must be the checkpoint's) on a tiny Gemma 4 of
    the E kind, its window given by --weights-config: nothing guessed, greedy on the mesh."""
    cfg = gc.TINY4["e"]
    root = str(tmp_path_factory.mktemp("g4") / "flax")
    gc.write_flax(root, cfg, gemma.random_params(cfg, 5))
    gc.write_tokenizer(root + "/tokenizer.model", cfg.vocab)
    p = _sample(tmp_path_factory, "--weights", root, "--model", "gemma4", "--weights-config", "sliding_window=4",
                "--prompt", "To be", "--max-new-tokens", "6", "--temperature", "0", "--mesh", "data=4,model=2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "gemma4 10 layers" in p.stderr and "note:" not in p.stderr, p.stderr


@pytest.mark.parametrize("extra, message", [
    (["--model", "gemma3"], "error: --model gemma3: --weights .* is a gemma2 checkpoint; pass --model gemma2"),
    (["--tokenizer", "BIG"], "error: tokenizer .* has 128 pieces but the checkpoint's embedding has 96 rows"),
    (["--top-p", "0"], "error: --temperature and --top-k must not be negative and --top-p must be in"),
    (["--model", "gemma2-9b"], "error: --model gemma2-9b: --weights .* holds a gemma2 checkpoint \\(4 layers, width "
                               "64\\); pass --model gemma2 or leave --model out"),
])
def test_cli_bad_input_is_one_line(tiny_flax, tmp_path_factory, extra, message):
    import re
    if "BIG" in extra:
        extra = ["--tokenizer", gc.write_tokenizer(str(tmp_path_factory.mktemp("tok") / "t.model"), 128)]
    p = _sample(tmp_path_factory, "--weights", tiny_flax, "--prompt", "x", *extra)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(message, lines[0]), p.stderr


def test_cli_weights_path_without_a_checkpoint(tmp_path, tmp_path_factory):
    p = _sample(tmp_path_factory, "--weights", str(tmp_path), "--prompt", "x")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: --weights {tmp_path}: no Gemma checkpoint there (no *.safetensors, no Orbax params dir; found: "
        "nothing); pass the folder `tpuctl weights pull` staged"]


def test_cli_needs_exactly_one_checkpoint_kind(tiny_flax, tmp_path_factory):
    p = _sample(tmp_path_factory, "--weights", tiny_flax, "--ckpt-dir", tiny_flax, "--prompt", "x")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: sample: pass either --ckpt-dir (a GPT-2 checkpoint) or --weights (a Gemma checkpoint)"]
    p = _sample(tmp_path_factory, "--ckpt-dir", tiny_flax, "--chat")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: sample: --chat, --model, --tokenizer, --top-p, --mesh and --weights-config apply to Gemma --weights "
        "only"]
