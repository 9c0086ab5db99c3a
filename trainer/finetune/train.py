"""LoRA fine-tuning of a Gemma checkpoint: the frozen base on the mesh, adapters trained, adapters saved.

The base (trainer/gemma/weights.py) is loaded once, sharded fsdp-style by the mesh rules, optionally in bf16,
and is only ever an input of the step: it is neither differentiated, nor updated, nor checkpointed.
The train state is the adapters (f32) and the optimizer state for them alone; the step is a pure
jitted function of (adapters, optimizer state, base, batch, step) that donates the first two.
Checkpoints, preemption (save, exit 42), Ctrl-C and metrics.jsonl: the loop pretraining runs too (trainer/common/loop.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath

from trainer.common import checkpoint, chips, loop, metrics, optim, profiling, scans, step_compiler
from trainer.finetune import data as sft_data
from trainer.gemma import tokenizer as tok_lib
from trainer.gemma import weights
from trainer.common import mesh as mesh_lib
from trainer.common.config import TrainConfig, UsageError
from trainer.finetune.config import LoraRun
from trainer.common.mesh import compute_dtype
from trainer.models import attention, gemma, lora as lora_lib, vocab_parallel as vocab_parallel_lib, xent


def token_losses(cfg: gemma.GemmaConfig, lc: lora_lib.LoraConfig, base: dict, lora: dict, batch: dict, *,
                 dtype=jnp.float32, dropout_key=None, attention: str = "xla", remat: str = "none",
                 lora_impl: str = lora_lib.DEFAULT_IMPL) -> jax.Array:
    """f32 next-token cross-entropy [B, T] of packed rows under base + adapters (unweighted), from the full
    logits (for inspection and checks: a step takes loss_sums).
    attention: resolved (trainer/models/attention.py); remat: a policy of trainer/models/remat.py."""
    model = gemma.from_flat(cfg, base)
    logits, _ = model(batch["inputs"], batch["positions"], dtype=dtype, segment_ids=batch["segments"],
                      adapter=lora_lib.adapter(lc, lora, dropout_key, lora_impl), attention=attention, remat=remat)
    logz = jax.nn.logsumexp(logits, axis=-1)
    return logz - jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]


def loss_sums(cfg: gemma.GemmaConfig, lc: lora_lib.LoraConfig, base: dict, lora: dict, batch: dict,
              **kw) -> tuple[jax.Array, jax.Array]:
    """(sum of weight x cross-entropy, sum of weights): loss_terms without its count of dropped assignments."""
    return loss_terms(cfg, lc, base, lora, batch, **kw)[:2]


def loss_terms(cfg: gemma.GemmaConfig, lc: lora_lib.LoraConfig, base: dict, lora: dict, batch: dict, *,
               dtype=jnp.float32, dropout_key=None, attention: str = "xla", remat: str = "none",
               loss_chunk: int = 0, lora_impl: str = lora_lib.DEFAULT_IMPL, vocab_parallel: bool = False
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of weight x cross-entropy, sum of weights, moe.Drops summed over the layers) of packed rows under
    base + adapters: what a step differentiates, and what its experts dropped (none without experts). The output
    layer and the loss take loss_chunk positions at a time (trainer/models/xent.py; 0: all at once), so the
    [B, T, V] logits (Gemma's 256k vocabulary: 2 GB for 4 rows of 512) never exist whole, and the frozen
    embedding gets no gradient. The same sums as token_losses' up to the order of addition.
    vocab_parallel: the embedding is sharded by its rows over every device (vocab_parallel.TABLE; Steps places it
    so): the lookup and the output layer each work on a device's own rows, and the table is never gathered."""
    lookup = vocab_parallel_lib.lookup if vocab_parallel else None
    if gemma.is_stacked(base):  # the step's base (Steps.place_base): the layers in scans
        x, drops = gemma.hidden_counted(cfg, base, batch["inputs"], batch["positions"], dtype=dtype,
                                        segment_ids=batch["segments"], adapters=lora,
                                        make_adapter=_layer_adapter(lc, dropout_key, lora_impl),
                                        attention=attention, remat=remat, lookup=lookup)
    else:
        if gemma.is_stacked(lora):
            lora = gemma.unstack(cfg, lora)
        model = gemma.from_flat(cfg, base)
        x, _, drops = model.forward(batch["inputs"], batch["positions"], dtype=dtype, segment_ids=batch["segments"],
                                    adapter=lora_lib.adapter(lc, lora, dropout_key, lora_impl), attention=attention,
                                    remat=remat, logits=False, lookup=lookup)
    if vocab_parallel:
        total = vocab_parallel_lib.frozen_xent(x, base["embed"], batch["targets"], batch["weights"],
                                               cfg.fam.final_softcap, loss_chunk)
    else:
        total = xent.chunked(x, base["embed"], batch["targets"], loss_chunk, None, cfg.fam.final_softcap, False,
                             batch["weights"], False)
    return total, jnp.sum(batch["weights"]), drops


