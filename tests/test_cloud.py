"""The slice verbs through tpuctl's Python API, with the real google-cloud-tpu client against the stand-in.

Every test asserts on the stand-in's own record (GET /_fake/state): what exists, what was created, deleted."""
from __future__ import annotations

import json
import time

import pytest

from _tpu_fixtures import PROJECT, ZONE, env, fake, fake_server, live, make_spec  # noqa: F401
from orchestrator import slices, state
from orchestrator.provider import cloud
from orchestrator.provider.cloud import CloudError
from orchestrator.spec import UserError


def test_v4_and_v5e_up_ls_workers_down(fake):
    """Must-show 1 (Python API): v4-16 (2 workers) and v5litepod-16 (4 workers), listed, deleted, nothing left."""
    t0 = time.time()
    a = slices.up(make_spec(fake, "t-v4", "v4-16", labels={"team": "nlp"}, ttl_s=3600))
    t1 = time.time()
    b = slices.up(make_spec(fake, "t-v5e", "v5e-16", zones=["us-west4-a"], spot=True))
    assert [w.index for w in a.workers] == [0, 1] and len(b.workers) == 4
    assert b.record.accelerator == "v5litepod-16" and b.record.spot
    assert a.record.price_per_hour == pytest.approx(8 * 3.22) and b.record.price_per_hour == pytest.approx(16 * 0.469)

    calls = fake.control.state()["create_calls"]
    assert [(c["kind"], c["accelerator"], c["spot"]) for c in calls] == [
        ("queuedResource", "v4-16", False), ("queuedResource", "v5litepod-16", True)]
    labels = calls[0]["labels"]
    assert labels["tpuctl-name"] == "t-v4" and labels["team"] == "nlp"
    # the TTL from the moment of `up`, in whole seconds: between the clock before it and after it
    assert int(t0) + 3600 <= int(labels["tpuctl-expiry"]) <= int(t1) + 3600 + 1
    assert calls[1]["labels"]["tpuctl-expiry"] == "never"

    rows = {s.name: s for s in slices.ls()}
    assert set(rows) == {"t-v4", "t-v5e"}
    assert rows["t-v4"].state == "READY" and rows["t-v4"].queued_state == "ACTIVE" and rows["t-v4"].health == "HEALTHY"
    assert len(rows["t-v4"].workers) == 2 and len(rows["t-v5e"].workers) == 4
    assert rows["t-v4"].cost_so_far >= 0 and rows["t-v4"].price_per_hour > 0
    ws = slices.workers("t-v5e")
    assert len({w.internal_ip for w in ws}) == 4 and all(w.external_ip for w in ws)
    assert state.lookup("t-v4").workers == a.workers

    assert slices.down("t-v4").deleted and slices.down("t-v5e").deleted
    nodes, qrs = live(fake)
    assert nodes == [] and qrs == []
    assert state.records() == {}


def test_plain_node_no_queue(fake):
    res = slices.up(make_spec(fake, "t-node", "v4-8", queued=False))
    assert res.record.queued_resource is None and len(res.workers) == 1
    assert [c["kind"] for c in fake.control.state()["create_calls"]] == ["node"]
    assert slices.down("t-node").deleted == [res.record.node]
    assert live(fake) == ([], [])


def test_worker_ips_from_control_api(fake):
    """Nodes created after POST /_fake/workers get those IPs in worker order (the next issue's SSH hosts)."""
    fake.control.set_workers(["127.0.10.1", "127.0.10.2"])
    res = slices.up(make_spec(fake, "t-ips", "v4-16"))
    assert [(w.index, w.internal_ip, w.external_ip) for w in res.workers] == [
        (0, "127.0.10.1", "127.0.10.1"), (1, "127.0.10.2", "127.0.10.2")]
    fake.control.set_node_workers(res.record.node, ["127.0.10.7", "127.0.10.8"])
    assert [w.internal_ip for w in slices.workers("t-ips")] == ["127.0.10.7", "127.0.10.8"]
    # Reading has no side effect; refreshing is the explicit call that writes the record.
    assert [w.internal_ip for w in state.lookup("t-ips").workers] == ["127.0.10.1", "127.0.10.2"]
    assert slices.refresh("t-ips").state == "READY"
    assert [w.internal_ip for w in state.lookup("t-ips").workers] == ["127.0.10.7", "127.0.10.8"]


