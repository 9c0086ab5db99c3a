"""Compute Engine instances in the login stand-in, through the real google-cloud-compute client (REST)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from infra.fake_login_apis import start_in_thread

P, Z = "proj-a", "us-central1-a"


@pytest.fixture(scope="module")
def server():
    srv = start_in_thread()
    yield srv
    srv.stop()


@pytest.fixture
def fk(server):
    server.control.reset()
    server.control.compute_config(provisioning_s=0.1, staging_s=0.1, stopping_s=0.1, terminated_s=0.1)
    yield server
    server.control.reset()


@pytest.fixture(scope="module")
def clients(server):
    kw = {"transport": "rest", "credentials": AnonymousCredentials(), "client_options": {"api_endpoint": server.url}}
    return compute_v1.InstancesClient(**kw), compute_v1.ZoneOperationsClient(**kw)


def _vm(name="ctl", external=True, machine="e2-small", labels=None) -> compute_v1.Instance:
    nic = compute_v1.NetworkInterface(network="global/networks/default")
    if external:
        nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
    return compute_v1.Instance(
        name=name, machine_type=f"zones/{Z}/machineTypes/{machine}", network_interfaces=[nic],
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True,
                                       initialize_params=compute_v1.AttachedDiskInitializeParams(
                                           source_image="projects/debian-cloud/global/images/family/debian-12"))],
        service_accounts=[compute_v1.ServiceAccount(email="default",
                                                    scopes=["https://www.googleapis.com/auth/cloud-platform"])],
        metadata=compute_v1.Metadata(items=[compute_v1.Items(key="startup-script", value="#!/bin/sh\necho up")]),
        labels={"tpuctl-role": "controller"} if labels is None else labels)


def test_insert_wait_get_list_delete(fk, clients):
    ic, oc = clients
    fk.control.set_ips("127.0.20.1", external="127.0.20.2")
    op = ic.insert(project=P, zone=Z, instance_resource=_vm())
    assert op.status == compute_v1.Operation.Status.RUNNING and op.operation_type == "insert"
    assert ic.get(project=P, zone=Z, instance="ctl").status == "PROVISIONING"
    done = oc.wait(project=P, zone=Z, operation=op.name)
    assert done.status == compute_v1.Operation.Status.DONE and not done.http_error_status_code, done

    vm = ic.get(project=P, zone=Z, instance="ctl")
    assert vm.status == "RUNNING"
    assert vm.machine_type == f"https://www.googleapis.com/compute/v1/projects/{P}/zones/{Z}/machineTypes/e2-small"
    assert vm.network_interfaces[0].network_i_p == "127.0.20.1"
    assert vm.network_interfaces[0].access_configs[0].nat_i_p == "127.0.20.2"
    (sa,) = vm.service_accounts  # "default" is the project's Compute Engine default account, by its number
    assert sa.email.endswith("-compute@developer.gserviceaccount.com") and sa.email.split("-")[0].isdigit()
    assert [(i.key, i.value) for i in vm.metadata.items] == [("startup-script", "#!/bin/sh\necho up")]
    assert dict(vm.labels) == {"tpuctl-role": "controller"}

    ic.insert(project=P, zone=Z, instance_resource=_vm("other", labels={}))  # no label: filtered out below
    listed = ic.list(request={"project": P, "zone": Z, "filter": "labels.tpuctl-role = controller"})
    assert [i.name for i in listed] == ["ctl"]
    assert sorted(i.name for i in ic.list(project=P, zone=Z)) == ["ctl", "other"]
    assert list(ic.list(project=P, zone="europe-west4-a")) == []

    with pytest.raises(gexc.Conflict, match=f"projects/{P}/zones/{Z}/instances/ctl' already exists"):
        ic.insert(project=P, zone=Z, instance_resource=_vm())

    op = ic.delete(project=P, zone=Z, instance="ctl")
    assert op.operation_type == "delete" and ic.get(project=P, zone=Z, instance="ctl").status == "STOPPING"
    assert oc.wait(project=P, zone=Z, operation=op.name).status == compute_v1.Operation.Status.DONE
    with pytest.raises(gexc.NotFound, match=f"'projects/{P}/zones/{Z}/instances/ctl' was not found"):
        ic.get(project=P, zone=Z, instance="ctl")
    with pytest.raises(gexc.NotFound):
        ic.delete(project=P, zone=Z, instance="ctl")
    (gone,) = fk.control.compute_state()["gone"]
    assert [s for s, _ in gone["history"]] == ["PROVISIONING", "STAGING", "RUNNING", "STOPPING", "TERMINATED",
                                               "GONE"]


def test_result_polls_through_a_client_made_without_the_endpoint_and_quota_fails_the_operation(fk, clients):
    """The operation `insert()` returns polls with a ZoneOperationsClient the library builds without the
    InstancesClient's client_options, so against any other endpoint `.result()` asks compute.googleapis.com: a
    caller of the stand-in waits with its own ZoneOperationsClient (here it is handed to the library)."""
    ic, oc = clients
    assert ic._transport._zone_operations_client.api_endpoint == "compute.googleapis.com"  # noqa: SLF001
    own = compute_v1.InstancesClient(transport="rest", credentials=AnonymousCredentials(),
                                     client_options={"api_endpoint": fk.url})
    own._transport._extended_operations_services["zone_operations"] = oc  # noqa: SLF001
    assert own.insert(project=P, zone=Z, instance_resource=_vm()).result(timeout=30) is None

    fk.control.quota(quota="CPUS", limit=8, times=1)
    op = own.insert(project=P, zone=Z, instance_resource=_vm("second"))
    with pytest.raises(gexc.Forbidden) as e:
        op.result(timeout=30)
    (err,) = e.value.errors
    assert err.code == "QUOTA_EXCEEDED" and err.message == "Quota 'CPUS' exceeded.  Limit: 8.0 in region us-central1."
    q = err.error_details[0].quota_info
    assert (q.metric_name, q.limit_name, dict(q.dimensions), q.limit) == (
        "compute.googleapis.com/cpus", "CPUS-per-project-region", {"region": "us-central1"}, 8)
    waited = oc.wait(project=P, zone=Z, operation=op.name)
    assert (waited.http_error_status_code, waited.http_error_message) == (403, "FORBIDDEN")
    with pytest.raises(gexc.NotFound):  # a refused insert makes no instance
        ic.get(project=P, zone=Z, instance="second")
    assert own.insert(project=P, zone=Z, instance_resource=_vm("second")).result(timeout=30) is None  # times=1


def test_refusals_as_the_client_raises_them(fk, clients):
    ic, _ = clients
    fk.control.quota(quota="CPUS_ALL_REGIONS", limit=12, sync=True, times=1)
    with pytest.raises(gexc.Forbidden, match=r"Quota 'CPUS_ALL_REGIONS' exceeded\.  Limit: 12\.0 globally\.") as e:
        ic.insert(project=P, zone=Z, instance_resource=_vm())
    assert e.value.errors[0]["reason"] == "quotaExceeded"

    fk.control.org_policy()
    with pytest.raises(gexc.PreconditionFailed) as e:
        ic.insert(project=P, zone=Z, instance_resource=_vm())
    assert e.value.errors[0]["reason"] == "conditionNotMet"
    assert "Constraint constraints/compute.vmExternalIpAccess violated for project 1" in e.value.message
    assert f"Add instance projects/{P}/zones/{Z}/instances/ctl to the constraint" in e.value.message
    ic.insert(project=P, zone=Z, instance_resource=_vm("internal-only", external=False))  # the policy allows it

    fk.control.service_disabled(times=2)
    for call in (lambda: ic.get(project=P, zone=Z, instance="internal-only"),
                 lambda: compute_v1.ProjectsClient(transport="rest", credentials=AnonymousCredentials(),
                                                   client_options={"api_endpoint": fk.url}).get(project=P)):
        with pytest.raises(gexc.Forbidden, match="Compute Engine API has not been used in project") as e:
            call()
        assert e.value.reason == "SERVICE_DISABLED" and e.value.domain == "googleapis.com"
        assert e.value.metadata["activationUrl"].startswith(
            "https://console.developers.google.com/apis/api/compute.googleapis.com/overview?project=")

    fk.control.deny("compute")  # the caller lacks the IAM permission
    with pytest.raises(gexc.Forbidden, match="Permission 'compute.instances.create' denied") as e:
        ic.insert(project=P, zone=Z, instance_resource=_vm("y"))
    assert e.value.reason == "IAM_PERMISSION_DENIED"
    fk.control.reset()

    with pytest.raises(gexc.BadRequest, match="Machine type with name 'e2-giant' does not exist"):
        ic.insert(project=P, zone=Z, instance_resource=_vm("x", machine="e2-giant"))
    with pytest.raises(gexc.BadRequest, match="resource.name"):
        ic.insert(project=P, zone=Z, instance_resource=_vm("Bad_Name"))


def test_the_command_serves_instances(tmp_path):
    """`python -m infra.fake_login_apis`: how local mode runs it, as a process of its own."""
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "infra.fake_login_apis", "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        kw = {"transport": "rest", "credentials": AnonymousCredentials(),
              "client_options": {"api_endpoint": json.loads(ready.read_text())["url"]}}
        ic, oc = compute_v1.InstancesClient(**kw), compute_v1.ZoneOperationsClient(**kw)
        op = ic.insert(project=P, zone=Z, instance_resource=_vm(external=False))
        assert oc.wait(project=P, zone=Z, operation=op.name).status == compute_v1.Operation.Status.DONE
        vm = ic.get(project=P, zone=Z, instance="ctl")
        assert vm.status == "RUNNING" and vm.network_interfaces[0].network_i_p.startswith("10.128.0.")
        assert not vm.network_interfaces[0].access_configs
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