def _layer_adapter(lc: lora_lib.LoraConfig, dropout_key, lora_impl: str = lora_lib.DEFAULT_IMPL):
    """gemma.hidden's make_adapter: one layer's adapters (layer index i, maybe traced inside a scan) as the
    model's hook. Dropout draws from the key folded with the layer (other masks than the flat model's, the same
    distribution)."""
    def make(i, arrays: dict):
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
        return functools.partial(lora_lib.adapter(lc, {f"layers.0.{n}": a for n, a in arrays.items()}, key,
                                                  lora_impl), 0)
    return make


# --remat auto: the step the chip timed fastest where it fits, and the layers in scans with full recompute where
# it does not. On one v5e chip, gemma4-e2b at 1 x 512 (jax 0.10.2, libtpu 0.0.42.1; bench/tpu_records/
# v5e-2026-12-06-d.json): 41.4 ms a step written out without recompute (none), 87.8 ms with its layers in scans
# and full recompute. So none wherever the written-out step's activations fit the device, full where they do not
# (gemma4-31b and gemma4-26b-a4b on v5litepod-8 and v4-8, gemma4-e4b on v5litepod-8 at 4 rows of 512: their
# written-out steps need 46, 38 and 15.9 GiB of a 16 GiB chip by the compiler's count). Gemma 2 and 3 stay
# written out (none), as the chip timed them.
#
# "Fits" is decided before anything compiles, from the shapes: the written-out step keeps, per token of a
# device's rows and per layer, about WRITTEN_OUT_BYTES bytes per unit of (d_model + the layer's MLP width)
# (10.5-13.9 by the compiler's count of gemma4-e2b, e4b and 31b on v5litepod-8, 4 x 512, libtpu 0.0.42.1), and
# the loss its f32 logits twice; with the base's shard, it must stay under AUTO_FIT of the chip's HBM. The
# experts' dispatch is not in that count: a config with experts takes full.
WRITTEN_OUT_BYTES = 11.0
AUTO_FIT = 0.85


def written_out_bytes(cfg: gemma.GemmaConfig, tokens: int, vocab_shards: int = 1) -> float:
    """What the written-out LoRA step (no recompute) holds beside its state, per device, for `tokens` tokens of
    rows a device computes: the layers' kept activations and the loss's logits (an estimate: see AUTO_FIT)."""
    width = sum(cfg.d_model + cfg.ff_of(i) for i in range(cfg.n_layers))
    return WRITTEN_OUT_BYTES * tokens * width + 2 * 4 * tokens * cfg.vocab / vocab_shards


