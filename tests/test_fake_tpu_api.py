"""The Cloud TPU stand-in, through the real google-cloud-tpu client (REST) and its control API."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2

from _tpu_fixtures import fake_server  # noqa: F401
from infra.fake_tpu_api import FakeControl

P = "projects/p1/locations/us-central2-b"


@pytest.fixture
def fk(fake_server):
    fake_server.control.reset()
    yield fake_server
    fake_server.control.reset()


@pytest.fixture
def client(fake_server):
    return tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": fake_server.url})


def _node(acc="v4-16", **kw):
    return tpu_v2.Node(accelerator_type=acc, runtime_version="tpu-ubuntu2204-base", labels={"tpuctl-name": "x"},
                       network_config=tpu_v2.NetworkConfig(enable_external_ips=kw.pop("external", True)), **kw)


def _qr(node_id, node, **kw):
    return tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[
        tpu_v2.QueuedResource.Tpu.NodeSpec(parent=P, node_id=node_id, node=node)]), **kw)


def _states_until(get, final, limit_s=10):
    seen = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        s = get()
        if not seen or seen[-1] != s:
            seen.append(s)
        if s in final:
            return seen
        time.sleep(0.005)
    raise AssertionError(f"never reached {final}: {seen}")


def test_node_lifecycle_and_lro(fk, client):
    op = client.create_node(parent=P, node_id="n1", node=_node())
    assert _states_until(lambda: client.get_node(name=f"{P}/nodes/n1").state.name, {"READY"})[-1] == "READY"
    node = op.result(timeout=10)  # the strict LRO parser accepts the operation and its Node response
    assert node.state.name == "READY" and node.health.name == "HEALTHY"
    assert node.accelerator_config.topology == "2x2x2" and node.accelerator_config.type_.name == "V4"
    eps = node.network_endpoints
    assert len(eps) == 2 and all(e.port == 8470 for e in eps)
    assert eps[0].ip_address.startswith("10.") and eps[0].access_config.external_ip.startswith("34.")
    assert [n.name for n in client.list_nodes(parent=P)] == [f"{P}/nodes/n1"]
    client.delete_node(name=f"{P}/nodes/n1").result(timeout=10)
    with pytest.raises(gexc.NotFound):
        client.get_node(name=f"{P}/nodes/n1")
    assert fk.control.state()["gone"] == [{"kind": "node", "name": f"{P}/nodes/n1",
                                           "history": ["CREATING", "READY", "DELETING"]}]


def test_queued_resource_lifecycle_delete_needs_force(fk, client):
    fk.control.config(creating_s=0.1, accept_s=0.05, waiting_s=0.05)
    r = client.create_queued_resource(parent=P, queued_resource_id="q1", queued_resource=_qr("q1", _node()),
                                      ).result(timeout=10)
    assert r.name == f"{P}/queuedResources/q1"
    _states_until(lambda: client.get_queued_resource(name=r.name).state.state.name, {"ACTIVE"})
    assert fk.control.state()["queued_resources"][0]["history"] == [
        "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]
    node = client.get_node(name=f"{P}/nodes/q1")
    assert node.queued_resource == r.name
    with pytest.raises(gexc.BadRequest, match="force"):  # FAILED_PRECONDITION over REST is a 400
        client.delete_queued_resource(request={"name": r.name})
    client.delete_queued_resource(request={"name": r.name, "force": True}).result(timeout=10)
    st = fk.control.state()
    assert st["nodes"] == [] and st["queued_resources"] == []
    assert st["delete_calls"][-1] == {**st["delete_calls"][-1], "kind": "queuedResource", "force": True}


def test_a_node_in_a_queued_resource_can_be_deleted_directly_and_deletes_take_longer_per_host(fk, client):
    """Google's samples delete the node, then its queued resource."""
    fk.control.config(creating_s=0.05, deleting_s=0.1, deleting_per_host_s=0.2)
    client.create_queued_resource(parent=P, queued_resource_id="d1", queued_resource=_qr("d1", _node("v4-32")),
                                  ).result(timeout=10)
    _states_until(lambda: client.get_queued_resource(name=f"{P}/queuedResources/d1").state.state.name, {"ACTIVE"})
    t0 = time.monotonic()
    client.delete_node(name=f"{P}/nodes/d1")                           # 4 workers: 0.1 + 4 x 0.2 s
    seen = _states_until(lambda: client.get_queued_resource(name=f"{P}/queuedResources/d1").state.state.name,
                         {"SUSPENDED"})
    # a lower bound (the 0.9 s the fake was told a 4-host delete takes, less polling's granularity): load only
    # lengthens the wait, it cannot make it pass early
    assert seen == ["SUSPENDING", "SUSPENDED"] and time.monotonic() - t0 >= 0.85
    client.delete_queued_resource(request={"name": f"{P}/queuedResources/d1"}).result(timeout=10)


