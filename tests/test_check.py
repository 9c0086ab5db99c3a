"""`tpuctl check` against the TPU API stand-in (real google-cloud-tpu client) and the GCS emulator (real
google-cloud-storage client): each injected refusal gives its ✘ line and its fix, and the exit code says so."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from _tpu_fixtures import PROJECT, ZONE, env, fake, fake_server  # noqa: F401
from infra import gcs
from orchestrator.cli.app import cli


@pytest.fixture
def emu(tmp_path, monkeypatch):
    e = gcs.start(home=tmp_path / "gcs-home", buckets=("ckpts",), record=False, reuse=False)
    for k, v in e.env.items():
        monkeypatch.setenv(k, v)
    yield e
    e.stop()


@pytest.fixture
def login(monkeypatch):
    """The Compute Engine / OS Login stand-in (real google-cloud-compute and google-cloud-os-login clients)."""
    from infra.fake_login_apis import start_in_thread
    srv = start_in_thread()
    monkeypatch.setenv("TPUCTL_COMPUTE_API_ENDPOINT", srv.url)
    monkeypatch.setenv("TPUCTL_OSLOGIN_API_ENDPOINT", srv.url)
    yield srv
    srv.stop()


def check(fake, tmp_path, *args):
    res = CliRunner().invoke(cli, ["check", "--api-endpoint", fake.url, "--project", PROJECT,
                                   "--ssh-key", str(tmp_path / "ssh" / "key"), *args])
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


def lines(res) -> dict[str, str]:
    out = {}
    for line in res.stdout.splitlines():
        if line[:2] in ("✔ ", "✘ ", "- "):
            name = line[2:].split(":")[0]
            out[name] = line
        elif line.strip().startswith("fix:"):
            out[name] += "\n" + line.strip()
    return out


def test_everything_ready_is_all_ticks(fake, emu, login, tmp_path):
    res = check(fake, tmp_path, "-z", ZONE, "-a", "v4-16", "--bucket", "gs://ckpts/runs")
    assert res.exit_code == 0, res.output
    got = lines(res)
    assert list(got) == ["credentials", "project", "TPU API", "zone", "OS Login", "SSH key", "bucket"]
    assert "not enforced" in got["OS Login"]
    assert all(v.startswith("✔") for v in got.values()), got
    assert f"{ZONE} offers v4-16" in got["zone"] and "writable" in got["bucket"]
    assert (tmp_path / "ssh" / "key.pub").read_text().startswith("ssh-ed25519 ")
    again = json.loads(check(fake, tmp_path, "-z", ZONE, "--bucket", "gs://ckpts", "--json").stdout)
    assert again["ok"] and [i["name"] for i in again["items"]][-1] == "bucket"
    assert not list(emu_blobs(emu, "ckpts"))  # the probe object was deleted


def emu_blobs(emu, bucket):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    c = storage.Client(project="x", credentials=AnonymousCredentials(), client_options={"api_endpoint": emu.endpoint})
    return c.list_blobs(bucket)


def test_service_disabled_gives_the_enable_command(fake, emu, tmp_path):
    fake.control.service_disabled()
    res = check(fake, tmp_path, "-z", ZONE, "--bucket", "gs://ckpts")
    assert res.exit_code == 1, res.output
    got = lines(res)
    assert got["TPU API"].startswith("✘ TPU API: the Cloud TPU API is not enabled in project proj-test")
    assert f"fix: gcloud services enable tpu.googleapis.com --project {PROJECT}" in got["TPU API"]
    assert got["zone"].startswith("- zone: not checked")
    assert got["bucket"].startswith("✔") and got["SSH key"].startswith("✔")


def test_a_403_location_is_a_zone_line(fake, emu, tmp_path):
    fake.control.location_forbidden("europe-west4-a")
    res = check(fake, tmp_path, "-z", "europe-west4-a", "-a", "v5litepod-8")
    assert res.exit_code == 1, res.output
    got = lines(res)
    assert got["TPU API"].startswith("✔")
    assert got["zone"].startswith("✘ zone: zone europe-west4-a is not a Cloud TPU location for project proj-test")
    assert "permission" in got["zone"]  # the alternative reading of a 403 location


def test_a_missing_bucket_says_how_to_create_it(fake, emu, tmp_path):
    res = check(fake, tmp_path, "-z", ZONE, "--bucket", "gs://no-such-bucket/x")
    assert res.exit_code == 1, res.output
    got = lines(res)
    assert got["bucket"].startswith("✘ bucket: gs://no-such-bucket does not exist")
    assert (f"fix: gcloud storage buckets create gs://no-such-bucket --project {PROJECT} --location us-central2"
            in got["bucket"])
    assert "1 problem(s)" in res.stderr


def test_os_login_enforced_by_the_project_is_reported_and_a_403_names_the_role(fake, login, tmp_path):
    login.control.set_project_metadata(PROJECT, {"enable-oslogin": "TRUE"})
    got = lines(check(fake, tmp_path))
    assert got["OS Login"].startswith("✔ OS Login: enforced in " + PROJECT), got
    assert "roles/compute.osLogin" in got["OS Login"] and "POSIX name" in got["OS Login"]
    login.control.deny("compute")
    res = check(fake, tmp_path)
    assert res.exit_code == 1 and lines(res)["OS Login"].startswith("✘ OS Login: cannot read project "), res.output
    assert "roles/compute.viewer" in lines(res)["OS Login"]


def test_check_name_reads_the_nodes_own_enable_oslogin_as_run_decides(fake, login, tmp_path, monkeypatch):
    """`check NAME`: the VMs' own enable-oslogin metadata, read from the TPU API, wins over the project's; without
    it the project's applies; each line agrees with oslogin.applies, what `run` goes by."""
    from orchestrator import slices
    from orchestrator.access import oslogin
    from orchestrator.provider import cloud
    from _tpu_fixtures import make_spec
    monkeypatch.setenv("TPUCTL_ACCOUNT", "alice@example.com")  # `up` of an OS Login slice registers the key
    for name, own in (("own-off", "FALSE"), ("own-on", "true"), ("plain", None)):
        slices.up(make_spec(fake, name, "v4-8", metadata={"enable-oslogin": own} if own else {}))
    api = cloud.connect(api_endpoint=fake.url, project=PROJECT)

    def agrees(name, line):  # the check's verdict is run's
        meta = api.get_node(f"{api.parent(ZONE)}/nodes/{name}").metadata
        assert line.startswith("✔ OS Login on " + name + ": " + ("on" if oslogin.applies(PROJECT, meta, fake.url)
                                                                else "off") + ": "), line

    login.control.set_project_metadata(PROJECT, {"enable-oslogin": "TRUE"})
    got = lines(check(fake, tmp_path, "own-off"))
    assert got["OS Login"].startswith("✔ OS Login: enforced in " + PROJECT)
    assert "its VMs' own metadata says enable-oslogin=FALSE, which wins over the project's" in got["OS Login on own-off"]
    assert "ssh-keys metadata" in got["OS Login on own-off"]
    agrees("own-off", got["OS Login on own-off"])
    got = lines(check(fake, tmp_path, "plain"))
    assert f"no enable-oslogin of their own, so {PROJECT}'s applies (enforced)" in got["OS Login on plain"]
    agrees("plain", got["OS Login on plain"])

    login.control.set_project_metadata(PROJECT, {})
    res = check(fake, tmp_path, "own-on")
    got = lines(res)
    assert res.exit_code == 0 and got["OS Login"].startswith("✔ OS Login: not enforced"), res.output
    assert got["OS Login on own-on"].startswith("✔ OS Login on own-on: on: its VMs' own metadata says "
                                                "enable-oslogin=true, which wins")
    assert "registers your key with OS Login" in got["OS Login on own-on"]
    agrees("own-on", got["OS Login on own-on"])
    agrees("plain", lines(check(fake, tmp_path, "plain"))["OS Login on plain"])
    # Without a Compute Engine API to ask (a stand-in TPU API): the project is not checked, the node still decides.
    monkeypatch.delenv("TPUCTL_COMPUTE_API_ENDPOINT")
    got = lines(check(fake, tmp_path, "own-on"))
    assert got["OS Login"].startswith("- OS Login: not checked") and got["OS Login on own-on"].startswith(
        "✔ OS Login on own-on: on: its VMs' own metadata"), got
    assert "stand-in with no project to ask" in lines(check(fake, tmp_path, "plain"))["OS Login on plain"]
    # A name the record does not hold: one line before anything is checked.
    res = check(fake, tmp_path, "nope")
    assert res.exit_code != 0 and "no slice named nope in the local record" in res.output and "✔" not in res.output


def test_os_login_registers_the_key_with_its_expiry_and_gives_the_posix_name(login):
    """import_ssh_public_key through the real client: the POSIX user to SSH as, the key kept until --ttl."""
    import time
    from orchestrator.access import oslogin
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIC9h2pV9Q3c4y0Ckq2o1hZ5sXlq5V4Y2b0m1n2o3p4q5"
    t0 = time.time()
    user = oslogin.register(key, project=PROJECT, account_email="alice@example.com", ttl_s=3600)
    t1 = time.time()
    assert user == "alice_example_com"
    (entry,) = login.control.state()["keys"]["alice@example.com"].values()
    # the --ttl from the moment of the call: between the clock before it and after it, however long it took
    assert entry["key"] == key and t0 + 3600 - 1 <= int(entry["expirationTimeUsec"]) / 1e6 <= t1 + 3600 + 1
    login.control.deny("oslogin")
    with pytest.raises(oslogin.UserError, match=r"needs roles/compute.osLogin \(or roles/compute.osAdminLogin\)"):
        oslogin.register(key, project=PROJECT, account_email="alice@example.com")
    assert oslogin.node_enforces({"enable-oslogin": "false"}, True) is False
    assert oslogin.node_enforces({}, True) is True