def remat_of(run: LoraRun, cfg: gemma.GemmaConfig, mesh, global_batch: int) -> tuple[str, str]:
    """(--remat with auto resolved for this model, mesh and batch, why)."""
    if run.remat != "auto":
        return run.remat, "--remat " + run.remat
    if cfg.family != "gemma4":
        return "none", "auto: Gemma 2 and 3 run written out"
    if cfg.n_experts:
        return "full", "auto: the experts' step runs its layers in scans with full recompute"
    kind = mesh.devices.flat[0].device_kind
    hbm = chips.HBM_BYTES.get(kind)
    if not hbm:  # the CPU (a local slice): no device memory to fit
        return "none", "auto: written out (no device memory to fit on " + kind + ")"
    data = mesh.shape["data"] * mesh.shape.get(mesh_lib.DCN, 1)
    tokens = global_batch // max(data, 1) * run.seq_len
    state = sum(math.prod(sh.shard_shape(shape)) for (shape, _), sh in
                zip(gemma.param_layout(cfg).values(), gemma.shardings(cfg, mesh).values())) * \
        jnp.dtype(compute_dtype(run.base_dtype, mesh.devices.flat[0].platform)).itemsize
    need = state + written_out_bytes(cfg, tokens, mesh.shape["model"])
    gib = 2 ** 30
    if need <= AUTO_FIT * hbm:
        return "none", f"auto: written out, ~{need / gib:.1f} GiB of {hbm / gib:.0f} a device (estimated)"
    return "full", (f"auto: layers in scans with full recompute: written out would need ~{need / gib:.1f} GiB of "
                    f"{hbm / gib:.0f} a device (estimated)")



