"""Cloud TPU accelerator types: chips, VMs (workers), topology, HBM, peak bf16 TFLOP/s, list price.

Each figure carries its source (numbered in the comments below). The zone lists are hints only: the API's own `acceleratorTypes` listing for a zone is the
source of truth (cloud.py asks it before creating anything).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from trainer.common.chips import HBM_BYTES_S, PEAK_FLOPS

# Sources (see catalog.md for the full list):
# [1] https://docs.cloud.google.com/tpu/docs/v6e
# [2] https://cloud.google.com/tpu/docs/v5e
# [3] https://cloud.google.com/tpu/docs/v5p ; https://docs.cloud.google.com/tpu/docs/v5p-training
# [4] https://docs.cloud.google.com/tpu/docs/v4.md.txt
# [6] https://cloud.google.com/tpu/docs/regions-zones
# [7] https://github.com/AI-Hypercomputer/xpk/blob/02b0c0928aeee28beee4b90f853073488d3893fb/src/xpk/core/system_characteristics.py
# [9] https://cloud.google.com/tpu/docs/runtimes
# [10] https://github.com/skypilot-org/skypilot-catalog/blob/017e2502fb63c7a28757acd94002b2d6099d3e3d/catalogs/v7/gcp/vms.csv
#      (third party, built from GCP SKUs, US regions, undated: list prices are estimates)
# [5] https://cloud.google.com/tpu/docs/v3 ; [6b] an older version of [6] (v2/v3 zones, v2 HBM)
# [12] https://cloud.google.com/tpu/docs/quota (v2-8/v3-8: 4 chips, 8 TensorCores, one host)
# [16] https://docs.cloud.google.com/tpu/docs/ray-guide (v5p in europe-west4-b)
# [6e] https://cloud.google.com/tpu/docs/types-zones (an older version: v5e in us-east5-a/b/c)
# [21] https://github.com/apple/axlearn/blob/c18592d3027fb951bb047728640b80722b3d0159/axlearn/common/aot_compilation.py
#      (libtpu topology names, chip configs and host bounds for AOT compiles: v4-8 = "v4:2x2x1", megacore)


@dataclass(frozen=True)
class Generation:
    name: str                     # "v4", "v5p", "v5litepod", "v6e"
    api_type: str                 # AcceleratorConfig.Type in the v2 API
    device_kind: str              # jax's device_kind on these chips: the key of the peak FLOP/s table
    hbm_gib_per_chip: float
    chips_per_vm: int             # multi-host slices use 4-chip VMs on every generation [7]
    name_counts_cores: bool       # v4/v5p-N: N = TensorCores (2 per chip); v5e/v6e-N: N = chips
    price_on_demand: float        # USD per chip-hour, US regions [10]
    price_spot: dict[str, float]  # USD per chip-hour by region; the first entry is the default [10]
    runtime_version: str          # default software version [9]
    zones: tuple[str, ...]        # hints only [6]
    topologies: dict[int, tuple[str, int]]  # size in the name -> (topology, VMs)
    devices_per_chip: int = 1     # JAX devices: one per chip (megacore, v5e, v6e); v2/v3: one per TensorCore
    # Ahead-of-time compile (orchestrator/plan/step.py): libtpu's name for the generation ("" = none) and chip
    # config; megacore makes one device per chip, as the runtime on these VMs has [21].
    aot_name: str = ""
    aot_chip_config: str = "default"

    @property
    def peak_bf16_tflops(self) -> float:
        """Per chip, from the one table (trainer/common/chips.py)."""
        return PEAK_FLOPS[self.device_kind] / 1e12

    @property
    def hbm_bytes_s(self) -> float | None:
        """HBM bandwidth per chip, bytes/s, from the same table (None where it has no figure: v2, v3)."""
        return HBM_BYTES_S.get(self.device_kind)


GENERATIONS: dict[str, Generation] = {
    "v4": Generation(
        name="v4", api_type="V4",
        device_kind="TPU v4",     # peak bf16 FLOP/s per chip: trainer/common/chips.py
        hbm_gib_per_chip=32.0,    # 32 GiB [4]
        chips_per_vm=4, name_counts_cores=True,  # megacore: 1 JAX device per chip
        price_on_demand=3.22, price_spot={"us-central2": 0.92},    # [10]
        runtime_version="tpu-ubuntu2204-base",                     # [9]
        zones=("us-central2-b",),                                  # the only v4 zone [4][6]
        topologies={  # [7]: 4 chips per VM, VMs = chips / 4
            8: ("2x2x1", 1), 16: ("2x2x2", 2), 32: ("2x2x4", 4), 64: ("2x4x4", 8),
            128: ("4x4x4", 16), 256: ("4x4x8", 32), 512: ("4x8x8", 64), 1024: ("8x8x8", 128),
            2048: ("8x8x16", 256), 4096: ("8x16x16", 512),
        },
        aot_name="v4", aot_chip_config="megacore",  # [21]
    ),
    "v5p": Generation(
        name="v5p", api_type="V5P",
        device_kind="TPU v5p",     # peak bf16 FLOP/s per chip: trainer/common/chips.py
        hbm_gib_per_chip=95.0,    # "95GB" on the v5p page, "95 GiB" on v5p-training [3]
        chips_per_vm=4, name_counts_cores=True,
        price_on_demand=4.20,                                       # [10]
        price_spot={"us-central1": 1.68, "us-east1": 1.68, "us-east5": 1.56},  # [10]
        runtime_version="v2-alpha-tpuv5",                           # [9]
        zones=("us-central1-a", "us-east5-a", "europe-west4-b"),    # [6][16]
        topologies={  # [3] (v5p-32 from [7])
            8: ("2x2x1", 1), 16: ("2x2x2", 2), 32: ("2x2x4", 4), 64: ("2x4x4", 8),
            128: ("4x4x4", 16), 256: ("4x4x8", 32), 512: ("4x8x8", 64), 1024: ("8x8x8", 128),
            2048: ("8x8x16", 256), 4096: ("8x16x16", 512), 8192: ("16x16x16", 1024),
            12288: ("16x16x24", 1536),
        },
        aot_name="v5p", aot_chip_config="megacore",  # [21]
    ),
    "v5litepod": Generation(
        name="v5litepod", api_type="V5LITE_POD",
        device_kind="TPU v5 lite",     # peak bf16 FLOP/s per chip: trainer/common/chips.py
        hbm_gib_per_chip=16.0,    # [2]
        chips_per_vm=4, name_counts_cores=False,
        price_on_demand=1.20,                                       # [10]
        price_spot={"us-central1": 0.213, "us-east1": 0.213, "us-west1": 0.213,
                    "us-west4": 0.469, "us-east5": 0.60},           # [10]
        runtime_version="v2-alpha-tpuv5-lite",                      # [9]
        zones=("us-central1-a", "us-south1-a", "us-west1-c", "us-west4-a",   # [6]
               "us-east5-a", "us-east5-b", "us-east5-c", "europe-west4-b"), # [6e]
        topologies={  # -1/-4/-8: one 1-, 4- or 8-chip VM [2]; larger: 4-chip VMs [7]
            1: ("1x1", 1), 4: ("2x2", 1), 8: ("2x4", 1), 16: ("4x4", 4), 32: ("4x8", 8),
            64: ("8x8", 16), 128: ("8x16", 32), 256: ("16x16", 64),
        },
        aot_name="v5e", aot_chip_config="default",  # [21]
    ),
    "v6e": Generation(
        name="v6e", api_type="V6E",
        device_kind="TPU v6 lite",     # peak bf16 FLOP/s per chip: trainer/common/chips.py
        hbm_gib_per_chip=32.0,    # 32 GB [1]
        chips_per_vm=4, name_counts_cores=False,
        price_on_demand=2.70,                                       # [10]
        price_spot={"us-central1": 0.648, "us-east1": 0.648, "us-west1": 0.648,
                    "us-east5": 1.08},                              # [10]
        runtime_version="v2-alpha-tpuv6e",                          # [9]
        zones=("us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "europe-west4-a"),  # [6]
        topologies={  # -1/-4/-8: one VM [1]; larger: 4-chip VMs (catalog.md "VMs")
            1: ("1x1", 1), 4: ("2x2", 1), 8: ("2x4", 1), 16: ("4x4", 4), 32: ("4x8", 8),
            64: ("8x8", 16), 128: ("8x16", 32), 256: ("16x16", 64),
        },
        aot_name="v6e", aot_chip_config="default",  # [21]
    ),
    "v2": Generation(
        name="v2", api_type="V2",
        device_kind="TPU v2",     # peak bf16 FLOP/s per chip: trainer/common/chips.py
        hbm_gib_per_chip=16.0,    # v2-8 = 64 GiB [6b]
        chips_per_vm=4, name_counts_cores=True,
        price_on_demand=1.125, price_spot={"us-central1": 0.3375},  # [10]
        runtime_version="tpu-ubuntu2204-base",                      # "v4 and older" [9]
        zones=("us-central1-b", "us-central1-c", "us-central1-f", "europe-west4-a"),  # [6b]
        topologies={8: ("2x2", 1)},  # the size still offered [6b][12]
        devices_per_chip=2,
    ),
    "v3": Generation(
        name="v3", api_type="V3",
        device_kind="TPU v3",     # peak bf16 FLOP/s per chip: trainer/common/chips.py
        hbm_gib_per_chip=32.0,    # [5]
        chips_per_vm=4, name_counts_cores=True,
        price_on_demand=2.00, price_spot={"us-central1": 0.51},     # [10]
        runtime_version="tpu-ubuntu2204-base",                      # [9]
        zones=("us-central1-a", "us-central1-b", "us-central1-f", "europe-west4-a"),  # [6b]
        topologies={8: ("2x2", 1)},  # [6b][12]
        devices_per_chip=2,
    ),
}

# Names people type for the same thing; the API only knows the canonical ones.
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "v5litepod": "v5litepod"}


@dataclass(frozen=True)
class AcceleratorType:
    name: str            # the API's name, e.g. "v4-16"
    generation: Generation
    chips: int
    hosts: int           # worker VMs, = len(node.networkEndpoints)
    topology: str

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def devices_per_host(self) -> int:
        # one JAX device per chip on v4/v5p (megacore), v5e and v6e; one per TensorCore on v2/v3
        return self.chips_per_host * self.generation.devices_per_chip

    @property
    def hbm_gib_per_chip(self) -> float:
        return self.generation.hbm_gib_per_chip

    @property
    def hbm_gib(self) -> float:
        return self.chips * self.generation.hbm_gib_per_chip

    @property
    def peak_bf16_tflops(self) -> float:
        return self.chips * self.generation.peak_bf16_tflops

    @property
    def default_runtime_version(self) -> str:
        return self.generation.runtime_version

    @property
    def zone_hints(self) -> tuple[str, ...]:
        return self.generation.zones

    @property
    def aot_topology(self) -> str:
        """libtpu's topology name for an ahead-of-time compile, e.g. "v4:2x2x1" ("" when not known)."""
        return f"{self.generation.aot_name}:{self.topology}" if self.generation.aot_name else ""

    @property
    def aot_host_bounds(self) -> str:
        """Chips per host as libtpu's X,Y,Z box: the whole slice on one VM, else 2x2x1 (4-chip VMs)."""
        if self.hosts > 1:
            return "2,2,1"
        dims = [int(x) for x in self.topology.split("x")]
        return ",".join(str(d) for d in (dims + [1, 1])[:3])

    def price_per_chip_hour(self, zone: str | None = None, spot: bool = False) -> float:
        g = self.generation
        if not spot:
            return g.price_on_demand
        region = zone.rsplit("-", 1)[0] if zone else ""
        return g.price_spot.get(region, next(iter(g.price_spot.values())))

    def price_per_hour(self, zone: str | None = None, spot: bool = False) -> float:
        return round(self.chips * self.price_per_chip_hour(zone, spot), 4)


