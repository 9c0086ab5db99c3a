"""A run's metrics live with the run, every run gets a report, and W&B logging is optional.

One tiny run of two processes joined by jax.distributed trains into gs:// (the GCS emulator) with
`--wandb` in offline mode; then a sample is taken from it on "the laptop". From that one run:
- TensorBoard events and metrics.jsonl are under the gs:// prefix, readable by TensorBoard's own reader from
  gs://, and nothing is written into the folder either process was started from;
- the W&B run dir lands under <ckpt-dir>/wandb/, its history (read from the .wandb file with wandb's own
  protobuf records) holds the losses of metrics.jsonl; process 1 wrote nothing; the key is in no log or file;
- `python -m trainer report` charts it and summarises config, mesh, hosts, goodput and the final sample;
- `tpuctl report NAME` finds the run from its record in $TPUCTL_HOME/runs/NAME (the slice itself is gone)
  and makes the same report on this machine through the emulator, goodput included.
"""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import pytest

from _trainer_util import REPO, TINY, Procs, env, session_cache, shakespeare, tail
from infra import gcs

NAME = "rep"
CKPT = "gs://runs/r"
KEY = "wandb-key-" + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tpuctl-home")


@pytest.fixture(scope="module")
def emu(home):
    e = gcs.start(home=home, buckets=("runs",))  # recorded in this TPUCTL_HOME: `tpuctl report` finds it
    yield e
    e.stop()