class Steps:
    """The compiled train and eval steps of one (base config, LoRA config, mesh)."""

    def __init__(self, run: LoraRun, cfg: gemma.GemmaConfig, mesh, total_steps: int, global_batch: int,
                 vocab_parallel: bool | None = None):
        cfg = dataclasses.replace(cfg, expert_capacity=run.expert_capacity) if cfg.n_experts else cfg
        self.run, self.cfg, self.mesh, self.lc = run, cfg, mesh, run.lora
        lora_lib.check_model(cfg, self.lc)
        self.wait_each_step = mesh_lib.one_step_in_flight(mesh)
        platform = mesh.devices.flat[0].platform  # of the devices compiled for (a TPU plan from a CPU host)
        self.dtype = compute_dtype(run.dtype, platform)
        self.attention = attention.resolve(run.attention, platform, run.seq_len, mesh.devices.flat[0].device_kind)
        self.compiler_options = step_compiler.options(platform, mesh.size)
        self.global_batch = global_batch
        self.remat, self.remat_why = remat_of(run, cfg, mesh, global_batch)
        self.loss_chunk = run.loss_chunk
        # the base as the step takes it: with a remat policy, the layers run in scans and the scanned layers'
        # weights come stacked (gemma.stacked_layout, place_base); without one the layers stay written out, as a
        # scan would keep every layer's residuals in stacked buffers the compiler cannot rematerialise
        self.scanned = self.remat != "none"
        self.flat_base_sh = gemma.shardings(cfg, mesh)  # as a checkpoint loads (weights.load)
        self.base_layout = gemma.stacked_layout(cfg) if self.scanned else gemma.param_layout(cfg)
        self.base_sh = gemma.stacked_shardings(cfg, mesh) if self.scanned else self.flat_base_sh
        # The tied embedding by its vocab rows over every device where they divide, on one slice (the vocab-parallel
        # rules): its lookup and the output layer then never gather the table ([262144, D]: 2.6 GiB for 31B in bf16).
        # vocab_parallel None: by the mesh; True on one device is the chip check's measure of that path's compute
        self.vocab_parallel = vocab_parallel_lib.fits_mesh(cfg.vocab, mesh) if vocab_parallel is None else vocab_parallel
        if self.vocab_parallel:
            shape, axes = gemma.param_layout(cfg)["embed"]
            rows = mesh_lib.fitted_spec(axes, shape, dict(mesh.shape), mesh_lib.VOCAB_PARALLEL_RULES)
            self.base_sh = {**self.base_sh, "embed": jax.sharding.NamedSharding(mesh, rows)}
        # the adapters as the train state holds them: a scanned step's stacked as its layers' weights are
        # (lora.stacked_layout: its optimizer then updates a few stacked arrays, not hundreds of per-layer ones, which
        # the TPU compiler generates code for one by one), a written-out step's per layer (param_layout)
        self.lora_layout = lora_lib.layout(cfg, self.lc, self.scanned)
        self.lora_sh = lora_lib.shardings(cfg, self.lc, mesh, self.scanned)
        self.rep = mesh_lib.replicated(mesh)
        self.batch_sh = mesh_lib.sharding(mesh, ("batch", None))
        t = TrainConfig(lr=run.lr, warmup_steps=run.warmup_steps, decay_steps=max(total_steps, run.warmup_steps + 1),
                        min_lr_ratio=run.min_lr_ratio, weight_decay=run.weight_decay, grad_clip=run.grad_clip,
                        beta1=0.9, beta2=0.999)
        self.lr = optim.schedule(t)
        self.tx = optax.chain(optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
                              optax.adamw(self.lr, b1=t.beta1, b2=t.beta2, eps=1e-8, weight_decay=t.weight_decay))
        self.abstract_lora = lora_lib.abstract(cfg, self.lc, mesh, self.scanned)
        self.opt_sh, self.abstract_opt = self.abstract_opt_of(self.abstract_lora)
        self.fields_sh = {f: self.batch_sh for f in sft_data.FIELDS}  # a batch dict's fields, each split so
        self._train = self._jit_train(self._train_step)
        # the eval step's projections are the train step's forward: the same compiler options (no collective matmuls)
        self._eval = jax.jit(self._eval_step, in_shardings=(self.lora_sh, self.base_sh, self.fields_sh),
                             out_shardings=self.rep, compiler_options=self.compiler_options or None)

    def abstract_opt_of(self, abstract_lora: dict):
        """(shardings, abstract tree) of the optimizer's state for adapters laid out as abstract_lora."""
        sh = optim.state_shardings(self.tx, abstract_lora, {n: a.sharding for n, a in abstract_lora.items()}, self.rep)
        return sh, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                jax.eval_shape(self.tx.init, abstract_lora), sh)

    def _sums(self, lora, base, batch, key):
        return loss_terms(self.cfg, self.lc, base, lora, batch, dtype=self.dtype, dropout_key=key,
                          attention=self.attention, remat=self.remat, loss_chunk=self.loss_chunk,
                          lora_impl=self.run.lora_impl, vocab_parallel=self.vocab_parallel)

    def _train_step(self, lora, opt_state, base, batch, step):
        key = jax.random.fold_in(jax.random.key(self.run.seed), step)  # from (seed, step): any host count

        def loss(lr_params):
            s, n, drops = self._sums(lr_params, base, batch, key)
            return s / jnp.maximum(n, 1.0), drops
        (value, drops), grads = jax.value_and_grad(loss, has_aux=True)(lora)
        updates, opt_state = self.tx.update(grads, opt_state, lora)
        lora = optax.apply_updates(lora, updates)
        out = {"loss": value, "grad_norm": optax.tree.norm(grads), "lr": self.lr(step - 1)}
        if self.cfg.n_experts:  # the step's expert assignments its devices' capacity left out (moe.parallel)
            out["expert_dropped"] = drops[0] / jnp.maximum(drops[1], 1)
        return lora, opt_state, out

    def _eval_step(self, lora, base, batch):
        return jnp.stack(self._sums(lora, base, batch, None)[:2])

    def place_base(self, flat: dict, free: bool = False) -> dict:
        """The base as loaded (param_layout's names) -> as the steps take it (stacked_layout's), where the rules
        place it (the embedding moved to its rows' sharding). free: each loaded array is deleted once stacked or
        moved (a base is never held twice)."""
        out = gemma.stack(self.cfg, flat, self.base_sh, free=free) if self.scanned else dict(flat)
        table = out["embed"]
        if isinstance(table, jax.Array) and table.sharding != self.base_sh["embed"]:
            out["embed"] = jax.device_put(table, self.base_sh["embed"])
            if free:
                table.delete()
        return out

    @property
    def loss_chunks(self) -> int:
        """How many chunks of positions the loss takes (1: the logits whole, no loop)."""
        return self.run.seq_len // xent.chunk_of(self.loss_chunk, self.run.seq_len)

    def _jit_train(self, fn):
        return jax.jit(fn, in_shardings=(self.lora_sh, self.opt_sh, self.base_sh, self.fields_sh, self.rep),
                       out_shardings=(self.lora_sh, self.opt_sh, self.rep), donate_argnums=(0, 1))

    def abstract_base(self, dtype) -> dict:
        """The base as the step takes it (its layout and shardings), each array abstract in `dtype`: what a plan or
        a test compiles the step for, no weights drawn."""
        return {n: jax.ShapeDtypeStruct(s, dtype, sharding=self.base_sh[n]) for n, (s, _) in self.base_layout.items()}

    def _train_args(self, base):
        shape = jax.ShapeDtypeStruct((self.global_batch, self.run.seq_len), jnp.int32, sharding=self.batch_sh)
        batch = {f: shape if f != "weights" else shape.update(dtype=jnp.float32) for f in sft_data.FIELDS}
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.rep)
        abstract_base = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for n, a in base.items()}
        return self.abstract_lora, self.abstract_opt, abstract_base, batch, step

    def lower(self, base):
        """The train step traced and lowered for base's shapes and shardings (jax.stages.Lowered), not compiled."""
        with jax.set_mesh(self.mesh):
            return self._train.lower(*self._train_args(base))

    def compile(self, base, options: dict | None = None, lowered=None) -> float:
        """Ahead-of-time compile of the train step, so no step's time includes compilation (options: the
        compiler's, e.g. a plan's dump of its buffer assignment), beside the step's own (step_compiler).
        lowered: the step as lower(base) gave it (a plan lowers first, to know the program it compiles)."""
        t0 = time.perf_counter()
        lowered = lowered if lowered is not None else self.lower(base)
        with jax.set_mesh(self.mesh):
            self._train = lowered.compile(compiler_options={**self.compiler_options, **(options or {})})
        took = time.perf_counter() - t0
        mesh_lib.meet("the compiled train step")
        return took

    def compile_unrolled(self, base):
        """The train step with the loss's chunks written out (trainer/common/scans.py), compiled for its cost
        analysis only (a plan's whole-step count). Never run; a jit of its own."""
        with scans.unrolled(), jax.set_mesh(self.mesh):
            return self._jit_train(lambda *a: self._train_step(*a)).lower(*self._train_args(base)).compile()

    @property
    def train_fn(self):
        """The train step: the compiled one once compile() ran (its memory and cost analyses)."""
        return self._train

    def global_batch_of(self, local: dict) -> dict:
        return {f: jax.make_array_from_process_local_data(self.batch_sh, local[f]) for f in sft_data.FIELDS}

    def step(self, lora, opt_state, base, local: dict, step: int):
        with jax.set_mesh(self.mesh):
            out = self._train(lora, opt_state, base, self.global_batch_of(local), np.int32(step))
        return jax.block_until_ready(out) if self.wait_each_step else out  # mesh.one_step_in_flight

    def evaluate(self, lora, base, rows: sft_data.Rows) -> float | None:
        if rows is None or not len(rows):
            return None
        tot = np.zeros(2)
        with jax.set_mesh(self.mesh):
            for b in sft_data.eval_batches(rows, self.global_batch, jax.process_index(), jax.process_count()):
                tot += np.asarray(self._eval(lora, base, self.global_batch_of(b)))
        return float(tot[0] / max(tot[1], 1.0))

    def init(self):
        lora = jax.block_until_ready(lora_lib.init(self.cfg, self.lc, self.run.seed, self.mesh, self.scanned))
        return lora, jax.block_until_ready(jax.jit(self.tx.init, out_shardings=self.opt_sh)(lora))


