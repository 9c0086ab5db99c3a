"""`tpuctl up/down/status/ls/gc` through the CLI: click's runner against the in-process stand-in, and real
`tpuctl ... --local` subprocesses against the background stand-in that local mode starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from _tpu_fixtures import PROJECT, ZONE, env, fake, fake_server, live  # noqa: F401
from _local_hosts import needs_hosts
from infra.fake_tpu_api import FakeControl
from orchestrator import state
from orchestrator.provider import local as local_provider
from orchestrator.cli.app import cli


def run(*args, ok=True):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert "Traceback" not in res.output
    if ok:
        assert res.exit_code == 0, res.output
    return res


def api(fake):
    return ["--api-endpoint", fake.url, "--project", PROJECT]


def error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, res.stderr
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return lines[0]


def test_up_ls_status_down_v4_and_v5e(fake):
    """Must-show 1 (CLI): v4-16 and v5litepod-16 created, listed with 2 and 4 workers, deleted; nothing left."""
    a = json.loads(run("up", "c-v4", "-a", "v4-16", "--zone", ZONE, "--json", *api(fake)).stdout)
    assert a["state"] == "READY" and len(a["workers"]) == 2 and a["plan"]["hosts"] == 2
    up_text = run("up", "c-v5e", "-a", "v5litepod-16", "--zone", "us-west4-a", "--spot", *api(fake))
    assert "c-v5e is READY in us-west4-a (v5litepod-16, 4 workers)" in up_text.stdout
    assert "plan: c-v5e: v5litepod-16 = 16 chips on 4 host(s), topology 4x4, 256 GiB HBM" in up_text.stderr
    assert "$7.50/hour spot list price" in up_text.stderr  # 16 chips x $0.469

    rows = {r["name"]: r for r in json.loads(run("ls", "--json").stdout)}
    assert {n: len(r["workers"]) for n, r in rows.items()} == {"c-v4": 2, "c-v5e": 4}
    assert set(rows["c-v4"]["workers"][0]) == {"index", "internal_ip", "external_ip"}
    table = run("ls").stdout
    assert table.splitlines()[0].split() == ["NAME", "STATE", "HEALTH", "ACCELERATOR", "ZONE", "WORKERS", "AGE",
                                             "$/HOUR", "COST"]
    assert "READY" in table and "4/4" in table and "25.76" in table

    st = json.loads(run("status", "c-v5e", "--json").stdout)
    assert [w["index"] for w in st["workers"]] == [0, 1, 2, 3] and st["state"] == "READY"
    assert all(w["internal_ip"] and w["external_ip"] for w in st["workers"])
    assert "WORKER  INTERNAL IP" in run("status", "c-v4").stdout

    assert "deleted c-v4" in run("down", "c-v4").stdout
    assert "deleted c-v5e" in run("down", "c-v5e").stdout
    assert live(fake) == ([], []) and json.loads(run("ls", "--json").stdout) == []


@pytest.mark.parametrize("case", ["unknown-accelerator", "not-offered-in-zone", "invalid-name", "spot-and-reserved",
                                  "missing-project", "api-403", "api-429", "api-400"])
def test_bad_input_one_line_with_fix(fake, case):
    """Must-show 4: one clear line with the fix, non-zero exit, and no create call for the invalid inputs."""
    args = ["up", "c-bad", "-a", "v4-8", "--zone", ZONE, *api(fake)]
    expect = {
        "unknown-accelerator": ("unknown accelerator type 'v4-9'; did you mean v4-8", ["-a", "v4-9"]),
        "not-offered-in-zone": ("v5p-8 is not offered in us-central2-b", ["-a", "v5p-8"]),
        "invalid-name": ("invalid slice name 'Bad_Name': use 1-63 lowercase letters", None),
        "spot-and-reserved": ("--spot and --reserved exclude each other", ["--spot", "--reserved"]),
        "missing-project": ("no Google Cloud project: pass --project P", None),
        "api-403": ("permission denied while trying to create a queued resource", None),
        "api-429": ("quota exceeded for v4-8 in us-central2-b (TPUV4PerProjectPerRegionForTPUAPI, per region us-central2): request more", None),
        "api-400": ("the Cloud TPU API rejected the request to create a queued resource", None),
    }
    fragment, extra = expect[case]
    if case == "invalid-name":
        args[1] = "Bad_Name"
    if case == "missing-project":
        args = args[:-2]
    if extra:
        args += extra
    if case == "api-403":
        fake.control.inject("permission")
    if case == "api-429":
        fake.control.inject("quota")
    if case == "api-400":
        fake.control.inject("bad_argument", message="Invalid value for field 'node.networkConfig'")
    res = run(*args, ok=False)
    assert res.exit_code == 1
    line = error_line(res)
    assert fragment in line, line
    fixes = {"unknown-accelerator": "did you mean", "not-offered-in-zone": "try --zone us-central1-a",
             "invalid-name": "e.g. my-slice-1", "spot-and-reserved": "pick one", "missing-project": "GOOGLE_CLOUD_PROJECT",
             "api-403": "roles/tpu.admin", "api-429": "iam-admin/quotas", "api-400": "--runtime-version"}
    assert fixes[case] in line
    calls = fake.control.state()["create_calls"]
    if case.startswith("api-"):
        assert [c["status"] for c in calls] == [int(case[-3:])]
    else:
        assert calls == []
    assert live(fake) == ([], []) and state.records() == {}


def test_no_credentials_is_one_line(env, monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(env / "no-such-key.json"))
    res = run("up", "c-adc", "-a", "v4-8", "--zone", ZONE, "--project", PROJECT, ok=False)
    assert res.exit_code == 1
    assert "no Google Cloud credentials found: run `gcloud auth application-default login`" in error_line(res)


def test_unreachable_endpoint_is_one_line(env):
    res = run("status", "x", "--zone", ZONE, "--project", PROJECT, "--api-endpoint", "http://127.0.0.1:9", ok=False)
    assert "cannot reach the Cloud TPU API at http://127.0.0.1:9" in error_line(res)


def test_stockout_zones_via_cli(fake):
    """Must-show 2 (CLI)."""
    fake.control.inject("stockout", zone="us-central1-a")
    res = run("up", "c-z", "-a", "v5litepod-4", "--zones", "us-central1-a,us-west4-a", "--no-queue", *api(fake))
    assert "no capacity for v5litepod-4 in us-central1-a (stockout); trying us-west4-a" in res.stderr
    assert "READY in us-west4-a" in res.stdout
    bad = run("up", "c-z2", "-a", "v5litepod-4", "--zone", "us-central1-a", "--capacity-wait", "0.3s", *api(fake),
              ok=False)
    assert bad.exit_code == 1
    assert "no capacity for v5litepod-4 in us-central1-a right now (stockout" in error_line(bad)
    nodes, qrs = live(fake)
    assert [n["name"].rsplit("/", 1)[1] for n in nodes] == ["c-z"] and qrs == []


def test_down_twice_unknown_all_and_gc_via_cli(fake):
    """Must-show 5 (CLI) plus `down --all` and `gc`."""
    fake.control.inject("never_ready", times=1)
    kept = run("up", "c-f", "-a", "v4-8", "--zone", ZONE, "--timeout", "0.3s", "--keep-on-failure", *api(fake),
               ok=False)
    assert "kept the queued resource and node c-f" in error_line(kept)
    first = run("down", "c-f")
    assert "deleted c-f" in first.stdout
    again = run("down", "c-f")
    assert "nothing to delete" in again.stdout and again.exit_code == 0
    assert "nothing to delete" in run("down", "never-was").stdout

    run("up", "c-a", "-a", "v4-8", "--zone", ZONE, *api(fake))
    run("up", "c-b", "-a", "v4-8", "--zone", ZONE, "--ttl", "1s", *api(fake))
    refused = run("down", "--all", ok=False)
    assert "pass --yes to confirm" in error_line(refused) and len(live(fake)[1]) == 2
    time.sleep(1.1)  # c-b's TTL passes
    listed = run("gc", "--zones", ZONE, *api(fake))
    assert "c-b" in listed.stdout and "expired" in listed.stdout and "c-a" not in listed.stdout
    assert "run `tpuctl gc --yes`" in listed.stdout and len(live(fake)[1]) == 2
    swept = json.loads(run("gc", "--yes", "--json", "--zones", ZONE, *api(fake)).stdout)
    assert [(i["slice"], i["reason"], i["deleted"]) for i in swept["items"]] == [("c-b", "expired", True)]
    out = json.loads(run("down", "--all", "--yes", "--json").stdout)
    assert [r["name"] for r in out] == ["c-a"]
    assert live(fake) == ([], []) and state.records() == {}


def test_dry_run_and_spec_file(fake, tmp_path):
    spec = tmp_path / "slice.yaml"
    spec.write_text(f"name: c-spec\naccelerator: v4-16\nzone: {ZONE}\nlabels: {{team: nlp}}\nttl: 2h\n")
    dry = run("up", "--spec", spec, "--dry-run", "--json", *api(fake))
    plan = json.loads(dry.stdout)
    assert plan["state"] == "PLANNED" and plan["plan"]["chips"] == 8 and plan["labels"]["team"] == "nlp"
    assert fake.control.state()["create_calls"] == [] and state.records() == {}
    res = json.loads(run("up", "--spec", spec, "-a", "v4-8", "--json", *api(fake)).stdout)  # the flag wins
    assert res["accelerator"] == "v4-8" and res["name"] == "c-spec" and len(res["workers"]) == 1
    assert fake.control.state()["create_calls"][0]["labels"]["team"] == "nlp"
    missing = run("status", "nope", ok=False)
    assert "no slice named nope in the local record" in error_line(missing)


@pytest.mark.parametrize("verb", ["up", "down", "status", "ls", "gc"])
def test_help_explains_every_flag(verb):
    cmd = cli.commands[verb]
    for p in cmd.params:
        if p.param_type_name == "option":
            assert p.help and len(p.help) > 10, f"{verb} {p.opts} has no help"
    text = run(verb, "--help").stdout
    for p in cmd.params:
        if p.param_type_name == "option":
            assert p.opts[-1] in text
    if verb != "ls":
        assert "--api-endpoint" in text and "--local" in text


def test_run_without_a_command_says_what_to_type():
    res = run("run", "x", ok=False)
    assert res.exit_code == 1 and "nothing to run" in res.output and "tpuctl run NAME --" in res.output
    assert "Traceback" not in res.output


# ---- real subprocesses against the local-mode stand-in ---------------------------------------------------

def _tpuctl() -> list[str]:
    exe = Path(sys.executable).with_name("tpuctl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "orchestrator.cli"]


@pytest.fixture
def sub_env(env):
    e = {k: v for k, v in os.environ.items()
         if k not in ("GOOGLE_CLOUD_PROJECT", "TPUCTL_PROJECT", "CLOUDSDK_CORE_PROJECT", "TPUCTL_TPU_API_ENDPOINT")}
    return e  # TPUCTL_HOME, TPUCTL_POLL_S and CLOUDSDK_CONFIG come from the env fixture


def sh(sub_env, *args, check=True, timeout=60):
    p = subprocess.run(_tpuctl() + [str(a) for a in args], env=sub_env, capture_output=True, text=True,
                       timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr
    if check:
        assert p.returncode == 0, p.stderr
    return p


def _local_info() -> dict:
    return json.loads((Path(os.environ["TPUCTL_HOME"]) / "local" / "fake_tpu_api.json").read_text())


@pytest.mark.e2e
def test_local_mode_subprocess_up_ls_down_reuse_restart(sub_env):
    """`tpuctl ... --local` as real processes: the first starts the stand-in, the next reuse it, a dead one is
    restarted; the stand-in's own record shows what was created and that nothing is left."""
    up = json.loads(sh(sub_env, "up", "demo", "--local", "-a", "v4-16", "--json").stdout)
    assert up["project"] == "local-project" and up["zone"] == ZONE and len(up["workers"]) == 2
    info = _local_info()
    ctl = FakeControl(info["url"])
    sh(sub_env, "up", "demo2", "--local", "-a", "v5litepod-16")
    assert _local_info()["pid"] == info["pid"]  # reused, not restarted
    assert [c["id"] for c in ctl.state()["create_calls"]] == ["demo", "demo2"]

    rows = json.loads(sh(sub_env, "ls", "--local", "--json").stdout)
    assert [(r["name"], r["state"], len(r["workers"])) for r in rows] == [("demo", "READY", 2), ("demo2", "READY", 4)]
    assert "deleted demo" in sh(sub_env, "down", "demo").stdout
    assert [n["name"].rsplit("/", 1)[1] for n in ctl.state()["nodes"]] == ["demo2"]

    # A dead stand-in is restarted (with empty state) by the next command; down then has nothing to delete.
    os.kill(info["pid"], signal.SIGKILL)
    gone = sh(sub_env, "down", "demo2")
    assert "nothing to delete: demo2 no longer exists" in gone.stdout
    new = _local_info()
    assert new["pid"] != info["pid"]
    s = FakeControl(new["url"]).state()
    assert s["nodes"] == [] and s["queued_resources"] == [] and state.records() == {}


