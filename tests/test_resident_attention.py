"""The resident attention kernel (trainer/kernels/resident_attention.py, run by Pallas' interpreter on CPU) against
causal softmax attention written out, forward and gradients: two heads of 64 per 128 lanes (GPT-2's) and one of
128, four blocks of the causal triangle (the unrolled loops' every kind of block pair), a sequence shorter than
the block, f32 (1e-5 / 1e-4 of the largest value) and bf16 (2e-2, the kernel's own rounding of p and ds)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.kernels import resident_attention as ra


def reference(q, k, v):
    t = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32), precision="highest")
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32), precision="highest")


@pytest.mark.parametrize("b,t,h,hd,block,dtype,tol", [
    (2, 512, 4, 64, 128, jnp.float32, (1e-5, 1e-4)),   # 2 groups of 2 heads, 4 x 4 blocks
    (1, 256, 2, 128, 128, jnp.float32, (1e-5, 1e-4)),  # one head per group
    (1, 128, 2, 64, 256, jnp.float32, (1e-5, 1e-4)),   # the sequence is one block, shorter than asked
    (1, 512, 2, 64, 256, jnp.bfloat16, (2e-2, 2e-2)),
])
def test_resident_attention_matches_softmax_attention_forward_and_gradients(b, t, h, hd, block, dtype, tol):
    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.standard_normal((b, t, h, hd)) * s, dtype)
                   for s in (2 * hd ** -0.5, 1.0, 1.0, 1.0))  # scores of a few units: a peaked softmax
    out, pull = jax.vjp(lambda q, k, v: ra.attend(q, k, v, block=block, interpret=True), q, k, v)
    want, pull_ref = jax.vjp(reference, q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    for got, ref, t_ in [(out, want, tol[0])] + [(g, r, tol[1]) for g, r in zip(pull(ct.astype(dtype)),
                                                                               pull_ref(ct.astype(jnp.float32)))]:
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert np.abs(got - ref).max() <= t_ * np.abs(ref).max(), (np.abs(got - ref).max(), np.abs(ref).max())


def test_shapes_it_does_not_take_are_named():
    assert ra.supports(12, 64, 1024, 256) is None and ra.supports(6, 128, 2048, 256) is None
    assert "head_dim 256" in ra.supports(4, 256, 1024, 256)
    assert "3 heads of 64" in ra.supports(3, 64, 1024, 256)
    assert "at most 8 blocks" in ra.supports(12, 64, 4096, 256)
    assert "more VMEM" in ra.supports(12, 64, 2048, 512)  # the compiler's limit, found compiling for v5e
    with pytest.raises(ValueError, match="head_dim 96"):
        ra.attend(*(jnp.zeros((1, 128, 4, 96)),) * 3)
