"""Managed jobs' parts, cheaply: the controller VM through the real google-cloud-compute client against the
Compute Engine stand-in (its refusals as one line with the fix), the job's secrets through the real Secret Manager
client (only the controller's account reads them), the job bucket through google-cloud-storage on the GCS
emulator, and `run --detach`'s refusals before anything is created. The whole life of a managed job (the laptop
leaving, a preemption, the controller dying, cancel, idle) is tests/test_preemption_e2e.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infra import fake_login_apis, fake_secret_manager
from infra.gcp_ids import default_service_account
from orchestrator.jobs import controller_vm as V
from orchestrator.jobs import job_secrets
from orchestrator.jobs.store import JobStore, cost_so_far, initial_state, is_job_id, new_job_id
from orchestrator.spec import UserError

P, Z = "proj-a", "us-central1-a"


@pytest.fixture(scope="module")
def compute():
    srv = fake_login_apis.start_in_thread()
    srv.control.compute_config(provisioning_s=0.05, staging_s=0.05, stopping_s=0.05, terminated_s=0.05)
    yield srv
    srv.stop()


def _where(url: str, **kw) -> V.Where:
    return V.Where(project=P, zone=Z, bucket="b", provider="gcp", endpoint=url, **kw)


def test_the_controller_vm_is_created_found_and_deleted(compute):
    compute.control.reset()
    w = _where(compute.url, idle_minutes=3)
    assert V.get(w) is None
    said = []
    script = V.startup_script(w, "gs://b/tpuctl/bundles/h/tpuctl.whl", {"A": "1"}, python=None)
    V.create(w, script, said.append)
    got = V.get(w)
    assert got["name"] == "tpuctl-controller-us-central1" and got["status"] == "RUNNING" and got["machine"] == "e2-small"
    assert "0.0168 $/hour" in said[0] and "3 idle minutes" in said[0]
    (body,) = [i["body"] for i in compute.control.compute_state()["instances"]]
    items = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    # A real VM installs tpuctl from the bundle and runs the controller as a systemd service (a reboot keeps it).
    assert "systemctl enable --now tpuctl-controller" in items["startup-script"]
    assert "--bucket b --project proj-a --zone us-central1-a --provider gcp --idle-minutes 3" in items["startup-script"]
    assert body["serviceAccounts"][0]["email"] == "default" and body["labels"] == {V.LABEL: "true"}
    V.create(w, script, said.append)  # a second tpuctl racing for it: it exists, nothing else happens
    assert len(compute.control.compute_state()["instances"]) == 1
    assert V.delete(w) and V.get(w) is None and not V.delete(w)


@pytest.mark.parametrize("kind,expect", [
    ("quota", "ask for more quota"),
    ("org_policy", "organisation policy"),
    ("service_disabled", "gcloud services enable compute.googleapis.com --project proj-a"),
])
def test_a_controller_that_cannot_be_created_is_one_line_with_the_fix(compute, kind, expect):
    compute.control.reset()
    getattr(compute.control, kind)()
    with pytest.raises(UserError) as e:
        V.create(_where(compute.url), "#!/bin/sh\n", lambda m: None)
    assert expect in str(e.value) and "\n" not in str(e.value), e.value
    compute.control.reset()
    assert V.get(_where(compute.url)) is None  # nothing was left behind


def test_an_api_that_refuses_the_look_up_is_one_line_with_the_fix(compute):
    """`controller status`, `jobs` and a submit all look the controller up first: a disabled API says how to
    enable it there too, not a traceback."""
    compute.control.reset()
    compute.control.service_disabled(op="get")
    with pytest.raises(UserError) as e:
        V.get(_where(compute.url))
    assert str(e.value).startswith("cannot look up the tpuctl controller: the Compute Engine API is not enabled")
    assert "gcloud services enable compute.googleapis.com --project proj-a" in str(e.value)
    assert "\n" not in str(e.value), e.value
    compute.control.reset()
    assert V.get(_where(compute.url)) is None


def test_a_jobs_secrets_are_read_by_the_controllers_account_only():
    srv = fake_secret_manager.start_in_thread()
    try:
        from google.oauth2.credentials import Credentials
        sa = f"serviceAccount:{default_service_account(P)}"
        refs = job_secrets.store(P, "job-20261203-000000-abcd", {"WANDB_API_KEY": "s3cr3t-value"}, sa,
                                 endpoint=srv.url)
        (name,) = refs.values()
        assert name.endswith("/secrets/tpuctl-job-20261203-000000-abcd-WANDB_API_KEY")
        got = job_secrets.read(refs, endpoint=srv.url, credentials=Credentials(token=sa))
        assert got == {"WANDB_API_KEY": "s3cr3t-value"}
        with pytest.raises(UserError) as e:  # another account (a user's VM, another controller) cannot
            job_secrets.read(refs, endpoint=srv.url, credentials=Credentials(token="serviceAccount:x@p.iam"))
        assert "roles/secretmanager.secretAccessor" in str(e.value) and "s3cr3t" not in str(e.value)
        assert "s3cr3t" not in json.dumps(srv.control.call("GET", "state"))
        job_secrets.drop(refs, endpoint=srv.url)
        with pytest.raises(UserError):
            job_secrets.read(refs, endpoint=srv.url)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """The GCS emulator with bucket jobs-b, recorded in a TPUCTL_HOME of its own (yielded): the local provider, and
    so `tpuctl ... --local --bucket jobs-b`, finds it there."""
    from infra import gcs
    home = tmp_path_factory.mktemp("jobs") / "home"
    emu = gcs.start(home=home, buckets=("jobs-b",))
    old = {k: os.environ.get(k) for k in (*emu.env, "TPUCTL_HOME", "TPUCTL_LOCAL_DIR")}
    os.environ.update({**emu.env, "TPUCTL_HOME": str(home)})
    os.environ.pop("TPUCTL_LOCAL_DIR", None)
    try:
        yield home
    finally:
        from orchestrator.provider.local import stop_service
        for kind in ("compute", "secrets"):  # a submit here asks the local cloud's Resource Manager (and, were
            stop_service(kind)               # its check missing, would store a secret)
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        emu.stop()


def _job(store: JobStore, workers=((0, None), (1, None)), state="RUNNING") -> dict:
    """A job's record as submit and its controller write it, on a slice with these (index, slice) workers."""
    jid = new_job_id()
    spec = {"id": jid, "name": "n", "slice_name": "n", "submitted": 1000.0, "total_steps": 60, "price_per_hour": 3.6}
    store.put_slice(jid, {"name": "n", "project": P, "zone": Z, "accelerator": "v4-16",
                          "node": f"projects/{P}/locations/{Z}/nodes/n",
                          "workers": [{"index": i, "internal_ip": f"10.0.0.{i}", "slice": k} for i, k in workers]})
    store.put_spec(jid, spec)
    store.put_state(jid, {**initial_state(spec), "state": state})
    return spec


