"""The house, read from the code's imports (every import, those inside functions too): the trainer's top level is
the command line and its folders are its jobs; nothing below a command line imports it; no package imports in a
circle; the trainer and the stand-ins never reach up into the orchestrator."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "orchestrator", "infra", "bench")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports: `from a.b import c` counts a.b.c when that is a module, else a.b."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        out |= {n for n in names if n.split(".")[0] in PACKAGES}
    return out


def _graph(prefix: str) -> dict[str, set[str]]:
    known = _modules()
    return {m: {i for i in imports_of(p, known) if i.startswith(prefix) and i != m}
            for m, p in known.items() if m.startswith(prefix)}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_trainer_top_level_is_its_command_line_and_its_folders_are_the_jobs():
    top = sorted(p.name for p in (ROOT / "trainer").glob("*.py"))
    assert len(top) <= 4, top
    folders = {p.name for p in (ROOT / "trainer").iterdir() if (p / "__init__.py").exists()}
    assert {"common", "pretrain", "gemma", "finetune", "experiments", "models"} <= folders, folders


def test_the_bench_top_level_is_its_command_and_its_folders_say_what_each_bench_measures():
    top = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert len(top) <= 6, top
    folders = {p.name for p in (ROOT / "bench").iterdir() if (p / "__init__.py").exists()}
    assert folders == {"peers", "system", "compiler", "tpu"}, folders
    layout = (ROOT / "docs" / "layout.md").read_text()
    assert all(f"`{f}/`" in layout for f in folders), "docs/layout.md names each of bench's folders"


def test_nothing_imports_the_trainer_entry_point():
    known = _modules()
    users = [m for m, p in known.items() if "trainer.__main__" in imports_of(p, known)]
    users += [str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")
              if "trainer.__main__" in imports_of(p, known)]
    assert users == [], users


def test_no_import_circles_in_the_trainer_or_the_orchestrator():
    for prefix in ("trainer", "orchestrator"):
        assert _cycles(_graph(prefix)) == [], prefix


def test_the_trainer_and_the_stand_ins_never_import_the_orchestrator():
    known = _modules()
    for pkg, banned in (("trainer", ("orchestrator", "infra", "bench")), ("infra", ("orchestrator", "trainer"))):
        bad = {m: sorted(i for i in imports_of(p, known) if i.split(".")[0] in banned)
               for m, p in known.items() if m.split(".")[0] == pkg}
        assert {m: v for m, v in bad.items() if v} == {}, pkg


def test_the_checks_can_fail():
    """The cycle finder sees a circle through a function-level import, and the import reader sees such imports."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    known = _modules()
    assert "trainer.common.config" in imports_of(ROOT / "trainer" / "common" / "process.py", known)


def test_the_orchestrator_top_level_is_small_and_its_folders_are_its_concerns():
    top = sorted(p.name for p in (ROOT / "orchestrator").glob("*.py"))
    assert len(top) <= 6, top
    folders = {p.name for p in (ROOT / "orchestrator").iterdir() if (p / "__init__.py").exists()}
    assert {"cli", "access", "jobs", "plan", "artifacts", "provider", "slices", "host"} <= folders, folders


def test_no_two_orchestrator_modules_share_a_file_name():
    names: dict[str, list[str]] = {}
    for p in (ROOT / "orchestrator").rglob("*.py"):
        if p.name not in ("__init__.py", "__main__.py"):
            names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}


def test_nothing_below_the_command_line_imports_it():
    """The orchestrator's command line (orchestrator.cli) is on top: its own modules may import each other, no
    other module of the project imports any of them (a package's `__main__` runs it). The trainer's top level is
    its command line (cli, plan): no module in its folders imports it. The bench stands above both: it parses
    the trainer's flags as its command line does."""
    known = _modules()
    above = {"orchestrator.cli": lambda m: m.startswith("orchestrator.cli") or m.endswith("__main__"),
             "trainer.cli": lambda m: m.count(".") == 1 or m.startswith("bench.")}
    for cli, is_above in above.items():
        users = {m: sorted(i for i in imports_of(p, known) if i == cli or i.startswith(cli + "."))
                 for m, p in known.items() if not is_above(m)}
        assert {m: v for m, v in users.items() if v} == {}, cli


def test_help_and_the_command_lines_import_no_cloud_client_or_ssh_library():
    """Every `tpuctl` command pays for what it imports: `--help` (and every verb's module) loads none of the TPU,
    Compute Engine or storage clients, fabric or jax; a verb that uses one imports it when it runs."""
    import subprocess
    import sys
    code = ("import sys\nfrom orchestrator.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = ('google.cloud.tpu_v2', 'google.cloud.compute_v1', 'google.cloud.storage', 'fabric', 'paramiko',"
            " 'jax')\nprint('LOADED', sorted(m for m in heavy if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "LOADED []", p.stdout[-500:]
