"""Fixtures shared by the cloud-half tests: one in-process Cloud TPU stand-in per module, reset per test, and a
private TPUCTL_HOME with no ambient project/endpoint settings (tests never touch the user's ~/.tpuctl)."""
from __future__ import annotations

import contextlib

import pytest

from infra.fake_tpu_api import FakeConfig, start_in_thread
from orchestrator.spec import SliceSpec

FAST = FakeConfig(creating_s=0.15, deleting_s=0.05, accept_s=0.02, waiting_s=0.02, stockout_fail_s=0.05)
PROJECT = "proj-test"
ZONE = "us-central2-b"


@pytest.fixture(scope="module")
def fake_server():
    f = start_in_thread(FAST)
    yield f
    f.stop()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private TPUCTL_HOME and an environment without ambient project/endpoint settings."""
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "tpuctl-home"))
    monkeypatch.setenv("TPUCTL_POLL_S", "0.02")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no gcloud default project
    for var in ("GOOGLE_CLOUD_PROJECT", "TPUCTL_PROJECT", "CLOUDSDK_CORE_PROJECT", "TPUCTL_TPU_API_ENDPOINT",
                "CLOUDSDK_COMPUTE_ZONE"):
        monkeypatch.delenv(var, raising=False)
    yield tmp_path
    from orchestrator.provider import local as local_provider
    with contextlib.suppress(Exception):
        local_provider.stop_api()  # in case a test used --local with this TPUCTL_HOME


@pytest.fixture
def fake(fake_server, env):
    fake_server.control.reset()
    yield fake_server
    fake_server.control.reset()


def make_spec(fake, name: str, accelerator: str = "v4-16", **kw) -> SliceSpec:
    kw.setdefault("zones", [ZONE])
    kw.setdefault("timeout_s", 20)
    kw.setdefault("capacity_wait_s", 5)
    return SliceSpec(name=name, accelerator=accelerator, project=PROJECT, api_endpoint=fake.url, **kw)


def live(fake) -> tuple[list, list]:
    """(nodes, queued resources) the stand-in holds right now."""
    s = fake.control.state()
    return s["nodes"], s["queued_resources"]