def _bucket_iam(bucket: str = "jobs-b") -> str:
    """The local cloud's bucket IAM stand-in (fake-gcs-server has none), told the bucket is project P's."""
    from infra.fake_login_apis import FakeLoginControl
    from orchestrator.provider.local import service_url
    url = service_url("compute")
    FakeLoginControl(url).bucket_project(bucket, P)
    return url


def test_the_job_bucket_round_trip(bucket):
    s = JobStore("jobs-b")
    s.check(iam_endpoint=_bucket_iam(), project=P)
    jid = new_job_id()
    assert is_job_id(jid) and not is_job_id("my-slice")
    spec = {"id": jid, "name": "n", "slice_name": "n", "submitted": 1000.0, "total_steps": 60,
            "price_per_hour": 3.6}
    s.put_spec(jid, spec)
    mine = lambda: next(j for j in s.jobs() if j["id"] == jid)  # noqa: E731 - the bucket is the module's
    assert jid in s.job_ids() and mine()["state"] == "PENDING"  # not taken yet
    s.put_state(jid, {**initial_state(spec), "state": "RUNNING", "step": 7})
    s.put_log(jid, "controller.log", b"a\n")
    s.put_log(jid, "r1/w0.log", b"step 7\n")
    s.request_cancel(jid, down=True)
    assert mine()["step"] == 7 and s.cancel_request(jid)["down"] is True
    assert s.logs(jid) == {"controller.log": b"a\n", "r1/w0.log": b"step 7\n"}
    assert abs(cost_so_far({**initial_state(spec), "ended": 1000.0 + 1800}) - 1.8) < 1e-9
    with pytest.raises(UserError) as e:
        JobStore("no-such-bucket").check(iam_endpoint=_bucket_iam(), project=P)
    assert "does not exist" in str(e.value)


