"""`tpuctl data pull`: the real kagglehub downloads a dataset from the Kaggle stand-in (GetDataset for the
current version, DownloadDataset for the zip of the version or one file), the real google-cloud-storage stages it
in the GCS emulator with the manifest last, exactly as `weights pull` does (the same staging code)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _trainer_util import REPO, TINY, env as trainer_env, losses, session_cache
from infra import gcs
from infra.fake_kaggle import FakeKaggle
from orchestrator.artifacts import datasets as D
from orchestrator.artifacts import weights as W
from orchestrator.spec import UserError

KEY = "k-secret-d47a"  # must never show up in any output
OWT = "tiny/owt-gpt2"
BIG = "tiny/owt-big"  # 1M train tokens (2 MB): what the trainer reads from gs:// in place


def nanogpt_files(folder, n_train: int = 40_000, n_val: int = 4_000, seed: int = 0) -> dict[str, bytes]:
    """A nanoGPT-layout dataset (raw uint16 GPT-2 token ids, no meta.json) of documents ending in EOT."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, n in (("train.bin", n_train), ("val.bin", n_val)):
        toks = rng.integers(0, 50256, n, dtype=np.uint16)
        toks[rng.random(n) < 0.003] = 50256
        out[name] = toks.tobytes()
        (folder / name).write_bytes(out[name])
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("kaggle")
    v1, v2 = root / "datasets" / OWT / "1", root / "datasets" / OWT / "2"
    v1.mkdir(parents=True)
    v2.mkdir(parents=True)
    nanogpt_files(v1, seed=1)
    files = nanogpt_files(v2, seed=2)
    (v2 / "README.md").write_text("nanoGPT's prepare.py on OpenWebText, shrunk\n")
    big = root / "datasets" / BIG / "1"
    big.mkdir(parents=True)
    nanogpt_files(big, n_train=1 << 20, n_val=20_000, seed=3)
    fake = FakeKaggle(root, {"alice": KEY})
    url = fake.start()
    emu = gcs.start(home=tmp_path_factory.mktemp("home"), buckets=("datasets",), record=False, reuse=False)
    mp = pytest.MonkeyPatch()
    for k, v in emu.env.items():
        mp.setenv(k, v)
    mp.setenv("KAGGLE_USERNAME", "alice")
    mp.setenv("KAGGLE_KEY", KEY)
    mp.setenv("KAGGLE_CONFIG_DIR", str(tmp_path_factory.mktemp("no-kaggle-json")))
    mp.setenv("KAGGLEHUB_CACHE", str(tmp_path_factory.mktemp("kagglehub")))
    yield dict(fake=fake, url=url, emu=emu, files=files)
    mp.undo()
    fake.stop()
    emu.stop()


def _pull(world, handle, dest, **kw):
    lines = []
    res = D.pull(handle, dest, endpoint=world["url"], say=lines.append, progress=False, **kw)
    return res, lines


def _objects(dest: str) -> dict[str, bytes]:
    b = W.Bucket(dest)
    return {bl.name[len(b.prefix) + 1:]: bl.download_as_bytes() for bl in b.client.list_blobs(b.bucket_name,
                                                                                              prefix=b.prefix + "/")}


