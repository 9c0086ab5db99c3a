"""trainer/common/hostmem.py: on the CPU backend the trainer reuses freed host memory instead of page-faulting it in.

Measured the way the trainer meets it: a 256 MB buffer (over glibc's 32 MB mmap ceiling) allocated, freed and
allocated again by a thread other than the main one (XLA:CPU's worker threads allocate each step's buffers),
counting the page faults of the second allocation. A fresh mapping of 256 MB needs at least 128 faults (2 MB
huge pages) and up to 65,536 (4 KB pages); a reused one needs none.
"""
import os
import subprocess
import sys
from pathlib import Path

from _skips import needs_machine

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = """
import resource, sys, threading
import numpy as np
from trainer.common.process import emulate_devices, keep_freed_memory
if sys.argv[1] == "emulate":
    emulate_devices(["--emulate-devices", "2"])  # what `python -m trainer ... --emulate-devices 2` runs first
keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
def work():
    a = np.ones(64 * 2**20, np.float32)
    del a
    f0 = faults()
    a = np.ones(64 * 2**20, np.float32)
    out.append(faults() - f0)
t = threading.Thread(target=work)
t.start()
t.join()
print(out[0])
"""


def _second_allocation_faults(mode: str, **env) -> int:
    e = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPUCTL_KEEP_FREED_MEMORY")}
    r = subprocess.run([sys.executable, "-c", SNIPPET, mode], cwd=ROOT, env={**e, **env}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


@needs_machine(not sys.platform.startswith("linux"), "glibc (Linux)")
def test_cpu_backend_reuses_freed_memory():
    assert _second_allocation_faults("emulate") < 8


@needs_machine(not sys.platform.startswith("linux"), "glibc (Linux)")
def test_glibc_defaults_kept_off_cpu_or_when_opted_out():
    # Without the CPU backend chosen (e.g. a TPU host), or with the opt-out, glibc maps the buffer afresh.
    assert _second_allocation_faults("none") >= 64
    assert _second_allocation_faults("emulate", TPUCTL_KEEP_FREED_MEMORY="0") >= 64
