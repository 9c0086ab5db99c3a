"""A LoRA step of Gemma on the chip from random bf16 weights (no checkpoint is needed to time a step): rank 8 on
every projection (q, k, v, o and the MLP's three), T 512, the batch each size is measured at; and beside ours, the
same step by Google's own post-training library (tunix's PeftTrainer with qwix's LoRA) on gemma2-2b. MFU counts
4 N_base + 6 N_lora + 12 L T H head_dim per token (trainer/common/aot.lora_flops_per_token). The plan's time for
the same step is compiled ahead, off the chip (`python -m bench.tpu --plan-ahead`), and joined by the row's name.

Each row says where it is while it works (drawing the base, compiling, timing): a command cut short by the chip's
time limit shows which row it was in and how far it got."""
from __future__ import annotations

import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.tpu.common import Row, Settings, block, hbm_of, reps_for, say, time_steps, version_of

# rows of 512 each size is measured at on one v5e chip: the largest batch whose step fits its 15.7 GiB by the
# compiler's count (docs/performance.md)
SIZES = {"gemma3-1b": 8, "gemma2-2b": 4, "gemma4-e2b": 1}
# sizes whose whole base does not fit one chip, cut to their first layers (size -> (layers, rows of 512)): the
# step's work a layer is the whole size's, so the chip's time against the plan's for the same program says whether
# the plan's roofline is the chip's (26B-A4B: its experts count as memory-bound, docs/gemma.md)
TWINS = {"gemma4-26b-a4b": (6, 4)}
# sizes at a batch whose step written out does not fit one chip (size -> rows of 512): --remat auto runs their layers
# in scans with full recompute there, the one-chip default of a larger batch
SCANNED = {"gemma4-e2b": 4}
# The step's embedding by its vocab rows (what every multi-device slice runs: trainer/models/vocab_parallel.py), forced
# on the one chip: its lookup and loss's compute beside the gathered table's, without the collectives.
VOCAB_ROWS = "vocab_parallel"
# (variant name, LoraRun fields, or VOCAB_ROWS): alternatives of how the step computes, each timed beside the default
# (a remat variant that is the size's default here, --remat auto, is not timed twice)
VARIANTS: dict[str, dict] = {"lora-impl beside": {"lora_impl": "beside"}, "remat full": {"remat": "full"},
                             "remat dots": {"remat": "dots"}, "remat none": {"remat": "none"},
                             "vocab rows": {VOCAB_ROWS: True}}
PEER_SIZE = "gemma2-2b"  # the size tunix's step is timed at (its Gemma 2 config is Google's own)
RANK, ALPHA = 8, 16.0
QUICK = dict(family="gemma2", vocab=1024, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ff=1024,
             sliding_window=64, query_pre_attn_scalar=64.0)


def name_of(size: str, batch: int, seq_len: int = 512, variant: str = "", layers: int = 0) -> str:
    return f"{size}{f' ({layers} layers)' if layers else ''} LoRA r{RANK} all targets, {batch} x {seq_len}" + (f", {variant}" if variant else "")


