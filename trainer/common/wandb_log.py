"""Optional Weights & Biases logging (`--wandb PROJECT`): the records of metrics.jsonl, from process 0 only.

The key is never a flag: wandb reads WANDB_API_KEY from the environment, which `tpuctl run --secret-env
WANDB_API_KEY` fills on the hosts through stdin (masked in the logs). WANDB_MODE=offline needs no key and no
network. The run's local files (wandb's `wandb/offline-run-*` dirs, what `wandb sync` uploads later) live with
the run: `<ckpt-dir>/wandb/`; for a gs:// --ckpt-dir they are written to a private temp folder and copied there
when training ends (a killed process loses them; online, the records have streamed to W&B already).
The W&B run id is kept in `<ckpt-dir>/wandb/run_id`, so a resumed run continues the same W&B run.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from etils import epath

from trainer.common.config import Config, UsageError

INSTALL = "pip install 'tpuctl[wandb]'"


def check(project: str) -> None:
    """Before anything is allocated, on every process (the same environment everywhere): the package and
    either a key or offline mode. wandb would otherwise ask for a login on a host that has no terminal."""
    if not project:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UsageError(f"--wandb {project}: the wandb package is not installed ({INSTALL})") from None
    mode = os.environ.get("WANDB_MODE", "")
    if mode not in ("offline", "disabled", "dryrun") and not os.environ.get("WANDB_API_KEY"):
        raise UsageError(f"--wandb {project}: WANDB_API_KEY is not set; pass it with `tpuctl run NAME "
                         "--secret-env WANDB_API_KEY -- ...` (never as a flag), or set WANDB_MODE=offline")


class WandbLog:
    """wandb.init on process 0 (enabled); every other process does nothing, not even import wandb."""

    def __init__(self, cfg: Config, enabled: bool):
        self.run = self._staging = None
        project, ckpt_dir = cfg.train.wandb, cfg.train.ckpt_dir
        if not (enabled and project):
            return
        import wandb
        self.remote_dir = epath.Path(ckpt_dir) / "wandb"
        self._staging = tempfile.mkdtemp(prefix="tpuctl-wandb-") if "://" in ckpt_dir else None
        id_file = self.remote_dir / "run_id"
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]
            self.remote_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        # wandb writes into <dir>/wandb/: the ckpt dir itself, or the staging folder copied to <ckpt-dir>/wandb/.
        self.run = wandb.init(project=project, id=run_id, resume="allow", dir=self._staging or ckpt_dir,
                              name=ckpt_dir.rstrip("/").rsplit("/", 1)[-1], config=cfg.to_dict(),
                              settings=wandb.Settings(console="off", disable_git=True, save_code=False,
                                                      silent=True))

    def log(self, rec: dict) -> None:
        if self.run is None:
            return
        self.run.log({f"train/{k}": v for k, v in rec.items()
                      if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}, step=rec["step"])

    def close(self) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish()
            if self._staging:
                _settled(Path(self._staging, "wandb"))
                for f in sorted(Path(self._staging, "wandb").rglob("*")):
                    if f.is_file() and not f.is_symlink():
                        dest = self.remote_dir / f.relative_to(Path(self._staging, "wandb")).as_posix()
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        dest.write_bytes(f.read_bytes())
        finally:
            if self._staging:
                shutil.rmtree(self._staging, ignore_errors=True)


def _settled(folder: Path, quiet_s: float = 1.0, limit_s: float = 20.0) -> None:
    """Wait until no file under `folder` has changed for quiet_s (at most limit_s): wandb's service process may
    still be writing the run's .wandb log after finish() returns, and a copy taken then holds no history."""
    import time

    def sizes() -> dict:
        return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for f in folder.rglob("*") if f.is_file()}
    deadline, last, since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < deadline:
        now = sizes()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)
