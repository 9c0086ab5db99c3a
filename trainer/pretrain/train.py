"""Pretraining: the jitted step, evaluation, checkpoints and metrics around it.

Every process runs this same program on its share of the global batch. The train state is two
pytrees of global arrays (params, optimizer state) that stay in the shardings the rules give them:
the step is compiled with those as in/out shardings and donates its inputs.
"""
from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx

from trainer.common import checkpoint, loop, metrics, optim, profiling, scans, wandb_log
from trainer.common import mesh as mesh_lib
from trainer.pretrain import data, tokenizers
from trainer.common.mesh import compute_dtype
from trainer.common.config import Config, UsageError
from trainer.kernels import xent_kernel
from trainer.models import attention, gpt2

def check_fits(cfg: Config, shape: dict[str, int], n_processes: int) -> None:
    """The config against the mesh: clear errors before anything is allocated."""
    m, t = cfg.model, cfg.train
    d, mp = shape["data"] * shape.get(mesh_lib.DCN, 1), shape["model"]  # the batch goes over (dcn, data)
    micro = t.batch_size // t.grad_accum
    if micro % d:
        per = f" (per micro-step {micro} with --grad-accum {t.grad_accum})" if t.grad_accum > 1 else ""
        raise UsageError(f"--batch-size {t.batch_size}{per} is not divisible by the mesh's data axis ({d}"
                         + (f" over {shape[mesh_lib.DCN]} slices" if shape.get(mesh_lib.DCN, 1) > 1 else "") + "); "
                         f"use a multiple of {d * t.grad_accum}")
    if t.batch_size % n_processes:
        raise UsageError(f"--batch-size {t.batch_size} is not divisible by the {n_processes} processes")
    for what, v in (("--n-head", m.n_head), ("the MLP width (--d-ff)", m.ff),
                    ("the padded vocab", m.padded_vocab)):
        if v % mp:
            raise UsageError(f"{what} {v} is not divisible by the mesh's model axis ({mp}); "
                             f"use a --mesh whose model size divides {v}")
    attention.check(t.attention, m.seq_len, (m.n_head, m.head_dim), t.resident_block)
    if t.vocab_parallel == "on" and m.padded_vocab % (d * mp):
        raise UsageError(f"--vocab-parallel on: the padded vocab {m.padded_vocab} is not divisible by the "
                         f"{d * mp} devices; set --vocab-multiple to a multiple of {d * mp}")


def use_vocab_parallel(cfg: Config, n_devices: int, n_slices: int = 1) -> bool:
    """--vocab-parallel resolved. auto: on when the hidden states of a (micro-)step, which it all-gathers,
    are smaller than the [V, D] table whose gradient it then no longer all-reduces; never on several slices
    (its gathers would cross DCN every step)."""
    m, t = cfg.model, cfg.train
    if t.vocab_parallel != "auto":
        return t.vocab_parallel == "on"
    if n_slices > 1:
        return False
    tokens = t.batch_size // t.grad_accum * m.seq_len
    return n_devices > 1 and m.padded_vocab % n_devices == 0 and tokens < m.padded_vocab


