"""The HBM bytes of a compiled step, charged to the instructions that move them and to the jax source that wrote
them: the compiler's `bytes accessed` taken apart.

The TPU compiler's cost analysis gives one total, counts a while loop's body once, and says nothing of where
the bytes go. This reads the optimized HLO text (`compiled.as_text()`) and charges each top-level instruction of
every computation the step runs as the cost analysis does (XLA's HloCostAnalysis):
- a fusion: its result, and each operand as its fused parameter is read (a parameter read only through slices
  or dynamic slices costs the slices; one updated in place by a dynamic-update-slice costs nothing, its update
  being the result; one the fusion only hands on as an element of its result tuple, as the compiler's windowed
  matmul loops pass their carried buffers from trip to trip, costs nothing either way: the buffer stays where it
  is);
- an async collective libtpu splits over a chain of fusions (one collective, one channel_id and chain_id, in
  every fusion of the chain: the first's root an `AsyncCollectiveStart` custom call, the last's an
  `AsyncCollectiveDone`, those between doing other work and returning the collective's in-flight buffer,
  aliased to their operand): its operand and its result once, in the start fusion; the fusions between are
  charged their own work only, the done fusion nothing (it hands the buffer over, as all-gather-done does);
- a Pallas kernel that carries a cost estimate (trainer/kernels/xent_kernel.py's): the estimate's bytes, as the
  compiler takes them; one without (splash attention's): its operands and its result, a lower bound of what it
  moves, which the compiler counts as nothing (so this count runs above the compiler's by those kernels);
- any other custom call, a collective, a convert, a copy: its operands and its result;
- slice / dynamic-slice: twice the slice; dynamic-update-slice: twice the update;
- parameter, constant, tuple, get-tuple-element, bitcast: nothing;
- libtpu's async pairs (copy-start/copy-done, slice-start/slice-done): only the -start half, as the cost analysis
  counts them (the -done half hands over a buffer);
- a while loop: its body and condition times the trip count (`known_trip_count` in its backend config, else the
  bound its condition compares the induction variable with); a call or conditional: what it calls.
Each charge goes to a bucket named from the instruction's jax source (its stack frame: the innermost frame in
this repository, or optax), and whether it is forward or backward (a `transpose(` in its op_name).
Pure text in, figures out: no jax needed (`bench.compiler.tpu_bytes` compiles the step and prints the table; the plan's
calibrated time, trainer/common/aot.py, takes its bytes by class of work).
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

_SIZES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
          "f8e4m3b11fnuz": 1, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\](?:\{([^}]*)\})?")
_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id", "replica-id",
        "copy-done", "slice-done", "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done",
        "recv-done", "async-done", "opt-barrier"}


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "({[":
            depth += 1
        elif s[j] in ")}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def array_bytes(dtype: str, dims: str, layout: str | None, padded: bool) -> float:
    """Bytes of one array; padded: each tiled dimension rounded up to its tile (the first tile of the layout)."""
    shape = [int(d) for d in dims.split(",") if d]
    if padded and layout:
        m = re.match(r"([\d,]*):T\(([\d,]+)\)", layout)
        if m:
            minor_to_major = [int(d) for d in m.group(1).split(",") if d]
            tile = [int(t) for t in m.group(2).split(",")]
            for k, t in enumerate(reversed(tile)):  # the tile's last dimension is the most minor
                if k < len(minor_to_major):
                    d = minor_to_major[k]
                    shape[d] = -(-shape[d] // t) * t
    return math.prod(shape) * _SIZES.get(dtype, 4)


def shape_bytes(shape: str, padded: bool = True, skip_spaces: tuple[str, ...] = ()) -> float:
    """Bytes of every array in a (possibly tuple) shape string; arrays in a memory space of skip_spaces (S(n) in
    the layout, e.g. "S(2)": sync flags) are left out."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if layout and any(s in layout for s in skip_spaces):
            continue
        total += array_bytes(dtype, dims, layout or None, padded)
    return total


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape string ("(a, (b, c), d)" -> ["a", "(b, c)", "d"])."""
    if not shape.startswith("("):
        return [shape]
    inner, out, depth, cur = shape[1:-1], [], 0, ""
    for ch in inner:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return [re.sub(r"^/\*index=\d+\*/", "", e) for e in out]


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    text: str = ""

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}})", self.attrs)
        return m.group(1).lstrip("%") if m else None


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    params: dict[int, Instr] = field(default_factory=dict)
    root: Instr | None = None
    users: dict[str, list[Instr]] = field(default_factory=lambda: defaultdict(list))


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    end = _balanced(rest, op.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[op.end():end - 1]) if op.group(1) != "constant" else []
    return Instr(m.group(2), shape, op.group(1), operands, rest[end:], bool(m.group(1)), line)


@dataclass
class Module:
    computations: dict[str, Computation]
    entry: str
    frames: dict[int, tuple[int, int]]          # stack frame id -> (file location id, parent frame id or 0)
    locations: dict[int, tuple[str, str, int]]  # file location id -> (file, function, line)


def _tables(lines: list[str]) -> tuple[dict, dict]:
    files, funcs, locs, frames, table = {}, {}, {}, {}, None
    for ln in lines:
        if ln in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = ln
            continue
        m = re.match(r"^(\d+) (.*)$", ln)
        if not m or table is None:
            if ln and not m:
                table = None
            continue
        k, v = int(m.group(1)), m.group(2)
        if table == "FileNames":
            files[k] = json.loads(v)
        elif table == "FunctionNames":
            funcs[k] = json.loads(v)
        elif table == "FileLocations":
            f = dict(re.findall(r"(\w+)=(\d+)", v))
            locs[k] = (files.get(int(f["file_name_id"]), "?"), funcs.get(int(f["function_name_id"]), "?"),
                       int(f.get("line", 0)))
        else:
            f = dict(re.findall(r"(\w+)=(\d+)", v))
            # parent_frame_id is printed one above the parent's id (0: none): frame 1 names 1, its root
            frames[k] = (int(f["file_location_id"]), int(f["parent_frame_id"]) - 1)
    return frames, locs


def _statements(lines: list[str]):
    """(computation header match, [instruction text]) per computation; an instruction whose backend config
    runs over several lines (a Pallas kernel's) is joined back into one."""
    cur, body = None, []
    for ln in lines:
        if cur is None:
            cur, body = _HEAD.match(ln), []
            continue
        if ln == "}":
            yield cur, body
            cur = None
        elif _INSTR.match(ln) or not body:
            body.append(ln)
        else:
            body[-1] += "\n" + ln


def parse(text: str) -> Module:
    comps, entry = {}, ""
    lines = text.splitlines()
    first = next((i for i, ln in enumerate(lines) if _HEAD.match(ln)), len(lines))
    for head, body in _statements(lines[first:]):
        cur = Computation(head.group(2))
        comps[cur.name] = cur
        if head.group(1):
            entry = cur.name
        for ln in body:
            ins = _parse_instr(ln)
            if ins is None:
                continue
            cur.instrs[ins.name] = ins
            if ins.root:
                cur.root = ins
            if ins.opcode == "parameter":
                cur.params[int(re.search(r"parameter\((\d+)\)", ln).group(1))] = ins
            for o in ins.operands:
                cur.users[o].append(ins)
    frames, locs = _tables(lines[1:first])
    return Module(comps, entry, frames, locs)


START, DONE = "AsyncCollectiveStart", "AsyncCollectiveDone"


def chained(ins: Instr) -> bool:
    """A collective libtpu runs asynchronously over a chain of fusions (its chain_id frontend attribute)."""
    return ins.opcode.startswith(_COLLECTIVE_OPS) and 'chain_id="' in ins.attrs


def _async_step(fused: Computation) -> str | None:
    """START or DONE for the fusion that begins or ends an async collective's chain (its root custom call)."""
    root = fused.root
    if root is not None and root.opcode == "custom-call":
        for step in (START, DONE):
            if f'custom_call_target="{step}"' in root.attrs:
                return step
    return None


class Charger:
    """Bytes per instruction, as the cost analysis counts them."""

    def __init__(self, module: Module, padded: bool = True, skip_spaces: tuple[str, ...] = ("S(2)",)):
        self.m, self.padded, self.skip = module, padded, skip_spaces

    def size(self, shape: str) -> float:
        return shape_bytes(shape, self.padded, self.skip)

    def operand_shape(self, comp: Computation, name: str) -> str:
        ins = comp.instrs.get(name)
        return ins.shape if ins else ""

    def param_read(self, fused: Computation, p: Instr) -> float:
        """HloCostAnalysis::FusionParameterReadBytes: a fused parameter's bytes as its users read them."""
        total, seen_full = 0.0, False
        users = fused.users.get(p.name, [])
        if _async_step(fused) != START:  # a chained collective's operand is read once, by its start fusion
            users = [u for u in users if not chained(u)]
        if all(u is fused.root and u.opcode == "tuple" for u in users):
            return 0.0  # handed on as it is (module docstring)
        for u in users:
            if u.opcode == "slice":
                total += self.size(u.shape)
            elif u.opcode == "dynamic-slice":
                if u.operands and u.operands[0] == p.name:
                    total += self.size(u.shape)
                elif not seen_full:
                    seen_full, total = True, total + self.size(p.shape)
            elif u.opcode == "dynamic-update-slice":
                if u.operands and u.operands[0] != p.name and not seen_full:
                    seen_full, total = True, total + self.size(p.shape)
            elif u.opcode in ("broadcast", "reshape"):
                total += self.size(p.shape)
            elif u.opcode == "fusion":
                sub = self.m.computations.get(u.attr("calls") or "")
                if sub is not None:
                    for idx, o in enumerate(u.operands):
                        if o == p.name and idx in sub.params:
                            total += self.param_read(sub, sub.params[idx])
            elif not seen_full:
                seen_full, total = True, total + self.size(p.shape)
        return total

    def fusion_output(self, fused: Computation, ins: Instr) -> float:
        root = fused.root
        roots = [root] if root is not None and root.opcode != "tuple" else \
            [fused.instrs.get(o) for o in (root.operands if root is not None else [])]
        shapes = _tuple_elements(ins.shape)
        total = 0.0
        for k, shape in enumerate(shapes):
            r = roots[k] if k < len(roots) else None
            if r is not None and r.opcode == "parameter" and root is not None and root.opcode == "tuple":
                continue  # a parameter handed on: no bytes move (module docstring)
            if r is not None and chained(r):
                continue  # a chained collective's in-flight buffer: its result is charged at its start
            if r is not None and r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
                total += self.size(self.operand_shape(fused, r.operands[1]))  # in place: only the update
            else:
                total += self.size(shape)
        return total

    def charge(self, comp: Computation, ins: Instr) -> float:
        op = ins.opcode
        if op in FREE or op in ("while", "call", "conditional"):
            return 0.0
        if op == "fusion":
            fused = self.m.computations.get(ins.attr("calls") or "")
            if fused is None:
                return self.size(ins.shape) + sum(self.size(self.operand_shape(comp, o)) for o in ins.operands)
            step = _async_step(fused)
            if step == DONE:
                return 0.0
            total = sum(self.size(c.shape) for c in fused.instrs.values() if chained(c)) if step == START else \
                self.fusion_output(fused, ins)
            for idx, o in enumerate(ins.operands):
                p = fused.params.get(idx)
                total += self.param_read(fused, p) if p is not None else self.size(self.operand_shape(comp, o))
            return total
        if op in ("slice", "dynamic-slice"):
            return 2 * self.size(ins.shape)
        if op == "dynamic-update-slice":
            return 2 * self.size(self.operand_shape(comp, ins.operands[1]))
        if op == "slice-start":  # ((operand), slice, sync): the slice, once
            return self.size(_tuple_elements(ins.shape)[1])
        if op == "copy-start":  # (destination, source, sync): the destination, once
            return self.size(_tuple_elements(ins.shape)[0])
        if op == "custom-call":
            m = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', ins.attrs)
            if m:
                return float(m.group(1))
        out = self.size(ins.shape)
        return out + sum(self.size(self.operand_shape(comp, o)) for o in ins.operands)


def trip_count(module: Module, comp: Computation, ins: Instr) -> int:
    """A while loop's trip count: known_trip_count from its backend config, else its condition's bound."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if m:
        return int(m.group(1))
    cond = module.computations.get(ins.attr("condition") or "")
    if cond is not None:  # a scan's condition: the induction variable compared with the bound, LT
        bounds = [int(v.group(1)) for c in cond.instrs.values() if c.opcode == "constant"
                  for v in [re.search(r"constant\((\d+)\)", c.text)] if v]
        if bounds:
            return max(bounds)
    return 1


@dataclass
class Charge:
    instr: Instr
    computation: str
    bytes: float
    times: int


def walk(module: Module, charger: Charger, name: str | None = None, times: int = 1, out=None) -> list[Charge]:
    """Every top-level instruction the step runs, with its bytes and how many times it runs."""
    out = [] if out is None else out
    comp = module.computations[name or module.entry]
    for ins in comp.instrs.values():
        if ins.opcode == "while":
            n = trip_count(module, comp, ins)
            walk(module, charger, ins.attr("body"), times * n, out)
            walk(module, charger, ins.attr("condition"), times * n, out)
        elif ins.opcode == "call":
            walk(module, charger, ins.attr("to_apply"), times, out)
        elif ins.opcode == "conditional":
            for c in re.findall(r"%([\w.\-]+)", ins.attr("branch_computations") or ""):
                walk(module, charger, c, times, out)
        else:
            b = charger.charge(comp, ins)
            if b:
                out.append(Charge(ins, comp.name, b, times))
    return out


# jax source -> bucket: (file suffix, function) pairs looked for from the innermost frame out
_BUCKETS = [
    ("optax/", None, "AdamW update (optax)"),
    ("trainer/common/optim.py", None, "AdamW update (optax)"),
    ("trainer/models/xent.py", "lookup", "embedding lookup"),
    ("trainer/models/xent.py", "per_shard", "embedding lookup"),
    ("trainer/models/vocab_parallel.py", "lookup", "embedding lookup"),
    ("trainer/models/xent.py", None, "logits + loss"),
    ("trainer/kernels/xent_kernel.py", None, "logits + loss"),
    ("trainer/models/vocab_parallel.py", None, "logits + loss"),
    ("trainer/models/gpt2.py", "loss_fn", "logits + loss"),
    ("trainer/models/gpt2.py", "LayerNorm.", "layernorm"),
    ("trainer/models/attention.py", None, "attention"),
    ("splash_attention", None, "attention"),
    ("trainer/models/gpt2.py", "Attention.", "attention"),
    ("trainer/models/gpt2.py", "MLP.", "MLP"),
    ("trainer/models/gpt2.py", "keep_masks", "dropout"),
    ("trainer/models/gpt2.py", "dropout", "dropout"),
    ("trainer/models/gpt2.py", "Block.", "residual adds"),
    ("trainer/models/gpt2.py", "GPT2.hidden", "embedding lookup"),
    ("trainer/pretrain/train.py", None, "step (grad norm, accumulation)"),
]


def source_of(module: Module, ins: Instr) -> list[tuple[str, str, int]]:
    """The instruction's stack, innermost first: (file, function, line)."""
    m = re.search(r"stack_frame_id=(\d+)", ins.attrs)
    out, seen, f = [], set(), int(m.group(1)) if m else 0
    while f and f not in seen and f in module.frames:
        seen.add(f)
        loc, parent = module.frames[f]
        if loc in module.locations:
            out.append(module.locations[loc])
        f = parent
    return out


def _traced(module: Module, comp: Computation, ins: Instr, depth: int = 4) -> Instr:
    """ins, or for one libtpu added without jax source (an async slice or copy, a ConcatBitcast), the first
    instruction downstream of it that has one: its bytes serve that use."""
    if "stack_frame_id=" in ins.attrs or depth == 0:
        return ins
    for u in comp.users.get(ins.name, []):
        t = _traced(module, comp, u, depth - 1)
        if "stack_frame_id=" in t.attrs:
            return t
    return ins


def bucket(module: Module, ins: Instr) -> str:
    op_name = (re.search(r'op_name="([^"]*)"', ins.attrs) or [None, ""])[1]
    if ins.opcode.startswith(("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")):
        return "collectives (" + ins.opcode.replace("-start", "") + ")"
    stack = source_of(module, ins)
    name = None
    for file, func, _ in stack:
        for suffix, fn, b in _BUCKETS:
            if suffix in file and (fn is None or func.startswith(fn)):
                name = b
                break
        if name:
            break
    if name is None:
        name = "other: " + (f"{stack[0][1]}" if stack else (op_name.rsplit("/", 1)[-1] or ins.opcode))
    if name in ("layernorm", "attention", "MLP", "dropout", "residual adds", "embedding lookup"):
        name += ", backward" if "transpose(" in op_name else ", forward"
    return name


def is_param_cast(module: Module, comp: Computation, ins: Instr) -> bool:
    """A fusion that only converts an f32 parameter-shaped array to bf16 (or a bare convert of one)."""
    if ins.opcode == "convert":
        return "f32" in (comp.instrs[ins.operands[0]].shape if ins.operands and ins.operands[0] in comp.instrs
                         else "") and ins.shape.startswith("bf16")
    if ins.opcode != "fusion":
        return False
    fused = module.computations.get(ins.attr("calls") or "")
    if fused is None:
        return False
    ops = {i.opcode for i in fused.instrs.values()} - {"parameter", "bitcast", "tuple", "copy", "transpose",
                                                         "reshape", "constant", "broadcast"}
    return ops == {"convert"} and all(_ARRAY.match(s) and s.startswith("bf16") for s in _tuple_elements(ins.shape))


MATMUL, KERNEL, COLLECTIVE, OTHER = "matmul", "kernel", "collective", "other"
_COLLECTIVE_OPS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


def op_class(module: Module, ins: Instr) -> str:
    """What kind of work an instruction is, as the plan's calibrated time (trainer/common/calibration.py) prices
    it: a fusion around a convolution or dot (the MXU's), a custom call (a Pallas kernel), a collective, or the
    rest (elementwise, reductions, copies: bound by HBM)."""
    if ins.opcode in ("convolution", "dot"):
        return MATMUL
    if ins.opcode == "fusion":
        fused = module.computations.get(ins.attr("calls") or "")
        if fused is not None and any(i.opcode in ("convolution", "dot") for i in fused.instrs.values()):
            return MATMUL
        return OTHER
    if ins.opcode == "custom-call":
        return KERNEL
    if ins.opcode.startswith(_COLLECTIVE_OPS):
        return COLLECTIVE
    return OTHER


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _matmul_flops(comp: Computation, ins: Instr) -> float:
    """2 x multiply-adds of one dot or convolution, as the cost analysis counts them: the result's elements
    times the contracted size (a dot's lhs contracting dims; a convolution's kernel dims but its output feature,
    over its feature groups)."""
    out = math.prod(_dims(ins.shape))
    operand = lambda k: comp.instrs[ins.operands[k]].shape if k < len(ins.operands) and \
        ins.operands[k] in comp.instrs else ""  # noqa: E731
    if ins.opcode == "dot":
        lhs = _dims(operand(0))
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        idx = [int(d) for d in m.group(1).split(",") if d] if m else []
        return 2.0 * out * math.prod(lhs[i] for i in idx if i < len(lhs))
    kernel = _dims(operand(1))
    m = re.search(r"dim_labels=[^_]*_([^-]*)->", ins.attrs)
    if not m or len(m.group(1)) != len(kernel):
        return 2.0 * out * math.prod(kernel)
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    return 2.0 * out * math.prod(n for n, lab in zip(kernel, m.group(1)) if lab != "o") / \
        (int(groups.group(1)) if groups else 1)


def matmul_flops(module: Module, comp: Computation, ins: Instr) -> float:
    """The flops of the dots and convolutions one instruction of comp runs (itself, or those it fuses)."""
    if ins.opcode in ("convolution", "dot"):
        return _matmul_flops(comp, ins)
    if ins.opcode != "fusion":
        return 0.0
    fused = module.computations.get(ins.attr("calls") or "")
    if fused is None:
        return 0.0
    return sum(matmul_flops(module, fused, i) for i in fused.instrs.values())


def table(text: str, padded: bool = True) -> dict:
    """{total, once, buckets: {name: bytes}, by_opcode: {opcode: bytes}, by_class: {op_class: bytes}, loops:
    [(body, trips)], matmul_flops, matmul_flops_once} for one program: total counts each loop body its trip count
    times, once counts it once (as the compiler's cost analysis); likewise the flops of its dots and
    convolutions (matmul_flops, matmul_flops_once)."""
    module = parse(text)
    charger = Charger(module, padded)
    charges = walk(module, charger)
    buckets: dict[str, float] = defaultdict(float)
    opcodes: dict[str, float] = defaultdict(float)
    classes: dict[str, float] = defaultdict(float)
    for c in charges:
        classes[op_class(module, c.instr)] += c.bytes * c.times
        comp = module.computations[c.computation]
        b = "casts of f32 params to bf16" if is_param_cast(module, comp, c.instr) else \
            bucket(module, _traced(module, comp, c.instr))
        if c.instr.opcode in ("slice-start", "copy-start") or "ConcatBitcast" in c.instr.attrs:
            b += " [async slices/copies]"
        buckets[b] += c.bytes * c.times
        opcodes[c.instr.opcode] += c.bytes * c.times
    loops = [(i.attr("body"), trip_count(module, comp, i)) for comp in module.computations.values()
             for i in comp.instrs.values() if i.opcode == "while"]
    mm = [(matmul_flops(module, module.computations[c.computation], c.instr), c.times) for c in charges
          if op_class(module, c.instr) == MATMUL]
    return {"total": sum(buckets.values()), "once": sum(c.bytes for c in charges), "buckets": dict(buckets),
            "matmul_flops": sum(f * n for f, n in mm), "matmul_flops_once": sum(f for f, _ in mm),
            "by_opcode": dict(opcodes), "by_class": dict(classes), "loops": loops}
