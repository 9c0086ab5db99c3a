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
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
_SA_RE = re.compile(r"[a-z0-9][-a-z0-9_.+]*@[a-z0-9][-a-z0-9.]*\.[a-z]+")
_RESERVATION_RE = re.compile(r"(projects/[^/\s]+/locations/[a-z0-9-]+/reservations/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_NETWORK_RE = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_./]{0,250}")
LOCAL_PROJECT = "local-project"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise UserError(
            f"invalid slice name {name!r}: use 1-63 lowercase letters, digits or hyphens, "
            "starting with a letter and not ending with a hyphen (e.g. my-slice-1)")
    return name


MAX_DURATION_S = 366 * 86400.0  # a year: longer is a typo (and overflows the expiry label's timestamp)


def parse_duration(text: str | float | int | None, what: str = "duration") -> float | None:
    """'90s', '30m', '8h', '2d', '500ms', or a number of seconds -> seconds. None/'' -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UserError(f"invalid {what} {text!r}: use a number with a unit, e.g. 90s, 30m, 8h or 2d")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        m = _DURATION_RE.fullmatch(str(text).strip().lower())
        if not m:
            raise UserError(f"invalid {what} {text!r}: use a number with a unit, e.g. 90s, 30m, 8h or 2d")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    shown = text if len(str(text)) <= 24 else f"{str(text)[:20]}..."
    if not seconds > 0:
        raise UserError(f"invalid {what} {shown!r}: it must be greater than zero")
    if seconds > MAX_DURATION_S:
        raise UserError(f"invalid {what} {shown!r}: at most {int(MAX_DURATION_S // 86400)}d")
    return seconds


_ZONE_RE = re.compile(r"[a-z]+-[a-z]+\d+-[a-z0-9]+")


def check_zone(zone, hint: str = "") -> str:
    """A zone name such as us-central2-b, or one UserError line (never a path or anything else)."""
    if not isinstance(zone, str) or not _ZONE_RE.fullmatch(zone):
        raise UserError(f"invalid zone {zone!r}: write a zone such as us-central2-b" + (f" ({hint})" if hint else ""))
    return zone


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


# Multislice joins slices over the data-center network; Cloud TPU offers it from v4 on (v2/v3 slices have no
# DCN collectives in libtpu). Every slice of one queued resource has the same node spec: one type, topology,
# runtime and zone by construction.
MULTISLICE_GENERATIONS = ("v4", "v5p", "v5litepod", "v6e")
MAX_SLICES = 64


def check_num_slices(n, acc: catalog.AcceleratorType, *, queued: bool = True, name: str = "NAME") -> int:
    """--num-slices N: a whole number >= 1; >= 2 only for v4 and later, and only as a queued resource."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SLICES:
        raise UserError(f"invalid --num-slices {n!r}: give a whole number from 1 (one slice) to {MAX_SLICES}")
    if n > 1 and acc.generation.name not in MULTISLICE_GENERATIONS:
        raise UserError(f"--num-slices {n} needs v4 or later ({acc.name} is {acc.generation.name}): pick a v4 or "
                        "later type (e.g. -a v4-8), or drop --num-slices")
    if n > 1 and not queued:
        raise UserError(f"--num-slices {n} is created as one queued resource (all slices or none); drop --no-queue")
    return n


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
    provider: str = "gcp"                              # where it lives: gcp | local (orchestrator/provider)
    provider_options: dict[str, bool] = field(default_factory=dict)  # the provider's own (local: fresh)
    reservation: str | None = None                     # consume this reservation (name or full name); implies reserved
    # The VMs' network and identity (None: the API's / the project's defaults).
    external_ips: bool = True                          # False: workers get internal IPs only (--no-external-ips)
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None                 # None: the project's default compute service account
    scopes: list[str] = field(default_factory=lambda: [CLOUD_PLATFORM_SCOPE])
    metadata: dict[str, str] = field(default_factory=dict)  # the VMs' metadata (e.g. ssh-keys), sent as node.metadata
    # How this machine reaches the workers later (recorded with the slice; nothing of it goes to the API).
    ssh_proxy_command: str | None = None               # OpenSSH ProxyCommand (%h %p %r %%) for every connection
    iap: bool = False                                  # the proxy is Cloud IAP TCP forwarding (gcloud start-iap-tunnel)
    # >1: a multislice queued resource of that many identical slices joined by DCN (nodes NAME-0 .. NAME-(N-1))
    num_slices: int = 1

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
        check_num_slices(self.num_slices, acc, queued=self.queued, name=self.name)
        self.zones = split_zones(self.zones)
        for z in self.zones:
            check_zone(z, f"zones offering {acc.generation.name} per the catalog: {', '.join(acc.zone_hints)}")
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
        if self.reservation is not None:
            if not _RESERVATION_RE.fullmatch(self.reservation):
                raise UserError(f"invalid --reservation {self.reservation!r}: give the reservation's name (e.g. "
                                "my-reservation) or projects/P/locations/Z/reservations/NAME")
            if self.spot:
                raise UserError("--spot and --reservation exclude each other: a reservation is not spot capacity")
            if not self.queued:
                raise UserError("--reservation needs a queued resource (the v2 API names a reservation only there); "
                                "drop --no-queue")
            self.reserved = True
        for what, v in (("--network", self.network), ("--subnetwork", self.subnetwork)):
            if v is not None and not _NETWORK_RE.fullmatch(v):
                raise UserError(f"invalid {what} {v!r}: give a name (default) or a path such as "
                                "projects/P/global/networks/NAME")
        if self.service_account is not None and not _SA_RE.fullmatch(self.service_account):
            raise UserError(f"invalid --service-account {self.service_account!r}: give an email such as "
                            "trainer@my-project.iam.gserviceaccount.com")
        for sc in self.scopes:
            if not isinstance(sc, str) or not re.fullmatch(r"https://www\.googleapis\.com/auth/[a-z0-9._-]+", sc):
                raise UserError(f"invalid scope {sc!r}: give full scope URLs such as {CLOUD_PLATFORM_SCOPE} (or the "
                                "short name cloud-platform)")
        if self.ssh_proxy_command is not None:
            from orchestrator.access import sshproxy
            try:
                sshproxy.check(self.ssh_proxy_command)
            except sshproxy.ProxyError as e:
                raise UserError(str(e)) from None
            if self.iap:
                raise UserError("--ssh-proxy-command and --iap exclude each other: --iap is a proxy command; pick one")
        for k, v in self.metadata.items():
            if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", k) or not isinstance(v, str):
                raise UserError(f"invalid metadata entry {k!r}: keys are letters, digits, '-' or '_' (at most 128), "
                                "values are strings")
        return self

    def with_flags(self, *, name=None, accelerator=None, zone=None, zones=None, spot=None, reserved=None,
                   wait_capacity=None, keep_on_failure=None, no_queue=None, no_external_ips=None, reservation=None,
                   network=None, subnetwork=None, service_account=None, scopes=None, runtime_version=None,
                   labels=(), ttl=None, capacity_wait=None, timeout=None, project=None, api_endpoint=None,
                   provider=None, fresh_vm=None, ssh_proxy_command=None, iap=None, num_slices=None) -> "SliceSpec":
        """`tpuctl up`'s flags over this spec (a spec file's, or an empty one). A flag not given (None or empty)
        leaves the spec's value alone; durations are parsed here, naming the flag when they are bad."""
        for attr, value in (("name", name), ("accelerator", accelerator), ("reservation", reservation),
                            ("network", network), ("subnetwork", subnetwork), ("service_account", service_account),
                            ("runtime_version", runtime_version), ("project", project),
                            ("api_endpoint", api_endpoint), ("ssh_proxy_command", ssh_proxy_command)):
            if value:
                setattr(self, attr, value)
        if not self.name:
            raise UserError("missing NAME: `tpuctl up NAME --accelerator v4-16 --zone us-central2-b`")
        if not self.accelerator:
            raise UserError("missing --accelerator: e.g. --accelerator v4-16 (see `tpuctl up --help`)")
        if zone or zones:
            self.zones = split_zones(([zone] if zone else []) + ([zones] if zones else []))
        for attr, value in (("spot", spot), ("reserved", reserved), ("wait_capacity", wait_capacity),
                            ("keep_on_failure", keep_on_failure), ("iap", iap)):
            if value:
                setattr(self, attr, True)
        if no_queue:
            self.queued = False
        if no_external_ips:
            self.external_ips = False
        if scopes:
            self.scopes = expand_scopes([scopes])
        if labels:
            self.labels = {**self.labels, **parse_labels(labels)}
        for flag, attr, value in (("--ttl", "ttl_s", ttl), ("--capacity-wait", "capacity_wait_s", capacity_wait),
                                  ("--timeout", "timeout_s", timeout)):
            if value:
                setattr(self, attr, parse_duration(value, flag))
        if provider:  # the place the user picked on the command line (--local)
            self.provider = provider
        if num_slices is not None:
            self.num_slices = num_slices
        if fresh_vm:
            self.provider_options = {**self.provider_options, "fresh": True}
        return self

    @property
    def accelerator_type(self) -> catalog.AcceleratorType:
        return catalog.lookup(self.accelerator)

    @property
    def runtime(self) -> str:
        return self.runtime_version or self.accelerator_type.default_runtime_version