def _batch(vocab: int, batch: int, seq_len: int) -> dict:
    from trainer.finetune import data as sft_data
    ids = np.random.default_rng(0).integers(4, vocab, (batch, seq_len)).astype(np.int32)
    local = {"inputs": ids, "targets": np.roll(ids, -1, axis=1), "weights": np.ones((batch, seq_len), np.float32),
             "segments": np.ones((batch, seq_len), np.int32),
             "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()}
    assert set(local) == set(sft_data.FIELDS)
    return local


def step_row(s: Settings, size: str, batch: int, seq_len: int = 512, variant: str = "",
             fields: dict | None = None, layers: int = 0) -> Row:
    from trainer.common import aot, mesh as mesh_lib
    from trainer.finetune import train as finetune
    from trainer.finetune.config import LoraRun
    from trainer.models import gemma, lora as lora_lib
    from bench.tpu import twin
    cfg = gemma.GemmaConfig(**QUICK) if s.quick else twin.config(size, layers) if layers else gemma.SIZES[size]
    seq_len = 128 if s.quick else seq_len
    name = name_of(size, batch, seq_len, variant, layers)
    fields = dict(fields or {})
    vocab_rows = fields.pop(VOCAB_ROWS, None)
    run = LoraRun(weights="-", data="-", ckpt_dir=tempfile.mkdtemp(dir=s.out), model=size, targets="all",
                  rank=RANK, alpha=ALPHA, seq_len=seq_len, batch_size=batch, steps=1000, base_dtype="bfloat16",
                  **fields)
    mesh = mesh_lib.make_mesh({"data": 1, "model": 1}, jax.devices()[:1])
    steps = finetune.Steps(run, cfg, mesh, 1000, batch, vocab_parallel=vocab_rows)
    t0 = time.perf_counter()
    # drawn where it lives, in the layout the step takes (its scanned layers' weights stacked)
    base = block(gemma.random_params(cfg, dtype=jnp.bfloat16, shardings=steps.base_sh, stacked=steps.scanned))
    lora, opt = steps.init()
    say(f"  {name}: random bf16 base drawn in {time.perf_counter() - t0:.0f} s; compiling the step")
    compile_s = steps.compile(base)
    say(f"  {name}: compiled in {compile_s:.0f} s; timing")
    local = _batch(cfg.vocab, batch, seq_len)
    state = {"lora": lora, "opt": opt, "n": 0}

    def one():
        state["n"] += 1
        state["lora"], state["opt"], out = steps.step(state["lora"], state["opt"], base, local, state["n"])
        return out["loss"]
    first = time_steps(one, 1, block)
    step_s = time_steps(one, reps_for(first), block)
    traced = {}
    if s.trace:
        from bench.tpu import profile
        say(f"  {name}: tracing two steps")
        path = profile.trace_steps(one, profile.row_trace(s.out, name))
        traced = {"trace": os.path.basename(path) if path else None}
    tokens = batch * seq_len
    fpt = aot.lora_flops_per_token(cfg, lora_lib.count(cfg, run.lora), seq_len)
    tps = tokens / step_s
    return Row("lora", name, step_s=step_s, tokens_per_s=tps, compile_s=compile_s,
               mfu=tps * fpt / s.peak if s.peak else None, hbm_bytes=hbm_of(steps.train_fn),
               note=f"attention {steps.attention}, random bf16 base" + (f"; {fields}" if fields else "")
               + ("; the embedding by its vocab rows" if vocab_rows else ""),
               figures={"batch": batch, "seq_len": seq_len, "fields": fields or {}, "loss": float(one()),
                        "flops_per_token": fpt, **({"layers": layers} if layers else {}), **traced})


OPTIONS_ROW = "a slice's compiler options on the chip's own compiler (step_compiler), tiny LoRA step"


def options_row(s: Settings) -> Row:
    """The compiler options a LoRA step on a TPU slice is compiled with (trainer/common/step_compiler.py), handed
    to this chip's own compiler: the runtime takes them (a plan compiles them ahead through libtpu, not through
    the chip's client), and on one device, which partitions nothing, the step they compile takes the very step of
    the default compile: the same loss and adapters to the bit. A check: ok or not."""
    from trainer.common import mesh as mesh_lib, step_compiler
    from trainer.finetune import train as finetune
    from trainer.finetune.config import LoraRun
    from trainer.models import gemma
    cfg, seq_len, batch = gemma.GemmaConfig(**QUICK), 128, 2
    mesh = mesh_lib.make_mesh({"data": 1, "model": 1}, jax.devices()[:1])
    run = LoraRun(weights="-", data="-", ckpt_dir=tempfile.mkdtemp(dir=s.out), model=PEER_SIZE, targets="all",
                  rank=RANK, alpha=ALPHA, seq_len=seq_len, batch_size=batch, steps=10, base_dtype="bfloat16")
    local, base, took = _batch(cfg.vocab, batch, seq_len), None, []
    for options in (None, step_compiler.NO_WINDOWED_EINSUM):
        steps = finetune.Steps(run, cfg, mesh, 10, batch)
        if base is None:  # the same base for both (the step does not donate it)
            base = block(gemma.random_params(cfg, dtype=jnp.bfloat16, shardings=steps.base_sh,
                                             stacked=steps.scanned))
        lora, opt = steps.init()
        steps.compile(base, options)
        lora, opt, out = steps.step(lora, opt, base, local, 1)
        took.append((float(out["loss"]), [np.asarray(a) for a in jax.tree.leaves(lora)]))
    (loss, lora), (loss_opt, lora_opt) = took
    same = loss == loss_opt and all(np.array_equal(a, b) for a, b in zip(lora, lora_opt))
    return Row("lora", OPTIONS_ROW, ok=same,
               note=f"compiled with {step_compiler.NO_WINDOWED_EINSUM} and without: "
                    + ("the same loss and adapters to the bit" if same else "they differ"),
               figures={"options": step_compiler.NO_WINDOWED_EINSUM, "losses": [loss, loss_opt]})


def tunix_row(s: Settings, size: str, batch: int, seq_len: int = 512) -> Row:
    """tunix's PeftTrainer step (its own jitted train step, `jit_train_and_eval_step`) on its Gemma 2 with qwix's
    LoRA on the same projections, rank and alpha; the base's weights random in bf16, as ours; the same batch."""
    import optax
    import qwix
    from flax import nnx
    from tunix.models.gemma import model as tm
    from tunix.sft import peft_trainer
    from trainer.common import aot
    from trainer.models import gemma, lora as lora_lib
    if s.quick:
        c = QUICK
        tcfg = tm.ModelConfig(num_layers=c["n_layers"], num_embed=c["vocab"], embed_dim=c["d_model"],
                              hidden_dim=c["ff"], num_heads=c["n_heads"], head_dim=c["head_dim"],
                              num_kv_heads=c["n_kv_heads"], final_logit_softcap=30.0, use_post_attn_norm=True,
                              use_post_ffw_norm=True, attention_types=(tm.AttentionType.LOCAL_SLIDING,
                                                                       tm.AttentionType.GLOBAL),
                              attn_logits_soft_cap=50.0, sliding_window_size=c["sliding_window"])
        ours_cfg, seq_len = gemma.GemmaConfig(**QUICK), 128
    else:
        tcfg, ours_cfg = {"gemma2-2b": tm.ModelConfig.gemma2_2b}[size](), gemma.SIZES[size]
    name = f"tunix {name_of(size, batch, seq_len)} (PeftTrainer, qwix LoRA)"
    ours_lc = lora_lib.LoraConfig(RANK, ALPHA, 0.0, lora_lib.resolve_targets("all"))
    t0 = time.perf_counter()
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: tm.Gemma(tcfg, rngs=nnx.Rngs(0))))
    leaves, treedef = jax.tree.flatten(abstract)
    key = jax.random.key(0)

    programs: dict = {}

    def draw(i, shape):  # the base in bf16 on the chip (tunix's own init is f32: twice the memory), one program a
        # shape as gemma.random_params draws ours (one program of every array took 111 s to compile on the host)
        if shape not in programs:
            programs[shape] = jax.jit(lambda k: (0.02 * jax.random.normal(k, shape, jnp.bfloat16)).astype(jnp.bfloat16))
        return programs[shape](jax.random.fold_in(key, i))
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, block([draw(i, a.shape) for i, a in enumerate(leaves)])))
    toks = jnp.asarray(_batch(ours_cfg.vocab, batch, seq_len)["inputs"])
    positions = jnp.broadcast_to(jnp.arange(seq_len)[None], (batch, seq_len))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((seq_len, seq_len), bool))[None], (batch, seq_len, seq_len))
    provider = qwix.LoraProvider(module_path=".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|"
                                             ".*down_proj", rank=RANK, alpha=ALPHA)
    model = qwix.apply_lora_to_model(model, provider, toks, positions, None, mask, rngs=nnx.Rngs(1))
    say(f"  {name}: base drawn and LoRA applied in {time.perf_counter() - t0:.0f} s; compiling its step")
    trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-4), peft_trainer.TrainingConfig(
        eval_every_n_steps=10 ** 9, max_steps=10 ** 9))
    step_fn, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)  # its fastest path
    inputs = {"input_tokens": toks, "input_mask": jnp.ones((batch, seq_len), bool), "positions": positions,
              "attention_mask": mask}

    def one():
        return step_fn(inputs)[0]
    t0 = time.perf_counter()
    block(one())  # its first call compiles
    compile_s = time.perf_counter() - t0
    say(f"  {name}: compiled in {compile_s:.0f} s; timing")
    first = time_steps(one, 1, block)
    step_s = time_steps(one, reps_for(first), block)
    n_lora = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    fpt = aot.lora_flops_per_token(ours_cfg, int(n_lora), seq_len)
    tps = batch * seq_len / step_s
    return Row("lora", name, step_s=step_s, tokens_per_s=tps, compile_s=compile_s,
               mfu=tps * fpt / s.peak if s.peak else None,
               note=f"google-tunix {version_of('google-tunix')}, qwix {version_of('qwix')}; XLA attention with a "
                    f"[T, T] mask (its own); {int(n_lora):,} adapter params "
                    f"(ours {lora_lib.count(ours_cfg, ours_lc):,})",
               figures={"batch": batch, "seq_len": seq_len, "n_lora": int(n_lora), "flops_per_token": fpt,
                        "peer": "tunix"})