def _client(emu):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    return storage.Client(project="local", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": emu.endpoint})


@pytest.fixture(scope="module")
def trained(emu, home, tmp_path_factory):
    """Two processes train 4 steps into gs://runs/r with --wandb (offline), each in an empty folder of its own;
    then a sample is recorded. Returns the folder of each process and their logs."""
    tmp = tmp_path_factory.mktemp("run")
    cache, data = session_cache(tmp_path_factory), shakespeare(tmp_path_factory)
    port, procs = free_port(), Procs()
    cwds, homes = [tmp / f"cwd{i}" for i in range(2)], [tmp / f"home{i}" for i in range(2)]
    try:
        started = []
        for i, cwd in enumerate(cwds):
            cwd.mkdir()
            homes[i].mkdir()
            e = env(cache, devices=None, **emu.env, TPUCTL_COORDINATOR=f"127.0.0.1:{port}",
                    TPUCTL_NUM_PROCESSES="2", TPUCTL_PROCESS_ID=str(i), TPUCTL_INIT_TIMEOUT_S="120",
                    WANDB_MODE="offline", WANDB_API_KEY=KEY, HOME=str(homes[i]))
            e.pop("WANDB_DIR", None)
            with open(tmp / f"w{i}.log", "w") as log:
                p = subprocess.Popen([sys.executable, "-m", "trainer", "pretrain", "--data", data, *TINY,
                                      "--emulate-devices", "2", "--mesh", "data=2,model=2", "--steps", "4",
                                      "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
                                      "--ckpt-every", "0", "--wandb", "tpuctl-test", "--ckpt-dir", CKPT],
                                     cwd=cwd, env={**e, "PYTHONPATH": str(REPO)}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            p.log = tmp / f"w{i}.log"
            procs.procs.append(p)
            started.append(p)
        logs = lambda: "\n".join(tail(p.log) for p in started)  # noqa: E731
        assert [p.wait(timeout=400) for p in started] == [0, 0], logs()
        s = subprocess.run([sys.executable, "-m", "trainer", "sample", "--ckpt-dir", CKPT, "--prompt", "ROMEO:",
                            "--max-new-tokens", "3", "--temperature", "0"], cwd=tmp,
                           env=env(cache, devices=1, **emu.env), capture_output=True, text=True, timeout=300)
        assert s.returncode == 0, s.stderr[-3000:]
    finally:
        procs.close()
    return {"cwds": cwds, "homes": homes, "logs": [p.log for p in started], "sample": s.stdout.strip().splitlines()[-1]}


READ_EVENTS = r"""
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"""


@pytest.mark.slow  # the module's one run: ~50 s on 2 cores, shared by these tests
def test_events_and_metrics_stay_under_the_gs_prefix_and_nothing_in_the_start_folder(trained, emu, tmp_path):
    assert "(ppl " in trained["logs"][0].read_text()  # perplexity beside the validation loss (the last step)
    client = _client(emu)
    names = [b.name for b in client.list_blobs("runs", prefix="r/")]
    events = [n for n in names if n.startswith("r/tensorboard/events.out.tfevents.")]
    assert len(events) == 1, names  # process 0's
    lines = client.bucket("runs").blob("r/metrics.jsonl").download_as_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2, 3, 4]
    # TensorBoard's reader, pointed at gs:// as `tensorboard --logdir gs://runs/r/tensorboard` would be.
    r = subprocess.run([sys.executable, "-c", READ_EVENTS, f"{CKPT}/tensorboard"], cwd=tmp_path, capture_output=True,
                       env=env("", devices=None, **emu.env), text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    scalars = json.loads(r.stdout.strip().splitlines()[-1])
    want = {json.loads(ln)["step"]: json.loads(ln)["loss"] for ln in lines}
    assert {s: pytest.approx(v, rel=1e-6) for s, v in want.items()} == {s: v for s, v in scalars["train/loss"]}
    assert [s for s, _ in scalars["train/val_loss"]] == [4]
    assert [list(c.iterdir()) for c in trained["cwds"]] == [[], []]
    assert list(tmp_path.iterdir()) == []


def wandb_records(path: Path):
    """The records of a .wandb file: wandb's leveldb-style log (7-byte header ':W&B', magic, version; then
    32 KiB blocks of records: crc32 (seeded with the type byte), length, type FULL/FIRST/MIDDLE/LAST, data),
    each a wandb.proto Record."""
    from wandb.proto import wandb_internal_pb2 as pb
    raw = path.read_bytes()
    assert struct.unpack("<4sHB", raw[:7])[:2] == (b":W&B", 0xBEE1)
    pos, buf = 7, b""
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        crc, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
        buf += data
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


@pytest.mark.slow
def test_wandb_offline_history_holds_the_logged_losses_from_process_0_only(trained, emu, tmp_path):
    client = _client(emu)
    names = [b.name for b in client.list_blobs("runs", prefix="r/wandb/")]
    runs = {n.split("/")[2] for n in names if n.split("/")[2].startswith("offline-run-")}
    assert len(runs) == 1, names  # one W&B run: process 0's
    blob = next(n for n in names if n.endswith(".wandb"))
    local = tmp_path / "run.wandb"
    client.bucket("runs").blob(blob).download_to_filename(str(local))
    history = {}
    for rec in wandb_records(local):
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history[items["_step"]] = items
    logged = [json.loads(ln) for ln in client.bucket("runs").blob("r/metrics.jsonl").download_as_text().splitlines()]
    assert sorted(history) == [r["step"] for r in logged] == [1, 2, 3, 4]
    for r in logged:
        assert history[r["step"]]["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
    assert history[4]["train/val_loss"] == pytest.approx(logged[-1]["val_loss"], rel=1e-6)
    # Neither process wrote into the folder it was started from; process 1 never started wandb.
    assert [list(c.iterdir()) for c in trained["cwds"]] == [[], []]
    assert [p for p in trained["homes"][1].rglob("*") if "wandb" in p.name.lower()] == []
    # The key: in no log of either process, in no file W&B wrote.
    for log in trained["logs"]:
        assert KEY not in log.read_text()
    for n in names:
        assert KEY.encode() not in client.bucket("runs").blob(n).download_as_bytes(), n


def _check_report(res: dict, files_at) -> None:
    s = res["summary"]
    assert s["mesh"].startswith("data=2,model=2 over 4 cpu device(s)"), s
    assert s["hosts"].startswith("2 process(es): 0: "), s
    assert res["run_info"]["processes"] == 2 and len(res["run_info"]["hosts"]) == 2
    assert "n_layer=1" in s["config"] and "wandb=tpuctl-test" in s["config"]
    assert s["final sample"].startswith("step 4, prompt 'ROMEO:'") and res["sample"]["text"].startswith("ROMEO:")
    assert "(perplexity " in s["results"]
    png = files_at("run.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    page = files_at("report.html").decode()
    assert "data:image/png;base64," in page and "final sample" in page and res["sample"]["text"] in page


@pytest.mark.slow
def test_trainer_report_charts_the_run_and_summarises_mesh_hosts_and_sample(trained, emu, tmp_path):
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, "-m", "trainer", "report", "--ckpt-dir", CKPT, "--out", str(out), "--json"],
                       env=env("", devices=None, **emu.env), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    _check_report(res, lambda f: (out / f).read_bytes())
    assert res["summary"]["goodput"].startswith("not known here") and res["goodput"] is None
    text = res["summary"]["where the time goes"]
    assert "Per host" in text and "process 1" in text
    # The page stays one file: its sections and charts (the hosts' step times too) drawn in a real browser.
    from _browser_util import CHROMIUM, TAB_BLUE, look, near, pixels
    page = (out / "report.html").read_text()
    assert "<h2>where the time goes</h2>" in page and 'alt="hosts"' in page and "http" not in page.split("<body>")[1]
    assert near(pixels((out / "hosts.png").read_bytes()), TAB_BLUE) > 50
    if CHROMIUM:
        px, console = look(out / "report.html", tmp_path, height=4000)
        assert console == [] and near(px, TAB_BLUE) > 500, console


@pytest.mark.slow
def test_tpuctl_report_finds_the_latest_run_and_includes_its_goodput(trained, emu, home, tmp_path):
    from orchestrator.jobs import launch as L
    from orchestrator.jobs.supervise import goodput
    runs = home / "runs" / NAME
    old, new = runs / "20260101-000000-aaaaaa", runs / "20260101-000100-bbbbbb"
    for d, argv in ((old, ["pretrain", "--ckpt-dir", "gs://runs/older"]), (new, ["pretrain", f"--ckpt-dir={CKPT}"])):
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"run_id": d.name, "argv": [L.PYTHON, "-m", "trainer", *argv],
                                                "env": {**emu.env}, "returncode": 0}))
    g = goodput([{"attempt": 0, "outcome": "done", "startup_s": 30.0, "steps_s": 60.0, "tail_s": 10.0,
                  "recover_s": 0.0, "step_s": 15.0}], 100.0)
    (new / "goodput.json").write_text(json.dumps({"run_id": new.name, "attempts": [], "goodput": g}))
    (runs / "20260101-000200-cccccc").mkdir()  # a run whose record was never written (killed at once)
    e = {**env("", devices=None), "TPUCTL_HOME": str(home)}
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "report", NAME, "--json"], env=e,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert (res["run_id"], res["ckpt_dir"]) == (new.name, CKPT)
    assert res["goodput"]["goodput"] == pytest.approx(0.6) and res["summary"]["goodput"].startswith("60.0% of 100 s")
    out = home / "reports" / NAME / new.name  # a gs:// run's report lands on this machine
    assert res["html"] == str(out / "report.html")
    _check_report(res, lambda f: (out / f).read_bytes())

    # --plan FILE: the compiler's expected step beside the measured one, each named; --plan auto needs the slice.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"accelerator": "v5litepod-8",
                                "timing": {"step_s_at_peak": 0.05, "step_s_at_mfu": 0.1, "mfu_assumed": 0.5}}))
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "report", NAME, "--json", "--plan", str(plan)],
                       env=e, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ("Expected by the compiler's plan (tpuctl plan, v5litepod-8): 50.0 ms at the chips' peak, 100.0 ms at "
            "50% MFU") in json.loads(p.stdout)["summary"]["where the time goes"]
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "report", NAME, "--plan", "auto"], env=e,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1 and f"--plan auto needs the slice {NAME}" in p.stderr, p.stderr

    text = subprocess.run([sys.executable, "-m", "orchestrator.cli", "report", NAME, "--run", old.name], env=e,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert text.returncode == 1 and text.stdout == ""
    err = text.stderr.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("[tpuctl] report of") and err[1].startswith(f"Error: {NAME}'s run {old.name}: --ckpt-dir gs://runs/older does not "
                                               "exist"), err


def test_tpuctl_report_without_a_run_says_so(tmp_path):
    from click.testing import CliRunner
    from orchestrator.cli.app import cli
    r = CliRunner().invoke(cli, ["report", "nothing-here"], env={"TPUCTL_HOME": str(tmp_path)})
    assert r.exit_code == 1
    assert r.output.strip() == (f"Error: no runs of nothing-here yet (they are kept in {tmp_path}/runs/nothing-here): "
                                "`tpuctl run nothing-here -- pretrain ... --ckpt-dir DIR` first")