def test_stockout_queued_waits_then_fails_or_provisions(fk, client):
    inj = fk.control.inject("stockout", zone="us-central2-b")
    vu = tpu_v2.QueuedResource.QueueingPolicy(valid_until_duration={"seconds": 1})
    client.create_queued_resource(parent=P, queued_resource_id="q2", queued_resource=_qr("q2", _node(),
                                  queueing_policy=vu)).result(timeout=10)
    client.create_queued_resource(parent=P, queued_resource_id="q3", queued_resource=_qr("q3", _node()),
                                  ).result(timeout=10)
    _states_until(lambda: client.get_queued_resource(name=f"{P}/queuedResources/q2").state.state.name, {"FAILED"})
    q2 = [q for q in fk.control.state()["queued_resources"] if q["name"].endswith("/q2")][0]
    assert q2["history"] == ["ACCEPTED", "WAITING_FOR_RESOURCES", "FAILED"]
    failed = client.get_queued_resource(name=f"{P}/queuedResources/q2").state.failed_data.error
    assert failed.code == 8 and "no more capacity" in failed.message
    # q3 has no validUntil: it keeps waiting until the stockout is lifted, then provisions.
    assert client.get_queued_resource(name=f"{P}/queuedResources/q3").state.state.name == "WAITING_FOR_RESOURCES"
    assert fk.control.state()["injections"][0]["id"] == inj["id"]
    fk.control.clear("stockout")
    _states_until(lambda: client.get_queued_resource(name=f"{P}/queuedResources/q3").state.state.name, {"ACTIVE"})


def test_errors_arrive_as_the_client_exception_classes(fk, client):
    fk.control.inject("stockout", zone="us-central2-b")
    with pytest.raises(gexc.ResourceExhausted, match="no more capacity"):
        client.create_node(parent=P, node_id="s1", node=_node()).result(timeout=10)
    fk.control.clear()
    fk.control.chip_quota(quota="TPUV4PodPerProjectPerRegionForTPUAPI", times=1)
    with pytest.raises(gexc.TooManyRequests) as q:
        client.create_node(parent=P, node_id="s2", node=_node())
    assert q.value.details[0]["@type"] == "type.googleapis.com/google.rpc.QuotaFailure"
    assert "'TPUV4PodPerProjectPerRegionForTPUAPI'" in q.value.message and "in region us-central2" in q.value.message
    fk.control.inject("permission", times=1)
    with pytest.raises(gexc.Forbidden):
        client.create_node(parent=P, node_id="s3", node=_node())
    with pytest.raises(gexc.BadRequest, match="not available in zone"):
        client.create_node(parent=P, node_id="s4", node=_node("v5p-8"))
    with pytest.raises(gexc.BadRequest, match="Runtime version"):
        client.create_node(parent=P, node_id="s5", node=tpu_v2.Node(accelerator_type="v4-8", runtime_version="nope"))
    with pytest.raises(gexc.BadRequest, match="nodeId"):
        client.create_node(parent=P, node_id="Bad_Id", node=_node())
    with pytest.raises(gexc.Forbidden, match="Location mars-north1-a is not found or access is unauthorized"):
        client.list_nodes(parent="projects/p1/locations/mars-north1-a").nodes
    client.create_node(parent=P, node_id="s6", node=_node())
    with pytest.raises(gexc.Conflict):
        client.create_node(parent=P, node_id="s6", node=_node())
    calls = fk.control.state()["create_calls"]
    assert [c["status"] for c in calls] == [200, 429, 403, 400, 400, 400, 200, 409]