def test_the_submit_check_asks_and_writes_nothing(bucket):
    """A submitter who may create objects but not delete them passes the bucket check and leaves the bucket as it
    was (the check asks testIamPermissions as the caller; it writes no probe); one who may only read is refused in
    one line naming what it lacks."""
    from google.cloud import storage
    from google.oauth2.credentials import Credentials
    url = _bucket_iam()
    store = JobStore("jobs-b")
    bucket_iam = storage.Client(project=P, client_options={"api_endpoint": url}).bucket("jobs-b")  # its owner
    before = {b.name: b.md5_hash for b in store.client.list_blobs(store.bucket)}
    me = "user:creator@example.com"
    policy = bucket_iam.get_iam_policy(requested_policy_version=3)
    kept = list(policy.bindings)
    try:
        policy.bindings.append({"role": "roles/storage.objectViewer", "members": {me}})
        bucket_iam.set_iam_policy(policy)
        with pytest.raises(UserError) as e:
            store.check(iam_endpoint=url, project=P, credentials=Credentials(token=me))
        assert "cannot write gs://jobs-b (you lack storage.objects.create)" in str(e.value), e.value
        policy = bucket_iam.get_iam_policy(requested_policy_version=3)
        policy.bindings.append({"role": "roles/storage.objectCreator", "members": {me}})
        bucket_iam.set_iam_policy(policy)  # create and get, no delete
        store.check(iam_endpoint=url, project=P, credentials=Credentials(token=me))
        assert {b.name: b.md5_hash for b in store.client.list_blobs(store.bucket)} == before
    finally:
        policy = bucket_iam.get_iam_policy(requested_policy_version=3)
        policy.bindings = kept
        bucket_iam.set_iam_policy(policy)


def test_logs_of_one_worker_of_a_job_from_its_bucket(bucket):
    """`tpuctl logs JOB --worker N`: that host's own log of each run in turn, from the bucket (--follow until the
    job ends); a worker the job does not have is one line naming those it has."""
    from click.testing import CliRunner
    from orchestrator.cli.run_verbs import logs
    store = JobStore("jobs-b")
    spec = _job(store)
    jid = spec["id"]
    store.put_log(jid, "controller.log", b"[w0] a\n[w1] b\n")
    store.put_log(jid, "20261203-100000-aaaaaa/w1.log", b"b1\nb2\n")
    store.put_log(jid, "20261203-100000-aaaaaa/w0.log", b"a1\n")
    store.put_log(jid, "20261203-110000-bbbbbb/w1.log", b"after the recovery\n")

    def cli(*args):
        return CliRunner().invoke(logs, [jid, "--local", "--bucket", "jobs-b", *args])

    r = cli("--worker", "1")
    assert r.exit_code == 0 and r.stdout.splitlines() == [
        "b1", "b2", "[tpuctl] run 20261203-110000-bbbbbb", "after the recovery"], r.output
    r = cli("--worker", "w1", "--run", "20261203-100000-aaaaaa")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["b1", "b2"], r.output
    assert cli().stdout.splitlines() == ["[w0] a", "[w1] b"]  # without --worker: the controller's stream
    for bad, says in (("2", f"job {jid} has no worker 2: its slice n has w0, w1 (--worker 0..1)"),
                      ("x", "--worker x: pick a worker index, a host such as s1w0, or all")):
        r = cli("--worker", bad)
        assert r.exit_code == 1 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = cli("--run", "20261203-100000-aaaaaa")
    assert r.exit_code == 1 and "add --worker N" in r.stderr, r.stderr
    # --follow: the lines that arrive until the job ends, then its state
    import threading
    import time
    from orchestrator.jobs import managed
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(managed.host_logs(store, spec, "w0", follow=True,
                                                                     out=got.append, poll_s=0.05)))
    t.start()
    time.sleep(0.5)
    store.put_log(jid, "20261203-100000-aaaaaa/w0.log", b"a1\na2 partial")  # a line being written: not yet
    time.sleep(0.5)
    assert got == ["a1"], got
    store.put_log(jid, "20261203-100000-aaaaaa/w0.log", b"a1\na2 partial, now whole\n")
    store.put_log(jid, "20261203-110000-bbbbbb/w0.log", b"c1\n")
    store.put_state(jid, {**initial_state(spec), "state": "SUCCEEDED"})
    t.join(30)
    assert got[:-1] == ["a1", "a2 partial, now whole", "[tpuctl] run 20261203-110000-bbbbbb", "c1"], got
    assert got[-1]["state"] == "SUCCEEDED"
    # a multislice job's hosts are named by slice and worker
    multi = _job(store, workers=((0, 0), (0, 1)))
    with pytest.raises(UserError) as e:
        managed.job_host(store, multi, "0")
    assert "has s0w0, s1w0 (--worker s0w0, ...)" in str(e.value), e.value
    assert managed.job_host(store, multi, "s1w0") == "s1w0"