def test_stockout_falls_through_to_next_zone(fake):
    """Must-show 2: a stockout in the first zone; --zones tries the second; the first leaves nothing behind."""
    fake.control.inject("stockout", zone="us-central1-a", fail_after_s=0.05)
    seen = []
    res = slices.up(make_spec(fake, "t-zones", "v5litepod-16", zones=["us-central1-a", "us-west4-a"]),
                    progress=seen.append)
    assert res.record.zone == "us-west4-a"
    assert [(a.zone, a.outcome) for a in res.attempts] == [("us-central1-a", "capacity"), ("us-west4-a", "ready")]
    assert any("trying us-west4-a" in m for m in seen)
    nodes, qrs = live(fake)
    assert [n["name"].split("/")[3] for n in nodes] == ["us-west4-a"] and len(qrs) == 1
    assert state.lookup("t-zones").zone == "us-west4-a"


def test_stockout_plain_node_falls_through(fake):
    fake.control.inject("stockout", zone="us-central1-a")
    res = slices.up(make_spec(fake, "t-zn", "v5litepod-4", zones=["us-central1-a", "us-west4-a"], queued=False))
    assert res.record.zone == "us-west4-a"
    assert [n["name"].split("/")[3] for n in live(fake)[0]] == ["us-west4-a"]


def test_stockout_single_zone_clear_error_nothing_left(fake):
    """Must-show 2: without --zones a clear capacity error, and nothing left behind (queued and plain)."""
    fake.control.inject("stockout", zone=ZONE)
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-so", capacity_wait_s=0.3))  # waits 0.3 s in WAITING_FOR_RESOURCES
    assert e.value.kind == "capacity"
    assert "no capacity for v4-16 in us-central2-b" in str(e.value) and "--zones" in str(e.value)
    assert "nothing was left behind" in str(e.value) and "quota" not in str(e.value)
    with pytest.raises(CloudError, match="no capacity"):
        slices.up(make_spec(fake, "t-so2", queued=False))
    assert live(fake) == ([], [])
    assert state.records() == {}
    assert len(fake.control.state()["create_calls"]) == 2


def test_queued_stockout_fails_by_valid_until(fake):
    """The stand-in FAILs a waiting queued resource with code 8 once validUntil passes; tpuctl reads it as stockout."""
    fake.control.inject("stockout", zone=ZONE, fail_after_s=0.1)
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-fail", capacity_wait_s=30))
    assert e.value.kind == "capacity" and "no more capacity" in e.value.raw
    assert live(fake) == ([], [])


def test_wait_capacity_keeps_waiting_until_capacity(fake):
    """--wait-capacity: the queued resource waits (even past --capacity-wait) and becomes READY when capacity comes."""
    inj = fake.control.inject("stockout", zone=ZONE)
    lifted = []

    def progress(msg):
        if "WAITING_FOR_RESOURCES" in msg and not lifted:
            time.sleep(0.3)  # longer than capacity_wait_s below: without --wait-capacity it would give up
            fake.control.clear("stockout")
            lifted.append(inj["id"])

    res = slices.up(make_spec(fake, "t-wait", wait_capacity=True, capacity_wait_s=0.1), progress=progress)
    assert lifted and len(res.workers) == 2
    qr = fake.control.state()["create_calls"][0]
    assert qr["kind"] == "queuedResource"


def test_wait_capacity_timeout_keeps_it_queued_and_recorded(fake):
    fake.control.inject("stockout", zone=ZONE)
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-q", wait_capacity=True, timeout_s=0.3))
    assert e.value.kind == "waiting" and "stays queued" in str(e.value)
    rec = state.lookup("t-q")
    assert rec.status == "waiting"
    assert [q["state"]["state"] for q in live(fake)[1]] == ["WAITING_FOR_RESOURCES"]
    fake.control.clear()
    deadline = time.time() + 60  # waits for the event (no measure): a loaded machine's room
    while slices.status("t-q").state != "READY" and time.time() < deadline:
        time.sleep(0.05)
    st = slices.status("t-q")
    assert st.state == "READY" and len(st.workers) == 2
    assert state.lookup("t-q").status == "waiting"  # reading has no side effect
    slices.refresh("t-q")                            # what `tpuctl status` calls
    assert state.lookup("t-q").status == "ready"
    slices.down("t-q")
    assert live(fake) == ([], [])


