"""How fast the chip does each class of the plan's work (trainer/common/calibration.py), each alone:
- matmul: an MLP's bf16 matmuls at gpt2-124m's and gemma2-2b's shapes, chained so none is skipped;
- attention: splash forward and backward of one layer, at GPT-2's head_dim (64) and Gemma's (256), counted by
  the arithmetic MFU uses (12 x T x heads x head_dim per token per layer); the resident kernel at head_dim 64
  beside it, at each block size (its own class: "attention resident");
- loss kernel: the two loss kernels forward and backward for 8 x 1024 tokens of GPT-2's vocabulary (8 N V D);
  XLA's chunked and whole loss beside them, for the record;
- HBM: y = a * x + b in f32 over 1 GiB arrays (bytes read and written per second).
Each rate is printed with its fraction of the chip's peak or bandwidth."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.tpu.common import Row, Settings, block, reps_for, time_steps


def _time(fn, *args) -> float:
    f = jax.jit(fn)
    one = time_steps(lambda: f(*args), 1, block)
    return time_steps(lambda: f(*args), reps_for(one), block)


def matmul_rows(s: Settings) -> list[Row]:
    shapes = {"gpt2-124m MLP (8192 x 768 x 3072)": (8192, 768, 3072),
              "gemma2-2b MLP (2048 x 2304 x 9216)": (2048, 2304, 9216)} if not s.quick else {"tiny": (256, 128, 512)}
    rows = []
    for name, (n, d, f) in shapes.items():
        k = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(k[0], (n, d), jnp.bfloat16)
        w1 = (0.02 * jax.random.normal(k[1], (d, f))).astype(jnp.bfloat16)
        w2 = (0.02 * jax.random.normal(k[2], (f, d))).astype(jnp.bfloat16)
        depth = 8

        def chain(x, w1, w2):
            for _ in range(depth):
                x = jnp.dot(jnp.dot(x, w1, preferred_element_type=jnp.float32).astype(jnp.bfloat16), w2,
                            preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return x
        t = _time(chain, x, w1, w2)
        flops = depth * 2 * 2 * n * d * f
        rows.append(_rate("matmul", name, flops / t, s.peak, t, {"flops": flops}))
    return rows


def _rate(cls: str, name: str, rate: float, peak: float | None, t: float, figures: dict, unit: str = "FLOP/s"):
    share = f" = {100 * rate / peak:.1f}% of the chip's" if peak else ""
    scale = 1e12 if unit == "FLOP/s" else 1e9
    word = "TFLOP/s" if unit == "FLOP/s" else "GB/s"
    return Row("classes", f"{cls}: {name}", step_s=t, note=f"{rate / scale:.1f} {word}{share}",
               figures={"class": cls, "rate": rate, **figures})


def attention_rows(s: Settings) -> list[Row]:
    from trainer.models import attention
    on_tpu = jax.default_backend() == "tpu" and not s.quick
    shapes = {64: (16, 1024, 12, 12), 256: (8, 512, 4, 1)} if on_tpu else {64: (1, 128, 2, 2)}
    rows = []
    for hd, (b, t, h, kh) in shapes.items():
        k = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(k[0], (b, t, h, hd), jnp.bfloat16)
        kk = jax.random.normal(k[1], (b, t, kh, hd), jnp.bfloat16)
        v = jax.random.normal(k[2], (b, t, kh, hd), jnp.bfloat16)
        kern = attention.Kernel("seq-minor", "fused", 1024, "splash") if hd == 64 else attention.Kernel()

        def fwd_bwd(q, kk, v):
            out, pull = jax.vjp(lambda *a: attention.splash(*a, interpret=not on_tpu, kernel=kern), q, kk, v)
            return pull(out)
        tm = _time(fwd_bwd, q, kk, v)
        flops = 12.0 * t * h * hd * b * t
        rows.append(_rate("attention", f"splash head_dim {hd}, {b} x {t}, {h} heads", flops / tm, s.peak, tm,
                          {"flops": flops, "head_dim": hd}))
        if hd != 64:
            continue
        flat = [a.reshape(b, t, h * hd) for a in (q, kk, v)]  # the layout GPT-2's layer gives the kernel
        for blk in ((128, 256, 512) if on_tpu else (128,)):
            def fwd_bwd(q, kk, v, blk=blk):
                out, pull = jax.vjp(lambda *a: attention.resident(*a, hd, block=blk, interpret=not on_tpu), q, kk, v)
                return pull(out)
            tm = _time(fwd_bwd, *flat)
            rows.append(_rate("attention resident", f"resident head_dim {hd}, block {blk}, {b} x {t}, {h} heads",
                              flops / tm, s.peak, tm, {"flops": flops, "head_dim": hd, "block": blk}))
    return rows


def loss_rows(s: Settings) -> list[Row]:
    from trainer.kernels import xent_kernel as xk
    from trainer.models import xent
    n, d, vocab, padded = (256, 128, 700, 768) if s.quick else (8 * 1024, 768, 50257, 50304)
    on_tpu = jax.default_backend() == "tpu" and not s.quick
    x = jax.random.normal(jax.random.key(2), (8 if n > 256 else 1, n // (8 if n > 256 else 1), d), jnp.bfloat16)
    table = 0.02 * jax.random.normal(jax.random.key(3), (padded, d), jnp.float32)
    targets = jax.random.randint(jax.random.key(4), x.shape[:2], 0, vocab)
    kernel = xk.Kernel() if on_tpu else xk.Kernel(xk.Blocks(64, 128, 128, 128), interpret=True)
    rows = []
    for name, fn in (("the loss kernels (pallas)", lambda x, w: xk.loss(x, w, targets, vocab, kernel)),
                     ("XLA loss, chunks of 256", lambda x, w: xent.chunked(x, w, targets, 256, vocab)),
                     ("XLA loss, whole logits", lambda x, w: xent.chunked(x, w, targets, 0, vocab))):
        tm = _time(jax.grad(fn, argnums=(0, 1)), x, table)
        flops = 8.0 * n * padded * d if "pallas" in name else 6.0 * n * padded * d
        rows.append(_rate("loss kernel" if "pallas" in name else "loss (xla)", f"{name}, {n} tokens", flops / tm,
                          s.peak, tm, {"flops": flops}))
    return rows


def hbm_rows(s: Settings) -> list[Row]:
    n = (1 << 16) if s.quick else (1 << 28)  # 1 GiB of f32
    x = jnp.ones((n,), jnp.float32)
    b = jnp.full((n,), 0.5, jnp.float32)
    tm = _time(lambda x, b: x * 1.0001 + b, x, b)
    moved = 3.0 * 4 * n
    return [_rate("hbm", f"a * x + b, f32, {4 * n / 2 ** 30:.2g} GiB arrays", moved / tm, s.hbm, tm,
                  {"bytes": moved}, unit="B/s")]


def run(s: Settings) -> list[Row]:
    return matmul_rows(s) + attention_rows(s) + loss_rows(s) + hbm_rows(s)


def rates(rows: list[Row]) -> dict:
    """The measured rates as trainer/common/calibration.Rates takes them (the mean where a class has several)."""
    by = {}
    for r in rows:
        f = r.figures
        if f.get("class") == "matmul":
            by.setdefault("matmul_flops_s", []).append(f["rate"])
        elif f.get("class") == "attention":
            by.setdefault("attention_flops_s", {})[f["head_dim"]] = f["rate"]
        elif f.get("class") == "loss kernel":
            by["loss_kernel_flops_s"] = f["rate"]
        elif f.get("class") == "hbm":
            by["hbm_bytes_s"] = f["rate"]
    if "matmul_flops_s" in by:
        by["matmul_flops_s"] = float(np.mean(by["matmul_flops_s"]))
    return by
