"""Orbax checkpoints: async saves to a local dir or gs:// (same code), resume, save on a preemption notice
or (single process) on Ctrl-C.

A step holds three items: `params` and `opt` (sharded arrays, restored straight into the shardings of
whatever mesh the new run uses) and `meta` (the step and the run's config, JSON). Only finished steps
count: Orbax ignores a step whose save did not complete, and the next writer deletes what it left.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import uuid

import orbax.checkpoint as ocp
from etils import epath

from trainer.common.config import Config, UsageError, model_diff


def check_writable(directory: str) -> None:
    """Create the dir (if missing) and write + delete a probe file, or raise a one-line UsageError."""
    path = epath.Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{uuid.uuid4().hex[:8]}"
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # OSError locally; google/gcsfs errors on gs://
        reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        fix = "pass a directory you can write"
        if directory.startswith("gs://") and ("403" in str(e) or "Forbidden" in type(e).__name__ + str(e)):
            bucket = directory[5:].split("/")[0]
            who = vm_identity()
            fix = (f"the identity this process runs as ({who or 'its credentials'}) needs roles/storage.objectAdmin "
                   f"on gs://{bucket}: `gcloud storage buckets add-iam-policy-binding gs://{bucket} "
                   f"--member serviceAccount:{who or 'SA_EMAIL'} --role roles/storage.objectAdmin`")
        raise UsageError(f"--ckpt-dir {directory} is not writable ({reason}); {fix}") from None


def vm_identity(timeout: float = 1.0) -> str | None:
    """The service account a Cloud VM runs as, from its metadata server (None elsewhere)."""
    import urllib.request
    host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
    req = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/service-accounts/default/email",
                                 headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode().strip() or None
    except Exception:  # noqa: BLE001 - not on a VM
        return None


def check_shared(directory: str) -> list[str]:
    """Every process must see the same --ckpt-dir (they write one checkpoint together): process 0 writes a
    probe, each process looks for it. Raises a one-line UsageError on every process naming those that could
    not see it (a per-host local disk, a mount missing on some hosts). Returns each process's host name."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils as mh
    if jax.process_count() == 1:
        return [socket.gethostname()]
    nonce = int(mh.broadcast_one_to_all(np.array(uuid.uuid4().int % 2**31, dtype=np.int32)))
    probe = epath.Path(directory) / f".shared-probe-{nonce}"
    if jax.process_index() == 0:
        probe.write_text("tpuctl")
    mh.sync_global_devices("ckpt-dir probe written")
    seen = probe.exists()
    host = np.frombuffer(socket.gethostname().encode()[:64].ljust(64, b"\0"), dtype=np.uint8)
    everyone = mh.process_allgather(np.concatenate([[np.uint8(seen)], host]))
    mh.sync_global_devices("ckpt-dir probe read")
    if jax.process_index() == 0:
        probe.unlink(missing_ok=True)
    names = [bytes(row[1:]).rstrip(b"\0").decode(errors="replace") for row in everyone]
    missing = [f"process {i} ({names[i]})" for i, row in enumerate(everyone) if not row[0]]
    if missing:
        raise UsageError(f"--ckpt-dir {directory} is not shared by all {jax.process_count()} processes: "
                         f"{', '.join(missing)} did not see the file process 0 wrote there; use gs://BUCKET/PATH "
                         "or a filesystem every host mounts at the same path (NFS, Filestore, gcsfuse)")
    return names


EXIT_STORAGE = 3  # the checkpoint storage did not answer in time (docs/CONTRACTS.md)
# How long one checkpoint operation (a save's synchronous part, waiting for the previous async save, a restore)
# may take before the run stops instead of waiting on retries. Long enough for a slow save of a big model;
# TPUCTL_STORAGE_TIMEOUT_S raises it.
STORAGE_TIMEOUT_S = 60.0
# tensorstore retries a GCS request 32 times with waits up to 32 s (~15 min) by default: a few retries with
# short waits are enough for a blip, and a bucket that is gone fails within the operation's budget.
GCS_RETRIES = {"max_retries": 5, "initial_delay": "0.5s", "max_delay": "8s"}


