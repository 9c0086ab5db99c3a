"""The GCS emulator: the real orbax CheckpointManager and google-cloud-storage against fake-gcs-server."""
import json
import os
import subprocess
import sys

import pytest

from infra import gcs


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    home = tmp_path_factory.mktemp("tpuctl-home")
    e = gcs.start(home=home, buckets=("ckpt",))
    yield e
    e.stop()
    assert not gcs._is_server(e.pid)


def test_emulator_env_names_every_client(emu):
    env = gcs.emulator_env(emu.endpoint + "/")
    assert env["STORAGE_EMULATOR_HOST"] == env["TENSORSTORE_GCS_HTTP_URL"] == emu.endpoint
    assert env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert env["FSSPEC_GCS_TOKEN"] == "anon" and env["NO_GCE_CHECK"] == "true"


def test_start_reuses_the_recorded_emulator(emu, tmp_path):
    home = os.path.dirname(os.path.dirname(emu.record))
    again = gcs.start(home=home, buckets=("ckpt", "other"))  # bucket creation is idempotent
    assert again.pid == emu.pid and again.endpoint == emu.endpoint
    assert gcs.running(home).pid == emu.pid
    assert gcs.running(tmp_path) is None  # another TPUCTL_HOME has none


def test_orbax_saves_and_restores_a_sharded_array_to_gs(emu, tmp_path):
    # A child process, so the emulator env is set before gcsfs/tensorstore/orbax are imported.
    script = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
sh = NamedSharding(mesh, P("data", "model"))
x = jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), sh)
mgr = ocp.CheckpointManager("gs://ckpt/x", options=ocp.CheckpointManagerOptions(max_to_keep=2))
mgr.save(3, args=ocp.args.StandardSave({"w": x}))
mgr.wait_until_finished()
mgr.close()
mgr = ocp.CheckpointManager("gs://ckpt/x")
abstract = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)}
back = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract))["w"]
print(json.dumps({"steps": list(mgr.all_steps()), "equal": bool(np.array_equal(np.asarray(back), np.asarray(x))),
                  "sharding": list(back.sharding.spec)}))
"""
    env = {**os.environ, **emu.env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"steps": [3], "equal": True, "sharding": ["data", "model"]}

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    client = storage.Client(project="local", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emu.endpoint})
    names = [b.name for b in client.list_blobs("ckpt", prefix="x/")]
    assert "x/3/commit_success.txt" in names, names
    assert len([n for n in names if n.startswith("x/3/")]) > 3, names  # metadata + array chunks


def test_prepare_to_a_missing_bucket_is_one_line(emu, tmp_path):
    env = {**os.environ, **emu.env}
    r = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--out", "gs://no-such-bucket-x/tok"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["error: --out gs://no-such-bucket-x/tok: cannot write to gs://no-such-bucket-x "
                                     "(the bucket does not exist); create it (`gcloud storage buckets create "
                                     "gs://no-such-bucket-x`) or pick a bucket you can write"], r.stderr


QUIET_PROBE = """
import sys
from trainer.common import process
if sys.argv[1] == "quiet":
    process.quiet_native_logs()  # what every trainer process does first
    assert "tensorstore" not in sys.modules, "a process that never uses tensorstore should not pay for its import"
import tensorstore as ts
kv = ts.KvStore.open({"driver": "gcs", "bucket": "tpuctl-nowhere",
                      "context": {"gcs_request_retries": {"max_retries": 1, "initial_delay": "10ms"}}}).result()
try:
    kv.read("x").result()
except Exception as e:  # noqa: BLE001 - nothing listens there: only the log line before the request matters
    print("read failed", type(e).__name__)
"""


def test_tensorstore_credentials_line_is_silenced_at_its_log_level():
    """tensorstore logs the credentials it picks at INFO on first use; the trainer lowers tensorstore's own
    absl level to WARNING when tensorstore is first imported (trainer/common/process.py). Without it the line is
    there: the check can fail."""
    env = dict(os.environ, GOOGLE_AUTH_TOKEN_FOR_TESTING="t", TENSORSTORE_GCS_HTTP_URL="http://127.0.0.1:1")
    out = {m: subprocess.run([sys.executable, "-c", QUIET_PROBE, m], env=env, capture_output=True, text=True,
                             timeout=120) for m in ("loud", "quiet")}
    for p in out.values():
        assert p.returncode == 0 and "read failed" in p.stdout, p.stderr[-2000:]
    assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" in out["loud"].stderr
    assert "google_auth_provider" not in out["quiet"].stderr, out["quiet"].stderr


def test_a_restart_over_the_same_folder_drops_what_a_killed_server_left_half_written(tmp_path, monkeypatch):
    """The stand-in writes an object to a temporary file and renames it into place (its metadata in an extended
    attribute); killed between the two, it leaves a file that makes every listing of that folder answer 404.
    GCS shows an object whole or not at all, so a restart over the folder drops the leftover and lists the rest."""
    import urllib.error
    import urllib.request
    data, home = tmp_path / "data", tmp_path / "home"
    emu = gcs.start(home=home, backend="filesystem", data_dir=str(data), buckets=("outage-b",), record=False,
                    reuse=False)
    try:
        req = urllib.request.Request(f"{emu.endpoint}/upload/storage/v1/b/outage-b/o?uploadType=media&"
                                     "name=run/7/manifest", data=b"whole", method="POST")
        urllib.request.urlopen(req).read()
    finally:
        os.kill(emu.pid, 9)
        emu.stop()
    folder = data / "outage-b" / "run" / "7"
    (folder / ".manifest1390746563").write_bytes(b"")  # what a SIGKILL mid-write leaves: no metadata attribute
    listing = "/storage/v1/b/outage-b/o?prefix=run/&delimiter=/"

    def restart_and_list():
        emu = gcs.start(home=home, backend="filesystem", data_dir=str(data), record=False, reuse=False)
        try:
            return json.loads(urllib.request.urlopen(emu.endpoint + listing).read())
        finally:
            emu.stop()
    with monkeypatch.context() as m:  # the stand-in as it is: the listing fails
        m.setattr(gcs, "_drop_unfinished_uploads", lambda data_dir: None)
        with pytest.raises(urllib.error.HTTPError, match="404"):
            restart_and_list()
    out = restart_and_list()
    assert out.get("prefixes") == ["run/7/"], out
    assert sorted(p.name for p in folder.iterdir()) == ["manifest"]


def test_a_bucket_the_stand_in_refuses_is_one_error_and_leaves_no_server(tmp_path):
    data = tmp_path / "refused-data"
    with pytest.raises(gcs.GcsError, match="could not create bucket 'b'.*invalid bucket name"):
        gcs.start(home=tmp_path / "home", backend="filesystem", data_dir=str(data), buckets=("b",), record=False,
                  reuse=False)
    left = subprocess.run(["pgrep", "-f", f"filesystem-root {data}"], capture_output=True, text=True).stdout
    assert left == "", left
