"""The one training loop both jobs run (pretraining and LoRA): steps, logging, evaluation, checkpoints, a
preemption notice or Ctrl-C (save, then exit 42 or 130), the progress tpuctl watches, W&B. Each job supplies its
compiled step, its evaluation and what a checkpoint holds (`Job`); the loop owns everything around them.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jax

from trainer.common import checkpoint, chipstats, metrics, profiling, steptimes
from trainer.common.config import UsageError

PREEMPTED = 42  # exit code after a preemption save (docs/CONTRACTS.md)
INTERRUPTED = 130  # exit code after Ctrl-C (128 + SIGINT, as shells report it)


def enable_compile_cache() -> None:
    """Persistent XLA compilation cache (a restart after preemption skips recompiling).

    JAX_COMPILATION_CACHE_DIR wins; else $TPUCTL_CACHE/jax (default ~/.cache/tpuctl/jax), private to the user.

    Every compile is kept, not only those over JAX's default second: a run's start compiles dozens of small
    programs besides the step (parameter init, the checkpointer's per-shard slices, evaluation), each under a
    second and together a few seconds of every host's restart.
    """
    from jax.experimental.compilation_cache import compilation_cache as cc
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if jax.config.jax_compilation_cache_dir:
        return
    root = Path(os.environ.get("TPUCTL_CACHE", Path.home() / ".cache" / "tpuctl"))
    cc.set_cache_dir(str(root / "jax"))
    cc.reset_cache()  # in case something compiled earlier in this process with no cache configured


class _NoWandb:
    def log(self, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Job:
    """What a job gives the loop. `state` is the job's train state (a tuple of pytrees) and passes through."""
    ckpt_dir: str
    total: int                                      # the last step
    log_every: int
    eval_every: int                                 # 0: only at the last step
    ckpt_every: int                                 # 0: only at the end and on a notice
    tokens_per_step: int
    # (state, local batch, step) -> (*state, {loss, grad_norm, lr, and any of the step's own scalars: logged too})
    step: Callable[[Any, Any, int], tuple]
    evaluate: Callable[[Any], float | None]         # state -> validation loss
    save: Callable[[checkpoint.Checkpointer, int, Any], None]  # write step's state (and the job's meta)
    saved_what: str = "checkpoint"                  # the last line: "done: step N, <saved_what> in DIR"
    flops_per_token: float | None = None            # with peak_flops: the MFU column
    peak_flops: float | None = None
    profile: profiling.Window | None = None         # --profile: the steps every process traces


def finite(loss: float, step: int, ckpt: checkpoint.Checkpointer) -> float:
    """The loss, or stop the run (every process sees the same replicated loss) keeping the last good step."""
    if math.isfinite(loss):
        return loss
    ckpt.wait()
    kept = ckpt.latest_step()
    raise UsageError(f"the loss is {loss} at step {step}: training stopped; "
                     + (f"the latest checkpoint stays step {kept}" if kept else "no checkpoint was written")
                     + " (nothing diverged was saved): lower --lr, or check the data")


def run(job: Job, ckpt: checkpoint.Checkpointer, state: Any, start: int,
        batches: Iterator[tuple[int, Any]], wandb=None) -> int:
    """Train from step start + 1 to job.total over `batches` ((step, local batch) in step order). Returns the
    exit code: 0 done, PREEMPTED after a notice's save, INTERRUPTED after Ctrl-C's save."""
    primary = jax.process_index() == 0
    wandb = wandb or _NoWandb()
    log = metrics.MetricsLog(job.ckpt_dir, start, enabled=primary)
    ckpt.watch_interrupt()  # from here on Ctrl-C would lose steps: save them first
    report_progress = "TPUCTL_PROCESS_ID" in os.environ
    prof = profiling.Recorder(job.profile, job.ckpt_dir, jax.process_index())
    port, why = profiling.start_server(jax.process_index())  # for a live capture (TensorBoard, tpuctl profile)
    if port is None and why != f"{profiling.PORT_ENV}=0":
        metrics.say(f"profiler server of process {jax.process_index()}: {why}; no live capture from it")
    if primary and job.profile is not None and job.profile.last <= start:
        metrics.say(f"--profile {job.profile}: those steps were done before step {start}, where this run resumes; "
                    "no trace is taken")
    # How long this process was itself not running (a straggler's mark when the others wait for it inside steps).
    stall_clock = steptimes.StallClock() if jax.process_count() > 1 else None
    chips = chipstats.Sampler()  # this host's chips, once a minute, into its record of the next logged step
    try:
        # A logged window's tokens/s and MFU count the steps that FINISHED within it: it starts and ends where
        # the loop has waited for a step's result (its loss), and what is left out of it (the profiler's start and
        # stop, a checkpoint's save) is timed only once the device has nothing of the window's left to do. Had the
        # device gone on working while the profiler started, that work would leave the window and a step would
        # seem faster than the chip (96% MFU was logged so as a profile began).
        last_t, last_step = time.perf_counter(), start
        batches, step, profiler_s, save_s = iter(batches), start, 0.0, 0.0
        while True:
            spent = prof.begin(step + 1, state)  # the profiler's own start and stop stay out of step times
            last_t, profiler_s = last_t + spent, profiler_s + spent
            with prof.annotate(step + 1):  # the trace's step: waiting for the batch, then the step itself
                waiting = time.perf_counter()
                nxt = next(batches, None)
                if nxt is None:
                    break
                step, local = nxt
                input_wait_s, dispatch_t = time.perf_counter() - waiting, time.time()
                *new, out = job.step(state, local, step)
            state = tuple(new)
            spent = prof.end(step, state)
            last_t, profiler_s = last_t + spent, profiler_s + spent
            last = step == job.total
            if step == start + 1 or step % job.log_every == 0 or last:
                rec = {"step": step, "loss": finite(float(out["loss"]), step, ckpt)}  # waits for the step
                dt = (time.perf_counter() - last_t) / (step - last_step)
                tps = job.tokens_per_step / dt
                rec["tokens_per_s"] = tps
                if job.flops_per_token is not None:
                    rec["mfu"] = tps * job.flops_per_token / (job.peak_flops * jax.device_count()) \
                        if job.peak_flops else None
                rec.update(step_time_s=dt, lr=float(out["lr"]), grad_norm=float(out["grad_norm"]))
                rec.update({k: float(v) for k, v in out.items() if k not in rec})  # e.g. lora's expert_dropped
                if profiler_s or save_s:  # named, not hidden: the window's time is the steps' alone
                    rec["left_out_s"] = {k: v for k, v in (("profiler", profiler_s), ("checkpoint", save_s)) if v}
                mine = {"dispatch_t": dispatch_t, "input_wait_s": input_wait_s,
                        "stalled_s": stall_clock.take() if stall_clock else 0.0, "profiler_s": profiler_s}
                profiler_s = save_s = 0.0
                if (sample := chips.take()) is not None:
                    mine["chips"] = sample
                hosts = steptimes.gather(step, mine)  # every process's record, on process 0
                if last or (job.eval_every and step % job.eval_every == 0):
                    rec["val_loss"] = job.evaluate(state)
                log.log({**rec, "hosts": hosts} if primary else rec)
                wandb.log(rec)
                if primary:
                    metrics.say(metrics.progress(rec, job.total))
                if report_progress:  # every process: tpuctl names a host that stops advancing, and the slow one
                    print(f"TPUCTL_PROGRESS step={step} dispatch_t={dispatch_t:.6f} input_wait_s={input_wait_s:.6f} "
                          f"stalled_s={mine['stalled_s']:.6f} step_time_s={dt:.6f} tokens_per_s={tps:.1f}", flush=True)
                last_t, last_step = time.perf_counter(), step  # eval and logging stay out of step times
            preempted = ckpt.preempted(step)  # every process, every step (a sync point when distributed)
            interrupted = ckpt.interrupted and not last
            if preempted or interrupted or last or (job.ckpt_every and step % job.ckpt_every == 0):
                finite(float(out["loss"]), step, ckpt)  # a diverged step never replaces a good one
                jax.block_until_ready(state)  # the steps' own work stays in their window
                t0 = time.perf_counter()
                job.save(ckpt, step, state)
                spent = time.perf_counter() - t0
                if not last:
                    last_t, save_s = last_t + spent, save_s + spent
            if preempted or interrupted:
                ckpt.wait()
                if preempted:
                    if primary:
                        metrics.say(f"preemption notice: saved step {step} to {job.ckpt_dir}; exiting {PREEMPTED}")
                    return PREEMPTED
                metrics.say(f"interrupted: saved step {step} to {job.ckpt_dir}; the same command resumes from it")
                return INTERRUPTED
            if last:
                break
    finally:
        if stall_clock:
            stall_clock.close()
        chips.close()
        prof.close()
        profiling.stop_server()
        log.close()
        wandb.close()
    if primary:
        metrics.say(f"done: step {job.total}, {job.saved_what} in {job.ckpt_dir}")
    return 0