def test_timeout_after_create_deletes_it(fake):
    """Must-show 3: READY never comes within --timeout -> deleted, record dropped, nothing left."""
    fake.control.inject("never_ready")
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-to", timeout_s=0.4))
    assert e.value.kind == "timeout" and "deleted the queued resource and node t-to" in str(e.value)
    assert live(fake) == ([], []) and state.records() == {}
    deletes = fake.control.state()["delete_calls"]
    assert deletes[0]["kind"] == "queuedResource" and deletes[0]["force"] is True


def test_interrupt_while_waiting_deletes_it(fake):
    """Must-show 3: Ctrl-C (KeyboardInterrupt in the main thread) while waiting -> deleted, nothing left."""
    fake.control.inject("never_ready")

    def progress(msg):
        if "node CREATING" in msg:
            raise KeyboardInterrupt

    with pytest.raises(slices.Interrupted, match="interrupted while waiting; deleted"):
        slices.up(make_spec(fake, "t-int", queued=False), progress=progress)
    assert live(fake) == ([], []) and state.records() == {}
    assert [d["kind"] for d in fake.control.state()["delete_calls"]] == ["node"]


def test_keep_on_failure_records_it_for_down_and_gc(fake):
    """Must-show 3 (the other branch): kept and recorded so that down (and gc) find it."""
    fake.control.inject("never_ready")
    with pytest.raises(CloudError, match=r"kept the queued resource and node t-keep .*tpuctl down t-keep"):
        slices.up(make_spec(fake, "t-keep", timeout_s=0.3, keep_on_failure=True))
    rec = state.lookup("t-keep")
    assert rec.status == "failed" and "READY" in rec.note
    assert len(live(fake)[1]) == 1
    # A record whose delete failed is found the same way: by name.
    assert slices.status("t-keep").state == "CREATING"
    assert slices.down("t-keep").deleted
    assert live(fake) == ([], [])


def test_delete_failure_during_cleanup_keeps_record(fake):
    """If the cleanup itself fails (here: the project loses its permissions mid-wait), the record stays so
    that down/gc can finish the job later."""
    fake.control.inject("never_ready")

    def progress(msg):
        if "node CREATING" in msg and len(fake.control.state()["injections"]) == 1:
            fake.control.inject("permission", op="any")

    with pytest.raises(CloudError, match=r"could not delete .*stays in the local record: run `tpuctl down t-df`"):
        slices.up(make_spec(fake, "t-df"), progress=progress)
    assert state.lookup("t-df").status == "failed"
    fake.control.clear("permission")
    assert len(live(fake)[1]) == 1
    assert slices.down("t-df").deleted
    assert live(fake) == ([], [])


def test_down_twice_unknown_and_failed_queued_resource(fake):
    """Must-show 5."""
    slices.up(make_spec(fake, "t-d"))
    first = slices.down("t-d")
    assert first.deleted and not first.nothing
    second = slices.down("t-d")
    assert second.nothing and second.deleted == [] and "nothing to delete" in second.message
    unknown = slices.down("no-such-slice")
    assert unknown.nothing and "nothing to delete" in unknown.message
    unknown_zone = slices.down("no-such-slice", zone=ZONE, project=PROJECT, api_endpoint=fake.url)
    assert unknown_zone.nothing

    # A FAILED queued resource (here: quota ran out after it was accepted; kept on failure): down deletes it.
    fake.control.inject("quota", times=1, **{"async": True})
    with pytest.raises(CloudError, match="quota exceeded"):
        slices.up(make_spec(fake, "t-f", keep_on_failure=True))
    assert [q["state"]["state"] for q in live(fake)[1]] == ["FAILED"]
    assert slices.status("t-f").state == "FAILED"
    res = slices.down("t-f")
    assert res.deleted == [f"projects/{PROJECT}/locations/{ZONE}/queuedResources/t-f"]
    assert live(fake) == ([], [])


def test_down_unrecorded_by_zone_and_preempted(fake):
    """down finds a slice by name in a zone even without a record, and works on PREEMPTED/SUSPENDED."""
    res = slices.up(make_spec(fake, "t-pre", spot=True))
    fake.control.config(suspend_s=60)     # the service has not begun deleting the preempted node yet
    fake.control.preempt(res.record.node)
    st = slices.status("t-pre")
    assert st.state == "PREEMPTED" and st.queued_state == "SUSPENDING"
    assert cloud.get_node(res.record.node, api_endpoint=fake.url).state == "PREEMPTED"
    assert slices.node("t-pre").state == "PREEMPTED"
    with pytest.raises(UserError, match="PREEMPTED, not READY"):
        slices.workers("t-pre")
    state.remove("t-pre")  # forget it locally: down must still find it by name and zone
    out = slices.down("t-pre", zone=ZONE, project=PROJECT, api_endpoint=fake.url)
    assert out.deleted and live(fake) == ([], [])


