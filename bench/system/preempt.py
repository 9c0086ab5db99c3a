"""A spot run through real preemptions on a local slice, driven as a user drives it (`tpuctl up/run/down`
subprocesses): the TPU API stand-in preempts the node at chosen steps, the hosts die with their "VMs", `run`
recreates the slice and the trainer resumes from gs:// (the GCS emulator). Used by the preemption e2e test and
by `make bench` (steps redone, time to recover, goodput, for one and two preemptions).

    python -m bench.system.preempt        # one and two preemptions of a 2-host gpt2-tiny-sized run
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET = "preempt-e2e"
STEPS = 60
ARGS = ["pretrain", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32", "--batch-size", "8",
        "--dropout", "0.1", "--warmup-steps", "2", "--decay-steps", "50", "--lr", "1e-2", "--seed", "7",
        "--mesh", "data=4,model=2", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--steps", str(STEPS), "--ckpt-every", "10", "--data", f"gs://{BUCKET}/data"]


class LocalSpot:
    """A local TPU API stand-in + GCS emulator + a local slice NAME (default a 2-host v4-16; num_slices > 1: a
    multislice one) in a TPUCTL_HOME of its own."""

    def __init__(self, home: Path, name: str = "pre", accelerator: str = "v4-16", num_slices: int = 1):
        self.home, self.name = Path(home), name
        self.up_args = ["-a", accelerator] + (["--num-slices", str(num_slices)] if num_slices > 1 else [])
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("TPUCTL_", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_")) and k != "XLA_FLAGS"}
        self.env.update(TPUCTL_HOME=str(self.home), TPUCTL_POLL_S="0.05", CLOUDSDK_CONFIG=str(self.home / "gcloud"),
                        TPUCTL_SSH_KEY=os.environ.get("TPUCTL_SSH_KEY") or str(self.home / "ssh" / "key"))
        self.tpuctl = [sys.executable, "-m", "orchestrator.cli"]
        self.api: dict | None = None

    def __enter__(self) -> "LocalSpot":
        from infra import gcs
        self.emu = gcs.start(home=self.home, buckets=(BUCKET,), record=True)
        prep = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--out", f"gs://{BUCKET}/data"],
                              env={**self.env, **self.emu.env}, capture_output=True, text=True, timeout=300)
        assert prep.returncode == 0, prep.stderr[-2000:]
        up = self.cli("up", self.name, "--local", *self.up_args)
        assert up.returncode == 0, up.stderr
        self.api = json.loads((self.home / "local" / "fake_tpu_api.json").read_text())
        return self

    def __exit__(self, *exc) -> None:
        from infra import gcs
        from infra.fake_login_apis import FakeLoginControl
        self.cli("down", self.name, "--local", "--force")
        for stem in ("fake_login_apis", "fake_secret_manager"):  # managed jobs' stand-ins, if a test started them
            try:
                info = json.loads((self.home / "local" / f"{stem}.json").read_text())
            except (OSError, ValueError):
                continue
            if stem == "fake_login_apis":  # the controller's host ends with it
                try:
                    FakeLoginControl(info["url"], timeout=60).reset()
                except (RuntimeError, OSError):
                    pass
            try:
                os.kill(info["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        gcs.stop(self.home)
        if self.api:
            os.kill(self.api["pid"], signal.SIGKILL)
            try:
                os.waitpid(self.api["pid"], 0)
            except ChildProcessError:
                pass

    def cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([*self.tpuctl, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def run(self, ckpt: str, preempt_at: tuple[int, ...] = (), *, args: list[str] = ARGS, node: str | None = None,
            log: str = "w0.log", steps: int = STEPS) -> tuple[int, dict | None, str]:
        """`tpuctl run --json` of args into ckpt, preempting the node (default: the slice's; a multislice one's:
        NAME-i) when attempt k's `log` reaches step preempt_at[k]. Returns (exit code, the JSON result, stderr)."""
        from infra.fake_tpu_api import FakeControl
        before = set((self.home / "runs" / self.name).glob("*"))
        p = subprocess.Popen([*self.tpuctl, "run", self.name, "--local", "--json", "--", *args, "--ckpt-dir", ckpt],
                             env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        node = node or json.loads(self.cli("status", self.name, "--local", "--json").stdout)["node"]
        for k, at in enumerate(preempt_at):
            deadline = time.time() + 600
            while True:
                runs = sorted(set((self.home / "runs" / self.name).glob("*")) - before)
                text = (runs[k] / log).read_text(errors="replace") if len(runs) > k and \
                    (runs[k] / log).exists() else ""
                if re.search(rf"step +{at}/{steps}", text):
                    break
                if p.poll() is not None or time.time() > deadline:
                    out, err = p.communicate()
                    raise AssertionError(f"attempt {k + 1} never reached step {at}:\n{err[-3000:]}")
                time.sleep(0.05)
            FakeControl(self.api["url"]).preempt(node)
        out, err = p.communicate(timeout=900)
        return p.returncode, (json.loads(out) if out.strip() else None), err


    def wait_step(self, ckpt: str, step: int, timeout: float = 900) -> None:
        """Until process 0's log on its host (the run's own log, under the host's home) of the run into ckpt
        shows `step N/`: a trigger that needs no tpuctl on this machine."""
        deadline = time.time() + timeout
        logs = self.home / "local" / "slices" / self.name / "w0" / "home" / ".tpuctl-host" / "logs"
        while True:
            for log in logs.glob("*.log"):
                text = log.read_text(errors="replace")
                if f'"ckpt_dir":"{ckpt}"' in text and re.search(rf"step +{step}/", text):
                    return
            assert time.time() < deadline, f"process 0 never reached step {step}"
            time.sleep(0.05)

    def managed(self, ckpt: str, preempt_at: int | None = None, idle_min: float = 1.0) -> dict:
        """A managed job (`run --detach`) of ARGS into ckpt, the node preempted once at preempt_at; returns the
        job's final record with submit_s (until the controller took it) and wall_s (submit to its end)."""
        from infra.fake_tpu_api import FakeControl
        node = json.loads(self.cli("status", self.name, "--local", "--json").stdout)["node"]
        t0 = time.time()
        sub = self.cli("run", self.name, "--detach", "--json", "--controller-idle", str(idle_min), "--", *ARGS,
                       "--ckpt-dir", ckpt)
        assert sub.returncode == 0, sub.stderr[-3000:]
        submit_s, job_id = time.time() - t0, json.loads(sub.stdout)["id"]
        if preempt_at is not None:
            self.wait_step(ckpt, preempt_at)
            FakeControl(self.api["url"]).preempt(node)
        while True:
            r = self.cli("jobs", "--local", "--json", "--bucket", BUCKET)
            (job,) = [j for j in json.loads(r.stdout) if j["id"] == job_id]
            if job["state"] not in ("PENDING", "STARTING", "RUNNING", "RECOVERING"):
                return {**job, "submit_s": submit_s, "wall_s": time.time() - t0}
            time.sleep(1)


def main() -> int:
    print("[preempt] 2-host local run, gpt2-tiny-sized, 60 steps, checkpoint every 10 steps, gs:// (emulator)")
    with tempfile.TemporaryDirectory(prefix="tpuctl-bench-preempt-") as d, LocalSpot(Path(d) / "home") as spot:
        attached: dict[int, float] = {}
        for n, at in ((0, ()), (1, (25,)), (2, (25, 45))):
            rc, res, err = spot.run(f"gs://{BUCKET}/bench{n}", at)
            if rc != 0 or res is None:
                print(f"  {n} preemption(s): run failed (exit {rc}): {err[-500:]}")
                continue
            g = res["goodput"]
            rec = " ".join(f"{a['recover_s']:.1f}s" for a in res["attempts"][1:]) or "-"
            starts = " ".join(f"{a['startup_s']:.1f}s" for a in res["attempts"][1:]) or "-"
            print(f"  {n} preemption(s) at {list(at) or '-'}: steps redone {res['steps_redone']}, recreate {rec}, "
                  f"restart (push + restore + compile + first step) {starts}, wall {g['wall_s']:.1f}s, "
                  f"goodput {g['goodput']:.1%}")
            attached[n] = g["wall_s"]
        # The same job handed to the controller (its VM created by the first): what supervising from a VM of its
        # own costs against a terminal, side by side in this run.
        for n, at in ((0, None), (1, 25)):
            job = spot.managed(f"gs://{BUCKET}/managed{n}", at)
            line = (f"  managed, {n} preemption(s): {job['state']}, submit {job['submit_s']:.1f}s (until the "
                    f"controller took it{', its VM created' if n == 0 else ''}), submit to end {job['wall_s']:.1f}s")
            if n in attached:
                line += f" = {job['wall_s'] / attached[n]:.2f}x the attached run's wall"
            print(line + (f", goodput {job['goodput']['goodput']:.1%}" if job.get("goodput") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
