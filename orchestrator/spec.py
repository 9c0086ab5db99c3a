"""What the user asked for, as dataclasses, validated before anything talks to the cloud.

A SliceSpec comes from flags or a YAML/TOML file (`load_slice_spec`); `validate()` checks everything that
can be checked offline (name rules, catalog, flag conflicts, labels, durations) and raises UserError with
one line that names the problem and the fix.
"""
from __future__ import annotations

import dataclasses
import getpass
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import catalog


class UserError(Exception):
    """Bad input or an explained cloud error: one line naming what is wrong and how to fix it."""


# Cloud TPU node and queued-resource ids: RFC 1035 labels (lowercase letter first, then lowercase letters,
# digits or hyphens, no trailing hyphen, at most 63 characters).
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
# GCP label keys: lowercase letter first; keys and values: lowercase letters, digits, '_' and '-', <= 63.
_LABEL_KEY_RE = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_LABEL_VALUE_RE = re.compile(r"[a-z0-9_-]{0,63}")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)?")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}

LABEL_NAME, LABEL_OWNER, LABEL_EXPIRY = "tpuctl-name", "tpuctl-owner", "tpuctl-expiry"
LOCAL_PROJECT = "local-project"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise UserError(
            f"invalid slice name {name!r}: use 1-63 lowercase letters, digits or hyphens, "
            "starting with a letter and not ending with a hyphen (e.g. my-slice-1)")
    return name


def parse_duration(text: str | float | int | None, what: str = "duration") -> float | None:
    """'90s', '30m', '8h', '2d', '500ms', or a number of seconds -> seconds. None/'' -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        m = _DURATION_RE.fullmatch(str(text).strip().lower())
        if not m:
            raise UserError(f"invalid {what} {text!r}: use a number with a unit, e.g. 90s, 30m, 8h or 2d")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise UserError(f"invalid {what} {text!r}: it must be greater than zero")
    return seconds


def parse_labels(items) -> dict[str, str]:
    """['k=v,k2=v2', 'k3=v3'] or {'k': 'v'} -> dict, checked against GCP's label rules."""
    if isinstance(items, dict):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    else:
        pairs = []
        for item in items or ():
            for part in str(item).split(","):
                if not part.strip():
                    continue
                if "=" not in part:
                    raise UserError(f"invalid label {part!r}: write key=value (e.g. --labels team=nlp,run=7)")
                k, v = part.split("=", 1)
                pairs.append((k.strip(), v.strip()))
    labels = {}
    for k, v in pairs:
        if not _LABEL_KEY_RE.fullmatch(k):
            raise UserError(f"invalid label key {k!r}: start with a lowercase letter; use lowercase letters, "
                            "digits, '_' or '-' (at most 63)")
        if not _LABEL_VALUE_RE.fullmatch(v):
            raise UserError(f"invalid label value {v!r} for {k}: use lowercase letters, digits, '_' or '-' (at most 63)")
        if k.startswith("tpuctl-"):
            raise UserError(f"label {k!r} is reserved: tpuctl sets tpuctl-* labels itself; pick another key")
        labels[k] = v
    return labels


