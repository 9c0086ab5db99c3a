"""`tpuctl weights pull`: the real kagglehub downloads from the Kaggle stand-in, the real google-cloud-storage
stages into the GCS emulator, and the trainer loads from gs://. Injected Kaggle errors give one line each and
never leave a prefix the trainer would take for a finished model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import _gemma_ckpt as gc
from _trainer_util import REPO
from infra import gcs
from infra.fake_kaggle import FakeKaggle
from orchestrator.artifacts import weights as W
from orchestrator.spec import UserError
from trainer.models import gemma

KEY = "k-secret-5f2e"  # must never show up in any output
MODELS = {(fam, layout): f"google/{fam.replace('gemma', 'gemma-')}/{layout}/tiny"
          for fam in ("gemma2", "gemma3") for layout in ("flax", "transformers")}
GEMMA4 = "google/gemma-4/flax/tiny"  # the E sizes' kind (kv sharing, per-layer embeddings), nested as Gemma 4 ships


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Kaggle stand-in serving tiny Gemma 2/3 in both layouts (licences accepted by alice only), the GCS
    emulator with bucket `models`, and this process pointed at both."""
    root = tmp_path_factory.mktemp("kaggle")
    params = {}
    for (fam, layout), handle in MODELS.items():
        cfg = gc.TINY[fam]
        flat = gemma.random_params(cfg, seed=11)
        params[fam] = flat
        vdir = root / handle / "1"
        if layout == "flax":
            gc.write_flax(str(vdir), cfg, flat)
            gc.write_tokenizer(str(vdir / "tokenizer.model"), cfg.vocab)
        else:
            gc.write_hf(str(vdir), cfg, flat)
    cfg4 = gc.TINY4["e"]
    params["gemma4"] = gemma.random_params(cfg4, seed=11)
    gc.write_flax(str(root / GEMMA4 / "1"), cfg4, params["gemma4"])
    gc.write_tokenizer(str(root / GEMMA4 / "1" / "tokenizer.model"), cfg4.vocab)
    fake = FakeKaggle(root, {"alice": KEY, "bob": "bob-key"},
                      {"google/gemma-2": {"alice"}, "google/gemma-3": {"alice"}, "google/gemma-4": {"alice"}})
    url = fake.start()
    emu = gcs.start(home=tmp_path_factory.mktemp("home"), buckets=("models",))
    mp = pytest.MonkeyPatch()
    for k, v in emu.env.items():
        mp.setenv(k, v)
    mp.setenv("KAGGLE_USERNAME", "alice")
    mp.setenv("KAGGLE_KEY", KEY)
    mp.setenv("KAGGLE_CONFIG_DIR", str(tmp_path_factory.mktemp("no-kaggle-json")))
    mp.setenv("KAGGLEHUB_CACHE", str(tmp_path_factory.mktemp("kagglehub")))
    yield dict(fake=fake, url=url, emu=emu, root=root, params=params)
    mp.undo()
    fake.stop()
    emu.stop()


def _pull(world, handle, dest, **kw):
    lines = []
    res = W.pull(handle, dest, endpoint=world["url"], say=lines.append, progress=False, **kw)
    return res, lines


def _blob_gets(fake) -> int:
    return sum(1 for c in fake.calls if c.startswith("GET "))


def _load_in_child(world, paths: dict) -> dict:
    """Each gs:// path through trainer.gemma.weights.load on a 4x2 mesh in a child process (the GCS clients read
    the emulator variables at import): {key: params checksum} or {key: 'error: ...'}."""
    script = r"""
import json, sys
import jax, numpy as np
from trainer.gemma import weights
from trainer.common import mesh as M
from trainer.common.config import UsageError
mesh = M.make_mesh({"data": 4, "model": 2})
out = {}
for key, path in json.loads(sys.argv[1]).items():
    try:
        ck, p = weights.load(path, mesh)
        out[key] = {"family": ck.cfg.family, "layout": ck.layout,
                    "sum": {k: float(np.asarray(v, np.float64).sum()) for k, v in p.items()}}
    except UsageError as e:
        out[key] = "error: " + str(e)
print(json.dumps(out))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", script, json.dumps(paths)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_GEMMA4_FLOW = r"""
import json, shutil, sys
from trainer.cli import main
weights_path, data, tmp = sys.argv[1:]
common = ["--model", "gemma4", "--weights", weights_path, "--data", data, "--seq-len", "48", "--batch-size", "4",
          "--mesh", "data=4,model=2", "--targets", "attn,mlp", "--dropout", "0.1", "--lr", "1e-2", "--log-every", "1",
          "--dtype", "float32", "--base-dtype", "float32", "--val-fraction", "0"]