def _status(exc) -> str:
    """`error.status` of a REST answer: api-core does not keep it, so read it off the response."""
    return exc.response.json()["error"]["status"]


# kind, FakeControl call, HTTP status, error.status, ErrorInfo.reason (or the detail's @type), message part
_SHAPES = [
    ("service_disabled", lambda c: c.service_disabled(times=1), 403, "PERMISSION_DENIED", "SERVICE_DISABLED",
     "Cloud TPU API has not been used in project p1"),
    ("billing_disabled", lambda c: c.billing_disabled(times=1), 403, "PERMISSION_DENIED", "BILLING_DISABLED",
     "requires billing to be enabled"),
    ("location_policy", lambda c: c.location_policy("us-central2-b", times=1), 403, "PERMISSION_DENIED",
     "LOCATION_POLICY_VIOLATED", "violates constraint constraints/gcp.resourceLocations"),
    ("location", lambda c: c.location_forbidden("us-central2-b", times=1), 403, "PERMISSION_DENIED", None,
     "Location us-central2-b is not found or access is unauthorized."),
    ("permission", lambda c: c.permission_denied(op="any", times=1), 403, "PERMISSION_DENIED",
     "IAM_PERMISSION_DENIED", "Permission 'tpu.nodes.list' denied"),
    ("rate_limit", lambda c: c.rate_limit(), 429, "RESOURCE_EXHAUSTED", "RATE_LIMIT_EXCEEDED",
     "Quota exceeded for quota metric 'Read requests'"),
    ("unavailable", lambda c: c.transient(503), 503, "UNAVAILABLE", None, "currently unavailable"),
    ("internal", lambda c: c.transient(500), 500, "INTERNAL", None, "Internal error"),
]


@pytest.mark.parametrize("kind,arm,http,status,reason,text", _SHAPES, ids=[s[0] for s in _SHAPES])
def test_refusals_have_the_real_shape_on_any_request(fk, client, kind, arm, http, status, reason, text):
    arm(fk.control)
    with pytest.raises(gexc.GoogleAPICallError) as e:
        list(client.list_accelerator_types(parent=P))   # what a `check` asks first
    assert e.value.code == http and _status(e.value) == status and text in e.value.message
    assert e.value.reason == reason
    if reason:
        assert e.value.domain and e.value.metadata is not None
    assert [a.type_ for a in client.list_accelerator_types(parent=P)][:1] == ["v4-8"]  # times=1: gone again