_FILE_KEYS = ({f.name for f in dataclasses.fields(SliceSpec)} - {"provider", "provider_options"}
              | {"zone", "ttl", "timeout", "capacity_wait", "local"})
# What each key of a spec file must hold (durations are parsed separately; zones may be a list or "a,b").
_INT_KEYS = ("num_slices",)
_STR_KEYS = ("name", "accelerator", "zone", "project", "runtime_version", "api_endpoint", "reservation", "network",
             "subnetwork", "service_account", "ssh_proxy_command")
_BOOL_KEYS = ("spot", "reserved", "queued", "wait_capacity", "keep_on_failure", "local", "external_ips", "iap")
_DURATION_KEYS = (("ttl", "ttl_s"), ("timeout", "timeout_s"), ("capacity_wait", "capacity_wait_s"))


def _typed(data: dict) -> dict:
    """The spec file's values, type-checked: one UserError line naming the key and what it must hold."""
    def bad(key: str, want: str):
        return UserError(f"invalid `{key}` in slice spec: {data[key]!r} is a {type(data[key]).__name__}; "
                         f"write {want}")
    for key in _STR_KEYS:
        if key in data and data[key] is not None and not isinstance(data[key], str):
            raise bad(key, "a string" + (" (e.g. accelerator: v4-16)" if key == "accelerator" else ""))
    for key in _INT_KEYS:
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int)):
            raise bad(key, "a whole number (e.g. num_slices: 2)")
    for key in _BOOL_KEYS:
        if key in data and not isinstance(data[key], bool):
            raise bad(key, "true or false (unquoted)")
    if "zones" in data and not (isinstance(data["zones"], str) or (
            isinstance(data["zones"], list) and all(isinstance(z, str) for z in data["zones"]))):
        raise bad("zones", "a list of zones (zones: [us-central2-b]) or one string")
    for key in ("labels", "metadata"):
        if key in data and not isinstance(data[key], dict):
            raise bad(key, "a mapping (key: value)")
    if "metadata" in data and not all(isinstance(v, str) for v in data["metadata"].values()):
        raise UserError("invalid `metadata` in slice spec: every value must be a string")
    if "scopes" in data and not (isinstance(data["scopes"], list) and all(isinstance(x, str) for x in data["scopes"])):
        raise bad("scopes", "a list of scope URLs")
    for key, target in _DURATION_KEYS:
        for k in (key, target):
            if k in data and (isinstance(data[k], bool) or not isinstance(data[k], (str, int, float))):
                raise bad(k, "a duration such as 30m or a number of seconds")
    return data