def test_recreate_after_preemption(fake):
    res = slices.up(make_spec(fake, "t-rc", spot=True, labels={"run": "r1"}))
    fake.control.preempt(res.record.node)
    again = slices.recreate("t-rc")
    assert again.record.spot and again.record.labels["run"] == "r1" and len(again.workers) == 2
    assert slices.status("t-rc").state == "READY"
    assert [c["kind"] for c in fake.control.state()["create_calls"]] == ["queuedResource"] * 2


def test_stockout_and_quota_are_told_apart(fake):
    """Must-show 6: both arrive as RESOURCE_EXHAUSTED; the user sees which one it is."""
    fake.control.inject("quota", quota="TPUV4PodPerProjectPerZoneForTPUAPI", times=1)  # synchronous 429
    with pytest.raises(CloudError) as q:
        slices.up(make_spec(fake, "t-quota"))
    assert q.value.kind == "quota" and q.value.quota == "TPUV4PodPerProjectPerZoneForTPUAPI"
    assert "request more" in str(q.value) and "TPUV4PodPerProjectPerZoneForTPUAPI" in str(q.value)
    assert "capacity" not in str(q.value).split("API said")[0]

    fake.control.inject("quota", quota="TPUV5sLitepodPerProjectPerZone", times=1, **{"async": True})  # LRO code 8
    with pytest.raises(CloudError) as qa:
        slices.up(make_spec(fake, "t-quota2", "v5litepod-16", zones=["us-west4-a"], queued=False))
    assert qa.value.kind == "quota" and qa.value.quota == "TPUV5sLitepodPerProjectPerZone"

    fake.control.inject("stockout", zone=ZONE)  # LRO code 8 too
    with pytest.raises(CloudError) as s:
        slices.up(make_spec(fake, "t-stock", queued=False))
    assert s.value.kind == "capacity" and "quota" not in str(s.value)
    assert "try other zones" in str(s.value) and "--wait-capacity" in str(s.value)
    assert live(fake) == ([], []) and state.records() == {}


def test_api_errors_explained_no_orphans(fake):
    fake.control.inject("permission", times=1)
    with pytest.raises(CloudError) as p:
        slices.up(make_spec(fake, "t-403"))
    assert p.value.kind == "permission" and "roles/tpu.admin" in str(p.value)
    fake.control.inject("bad_argument", message="Invalid network", times=1)
    with pytest.raises(CloudError) as b:
        slices.up(make_spec(fake, "t-400"))
    assert b.value.kind == "bad-argument" and "Invalid network" in str(b.value)
    assert [c["status"] for c in fake.control.state()["create_calls"]] == [403, 400]
    assert live(fake) == ([], []) and state.records() == {}


def test_zone_listing_is_the_source_of_truth(fake):
    """The catalog says v4 is in us-central2-b; the API (here) disagrees: tpuctl believes the API."""
    fake.control.set_zone(ZONE, ["v4-8"])
    with pytest.raises(UserError, match=r"v4-16 is not offered in us-central2-b \(the API lists there: v4-8\)"):
        slices.up(make_spec(fake, "t-off"))
    fake.control.set_zone("us-east1-d", ["v4-16"])  # not a v4 zone in the catalog, but the API offers it
    res = slices.up(make_spec(fake, "t-on", zones=["us-east1-d"]))
    assert res.record.zone == "us-east1-d"
    assert len(fake.control.state()["create_calls"]) == 1


def test_existing_name_refused_before_create(fake):
    slices.up(make_spec(fake, "t-dup", "v4-8"))
    with pytest.raises(UserError, match="a slice named t-dup already exists"):
        slices.up(make_spec(fake, "t-dup", "v4-8"))
    assert len(fake.control.state()["create_calls"]) == 1