def is_out_of_memory(e: Exception) -> bool:
    """Whether the compiler refused a step for want of device memory (jax raises its runtime error type)."""
    return "RESOURCE_EXHAUSTED" in str(e)


REFUSED_WRITTEN_OUT = "auto: the written-out step was refused by the compiler for memory"


def compile_fitting(steps: Steps, base: dict, total: int) -> tuple[Steps, dict, float]:
    """(steps, base as they take it, compile seconds): the step compiled; a written-out step that --remat auto
    chose on an estimate (remat_of) and the compiler refuses for memory is compiled again with its layers in
    scans and full recompute, the base restacked in place."""
    try:
        return steps, base, steps.compile(base)
    except Exception as e:  # noqa: BLE001
        if not is_out_of_memory(e) or steps.run.remat != "auto" or steps.remat != "none":
            raise
    if jax.process_index() == 0:
        metrics.say("the written-out step does not fit the devices after all (the compiler refused it); compiling it "
                    "with its layers in scans and full recompute (--remat full)")
    full = Steps(dataclasses.replace(steps.run, remat="full"), steps.cfg, steps.mesh, total, steps.global_batch)
    full.remat_why = REFUSED_WRITTEN_OUT
    base = full.place_base(base, free=True)
    return full, base, full.compile(base)


