"""The SSH key a new TPU VM lets in: made once on this machine, sent in the node's `ssh-keys` metadata.

A TPU VM accepts the keys in its own metadata, the project's metadata, or OS Login. gcloud puts
`~/.ssh/google_compute_engine.pub` into the project's metadata on a user's first `gcloud compute ssh`; a tool
that creates VMs through the API itself must send the key with the node (`metadata: {"ssh-keys": ...}`, one
line per key: `USER:ssh-ed25519 AAAA... USER`), or a user who never ran gcloud is refused at the first `run`.
"""
from __future__ import annotations

import getpass
import os
import re
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

# What gcloud creates and TPU VMs accept: the same pair serves users of both tools.
DEFAULT_KEY = Path.home() / ".ssh" / "google_compute_engine"
# The guest agent makes a POSIX account of this name; Linux user names are lowercase and short.
USER_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


class SshKeyError(ValueError):
    """One line: what is wrong with the key or user and how to fix it."""


def default_key_path() -> Path:
    return Path(os.environ.get("TPUCTL_SSH_KEY") or DEFAULT_KEY).expanduser()


def default_user() -> str:
    return os.environ.get("TPUCTL_SSH_USER") or getpass.getuser()


def ensure_key(path: str | os.PathLike | None = None) -> tuple[Path, str, bool]:
    """(private key path, public key line, created?) making an ed25519 pair (0600, no passphrase) if none exists."""
    path = Path(path).expanduser() if path else default_key_path()
    pub = path.with_name(path.name + ".pub")
    if path.exists():
        if not pub.exists():
            raise SshKeyError(f"SSH key {path} has no public half {pub}: recreate it with "
                              f"`ssh-keygen -y -f {path} > {pub}`")
        return path, _one_key(pub), False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ed25519.Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    line = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(priv)
    pub.write_text(line.decode() + f" {default_user()}\n")
    os.replace(tmp, path)  # the private half appears last: a half-made pair is never taken for a key
    return path, _one_key(pub), True


def _one_key(pub: Path) -> str:
    fields = pub.read_text().split()
    if len(fields) < 2 or not fields[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise SshKeyError(f"{pub} does not hold an OpenSSH public key")
    return f"{fields[0]} {fields[1]}"


def metadata_entry(user: str, public_key: str) -> str:
    """One line of a VM's `ssh-keys` metadata: `USER:TYPE BASE64 USER`."""
    if not USER_RE.match(user):
        raise SshKeyError(f"SSH user {user!r} cannot be a user on the VM: use lowercase letters, digits, '_', '.' "
                          "or '-' (--ssh-user / TPUCTL_SSH_USER)")
    return f"{user}:{public_key} {user}"


def parse_metadata(text: str) -> list[tuple[str, str]]:
    """The (user, 'TYPE BASE64') pairs of an `ssh-keys` value (what a VM's guest agent installs)."""
    out = []
    for line in text.splitlines():
        user, sep, rest = line.strip().partition(":")
        fields = rest.split()
        if sep and len(fields) >= 2:
            out.append((user, f"{fields[0]} {fields[1]}"))
    return out