def test_gc_expired_unrecorded_and_stale_records(fake):
    slices.up(make_spec(fake, "t-old", "v4-8", ttl_s=60))
    slices.up(make_spec(fake, "t-lost", "v4-8"))
    slices.up(make_spec(fake, "t-keep2", "v4-8"))
    state.remove("t-lost")                                   # unrecorded: the record was lost
    state.save(state.SliceRecord(name="t-ghost", project=PROJECT, zone=ZONE, accelerator="v4-8",
                                 node=f"projects/{PROJECT}/locations/{ZONE}/nodes/t-ghost",
                                 api_endpoint=fake.url, status="ready", created_at=time.time() - 3600))
    later = time.time() + 120                                # t-old's TTL has passed by then
    found = slices.gc(project=PROJECT, zones=[ZONE], api_endpoint=fake.url, now=later)
    assert not found.applied
    assert sorted((i.slice, i.reason) for i in found.items) == [
        ("t-ghost", "gone"), ("t-lost", "unrecorded"), ("t-old", "expired")]
    assert len(live(fake)[1]) == 3  # listing deletes nothing
    done = slices.gc(yes=True, project=PROJECT, zones=[ZONE], api_endpoint=fake.url, now=later)
    assert all(i.deleted for i in done.items)
    time.sleep(0.2)
    assert [q["name"].rsplit("/", 1)[1] for q in live(fake)[1]] == ["t-keep2"]
    assert sorted(state.records()) == ["t-keep2"]


