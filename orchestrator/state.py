"""The local record of what tpuctl created, so that down/status/run work by name.

`$TPUCTL_HOME/state.json` (default ~/.tpuctl). Every write is read-modify-write under an exclusive
flock, to a temp file that is fsynced and then os.replace()d over the old one: a crash mid-write
leaves either the old or the new record, never a torn one. No secrets are ever stored here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

VERSION = 1


@dataclass(frozen=True)
class Worker:
    """One VM of a slice, as the TPU API lists it and as SSH reaches it (the one worker type of tpuctl)."""
    index: int
    internal_ip: str
    external_ip: str | None = None
    port: int | None = None  # SSH port, when this worker's differs from the run's (--hosts ip:port)
    slice: int | None = None  # its slice in a multislice job (None: a single slice); index counts within it

    @property
    def address(self) -> str:
        """Where SSH connects: the external IP when the slice has one, else the internal IP."""
        return self.external_ip or self.internal_ip

    @property
    def name(self) -> str:
        return f"w{self.index}" if self.slice is None else f"s{self.slice}w{self.index}"


@dataclass
class SliceRecord:
    name: str
    project: str
    zone: str
    accelerator: str
    node: str                          # full node name projects/P/locations/Z/nodes/N
    queued_resource: str | None = None  # full queued resource name, None for --no-queue
    api_endpoint: str | None = None    # None: the default Cloud TPU endpoint (or the provider resolves it)
    provider: str = "gcp"              # where it lives: gcp | local (orchestrator/provider)
    provider_options: dict[str, bool] = field(default_factory=dict)  # the provider's own (local: fresh hosts)
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    price_per_hour: float = 0.0
    spot: bool = False
    reserved: bool = False
    runtime_version: str = ""
    status: str = "creating"           # creating | ready | failed (kept after a failure, for down/gc)
    note: str = ""                     # why a failed record was kept
    workers: list[Worker] = field(default_factory=list)
    reservation: str | None = None     # the reservation it consumes (full name)
    external_ips: bool = True
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None  # None: the project's default compute service account
    scopes: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)  # the VMs' metadata (public keys, never secrets)
    ssh_proxy_command: str | None = None  # every SSH connection to the workers goes through it (%h %p %r %%)
    iap: bool = False                     # ... or through Cloud IAP TCP forwarding
    claim: str = ""                    # which `up` wrote it: only that process may drop or replace it
    leftovers: list[str] = field(default_factory=list)  # resources of earlier zones still being deleted
    slices: int = 1                    # >1: a multislice queued resource; `node` is slice 0's (NAME-0)

    @property
    def nodes(self) -> list[str]:
        """Every node's full name, slice by slice: NAME-0 .. NAME-(N-1) for multislice (the service's naming
        from multisliceParams.nodeIdPrefix), else the one node."""
        if self.slices <= 1:
            return [self.node]
        parent = self.node.rsplit("/", 1)[0]
        return [f"{parent}/{self.name}-{i}" for i in range(self.slices)]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "SliceRecord":
        """A record as stored; raises ValueError naming what is missing or malformed."""
        if not isinstance(d, dict):
            raise ValueError("a slice entry is not a mapping")
        known = {f.name: f for f in dataclasses.fields(cls)}
        if d.get("local") and "provider" not in d:  # written before slices named their provider
            d = {**d, "provider": "local", "provider_options": {"fresh": True} if d.get("fresh_hosts") else {}}
        d = {k: v for k, v in d.items() if k in known}
        missing = [k for k in ("name", "project", "zone", "accelerator", "node") if not isinstance(d.get(k), str)]
        if missing:
            raise ValueError(f"slice {d.get('name', '?')!r} lacks {', '.join(missing)}")
        try:
            d["workers"] = [Worker(**w) for w in d.get("workers") or []]
        except TypeError as e:
            raise ValueError(f"slice {d['name']!r} has malformed workers ({e})") from None
        return cls(**d)


def home() -> Path:
    return Path(os.environ.get("TPUCTL_HOME") or Path.home() / ".tpuctl")


def state_path() -> Path:
    return home() / "state.json"


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read() -> dict[str, SliceRecord]:
    path = state_path()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        from orchestrator.spec import UserError
        raise UserError(f"the local record {path} is unreadable ({e}); move it aside and run `tpuctl gc` "
                        "to find what it listed") from None
    try:
        return {name: SliceRecord.from_json(d) for name, d in ((raw or {}).get("slices") or {}).items()}
    except (ValueError, AttributeError) as e:
        from orchestrator.spec import UserError
        raise UserError(f"the local record {path} is damaged ({e}); move it aside and run `tpuctl gc` "
                        "to find what it listed") from None


def _write(records: dict[str, SliceRecord]) -> None:
    path = state_path()
    payload = json.dumps({"version": VERSION, "slices": {n: r.to_json() for n, r in sorted(records.items())}},
                         indent=2, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".state.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(payload + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def update(fn: Callable[[dict[str, SliceRecord]], None]) -> dict[str, SliceRecord]:
    """Apply fn to the records under the lock and write them back atomically."""
    with _locked():
        records = _read()
        fn(records)
        _write(records)
        return records


def records() -> dict[str, SliceRecord]:
    with _locked():
        return _read()


def lookup(name: str) -> SliceRecord | None:
    """The record of a slice by name, or None."""
    return records().get(name)


def save(rec: SliceRecord) -> None:
    update(lambda rs: rs.__setitem__(rec.name, rec))


def claim(rec: SliceRecord) -> bool:
    """Write rec only if no record of that name exists (atomically, under the lock). True if it was written."""
    done = []

    def put(rs):
        if rec.name not in rs:
            rs[rec.name] = rec
            done.append(True)
    update(put)
    return bool(done)


def save_claimed(rec: SliceRecord) -> bool:
    """Replace the record of rec.name only while it is still ours (same claim). True if it was written."""
    done = []

    def put(rs):
        if rec.name in rs and rs[rec.name].claim == rec.claim:
            rs[rec.name] = rec
            done.append(True)
    update(put)
    return bool(done)


def release(name: str, claim_id: str) -> bool:
    """Drop the record of `name` only if this claim wrote it; another process's record stays."""
    done = []

    def drop(rs):
        if name in rs and rs[name].claim == claim_id:
            del rs[name]
            done.append(True)
    update(drop)
    return bool(done)


def remove(name: str) -> bool:
    removed = []
    update(lambda rs: removed.append(rs.pop(name, None)))
    return removed[0] is not None