@pytest.mark.e2e
def test_ctrl_c_while_waiting_leaves_no_orphan(sub_env):
    """Must-show 3 with a real process and a real SIGINT: what was created is deleted, the record is clean."""
    url = local_provider.api_url()  # the same background stand-in the subprocess will reuse
    ctl = FakeControl(url)
    ctl.inject("never_ready")
    proc = subprocess.Popen(_tpuctl() + ["up", "c-int", "--local", "-a", "v4-8"], env=sub_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ctl.state()["nodes"]:  # tpuctl is now waiting for READY
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted while waiting; deleted the queued resource and node c-int: nothing was left behind" in err
    assert "Traceback" not in err
    s = ctl.state()
    assert s["nodes"] == [] and s["queued_resources"] == []
    assert [d["kind"] for d in s["delete_calls"]] == ["queuedResource"]
    assert state.records() == {}


@pytest.mark.parametrize("argv,fragment", [
    (["up", "c-ttl", "-a", "v4-8", "--zone", ZONE, "--ttl", "9" * 400], "invalid --ttl '99999999999999999999...': at most 366d"),
    (["status", "c-x", "-z", "../../etc"], "invalid zone '../../etc'"),
    (["down", "c-x", "-z", "../../etc"], "invalid zone '../../etc'"),
    (["gc", "--zones", "../x"], "invalid zone '../x'"),
], ids=["ttl-400-digits", "status-zone-path", "down-zone-path", "gc-zone-path"])
def test_no_traceback_for_hostile_input(fake, argv, fragment):
    res = run(*argv, *api(fake), ok=False)
    assert res.exit_code == 1 and fragment in error_line(res)
    assert fake.control.state()["create_calls"] == []


def test_a_state_file_that_lacks_fields_is_one_line(fake):
    state.state_path().parent.mkdir(parents=True, exist_ok=True)
    state.state_path().write_text(json.dumps({"version": 1, "slices": {"a": {"name": "a", "zone": ZONE}}}))
    res = run("ls", ok=False)
    assert res.exit_code == 1 and "is damaged (slice 'a' lacks project, accelerator, node)" in error_line(res)


def _fake_run(home: Path, name: str, pid: int, lines: list[str]) -> Path:
    d = home / "runs" / name / "20260101-000000-abcdef"
    d.mkdir(parents=True)
    (d / "w0.log").write_text("".join(f"{x}\n" for x in lines))
    (d / "run.json").write_text(json.dumps({"run_id": d.name, "started": time.time()}))  # no returncode: killed
    (d / "tpuctl.pid").write_text(str(pid))
    return d


def test_logs_tail_refuses_negative_and_follow_ends_when_its_tpuctl_is_gone(env):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _fake_run(state.home(), "lg", dead.pid, ["one", "two", "three"])
    res = run("logs", "lg", "--tail", "-1", ok=False)
    assert res.exit_code == 2 and "-1 is not in the range x>=0" in res.output
    assert run("logs", "lg", "--tail", "2").output.splitlines() == ["[w0] two", "[w0] three"]
    # returns although run.json has no end: follow has no clock of its own, it ends only when it sees the run
    # ended, here by its tpuctl's pid being gone (said on stderr, checked below)
    res = run("logs", "lg", "--follow")
    assert res.output.splitlines()[:3] == ["[w0] one", "[w0] two", "[w0] three"]
    assert f"(pid {dead.pid}) is gone" in res.stderr


def test_up_flags_for_network_identity_and_reservation_reach_the_request(fake):
    fake.control.add_reservation(f"projects/{PROJECT}/locations/{ZONE}/reservations/r1")
    run("up", "c-net", "-a", "v4-8", "--zone", ZONE, "--no-external-ips", "--network", "n1", "--subnetwork", "s1",
        "--service-account", "sa@proj-test.iam.gserviceaccount.com", "--scopes", "cloud-platform,userinfo.email",
        "--reservation", "r1", *api(fake))
    body = FakeControl(fake.url).create_bodies("queuedResource")[-1]
    node = body["tpu"]["nodeSpec"][0]["node"]
    assert body["reservationName"] == f"projects/{PROJECT}/locations/{ZONE}/reservations/r1"
    assert node["networkConfig"] == {"network": "n1", "subnetwork": "s1"}
    assert node["serviceAccount"] == {"email": "sa@proj-test.iam.gserviceaccount.com", "scope": [
        "https://www.googleapis.com/auth/cloud-platform", "https://www.googleapis.com/auth/userinfo.email"]}
    assert json.loads(run("status", "c-net", "--json").output)["workers"][0]["external_ip"] is None


def test_run_on_a_missing_slice_suggests_nothing_run_does_not_take(env):
    res = run("run", "adv-x", "--local", "--raw", "--", "echo", "x", ok=False)
    line = error_line(res)
    assert res.exit_code == 1 and "no slice named adv-x in the local record" in line
    assert "--zone" not in line and "--project" not in line and "tpuctl up adv-x ... --local" in line


def _procs_naming(path: Path) -> list[str]:
    """Processes whose command line names a path under `path` (a local slice's hosts: unshare, sshd)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if p.name.isdigit() and f"{path}/" in cmd:
            out.append(f"{p.name}: {cmd[:120]}")
    return out


@pytest.mark.e2e
@needs_hosts
def test_up_local_killed_at_any_moment_leaves_nothing_down_or_gc_cannot_find(sub_env):
    """SIGKILL of `tpuctl up --local` while it records the slice, while it starts the hosts' sshd, and once they
    run: `down` (or `gc --yes`, when the record is gone too) stops every host process and removes its folder."""
    slices_dir = Path(os.environ["TPUCTL_HOME"]) / "local" / "slices"
    moments = {
        "recorded": lambda n: n in (json.loads(state.state_path().read_text()).get("slices", {})
                                    if state.state_path().exists() else {}),
        "first host starting": lambda n: (slices_dir / n / "w0" / "host.log").exists(),
        "second host starting": lambda n: (slices_dir / n / "w1" / "host.log").exists(),
    }
    local_provider.api_url()  # started once: the moments below are tpuctl's own
    for i, (moment, reached) in enumerate(moments.items()):
        name = f"k{i}"
        proc = subprocess.Popen(_tpuctl() + ["up", name, "--local", "-a", "v4-16"], env=sub_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not reached(name):
                assert proc.poll() is None and time.monotonic() < deadline, (moment, proc.communicate())
                time.sleep(0.002)
            proc.kill()
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == -signal.SIGKILL, moment
        if i == len(moments) - 1:  # the record lost as well: gc finds the hosts by their folder
            state.remove(name)
            out = sh(sub_env, "gc", "--local", "--yes", "--zones", ZONE).stdout
            assert "hosts" in out and name in out, out
        else:
            sh(sub_env, "down", name, "--local")
        left = _procs_naming(slices_dir / name)
        assert left == [] and not (slices_dir / name).exists(), (moment, left)