def test_capacity_answers_in_the_lro_and_over_rest(fk, client):
    fk.control.reserved_capacity("us-central2-b", times=1)                     # in the create LRO: code 9
    op = client.create_node(parent=P, node_id="r1", node=_node())
    with pytest.raises(gexc.GoogleAPICallError, match="Insufficient reserved capacity"):
        op.result(timeout=10)
    assert op.operation.error.code == 9
    fk.control.reserved_capacity("us-central2-b", sync=True, times=1)          # over REST: 400 FAILED_PRECONDITION
    with pytest.raises(gexc.BadRequest) as rc:
        client.create_node(parent=P, node_id="r2", node=_node())
    assert _status(rc.value) == "FAILED_PRECONDITION"
    fk.control.spot_preempted_during_create(times=1)                           # code 3 in the LRO
    op = client.create_node(parent=P, node_id="r3", node=_node(scheduling_config=tpu_v2.SchedulingConfig(spot=True)))
    with pytest.raises(gexc.GoogleAPICallError, match="while in state PREEMPTED"):
        op.result(timeout=10)
    assert op.operation.error.code == 3
    fk.control.reserved_capacity(times=1)                                      # a queued resource goes FAILED
    client.create_queued_resource(parent=P, queued_resource_id="r4", queued_resource=_qr("r4", _node())
                                  ).result(timeout=10)
    _states_until(lambda: client.get_queued_resource(name=f"{P}/queuedResources/r4").state.state.name, {"FAILED"})
    err = client.get_queued_resource(name=f"{P}/queuedResources/r4").state.failed_data.error
    assert err.code == 9 and "Insufficient reserved capacity" in err.message
    fk.control.chip_quota(quota="TPUV6EPreemptiblePerProjectPerRegionForTPUAPI", times=1, zone="us-central2-b")
    with pytest.raises(gexc.TooManyRequests) as q:
        client.create_node(parent=P, node_id="r5", node=_node())
    assert q.value.message.endswith(": Quota limit 'TPUV6EPreemptiblePerProjectPerRegionForTPUAPI' has been "
                                    "exceeded. Limit: 0 in region us-central2.")
    assert _status(q.value) == "RESOURCE_EXHAUSTED" and q.value.reason is None
    assert q.value.details[0]["violations"][0]["subject"] == "project:p1"


def test_reservations_and_recorded_request_bodies(fk, client):
    res = f"{P}/reservations/my-res"
    qr = _qr("v1", _node(scheduling_config=tpu_v2.SchedulingConfig(reserved=True)), reservation_name=res)
    with pytest.raises(gexc.NotFound, match=f"Reservation not found: {res}"):
        client.create_queued_resource(parent=P, queued_resource_id="v1", queued_resource=qr)
    fk.control.add_reservation(res)
    client.create_queued_resource(parent=P, queued_resource_id="v1", queued_resource=qr).result(timeout=10)
    body = fk.control.create_bodies("queuedResource")[-1]
    assert body["reservationName"] == res and body["tpu"]["nodeSpec"][0]["node"]["schedulingConfig"] == {
        "reserved": True}
    # gcloud alpha's v2alpha1 field (guaranteed.reserved) is not part of v2: refused the way the API's JSON
    # parser refuses an unknown field
    from google.cloud import tpu_v2alpha1
    alpha = tpu_v2alpha1.QueuedResource(
        tpu=tpu_v2alpha1.QueuedResource.Tpu(node_spec=[tpu_v2alpha1.QueuedResource.Tpu.NodeSpec(
            parent=P, node_id="v2", node=tpu_v2alpha1.Node(accelerator_type="v4-8",
                                                           runtime_version="tpu-ubuntu2204-base"))]),
        guaranteed=tpu_v2alpha1.QueuedResource.Guaranteed(reserved=True))
    r = requests.post(f"{fk.url}/v2/{P}/queuedResources?queuedResourceId=v2",
                      json=tpu_v2alpha1.QueuedResource.to_dict(alpha, preserving_proto_field_name=False))
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        'Invalid JSON payload received. Unknown name "reserved" at \'queued_resource.guaranteed\': Cannot find field.')


