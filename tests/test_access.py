"""Reaching VMs the way companies run them, against the TPU API stand-in and local sshd hosts that tpuctl did not
set up itself: host keys pinned from the workers' guest attributes, private workers through a proxy command."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from _local_hosts import TEST_CACHE, needs_hosts
from infra import gcs
from infra.fake_tpu_api import FakeControl, start_in_thread
from orchestrator.provider import cloud
from orchestrator.access import hostkeys
from orchestrator.access import sshproxy

pytestmark = needs_hosts


def tpuctl(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture
def home_env(tmp_path):
    """A TPUCTL_HOME of its own; the local stand-in (and GCS emulator) it starts are stopped after."""
    home = tmp_path / "home"
    home.mkdir()
    (TEST_CACHE / "wheelhouse").mkdir(parents=True, exist_ok=True)
    (home / "wheelhouse").symlink_to(TEST_CACHE / "wheelhouse")  # the machine-wide cache of the other e2e tests
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TPUCTL_", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_")) and k != "XLA_FLAGS"}
    env.update(TPUCTL_HOME=str(home), TPUCTL_POLL_S="0.05", CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               TPUCTL_SSH_KEY=os.environ["TPUCTL_SSH_KEY"])
    yield home, env
    from infra.local_slice import LocalSlice
    for s in LocalSlice.ls(home / "local" / "slices"):
        s.stop()
    gcs.stop(home)
    info = home / "local" / "fake_tpu_api.json"
    if info.exists():
        pid = json.loads(info.read_text())["pid"]
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _other_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    k = ed25519.Ed25519PrivateKey.generate().public_key()
    return k.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def test_guest_attributes_come_back_through_the_real_client_in_worker_order():
    """The stand-in answers nodes:getGuestAttributes in the REST shape google-cloud-tpu parses; a 403 there is
    one line naming the permission."""
    fake = start_in_thread()
    try:
        api = cloud.connect(api_endpoint=fake.url, project="proj-123")
        op = api.create_node("us-central2-b", "ga", api.node_body("v4-16", "tpu-ubuntu2204-base", {}))
        name = f"{api.parent('us-central2-b')}/nodes/ga"
        deadline = time.time() + 60  # waits for the event (no measure): a loaded machine's room
        while api.get_node(name).state != "READY":
            assert time.time() < deadline
            time.sleep(0.05)
        del op
        key = _other_key()
        fake.control.publish_host_keys(name, 1, [key])
        fake.control.set_guest_attributes(name, 1, [{"key": "hostname", "value": "t1v-n-1-w-1"}], namespace="")
        assert api.guest_attributes(name, "hostkeys/") == [[], [("hostkeys", "ssh-ed25519", key.split()[1])]]
        assert api.guest_attributes(name, "")[1][-1] == ("", "hostname", "t1v-n-1-w-1")
        fake.control.permission_denied(op="guest_attributes", permission=hostkeys.PERMISSION)
        with pytest.raises(cloud.CloudError) as e:
            api.guest_attributes(name, "hostkeys/")
        assert e.value.kind == "permission" and hostkeys.PERMISSION in str(e.value)
    finally:
        fake.stop()


def test_proxy_templates_expand_like_openssh_and_iap_is_gclouds_own_hop():
    assert sshproxy.expand("ssh -W %h:%p -l %r bastion # 100%%", "10.0.0.2", 22, "me") == \
        "ssh -W 10.0.0.2:22 -l me bastion # 100%"
    with pytest.raises(sshproxy.ProxyError, match="unknown token '%x'"):
        sshproxy.check("nc %x %p")
    assert sshproxy.iap_command("t1v-n-abc-w-1", "us-central2-b", "proj-1") == (
        "gcloud compute start-iap-tunnel t1v-n-abc-w-1 %p --listen-on-stdin --zone=us-central2-b --project=proj-1 "
        "--verbosity=warning")
    with pytest.raises(sshproxy.ProxyError):
        sshproxy.iap_command("vm; rm -rf ~", "z", "p")


@pytest.mark.e2e
def test_host_keys_are_pinned_from_guest_attributes_and_an_impostor_gets_nothing(home_env):
    from infra.local_slice import LocalSlice
    home, env = home_env
    assert tpuctl("up", "hk", "--local", "-a", "v4-16", env=env).returncode == 0
    sl = LocalSlice.load("hk", home / "local" / "slices")
    url = json.loads((home / "local" / "fake_tpu_api.json").read_text())["url"]
    node = json.loads(tpuctl("status", "hk", "--json", env=env).stdout)["node"]

    ctl = FakeControl(url)
    # 1. Worker 1 has published nothing (its guest agent is late): waited for, then first contact, said once.
    ctl.set_guest_attributes(node, 1, [], namespace="hostkeys")
    r = tpuctl("ssh", "hk", "-w", "all", "--ssh-wait", "1", "--", "true", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("pinning its key on first contact instead") == 1 and "w1 (" in r.stderr, r.stderr
    # ... and once its key is pinned, later commands on the same VMs use the pin at once: no wait, no notice.
    r = tpuctl("ssh", "hk", "-w", "all", "--ssh-wait", "120", "--", "true", env=env, timeout=60)
    assert r.returncode == 0 and "first contact" not in r.stderr and "waiting for" not in r.stderr, r.stderr

    ctl.publish_host_keys(node, 1, sl.host_keys(1))  # ... until its guest agent has published them

    # 2. Every worker's real key is published: pinned exactly, no first-contact trust, the command runs.
    r = tpuctl("ssh", "hk", "-w", "all", "--", "touch /tmp/trusted; hostname", env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["[w0]", "[w1]", "hk-w0", "hk-w1"], r.stdout
    assert "first contact" not in r.stderr
    assert all((sl.dir / f"w{h.index}" / "tmp" / "trusted").exists() for h in sl.hosts)  # where a host's /tmp is
    (kh,) = [p for p in (home / "known_hosts").glob("hk@*") if "." not in p.name]
    pinned = kh.read_text().split("\n")
    for h in sl.hosts:
        assert f"[{h.ip}]:{h.port} {sl.host_keys(h.index)[0]}" in pinned

    # 3. No permission to read guest attributes: the missing permission, what tpuctl did instead.
    ctl.permission_denied(op="guest_attributes", permission=hostkeys.PERMISSION)
    r = tpuctl("ssh", "hk", "-w", "0", "--", "true", env=env)
    assert r.returncode == 0, r.stderr
    assert f"lacks {hostkeys.PERMISSION}" in r.stderr and "first contact instead" in r.stderr, r.stderr
    ctl.clear("permission")

    # 4. Worker 1 publishes another key than its sshd has: refused before anything is sent, named.
    ctl.publish_host_keys(node, 1, [_other_key()])
    marker = "/tmp/impostor-was-trusted"
    r = tpuctl("ssh", "hk", "-w", "all", "--", "touch", marker, env=env)
    assert r.returncode != 0
    assert "worker 1 (w1" in r.stderr and "SSH host key ssh-ed25519 SHA256:" in r.stderr, r.stderr
    assert "refused, nothing was sent" in r.stderr and "slice hk" in r.stderr, r.stderr
    for h in sl.hosts:  # /tmp of each host is its own folder
        assert not (sl.dir / f"w{h.index}" / "tmp" / marker.rsplit("/", 1)[1]).exists()


@pytest.mark.e2e
def test_private_workers_are_reached_only_through_the_proxy_for_every_connection(home_env, tmp_path, monkeypatch):
    from infra.local_slice import LocalSlice
    home, env = home_env
    log = tmp_path / "hop.log"
    hop = f"{sys.executable} -m infra.ssh_hop --log {log} --map 127.1.=127.0. %h %p"
    up = tpuctl("up", "pv", "--local", "-a", "v4-16", "--no-external-ips", "--ssh-proxy-command", hop, env=env)
    assert up.returncode == 0, up.stderr
    sl = LocalSlice.load("pv", home / "local" / "slices")
    st = json.loads(tpuctl("status", "pv", "--json", env=env).stdout)
    internal = [w["internal_ip"] for w in st["workers"]]
    assert [w["external_ip"] for w in st["workers"]] == [None, None]
    for ip, h in zip(internal, sl.hosts):  # the workers' addresses cannot be reached from here
        assert ip != h.ip
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ip, h.port), timeout=2).close()

    # The proxy recorded at `up` is used without repeating it; every worker through it.
    r = tpuctl("ssh", "pv", "-w", "all", "--", "hostname", env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["[w0]", "[w1]", "pv-w0", "pv-w1"]
    uses = [json.loads(l) for l in log.read_text().splitlines()]
    assert sorted(u["argv"][0] for u in uses) == sorted(internal) and all("error" not in u for u in uses)

    # A shell on one worker (OpenSSH itself): the same proxy as its ProxyCommand, the published key as the only
    # one trusted (StrictHostKeyChecking=yes), the host's sshd key file checked against it.
    sh = subprocess.run([sys.executable, "-m", "orchestrator.cli", "ssh", "pv", "-w", "1"], input="hostname\n",
                        capture_output=True, text=True, timeout=120, env=env)
    assert sh.returncode == 0 and sh.stdout.split() == ["pv-w1"], sh.stderr
    assert json.loads(log.read_text().splitlines()[-1])["argv"][0] == internal[1]

    # A 2-host gpt2-tiny run: preflight (with the coordinator port check), push, launch, log streaming and the
    # end-of-run state checks: each connection through the proxy.
    log.write_text("")
    run = tpuctl("run", "pv", "--no-plan", "--json", "--", "pretrain", "--preset", "gpt2-tiny", "--n-layer", "1",
                 "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "8", "--steps", "2",
                 "--log-every", "1", "--eval-every", "0", "--ckpt-every", "0", "--ckpt-dir", "gs://access/run",
                 env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["exit_codes"] == {"0": 0, "1": 0}
    assert "in 2 process(es)" in run.stderr
    uses = [json.loads(l) for l in log.read_text().splitlines()]
    assert {u["argv"][0] for u in uses} == set(internal) and all("error" not in u for u in uses), uses

    # The stop that ends every host on a failure or Ctrl-C opens fresh connections: through the proxy too.
    from orchestrator.access.reach import reach
    from orchestrator.access.hosts import Hosts
    monkeypatch.setenv("TPUCTL_HOME", str(home))
    target = reach("pv")
    log.write_text("")
    with Hosts(target.workers, target.ssh) as h:
        assert [r.exited for r in h.stop("true").values()] == [0, 0]
    assert sorted(json.loads(l)["argv"][0] for l in log.read_text().splitlines()) == sorted(internal)

    # --iap: gcloud's own hop to each worker VM, named by its guest attributes (a `gcloud` stand-in on PATH that
    # takes start-iap-tunnel's arguments and reaches the VM by name).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vms = " ".join(f"--vm pv-w{h.index}={h.ip}" for h in sl.hosts)
    (bin_dir / "gcloud").write_text(f"#!/bin/sh\nexec {sys.executable} -m infra.ssh_hop --as-gcloud --log {log} "
                                    f"{vms} \"$@\"\n")
    (bin_dir / "gcloud").chmod(0o755)
    log.write_text("")
    r = tpuctl("ssh", "pv", "-w", "all", "--iap", "--", "hostname", env={**env, "PATH": f"{bin_dir}:{env['PATH']}"})
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["[w0]", "[w1]", "pv-w0", "pv-w1"]
    uses = [json.loads(l) for l in log.read_text().splitlines()]
    assert sorted(u["argv"][:4] for u in uses) == [["compute", "start-iap-tunnel", f"pv-w{i}", str(sl.hosts[i].port)]
                                                   for i in range(2)], uses
    assert all(f"--zone={st['zone']}" in u["argv"] and f"--project={st['project']}" in u["argv"] and
               "--listen-on-stdin" in u["argv"] for u in uses), uses

    # A proxy that fails before any SSH banner: one line with the worker, the command as run and its stderr.
    bad = "sh -c 'echo not-ssh; echo the-bastion-said-no >&2' %h %p"
    r = tpuctl("ssh", "pv", "-w", "0", "--ssh-proxy-command", bad, "--", "true", env=env)
    assert r.returncode != 0
    err = [l for l in r.stderr.splitlines() if l.startswith("Error:") or l.startswith("  w")]
    line = next(l for l in err if f"w0 ({internal[0]})" in l)
    assert "printed 'not-ssh' instead of an SSH banner" in line and "(stderr: the-bastion-said-no)" in line, err
    assert f"`sh -c 'echo not-ssh; echo the-bastion-said-no >&2' {internal[0]} {sl.hosts[0].port}`" in line, line
    assert "waiting" not in r.stderr  # no point waiting for a proxy that talks something else than SSH


@pytest.mark.e2e
def test_os_login_registers_the_key_writes_no_ssh_keys_and_logs_in_as_the_posix_user(home_env):
    """A project that enforces OS Login (its common metadata, through the Compute Engine stand-in): `up` registers
    the key with the OS Login stand-in for the account, expiring with --ttl, and writes no ssh-keys metadata; the
    hosts let in the login profile's keys as its POSIX user, which `ssh` logs in as. An account whose POSIX user
    the VMs refuse (no OS Login role) gets one line naming the role."""
    from infra.fake_login_apis import start_in_thread as start_login
    home, env = home_env
    login = start_login()
    try:
        env = {**env, "TPUCTL_COMPUTE_API_ENDPOINT": login.url, "TPUCTL_OSLOGIN_API_ENDPOINT": login.url,
               "TPUCTL_ACCOUNT": "alice@example.com"}
        login.control.set_project_metadata("local-project", {"enable-oslogin": "TRUE"})
        login.control.set_username("alice@example.com", "root")  # the one user a local host has
        t0 = time.time()
        up = tpuctl("up", "ol", "--local", "--fresh-vm", "-a", "v4-8", "--ttl", "2h", env=env)
        assert up.returncode == 0, up.stderr
        assert "OS Login is on in local-project" in up.stderr and "POSIX user root" in up.stderr, up.stderr
        url = json.loads((home / "local" / "fake_tpu_api.json").read_text())["url"]
        (qr,) = FakeControl(url).create_bodies("queuedResource")
        assert "ssh-keys" not in (qr["tpu"]["nodeSpec"][0]["node"].get("metadata") or {}), qr
        (key,) = login.control.state()["keys"]["alice@example.com"].values()
        pub = open(env["TPUCTL_SSH_KEY"] + ".pub").read().split()
        assert key["key"].split()[:2] == pub[:2]
        # --ttl 2h from the moment of `up`: between the clock before it and after it, however long it took
        assert t0 + 7200 - 1 <= int(key["expirationTimeUsec"]) / 1e6 <= time.time() + 7200 + 1

        r = tpuctl("ssh", "ol", "--", "whoami", env=env)
        assert r.returncode == 0 and r.stdout.split() == ["root"], r.stderr

        login.control.set_username("alice@example.com", "alice_example_com")  # a user the VM does not let in
        r = tpuctl("ssh", "ol", "--ssh-wait", "1", "--", "whoami", env=env)
        assert r.returncode != 0
        assert "refused alice_example_com: your account needs roles/compute.osLogin (or " \
               "roles/compute.osAdminLogin) on project local-project" in r.stderr, r.stderr
    finally:
        login.stop()
