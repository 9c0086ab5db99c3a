"""The Secret Manager stand-in, through the real google-cloud-secret-manager client (REST)."""
from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import google_crc32c
import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import secretmanager_v1 as sm
from google.oauth2.credentials import Credentials

from infra.fake_secret_manager import start_in_thread
from infra.gcp_ids import project_number

P = "proj-a"
NUM = project_number(P)
CTL = "serviceAccount:tpuctl-controller@proj-a.iam.gserviceaccount.com"
PAYLOAD = b"wandb-key-0123456789abcdef"


@pytest.fixture(scope="module")
def server():
    lines: list[str] = []
    srv = start_in_thread(log=lines.append)
    srv.lines = lines
    yield srv
    srv.stop()


@pytest.fixture
def fk(server):
    server.control.reset()
    yield server
    server.control.reset()


def _client(url: str, member: str | None = None) -> sm.SecretManagerServiceClient:
    creds = Credentials(token=member) if member else AnonymousCredentials()  # no credentials: the project owner
    return sm.SecretManagerServiceClient(transport="rest", credentials=creds, client_options={"api_endpoint": url})


def test_create_add_access_get_list_delete(fk):
    c = _client(fk.url)
    s = c.create_secret(parent=f"projects/{P}", secret_id="wandb",
                        secret={"replication": {"automatic": {}}, "labels": {"tpuctl-job": "j1"}})
    assert s.name == f"projects/{NUM}/secrets/wandb" and dict(s.labels) == {"tpuctl-job": "j1"}  # by number
    with pytest.raises(gexc.Conflict, match=rf"Secret \[projects/{NUM}/secrets/wandb\] already exists\."):
        c.create_secret(parent=f"projects/{P}", secret_id="wandb", secret={"replication": {"automatic": {}}})
    with pytest.raises(gexc.NotFound, match=rf"Secret \[projects/{NUM}/secrets/wandb\] not found or has no versions"):
        c.access_secret_version(name=f"projects/{P}/secrets/wandb/versions/latest")  # no version yet

    v1 = c.add_secret_version(parent=s.name, payload={"data": b"old"})
    v2 = c.add_secret_version(parent=s.name, payload={"data": PAYLOAD, "data_crc32c": google_crc32c.value(PAYLOAD)})
    assert (v1.name, v2.name) == (f"{s.name}/versions/1", f"{s.name}/versions/2")
    assert v2.state == sm.SecretVersion.State.ENABLED and v2.client_specified_payload_checksum
    with pytest.raises(gexc.BadRequest, match="data_crc32c"):
        c.add_secret_version(parent=s.name, payload={"data": b"x", "data_crc32c": 1})

    latest = c.access_secret_version(name=f"projects/{P}/secrets/wandb/versions/latest")
    assert latest.name == f"{s.name}/versions/2" and latest.payload.data == PAYLOAD
    assert latest.payload.data_crc32c == google_crc32c.value(PAYLOAD)
    assert c.access_secret_version(name=f"{s.name}/versions/1").payload.data == b"old"
    with pytest.raises(gexc.NotFound, match=rf"Secret Version \[{s.name}/versions/7\] not found"):
        c.access_secret_version(name=f"{s.name}/versions/7")

    assert c.get_secret(name=f"projects/{P}/secrets/wandb").name == s.name
    c.create_secret(parent=f"projects/{P}", secret_id="kaggle", secret={"replication": {"automatic": {}}})
    assert sorted(x.name for x in c.list_secrets(parent=f"projects/{P}")) == [
        f"projects/{NUM}/secrets/kaggle", s.name]
    assert list(c.list_secrets(parent="projects/other-project")) == []

    c.delete_secret(name=s.name)
    with pytest.raises(gexc.NotFound, match=rf"Secret \[projects/{NUM}/secrets/wandb\] not found\."):
        c.get_secret(name=s.name)
    with pytest.raises(gexc.NotFound):
        c.delete_secret(name=s.name)
    with pytest.raises(gexc.BadRequest, match="replication"):
        c.create_secret(parent=f"projects/{P}", secret_id="no-replication", secret={})