def load_data(run: LoraRun, tok, pid: int, nproc: int, global_batch: int):
    """(train batches, val rows, message) from the JSONL files, the same on every process."""
    train = sft_data.read_jsonl(run.data)
    if run.val_data:
        val = sft_data.read_jsonl(run.val_data)
    else:
        train, val = sft_data.split(train, run.val_fraction, run.seed)
    enc = lambda recs, name: [sft_data.encode(tok, m, f"{name} example {i + 1}") for i, m in enumerate(recs)]
    rows = sft_data.build_rows(enc(train, run.data), run.seq_len, packing=run.packing == "on", long=run.long)
    val_rows = sft_data.build_rows(enc(val, run.val_data or run.data), run.seq_len,
                                   packing=run.packing == "on", long=run.long) if val else None
    msg = (f"data: {len(train)} train examples in {len(rows)} rows of {run.seq_len} (packing {run.packing}), "
           f"{len(val)} val; longer than --seq-len: {rows.truncated} truncated, {rows.dropped} dropped")
    return sft_data.Batches(rows, global_batch, run.seed, pid, nproc), val_rows, msg


def adapter_meta(ckpt: checkpoint.Checkpointer, step: int) -> dict:
    return ckpt.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def finetune(run: LoraRun) -> int:
    """Train adapters to the run's last step, resuming from the latest checkpoint. Returns the exit code."""
    run.check()
    distributed = mesh_lib.init_distributed()
    loop.enable_compile_cache()
    mesh, global_batch = setup_mesh(run)
    pid, nproc = jax.process_index(), jax.process_count()
    told = weights.parse_config(run.weights_config)
    ck = weights.inspect(run.weights, family=run.family, **told)
    check_size(run, ck.cfg)
    tok = tok_lib.load(ck.path, ck.cfg.vocab, run.tokenizer or None)
    if pid == 0 and ck.guessed:
        metrics.say(ck.guess_note())
    batches, val_rows, data_msg = load_data(run, tok, pid, nproc, global_batch)
    total = run.steps or max(1, int(np.ceil(run.epochs * len(batches.rows) / global_batch)))
    profiling.check_window(profiling.parse_window(run.profile), total, what="--steps, or --epochs over the data")

    checkpoint.check_writable(run.ckpt_dir)
    ckpt = checkpoint.Checkpointer(run.ckpt_dir, run.keep)
    ckpt.watch_preemption(distributed)
    try:
        start = ckpt.latest_step() or 0
        if start:
            check_resumable(ck.cfg, run, adapter_meta(ckpt, start), run.ckpt_dir)
        base_dt = compute_dtype(run.base_dtype)
        _, base = weights.load(run.weights, mesh, family=run.family, dtype=base_dt, **told)
        steps = Steps(run, ck.cfg, mesh, total, global_batch)
        base = steps.place_base(base, free=True)
        return _train(run, ck.cfg, steps, ckpt, base, batches, val_rows, start, total, data_msg)
    finally:
        ckpt.unwatch()
        ckpt.close()