def test_pull_the_current_version_as_a_zip_then_again_then_single_files(world):
    fake = world["fake"]
    res, lines = _pull(world, OWT, "gs://datasets/owt")
    assert lines[0] == f"resolved {OWT} to version 2: {OWT}/versions/2"
    assert lines[-1] == f"staged {OWT}/versions/2 at gs://datasets/owt; train on it with --data gs://datasets/owt"
    assert res.files == 3 and sorted(res.uploaded) == ["README.md", "train.bin", "val.bin"]
    got = _objects("gs://datasets/owt")
    assert got["train.bin"] == world["files"]["train.bin"] and got["val.bin"] == world["files"]["val.bin"]
    manifest = json.loads(got[W.MANIFEST])
    assert manifest["handle"] == f"{OWT}/versions/2" and {e["path"] for e in manifest["files"]} == \
        {"README.md", "train.bin", "val.bin"}
    assert "GetDataset" in fake.calls and any(c.startswith("GET /archives/datasets/") and c.endswith("/2.zip")
                                              for c in fake.calls)

    gets = sum(c.startswith("GET ") for c in fake.calls)
    res, lines = _pull(world, OWT + "/versions/2", "gs://datasets/owt")
    assert res.already_staged and sum(c.startswith("GET ") for c in fake.calls) == gets
    with pytest.raises(UserError, match=r"already holds tiny/owt-gpt2/versions/2; stage tiny/owt-gpt2/versions/1"):
        _pull(world, OWT + "/versions/1", "gs://datasets/owt")

    # Only the token files, one DownloadDataset with fileName each (no zip of the whole version).
    res, _ = _pull(world, OWT + "/versions/1", "gs://datasets/owt-v1", files=["train.bin", "val.bin"])
    assert sorted(res.uploaded) == ["train.bin", "val.bin"]
    assert f"GET /blobs/datasets/{OWT}/1/train.bin" in fake.calls and \
        not any(c.endswith("/1.zip") for c in fake.calls)
    assert set(_objects("gs://datasets/owt-v1")) == {"train.bin", "val.bin", W.MANIFEST}


def test_a_cut_download_is_one_line_then_resumes_and_bad_input_fails_before_any_call(world):
    fake = world["fake"]
    shutil.rmtree(os.environ["KAGGLEHUB_CACHE"], ignore_errors=True)  # make it download
    fake.inject("cut")
    with pytest.raises(UserError) as e:
        _pull(world, OWT + "/versions/1", "gs://datasets/cut", files=["train.bin"])
    assert re.match(r"^network failure talking to Kaggle \(http://127.0.0.1:\d+\): the connection was cut "
                    r"mid-file; run the same pull again", str(e.value)) and KEY not in str(e.value)
    fake.faults.clear()
    assert W.Bucket("gs://datasets/cut").manifest() is None
    res, _ = _pull(world, OWT + "/versions/1", "gs://datasets/cut", files=["train.bin"])
    assert res.uploaded == ["train.bin"] and W.Bucket("gs://datasets/cut").manifest()["version"] == 1
    with pytest.raises(UserError, match=r"^unknown handle tiny/nope \(Kaggle answered 404\): check "
                                        r"owner/dataset/versions/N on kaggle.com/datasets/tiny/nope$"):
        _pull(world, "tiny/nope", "gs://datasets/nope")
    calls = len(fake.calls)
    for handle, dest, files, message in [
            ("tiny/owt-gpt2/2", "gs://datasets/x", (), r"expected OWNER/DATASET\[/versions/N\]"),
            (OWT, "/tmp/x", (), r"--to /tmp/x: expected gs://BUCKET/PREFIX"),
            (OWT, "gs://datasets/x", ("../etc/passwd",), r"--file '../etc/passwd': expected a path inside"),
            (OWT, "gs://nosuch-bucket/x", (), r"bucket nosuch-bucket does not exist")]:
        with pytest.raises(UserError, match=message):
            _pull(world, handle, dest, files=files)
    assert len(fake.calls) == calls


def test_cli_data_pull_json_never_prints_the_key(world):
    """The click layer is weights pull's (cli_weights.run_pull), whose one-line errors test_weights_pull checks."""
    env = {**os.environ, "TPUCTL_KAGGLE_ENDPOINT": world["url"], "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "orchestrator.cli", "data", "pull", OWT, "--to", "gs://datasets/cli",
           "--file", "val.bin", "--json"]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["handle"] == f"{OWT}/versions/2" and out["uploaded"] == ["val.bin"]
    assert "upload: 100%" in p.stderr and KEY not in p.stdout + p.stderr


def _du(*folders) -> int:
    return sum(f.stat().st_size for d in folders for f in Path(d).rglob("*") if f.is_file())


