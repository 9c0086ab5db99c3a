"""What `up` will create: the plan it prints (chips, hosts, HBM, price, zones) and the zones that can hold it."""
from __future__ import annotations

import difflib
import time
from dataclasses import dataclass

from orchestrator.provider.cloud import Api, CloudError
from orchestrator.slices.common import Progress
from orchestrator.spec import LABEL_EXPIRY, LABEL_NAME, LABEL_OWNER, SliceSpec, UserError, owner_label


@dataclass
class Plan:
    name: str
    accelerator: str
    chips: int
    hosts: int
    topology: str
    hbm_gib: float
    hbm_gib_per_chip: float
    peak_bf16_tflops: float
    price_per_hour: float        # USD, list price (catalog); spot or on-demand
    spot: bool
    reserved: bool
    zones: list[str]
    runtime_version: str
    project: str
    queued: bool
    labels: dict[str, str]
    slices: int = 1              # a multislice queued resource of this many slices: the figures are the total


    def summary(self) -> str:
        kind = "spot" if self.spot else ("reserved" if self.reserved else "on-demand")
        how = "queued resource" if self.queued else "node"
        if self.slices > 1:
            how = f"one multislice queued resource (nodes {self.name}-0 .. {self.name}-{self.slices - 1}, all or none)"
        what = self.accelerator if self.slices == 1 else f"{self.slices} x {self.accelerator} joined by DCN"
        return (f"{self.name}: {what} = {self.chips} chips on {self.hosts} host(s), topology "
                f"{self.topology}, {self.hbm_gib:g} GiB HBM ({self.hbm_gib_per_chip:g}/chip), "
                f"{self.peak_bf16_tflops:,.0f} peak bf16 TFLOP/s; ${self.price_per_hour:.2f}/hour {kind} list price; "
                f"{how} in {', '.join(self.zones)} (project {self.project}, runtime {self.runtime_version})")


def make_plan(spec: SliceSpec, project: str, zones: list[str] | None = None) -> Plan:
    acc = spec.accelerator_type
    zones = zones or spec.zones
    n = spec.num_slices
    return Plan(name=spec.name, accelerator=acc.name, chips=acc.chips * n, hosts=acc.hosts * n,
                topology=acc.topology + (f" per slice" if n > 1 else ""), hbm_gib=acc.hbm_gib * n,
                hbm_gib_per_chip=acc.hbm_gib_per_chip, peak_bf16_tflops=acc.peak_bf16_tflops * n,
                price_per_hour=acc.price_per_hour(zones[0] if zones else None, spec.spot) * n, spot=spec.spot,
                reserved=spec.reserved, zones=list(zones), runtime_version=spec.runtime, project=project,
                queued=spec.queued, labels=labels_of(spec), slices=n)


def labels_of(spec: SliceSpec, now: float | None = None) -> dict[str, str]:
    now = time.time() if now is None else now
    expiry = str(int(now + spec.ttl_s)) if spec.ttl_s else "never"
    return {**spec.labels, LABEL_NAME: spec.name, LABEL_OWNER: owner_label(), LABEL_EXPIRY: expiry}


def usable_zones(api: Api, spec: SliceSpec, progress: Progress) -> list[str]:
    """The zones whose acceleratorTypes listing (the source of truth) offers the accelerator."""
    usable, refused = [], []
    for zone in spec.zones:
        try:
            offered = api.accelerator_types(zone)
        except CloudError as e:
            if e.kind in ("zone", "not-found"):
                raise CloudError("zone", f"{e}; zones offering {spec.accelerator} per the catalog: "
                                         f"{', '.join(spec.accelerator_type.zone_hints)}", raw=e.raw,
                                 status=e.status) from None
            raise
        if spec.accelerator in offered:
            usable.append(zone)
        else:
            refused.append((zone, offered))
            if len(spec.zones) > 1:
                progress(f"{zone} does not offer {spec.accelerator}; skipping it")
    if not usable:
        zone, offered = refused[0]
        same_gen = [t for t in offered if t.split("-")[0] == spec.accelerator.split("-")[0]]
        listed = ", ".join(same_gen or offered[:8]) or "nothing"
        hints = [z for z in spec.accelerator_type.zone_hints if z not in spec.zones]
        raise UserError(f"{spec.accelerator} is not offered in {', '.join(spec.zones)} (the API lists there: {listed}); "
                        + (f"try --zone {hints[0]} (catalog zones for {spec.accelerator_type.generation.name}: "
                           f"{', '.join(spec.accelerator_type.zone_hints)})" if hints else "pick another accelerator"))
    versions = api.runtime_versions(usable[0])
    if spec.runtime not in versions:
        close = difflib.get_close_matches(spec.runtime, versions, n=3, cutoff=0.5)
        raise UserError(f"runtime version {spec.runtime!r} is not available in {usable[0]}; "
                        + (f"did you mean {', '.join(close)}?" if close else
                           f"the default for {spec.accelerator_type.generation.name} is "
                           f"{spec.accelerator_type.default_runtime_version}"))
    return usable
