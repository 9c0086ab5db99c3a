"""The local slice: N real sshd hosts, each with its own hostname, home, /tmp, /etc/hosts and process tree."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from _local_hosts import host_processes, ssh, start, needs_hosts
from infra.local_slice import LocalSlice, LocalSliceError, _pid_in_ns, ns_members

pytestmark = needs_hosts


@pytest.fixture(scope="module")
def sl(tmp_path_factory):
    s = start("lstest", 3, tmp_path_factory.mktemp("slices"))
    yield s
    s.stop()


def test_each_host_is_its_own_machine(sl):
    seen = set()
    for i, h in enumerate(sl.hosts):
        out = ssh(sl, i, "hostname; getent hosts $(hostname) | cut -d' ' -f1; echo $HOME; ls -A ~; "
                         "touch /tmp/mine-$(hostname) ~/home-$(hostname); ls /tmp; ps -e -o pid= | wc -l").stdout.split()
        hostname, ip, home = out[:3]
        assert hostname == f"lstest-w{i}" and ip == h.ip and home == "/root"
        assert f"mine-lstest-w{i}" in out and not any(f"mine-lstest-w{j}" in out for j in range(3) if j != i)
        seen.add(hostname)
        # its home is the private dir the record names, not the machine's /root
        assert os.path.exists(f"{h.home}/home-{hostname}")
        assert not os.path.exists(f"/root/home-{hostname}")
        # the machine's Python is still reachable inside (bind-mounted back)
        assert ssh(sl, i, f"{sl.python} -c 'print(1)'").stdout.strip() == "1"
        # every session on it (a trainer, whoever starts it) has its slice's profiler ports, not 9999's
        assert ssh(sl, i, "echo $TPUCTL_PROFILER_PORT").stdout.strip() == str(h.profiler_port)
        # the trainer's compile cache is the machine's one, written from one host and read from the others
        ssh(sl, i, f"touch ~/.cache/tpuctl/jax/from-{hostname}")
    assert len(seen) == 3
    shared = os.path.join(sl.wheelhouse, "xla-cache")
    assert [ssh(sl, i, "readlink -f ~/.cache/tpuctl/jax").stdout.strip() for i in range(3)] == [shared] * 3
    for i in range(3):
        os.unlink(os.path.join(shared, f"from-lstest-w{i}"))  # each host's file is here


def test_a_slice_kept_under_root_works(sl, tmp_path):
    """The default $TPUCTL_HOME is ~/.tpuctl: the hosts' private /root and /tmp both come from under /root.
    Started while another slice runs (in another base dir): its hosts' profiler ports are not that slice's."""
    base = tempfile.mkdtemp(prefix=".tpuctl-test-", dir=os.path.expanduser("~"))
    try:
        s = start("lsroot", 1, base)
        try:
            out = ssh(s, 0, "hostname; touch /tmp/x-here; ls /tmp; echo $HOME $TPUCTL_PROFILER_PORT").stdout.split()
            assert out[0] == "lsroot-w0" and "x-here" in out and out[-2] == "/root"
            ports = {int(out[-1]), *(h.profiler_port for h in sl.hosts)}
            assert len(ports) == 2 and min(abs(a - b) for a in ports for b in ports if a != b) >= 64, ports
            assert os.path.exists(os.path.join(base, "lsroot", "w0", "tmp", "x-here"))  # its own /tmp
        finally:
            s.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_start_is_idempotent_and_visible_to_other_processes(sl):
    again = LocalSlice.start("lstest", 3, sl.base_dir)
    assert [h.init_pid for h in again.hosts] == [h.init_pid for h in sl.hosts]
    with pytest.raises(LocalSliceError, match="running with 3 hosts"):
        LocalSlice.start("lstest", 2, sl.base_dir)
    out = subprocess.run([sys.executable, "-m", "infra.local_slice", "--base-dir", sl.base_dir, "ls"],
                         capture_output=True, text=True, check=True).stdout
    assert "lstest  3/3 hosts up" in out


def test_bad_name_is_one_clear_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "infra.local_slice", "--base-dir", str(tmp_path), "start", "Bad_Name"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: invalid local slice name") and len(p.stderr.splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_stop_from_another_process_kills_everything_started_on_the_hosts(tmp_path):
    s = start("lsstop", 2, tmp_path)
    # a daemonised process (own session, reparented) on each host: stop must still find it
    for i in range(2):
        ssh(s, i, "setsid nohup sleep 4242 >/dev/null 2>&1 < /dev/null &")
    assert all(any("sleep 4242" in c for _, c in host_processes(s, i)) for i in range(2))
    # every process of each host before the stop (a namespace's id is reused once it is gone: another slice may
    # have one with the same id by the time we look again, so the check is on these processes)
    members = [(h.pidns, ns_members(h.pidns, h.init_pid)) for h in s.hosts]
    assert all(len(pids) >= 2 for _, pids in members)  # sshd and the daemonised sleep at least
    p = subprocess.run([sys.executable, "-m", "infra.local_slice", "--base-dir", str(tmp_path), "stop", "lsstop"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "stopped lsstop" in p.stdout
    for h in s.hosts:  # they were this process's children: reap them
        os.waitpid(h.unshare_pid, 0)
    assert [pid for ns, pids in members for pid in pids if _pid_in_ns(pid, ns)] == []
    assert LocalSlice.load("lsstop", tmp_path) is None and not (tmp_path / "lsstop").exists()
    assert not LocalSlice.stop_by_name("lsstop", tmp_path)  # second stop: nothing to do


def _still_there(host) -> str:
    """What a killed host's namespace still held (its init waits for every member to be reaped, zombies too): a
    failure's reading, as (pid, state, parent, command)."""
    out = []
    for p in os.listdir("/proc"):
        try:
            if not p.isdigit() or os.readlink(f"/proc/{p}/ns/pid") != host.pidns:
                continue
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:80]
        except OSError:
            continue
        out.append((int(p), fields[0], int(fields[1]), cmd))
    return f"init {host.init_pid}; its namespace's processes: {sorted(out)}"


def test_a_stale_record_is_replaced(tmp_path):
    s = start("lsstale", 1, tmp_path)
    os.kill(s.hosts[0].init_pid, signal.SIGKILL)  # the host dies behind tpuctl's back
    stale = LocalSlice.load("lsstale", tmp_path)
    deadline = time.monotonic() + 60  # waits for the event (no measure): a loaded machine's room
    while stale.alive() != [False] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stale.alive() == [False], _still_there(stale.hosts[0])
    fresh = start("lsstale", 1, tmp_path)
    try:
        assert fresh.alive() == [True] and fresh.hosts[0].init_pid != s.hosts[0].init_pid
        assert ssh(fresh, 0, "hostname").stdout.strip() == "lsstale-w0"
        rec = json.loads((tmp_path / "lsstale" / "slice.json").read_text())
        assert rec["hosts"][0]["init_pid"] == fresh.hosts[0].init_pid
    finally:
        fresh.stop()