def test_only_a_member_the_policy_names_may_access_and_payloads_stay_out_of_logs(fk):
    owner, ctl = _client(fk.url), _client(fk.url, CTL)
    s = owner.create_secret(parent=f"projects/{P}", secret_id="kaggle", secret={"replication": {"automatic": {}}})
    owner.add_secret_version(parent=s.name, payload={"data": PAYLOAD})

    for call in (lambda: ctl.access_secret_version(name=f"{s.name}/versions/latest"),
                 lambda: ctl.access_secret_version(name=f"projects/{P}/secrets/missing/versions/latest")):
        with pytest.raises(gexc.Forbidden, match=r"Permission 'secretmanager\.versions\.access' denied on resource "
                                                 r"\(or it may not exist\)\.") as e:
            call()  # a secret that does not exist answers the same to a member without access
        assert e.value.reason == "IAM_PERMISSION_DENIED"
        assert e.value.metadata["permission"] == "secretmanager.versions.access"
    with pytest.raises(gexc.Forbidden, match="secretmanager.secrets.create"):
        ctl.create_secret(parent=f"projects/{P}", secret_id="x", secret={"replication": {"automatic": {}}})

    policy = owner.get_iam_policy(request={"resource": s.name})
    assert list(policy.bindings) == []
    policy.bindings.add(role="roles/secretmanager.secretAccessor", members=[CTL])
    owner.set_iam_policy(request={"resource": s.name, "policy": policy})
    assert ctl.access_secret_version(name=f"{s.name}/versions/latest").payload.data == PAYLOAD
    with pytest.raises(gexc.Forbidden, match="secretmanager.versions.add"):  # access is not write
        ctl.add_secret_version(parent=s.name, payload={"data": b"y"})
    with pytest.raises(gexc.Conflict, match="concurrent policy changes"):  # the etag read before the last set
        owner.set_iam_policy(request={"resource": s.name, "policy": policy})
    (binding,) = owner.get_iam_policy(request={"resource": s.name}).bindings
    assert (binding.role, list(binding.members)) == ("roles/secretmanager.secretAccessor", [CTL])
    with pytest.raises(gexc.BadRequest, match="roles/storage.objectAdmin"):
        owner.set_iam_policy(request={"resource": s.name, "policy": {"bindings": [
            {"role": "roles/storage.objectAdmin", "members": [CTL]}]}})

    fk.control.grant(P, CTL, "roles/secretmanager.admin")  # a project role reaches every secret
    ctl.create_secret(parent=f"projects/{P}", secret_id="ctl-own", secret={"replication": {"automatic": {}}})

    fk.control.service_disabled(times=1)
    with pytest.raises(gexc.Forbidden, match="Secret Manager API has not been used in project") as e:
        owner.get_secret(name=s.name)
    assert e.value.reason == "SERVICE_DISABLED" and "activationUrl" in e.value.metadata

    state = json.dumps(fk.control.state())
    logged = "\n".join(fk.lines)
    assert "versions/latest:access caller=" + CTL + " -> 200" in logged  # the log says who read what
    for text in (state, logged):
        assert PAYLOAD.decode() not in text and base64.b64encode(PAYLOAD).decode() not in text
    assert '"bytes": 26' in state


def test_the_command_serves_and_logs_no_payload(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "infra.fake_secret_manager", "--ready-file", str(ready),
                             "--verbose"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        c = _client(json.loads(ready.read_text())["url"])
        s = c.create_secret(parent=f"projects/{P}", secret_id="k", secret={"replication": {"automatic": {}}})
        c.add_secret_version(parent=s.name, payload={"data": PAYLOAD})
        assert c.access_secret_version(name=f"{s.name}/versions/latest").payload.data == PAYLOAD
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert f"GET /v1/projects/{NUM}/secrets/k/versions/latest:access caller=projectOwner -> 200" in err, err
    assert PAYLOAD.decode() not in err and base64.b64encode(PAYLOAD).decode() not in err
