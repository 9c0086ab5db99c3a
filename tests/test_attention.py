"""The splash attention kernel (Pallas, run by its interpreter on CPU) against XLA attention, and --attention.

Kernel: causal, a sliding window, soft-capped scores, one kv head for all (MQA) and two for four query heads
(GQA), packed rows (segment ids), forward and gradients, f32 (1e-5 / 1e-4) and bf16 (stated below). Models:
GPT-2's attention and Gemma's local (window, soft-cap, GQA) and global (MQA, QK-norm) layers with splash equal
their XLA path on a 2x2 mesh (batch over data, heads over model, as the kernel's shard_map has them); GPT-2's
with the resident kernel (trainer/kernels/resident_attention.py) too. Shapes are the kernel's smallest: 128 positions.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _skips import needs_setup
from trainer.common import mesh as mesh_lib
from trainer.common.config import PRESETS, UsageError
from trainer.models import attention, gemma, gpt2

sys.path.insert(0, str(Path(__file__).parent))
import _gemma_ckpt as gc  # noqa: E402

B, T, H, HD = 2, 128, 2, 32


def reference(q, k, v, window=None, softcap=None, segments=None):
    """Masked softmax attention written out: q [B, T, H, hd] (scaled), k, v [B, T, K, hd]."""
    b, t, h, hd = q.shape
    kh = k.shape[2]
    s = jnp.einsum("btkgh,bskh->btkgs", q.reshape(b, t, kh, h // kh, hd), k, preferred_element_type=jnp.float32)
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    qp, kp = jnp.arange(t)[:, None], jnp.arange(t)[None]
    mask = jnp.broadcast_to(kp <= qp, (b, t, t))
    if window:
        mask &= kp > qp - window
    if segments is not None:
        mask &= segments[:, :, None] == segments[:, None, :]
    s = jnp.where(mask[:, :, None, None, :], s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("btkgs,bskh->btkgh", p, v).reshape(b, t, h, hd)


def _qkv(dtype, kv_heads, heads=H):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, heads, HD)) * HD ** -0.5 * 3  # scores of a few units: soft-capping bites
    k, v = (rng.standard_normal((B, T, kv_heads, HD)) for _ in range(2))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


# Packed rows, as a packed batch has them: documents of different lengths, boundaries off the kernel's 128-position
# blocks and different in each row, a document of one position, and a row that is one document.
SEGMENTS = np.stack([np.repeat([0, 1, 2, 3], [50, 1, 40, 37]), np.zeros(T, int)]).astype(np.int32)

CASES = {
    "causal": dict(kv_heads=H),
    "window": dict(kv_heads=1, window=16),
    "softcap": dict(kv_heads=1, softcap=2.0),
    "gqa": dict(heads=4, kv_heads=2),  # query heads 0, 1 read kv head 0; 2, 3 read kv head 1
    "packed": dict(heads=4, kv_heads=2, segments=SEGMENTS),
    "packed-window-softcap": dict(kv_heads=1, window=16, softcap=2.0, segments=SEGMENTS),
}


F32, BF16 = (jnp.float32, (1e-5, 1e-4)), (jnp.bfloat16, (1e-2, 2e-2))  # (forward, gradients)


# f32: absolute. bf16 (8 mantissa bits): relative to the largest magnitude of each reference tensor.
# The kernel's other ways of running (attention.Kernel: q, k, v unpadded with the sequence minor, one backward
# kernel, the forward pass of trainer/kernels/splash_fwd.py) compute the same attention: the causal, window and
# packed GQA cases with them, and bf16 with soft-capping (the Gemma 2 layers' scores as a TPU run computes them).
SEQ_MINOR_FUSED = attention.Kernel(layout="seq-minor", bwd="fused", fwd="compact")


@pytest.mark.parametrize("case,dtype,tol,kernel", [(c, *F32, attention.Kernel()) for c in CASES]
                         + [("causal", *BF16, attention.Kernel())]
                         + [(c, *F32, SEQ_MINOR_FUSED) for c in ("causal", "window", "packed")]
                         + [("softcap", *BF16, SEQ_MINOR_FUSED)])
def test_splash_matches_xla_attention_forward_and_gradients(case, dtype, tol, kernel):
    kw = dict(CASES[case])
    seg = kw.pop("segments", None)
    seg = None if seg is None else jnp.asarray(seg)
    q, k, v = _qkv(dtype, kw.pop("kv_heads"), kw.pop("heads", H))
    probe = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), dtype)

    def f(impl):
        def run(q, k, v):
            if impl == "xla":
                y = reference(q, k, v, segments=seg, **kw)
            else:
                y = attention.splash(q, k, v, segment_ids=seg, interpret=True, kernel=kernel, **kw)
            return y, jnp.sum(y.astype(jnp.float32) * probe)
        y, vjp = jax.vjp(lambda *a: run(*a)[1], q, k, v)
        return run(q, k, v)[0], vjp(jnp.ones((), jnp.float32))
    y, grads = f("splash")
    y_ref, grads_ref = f("xla")
    scale = (lambda r: 1.0) if dtype == jnp.float32 else (lambda r: float(np.abs(r).max()))
    for (a, r), t in [((y, y_ref), tol[0])] + [(pair, tol[1]) for pair in zip(grads, grads_ref)]:
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(a, r, atol=t * scale(r))


def _close(a, r, tol):
    """|a - r| <= tol x the largest |r|: weight gradients summed over 256 tokens reach ~100."""
    r = np.asarray(r)
    np.testing.assert_allclose(np.asarray(a), r, atol=tol * max(1.0, float(np.abs(r).max())))


def _mesh():
    return mesh_lib.make_mesh({"data": 2, "model": 2}, jax.devices()[:4])


# Splash at 4 heads of 32; the resident kernel at 4 heads of 64, two per device over model=2: one group of 128
# lanes each, in the kernel's shard_map.
@pytest.mark.parametrize("d_model,kernel", [(128, attention.INTERPRET), (256, attention.RESIDENT_INTERPRET)])
def test_gpt2_attention_with_a_kernel_equals_xla_on_a_mesh(d_model, kernel):
    model, _ = PRESETS["gpt2-tiny"]
    import dataclasses
    cfg = dataclasses.replace(model, n_head=4, d_model=d_model)
    attn = gpt2.Attention(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(attn)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, d_model)), jnp.float32)

    _splash_equals_xla(graphdef, state, x, lambda layer, x, impl: layer(x, impl), kernel)


@pytest.mark.parametrize("family,index", [("gemma2", 0), ("gemma3", 5)])  # a local layer; a global one
def test_gemma_layer_with_splash_equals_xla_on_a_mesh(family, index):
    """gemma2 layer 0: window 4, soft-cap 50, 4 heads over 2 kv heads. gemma3 layer 5: global, 1 kv head,
    QK-norm. Two packed examples per row (segment ids, positions restarting at 0)."""
    cfg = gc.TINY[family]
    layer = gemma.Layer(cfg, index, nnx.Rngs(index))
    assert layer.kind == (gemma.LOCAL if index == 0 else gemma.GLOBAL)
    graphdef, state = nnx.split(layer)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
    seg = jnp.asarray(1 + (np.arange(T)[None] >= np.array([[50], [100]])), jnp.int32)
    pos = jnp.asarray(np.where(seg == 1, np.arange(T), np.arange(T) - np.array([[50], [100]])), jnp.int32)

    _splash_equals_xla(graphdef, state, x, lambda layer, x, impl: layer(x, pos, None, None, seg, None, impl)[0])


def _splash_equals_xla(graphdef, state, x, call, kernel=attention.INTERPRET):
    """A layer's output and the gradients of its weights and input, through a kernel (interpret mode: splash's
    unless named) and through XLA attention on the 2x2 mesh: forward to 1e-5, gradients to 1e-4 (`_close`)."""
    def loss(state, x, impl):
        y = call(nnx.merge(graphdef, state), x, impl)
        return jnp.sum(jnp.sin(y)), y
    with jax.set_mesh(_mesh()):
        out = {impl: jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(state, x, impl)
               for impl in (attention.XLA, kernel)}
    (_, y), g = out[kernel]
    (_, y_ref), g_ref = out[attention.XLA]
    _close(y, y_ref, 1e-5)
    for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        _close(a, r, 1e-4)


def test_auto_follows_the_devices_compiled_for():
    # auto on TPU: what the chip measured faster (trainer/common/chip_choices.py): the resident kernel on v5e where
    # it takes the model (GPT-2's heads of 64), splash where it does not (Gemma's windows) and on unmeasured kinds
    assert attention.resolve("auto", "tpu", 1024, "TPU v5 lite", heads=(12, 64)) == attention.RESIDENT
    assert attention.resolve("auto", "tpu", 1024, "TPU v5 lite", heads=None) == attention.SPLASH
    assert attention.resolve("auto", "tpu", 1024, "TPU v5 lite", heads=(25, 64)) == attention.SPLASH
    assert attention.resolve("auto", "tpu", 1024, "TPU v5 lite", heads=(8, 32)) == attention.SPLASH  # not timed
    assert attention.resolve("auto", "tpu", 1024, "TPU v4", heads=(12, 64)) == attention.SPLASH
    assert attention.resolve("auto", "tpu", 1024) == attention.SPLASH
    assert attention.resolve("auto", "cpu", 1024) == attention.XLA
    assert attention.resolve("auto", "tpu", 100) == attention.XLA  # not whole kernel blocks
    assert attention.resolve("splash", "cpu", 256) == attention.INTERPRET
    assert attention.resolve("xla", "tpu", 1024) == attention.XLA
    with pytest.raises(UsageError, match="multiple of 128"):
        attention.resolve("splash", "tpu", 100)
    # The resident kernel: GPT-2's plain causal attention in whole groups of 128 lanes, nothing else.
    assert attention.resolve("resident", "tpu", 1024, heads=(12, 64)) == attention.RESIDENT
    assert attention.resolve("resident", "cpu", 1024, heads=(12, 64)) == attention.RESIDENT_INTERPRET
    for heads, seq, words in (((25, 64), 1024, "25 heads of 64"), ((12, 96), 1024, "head_dim 96"),
                              ((12, 64), 4096, "at most 8 blocks"), (None, 1024, "windows")):
        with pytest.raises(UsageError, match=words):
            attention.resolve("resident", "tpu", seq, heads=heads)


# ---- the TPU compiler's view (libtpu, the `plan` extra): the kernel is in the step and its scores are not ------

def _compile_for_v5e(attn: str):
    """A one-layer GPT-2 step (T=1024, 4 sequences per device, a 1k vocabulary so the output layer stays small,
    XLA's loss in one piece so that no loop needs an unrolled twin to be counted and no kernel but attention's is
    in the program) compiled for v5e:2x4 as `python -m
    trainer.plan` does: (figures, compiled HLO text)."""
    import argparse
    from trainer.common import aot
    from trainer.cli import parser
    opts = argparse.Namespace(devices=8, processes=1, num_slices=1, tpu="v5e:2x4", chip_config="default",
                              host_bounds="2,2,1", fallback_cpu=False, run_platform="cpu")
    target = aot.target(opts)
    args = parser().parse_args(["pretrain", "--ckpt-dir", "/tmp/unused", "--n-layer", "1", "--n-head", "4",
                                "--d-model", "256", "--seq-len", "1024", "--batch-size", "32", "--vocab-size", "1024",
                                "--dropout", "0", "--loss-kernel", "xla", "--loss-chunk", "0", "--attention", attn])
    built = aot.BUILDERS["pretrain"](args, target)
    compiled = built.compile()
    return aot.figures(built, compiled, target, 0.0), compiled.as_text()


@pytest.mark.slow
@needs_setup(not __import__("trainer.common.aot").common.aot.has_libtpu(),
             "libtpu (the `plan` extra, which `make setup` installs)")
def test_splash_step_for_v5e_has_the_kernel_and_fewer_temporaries_than_xla():
    splash, hlo = _compile_for_v5e("splash")
    xla, xla_hlo = _compile_for_v5e("xla")
    resident, resident_hlo = _compile_for_v5e("resident")  # Mosaic takes the resident kernel, both passes
    assert resident["settings"]["attention"] == attention.RESIDENT
    assert "resident_attention_fwd" in resident_hlo and "resident_attention_bwd" in resident_hlo
    assert 0 < resident["temp_bytes"] < 0.5 * xla["temp_bytes"], (resident["temp_bytes"], xla["temp_bytes"])
    assert splash["settings"]["attention"] == attention.SPLASH and xla["settings"]["attention"] == attention.XLA
    assert splash["counted"] == xla["counted"] == "program"  # one compile each
    assert 'custom_call_target="tpu_custom_call"' in hlo  # the Mosaic kernel, compiled for the TPU
    assert "tpu_custom_call" not in xla_hlo
    assert 0 < splash["temp_bytes"] < 0.5 * xla["temp_bytes"], (splash["temp_bytes"], xla["temp_bytes"])
    assert splash["bytes_accessed"] < xla["bytes_accessed"]