losses = lambda: [json.loads(ln)["loss"] for ln in open(tmp + "/run/metrics.jsonl")]  # noqa: E731
assert main(["lora", *common, "--ckpt-dir", tmp + "/run", "--steps", "2", "--ckpt-every", "1"]) == 0
straight = losses()
shutil.rmtree(tmp + "/run/2")  # as if it had stopped after saving step 1
assert main(["lora", *common, "--ckpt-dir", tmp + "/run", "--steps", "2", "--ckpt-every", "1"]) == 0  # from step 1
print(json.dumps({"straight": straight, "resumed": losses()}))
assert main(["export", "--weights", weights_path, "--adapters", tmp + "/run", "--out", tmp + "/merged", "--merge"]) == 0
assert main(["sample", "--weights", tmp + "/merged", "--prompt", "To be", "--max-new-tokens", "4", "--temperature", "0",
             "--mesh", "data=4,model=2"]) == 0
"""


@pytest.mark.slow
def test_gemma4_from_kaggle_to_adapters_a_merged_export_and_a_sample(world, tmp_path):
    """The local flow on a tiny Gemma 4: pull from the Kaggle stand-in into the GCS emulator, LoRA from gs://
    (its last checkpoint removed and the run resumed: the same step again, to the same loss), the adapters
    saved, a merged export (in the layout the base came in; that a merge is base + adapters: tests/test_lora.py),
    a sample from it. One process for the trainer verbs: the step compiles once."""
    res, _ = _pull(world, GEMMA4, "gs://models/gemma4")
    assert res.files > 2 and not res.already_staged
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}?", "response": "to be or not to be"[: 6 + i]}) + "\n"
                            for i in range(12)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", _GEMMA4_FLOW, "gs://models/gemma4", str(data), str(tmp_path)], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith('{"straight"')))
    assert len(got["straight"]) == 2 and got["resumed"] == pytest.approx(got["straight"], abs=1e-6), got
    assert sorted(os.listdir(tmp_path / "run" / "2")) == ["_CHECKPOINT_METADATA", "commit_success.txt", "meta",
                                                            "opt", "params"]  # adapters only, no base
    assert os.path.isdir(tmp_path / "merged" / "tiny") and os.path.isfile(tmp_path / "merged" / "tokenizer.model")
    assert "exported merged flax" in p.stdout + p.stderr
    assert "tokens in" in p.stderr and "gemma4 10 layers" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_pull_both_families_both_layouts_then_load_from_gs_and_pull_again(world):
    fake = world["fake"]
    dests = {}
    for (fam, layout), handle in MODELS.items():
        dest = f"gs://models/{fam}-{layout}"
        res, lines = _pull(world, handle, dest)
        assert lines[0] == f"resolved {handle} to version 1: {handle}/1"
        assert res.version == 1 and not res.already_staged and len(res.uploaded) == res.files > 2
        dests[f"{fam}/{layout}"] = dest
    loaded = _load_in_child(world, dests)
    for (fam, layout) in MODELS:
        got = loaded[f"{fam}/{layout}"]
        assert isinstance(got, dict), got
        assert got["family"] == fam and got["layout"] == layout
        want = {k: float(np.asarray(v, np.float64).sum()) for k, v in world["params"][fam].items()}
        assert got["sum"] == pytest.approx(want, rel=1e-6)

    # The sampler end to end from gs:// (the tokenizer.model is read from the bucket too).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "trainer", "sample", "--weights", dests["gemma2/flax"], "--prompt",
                        "To be", "--chat", "--max-new-tokens", "4", "--temperature", "0", "--mesh", "data=4,model=2"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "gemma2 4 layers" in p.stderr, p.stderr[-2000:]

    gets = _blob_gets(fake)
    res, lines = _pull(world, MODELS["gemma2", "flax"], dests["gemma2/flax"])
    assert res.already_staged and res.uploaded == [] and _blob_gets(fake) == gets
    assert lines[-1] == f"{MODELS['gemma2', 'flax']}/1 is already staged at gs://models/gemma2-flax ({res.files} files); nothing copied"
    res, _ = _pull(world, MODELS["gemma3", "transformers"] + "/1", dests["gemma3/transformers"])
    assert res.already_staged and _blob_gets(fake) == gets
    with pytest.raises(UserError, match=r"already holds google/gemma-2/flax/tiny/1; stage google/gemma-3"):
        _pull(world, MODELS["gemma3", "flax"] + "/1", dests["gemma2/flax"])


@pytest.mark.parametrize("fault, message", [
    ("401", r"^Kaggle rejected the credentials from the environment \(401\): check KAGGLE_USERNAME"),
    ("403", r"^licence not accepted: accept the Gemma licence at kaggle.com/models/google/gemma-2, then retry"),
    ("404", r"^unknown handle google/gemma-2/flax/tiny/1 \(Kaggle answered 404\)"),
    ("cut", r"^network failure talking to Kaggle \(http://127.0.0.1:\d+\): the connection was cut mid-file; "
            r"run the same pull again"),
])
def test_each_kaggle_error_is_one_line_and_leaves_no_finished_looking_model(world, fault, message, tmp_path):
    import re
    dest = f"gs://models/fault-{fault}"
    shutil.rmtree(os.environ["KAGGLEHUB_CACHE"], ignore_errors=True)  # make it download
    world["fake"].inject(fault)
    with pytest.raises(UserError) as e:
        _pull(world, MODELS["gemma2", "flax"] + "/1", dest)
    assert re.match(message, str(e.value)) and "\n" not in str(e.value) and KEY not in str(e.value)
    world["fake"].faults.clear()
    assert W.Bucket(dest).manifest() is None
    # Retrying resumes and finishes (a cut file resumes inside kagglehub's cache).
    res, _ = _pull(world, MODELS["gemma2", "flax"] + "/1", dest)
    assert not res.already_staged and W.Bucket(dest).manifest()["version"] == 1


def test_licence_not_accepted_and_unknown_handle_from_the_service_itself(world, monkeypatch):
    monkeypatch.setenv("KAGGLE_USERNAME", "bob")
    monkeypatch.setenv("KAGGLE_KEY", "bob-key")
    with pytest.raises(UserError, match="^licence not accepted: accept the Gemma licence at "
                                        "kaggle.com/models/google/gemma-3, then retry"):
        _pull(world, MODELS["gemma3", "flax"], "gs://models/bob")
    with pytest.raises(UserError, match=r"^unknown handle google/gemma-9/flax/nope \(Kaggle answered 404\)"):
        _pull(world, "google/gemma-9/flax/nope", "gs://models/bob")


def test_no_credentials_and_bad_arguments_fail_before_any_download(world, monkeypatch):
    calls = len(world["fake"].calls)
    for var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(world["root"]))  # no ~/.kaggle/access_token either
    with pytest.raises(UserError, match=r"^no Kaggle credentials: set KAGGLE_USERNAME and KAGGLE_KEY, or put "
                                        r"kaggle.json"):
        _pull(world, MODELS["gemma2", "flax"], "gs://models/nocreds")
    with pytest.raises(UserError, match=r"expected OWNER/MODEL/FRAMEWORK/VARIATION\[/VERSION\]"):
        _pull(world, "google/gemma-2", "gs://models/x")
    with pytest.raises(UserError, match=r"--to /tmp/x: expected gs://BUCKET/PREFIX"):
        _pull(world, MODELS["gemma2", "flax"], "/tmp/x")
    with pytest.raises(UserError, match=r"bucket nosuch does not exist"):
        _pull(world, MODELS["gemma2", "flax"] + "/1", "gs://nosuch/x")
    assert len(world["fake"].calls) == calls


def test_an_upload_cut_short_is_refused_by_the_trainer_then_resumed(world, monkeypatch):
    dest = "gs://models/cut-upload"
    real = W.Bucket.upload
    done = []

    def upload_then_die(self, src, entry, on_bytes):
        if done:
            raise KeyboardInterrupt  # Ctrl-C in the middle of staging
        real(self, src, entry, on_bytes)
        done.append(entry["path"])

    monkeypatch.setattr(W.Bucket, "upload", upload_then_die)
    with pytest.raises(KeyboardInterrupt):
        _pull(world, MODELS["gemma2", "transformers"] + "/1", dest)
    monkeypatch.setattr(W.Bucket, "upload", real)
    got = _load_in_child(world, {"cut": dest})["cut"]
    assert got == (f"error: --weights {dest}: no tpuctl-manifest.json there, so the `tpuctl weights pull` that "
                   "staged it did not finish; run the same pull again (it resumes)")
    res, _ = _pull(world, MODELS["gemma2", "transformers"] + "/1", dest)
    assert done[0] not in res.uploaded and len(res.uploaded) == res.files - 1


def test_cli_pull_json_with_endpoint_from_env_never_prints_the_key(world):
    env = {**os.environ, "TPUCTL_KAGGLE_ENDPOINT": world["url"], "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "orchestrator.cli", "weights", "pull", MODELS["gemma3", "transformers"],
           "--to", "gs://models/cli", "--json"]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip(), p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["handle"] == MODELS["gemma3", "transformers"] + "/1" and out["version"] == 1
    assert "resolved google/gemma-3/transformers/tiny to version 1" in p.stderr
    assert "Downloading" in p.stderr and "upload: 100%" in p.stderr  # both progress bars, on stderr
    assert KEY not in p.stdout + p.stderr and KEY not in " ".join(cmd)
    env["KAGGLE_USERNAME"], env["KAGGLE_KEY"] = "bob", "bob-key"
    cmd[-2] = "gs://models/cli-bob"
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "Error: licence not accepted: accept the Gemma licence at kaggle.com/models/google/gemma-3, then retry "
        "(Kaggle answered 403 for google/gemma-3/transformers/tiny)"]