class UnknownAccelerator(ValueError):
    """The name is not in the catalog; the message suggests the closest known names."""


def _canonical(name: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"([a-z0-9]+?)-(\d+)", name.strip().lower())
    if not m:
        return None
    gen = _ALIASES.get(m.group(1), m.group(1))
    return gen, int(m.group(2))


def lookup(name: str) -> AcceleratorType:
    """The catalog entry for an accelerator type ("v4-16", "v5litepod-16", alias "v5e-16")."""
    parsed = _canonical(name)
    if parsed and parsed[0] in GENERATIONS and parsed[1] in GENERATIONS[parsed[0]].topologies:
        g = GENERATIONS[parsed[0]]
        size = parsed[1]
        topology, hosts = g.topologies[size]
        chips = size // 2 if g.name_counts_cores else size
        return AcceleratorType(name=f"{g.name}-{size}", generation=g, chips=chips, hosts=hosts, topology=topology)
    close = difflib.get_close_matches(name.strip().lower(), names(), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else f"known types: {_summary()}"
    raise UnknownAccelerator(f"unknown accelerator type {name!r}; {hint}")


def names() -> list[str]:
    return [f"{g.name}-{size}" for g in GENERATIONS.values() for size in g.topologies]


def all_types() -> list[AcceleratorType]:
    return [lookup(n) for n in names()]


def _summary() -> str:
    return "; ".join(f"{g.name}-{min(g.topologies)}" + (f"..{g.name}-{max(g.topologies)}" if len(g.topologies) > 1
                                                        else "") for g in GENERATIONS.values())


def zones_for(name: str) -> tuple[str, ...]:
    """Catalog zone hints for an accelerator type (the API decides)."""
    return lookup(name).zone_hints


def all_zones() -> list[str]:
    seen: dict[str, None] = {}
    for g in GENERATIONS.values():
        for z in g.zones:
            seen[z] = None
    return list(seen)