def owner_label() -> str:
    """The current user as a valid label value."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        user = "unknown"
    return re.sub(r"[^a-z0-9_-]", "-", user.lower())[:63] or "unknown"


def split_zones(zones) -> list[str]:
    out: list[str] = []
    for item in zones or ():
        for z in str(item).split(","):
            z = z.strip()
            if z and z not in out:
                out.append(z)
    return out


@dataclass
class SliceSpec:
    """One slice to create. Durations are seconds."""
    name: str
    accelerator: str
    zones: list[str] = field(default_factory=list)     # the first is tried first; the rest on stockout
    project: str | None = None
    spot: bool = False
    reserved: bool = False
    runtime_version: str | None = None                 # None: the catalog's default for the generation
    labels: dict[str, str] = field(default_factory=dict)
    ttl_s: float | None = None                         # sets the tpuctl-expiry label; gc deletes after it
    queued: bool = True                                # False: a plain node (--no-queue)
    wait_capacity: bool = False                        # keep a queued resource waiting for capacity
    capacity_wait_s: float = 600.0                     # without wait_capacity: give up a zone after this
    timeout_s: float = 1800.0                          # total wait for READY
    keep_on_failure: bool = False                      # on timeout/interrupt: keep (recorded) instead of delete
    api_endpoint: str | None = None
    local: bool = False
    fresh_hosts: bool = False                          # local mode: hosts as a fresh TPU VM is (no uv, no wheelhouse)

    def validate(self) -> "SliceSpec":
        check_name(self.name)
        if self.spot and self.reserved:
            raise UserError("--spot and --reserved exclude each other: spot uses preemptible capacity, "
                            "reserved uses your reservation; pick one")
        try:
            acc = catalog.lookup(self.accelerator)
        except catalog.UnknownAccelerator as e:
            raise UserError(f"{e} (see `tpuctl up --help`)") from None
        self.accelerator = acc.name
        self.zones = split_zones(self.zones)
        for z in self.zones:
            if not re.fullmatch(r"[a-z]+-[a-z]+\d+-[a-z0-9]+", z):
                raise UserError(f"invalid zone {z!r}: write a zone such as us-central2-b "
                                f"(zones offering {acc.generation.name} per the catalog: {', '.join(acc.zone_hints)})")
        if self.fresh_hosts and not self.local:
            raise UserError("--fresh-vm shapes the hosts of a local slice: add --local (real TPU VMs are fresh anyway)")
        if self.local and self.api_endpoint:
            raise UserError("--local and --api-endpoint exclude each other: --local starts its own stand-in; drop one")
        if self.wait_capacity and not self.queued:
            raise UserError("--wait-capacity needs a queued resource; drop --no-queue")
        if self.runtime_version is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", self.runtime_version):
            raise UserError(f"invalid runtime version {self.runtime_version!r}: e.g. {acc.default_runtime_version}")
        self.labels = parse_labels(self.labels)
        for what, v in (("--timeout", self.timeout_s), ("--capacity-wait", self.capacity_wait_s)):
            if v is None or v <= 0:
                raise UserError(f"{what} must be greater than zero")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise UserError("--ttl must be greater than zero")
        return self

    @property
    def accelerator_type(self) -> catalog.AcceleratorType:
        return catalog.lookup(self.accelerator)

    @property
    def runtime(self) -> str:
        return self.runtime_version or self.accelerator_type.default_runtime_version


_FILE_KEYS = {f.name for f in dataclasses.fields(SliceSpec)} | {"zone", "ttl", "timeout", "capacity_wait"}


def slice_spec_from_mapping(data: dict) -> SliceSpec:
    """A SliceSpec from a dict as written in a spec file (durations as '8h', zone or zones)."""
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise UserError(f"unknown key(s) in slice spec: {', '.join(unknown)}; known: {', '.join(sorted(_FILE_KEYS))}")
    d = dict(data)
    zones = split_zones(([d.pop("zone")] if d.get("zone") else []) + list(d.pop("zones", None) or []))
    for key, target in (("ttl", "ttl_s"), ("timeout", "timeout_s"), ("capacity_wait", "capacity_wait_s")):
        if key in d:
            d[target] = parse_duration(d.pop(key), key)
    if "name" not in d or "accelerator" not in d:
        raise UserError("a slice spec needs at least `name` and `accelerator`")
    return SliceSpec(zones=zones, **d)


def load_slice_spec(path: str | os.PathLike) -> SliceSpec:
    """Read a YAML (.yaml/.yml) or TOML (.toml) slice spec; a `[slice]` table or top-level keys."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"cannot read spec file {p}: {e.strerror}") from None
    try:
        if p.suffix == ".toml":
            import tomllib
            data = tomllib.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text) or {}
    except Exception as e:  # parse errors of either format
        raise UserError(f"cannot parse spec file {p}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"spec file {p} must hold a mapping of keys to values")
    return slice_spec_from_mapping(data.get("slice", data))
