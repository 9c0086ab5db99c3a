"""Processes and devices: jax.distributed from the TPUCTL_* env, the (dcn, data, model) mesh, sharding rules.

Sharding is written once, as logical axis names -> mesh axes (RULES). Parameters carry logical names in
their `axes` metadata; activations are constrained with the same names; the batch is sharded over (dcn, data).
`--mesh data=D,model=M` describes one slice (its ICI); on several slices (multislice, MEGASCALE_NUM_SLICES) the
outer `dcn` axis runs over the slices, data parallel, so only one set of gradients per slice crosses the
data-center network. On one slice `dcn` has size 1.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from trainer.common.config import UsageError
from trainer.common.process import check_accelerator

DCN = "dcn"
AXES = (DCN, "data", "model")
ICI = ("data", "model")  # one slice's axes (--mesh)
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": (DCN, "data"),
    "vocab": "model",
    "heads": "model",
    "mlp": "model",
    "embed": None,
    "seq": None,
    "residual_seq": "model",  # Gemma's residual stream between layers (trainer/models/gemma.py RESIDUAL)
    "head_dim": None,
    # Gemma: the model width of each weight matrix is sharded fsdp-style over `data`; kv heads like heads.
    "fsdp": "data",
    "kv_heads": "model",
    # Gemma 4's routed experts (trainer/models/moe.py): each device keeps a share of the experts whole and the
    # tokens travel to them (expert parallelism over every device of a slice); where the experts do not divide
    # over data x model they fall back to the fsdp / mlp sharding of their other dims.
    "expert": ("data", "model"),
}
# --vocab-parallel, and the LoRA step's frozen Gemma embedding wherever its rows divide over the devices: the tied
# embedding's vocab rows over every device (trainer/models/vocab_parallel.py).
VOCAB_PARALLEL_RULES = {**RULES, "vocab": AXES}
# ZeRO-1 (--optimizer-state sharded): a parameter's optimizer state, and its gradient where the update reads
# it, are also split over this axis, on the first dimension the parameter's own sharding leaves whole and the
# axis divides (trainer/common/optim.py). Each device updates its share; the parameters are then gathered.
STATE_SPLIT = "data"


def init_distributed() -> bool:
    """Join the multi-process job described by TPUCTL_* (see docs/CONTRACTS.md). True if joined. Then, on a
    host with a TPU device node, make sure jax found the TPU (trainer/common/process.check_accelerator)."""
    joined = _join()
    check_accelerator()
    return joined


def _join() -> bool:
    coord = os.environ.get("TPUCTL_COORDINATOR")
    if not coord:
        return False
    try:
        n, pid = int(os.environ["TPUCTL_NUM_PROCESSES"]), int(os.environ["TPUCTL_PROCESS_ID"])
    except (KeyError, ValueError):
        raise UsageError("TPUCTL_COORDINATOR is set but TPUCTL_NUM_PROCESSES / TPUCTL_PROCESS_ID are "
                         "missing or not integers") from None
    # Process 0 serves the coordinator on worker 0's own address only (JAX's default is every interface,
    # which on a VM with an external IP is the internet); JAX_COORDINATOR_BIND_ADDRESS still overrides.
    jax.distributed.initialize(
        coordinator_address=coord, num_processes=n, process_id=pid,
        coordinator_bind_address=os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or coord,
        heartbeat_timeout_seconds=int(os.environ.get("TPUCTL_HEARTBEAT_TIMEOUT_S", 100)),
        initialization_timeout=int(os.environ.get("TPUCTL_INIT_TIMEOUT_S", 300)))
    return True


BARRIER_TIMEOUT_ENV = "TPUCTL_BARRIER_TIMEOUT_S"
_met: dict[str, int] = {}


def meet(what: str) -> None:
    """Every process of a multi-process job waits here for all the others (the coordination service's barrier).

    Called after each compile and before the program's first run: that first run sets up the collectives'
    communicators, and on the CPU backend (Gloo) a process that arrives there more than Gloo's fixed 30 s after
    another fails the whole job. Compiles take different times on different hosts (a busy machine, a cold
    compile cache), so the processes meet first and reach the collectives together. A process that does not
    arrive within $TPUCTL_BARRIER_TIMEOUT_S (default 600) is named."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None or jax.process_count() < 2:
        return
    _met[what] = _met.get(what, 0) + 1
    timeout_s = float(os.environ.get(BARRIER_TIMEOUT_ENV, "600") or 600)
    try:
        client.wait_at_barrier(f"tpuctl_{re.sub(r'[^a-z]+', '_', what)}_{_met[what]}", int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - jaxlib's XlaRuntimeError (DEADLINE_EXCEEDED, or a task that died)
        # The service lists the processes that had not arrived after "timed out task names" (the first task
        # at the barrier, named before that, is one that did).
        # jaxlib 0.10 lists them one per line as bare task ids ("Some timed out task names:\n1"), older ones as
        # "/job:jax_worker/replica:0/task:1"; the service's message ends at "RPC:".
        late = str(e).split("timed out task", 1)[1].split("RPC:", 1)[0] if "timed out task" in str(e) else ""
        late = late.split(":", 1)[-1]
        missing = sorted({int(t) for t in re.findall(r"(?:task:|^\s*)(\d+)\s*$", late, re.M)}
                         - {jax.process_index()})
        who = (f"process(es) {', '.join(map(str, missing))} (tpuctl's worker(s) {', '.join(f'w{i}' for i in missing)})"
               if missing else "another process")
        raise UsageError(f"{who} did not reach {what} within {timeout_s:.0f} s of process {jax.process_index()} "
                         f"({' '.join(str(e).split())[:300]})") from None


def parse_mesh(spec: str, n_devices: int) -> dict[str, int]:
    """'data=4,model=2' -> {'data': 4, 'model': 2}; '' = all devices on data. Checked against n_devices."""
    shape = {"data": 0, "model": 1}
    if spec:
        for part in spec.split(","):
            name, _, val = part.partition("=")
            name = name.strip()
            if name not in shape or not val.strip().isdigit() or int(val) < 1:
                raise UsageError(f"--mesh {spec}: expected data=D,model=M with positive integers")
            shape[name] = int(val)
    if not shape["data"]:
        if n_devices % shape["model"]:
            raise UsageError(f"--mesh {spec}: model={shape['model']} does not divide the {n_devices} devices")
        shape["data"] = n_devices // shape["model"]
    if shape["data"] * shape["model"] != n_devices:
        raise UsageError(f"--mesh {spec}: data*model = {shape['data'] * shape['model']} but there are "
                         f"{n_devices} devices; use sizes whose product is {n_devices}")
    return shape


def one_step_in_flight(mesh: Mesh) -> bool:
    """Whether the host must wait for each step before dispatching the next: a CPU mesh of several devices.

    XLA:CPU launches each device's share of a program on a small shared thread pool, and a launch holds its
    thread while it waits for the device's in-flight budget or for the program's collectives. With steps queued
    ahead (the host only waits at logged steps), the pool can fill with such launches while a launch their
    collectives wait for has no thread left: all but one device sit in an all-gather. Across processes (gloo)
    every process then sleeps at 0% CPU; within one process XLA aborts after 40 s ("only 7 of 8 threads
    arrived"). One program in flight at a time leaves every launch a thread. TPU and GPU runtimes queue per
    device stream without that pool: they keep the queue ahead that hides the host's time."""
    return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


def make_mesh(shape: dict[str, int], devices=None) -> Mesh:
    """One slice's mesh (dcn = 1). devices: default every device of the job; trainer/common/aot.py passes a TPU
    topology's devices instead."""
    # Auto axes: XLA propagates shardings through gathers (the embedding lookup) that Explicit axes reject.
    return jax.make_mesh((1, shape["data"], shape["model"]), AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)


def slices() -> tuple[int, int]:
    """(number of slices, this process's slice) from MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID: what a multislice
    queued resource's TPU VMs have in their tpu-env, and what `tpuctl run` sets on every host. (1, 0) without."""
    try:
        n, sid = int(os.environ.get("MEGASCALE_NUM_SLICES") or 1), int(os.environ.get("MEGASCALE_SLICE_ID") or 0)
    except ValueError:
        raise UsageError("MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID are not integers") from None
    if n < 1 or not 0 <= sid < n:
        raise UsageError(f"MEGASCALE_SLICE_ID {sid} is not a slice of MEGASCALE_NUM_SLICES {n}")
    return n, sid


def slice_of_process(process: int, n_processes: int, n_slices: int) -> int:
    """Processes are slice-major (process = slice x hosts_per_slice + worker), as jax.distributed numbers them
    on TPU VMs from MEGASCALE_SLICE_ID."""
    return process // (n_processes // n_slices)


def slice_groups(devices, n_slices: int, n_processes: int) -> list[list]:
    """The devices of each slice, in id order. TPU devices know their slice (`slice_index`); CPU devices do not
    (theirs is always 0), and jax's own grouping fits only one process per slice: here a slice is H = processes / slices consecutive
    processes, so a local multislice run builds its mesh on the same code path."""
    if n_processes % n_slices:
        raise UsageError(f"{n_processes} processes do not split over {n_slices} slices (MEGASCALE_NUM_SLICES)")
    groups: list[list] = [[] for _ in range(n_slices)]
    ordered = sorted(devices, key=lambda d: d.id)
    # All in one process: a plan's CPU devices standing in for several slices' hosts (trainer/common/aot.py);
    # consecutive devices make a slice, as consecutive processes do in a run.
    one_process = len({d.process_index for d in ordered}) == 1
    for i, d in enumerate(ordered):
        s = getattr(d, "slice_index", None) if d.platform == "tpu" else None  # jax's CPU devices say slice 0
        if s is None:
            s = i * n_slices // len(ordered) if one_process else slice_of_process(d.process_index, n_processes,
                                                                                   n_slices)
        groups[s].append(d)
    if len({len(g) for g in groups}) != 1:
        raise UsageError(f"the slices hold different device counts ({', '.join(str(len(g)) for g in groups)})")
    return groups


def job_mesh(spec_text: str, devices=None, n_slices: int | None = None, n_processes: int | None = None) -> Mesh:
    """The run's mesh: --mesh on one slice, or the hybrid (dcn, data, model) mesh over several, --mesh describing
    each slice. On TPU the hybrid mesh is jax's own (mesh_utils.create_hybrid_device_mesh, by slice_index); on
    CPU devices each slice's devices (slice_groups) are laid out the same way."""
    devices = list(devices if devices is not None else jax.devices())
    n = slices()[0] if n_slices is None else n_slices
    if n == 1:
        return make_mesh(parse_mesh(spec_text, len(devices)), devices)
    if len(devices) % n:
        raise UsageError(f"{len(devices)} devices do not split over {n} slices")
    try:
        shape = parse_mesh(spec_text, len(devices) // n)
    except UsageError as e:
        raise UsageError(f"{e} (on each of the {n} slices: --mesh describes one slice)") from None
    procs = jax.process_count() if n_processes is None else n_processes
    if all(getattr(d, "slice_index", None) is not None for d in devices) and devices[0].platform == "tpu":
        from jax.experimental import mesh_utils
        arr = mesh_utils.create_hybrid_device_mesh((1, shape["data"], shape["model"]), (n, 1, 1), devices)
    else:
        arr = np.array(slice_groups(devices, n, procs), dtype=object).reshape(n, shape["data"], shape["model"])
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * 3)


def describe(mesh: Mesh) -> str:
    """'data=4,model=1', or on several slices '2 slices x data=4,model=1'."""
    ici = f"data={mesh.shape['data']},model={mesh.shape['model']}"
    return ici if mesh.shape[DCN] == 1 else f"{mesh.shape[DCN]} slices x {ici}"


def shape_of(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes as run_info and plans record them: dcn only when there are several slices."""
    return {k: int(v) for k, v in mesh.shape.items() if k != DCN or v > 1}


def spec(axes: tuple[str | None, ...] | None, rules: dict = RULES) -> P:
    """Logical axis names -> PartitionSpec over mesh axes, through `rules`."""
    if not axes:
        return P()
    return P(*(rules[a] if a is not None else None for a in axes))


def sharding(mesh: Mesh, axes: tuple[str | None, ...] | None, rules: dict = RULES) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, rules))


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's sharding (inside jit, under `jax.set_mesh(mesh)`; a no-op without a mesh)."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec(axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def fitted_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: dict[str, int],
                rules: dict = RULES) -> P:
    """spec(axes) for an array of `shape`, with a mesh axis that does not divide its dimension (or that an
    earlier dimension already uses) left out: that dimension stays whole, e.g. a single kv head on model=2.

    An array's `fsdp` dimension also takes the slice's mesh axes (data, model; never dcn) that no other
    dimension of it uses, where they divide it: a weight `model` cannot split by its heads (4 kv heads on
    model=8), or one with no dimension over `model` at all (a LoRA adapter's A), is split over `model`
    fsdp-style. So more `model` on the same devices never leaves a device more of a weight to hold."""
    size_of = lambda names: math.prod(mesh_shape.get(name, 1) for name in names)  # noqa: E731
    used: set[str] = set()
    out: list = []
    for a, n in zip(axes, shape):
        m = rules[a] if a is not None else None
        names = (m,) if isinstance(m, str) else tuple(m or ())
        if not names or n % size_of(names) or used & set(names):
            out.append(None)
            continue
        used |= set(names)
        out.append(m)
    if "fsdp" in axes:
        i = axes.index("fsdp")
        have = out[i]
        names = () if have is None else (have,) if isinstance(have, str) else tuple(have)
        for extra in ICI:
            if extra not in used and mesh_shape.get(extra, 1) > 1 and shape[i] % size_of(names + (extra,)) == 0:
                names += (extra,)
                used.add(extra)
        out[i] = None if not names else names[0] if len(names) == 1 else names
    return P(*out)


def split_state(s: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """A parameter's sharding `s` with STATE_SPLIT added on the first dimension it leaves whole that the axis
    divides; `s` itself when it already uses the axis (fsdp) or no dimension takes it."""
    n = s.mesh.shape.get(STATE_SPLIT, 1)
    spec = tuple(s.spec) + (None,) * (len(shape) - len(s.spec))
    used = {a for p in spec for a in ((p,) if isinstance(p, str) else (p or ()))}
    if n == 1 or STATE_SPLIT in used:
        return s
    for i, (p, size) in enumerate(zip(spec, shape)):
        if p is None and size % n == 0:
            return NamedSharding(s.mesh, P(*spec[:i], STATE_SPLIT, *spec[i + 1:]))
    return s


def compute_dtype(name: str, platform: str | None = None):
    """platform: of the devices the step runs on (default: this process's backend); an ahead-of-time
    compile for TPU devices from a CPU-only process decides by the TPU's."""
    if name == "auto":  # bf16 matmuls are native on TPU/GPU; on CPU they are slower than f32
        return jnp.bfloat16 if (platform or jax.default_backend()) in ("tpu", "gpu") else jnp.float32
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
