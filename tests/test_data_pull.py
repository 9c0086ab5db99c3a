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

import numpy as np
import pytest

from _trainer_util import REPO
from infra import gcs
from infra.fake_kaggle import FakeKaggle
from orchestrator import datasets as D, weights as W
from orchestrator.spec import UserError

KEY = "k-secret-d47a"  # must never show up in any output
OWT = "tiny/owt-gpt2"


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