def test_a_jobs_goodput_counts_the_attempts_of_every_controller_it_had(bucket):
    """A controller that dies mid-job (its VM deleted) takes nothing of the job with it: the attempts it saw end are
    in the bucket, and so is the part it watched of the attempt it died in (written at each sync: recovering, then
    running), and the job's goodput and recoveries in `tpuctl jobs` count them with its replacement's, over
    the job's whole life. The stretch no controller watched, before the replacement re-attached to the run still
    going, counts as the run's (productive), not as unaccounted time."""
    import time
    from orchestrator import provider
    from orchestrator.jobs import managed
    from orchestrator.jobs.controller import Controller, JobRunner
    store = JobStore("jobs-b")
    jid = _job(store)["id"]
    store.put_state(jid, {**store.state(jid), "started": time.time() - 200})
    where = V.Where(P, Z, "jobs-b", provider.GCP, endpoint="http://127.0.0.1:9")  # no VM to ask about here

    def runner(host: str) -> JobRunner:  # a controller on host `host` taking the job up from the bucket
        ctl = Controller(store, where, provider.get(provider.GCP))
        ctl.host = host
        return JobRunner(ctl, jid)

    def attempt(outcome, resumed, last, steps_s, startup_s=10.0):
        return {"attempt": 1, "run_id": f"r{resumed}", "outcome": outcome, "resumed_from": resumed,
                "last_step": last, "wall_s": startup_s + steps_s + 1, "startup_s": startup_s, "steps_s": steps_s,
                "tail_s": 1.0, "recover_s": 0.0, "step_s": steps_s / max(1, last - resumed)}

    a = runner("ctl-a")  # preempted at step 27, recreated; then its VM is deleted while attempt 2 runs
    a.record_attempts([attempt("preempted", 0, 27, 27.0)])
    a.on_line("[tpuctl] n's VMs were preempted at step 27; recreating n (1/3); the trainer resumes ...")
    a.sync()  # the recovery so far is in the record already
    assert store.state(jid)["attempts"][-1]["outcome"] == "recovering"
    a.on_line("[tpuctl] n is READY again; relaunching (attempt 2)")
    assert store.state(jid)["restart_pending"] is False
    # attempt 2 runs (run r20, as this controller sees its hosts' logs): written as it goes, at each sync
    run = bucket / "runs" / "n" / "r20"
    run.mkdir(parents=True)
    (run / "w0.log").write_text("resuming from step 20\nstep 21/60\n")
    a.sync()
    time.sleep(0.5)
    (run / "w0.log").write_text("resuming from step 20\nstep 21/60\nstep 30/60\n")
    a.sync()
    watched = store.state(jid)["attempts"][-1]
    assert (watched["outcome"], watched["controller"], watched["run_id"], watched["resumed_from"],
            watched["last_step"], watched["steps_redone"]) == ("running", "ctl-a", "r20", 20, 30, 7), watched
    assert watched["steps_s"] >= 0.5 and watched["recover_s"] > 0, watched
    # its VM was deleted 100 s ago: nothing of the job has been written since
    store._put_json(f"jobs/{jid}/state.json", {**store.state(jid), "updated": time.time() - 100})
    b = runner("ctl-b")  # the next `tpuctl jobs` brings it: re-attached, preempted once more, then done
    b.on_line("[tpuctl] run r20 of this same command is still going on the hosts: following it (Ctrl-C stops it)")
    b.on_line("[tpuctl] n's VMs were preempted at step 41; recreating n (2/3); the trainer resumes ...")
    b.record_attempts([attempt("preempted", 20, 41, 21.0), {**attempt("done", 40, 60, 20.0), "steps_redone": 1}])
    b._finish("SUCCEEDED", "done", goodput=b.job_goodput())
    # what `tpuctl jobs` lists (this module's other jobs read live, and have no controller to revive)
    (job,) = [j for j in managed.jobs(["jobs-b"], provider.get(provider.LOCAL), revive=False) if j["id"] == jid]
    assert [(x["attempt"], x["controller"], x["outcome"]) for x in job["attempts"]] == [
        (1, "ctl-a", "preempted"), (2, "ctl-a", "unfinished"), (3, "ctl-b", "preempted"), (4, "ctl-b", "done")], \
        job["attempts"]
    # 27 -> 20: counted once, by the attempt ctl-a watched resume from 20 (ctl-b re-attached to that same run)
    assert [x.get("steps_redone") for x in job["attempts"]] == [None, 7, None, 1]
    g = job["goodput"]
    assert job["recoveries"] == 2 and g["restarts"] == 2 and g["wall_s"] >= 200, job
    unwatched = job["attempts"][2]
    assert unwatched["unwatched"] == "running" and unwatched["unwatched_s"] >= 100 - 32 - 1e-6, unwatched
    # steps kept: ctl-a's watched part of attempt 2 and the others, less 7 + 1 redone (1 s/step); the run's own
    # time while nobody watched it; and attempt 2's start-up and recovery under ctl-a, lost to the preemption
    assert abs(g["productive_s"] - (27 + watched["steps_s"] + 21 + 20 - 7 - 1) - unwatched["unwatched_s"]) < 1e-6, g
    assert g["lost_to_preemptions_s"] >= watched["recover_s"] + watched["startup_s"] + 7, g
    assert g["unwatched_s"] == unwatched["unwatched_s"], g
    assert abs(g["productive_s"] + g["lost_to_preemptions_s"] + g["overhead_s"] + g["unaccounted_s"] - g["wall_s"]) \
        < 1e-6 and 0 < g["goodput"] < 1, g


