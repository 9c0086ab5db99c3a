"""Multislice on the cloud half: one queued resource with multisliceParams through the real google-cloud-tpu client
against the TPU API stand-in (nodes NAME-0 .. NAME-(N-1), all or none, one state, force delete of every node), the
refusals before anything is created, and the per-host environment of one job over several slices."""
from __future__ import annotations

import json

import pytest

from _skips import needs_libtpu
from _tpu_fixtures import PROJECT, ZONE, env, fake, fake_server, live, make_spec  # noqa: F401
from orchestrator.jobs import launch as L
from orchestrator import slices, state
from orchestrator.jobs import supervise
from orchestrator.spec import SliceSpec, UserError, slice_spec_from_mapping
from orchestrator.state import Worker


def _short(names):
    return sorted(n.rsplit("/", 1)[-1] for n in names)


def test_up_sends_one_multislice_queued_resource_and_down_deletes_every_slice(fake):
    res = slices.up(make_spec(fake, "ms", "v4-8", num_slices=2))
    # One create call: a queued resource whose node spec carries multisliceParams instead of a nodeId.
    calls = fake.control.state()["create_calls"]
    assert [c["kind"] for c in calls] == ["queuedResource"], calls
    spec = calls[0]["body"]["tpu"]["nodeSpec"]
    assert len(spec) == 1 and "nodeId" not in spec[0], spec
    assert spec[0]["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "ms"}
    assert spec[0]["node"]["acceleratorType"] == "v4-8"
    nodes, qrs = live(fake)
    assert _short(n["name"] for n in nodes) == ["ms-0", "ms-1"] and len(qrs) == 1
    # Each slice's worker is its own host, listed slice-major (the JAX process order).
    ws = res.record.workers
    assert [(w.slice, w.index) for w in ws] == [(0, 0), (1, 0)] and ws[0].internal_ip != ws[1].internal_ip
    assert [w.name for w in ws] == ["s0w0", "s1w0"]
    # The plan is N x the slice; the record keeps the slice count.
    assert (res.plan.chips, res.plan.hosts, res.plan.slices) == (8, 2, 2)
    assert "2 x v4-8" in res.plan.summary()
    one = slices.make_plan(make_spec(fake, "x", "v4-8"), PROJECT)
    assert res.plan.price_per_hour == pytest.approx(2 * one.price_per_hour) and res.plan.price_per_hour > 0
    st = slices.status("ms")
    assert st.state == "READY" and st.slices == 2 and st.hosts == 2 and len(st.workers) == 2
    assert [(d["slice"], d["state"]) for d in st.nodes] == [(0, "READY"), (1, "READY")]
    assert [w.slice for w in slices.workers("ms")] == [0, 1]

    # One slice preempted: the whole job's slice is lost (the supervisor recreates every slice).
    fake.control.preempt("ms-1")
    assert supervise.node_state("ms") in supervise.LOST
    assert [d["state"] for d in slices.status("ms").nodes][0] == "READY"  # slice 0 lives until the delete
    assert "slice 1 (ms-1) of 2 was" in supervise._what_was_lost("ms", state.lookup("ms"), None)

    # down: the queued resource with force, taking every node; idempotent.
    out = slices.down("ms")
    assert out.deleted and not out.nothing
    assert live(fake) == ([], [])
    deletes = fake.control.state()["delete_calls"]
    assert [(d["kind"], d["force"]) for d in deletes if d["kind"] == "queuedResource"][0] == ("queuedResource", True)
    assert slices.down("ms").nothing and state.lookup("ms") is None


def test_all_or_none_with_zone_fallback_and_recreate(fake):
    fake.control.set_zone("us-central2-a", ["v4-8"])
    fake.control.stockout("us-central2-a")
    res = slices.up(make_spec(fake, "mz", "v4-8", num_slices=2, zones=["us-central2-a", ZONE],
                                capacity_wait_s=0.3))
    assert [a.outcome for a in res.attempts] == ["capacity", "ready"] and res.record.zone == ZONE
    nodes, qrs = live(fake)
    assert _short(n["name"] for n in nodes) == ["mz-0", "mz-1"] and [q["name"].split("/")[3] for q in qrs] == [ZONE]
    # recreate sends the same multislice spec again (what the supervisor does after a preemption)
    fake.control.preempt("mz-0")
    again = slices.recreate("mz")
    assert again.record.slices == 2 and len(again.workers) == 2
    bodies = fake.control.create_bodies("queuedResource")
    assert bodies[-1]["tpu"]["nodeSpec"][0]["multisliceParams"]["nodeCount"] == 2
    slices.down("mz")
    assert live(fake) == ([], [])


def test_gc_knows_an_unrecorded_multislice_queued_resource(fake):
    slices.up(make_spec(fake, "mg", "v4-8", num_slices=2))
    state.remove("mg")  # an `up` killed after the create call and before its record was kept
    found = slices.gc(project=PROJECT, zones=[ZONE], api_endpoint=fake.url)
    # The queued resource is the one thing to delete: its nodes go with it (force).
    assert [(i.kind, i.reason) for i in found.items] == [("queued_resource", "unrecorded")], found.items
    slices.gc(project=PROJECT, zones=[ZONE], api_endpoint=fake.url, yes=True)
    assert {q["state"]["state"] for q in live(fake)[1]} <= {"DELETING"}  # being deleted, with every node
    assert {n["state"] for n in live(fake)[0]} <= {"DELETING"}
    assert [d["force"] for d in fake.control.state()["delete_calls"]] == [True]


@pytest.mark.parametrize("kw, words", [
    (dict(accelerator="v3-8", num_slices=2), "needs v4 or later"),
    (dict(accelerator="v2-8", num_slices=2), "needs v4 or later"),
    (dict(accelerator="v4-8", num_slices=2, queued=False), "drop --no-queue"),
    (dict(accelerator="v4-8", num_slices=0), r"from 1 \(one slice\)"),
])
def test_refused_before_anything_is_created(fake, kw, words):
    acc = kw.pop("accelerator")
    with pytest.raises(UserError, match=words):
        slices.up(make_spec(fake, "bad", acc, **kw))
    assert fake.control.create_bodies() == [] and state.lookup("bad") is None


def test_spec_file_num_slices_is_typed():
    assert slice_spec_from_mapping({"name": "a", "accelerator": "v4-8", "num_slices": 2}).num_slices == 2
    with pytest.raises(UserError, match="num_slices"):
        slice_spec_from_mapping({"name": "a", "accelerator": "v4-8", "num_slices": "2"})
    assert SliceSpec(name="a", accelerator="v5e-8", num_slices=4).validate().num_slices == 4


def test_the_stand_in_refuses_a_multislice_spec_the_service_refuses(fake):
    from google.api_core import exceptions as gexc
    from orchestrator.provider import cloud
    api = cloud.connect(api_endpoint=fake.url, project=PROJECT)
    body = api.node_body("v4-8", "tpu-ubuntu2204-base", {"tpuctl-name": "m1"}, in_queue=True)
    with pytest.raises(UserError, match="nodeCount must be greater than 1"):
        # MultisliceParams.node_count: "This needs to be > 1" (google-cloud-tpu v2 types)
        import google.cloud.tpu_v2 as tpu_v2
        NodeSpec = tpu_v2.QueuedResource.Tpu.NodeSpec
        qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[NodeSpec(
            parent=api.parent(ZONE), node=body, multislice_params=NodeSpec.MultisliceParams(node_count=1))]))
        try:
            api.client.create_queued_resource(parent=api.parent(ZONE), queued_resource_id="m1", queued_resource=qr)
        except gexc.GoogleAPICallError as e:
            raise UserError(str(e)) from None
    # Without force a multislice queued resource with nodes is not deleted (nor are its nodes).
    api.create_queued_resource(ZONE, "m2", "m2", body, node_count=3)
    slices_ready = lambda: len([n for n in live(fake)[0] if n["state"] == "READY"]) == 3  # noqa: E731
    import time
    deadline = time.monotonic() + 60  # waits for the event (no measure): a loaded machine's room
    while not slices_ready() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _short(n["name"] for n in live(fake)[0]) == ["m2-0", "m2-1", "m2-2"]
    q = api.get_queued_resource(f"{api.parent(ZONE)}/queuedResources/m2")
    assert q.state == "ACTIVE" and _short(q.nodes) == ["m2-0", "m2-1", "m2-2"]
    with pytest.raises(UserError):
        api.delete_queued_resource(q.name, force=False)
    assert api.delete_queued_resource(q.name, force=True)
    assert {n["state"] for n in live(fake)[0]} <= {"DELETING"}


