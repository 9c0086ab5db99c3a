"""The key a new VM lets in: made once, 0600, OpenSSH format paramiko and ssh read; the metadata line."""
import os
import stat
import subprocess

import paramiko
import pytest

from orchestrator.access import sshkeys


def test_a_missing_key_is_made_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_SSH_USER", "alice")
    path, pub, created = sshkeys.ensure_key(tmp_path / "ssh" / "google_compute_engine")
    assert created and pub.startswith("ssh-ed25519 AAAA")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert paramiko.Ed25519Key.from_private_key_file(str(path)).get_base64() == pub.split()[1]
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(path)], capture_output=True, text=True, check=True)
    assert derived.stdout.split()[:2] == pub.split()
    assert (tmp_path / "ssh" / "google_compute_engine.pub").read_text().split()[2] == "alice"
    again = sshkeys.ensure_key(path)
    assert again == (path, pub, False)
    assert sshkeys.metadata_entry("alice", pub) == f"alice:{pub} alice"
    assert sshkeys.parse_metadata(f"bob:ssh-rsa AAAB bob\nalice:{pub} alice\n") == [("bob", "ssh-rsa AAAB"),
                                                                                   ("alice", pub)]


def test_bad_users_and_half_pairs_are_named(tmp_path):
    with pytest.raises(sshkeys.SshKeyError, match="'Alice Smith' cannot be a user on the VM"):
        sshkeys.metadata_entry("Alice Smith", "ssh-ed25519 AAAA")
    (tmp_path / "k").write_text("x")
    with pytest.raises(sshkeys.SshKeyError, match="has no public half"):
        sshkeys.ensure_key(tmp_path / "k")
