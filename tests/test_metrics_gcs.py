"""A run's metrics live with the run: with --ckpt-dir gs://... (the GCS emulator) the TensorBoard events and
metrics.jsonl land under that prefix, TensorBoard's own reader reads them from gs://, and the folder the run
was started from stays empty."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _trainer_util import TINY, env, session_cache, shakespeare
from infra import gcs

READ = r"""
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
tags = acc.Tags()["scalars"]
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags}))
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    e = gcs.start(home=tmp_path_factory.mktemp("home"), buckets=("runs",), record=False)
    yield e
    e.stop()


def test_a_gs_run_keeps_events_and_metrics_under_its_prefix_and_nothing_in_cwd(emu, tmp_path_factory, tmp_path):
    corpus = shakespeare(tmp_path_factory)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    e = env(session_cache(tmp_path_factory), devices=2, **emu.env)
    p = subprocess.run([sys.executable, "-m", "trainer", "pretrain", "--data", corpus, *TINY, "--steps", "4",
                        "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0",
                        "--ckpt-dir", "gs://runs/tb"], cwd=cwd, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "(ppl " in p.stdout  # perplexity beside the validation loss (evaluated at the last step)
    assert list(cwd.iterdir()) == []

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    client = storage.Client(project="local", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emu.endpoint})
    names = [b.name for b in client.list_blobs("runs", prefix="tb/")]
    events = [n for n in names if n.startswith("tb/tensorboard/events.out.tfevents.")]
    assert len(events) == 1, names
    lines = client.bucket("runs").blob("tb/metrics.jsonl").download_as_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2, 3, 4]

    # TensorBoard's reader, pointed at gs:// as `tensorboard --logdir gs://runs/tb/tensorboard` would be.
    r = subprocess.run([sys.executable, "-c", READ, "gs://runs/tb/tensorboard"], env=e, capture_output=True,
                       text=True, timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    scalars = json.loads(r.stdout.strip().splitlines()[-1])
    want = {json.loads(ln)["step"]: json.loads(ln)["loss"] for ln in lines}
    assert {s: pytest.approx(v, rel=1e-6) for s, v in want.items()} == {s: v for s, v in scalars["train/loss"]}
    assert [s for s, _ in scalars["train/val_loss"]] == [4]
    assert list(cwd.iterdir()) == []
