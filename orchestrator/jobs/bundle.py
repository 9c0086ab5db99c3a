"""The bundle: this project (and optionally the user's working dir) as one wheel with a content hash.

The hash covers the source files only (path + bytes), so it is stable across builds and machines;
the wheel itself is written deterministically (sorted entries, fixed timestamps), built once per hash
and cached in $TPUCTL_HOME/bundles/<hash>/. Hosts install it `--no-deps` keyed by that hash, on top of
a dependency layer keyed by `deps_hash` (the pinned dependency list), so a code change never
reinstalls jax.
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.spec import UserError
from orchestrator.state import home as _home

WORKDIR_PKG = "tpuctl_workdir"  # where the user's working dir lands inside the wheel (and on hosts)
_EXCLUDE_DIRS = {"__pycache__", ".git", ".venv", "venv", ".tox", ".pytest_cache", ".mypy_cache", "node_modules",
                 "build", "dist", ".tpuctl", "runs"}
_EPOCH = (1980, 1, 1, 0, 0, 0)


class BundleError(RuntimeError):
    """One clear line about what is wrong with the project or working dir to bundle."""


@dataclass
class Bundle:
    hash: str                    # sha256 of the source files (and the working dir, if any)
    wheel: Path                  # the wheel, in the bundle cache
    requirements: list[str]      # the dependency layer: installed with their dependencies
    no_deps: list[str] = field(default_factory=list)  # data-only wheels installed --no-deps
    has_workdir: bool = False

    @property
    def short(self) -> str:
        return self.hash[:16]

    @property
    def deps_hash(self) -> str:
        return deps_hash(self.requirements, self.no_deps)

    def requirements_text(self) -> str:
        """requirements file for the host: `--no-deps` lines are marked for bootstrap.sh."""
        return "".join(f"{r}\n" for r in self.requirements) + "".join(f"# no-deps: {r}\n" for r in self.no_deps)


def project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _pyproject(root: Path) -> dict:
    try:
        return tomllib.loads((root / "pyproject.toml").read_text())
    except FileNotFoundError:
        raise BundleError(f"no pyproject.toml in {root}: point --project at the tpuctl checkout") from None


def source_files(root: Path) -> list[str]:
    """Files the wheel carries, relative to root: the packages of [tool.tpuctl] host-packages, their *.py plus
    [tool.setuptools.package-data] globs."""
    tool = _pyproject(root).get("tool", {})
    include = tool.get("tpuctl", {}).get("host-packages", [])
    pkg_data = tool.get("setuptools", {}).get("package-data", {})
    out = []
    for top in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in _EXCLUDE_DIRS):
        if top.name not in include or not (top / "__init__.py").exists():
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDE_DIRS)
            rel_dir = Path(dirpath).relative_to(root)
            pkg = ".".join(rel_dir.parts)
            globs = ["*.py", *pkg_data.get(pkg, []), *pkg_data.get("*", [])]
            for f in sorted(filenames):
                if any(fnmatch.fnmatch(f, g) for g in globs):
                    out.append(str(rel_dir / f))
    return out


def workdir_files(workdir: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(workdir):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDE_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if not f.endswith((".pyc", ".pyo")) and not f.startswith("."):
                out.append(str(Path(dirpath, f).relative_to(workdir)))
    return out


def dependency_list(root: Path) -> tuple[list[str], list[str]]:
    """(requirements, no_deps): [project].dependencies, and [tool.tpuctl] data-wheels (installed --no-deps)."""
    meta = _pyproject(root)
    return (list(meta["project"].get("dependencies", [])),
            list(meta.get("tool", {}).get("tpuctl", {}).get("data-wheels", [])))


def deps_hash(requirements: list[str], no_deps: list[str]) -> str:
    text = "\n".join(sorted(requirements)) + "\n--no-deps\n" + "\n".join(sorted(no_deps))
    return hashlib.sha256(text.encode()).hexdigest()


def content_hash(root: Path, workdir: Path | None = None) -> str:
    h = hashlib.sha256()
    entries = [("", "pyproject.toml", root / "pyproject.toml")]
    entries += [("", f, root / f) for f in source_files(root)]
    if workdir is not None:
        entries += [(WORKDIR_PKG, f, workdir / f) for f in workdir_files(workdir)]
    for prefix, rel, path in entries:
        data = path.read_bytes()
        h.update(f"{prefix}/{rel}\0{len(data)}\0".encode())
        h.update(data)
        h.update(b"\1" if os.access(path, os.X_OK) else b"\0")
    return h.hexdigest()


def build(root: Path | str | None = None, *, workdir: Path | str | None = None,
          cache_dir: Path | str | None = None, extras: tuple[str, ...] | list[str] = ()) -> Bundle:
    """The bundle of `root` (default: this checkout), built once per content hash. extras: optional dependency
    groups of pyproject.toml the hosts need too (the trainer says which a command needs: `python -m trainer
    extras`); they join the dependency layer, not the wheel."""
    root = Path(root or project_root()).resolve()
    wd = Path(workdir).resolve() if workdir else None
    if wd is not None and not wd.is_dir():
        raise BundleError(f"--workdir {workdir} is not a directory")
    meta = _pyproject(root)["project"]
    name, version = meta["name"], meta["version"]
    reqs, no_deps = dependency_list(root)
    optional = meta.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise BundleError(f"the command needs the extra(s) {', '.join(unknown)}, which pyproject.toml does not "
                          f"define (it has: {', '.join(sorted(optional))})")
    host_reqs = reqs + [r for e in sorted(set(extras)) for r in optional[e] if r not in reqs]
    digest = content_hash(root, wd)
    cache = Path(cache_dir or _home() / "bundles") / digest[:16]
    norm = re.sub(r"[-_.]+", "_", name).lower()
    wheel = cache / f"{norm}-{version}+b{digest[:12]}-py3-none-any.whl"
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = wheel.with_name(wheel.name + f".{os.getpid()}.tmp")
        tmp.write_bytes(_wheel_bytes(root, wd, norm, name, f"{version}+b{digest[:12]}", meta, reqs))
        os.replace(tmp, wheel)  # atomic: a concurrent build writes the same bytes
    return Bundle(hash=digest, wheel=wheel, requirements=host_reqs, no_deps=no_deps, has_workdir=wd is not None)


def _wheel_bytes(root: Path, wd: Path | None, norm: str, name: str, version: str, meta: dict,
                 reqs: list[str]) -> bytes:
    files: list[tuple[str, bytes, bool]] = []
    for rel in source_files(root):
        p = root / rel
        files.append((rel, p.read_bytes(), os.access(p, os.X_OK)))
    if wd is not None:
        files.append((f"{WORKDIR_PKG}/__init__.py", b"", False))
        for rel in workdir_files(wd):
            p = wd / rel
            files.append((f"{WORKDIR_PKG}/{rel}", p.read_bytes(), os.access(p, os.X_OK)))
    dist = f"{norm}-{version}.dist-info"
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    if meta.get("requires-python"):
        metadata.append(f"Requires-Python: {meta['requires-python']}")
    metadata += [f"Requires-Dist: {r}" for r in reqs]
    files.append((f"{dist}/METADATA", ("\n".join(metadata) + "\n").encode(), False))
    files.append((f"{dist}/WHEEL", b"Wheel-Version: 1.0\nGenerator: tpuctl.bundle\nRoot-Is-Purelib: true\n"
                                   b"Tag: py3-none-any\n", False))
    record = io.StringIO()
    for rel, data, _ in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{rel},sha256={digest},{len(data)}\n")
    record.write(f"{dist}/RECORD,,\n")
    files.append((f"{dist}/RECORD", record.getvalue().encode(), False))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for rel, data, exe in files:
            info = zipfile.ZipInfo(rel, _EPOCH)
            info.external_attr = (0o100755 if exe else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return buf.getvalue()


def fill_wheelhouse(bundle: Bundle, wheelhouse: Path | str, *, python: str | None = None,
                    log=print) -> Path:
    """Download the dependency layer's wheels (and uv) once into a wheelhouse shared on this machine.

    Keyed by the dependency hash; later calls return at once. Hosts on this machine then install with
    `--no-index --find-links` and a shared uv cache, so a second host hard-links instead of downloading.
    """
    wh = Path(wheelhouse) / bundle.deps_hash[:16]
    done = wh / ".complete"
    if done.exists():
        return wh
    import fcntl
    wh.mkdir(parents=True, exist_ok=True)
    with open(wh / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download per machine, whoever comes first
        if done.exists():
            return wh
        py = python or sys.executable
        req = wh / "requirements.txt"
        req.write_text("\n".join(bundle.requirements) + "\nuv\n")
        log(f"filling the wheelhouse {wh} from the package index (once per dependency list)")
        for args in (["-r", str(req)], ["--no-deps", *bundle.no_deps] if bundle.no_deps else None):
            if args is None:
                continue
            p = subprocess.run([py, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(wh),
                                *args], capture_output=True, text=True)
            if p.returncode != 0:
                tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
                raise BundleError(f"could not download the dependencies into {wh}: {tail[0]}")
        done.write_text(bundle.deps_hash + "\n")
    return wh


def trainer_extras(argv: list[str], python: str) -> list[str]:
    """The optional dependency groups a trainer command needs on the hosts (e.g. wandb for --wandb), as the
    trainer itself reads its flags (`python -m trainer extras`, jax-free). A command it refuses stops here,
    with its message, before anything is pushed. `python` is what the host command names the bundle's Python."""
    if argv[:3] != [python, "-m", "trainer"]:
        return []
    p = subprocess.run([sys.executable, "-m", "trainer", "extras", "--", *argv[3:]], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        err = [ln[len("error: "):] for ln in p.stderr.splitlines() if ln.startswith("error: ")]
        raise UserError(f"the trainer refuses the command: {err[-1] if err else p.stderr.strip()[-300:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])
