"""The SSH host keys a slice's VMs published themselves, and pinning exactly those.

A VM's guest agent publishes its sshd host keys as guest attributes (namespace `hostkeys/`, one item per key
type); the Cloud TPU API serves them per worker (`nodes.getGuestAttributes`). A worker's connection then trusts
only those keys: any other key, of any type, is refused before anything is sent to it. The agent starts after
the VM is READY, so a worker may have published nothing yet: callers wait (within --ssh-wait), then fall back to
pinning on first contact for that worker, and say so.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Callable

import paramiko

NAMESPACE = "hostkeys"
PERMISSION = "tpu.nodes.getGuestAttributes"


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's form: SHA256:<base64 of the blob's digest, unpadded>."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def host_id(address: str, port: int) -> str:
    """How paramiko (and OpenSSH's known_hosts) name a host: [addr]:port unless the port is 22."""
    return address if port == 22 else f"[{address}]:{port}"


def parse(items: list[tuple[str, str]]) -> list[paramiko.PKey]:
    """Keys from (key type, base64) items of the hostkeys namespace; unreadable ones are skipped."""
    out = []
    for kind, value in items:
        try:
            out.append(paramiko.PKey.from_type_string(kind, base64.b64decode(value)))
        except (ValueError, paramiko.SSHException, TypeError):
            continue
    return out


@dataclass
class Published:
    """Where a slice's workers publish their host keys. `fetch()` answers {(slice, worker index): [(type, base64)]}
    (slice 0 on a single slice; workers that published nothing are absent), or raises `Unreadable` with the reason
    (no permission...)."""
    slice: str
    fetch: Callable[[], dict[tuple[int, int], list[tuple[str, str]]]]


class Unreadable(Exception):
    """The published keys cannot be read; the message says why and what to grant."""


class OnlyPublished(paramiko.MissingHostKeyPolicy):
    """A worker with published keys whose sshd shows a key of another type: refused like a changed key."""

    def __init__(self, keys: list[paramiko.PKey]):
        self.keys = keys

    def missing_host_key(self, client, hostname, key):
        raise paramiko.BadHostKeyException(hostname, key, self.keys[0])


_lock = threading.Lock()


def pin(path: str, host: str, keys: list[paramiko.PKey]) -> None:
    """Make `path` (a known_hosts file) hold exactly `keys` for `host`: its earlier lines for that host go."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with _lock, open(path + ".lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        kept = [l for l in lines if l.strip() and host not in l.split(" ", 1)[0].split(",")]
        new = [f"{host} {k.get_name()} {k.get_base64()}" for k in keys]
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(kept + new) + "\n")
        os.replace(tmp, path)
