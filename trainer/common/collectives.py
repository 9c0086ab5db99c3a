"""The collectives of a compiled step that cross slices: what a multislice step sends over the data-center network.

Read from the compiled program's HLO text, in either of two forms:
- The TPU compiler (libtpu) builds one slice's program (num_partitions = the devices of a slice) and moves what
  crosses slices with host-transfer sends to its DCN runtime (`send(...)` with `_xla_megascale_transfer_type`,
  e.g. ALL_REDUCE): each such send is one DCN collective, its bytes the send's buffer. A cross-slice all-reduce
  becomes a reduce-scatter over the slice's ICI, a DCN all-reduce of each device's share, an all-gather.
- The CPU compiler keeps one program over every device, and its collectives name their devices. After SPMD
  partitioning a collective names its devices by their
index in the program's device assignment, which for a step jitted over a mesh is the mesh's devices in order
(mesh.devices.flat); the hybrid mesh (trainer/common/mesh.py) puts the slices on its first axis, `dcn`, so
device i is on slice i // (devices per slice). A collective crosses slices when one of its replica groups (or,
for a collective-permute, one of its source -> target pairs) holds devices of two slices.

Its bytes are what each device hands to the collective (its operands), per device: the buffer an all-reduce
or reduce-scatter reduces, the shard an all-gather contributes, what a permute sends. How many of those bytes
travel over DCN depends on the algorithm the runtime picks (a ring all-reduce over N slices sends 2 (N - 1) / N
of the buffer); the count does not guess it.
"""
from __future__ import annotations

import math
import re

import numpy as np

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
# "%x = TYPE op(-start)?(OPERANDS), attrs": the -done half of an async pair moves nothing of its own.
_INSTR = re.compile(r"=\s*(?P<type>.+?)\s+(?P<op>" + "|".join(OPS) + r")(?:-start)?\((?P<args>.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_SEND = re.compile(r"=\s*(?P<type>\(.+?)\s+send\(.*_xla_megascale_transfer_type=\"?(?P<kind>\w+)")
_DEF = re.compile(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+[\w\-]+\(")
_ITEM = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_LIST = re.compile(r"(replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")


def _itemsize(dtype: str) -> int:
    if dtype in _ITEM:
        return _ITEM[dtype]
    if dtype.startswith("f8"):
        return 1
    return max(int(re.sub(r"\D", "", dtype)) // 8, 1)


def _bytes(type_text: str) -> int:
    """The bytes of an HLO type: an array, or a tuple of arrays."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _itemsize(t) for t, dims in _ARRAY.findall(type_text))


def _operand_bytes(args: str, types: dict[str, str]) -> int:
    """The bytes of an instruction's operands (the names inside its parentheses, looked up in `types`: the
    compiler's text does not always print an operand's shape beside it)."""
    for _ in range(2):  # layouts ({1,0:T(8,128)}) hold parentheses; replica groups nest braces once
        args = re.sub(r"\{[^{}]*\}", "", args)
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return sum(_bytes(types.get(name, "")) for name in re.findall(r"%([\w.\-]+)", args[:end]))


def groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups of one collective instruction: replica groups over named mesh axes, iota or listed
    replica groups, a permute's pairs; one group of every device when it names none (or in a form not known
    here: counted as crossing, the safe side)."""
    m = _MESH.search(line)
    if m:
        axes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        ids = np.arange(math.prod(axes.values())).reshape(list(axes.values()))
        over = [list(axes).index(a) for a in re.findall(r"'([^']+)'", m.group(2)) if a in axes]
        keep = [i for i in range(len(axes)) if i not in over]
        # Devices that differ only along the named axes make a group.
        return ids.transpose(keep + over).reshape(-1, math.prod(ids.shape[i] for i in over) if over else 1).tolist()
    m = _IOTA.search(line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = _LIST.search(line)
    if m and m.group(2):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(2))]
    return [list(range(n_devices))]


def crossing(hlo_text: str, n_devices: int, n_slices: int) -> dict:
    """{dcn_send_ops, dcn_send_bytes, dcn_ops_by_kind}: the collectives of `hlo_text` whose groups hold devices of
    more than one slice, with their operand bytes per device (module docstring)."""
    per_slice = n_devices // max(n_slices, 1)
    ops, sent, kinds = 0, 0, {}
    if n_slices > 1:
        lines = hlo_text.splitlines()
        types = {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}
        parts = re.search(r"num_partitions=(\d+)", hlo_text)
        # One slice's program (the TPU compiler's): its own collectives stay on the slice's ICI.
        one_slice = parts is not None and int(parts.group(1)) * n_slices == n_devices
        for line in lines:
            m = _SEND.search(line)
            if m:  # the TPU compiler's DCN transfer: its buffer is the first element of the send's type
                ops += 1
                sent += _bytes(_ARRAY.search(m.group("type")).group(0))
                kind = m.group("kind").lower().replace("_", "-")
                kinds[kind] = kinds.get(kind, 0) + 1
                continue
            m = None if one_slice else _INSTR.search(line)
            if not m:
                continue
            if not any(len({d // per_slice for d in g}) > 1 for g in groups(line, n_devices)):
                continue
            ops += 1
            sent += _operand_bytes(m.group("args"), types)
            kinds[m.group("op")] = kinds.get(m.group("op"), 0) + 1
    return {"dcn_send_ops": ops, "dcn_send_bytes": sent, "dcn_ops_by_kind": kinds}