def run(s: Settings):
    """The defaults of every size first, then the twins (TWINS) and the scanned defaults (SCANNED), then each
    variant of every size, then tunix's step, then the steps with another remat policy than the size's default: a
    run cut short by the chip's time keeps what matters most."""
    sizes = {k: v for k, v in SIZES.items() if not k.startswith("gemma4")} if s.quick else SIZES  # one tiny config
    if jax.default_backend() == "tpu" and s.wants(OPTIONS_ROW):  # libtpu's flags: no CPU compiler knows them
        yield options_row(s)
    batches = {size: 2 if s.quick else batch for size, batch in sizes.items()}
    for size, batch in batches.items():
        if s.wants(name_of(size, batch)):
            yield step_row(s, size, batch)
    for size, (layers, batch) in ({} if s.quick else TWINS).items():
        if s.wants(name_of(size, batch, layers=layers)):
            yield step_row(s, size, batch, layers=layers)
    for size, batch in ({} if s.quick else SCANNED).items():
        if s.wants(name_of(size, batch)):
            yield step_row(s, size, batch)
    later = {k: v for k, v in VARIANTS.items() if v.get("remat")}  # the scanned layers (remat): new, and slower
    for variant, fields in [*((k, v) for k, v in VARIANTS.items() if k not in later), (None, None),
                            *later.items()]:
        if variant is None:
            batch = batches.get(PEER_SIZE, 2)
            if s.wants(f"tunix {name_of(PEER_SIZE, batch)}"):
                yield tunix_row(s, PEER_SIZE, batch)
            continue
        for size, batch in batches.items():
            if not s.quick and _is_default(size, fields, batch):
                continue
            if s.wants(name_of(size, batch, variant=variant)):
                yield step_row(s, size, batch, variant=variant, fields=fields)


def _is_default(size: str, fields: dict, batch: int) -> bool:
    """A remat variant the size runs by default here (--remat auto on this chip): its default row times it."""
    import dataclasses

    from trainer.common import mesh as mesh_lib
    from trainer.finetune import train as finetune
    from trainer.finetune.config import LoraRun
    from trainer.models import gemma
    remat = fields.get("remat")
    if remat is None:
        return False
    run = LoraRun(weights="-", data="-", ckpt_dir="-", model=size, batch_size=batch, base_dtype="bfloat16")
    mesh = mesh_lib.make_mesh({"data": 1, "model": 1}, jax.devices()[:1])
    return finetune.remat_of(dataclasses.replace(run, remat="auto"), gemma.SIZES[size], mesh, batch)[0] == remat