def slice_spec_from_mapping(data: dict) -> SliceSpec:
    """A SliceSpec from a dict as written in a spec file (durations as '8h', zone or zones)."""
    unknown = sorted(set(map(str, data)) - _FILE_KEYS)
    if unknown:
        raise UserError(f"unknown key(s) in slice spec: {', '.join(unknown)}; known: {', '.join(sorted(_FILE_KEYS))}")
    d = dict(_typed(data))
    zones_in = d.pop("zones", None) or []
    zones = split_zones(([d.pop("zone")] if d.get("zone") else []) + ([zones_in] if isinstance(zones_in, str)
                                                                     else list(zones_in)))
    d.pop("zone", None)
    for key, target in _DURATION_KEYS:
        if key in d:
            d[target] = parse_duration(d.pop(key), f"`{key}` in slice spec")
        elif target in d:
            d[target] = parse_duration(d[target], f"`{target}` in slice spec")
    if "name" not in d or "accelerator" not in d:
        raise UserError("a slice spec needs at least `name` and `accelerator`")
    if "scopes" in d:
        d["scopes"] = expand_scopes(d["scopes"])
    if d.pop("local", False):
        d["provider"] = "local"
    return SliceSpec(zones=zones, **d)


def expand_scopes(scopes) -> list[str]:
    """Scope names as the API wants them: 'cloud-platform' -> https://www.googleapis.com/auth/cloud-platform."""
    out = []
    for item in scopes:
        for sc in str(item).split(","):
            sc = sc.strip()
            if sc:
                out.append(sc if sc.startswith("https://") else f"https://www.googleapis.com/auth/{sc}")
    return out


def load_slice_spec(path: str | os.PathLike) -> SliceSpec:
    """Read a YAML (.yaml/.yml) or TOML (.toml) slice spec; a `[slice]` table or top-level keys."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read spec file {p}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"cannot read spec file {p}: it is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
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
    data = data.get("slice", data)
    if not isinstance(data, dict):
        raise UserError(f"spec file {p}: `slice` must hold a mapping of keys to values")
    return slice_spec_from_mapping(data)