class Steps:
    """The compiled train and eval steps of one (config, mesh)."""

    def __init__(self, cfg: Config, mesh):
        m, t = cfg.model, cfg.train
        self.cfg, self.mesh = cfg, mesh
        platform = mesh.devices.flat[0].platform  # of the devices compiled for: a TPU plan from a CPU host
        self.dtype = compute_dtype(t.dtype, platform)
        self.attention = attention.resolve(t.attention, platform, m.seq_len, mesh.devices.flat[0].device_kind,
                                           (m.n_head, m.head_dim), t.resident_block)
        self.kernel = attention.Kernel(t.splash_layout, t.splash_bwd, t.splash_block, t.splash_fwd, t.resident_block)
        self.graphdef, _ = gpt2.abstract(m)
        self.vocab_parallel = use_vocab_parallel(cfg, mesh.size, mesh.shape[mesh_lib.DCN])
        # the output layer's kernels where they apply: not with the vocabulary split over devices (its own loss),
        # nor where one device's tokens and the table do not tile into their blocks
        kernel = xent_kernel.resolve(t.loss_kernel, platform, mesh.devices.flat[0].device_kind)
        shards = mesh.shape[mesh_lib.DCN] * mesh.shape["data"]
        rows = t.batch_size // t.grad_accum
        self.loss_kernel = None if kernel is None or self.vocab_parallel or rows % shards or xent_kernel.plan(
            rows // shards * m.seq_len, m.padded_vocab, m.d_model, kernel.blocks) is None else kernel
        self.rules = mesh_lib.VOCAB_PARALLEL_RULES if self.vocab_parallel else mesh_lib.RULES
        self.param_sh = gpt2.param_shardings(m, mesh, self.rules)
        self.rep = mesh_lib.replicated(mesh)
        self.batch_sh = mesh_lib.sharding(mesh, ("batch", None))
        self.tx = optim.make(t)
        self.lr = optim.schedule(t)
        shapes = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(gpt2.GPT2(m, nnx.Rngs(0)), nnx.Param)))
        self.abstract_params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                            shapes, self.param_sh)
        # --optimizer-state sharded (ZeRO-1): the moments, and the gradients the update reads, split over data
        self.split = t.optimizer_state == "sharded"
        self.grad_sh = optim.split_shardings(self.abstract_params, self.param_sh) if self.split else None
        self.opt_sh = optim.state_shardings(self.tx, self.abstract_params, self.param_sh, self.rep, split=self.split)
        self.abstract_opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                         jax.eval_shape(self.tx.init, self.abstract_params), self.opt_sh)
        self._train = self._jit_train(self._train_step)
        self._eval = jax.jit(self._eval_step, in_shardings=(self.param_sh, self.batch_sh), out_shardings=self.rep)
        self.train_fn = self.eval_fn = None
        self.wait_each_step = mesh_lib.one_step_in_flight(mesh)

    # --- pure functions ---------------------------------------------------------------------------

    def _loss(self, params, tokens, key):
        model = nnx.merge(self.graphdef, params)
        t = self.cfg.train
        return model.loss(tokens, dropout_key=key, dtype=self.dtype, vocab_parallel=self.vocab_parallel,
                          loss_chunk=t.loss_chunk, attention=self.attention, remat=t.remat,
                          table_grads=t.table_grads, logits=t.logits, kernel=self.kernel,
                          loss_kernel=self.loss_kernel)

    def _train_step(self, params, opt_state, batch, step):
        t = self.cfg.train
        # Dropout keys from (seed, step), drawn on global arrays: independent of the process count.
        key = jax.random.fold_in(jax.random.key(t.seed), step)
        grad = jax.value_and_grad(self._loss)
        if t.grad_accum == 1:
            loss, grads = grad(params, batch, key)
        else:
            a = t.grad_accum
            # Micro-batch i = rows i, a+i, 2a+i, ...: each device keeps its own rows (no data movement).
            micro = batch.reshape(batch.shape[0] // a, a, batch.shape[1]).swapaxes(0, 1)
            micro = mesh_lib.constrain(micro, (None, "batch", None))

            def body(acc, xs):
                i, mb = xs
                out = grad(params, mb, jax.random.fold_in(key, i))
                return jax.tree.map(jnp.add, acc, out), None
            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = scans.scan(body, zero, (jnp.arange(a), micro))
            loss, grads = loss / a, jax.tree.map(lambda g: g / a, grads)
        if self.grad_sh is not None:
            # ZeRO-1: each device updates only its share of the parameters (read from its replica), then the new
            # parameters are gathered: the update reads and writes an eighth of the f32 state on each of 8
            # devices (given the replicated parameters, the compiler computes the update for all of them on
            # every device). The barrier keeps the TPU compiler from windowing the backward pass's weight matmuls
            # into loops of collective permutes that reduce-scatter as they go (gpt2-124m on v5e-8 with
            # --loss-chunk 0: 63.4 GB a step without it, 41-48 GB with it, docs/verbs.md); past it, the compiler
            # still fuses the all-reduce and each device's slice of the MLP kernels' bf16 gradients into
            # reduce-scatters.
            grads = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(grads, self.param_sh))
            grads = jax.lax.with_sharding_constraint(grads, self.grad_sh)
            params = jax.lax.with_sharding_constraint(params, self.grad_sh)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if self.grad_sh is not None:
            params = jax.lax.with_sharding_constraint(params, self.param_sh)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "lr": self.lr(step - 1)}

    def _jit_train(self, fn):
        return jax.jit(fn, in_shardings=(self.param_sh, self.opt_sh, self.batch_sh, self.rep),
                       out_shardings=(self.param_sh, self.opt_sh, self.rep),
                       # ZeRO-1's parameters come out of an all-gather, which the compiler does not write into a
                       # donated buffer: donated, each is copied out of the input before the step and into it
                       # after (gpt2-124m on v5e-8, --loss-chunk 0: 41.3 GB and 3.91 GiB of temporaries a step
                       # against 40.7 and 3.74 not donated; the old parameters are held until the step ends)
                       donate_argnums=(1,) if self.split else (0, 1))

    def _eval_step(self, params, batch):
        return self._loss(params, batch, None)

    # --- compiled ---------------------------------------------------------------------------------

    def lower(self):
        """The train step traced and lowered (jax.stages.Lowered), not compiled."""
        with jax.set_mesh(self.mesh):
            return self._train.lower(*self._train_args())

    def compile(self, options: dict | None = None, lowered=None) -> float:
        """Ahead-of-time compile of the train step, so no step's time includes compilation (options: the
        compiler's, e.g. a plan's dump of its buffer assignment; lowered: the step as lower() gave it)."""
        t0 = time.perf_counter()
        lowered = lowered if lowered is not None else self.lower()
        with jax.set_mesh(self.mesh):
            self.train_fn = lowered.compile(compiler_options=options)
        took = time.perf_counter() - t0
        mesh_lib.meet("the compiled train step")
        return took

    def _train_args(self):
        t, m = self.cfg.train, self.cfg.model
        batch = jax.ShapeDtypeStruct((t.batch_size, m.seq_len + 1), jnp.int32, sharding=self.batch_sh)
        return self.abstract_params, self.abstract_opt, batch, jax.ShapeDtypeStruct((), jnp.int32, sharding=self.rep)

    def compile_unrolled(self):
        """The train step with every loop written out (trainer/common/scans.py), compiled for its cost analysis
        only: a plan's whole-step flops and bytes. Never run. A jit of its own, so that nothing traced for the
        real step (whose loops stay loops) is reused."""
        with scans.unrolled(), jax.set_mesh(self.mesh):
            return self._jit_train(lambda *a: self._train_step(*a)).lower(*self._train_args()).compile()

    def init(self):
        params = self._settled(gpt2.init_params(self.cfg.model, self.cfg.train.seed, self.mesh, self.rules))
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_sh)(params)
        return params, self._settled(opt_state)

    def global_batch(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.batch_sh, local)

    def step(self, params, opt_state, local: np.ndarray, step: int):
        return self._settled(self.train_fn(params, opt_state, self.global_batch(local), np.int32(step)))

    def _settled(self, out):
        """out, after it is computed when the mesh needs one program in flight (mesh.one_step_in_flight)."""
        return jax.block_until_ready(out) if self.wait_each_step else out

    def evaluate(self, params, val: data.BatchLoader, n: int) -> float:
        if self.eval_fn is None:  # compiled at the first evaluation, outside any timed step
            t, m = self.cfg.train, self.cfg.model
            shape = jax.ShapeDtypeStruct((t.batch_size // t.grad_accum, m.seq_len + 1), jnp.int32,
                                         sharding=self.batch_sh)
            with jax.set_mesh(self.mesh):
                self.eval_fn = self._eval.lower(self.abstract_params, shape).compile()
            mesh_lib.meet("the compiled eval step")
        # One batch at a time: each float() waits for its batch (mesh.one_step_in_flight).
        return float(np.mean([float(self.eval_fn(params, self.global_batch(val.local_batch(i)))) for i in range(n)]))


def setup_mesh(cfg: Config):
    """--mesh over this job's devices: one slice's, or each slice's with the slices on `dcn` (MEGASCALE_*)."""
    mesh = mesh_lib.job_mesh(cfg.train.mesh)
    check_fits(cfg, dict(mesh.shape), jax.process_count())
    return mesh


def pretrain(cfg: Config) -> int:
    """Train to cfg.train.steps, resuming from the latest checkpoint. Returns the exit code."""
    t, m = cfg.train, cfg.model
    wandb_log.check(t.wandb)
    distributed = mesh_lib.init_distributed()
    loop.enable_compile_cache()
    mesh = setup_mesh(cfg)
    pid, nproc = jax.process_index(), jax.process_count()
    data_dir = data.resolve(t.data or None)
    tokenizer = tokenizers.of_data(data_dir)  # meta.json of the token folder (gs:// is read in place)
    if m.tokenizer and m.tokenizer != tokenizer:
        raise UsageError(f"--tokenizer {m.tokenizer}: the data was prepared with {tokenizer}")
    if not m.tokenizer:  # a Config built in Python without it: the checkpoint records what the ids mean
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, tokenizer=tokenizer))
        m = cfg.model
    loader = data.BatchLoader(data_dir, "train", m.seq_len, t.batch_size, t.seed, pid, nproc, vocab_size=m.vocab_size)
    val = data.BatchLoader(data_dir, "val", m.seq_len, t.batch_size // t.grad_accum, 1234, pid, nproc,
                           vocab_size=m.vocab_size)

    checkpoint.check_writable(t.ckpt_dir)
    hosts = checkpoint.check_shared(t.ckpt_dir)
    ckpt = checkpoint.Checkpointer(t.ckpt_dir, t.keep)
    ckpt.watch_preemption(distributed)  # a notice during setup stops the run after its first step
    try:
        return _train(cfg, mesh, ckpt, loader, val, hosts)
    finally:
        ckpt.unwatch()
        ckpt.close()