def test_one_job_over_two_slices_gets_slice_major_ids_and_megascale_env():
    ws = [Worker(0, "10.0.1.2", slice=1), Worker(1, "10.0.1.3", slice=1), Worker(0, "10.0.0.2", slice=0),
          Worker(1, "10.0.0.3", slice=0)]
    ordered = sorted(ws, key=L.process_order)
    assert [w.name for w in ordered] == ["s0w0", "s0w1", "s1w0", "s1w1"]
    spec = L.LaunchSpec(argv=["python", "-m", "trainer"], **L.timeouts(ordered, None, None))
    envs = [L.host_env(spec, ordered, i) for i in range(4)]
    assert [e["TPUCTL_PROCESS_ID"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["TPUCTL_COORDINATOR"] for e in envs} == {"10.0.0.2:8476"}
    assert {e["MEGASCALE_COORDINATOR_ADDRESS"] for e in envs} == {"10.0.0.2"}
    assert [e["MEGASCALE_SLICE_ID"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["MEGASCALE_NUM_SLICES"] for e in envs} == {"2"}
    # Patient coordination timeouts on several slices; the user's own win.
    assert (spec.heartbeat_timeout_s, spec.init_timeout_s) == (L.MULTISLICE_HEARTBEAT_TIMEOUT_S,
                                                               L.MULTISLICE_INIT_TIMEOUT_S)
    assert L.timeouts(ordered, 5, 7) == {"heartbeat_timeout_s": 5, "init_timeout_s": 7}
    assert L.timeouts([Worker(0, "a")], None, None) == {"heartbeat_timeout_s": 10, "init_timeout_s": 60}
    # Set in the host command itself, before Python starts; one slice gets none of them.
    cmd = L.host_command(spec, ordered, 2, layout=L.HostLayout(), wrap_python="python3", env_python="py")
    assert cmd.index("MEGASCALE_SLICE_ID=1") < cmd.index(" -- ")
    single = L.host_env(spec, [Worker(0, "a"), Worker(1, "b")], 1)
    assert not any(k.startswith("MEGASCALE_") for k in single)
    with pytest.raises(L.LaunchError, match="MEGASCALE_SLICE_ID"):
        L.parse_env(["MEGASCALE_SLICE_ID=3"])


def test_multislice_plan_arithmetic_dcn_bytes_and_time_beside_compute():
    """The DCN figures from one slice's compiled figures (no compile here: the figures are given)."""
    from orchestrator import catalog
    from orchestrator.plan import step as P
    from orchestrator.plan import dcn as plan_dcn
    figs = {"params_bytes": 2 ** 30, "grad_bytes": 2 ** 30, "optimizer_bytes": 2 ** 31, "temp_bytes": 2 ** 30,
            "total_bytes": 5 * 2 ** 30, "flops": 4e12, "model_flops_per_token": 1e9, "tokens_per_step": 4096,
            "devices": 8, "mesh": {"data": 4, "model": 2}, "settings": {"batch_size": 32}, "argument_bytes": 0,
            "output_bytes": 0, "alias_bytes": 0, "code_bytes": 0, "bytes_accessed": 0, "dtype": "bfloat16",
            "compile_s": 1.0}
    one = P.Plan(catalog.lookup("v4-16"), P.TPU, figs, mfu=0.5)
    m = plan_dcn.MultislicePlan(one, 4, 32, grad_bytes=2 * 2 ** 30, dcn_gbps=100)
    # ring all-reduce over 4 slices: 2 * 3/4 of 2 GiB through each slice, over its 2 hosts
    assert m.dcn_bytes_per_host == pytest.approx(1.5 * 2 ** 30)
    assert m.dcn_s == pytest.approx(1.5 * 2 ** 30 * 8 / 100e9)
    assert m.compute_s == pytest.approx(one.step_s(0.5)) and m.compute_s > 0
    text = m.render()
    assert "4 x v4-16 joined by DCN = 32 chips, 8 host(s)" in text and "32 / 4 = 8 sequences per slice" in text
    assert "1.50 GiB sent and received by each host" in text and "at 100 Gbit/s" in text and "compute step" in text
    assert "compiled: not counted" in text  # figures without the compiler's DCN count say so
    assert m.to_json()["dcn_bytes_per_host_per_step"] == m.dcn_bytes_per_host
    with pytest.raises(UserError, match="needs v4 or later"):
        plan_dcn.plan("v3-8", ["pretrain"], 2)
    # Suggestions split the batch over dcn x data (2 x 4 = 8), not data alone: batch 8 has no smaller share.
    tight = {**figs, "devices": 8, "mesh": {"dcn": 2, "data": 4, "model": 1}, "temp_bytes": 34 * 2 ** 30,
             "total_bytes": 40 * 2 ** 30, "settings": {"batch_size": 8, "grad_accum": 1, "steps": 1, "n_head": 12},
             "levers": ["grad_accum", "batch_size", "mesh_model"]}
    assert P.suggest(P.Plan(catalog.lookup("v4-8"), P.TPU, tight)) == []
    wider = {**tight, "settings": {**tight["settings"], "batch_size": 16}}
    assert sorted(s.change for s in P.suggest(P.Plan(catalog.lookup("v4-8"), P.TPU, wider))) == [
        "--batch-size 8", "--grad-accum 2"]


def test_collectives_that_cross_slices_in_either_compilers_text():
    """libtpu's one-slice program sends what crosses slices to its DCN runtime; the CPU program's collectives
    name their devices (device i is on slice i // devices-per-slice)."""
    from trainer.common import collectives as C
    tpu = "\n".join([
        "HloModule jit__train_step, num_partitions=4",
        "  %p = f32[8,128]{1,0} parameter(0)",
        '  %send.1 = (f32[2,128]{1,0:T(8,128)}, u32[], token[]) send(%x, %t), channel_id=3, is_host_transfer=true, '
        'frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}',
        "  %ag = f32[8,128]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}"])
    assert C.crossing(tpu, 8, 2) == {"dcn_send_ops": 1, "dcn_send_bytes": 2 * 128 * 4,
                                     "dcn_ops_by_kind": {"all-reduce": 1}}
    cpu = "\n".join([
        "HloModule jit__train_step, num_partitions=8",
        "  %a = f32[16]{0} parameter(0)",
        "  %b = bf16[4,4]{1,0} parameter(1)",
        "  %r1 = (f32[16]{0}, bf16[4,4]{1,0}) all-reduce(%a, %b), channel_id=1, "
        "replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, to_apply=%add",
        "  %r2 = f32[16]{0} all-reduce(%a), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add",
        "  %r3 = f32[16]{0} all-reduce-start(%a), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
        "  %r4 = f32[16]{0} all-reduce-done(%r3)",
        "  %cp = bf16[4,4]{1,0} collective-permute(%b), channel_id=4, source_target_pairs={{0,1},{1,0}}"])
    assert C.crossing(cpu, 8, 2) == {"dcn_send_ops": 2, "dcn_send_bytes": 2 * 64 + 32,
                                     "dcn_ops_by_kind": {"all-reduce": 2}}
    assert C.crossing(cpu, 8, 1)["dcn_send_ops"] == 0


@needs_libtpu
def test_plan_on_two_slices_compiles_the_hybrid_step_and_run_checks_it(env, capsys):
    """gpt2-tiny on 2 x v5e-8: the step over 16 devices (dcn=2 x data=8), and the gradient's reduction over DCN:
    each device hands its 1/8 share of the gradient to it, once (the tied table's lookup and output layer add
    their gradients before the reduction: xent.per_shard; reduced apart, the table's share, 94% of gpt2-tiny,
    crossed twice). `run`'s gate plans the same step (from the cache); a batch that does not split over dcn x
    data is one line."""
    from click.testing import CliRunner
    from orchestrator.cli.app import cli
    from orchestrator.plan import step as P
    argv = ["pretrain", "--preset", "gpt2-tiny", "--batch-size", "16", "--ckpt-dir", "/tmp/ms-plan"]
    res = CliRunner().invoke(cli, ["plan", "-a", "v5litepod-8", "--num-slices", "2", "--json", "--", *argv])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    f = out["slice"]
    assert f["mesh"] == {"dcn": 2, "data": 8, "model": 1} and f["devices"] == 16 and f["compiler"] == "tpu"
    assert out["dcn_ops_by_kind"].keys() == {"all-reduce"} and out["dcn_send_ops"] >= 1
    share = f["per_device"]["params_bytes"] / 8  # the gradient (f32, replicated like the params) over data=8
    # the table's f32 share crosses once (twice, if its two uses were reduced apart); the compiler sends some
    # other gradients in bf16, so the whole is between the table's share and the f32 share (+ tile padding)
    table = 50304 * 128 * 4 / 8
    assert table <= out["dcn_send_bytes"] <= 1.03 * share < 2 * table, (out["dcn_send_bytes"], share, table)
    said = []
    P.check_before_run("v5litepod-8", 2, argv, {}, cpu_devices=False, say=said.append)
    assert len(said) == 1 and said[0].startswith(
        f"plan: fits on 2 x v5litepod-8: {P.gib(f['per_device']['total_bytes'])} of 16.00 GiB HBM per device")
    assert said[0].endswith(f"(2 slices joined by DCN: {out['dcn_send_ops']} DCN collective(s), "
                            f"{P.gib(out['dcn_send_bytes'])} per device per step)")
    bad = CliRunner().invoke(cli, ["plan", "-a", "v5litepod-8", "--num-slices", "2", "--",
                                   *argv[:4], "12", *argv[5:]])
    assert bad.exit_code == 1 and bad.stderr.strip().splitlines()[-1] == (
        "Error: --batch-size 12 is not divisible by the mesh's data axis (16 over 2 slices); use a multiple of 16")


def test_the_trainer_groups_cpu_devices_by_slice_from_the_process_index(monkeypatch):
    """Local mode has no slice_index: a slice is H consecutive processes (slice-major ids)."""
    from collections import namedtuple
    from trainer.common import mesh as mesh_lib
    from trainer.common.config import UsageError
    Dev = namedtuple("Dev", "id process_index platform")
    devs = [Dev(i, i // 2, "cpu") for i in range(8)]  # 4 processes x 2 devices
    groups = mesh_lib.slice_groups(devs[::-1], n_slices=2, n_processes=4)
    assert [[d.id for d in g] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [mesh_lib.slice_of_process(p, 4, 2) for p in range(4)] == [0, 0, 1, 1]
    with pytest.raises(UsageError, match="do not split"):
        mesh_lib.slice_groups(devs, n_slices=3, n_processes=4)
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    assert mesh_lib.slices() == (2, 1)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "2")
    with pytest.raises(UsageError, match="not a slice"):
        mesh_lib.slices()
    monkeypatch.delenv("MEGASCALE_NUM_SLICES")
    monkeypatch.delenv("MEGASCALE_SLICE_ID")
    one = mesh_lib.job_mesh("data=2,model=1", devices=__import__("jax").devices()[:2])
    assert mesh_lib.describe(one) == "data=2,model=1" and mesh_lib.shape_of(one) == {"data": 2, "model": 1}
    with pytest.raises(UsageError, match="each of the 2 slices"):
        mesh_lib.job_mesh("data=4,model=1", devices=__import__("jax").devices()[:4], n_slices=2, n_processes=1)


def test_the_planner_builds_lora_on_the_hybrid_mesh_as_the_run_does():
    """`lora` on 2 slices of 4 devices (the step built, not compiled): dcn=2 x data=4, and its default batch of 4
    rows per device over all 8; a batch that does not split over dcn x data is the run's own refusal."""
    import jax
    from trainer.cli import parser
    from trainer.common import aot
    from trainer.common.config import UsageError
    target = aot.Target(jax.devices()[:8], processes=2, run_platform="tpu", slices=2)
    argv = ["lora", "--weights", "gs://b/g", "--data", "gs://b/t.jsonl", "--ckpt-dir", "gs://b/l", "--model",
            "gemma2-2b", "--rank", "8"]
    built = aot.BUILDERS["lora"](parser().parse_args(argv), target)
    assert built.mesh == {"dcn": 2, "data": 4, "model": 1} and built.settings["batch_size"] == 32
    with pytest.raises(UsageError, match=r"data axis \(8 over 2 slices\)"):
        aot.BUILDERS["lora"](parser().parse_args([*argv, "--batch-size", "12"]), target)
