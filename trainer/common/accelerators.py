"""The host's accelerator device nodes: one probe for the trainer (trainer/common/process.py, which picks the
backend before jax starts and checks it after) and for the host tools (orchestrator/host/hostprobe.py, which the
orchestrator sends to a host ahead of its own source and runs with the host's python3 before anything is
installed there: so standard library only, Python >= 3.8, and no `from __future__` import).

A TPU chip shows as /dev/accel<N> (v4, v5p) or /dev/vfio/<N> (v5e, v6e; N is not always 0: one v5e host had
only /dev/vfio/1), a GPU as /dev/nvidia<N>. TPUCTL_DEVICE_ROOT moves where they are looked for (tests point it at
a fake device tree)."""
import glob
import os

DEVICE_ROOT_ENV = "TPUCTL_DEVICE_ROOT"


def _dev(root=None):
    return os.path.join(root or os.environ.get(DEVICE_ROOT_ENV) or "/", "dev")


def tpu_nodes(root=None):
    """The TPU chips' device nodes, sorted: /dev/accel*, and /dev/vfio/<N> (not /dev/vfio/vfio, the container)."""
    dev = _dev(root)
    vfio = [p for p in glob.glob(os.path.join(dev, "vfio", "*")) if os.path.basename(p).isdigit()]
    return sorted(glob.glob(os.path.join(dev, "accel*")) + vfio)


def gpu_nodes(root=None):
    """/dev/nvidia<N> (not /dev/nvidiactl or /dev/nvidia-uvm)."""
    return sorted(p for p in glob.glob(os.path.join(_dev(root), "nvidia*")) if os.path.basename(p)[6:].isdigit())


def device_nodes(root=None):
    """Every accelerator device node of this host (TPU chips, then GPUs)."""
    return tpu_nodes(root) + gpu_nodes(root)