def test_state_record_is_atomic_and_locked(env, monkeypatch):
    rec = state.SliceRecord(name="a", project="p", zone="z", accelerator="v4-8", node="n")
    state.save(rec)
    before = state.state_path().read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    with monkeypatch.context() as m, pytest.raises(OSError):
        m.setattr(state.os, "replace", boom)
        state.save(state.SliceRecord(name="b", project="p", zone="z", accelerator="v4-8", node="n"))
    assert state.state_path().read_text() == before          # the old record, whole
    assert [p.name for p in state.state_path().parent.iterdir() if p.suffix == ".tmp"] == []
    assert json.loads(before)["slices"]["a"]["node"] == "n"

    import threading
    threads = [threading.Thread(target=state.save, args=(state.SliceRecord(
        name=f"s{i}", project="p", zone="z", accelerator="v4-8", node="n"),)) for i in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(state.records()) == 17                        # no update lost
    assert "secret" not in state.state_path().read_text().lower()


# ---- the real API's answers: each gets its line and its action (next zone, retry, stop) --------------------

TWO = ["us-central1-a", "us-west4-a"]  # two v5e zones: the first one misbehaves


def _arm_stockout(c): c.stockout("us-central1-a")
def _arm_reserved_lro(c): c.reserved_capacity("us-central1-a")
def _arm_reserved_rest(c): c.reserved_capacity("us-central1-a", sync=True)
def _arm_spot_preempted(c): c.spot_preempted_during_create("us-central1-a")


@pytest.mark.parametrize("arm,queued,status,words", [
    (_arm_stockout, False, "RESOURCE_EXHAUSTED", "stockout"),
    (_arm_reserved_lro, False, "FAILED_PRECONDITION", "Insufficient reserved capacity"),
    (_arm_reserved_rest, True, "FAILED_PRECONDITION", "Insufficient reserved capacity"),
    (_arm_reserved_lro, True, "FAILED_PRECONDITION", "Insufficient reserved capacity"),
    (_arm_spot_preempted, False, "INVALID_ARGUMENT", "preempted while it was being created"),
], ids=["stockout-lro", "reserved-lro", "reserved-rest-400", "reserved-queued-failed", "spot-preempted-lro"])
def test_capacity_answers_move_to_the_next_zone(fake, arm, queued, status, words):
    arm(fake.control)
    lines = []
    res = slices.up(make_spec(fake, "t-cap", "v5litepod-4", zones=TWO, queued=queued, spot=True), progress=lines.append)
    assert res.record.zone == "us-west4-a" and [a.zone for a in res.attempts] == TWO
    assert res.attempts[0].outcome == "capacity" and res.attempts[0].status == status
    assert any(l.startswith("no capacity for v5litepod-4 in us-central1-a") and "trying us-west4-a" in l for l in lines)
    # nothing left in the first zone
    nodes, qrs = live(fake)
    assert [n["name"].split("/")[3] for n in nodes + qrs] == ["us-west4-a"] * len(nodes + qrs)


def test_capacity_everywhere_names_what_was_met_and_leaves_nothing(fake):
    fake.control.reserved_capacity("us-central1-a")
    fake.control.stockout("us-west4-a")
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-none", "v5litepod-4", zones=TWO, queued=False))
    assert e.value.action == cloud.NEXT_ZONE
    assert "in us-central1-a, us-west4-a right now (reserved capacity short, stockout)" in str(e.value)
    assert live(fake) == ([], []) and state.records() == {}
    fake.control.clear()
    fake.control.stockout("us-central1-a", fail_after_s=0.1)
    with pytest.raises(CloudError) as w:   # already waiting for capacity: not told to add --wait-capacity
        slices.up(make_spec(fake, "t-none", "v5litepod-4", zones=["us-central1-a"], wait_capacity=True,
                            timeout_s=5))
    assert "--wait-capacity" not in str(w.value)


def _arm_quota(c): c.chip_quota(quota="TPUV5sLitepodPerProjectPerRegionForTPUAPI", zone="us-central1-a")
def _arm_service(c): c.service_disabled()
def _arm_billing(c): c.billing_disabled()
def _arm_policy(c): c.location_policy("us-central1-a")
def _arm_location(c): c.location_forbidden("us-central1-a")
def _arm_iam(c): c.permission_denied()


@pytest.mark.parametrize("arm,kind,words", [
    (_arm_quota, "quota", "(TPUV5sLitepodPerProjectPerRegionForTPUAPI, per region us-central1)"),
    (_arm_service, "service-disabled", f"run `gcloud services enable tpu.googleapis.com --project {PROJECT}`"),
    (_arm_billing, "billing", f"billing is not enabled for project {PROJECT}"),
    (_arm_policy, "location-policy", "organization policy of project proj-test forbids zone us-central1-a"),
    (_arm_location, "zone", "zone us-central1-a is not a Cloud TPU location for project proj-test, or the project "
                            "may not use it"),
    (_arm_iam, "permission", "(missing tpu.queuedResources.create): grant your account roles/tpu.admin"),
], ids=["chip-quota-429", "service-disabled", "billing-disabled", "location-policy", "location-403", "iam"])
def test_refusals_stop_with_their_own_line_and_leave_nothing(fake, arm, kind, words):
    arm(fake.control)
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-stop", "v5litepod-4", zones=TWO))
    assert e.value.kind == kind and e.value.action == cloud.STOP and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    st = fake.control.state()
    assert live(fake) == ([], []) and state.records() == {}
    assert all(c["zone"] == "us-central1-a" for c in st["create_calls"])  # never went on to the next zone


@pytest.mark.parametrize("arm,queued,what", [
    (lambda c: c.rate_limit(op="create", times=2), True, "RESOURCE_EXHAUSTED"),
    (lambda c: c.transient(503, op="get", times=3), True, "UNAVAILABLE"),
    (lambda c: c.transient(500, op="operation", times=2), False, "INTERNAL"),
], ids=["rate-limit-on-create", "503-while-waiting", "500-polling-the-lro"])
def test_rate_limits_and_transient_errors_are_retried_with_one_line(fake, arm, queued, what):
    arm(fake.control)
    lines = []
    res = slices.up(make_spec(fake, "t-retry", "v5litepod-4", zones=TWO, queued=queued), progress=lines.append)
    assert res.record.zone == "us-central1-a" and res.record.status == "ready"
    retries = [l for l in lines if "retrying with backoff" in l]
    assert len(retries) == 1 and what in retries[0], lines
    assert fake.control.state()["injections"] == []   # every injected answer was met


def test_a_transient_error_that_persists_gives_up_with_one_line(fake):
    fake.control.transient(503, op="accelerator_types", times=None)
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-down", "v5litepod-4", zones=TWO))
    assert e.value.kind == "transient" and "(after 5 tries)" in str(e.value) and "\n" not in str(e.value)
    assert fake.control.state()["create_calls"] == []


def test_a_delayed_second_up_of_the_same_name_leaves_the_winners_record(fake, monkeypatch):
    """The second `up` checked the name while it was free, then the first one recorded and created it: the second
    must neither create nor touch the first one's record."""
    import threading
    checked, winner_created = threading.Event(), threading.Event()
    from orchestrator.slices import create
    real_check = create._check_name_free

    def check_then_wait(name):
        real_check(name)
        if threading.current_thread().name == "second":
            checked.set()
            assert winner_created.wait(10)

    monkeypatch.setattr(create, "_check_name_free", check_then_wait)
    errors = []
    second = threading.Thread(name="second", target=lambda: errors.append(_raises(
        lambda: slices.up(make_spec(fake, "t-race", "v4-8")))))
    second.start()
    assert checked.wait(10)
    slices.up(make_spec(fake, "t-race", "v4-8"))                # the winner: READY and recorded
    winner_created.set()
    second.join(20)
    assert isinstance(errors[0], UserError) and "was just recorded by another tpuctl" in str(errors[0])
    assert len(fake.control.state()["create_calls"]) == 1          # the loser never called create
    rec = state.lookup("t-race")
    assert rec is not None and rec.status == "ready" and slices.status("t-race").state == "READY"


def test_an_already_existing_resource_never_drops_someone_elses_record(fake):
    slices.up(make_spec(fake, "t-mine", "v4-8"))
    other = state.lookup("t-mine")
    state.remove("t-mine")                                   # e.g. recorded on another machine
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-mine", "v4-8"))
    assert e.value.kind == "exists" and state.lookup("t-mine") is None
    state.save(other)
    assert not state.release("t-mine", "another-claim") and state.lookup("t-mine") is not None


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


def test_failed_queued_resources_hold_quota_ls_flags_them_gc_deletes_them(fake):
    """A FAILED queued resource that is recorded still counts against quota: ls flags it, gc lists it and deletes
    it only when confirmed (yes=True)."""
    fake.control.stockout(ZONE, fail_after_s=0.3)
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-held", "v4-8", wait_capacity=True, timeout_s=0.1))
    assert e.value.kind == "waiting"
    deadline = time.monotonic() + 60  # waits for the event (no measure): a loaded machine's room
    while live(fake)[1][0]["state"]["state"] != "FAILED":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    [row] = slices.ls()
    assert row.holds_quota and row.queued_state == "FAILED"
    found = slices.gc(project=PROJECT, zones=[ZONE], api_endpoint=fake.url)
    assert [(i.kind, i.slice, i.reason) for i in found.items] == [("queued_resource", "t-held", "holds-quota (FAILED)")]
    assert len(live(fake)[1]) == 1 and state.lookup("t-held")        # not confirmed: nothing deleted
    done = slices.gc(yes=True, project=PROJECT, zones=[ZONE], api_endpoint=fake.url)
    assert all(i.deleted for i in done.items) and state.lookup("t-held") is None
    time.sleep(0.2)
    assert live(fake) == ([], [])


# ---- reservations, and the VMs' network and identity, as the create request carries them ------------------

def _body(fake, kind="queuedResource"):
    return fake.control.create_bodies(kind)[-1]


def test_reservation_by_name_not_found_then_consumed(fake):
    res = f"projects/{PROJECT}/locations/{ZONE}/reservations/team-res"
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-res", "v4-8", reservation="team-res"))
    assert e.value.kind == "reservation" and e.value.action == cloud.STOP
    assert f"reservation not found: {res} does not exist in {ZONE}" in str(e.value)
    assert live(fake) == ([], []) and state.records() == {}
    fake.control.add_reservation(res)
    up = slices.up(make_spec(fake, "t-res", "v4-8", reservation="team-res"))
    body = _body(fake)
    # v2: reservationName on the queued resource and schedulingConfig.reserved on its node; v2alpha1's
    # guaranteed.reserved is not a v2 field (the stand-in refuses it as the API's parser does)
    assert body["reservationName"] == res and "guaranteed" not in body
    assert body["tpu"]["nodeSpec"][0]["node"]["schedulingConfig"] == {"reserved": True}
    assert up.record.reserved and up.record.reservation == res
    assert slices.spec_of(state.lookup("t-res")).reservation == res       # a recreate consumes it again


def test_reserved_without_a_reservation_in_the_zone_moves_on(fake):
    fake.control.add_reservation(f"projects/{PROJECT}/locations/us-west4-a/reservations/r1")
    res = slices.up(make_spec(fake, "t-rz", "v5litepod-4", zones=TWO, reserved=True, queued=False))
    assert res.record.zone == "us-west4-a" and res.attempts[0].status == "FAILED_PRECONDITION"
    assert _body(fake, "node")["schedulingConfig"] == {"reserved": True}
    with pytest.raises(UserError, match="--reservation needs a queued resource"):
        slices.up(make_spec(fake, "t-rz2", "v4-8", reservation="r1", queued=False))


def test_create_request_carries_identity_network_and_metadata(fake):
    slices.up(make_spec(fake, "t-vm", "v4-8"))
    body = _body(fake)["tpu"]["nodeSpec"][0]["node"]
    # by default the cloud-platform scope is sent explicitly; the email is left to the API, which uses the
    # project's default compute service account
    assert body["serviceAccount"] == {"scope": ["https://www.googleapis.com/auth/cloud-platform"]}
    assert body["networkConfig"] == {"enableExternalIps": True}
    assert slices.node("t-vm").service_account.endswith("-compute@developer.gserviceaccount.com")

    keys = "alice:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyForTests alice"
    spec = make_spec(fake, "t-vm2", "v4-16", external_ips=False, network="train-net", subnetwork="train-sub",
                     service_account="trainer@proj-test.iam.gserviceaccount.com",
                     scopes=["https://www.googleapis.com/auth/devstorage.read_write"], metadata={"ssh-keys": keys})
    rec = slices.up(spec).record
    body = _body(fake)["tpu"]["nodeSpec"][0]["node"]
    assert body["serviceAccount"] == {"email": "trainer@proj-test.iam.gserviceaccount.com",
                                      "scope": ["https://www.googleapis.com/auth/devstorage.read_write"]}
    assert body["networkConfig"] == {"network": "train-net", "subnetwork": "train-sub"}  # enableExternalIps false
    assert body["metadata"] == {"ssh-keys": keys}
    assert all(w.external_ip is None and w.internal_ip.startswith("10.") for w in rec.workers) and len(rec.workers) == 2
    again = slices.spec_of(state.lookup("t-vm2"))
    assert (again.external_ips, again.network, again.metadata) == (False, "train-net", {"ssh-keys": keys})
    with pytest.raises(UserError, match="invalid --service-account"):
        slices.up(make_spec(fake, "t-vm3", "v4-8", service_account="not an email"))


def test_gc_default_scan_covers_every_catalog_zone(fake):
    from orchestrator import catalog
    res = slices.gc(project=PROJECT, api_endpoint=fake.url)
    assert set(catalog.all_zones()) <= set(res.zones) and res.skipped_zones == {}
    assert {"us-central1-f", "europe-west4-b", "us-east5-c"} <= set(res.zones)  # v2/v3, v5p/v5e zones included


def test_zone_fallback_keeps_a_slice_still_being_deleted_recorded(fake, monkeypatch):
    """Deleting a multi-host slice takes minutes: when the first zone's leftovers outlast tpuctl's wait, the next
    zone's record carries them (never overwrites them), and `down` deletes them too."""
    fake.control.config(deleting_s=0.05, deleting_per_host_s=1.0)      # a 4-VM slice: 4 s to delete
    from orchestrator.slices import delete
    monkeypatch.setattr(delete, "DELETE_WAIT_BASE_S", 0.2)
    monkeypatch.setattr(delete, "DELETE_WAIT_PER_HOST_S", 0.1)         # tpuctl waits 0.6 s for it
    fake.control.stockout("us-central1-a")
    res = slices.up(make_spec(fake, "t-left", "v5litepod-16", zones=TWO, capacity_wait_s=0.3))
    first = f"projects/{PROJECT}/locations/us-central1-a/queuedResources/t-left"
    assert res.record.zone == "us-west4-a" and first in res.record.leftovers
    assert first in state.lookup("t-left").leftovers
    assert any(q["name"] == first and q["state"]["state"] == "DELETING" for q in live(fake)[1])
    out = slices.down("t-left", timeout_s=30)
    assert live(fake) == ([], []) and state.lookup("t-left") is None and out.deleted


def test_valid_until_outlasts_the_clients_own_capacity_wait(fake):
    fake.control.stockout(ZONE)                                  # no end of its own: only validUntil would end it
    with pytest.raises(CloudError) as e:
        slices.up(make_spec(fake, "t-vu", "v4-8", capacity_wait_s=0.3))
    assert "right now (stockout: still WAITING_FOR_RESOURCES after --capacity-wait 0.3s)" in str(e.value)
    vu = float(fake.control.create_bodies("queuedResource")[-1]["queueingPolicy"]["validUntilDuration"].rstrip("s"))
    assert vu >= 0.3 + slices.VALID_UNTIL_MARGIN_S - 1
    assert live(fake) == ([], []) and state.records() == {}


def test_capacity_wait_counts_while_the_create_operation_is_pending(fake):
    fake.control.inject("pending_create", zone="us-central1-a", pending_s=60)
    lines = []
    res = slices.up(make_spec(fake, "t-pend", "v5litepod-4", zones=TWO, capacity_wait_s=0.3), progress=lines.append)
    assert res.record.zone == "us-west4-a"
    assert "stockout: create operation still pending after --capacity-wait 0.3s" in res.attempts[0].detail
    assert [q["name"].split("/")[3] for q in live(fake)[1]] == ["us-west4-a"]