@pytest.mark.slow
def test_a_pulled_nanogpt_dataset_trains_in_place_from_gs_and_a_bucket_outage_stops_it(world, tmp_path_factory,
                                                                                      tmp_path):
    """The seed's path: `tpuctl data pull` of a nanoGPT-layout dataset, then `pretrain --data gs://...` as it is.
    Two runs of the same command reach the same losses; neither leaves as much as 20% of the dataset's bytes in
    its home, temp or cache folders (the XLA compilation cache, not data, lives elsewhere here). Meanwhile the
    data's bucket dies under a third run: one line naming it, exit 3, within the storage budget of 60 s."""
    import signal
    import time
    res, _ = _pull(world, BIG, "gs://datasets/owt-big")
    assert res.bytes > 2 << 20
    cache = session_cache(tmp_path_factory)
    args = ["pretrain", *TINY, "--data", "gs://datasets/owt-big", "--log-every", "1", "--eval-batches", "2"]

    def start(i: int, emu_env: dict, *more: str) -> tuple[subprocess.Popen, dict]:
        dirs = {k: tmp_path / f"run{i}" / k for k in ("home", "tmp", "cache")}
        for d in dirs.values():
            d.mkdir(parents=True)
        e = trainer_env(str(dirs["cache"]), **emu_env, HOME=str(dirs["home"]), TMPDIR=str(dirs["tmp"]),
                        JAX_COMPILATION_CACHE_DIR=str(Path(cache) / "jax"), PYTHONPATH=str(REPO))
        log = open(tmp_path / f"run{i}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--ckpt-dir", str(tmp_path / f"ckpt{i}"),
                              *more], env=e, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return p, dirs

    def finished(i: int, p: subprocess.Popen, dirs: dict) -> dict[int, float]:
        assert p.wait(timeout=600) == 0, (tmp_path / f"run{i}.log").read_text()[-3000:]
        left = _du(*dirs.values())
        assert left < 0.2 * res.bytes, (left, res.bytes, [str(f) for d in dirs.values() for f in d.rglob("*")][:20])
        return losses(tmp_path / f"ckpt{i}")

    # The outage's bucket: an emulator of its own holding the same dataset.
    emu = gcs.start(home=tmp_path / "emu2", buckets=("datasets",), record=False, reuse=False)
    procs = []
    try:
        from google.cloud import storage
        bucket = storage.Client(client_options={"api_endpoint": emu.endpoint}).bucket("datasets")
        for name in ("train.bin", "val.bin"):
            bucket.blob(f"owt-big/{name}").upload_from_string(W.Bucket("gs://datasets/owt-big").blob(name)
                                                              .download_as_bytes())
        p1, d1 = start(1, world["emu"].env, "--steps", "6")
        procs.append(p1)
        first = finished(1, p1, d1)  # alone: it fills the compilation cache the next two share
        p2, d2 = start(2, world["emu"].env, "--steps", "6")
        p3, _ = start(3, emu.env, "--steps", "100000", "--eval-every", "0")
        procs += [p2, p3]
        log3 = tmp_path / "run3.log"
        deadline = time.time() + 300
        while not re.search(r"step +2/", log3.read_text()):
            assert p3.poll() is None and time.time() < deadline, log3.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(emu.pid, signal.SIGKILL)
        gone = time.monotonic()
        rc = p3.wait(timeout=120)
        # within the storage budget (60 s) of the bucket going away: a data read with no answer for half of it
        # stops the run (token_files.py), so the other 30 s are room for a loaded machine's late wakeups
        took = time.monotonic() - gone
        second = finished(2, p2, d2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        emu.stop()
    assert sorted(first) == list(range(1, 7)) and first == second
    out = log3.read_text()
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert rc == 3 and len(errors) == 1 and took < 60, (rc, took, out[-3000:])
    assert errors[0].startswith("error: the bucket gs://datasets ") and "while reading train windows from " \
        "gs://datasets/owt-big" in errors[0] and errors[0].endswith("once the bucket answers again"), errors