def test_preemption_slow_and_never_ready(fk, client):
    fk.control.config(creating_s=0.05)
    client.create_queued_resource(parent=P, queued_resource_id="p1", queued_resource=_qr(
        "p1", _node(), spot=tpu_v2.QueuedResource.Spot())).result(timeout=10)
    _states_until(lambda: client.get_queued_resource(name=f"{P}/queuedResources/p1").state.state.name, {"ACTIVE"})
    assert client.get_node(name=f"{P}/nodes/p1").scheduling_config.spot
    fk.control.config(deleting_s=0.3)
    fk.control.preempt("p1")  # short names work when unique
    # under a queued resource the service deletes the preempted node: DELETING, then gone; SUSPENDING, SUSPENDED
    assert client.get_node(name=f"{P}/nodes/p1").state.name == "DELETING"
    assert client.get_queued_resource(name=f"{P}/queuedResources/p1").state.state.name == "SUSPENDING"
    with pytest.raises(RuntimeError, match="only a READY node"):
        fk.control.preempt("p1")
    _states_until(lambda: client.get_queued_resource(name=f"{P}/queuedResources/p1").state.state.name,
                  {"SUSPENDED"})
    with pytest.raises(gexc.NotFound):
        client.get_node(name=f"{P}/nodes/p1")
    gone = [g for g in fk.control.state()["gone"] if g["name"].endswith("/nodes/p1")]
    assert gone[0]["history"] == ["CREATING", "READY", "PREEMPTED", "DELETING"]
    client.delete_queued_resource(request={"name": f"{P}/queuedResources/p1"}).result(timeout=10)  # no node: no force

    fk.control.inject("never_ready", accelerator="v4-8", times=1)
    fk.control.inject("slow", accelerator="v4-32", creating_s=60, times=1)
    client.create_node(parent=P, node_id="nr", node=_node("v4-8"))
    client.create_node(parent=P, node_id="sl", node=_node("v4-32"))
    client.create_node(parent=P, node_id="ok", node=_node("v4-8"))
    _states_until(lambda: client.get_node(name=f"{P}/nodes/ok").state.name, {"READY"})
    assert client.get_node(name=f"{P}/nodes/sl").state.name == "CREATING"  # 60 s to go
    assert client.get_node(name=f"{P}/nodes/nr").state.name == "CREATING"  # forever


def test_worker_endpoints_control(fk, client):
    fk.control.set_workers(["127.0.10.1", "127.0.10.2", "127.0.10.3", "127.0.10.4"])
    fk.control.config(creating_s=0.01)
    node = client.create_node(parent=P, node_id="w1", node=_node("v4-32")).result(timeout=10)
    assert [(e.ip_address, e.access_config.external_ip) for e in node.network_endpoints] == [
        (f"127.0.10.{i}", f"127.0.10.{i}") for i in range(1, 5)]
    fk.control.set_node_workers(node.name, ["127.0.20.1", "127.0.20.2", "127.0.20.3", "127.0.20.4"])
    again = client.get_node(name=node.name)
    assert [e.ip_address for e in again.network_endpoints][0] == "127.0.20.1"
    fk.control.set_workers(None)
    internal_only = client.create_node(parent=P, node_id="w2", node=_node("v4-8", external=False)).result(timeout=10)
    assert internal_only.network_endpoints[0].ip_address.startswith("10.")
    assert not internal_only.network_endpoints[0].access_config.external_ip


def test_zone_offerings_runtime_versions_and_paging(fk, client):
    types = [a.type_ for a in client.list_accelerator_types(request={"parent": P, "page_size": 3})]
    assert types[:2] == ["v4-8", "v4-16"] and len(types) == 10  # every page fetched
    assert "tpu-ubuntu2204-base" in [r.version for r in client.list_runtime_versions(parent=P)]
    fk.control.set_zone("us-central2-b", ["v4-8"])  # the stand-in may disagree with the catalog
    assert [a.type_ for a in client.list_accelerator_types(parent=P)] == ["v4-8"]
    with pytest.raises(RuntimeError, match="unknown injection kind"):
        fk.control.inject("meteor")


def test_runs_as_a_module_subprocess(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "infra.fake_tpu_api", "--port", "0", "--ready-file", str(ready),
                             "--creating-s", "0.01"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid
        ctl = FakeControl(info["url"])
        assert ctl.health()["pid"] == proc.pid
        c = tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                             client_options={"api_endpoint": info["url"]})
        assert c.create_node(parent=P, node_id="sub", node=_node("v4-8")).result(timeout=10).state.name == "READY"
        assert [n["name"] for n in ctl.state()["nodes"]] == [f"{P}/nodes/sub"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    assert proc.returncode is not None
