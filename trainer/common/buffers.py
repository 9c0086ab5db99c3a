"""The largest buffers of a compiled step, from the compiler's own buffer assignment, each named by its jax source.

A plan compiles its step with XLA's dump options (`options(dir)`, passed as compiler options: libtpu honours them
as the CPU compiler does; jax's memory analysis carries no buffer assignment from libtpu) and reads two of the
files the compiler writes there: the buffer assignment (`*after_optimizations-buffer-assignment.txt`: each
allocation and the values placed in it, by instruction) and the optimized program (`*after_optimizations.txt`:
each instruction's jax op_name and stack frame). The buffers listed are those a device holds in HBM besides the
step's arguments (the state): temporaries and outputs, the largest first. Values of one allocation whose live
ranges do not overlap share its bytes, so the list names what the compiler placed, not what is live at once.
On TPU this buffer assignment is the one the compiler dumps before its last passes: its figures are close to,
not equal to, the memory analysis's (docs/gemma.md).
"""
from __future__ import annotations

import re
from pathlib import Path

from trainer.common import hlo_bytes

# buffers kept per program: enough that a buffer of one mesh is found among another's (the 32 largest named nothing
# of 26B-A4B's 128 MiB growth from data=4 to model=4 on v4-8: its largest buffers are GiB-sized)
KEEP = 200

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ ([^\s{>]+)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_LAYOUT = re.compile(r"\{[^{}]*\}")


def options(dump_dir: str) -> dict:
    """Compiler options that make the compiler write its buffer assignment and optimized program to dump_dir."""
    return {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}


def _held(attrs: str) -> bool:
    """An allocation in HBM (color 0) that is not an argument, a constant or a thread-local scalar."""
    if any(w in attrs for w in ("parameter", "thread-local", "constant")):
        return False
    color = re.search(r"color (\d+)", attrs)
    return color is None or color.group(1) == "0"


def _shape(text: str) -> str:
    """A value's shape without its layout: bf16[8,512,2816]{2,1,0:T(8,128)(2,1)} -> bf16[8,512,2816]."""
    while True:
        stripped = _LAYOUT.sub("", text)
        if stripped == text:
            return stripped.strip()
        text = stripped


def assigned(text: str) -> list[dict]:
    """The values the buffer assignment places in HBM outside the arguments: {instruction, index, bytes, shape},
    one per place (values sharing an allocation's offset and size, e.g. an all-reduce and its output, once)."""
    out, held, alloc, seen = [], False, None, set()
    for line in text.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            alloc, held = m.group(1), _held(m.group(3))
            continue
        v = _VALUE.match(line)
        if not (v and held):
            continue
        name, index, size, offset, shape = v.groups()
        if (alloc, offset, size) in seen:
            continue
        seen.add((alloc, offset, size))
        out.append({"instruction": name, "index": index or "", "bytes": int(size), "shape": _shape(shape)})
    return out


def _short(path: str) -> str:
    """A source path from the repository's packages on (trainer/models/gemma.py), else as given."""
    m = re.search(r"(?:^|/)((?:trainer|orchestrator|tests|bench)/.*)$", path)
    return m.group(1) if m else path


def sources(program: str) -> dict[str, dict]:
    """instruction -> {op_name, source, opcode, operand}: the jax op and the innermost frame that made it (a
    compiler-made instruction has none: its opcode and first operand name it). The program is read by
    hlo_bytes.parse, its frames by hlo_bytes.source_of."""
    module = hlo_bytes.parse(program)
    out = {}
    for comp in module.computations.values():
        for ins in comp.instrs.values():
            op = re.search(r'op_name="([^"]*)"', ins.attrs)
            stack = hlo_bytes.source_of(module, ins)
            file = re.search(r'source_file="([^"]*)" source_line=(\d+)', ins.attrs)
            source = (f"{_short(stack[0][0])}:{stack[0][2]} ({stack[0][1]})" if stack else
                      f"{_short(file.group(1))}:{file.group(2)}" if file else "")
            out[ins.name] = {"op_name": op.group(1) if op else "", "source": source, "opcode": ins.opcode,
                             "operand": ins.operands[0] if ins.operands else ""}
    return out


def _named(src: dict[str, dict], name: str, hops: int = 8) -> dict:
    """The first instruction up `name`'s chain of first operands that has a jax op_name (a copy reads a
    get-tuple-element of a loop, which reads the loop, ...), else `name`'s own entry."""
    here = src.get(name, {})
    for _ in range(hops):
        if here.get("op_name") or not here.get("operand"):
            break
        here = src.get(here["operand"], {})
    if here.get("op_name"):
        return here
    if here.get("opcode") == "parameter":  # a loop body's parameter: the step's own arguments have op_names
        return {"op_name": f"a loop's carried value ({name})", "source": ""}
    return src.get(name, {})


def largest(dump_dir: str | Path, keep: int = KEEP) -> list[dict] | None:
    """The `keep` largest buffers of the step compiled into dump_dir: {bytes, shape, instruction, op_name, source},
    the largest first; None when the compiler wrote no buffer assignment there (jax served the program from its
    persistent compilation cache, JAX_COMPILATION_CACHE_DIR: nothing was compiled). A compiler-made instruction
    with no op_name (a copy to another layout, say) is named by what it reads: "copy of base['scan.0.0.kv']"."""
    files = sorted(Path(dump_dir).glob("*after_optimizations-buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    if not files:
        return None
    ba = files[-1]
    program = ba.with_name(ba.name.replace("-buffer-assignment.txt", ".txt"))
    src = sources(program.read_text()) if program.exists() else {}
    values = sorted(assigned(ba.read_text()), key=lambda v: -v["bytes"])[:keep]
    out = []
    for v in values:
        s = src.get(v["instruction"], {})
        op = s.get("op_name", "")
        if not op and s.get("operand"):
            read = _named(src, s["operand"])
            op = f"{s.get('opcode', '?')} of {read.get('op_name') or s['operand']}"
            s = {**s, "source": s.get("source") or read.get("source", "")}
        out.append({"bytes": v["bytes"], "shape": v["shape"], "instruction": v["instruction"] + v["index"],
                    "op_name": op or s.get("opcode", ""), "source": s.get("source", "")})
    return out


def _key(b: dict) -> tuple[str, str]:
    """What a buffer is across meshes (its shape changes with the shards): its jax op and source (without the
    name of the loop value a copy reads, which each program numbers its own way)."""
    return re.sub(r" \([\w.\-]+\.\d+\)$", "", b["op_name"]), b["source"]


def grown(more: list[dict], fewer: list[dict], top: int = 3) -> list[dict]:
    """The buffers of `more` (one program's largest) larger than the same op's in `fewer` (another mesh's), by how
    much, the most first: {bytes, shape, op_name, source, instruction, other_bytes (None: not among fewer's
    listed, each at least fewer_floor), grown_bytes}."""
    theirs: dict[tuple, int] = {}
    for b in fewer:
        theirs[_key(b)] = max(theirs.get(_key(b), 0), b["bytes"])
    floor = min((b["bytes"] for b in fewer), default=0) if len(fewer) >= KEEP else 0
    best: dict[tuple, dict] = {}
    for b in more:
        k = _key(b)
        if k in best and best[k]["bytes"] >= b["bytes"]:
            continue
        other = theirs.get(k)
        delta = b["bytes"] - (other if other is not None else floor)
        if delta > 0:
            best[k] = {**b, "other_bytes": other, "grown_bytes": delta}
    return sorted(best.values(), key=lambda b: -b["grown_bytes"])[:top]
