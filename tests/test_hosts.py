"""Preflight over real SSH: stale processes holding the "device" are named with host and PID; --kill-stale clears them."""
import dataclasses
import re
import threading
import time
from pathlib import Path

import pytest

from _local_hosts import TEST_CACHE, host_processes, ssh, ssh_config, start, wait_idle, workers, needs_hosts
from orchestrator.access.hosts import HostError, Hosts, RunGoing, SshConfig
from orchestrator.jobs.launch import Worker

pytestmark = needs_hosts

LOCK = "/tmp/libtpu_lockfile"


@pytest.fixture(scope="module")
def sl(tmp_path_factory):
    s = start("hosts", 2, tmp_path_factory.mktemp("slices"))
    yield s
    s.stop()


@pytest.fixture
def hosts(sl):
    with Hosts(workers(sl), ssh_config(sl)) as h:
        yield h
    for i in range(2):  # leave nothing behind for the next test
        ssh(sl, i, f"rm -f {LOCK} ~/.tpuctl-host/run/*.pid; pkill -9 -f tpuctl-test-stale || true", check=False)
    assert wait_idle(sl) == {}


def _ns_pid(outer: int) -> int:
    """A process's PID as its host sees it (what a user on that host would kill)."""
    for line in Path(f"/proc/{outer}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(outer)


def _wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_clean_hosts_pass_preflight(hosts, sl):
    probes = hosts.preflight()
    assert [p.hostname for p in probes] == ["hosts-w0", "hosts-w1"]
    assert all(p.python.startswith("3.") and p.free_gb > 0 and abs(p.skew_s) < 5 and p.stale == [] for p in probes)


def test_a_sleeping_process_holding_the_libtpu_lockfile_is_named_then_killed(hosts, sl):
    ssh(sl, 1, f"setsid nohup python3 -c \"import time; f = open('{LOCK}', 'w'); time.sleep(600)\" "
               "tpuctl-test-stale >/dev/null 2>&1 < /dev/null &")
    holder = []
    _wait_for(lambda: holder.extend(p for p, c in host_processes(sl, 1) if "tpuctl-test-stale" in c) or holder)
    _wait_for(lambda: (Path(sl.hosts[1].home).parent / "tmp" / "libtpu_lockfile").exists())
    pid = _ns_pid(holder[0])
    with pytest.raises(HostError) as e:
        hosts.preflight()
    msg = str(e.value)
    assert re.search(rf"w1 \(127\.0\.\d+\.2\): PID {pid} \(python3 -c .*\) holds {LOCK}: rerun with --kill-stale", msg)
    assert "w0" not in msg and len(msg.splitlines()) == 1
    probes = hosts.preflight(kill_stale=True)
    assert [c["pid"] for c in probes[1].cleared] == [pid] and probes[1].stale == [] and probes[0].cleared == []
    _wait_for(lambda: not Path(f"/proc/{holder[0]}").exists() or "Z" in Path(f"/proc/{holder[0]}/stat").read_text())
    assert not (Path(sl.hosts[1].home).parent / "tmp" / "libtpu_lockfile").exists()
    hosts.preflight()  # clean again


def test_a_lockfile_nobody_holds_and_a_leftover_tpuctl_trainer(hosts, sl):
    ssh(sl, 0, f"touch {LOCK}")
    with pytest.raises(HostError, match=rf"w0 .*: a dead process left {LOCK} behind"):
        hosts.preflight()
    # a trainer from an earlier run, still running under tpuctl's wrapper on w1
    probes = hosts.preflight(kill_stale=True)
    hosts.push(None, probes)  # uploads the wrapper
    wrap = hosts.helpers["hostwrap.py"]
    ssh(sl, 1, f"mkdir -p ~/.tpuctl-host/run; cd; setsid nohup python3 .tpuctl-host/bin/{wrap} run "
               "--pidfile .tpuctl-host/run/old.pid --run-id old --log .tpuctl-host/logs/old.log -- sleep 600 "
               ">/dev/null 2>&1 < /dev/null &")
    _wait_for(lambda: (Path(sl.hosts[1].home) / ".tpuctl-host/run/old.pid").exists())
    with pytest.raises(RunGoing, match=r"a tpuctl run is still going on these hosts \(run old on w1: PID \d+ "
                                       r"\(sleep 600\)\)") as going:
        hosts.preflight()
    assert going.value.runs == {"old": ""} and going.value.hosts == {"old": [1]}
    probes = hosts.preflight(kill_stale=True)
    assert [c["kind"] for c in probes[1].cleared] == ["trainer"]
    # The trainer and its keeper are gone when preflight returns; the `run` that followed its log (started above
    # as a host's SSH session would) ends by itself once it reads the run's end.
    left = lambda: [c for _, c in host_processes(sl, 1) if "sleep 600" in c]
    assert not [c for c in left() if c.startswith("sleep") or " keep " in c], left()
    _wait_for(lambda: not left())


def test_an_unreachable_worker_is_named(sl, tmp_path):
    ws = workers(sl) + [Worker(2, sl.hosts[0].ip, port=1)]  # nothing listens on port 1
    said = []
    cfg = dataclasses.replace(ssh_config(sl), wait_s=1.0)
    with Hosts(ws, cfg) as h, pytest.raises(HostError, match=r"w2 \(127\.0\.\d+\.1\): unreachable over SSH "
                                                            r"as root@127\.0\.\d+\.1:1 after 1 s"):
        h.preflight(say=said.append)
    assert said == [f"waiting for SSH on w2 ({sl.hosts[0].ip}) (NoValidConnectionsError: [Errno None] Unable to "
                    f"connect to port 1 on {sl.hosts[0].ip}); up to 1 s"], said
    with pytest.raises(HostError, match="does not exist"):
        Hosts(workers(sl), ssh_config(sl).__class__(user="root", key=str(tmp_path / "nokey")))


def test_a_host_whose_sshd_comes_up_after_ready_is_waited_for(tmp_path):
    """A new VM starts sshd some seconds after READY: preflight keeps trying (with one progress line)."""
    from infra.local_slice import LocalSlice, _keygen
    base = tmp_path / "late"
    (base / "late").mkdir(parents=True)
    key = base / "late" / "client_key"
    _keygen(key)  # the slice will use this key: known before its hosts exist
    ip = "127.0.201.1"
    started: list = []
    t = threading.Timer(3.0, lambda: started.append(start_late(base, ip)))
    t.start()
    said = []
    try:
        with Hosts([Worker(0, ip)], SshConfig(user="root", key=str(key), port=2222, wait_s=60)) as h:
            probes = h.preflight(say=said.append)
        assert probes[0].hostname == "late-w0"
        assert len(said) == 1 and said[0].startswith(f"waiting for SSH on w0 ({ip})") and "up to 60 s" in said[0]
    finally:
        t.join()
        for s in started:
            s.stop()
        if not started:
            LocalSlice.stop_by_name("late", base)


def start_late(base, ip):
    from infra.local_slice import LocalSlice
    # the machine's test wheelhouse, as every test slice (_local_hosts.start): not $TPUCTL_HOME's (~/.tpuctl here)
    return LocalSlice.start("late", 1, base, first_ip=ip, wheelhouse=TEST_CACHE / "wheelhouse")


def test_a_refused_key_fails_at_once_naming_user_and_key(sl, tmp_path):
    from infra.local_slice import _keygen
    other = tmp_path / "other_key"
    _keygen(other)
    said = []
    # A wait of 600 s, which a preflight that waited on the refused key would spend whole; one refusal over
    # loopback takes seconds even on a loaded 2-core machine, so half of it tells the two apart.
    cfg = SshConfig(user="root", key=str(other), port=sl.hosts[0].port, wait_s=600)
    t0 = time.monotonic()
    with Hosts(workers(sl), cfg) as h, pytest.raises(HostError) as e:
        h.preflight(say=said.append)
    assert f"SSH refused user root with key {other}" in str(e.value) and "w0 (" in str(e.value)
    assert said == []  # no waiting on a key the host will never accept
    assert time.monotonic() - t0 < 300


def test_a_changed_host_key_is_refused_and_nothing_is_sent(sl, tmp_path):
    """Keys are pinned on first contact; a worker that later shows another key gets no command at all."""
    import paramiko
    pins = tmp_path / "known_hosts" / "hosts@1"
    cfg = dataclasses.replace(ssh_config(sl), known_hosts=str(pins))
    with Hosts(workers(sl), cfg) as h:
        h.preflight()
    pinned = paramiko.HostKeys(str(pins))
    entry = f"[{sl.hosts[1].ip}]:{sl.hosts[1].port}"
    assert set(pinned.keys()) == {f"[{w.ip}]:{w.port}" for w in sl.hosts}
    # w1 now shows another key (a different machine answering at its address): rewrite the pin to simulate it.
    impostor = paramiko.Ed25519Key.from_private_key_file(sl.ssh_key)
    pinned[entry] = {"ssh-ed25519": impostor}
    pinned.save(str(pins))
    marker = f"/tmp/pin-test-{time.time_ns()}"
    with Hosts(workers(sl), cfg) as h, pytest.raises(HostError) as e:
        h.preflight()
        h.stream(f"touch {marker}")
    assert f"w1 ({sl.hosts[1].ip}): its SSH host key changed since tpuctl first connected" in str(e.value)
    assert str(pins) in str(e.value)
    assert ssh(sl, 1, f"test -e {marker}", check=False).returncode == 1
    # With the pin file removed (a recreated VM), first contact pins afresh.
    pins.unlink()
    with Hosts(workers(sl), cfg) as h:
        h.preflight()
    assert set(paramiko.HostKeys(str(pins)).keys()) == {f"[{w.ip}]:{w.port}" for w in sl.hosts}