RUN_INFO = "run_info.json"  # in --ckpt-dir: where the latest start of the run ran (read by trainer/experiments/report.py)


def write_run_info(cfg: Config, mesh, steps: "Steps", hosts: list[str], start: int) -> None:
    """The mesh, devices and hosts of this start of the run (a resume after a preemption may have new ones)."""
    n_slices, nproc = mesh.shape[mesh_lib.DCN], jax.process_count()
    info = {"mesh": mesh_lib.shape_of(mesh), "slices": n_slices,
            "process_slices": [mesh_lib.slice_of_process(p, nproc, n_slices) for p in range(nproc)],
            "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
            "platform": jax.devices()[0].platform, "processes": jax.process_count(), "hosts": hosts,
            "dtype": jnp.dtype(steps.dtype).name, "vocab_parallel": steps.vocab_parallel, "started_at_step": start,
            "started": time.time()}
    (epath.Path(cfg.train.ckpt_dir) / RUN_INFO).write_text(json.dumps(info, indent=1) + "\n")


def _train(cfg: Config, mesh, ckpt: checkpoint.Checkpointer, loader: data.BatchLoader, val: data.BatchLoader,
           hosts: list[str]) -> int:
    t, m = cfg.train, cfg.model
    primary = jax.process_index() == 0
    start = ckpt.latest_step() or 0
    if start:
        ckpt.check_compatible(start, cfg)
    if primary:
        checkpoint.write_config(t.ckpt_dir, cfg)
        metrics.say(f"config: {json.dumps(cfg.to_dict(), separators=(',', ':'))}")  # one line; config.json has it all

    steps = Steps(cfg, mesh)
    if start:
        params, opt_state = ckpt.restore(start, steps.abstract_params, steps.abstract_opt)
    else:
        params, opt_state = steps.init()
    if primary:
        if mesh.shape[mesh_lib.DCN] > 1:
            metrics.say(f"mesh {mesh_lib.describe(mesh)} ({jax.device_count()} devices, {jax.process_count()} "
                        "processes)")
        metrics.say(f"{gpt2.count_params(params):,} params | mesh {mesh_lib.describe(mesh)}"
                    f" over {jax.device_count()} {jax.devices()[0].device_kind} devices in {jax.process_count()}"
                    f" process(es) | dtype {jnp.dtype(steps.dtype).name} | "
                    + (f"resuming from step {start}" if start else "starting from scratch"))
        write_run_info(cfg, mesh, steps, hosts, start)
    if start >= t.steps:
        if primary:
            metrics.say(f"already at step {start} >= --steps {t.steps}: nothing to do")
        return 0

    compile_s = steps.compile()
    if primary:
        metrics.say(f"compiled the train step in {compile_s:.1f} s")
    wandb = wandb_log.WandbLog(cfg, enabled=primary)  # first: a failing wandb.init leaves nothing else open
    job = loop.Job(
        ckpt_dir=t.ckpt_dir, total=t.steps, log_every=t.log_every, eval_every=t.eval_every, ckpt_every=t.ckpt_every,
        tokens_per_step=t.batch_size * m.seq_len,
        step=lambda state, local, step: steps.step(*state, local, step),
        evaluate=lambda state: steps.evaluate(state[0], val, t.eval_batches),
        save=lambda ck, step, state: ck.save(step, *state, cfg),
        flops_per_token=metrics.flops_per_token(m),
        peak_flops=metrics.peak_flops(jax.devices()[0].device_kind, t.peak_flops),
        profile=profiling.parse_window(t.profile))
    return loop.run(job, ckpt, (params, opt_state), start, loader.iterate(start + 1), wandb)