def setup_mesh(run: LoraRun):
    """(mesh, global batch): --mesh over this job's devices, one slice's or, on several slices (MEGASCALE_*),
    each slice's with the slices on `dcn`: pretrain's mesh (mesh.job_mesh). The base stays fsdp over `data`
    inside each slice and the batch goes over (dcn, data), so only the adapters' gradients cross the DCN."""
    mesh = mesh_lib.job_mesh(run.mesh)
    n_slices = mesh.shape[mesh_lib.DCN]
    return mesh, batch_of(run, jax.device_count(), mesh.shape["data"] * n_slices, n_slices)


def batch_of(run: LoraRun, devices: int, data: int, n_slices: int = 1) -> int:
    """The global batch in rows: --batch-size, or 4 per device; the mesh's batch axes (dcn x data) must divide
    it."""
    global_batch = run.batch_size or 4 * devices
    if global_batch % data:
        where = f" over {n_slices} slices" if n_slices > 1 else ""
        raise UsageError(f"--batch-size {global_batch} is not divisible by the mesh's data axis ({data}{where}); "
                         "use a multiple of it")
    return global_batch


def check_size(run: LoraRun, cfg: gemma.GemmaConfig) -> None:
    """--model SIZE against the checkpoint's shapes (weights.check_size)."""
    weights.check_size(run.size, cfg, run.weights)


def check_resumable(cfg: gemma.GemmaConfig, run: LoraRun, meta: dict, where: str) -> None:
    saved = meta.get("config", {})
    for key in ("rank", "alpha", "targets"):
        if key in saved and str(saved[key]) != str(getattr(run, key)):
            raise UsageError(f"--ckpt-dir {where} holds adapters with --{key} {saved[key]}, not {getattr(run, key)}; "
                             "use another --ckpt-dir or the same LoRA flags")
    lora_lib.check_matches(cfg, run.lora, {k: tuple(v) for k, v in saved.get("shapes", {}).items()},
                           f"--ckpt-dir {where}")


# The meta's key naming how a checkpoint holds the adapters: lora.STACKED (a scanned step's train state), or
# per layer (param_layout's names: a written-out step's, and every checkpoint written before the key was)
LAYOUT = "adapter_layout"


def _is_stacked(meta: dict) -> bool:
    return meta.get("config", {}).get(LAYOUT) == lora_lib.STACKED


def restore_state(ckpt: checkpoint.Checkpointer, step: int, steps: Steps, meta: dict):
    """(adapters, optimizer state) of a checkpoint, in the layout the steps take (a checkpoint of the other layout,
    e.g. written by a step with another --remat, is read as written and converted)."""
    stacked = _is_stacked(meta)
    if stacked == steps.scanned:
        return ckpt.restore(step, steps.abstract_lora, steps.abstract_opt)
    written = lora_lib.abstract(steps.cfg, steps.lc, steps.mesh, stacked)
    state = ckpt.restore(step, written, steps.abstract_opt_of(written)[1])
    return (lora_lib.flat_of if stacked else lora_lib.stacked_of)(steps.cfg, steps.lc, state, steps.mesh)