def _bounded_gcs_retries() -> None:
    """Orbax builds every TensorStore context from these module defaults (gcs_request_retries is a context
    resource of TensorStore's gcs driver)."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu
    for ctx in (tsu._BASE_TS_CONTEXT, tsu._DEFAULT_OCDBT_TS_CONTEXT):
        ctx["gcs_request_retries"] = dict(GCS_RETRIES)


class StorageDeadline:
    """Bound a blocking checkpoint operation: past the budget, say what hung and stop the process at once
    (Orbax's own threads would keep it alive, retrying). A step whose save was cut short never counts: on
    GCS it has no commit_success.txt, locally it stays a tmp dir the next writer deletes."""

    def __init__(self, what: str, kept: int | None, directory: str):
        self.what, self.kept, self.directory = what, kept, directory
        self.timeout = float(os.environ.get("TPUCTL_STORAGE_TIMEOUT_S") or STORAGE_TIMEOUT_S)
        self.timer = threading.Timer(self.timeout, self._fire)
        self.timer.daemon = True

    _stopping = threading.Lock()  # one line, from whichever deadline or watch fires first

    def _stop(self, why: str, full: bool = False) -> None:
        if not StorageDeadline._stopping.acquire(blocking=False):
            threading.Event().wait()  # another thread is printing its line and exiting the process
        where = f"the bucket gs://{self.directory[5:].split('/')[0]}" if self.directory.startswith("gs://") \
            else f"{self.directory} on {socket.gethostname()}"
        kept = f"the latest step known saved is {self.kept}" if self.kept else "no step is known saved yet"
        then = "some space is freed" if full else "the storage answers again"
        # The save's own threads may be dying beside this one (orbax's writers find their event loop closed) and
        # printing their tracebacks: none from here on, and the line goes out in one write after a newline of
        # its own, so a traceback's half-written last line cannot swallow its start.
        threading.excepthook = lambda args: None
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, (f"\nerror: {where} {why} while {self.what}: stopping; {kept}, and the same command resumes "
                     f"from the latest complete step once {then}\n").encode())
        os._exit(EXIT_STORAGE)

    def _fire(self) -> None:
        self._stop(f"did not answer for {self.timeout:.0f} s (TPUCTL_STORAGE_TIMEOUT_S sets the budget)")

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, kind, exc, tb):
        self.timer.cancel()
        if exc is not None and isinstance(exc, Exception) and not isinstance(exc, UsageError):
            # The clients' retries are spent (gcsfs, tensorstore): a storage failure, not a bug of the run.
            text = (str(exc).strip().splitlines() or [""])[-1][:200]
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "No space left" in str(exc)
            self._stop("is full (no space left on the device)" if full else f"failed ({type(exc).__name__}: {text})",
                       full)
        return False


class Checkpointer:
    def __init__(self, directory: str, keep: int, *, read_only: bool = False, async_save: bool = True):
        _bounded_gcs_retries()
        self.directory = directory
        self.path = epath.Path(directory)
        self.mngr = ocp.CheckpointManager(
            self.path,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep, create=not read_only, read_only=read_only,
                save_interval_steps=0 if read_only else 1, enable_async_checkpointing=async_save,
                # A save cut short (a kill, a second Ctrl-C) leaves a tmp dir no run counts as a step: delete it.
                cleanup_tmp_directories=not read_only),
            item_names=("params", "opt", "meta"),
        )
        self._signalled = False
        self._interrupted = False
        self._saving: int | None = None   # the step whose async save was started last
        self._saved: int | None = None    # the last step known complete
        self._distributed = False
        self._previous = None
        self._previous_int = None
        self._current: str | None = None  # the storage operation in progress, for the bucket watch's line
        self._watch = None

    # --- what is there --------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def saved_config(self, step: int) -> Config:
        meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        return Config.from_dict(meta["config"])

    def check_compatible(self, step: int, cfg: Config) -> None:
        """Refuse to resume a checkpoint whose model differs (run-length settings may differ)."""
        diff = model_diff(self.saved_config(step).model, cfg.model)
        if diff:
            raise UsageError(f"--ckpt-dir {self.directory} holds a checkpoint (step {step}) of a different model "
                             f"({', '.join(diff)}); use another --ckpt-dir or the same model flags")

    # --- save / restore -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _deadline(self, what: str):
        self._current = what
        try:
            with StorageDeadline(what, self._saved, self.directory):
                yield
        finally:
            self._current = None

    def _watch_bucket(self) -> None:
        """From the first save on gs://: a bucket that stops answering stops the run within the storage budget
        of the moment it went away (trainer/common/bucket_watch.py), whatever operation was in flight."""
        if self._watch is not None or not self.directory.startswith("gs://"):
            return
        from trainer.common.bucket_watch import BucketWatch
        budget = float(os.environ.get("TPUCTL_STORAGE_TIMEOUT_S") or STORAGE_TIMEOUT_S)

        def silent(for_s: float) -> None:
            what = self._current or (f"saving step {self._saving}" if self._saving else "training")
            StorageDeadline(what, self._saved, self.directory)._stop(f"did not answer for {for_s:.0f} s (TPUCTL_STORAGE_TIMEOUT_S sets the "
                                       "budget)")

        bucket, _, prefix = self.directory[5:].partition("/")
        self._watch = BucketWatch(bucket, prefix, budget, silent).start()

    def save(self, step: int, params, opt_state, cfg: Config) -> None:
        """Start an async save of `step` (every process calls this; Orbax coordinates the writers). Orbax first
        waits for the previous save: both are bounded by the storage deadline."""
        what = f"saving step {step}" + (f" (after step {self._saving})" if self._saving else "")
        self._watch_bucket()
        with self._deadline(what):
            self.mngr.save(step, force=True, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave({"step": step, "config": cfg.to_dict()})))
        if self._saving is not None:
            self._saved = self._saving  # Orbax finished it before starting this one
        self._saving = step

    def restore(self, step: int, abstract_params, abstract_opt=None):
        """Arrays land in the shardings carried by the abstract trees (ShapeDtypeStruct with .sharding)."""
        items = {"params": ocp.args.StandardRestore(abstract_params)}
        if abstract_opt is not None:
            items["opt"] = ocp.args.StandardRestore(abstract_opt)
        with self._deadline(f"restoring step {step}"):
            out = self.mngr.restore(step, args=ocp.args.Composite(**items))
        return out.params, (out.opt if abstract_opt is not None else None)

    def wait(self) -> None:
        with self._deadline(f"finishing the save of step {self._saving}"):
            self.mngr.wait_until_finished()
        self._saved = self._saving if self._saving is not None else self._saved

    def close(self) -> None:
        self.wait()
        self.mngr.close()
        if self._watch is not None:
            self._watch.stop()

    # --- preemption -----------------------------------------------------------------------------

    def watch_preemption(self, distributed: bool) -> None:
        """Multi-process: JAX's coordination service owns SIGTERM and agrees on a sync step.
        Single process: no such service, so catch SIGTERM here and stop after the current step."""
        self._distributed = distributed
        if not distributed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm) or signal.SIG_DFL

    def _on_sigterm(self, signum, frame) -> None:
        self._signalled = True

    def preempted(self, step: int) -> bool:
        """Call once per step on every process: True when this step is the one to save and stop at."""
        if self._distributed:
            return self.mngr.reached_preemption(step)
        return self._signalled

    def watch_interrupt(self) -> None:
        """Single process, from the first step on: Ctrl-C stops after the current step and saves it; a second
        Ctrl-C interrupts at once. Multi-process runs leave SIGINT alone: a save only one process asked for
        would wait for the others forever (`tpuctl run` stops its hosts with SIGTERM, a coordinated notice)."""
        from trainer.common import process
        if process.take_early_interrupt():  # a Ctrl-C whose KeyboardInterrupt a library dropped: nothing to save
            raise KeyboardInterrupt
        if not self._distributed and threading.current_thread() is threading.main_thread():
            self._previous_int = signal.signal(signal.SIGINT, self._on_sigint) or signal.default_int_handler

    def _on_sigint(self, signum, frame) -> None:
        self._interrupted = True
        signal.signal(signal.SIGINT, self._previous_int)
        print("\nCtrl-C: saving after this step (Ctrl-C again to stop without saving)", file=sys.stderr, flush=True)

    @property
    def interrupted(self) -> bool:
        """Ctrl-C was pressed (single process only): save this step and stop."""
        return self._interrupted

    def unwatch(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._previous_int is not None:
            signal.signal(signal.SIGINT, self._previous_int)
            self._previous_int = None


def write_config(directory: str, cfg: Config) -> None:
    """config.json beside the steps, for people and tools (the steps carry their own copy in `meta`)."""
    (epath.Path(directory) / "config.json").write_text(cfg.to_json() + "\n")


def read_json(path: str) -> dict:
    return json.loads(epath.Path(path).read_text())