def test_detach_without_a_gs_ckpt_dir_is_refused_before_anything_is_made(tmp_path):
    env = {**os.environ, "TPUCTL_HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "state.json").write_text(json.dumps({"slices": {"s": {
        "name": "s", "project": P, "zone": Z, "accelerator": "v4-8", "node": f"projects/{P}/locations/{Z}/nodes/s",
        "status": "ready"}}}))
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "s", "--detach", "--", "pretrain",
                        "--ckpt-dir", "/tmp/ckpt"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--detach needs a gs:// --ckpt-dir (got /tmp/ckpt)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "home" / "jobs.json").exists()


def test_refusals_at_submit_come_before_the_controller_vm_and_leave_the_bucket_as_it_was(bucket):
    """Two refusals of `run --detach`, each one line with its fix, before the controller VM is asked for, and
    leaving the bucket's listing, the project's instances and Secret Manager as they were:
    - the controller's service account cannot write the job bucket: the bucket's testIamPermissions, asked as that
      account (the local cloud's bucket IAM stand-in weighs the bucket's policy and the project's), is refused;
      granted on the bucket's own policy, the check passes;
    - Secret Manager refuses the job's secrets (the API disabled; an IAM deny on secrets.create): the secrets are
      stored before the VM, so the refusal comes first.
    The Compute Engine stand-in refuses every insert for quota after recording it, so a VM asked for shows in its
    inserts: only the last submit, past every check, asks (and its stored secret is deleted with the refusal)."""
    from click.testing import CliRunner
    from google.auth.credentials import AnonymousCredentials
    from google.auth.transport.requests import AuthorizedSession
    from google.cloud import storage
    from infra.fake_login_apis import FakeLoginControl
    from infra.fake_secret_manager import FakeSecretsControl
    from orchestrator import provider, state
    from orchestrator.cli.run_verbs import run
    from orchestrator.jobs import bucket_access
    from orchestrator.jobs.bucket_access import ROLE
    from orchestrator.provider.local import service_url
    from orchestrator.state import SliceRecord
    state.save(SliceRecord(name="iam", project=P, zone=Z, accelerator="v4-8", provider="local", status="ready",
                           node=f"projects/{P}/locations/{Z}/nodes/iam"))
    url = provider.of(state.lookup("iam")).resource_manager_endpoint()
    ctl, crm = FakeLoginControl(url), AuthorizedSession(AnonymousCredentials())
    sm = FakeSecretsControl(service_url("secrets"))
    sa = default_service_account(P)
    store = JobStore("jobs-b")
    ctl.bucket_project("jobs-b", P)
    # the bucket's IAM as its owner sees it (no credentials: the project's owner, to the stand-in)
    bucket_iam = storage.Client(project=P, credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": url}).bucket("jobs-b")

    def objects() -> dict[str, str]:  # the whole bucket, object by object: a refusal leaves it as it was
        return {b.name: b.md5_hash for b in store.client.list_blobs(store.bucket)}
    before = objects()

    def grant(role: str) -> None:
        etag = crm.post(f"{url}/v1/projects/{P}:getIamPolicy", json={}).json()["etag"]
        r = crm.post(f"{url}/v1/projects/{P}:setIamPolicy", json={"policy": {"etag": etag, "bindings": [
            {"role": "roles/owner", "members": ["user:owner@example.com"]},
            {"role": role, "members": [f"serviceAccount:{sa}", "user:me@example.com"]}]}})
        assert r.status_code == 200, r.text

    def refused(*says: str, progress: bool = False) -> None:
        r = CliRunner().invoke(run, ["iam", "--detach", "--no-plan", "--secret-env", "HOME", "--", "pretrain",
                                     "--steps", "3", "--ckpt-dir", "gs://jobs-b/iam"])
        errors = [line for line in r.stderr.splitlines() if not line.startswith("[tpuctl]")]  # past the progress
        assert r.exit_code == 1 and len(errors) == 1 and (progress or len(r.stderr.splitlines()) == 1), r.output
        assert all(x in errors[0] for x in says) and "warning" not in r.output, r.output
        assert objects() == before  # no bundle, no heartbeat, no write-check probe, no job record
        assert not sm.state()["secrets"]
        assert not ctl.compute_state()["instances"]

    ctl.quota(sync=True)  # any insert is recorded, then refused
    grant("roles/storage.objectViewer")  # reads, cannot write; nor is it an editor the bucket's default names
    refused(f"the controller's service account {sa} cannot write gs://jobs-b (it lacks storage.objects.create, "
            f"storage.objects.delete): grant it {ROLE} on gs://jobs-b")
    assert not sm.state()["calls"] and not ctl.compute_state()["inserts"]  # Secret Manager was never asked
    # Where submit cannot act as the account (no token creator role on it), the policies read say the same.
    with pytest.raises(UserError) as e:
        bucket_access.check("jobs-b", P, "default", endpoint=url, iam_endpoint=url, as_account=None, warn=print)
    assert f"{sa} cannot write gs://jobs-b: grant it {ROLE}" in str(e.value), e.value

    policy = bucket_iam.get_iam_policy(requested_policy_version=3)
    policy.bindings.append({"role": ROLE, "members": {f"serviceAccount:{sa}"}})
    bucket_iam.set_iam_policy(policy)  # granted on the bucket: the check passes
    warned: list[str] = []
    assert bucket_access.check("jobs-b", P, "default", endpoint=url, iam_endpoint=url, as_account=None,
                               warn=warned.append) == sa and not warned
    sm.service_disabled()
    refused(f"Secret Manager is not enabled in project {P}: `gcloud services enable secretmanager.googleapis.com "
            f"--project {P}`")
    sm.reset()
    sm.deny("secretmanager.secrets.create")
    refused("cannot store the job's secrets in Secret Manager", "Permission 'secretmanager.secrets.create' denied",
            "ask for roles/secretmanager.admin on the project")
    assert not ctl.compute_state()["inserts"]  # no VM was asked for by any refusal so far
    sm.reset()
    # past every check: the VM is asked for, refused, and the secret dropped
    refused("Quota 'CPUS' exceeded", progress=True)
    assert len(ctl.compute_state()["inserts"]) == 1
    assert [c["method"] for c in sm.state()["calls"]].count("DELETE") == 1, sm.state()["calls"]
    # You may not read the project: the check is a warning, but the secrets' reader (`default`'s email) cannot be
    # told, which is a refusal naming the flag.
    ctl.deny("resourcemanager")
    r = CliRunner().invoke(run, ["iam", "--detach", "--no-plan", "--secret-env", "HOME", "--", "pretrain",
                                 "--steps", "3", "--ckpt-dir", "gs://jobs-b/iam"])
    assert r.exit_code == 1 and r.stderr.startswith("[tpuctl] warning: could not check that the controller's "
                                                    "service account can write gs://jobs-b"), r.output
    assert "pass --controller-service-account EMAIL" in r.stderr.splitlines()[-1], r.output
    assert objects() == before and len(ctl.compute_state()["inserts"]) == 1 and not sm.state()["secrets"]


def test_which_grants_let_the_controller_write():
    """The judgement on policies as the APIs return them: roles that together hold create+get+delete, public
    members, a bucket's convenience members expanded from the project's policy; what cannot be told is unsure."""
    from orchestrator.jobs.bucket_access import judge
    me = "serviceAccount:c@p.iam.gserviceaccount.com"

    def pol(*bindings):
        return {"bindings": [{"role": r, "members": m, **({"condition": c} if c else {})} for r, m, c in bindings]}

    assert judge(me, [pol(("roles/storage.objectAdmin", [me], None))]).ok
    assert judge(me, [pol(("roles/editor", ["user:x@y", me], None))]).ok
    assert judge(me, [pol(("roles/storage.admin", ["allAuthenticatedUsers"], None))]).ok
    assert judge(me, [pol(("roles/storage.legacyBucketWriter", [me], None)),
                      pol(("roles/storage.legacyObjectReader", ["allUsers"], None))]).ok
    v = judge(me, [pol(("roles/storage.legacyBucketWriter", [me], None))])  # create+delete, no get
    assert not v.ok and not v.unsure and v.granted == {"create", "delete"}
    v = judge(me, [pol(("roles/storage.objectAdmin", ["serviceAccount:other@p"], None),
                       ("roles/tpu.admin", [me], None))])
    assert not v.ok and not v.unsure
    for unsure in (pol(("roles/storage.objectAdmin", ["group:ml@y"], None)),
                   pol(("roles/storage.objectAdmin", [me], {"expression": "request.time < x"})),
                   pol(("projects/p/roles/writer", [me], None)),
                   pol(("roles/storage.legacyBucketOwner", ["projectEditor:999"], None))):
        v = judge(me, [unsure])
        assert not v.ok and v.unsure, unsure
    project = pol(("roles/editor", [me], None))
    bucket = pol(("roles/storage.legacyBucketOwner", ["projectEditor:123"], None),
                 ("roles/storage.legacyObjectOwner", ["projectEditor:123"], None))
    assert judge(me, [bucket], ("p", "123"), project).ok
    assert not judge(me, [bucket], ("p", "123"), pol(("roles/viewer", [me], None))).ok