class _Meta:
    """The run's config and adapter shapes, as stored in each checkpoint's `meta` item."""

    def __init__(self, run: LoraRun, cfg: gemma.GemmaConfig, stacked: bool):
        self.run, self.cfg, self.stacked = run, cfg, stacked

    def to_dict(self) -> dict:
        shapes = {n: list(s) for n, (s, _) in lora_lib.param_layout(self.cfg, self.run.lora).items()}
        return {**self.run.to_dict(), "base": dataclasses.asdict(self.cfg), "shapes": shapes,
                LAYOUT: lora_lib.STACKED if self.stacked else "layers"}


def _train(run, cfg, steps: Steps, ckpt, base, batches, val_rows, start, total, data_msg) -> int:
    primary = jax.process_index() == 0
    lc = steps.lc
    if primary:
        (epath.Path(run.ckpt_dir) / "config.json").write_text(json.dumps(run.to_dict(), indent=1) + "\n")
        n_lora, n_base = lora_lib.count(cfg, lc), gemma.count_params(cfg)
        metrics.say(data_msg)
        metrics.say(f"LoRA rank {lc.rank} alpha {lc.alpha:g} on {','.join(lc.targets)}: {n_lora:,} trainable params "
                    f"({100 * n_lora / n_base:.3f}% of {n_base:,}) | mesh {mesh_lib.describe(steps.mesh)} over "
                    f"{jax.device_count()} devices in {jax.process_count()} process(es) | remat {steps.remat} ({steps.remat_why}) | "
                    + (f"resuming from step {start}" if start else "starting from the base"))
    if start >= total:
        if primary:
            metrics.say(f"already at step {start} >= {total}: nothing to do")
        return 0
    steps, base, compile_s = compile_fitting(steps, base, total)
    if primary:
        metrics.say(f"compiled the train step in {compile_s:.1f} s")
    # after the compile: the step it settled on (compile_fitting) decides the state's layout
    if start:
        lora, opt_state = restore_state(ckpt, start, steps, adapter_meta(ckpt, start))
    else:
        lora, opt_state = steps.init()
    meta = _Meta(run, cfg, steps.scanned)
    job = loop.Job(
        ckpt_dir=run.ckpt_dir, total=total, log_every=run.log_every, eval_every=run.eval_every,
        ckpt_every=run.ckpt_every, tokens_per_step=batches.global_batch * run.seq_len,
        step=lambda state, local, step: steps.step(*state, base, local, step),
        evaluate=lambda state: steps.evaluate(state[0], base, val_rows),
        save=lambda ck, step, state: ck.save(step, *state, meta), saved_what="adapters",
        profile=profiling.parse_window(run.profile))
    return loop.run(job, ckpt, (lora, opt_state), start,
                    ((step, batches.local_batch(step)) for step in range(start + 1, total + 1)))



def load_adapters(directory: str, cfg: gemma.GemmaConfig, mesh, step: int | None = None):
    """(LoraConfig, adapters on the mesh) from a fine-tuning checkpoint dir, checked against the base `cfg`."""
    ck = checkpoint.Checkpointer(directory, 1, read_only=True)
    try:
        step = step or ck.latest_step()
        if not step:
            raise UsageError(f"--adapters {directory}: no finished LoRA checkpoint there; pass the --ckpt-dir "
                             "of a `python -m trainer lora` run")
        meta = adapter_meta(ck, step)
        saved = meta["config"]
        lc = lora_lib.LoraConfig(saved["rank"], saved["alpha"], 0.0, lora_lib.resolve_targets(saved["targets"]))
        lora_lib.check_matches(cfg, lc, {k: tuple(v) for k, v in saved.get("shapes", {}).items()},
                               f"--adapters {directory}")
        stacked = _is_stacked(meta)
        lora, _ = ck.restore(step, lora_lib.abstract(cfg, lc, mesh, stacked))
        return lc, lora_lib.flat_of(cfg, lc, lora, mesh) if stacked else lora
    finally:
        ck.close()
