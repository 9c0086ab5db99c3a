"""Peak dense bf16 FLOP/s and HBM bandwidth per chip, by jax `device_kind`: the one table. The trainer's MFU reads it by the devices
it runs on; the orchestrator's catalog reads it by each TPU generation's device kind. Jax-free.

TPU figures are Google's per-chip numbers (the catalog's sources [1]-[5], orchestrator/catalog.py); v2's is
180 per 4-chip board, no longer in the current docs (unverified).
"""
from __future__ import annotations

PEAK_FLOPS = {
    "TPU v2": 45e12,
    "TPU v3": 123e12,        # [5]
    "TPU v4": 275e12,        # [4]
    "TPU v5 lite": 197e12,   # [2]
    "TPU v5e": 197e12,
    "TPU v5": 459e12,        # [3]
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,   # [1]
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
}

# HBM bandwidth per chip, bytes/s: Google's per-chip figures (the catalog's sources [1]-[4]: v6e "1638 GBps",
# v5e "819 GBps", v5p "2765 GBps", v4 "1200 GBps"). A plan's step time is a roofline over these and PEAK_FLOPS.
HBM_BYTES_S = {
    "TPU v4": 1200e9,        # [4]
    "TPU v5 lite": 819e9,    # [2]
    "TPU v5e": 819e9,
    "TPU v5": 2765e9,        # [3]
    "TPU v5p": 2765e9,
    "TPU v6 lite": 1638e9,   # [1]
    "TPU v6e": 1638e9,
}

# HBM per chip, bytes (the catalog's hbm_gib_per_chip, orchestrator/catalog.py, and its sources): what a step's
# estimate is held against before the compiler counts it (trainer/finetune/train.py remat_of).
HBM_BYTES = {
    "TPU v4": 32 * 2 ** 30,        # [4]
    "TPU v5 lite": 16 * 2 ** 30,   # [2]
    "TPU v5e": 16 * 2 ** 30,
    "TPU v5": 95 * 2 ** 30,        # [3]
    "TPU v5p": 95 * 2 ** 30,
    "TPU v6 lite": 32 * 2 ** 30,   # [1]
    "TPU v6e": 32 * 2 ** 30,
}
