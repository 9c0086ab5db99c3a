"""The kernels against f32 references, forward and gradients, on the chip: the loss kernels
(trainer/kernels/xent_kernel.py) and XLA's chunked loss against the full f32 logits; splash attention
(trainer/models/attention.py) and the resident kernel (trainer/kernels/resident_attention.py, at head_dims it
takes) against causal softmax attention written in plain f32 jnp. The inputs are rounded
to bf16 once and given to both sides, so the difference is the kernels' own arithmetic."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.tpu.common import Row, Settings, block, reps_for, say, time_steps

LOSS_TOL = 2e-2   # max |error| / max |reference| for bf16 matmuls with f32 accumulation
ATTN_TOL = 2e-2


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def loss_rows(s: Settings) -> list[Row]:
    from trainer.kernels import xent_kernel as xk
    from trainer.models import gpt2, xent
    n, d, vocab, padded = (256, 128, 700, 768) if s.quick else (8 * 1024, 768, 50257, 50304)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, n, d)), jnp.bfloat16)
    table = jnp.asarray(0.02 * rng.standard_normal((padded, d)), jnp.bfloat16).astype(jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (1, n)), jnp.int32)

    def reference(x, table):
        lg = jnp.einsum("btd,vd->btv", x.astype(jnp.float32), table, precision="highest")[..., :vocab]
        return gpt2.loss_fn(lg, targets)
    want, (wx, wt) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x, table)
    kernel = xk.Kernel(xk.Blocks(tokens=64, vocab=128, grad_vocab=128, grad_tokens=128), interpret=True) \
        if s.quick or jax.default_backend() != "tpu" else xk.Kernel()
    contenders = {
        "loss kernels (pallas)": lambda x, t: xk.loss(x, t, targets, vocab, kernel),
        "XLA loss, chunks of 256": lambda x, t: xent.chunked(x, t, targets, 256 if n >= 256 else n, vocab),
    }
    rows = []
    for name, fn in contenders.items():
        got, (gx, gt) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(x, table)
        err = {"loss": abs(float(got) - float(want)) / abs(float(want)), "dx": _rel(gx, wx), "dtable": _rel(gt, wt)}
        rows.append(Row("kernels", f"{name} vs f32 logits", ok=max(err.values()) <= LOSS_TOL,
                        note=", ".join(f"{k} {v:.1e}" for k, v in err.items()), figures=err))
    return rows


def _attention_ref(q, k, v, window=None):
    """Causal softmax attention in f32: q [B, T, H, hd] (scaled), k, v [B, T, K, hd]."""
    b, t, h, hd = q.shape
    rep = h // k.shape[2]
    k, v = (jnp.repeat(a, rep, axis=2).astype(jnp.float32) for a in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision="highest")
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    keep = (j <= i) if window is None else ((j <= i) & (j > i - window))
    s = jnp.where(keep, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def attention_rows(s: Settings) -> list[Row]:
    from trainer.models import attention
    on_tpu = jax.default_backend() == "tpu" and not s.quick
    shapes = {"gpt2-124m layer (12 x 64)": (2, 1024, 12, 12, 64),
              "gemma3-1b layer (4 x 256, 1 kv head)": (2, 512, 4, 1, 256)} if on_tpu else \
        {"tiny (2 x 64)": (1, 128, 2, 2, 64), "tiny GQA (4 x 128, 2 kv heads)": (1, 128, 4, 2, 128)}
    kernel = attention.Kernel("seq-minor", "fused", 1024, "splash")
    rows = []
    rng = np.random.default_rng(1)
    for name, (b, t, h, kh, hd) in shapes.items():
        q = jnp.asarray(rng.standard_normal((b, t, h, hd)) / np.sqrt(hd), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, t, kh, hd)), jnp.bfloat16) for _ in range(2))
        ct = jnp.asarray(rng.standard_normal((b, t, h, hd)), jnp.float32)
        lay = kernel if hd == 64 else attention.Kernel()

        def splash(q, k, v):
            return attention.splash(q, k, v, interpret=not on_tpu, kernel=lay).astype(jnp.float32)

        def vjp(fn):
            out, pull = jax.vjp(fn, q, k, v)
            return out, pull(ct)
        def resident(q, k, v):
            flat = [a.reshape(b, t, -1) for a in (q, k, v)]
            return attention.resident(*flat, hd, block=256 if t % 256 == 0 else t,
                                      interpret=not on_tpu).reshape(q.shape).astype(jnp.float32)
        want, wg = jax.jit(lambda: vjp(_attention_ref))()
        contenders = {"splash": splash}
        if kh == h and hd in (64, 128):
            contenders["resident"] = resident
        for kname, fn in contenders.items():
            got, gg = jax.jit(lambda fn=fn: vjp(fn))()
            err = {"out": _rel(got, want), **{f"d{n}": _rel(g, w) for n, g, w in zip("qkv", gg, wg)}}
            rows.append(Row("kernels", f"{kname} vs f32 attention, {name}", ok=max(err.values()) <= ATTN_TOL,
                            note=", ".join(f"{k} {v:.1e}" for k, v in err.items()), figures=err))
    return rows


def run(s: Settings):
    """The rows --rows asks for: "vs f32" the loss and attention kernels, "lora-impl" the LoRA impls."""
    if s.wants("vs f32 logits"):
        yield from loss_rows(s)
    if s.wants("vs f32 attention"):
        yield from attention_rows(s)
    if s.wants("--lora-impl stacked vs beside"):
        yield from lora_impl_rows(s)
    if s.wants("experts' MLP") or any(w.lstrip("=").startswith("experts' MLP") for w in s.rows):
        yield from experts_rows(s)


# Gemma 4 26B-A4B's experts (trainer/models/moe.py) as one device holds a layer's: name -> (rows in the buffer,
# rows routed, experts held, D, Fe), top 8. A chip holding all 128 at 4 and 8 x 512 tokens (128 and 256 rows an
# expert; 4 x 512 is the one-chip twin's layer), then a device under expert parallelism at capacity 2 x the even
# share (half the buffer routed): v4-8's 32 experts at 4 rows of 512 a device (512 an expert), v5litepod-8's 16 at
# 4 and 8 rows (1,024 and 2,048).
EXPERT_SHAPES = {"all 128 experts, 16384 rows": (16384, 16384, 128, 2816, 704),
                 "all 128 experts, 32768 rows": (32768, 32768, 128, 2816, 704),
                 "32 experts, 32768 rows": (32768, 16384, 32, 2816, 704),
                 "16 experts, 32768 rows": (32768, 16384, 16, 2816, 704),
                 "16 experts, 65536 rows": (65536, 32768, 16, 2816, 704)}
GMM_TILINGS = ((128, 128, 128), (512, 512, 512))


def experts_rows(s: Settings):
    """The experts' gated-GELU MLP (gate|up, then down: two grouped matmuls) forward and its gradient in the rows
    (the LoRA step's: the experts are frozen) by XLA's ragged_dot, the step's, and by the megablox grouped matmul
    kernel (jax.experimental.pallas.ops.tpu.megablox) at two tilings, timed at the shapes a 26B-A4B step's layer
    has on one chip: each against ragged_dot there (its f32 at full precision did not finish), against the same MLP
    in f32 at full precision off the chip. Its routing is random (every expert about the even share); rows past
    the routed ones stay out of every group, as the step pads them."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm
    on_tpu = jax.default_backend() == "tpu" and not s.quick
    shapes = EXPERT_SHAPES if on_tpu else {"tiny, 4 experts": (256, 128, 4, 256, 128)}
    tilings = {f"megablox gmm {t[0]}x{t[1]}x{t[2]}": t for t in (GMM_TILINGS if on_tpu else GMM_TILINGS[:1])}
    names = ["ragged_dot (XLA)", *tilings]
    for sname, (m, routed, e, d, fe) in shapes.items():
        wanted = [c for c in names if s.wants(f"experts' MLP, {c} vs f32, {sname}")]
        if not wanted:  # a shape's arrays are drawn only when one of its rows is asked for
            continue
        rng = np.random.default_rng(3)
        groups = jnp.asarray(np.bincount(rng.integers(0, e, routed), minlength=e), jnp.int32)
        x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
        w_in = jnp.asarray(rng.standard_normal((e, d, 2 * fe)) / np.sqrt(d), jnp.bfloat16)
        w_out = jnp.asarray(rng.standard_normal((e, fe, d)) / np.sqrt(fe), jnp.bfloat16)
        ct = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)

        def mlp(dot, x):
            gu = dot(x, w_in).reshape(-1, 2, fe)
            return dot(jax.nn.gelu(gu[:, 0], approximate=True) * gu[:, 1], w_out)

        def ragged(x, w, dt=jnp.bfloat16):
            return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes=groups, preferred_element_type=dt)

        def megablox(tiling):
            return lambda x, w: gmm(x, w, groups, jnp.bfloat16, tiling, interpret=not on_tpu)

        def vjp(dot, x):
            out, pull = jax.vjp(lambda x: mlp(dot, x), x)
            return out, pull(ct.astype(out.dtype))[0]
        contenders = {c: ragged if c == "ragged_dot (XLA)" else megablox(tilings[c]) for c in wanted}
        # the reference: off the chip the same MLP in f32 at full precision; on it XLA's ragged_dot itself (its
        # f32 at full precision did not finish in 9 minutes on the chip at these shapes), one program that the
        # ragged_dot row then times (compiling it twice took a minute a shape there)
        say(f"  experts' MLP, {sname}: the reference")
        reference = jax.jit(lambda x: vjp(ragged, x))
        if on_tpu:
            want, wdx = reference(x)
        else:
            with jax.default_matmul_precision("highest"):
                want, wdx = jax.jit(lambda x: vjp(lambda a, w: ragged(a, w, jnp.float32), x))(x.astype(jnp.float32))
        for cname, dot in contenders.items():
            name = f"experts' MLP, {cname} vs f32, {sname}"
            fn = reference if on_tpu and dot is ragged else jax.jit(lambda x, dot=dot: vjp(dot, x))
            say(f"  {name}: compiling and timing")
            try:
                got, gdx = fn(x)
            except Exception as e:  # noqa: BLE001 - a tiling the kernel refuses is a row that says so
                yield Row("kernels", name, ok=False, note=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            live = int(routed)  # rows past the routed ones are out of every group: zero in both
            err = {"out": _rel(got[:live], want[:live]), "dx": _rel(gdx[:live], wdx[:live])}
            first = time_steps(lambda: fn(x), 1, block)
            step_s = time_steps(lambda: fn(x), reps_for(first), block)
            flops = 2 * 2 * live * d * 3 * fe  # forward and the rows' gradient: twice its matmuls' 2 N D (3 Fe)
            yield Row("kernels", name, ok=max(err.values()) <= LOSS_TOL, step_s=step_s,
                      mfu=flops / step_s / s.peak if s.peak else None,
                      note=", ".join(f"{k} {v:.1e}" for k, v in err.items()) + f"; {step_s * 1e3:.2f} ms",
                      figures={**err, "rows": m, "routed": live, "experts": e, "flops": flops})



def lora_impl_rows(s: Settings, sizes: tuple[str, ...] = ("gemma3-1b", "gemma2-2b")) -> list[Row]:
    """Each --lora-impl (trainer/models/lora.py IMPLS) against `beside` on the chip: the loss and every adapter
    gradient of gemma3-1b's and gemma2-2b's first two layers at their real widths (the vocabulary cut to 16k so
    it is quick), rank 8 on all targets, 2 x 512 rows, bf16 compute over a bf16 base, both measured against the
    same step in f32 at full matmul precision. A row passes when the impl is no further from that reference than
    beside is (1.5x, plus 1e-3): the same arithmetic, rounded in another order. Three small compiles per size
    and impl pair (the f32 reference, beside, the impl)."""
    import dataclasses

    from trainer.finetune import train as finetune
    from trainer.models import gemma, lora as lora_lib
    on_tpu = jax.default_backend() == "tpu" and not s.quick
    rows = []
    for size in sizes:
        cfg = dataclasses.replace(gemma.SIZES[size], n_layers=2, vocab=16384) if on_tpu else \
            dataclasses.replace(gemma.SIZES[size], n_layers=2, vocab=256, d_model=128, n_heads=2, n_kv_heads=1,
                                head_dim=64, ff=256, query_pre_attn_scalar=64.0)
        b, t = (2, 512) if on_tpu else (1, 64)
        lc = lora_lib.LoraConfig(8, 16.0, 0.0, lora_lib.DENSE)
        base = jax.tree.map(lambda a: a.astype(jnp.bfloat16), gemma.random_params(cfg, 3))
        lora = lora_lib.init(cfg, lc, 1)
        lora = {n: (0.05 * jax.random.normal(jax.random.fold_in(jax.random.key(2), i), a.shape)
                    if n.endswith(".b") else a) for i, (n, a) in enumerate(sorted(lora.items()))}
        rng = np.random.default_rng(0)
        ids = rng.integers(4, cfg.vocab, (b, t + 1)).astype(np.int32)
        batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
                 "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                 "segments": jnp.ones((b, t), jnp.int32), "weights": jnp.ones((b, t), jnp.float32)}
        attn = "splash" if on_tpu else "xla"

        def grads(impl, dtype):
            def loss(lora):
                tot, n = finetune.loss_sums(cfg, lc, base, lora, batch, dtype=dtype, attention=attn, lora_impl=impl)
                return tot / n
            return jax.jit(jax.value_and_grad(loss))(lora)

        def errors(got, gg):
            return {"loss": abs(float(got) - float(want)) / abs(float(want)),
                    "grads": max(_rel(gg[n], gw[n]) for n in gw)}
        with jax.default_matmul_precision("highest"):
            want, gw = grads("beside", jnp.float32)
        plain = errors(*grads("beside", jnp.bfloat16))
        for impl in (i for i in lora_lib.IMPLS if i != "beside"):
            err = errors(*grads(impl, jnp.bfloat16))
            ok = all(err[k] <= 1.5 * plain[k] + 1e-3 for k in err)
            rows.append(Row("kernels", f"--lora-impl {impl} vs beside, {size} 2 layers, {b} x {t}, bf16", ok=ok,
                            note=", ".join(f"{k} {err[k]:.1e} (beside {plain[k]:.1e})" for k in err),
                            figures={**err, **{f"beside_{k}": v for k, v in plain.items()}}))
    return rows
