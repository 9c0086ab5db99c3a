"""bootstrap.sh as a fresh TPU VM runs it: no uv on PATH, no wheelhouse, the image's Python, relative paths.

Run directly (no SSH) in a home of its own with a minimal environment, the way `Hosts.push` calls it
(`cd && bash bootstrap.sh --root .tpuctl-host ...`). Packages come from the package index, reached through
the machine's pip configuration, as a VM image's would be.
"""
from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

from _skips import skip_machine

BOOTSTRAP = Path(__file__).resolve().parents[1] / "orchestrator" / "host" / "bootstrap.sh"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what sshd gives a session


def _wheel(dest: Path) -> Path:
    """A minimal pure-Python wheel (what the project bundle is, in small)."""
    whl = dest / "probepkg-0.1-py3-none-any.whl"
    files = {"probepkg/__init__.py": "VALUE = 42\n",
             "probepkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: probepkg\nVersion: 0.1\n",
             "probepkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + "probepkg-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for n, text in {**files, "probepkg-0.1.dist-info/RECORD": record}.items():
            z.writestr(n, text)
    return whl


def _host_home(tmp_path: Path, reqs: str) -> Path:
    home = tmp_path / "home"
    bundles = home / ".tpuctl-host" / "bundles"
    bundles.mkdir(parents=True)
    (bundles / "requirements.txt").write_text(reqs)
    _wheel(bundles)
    return home


def _bootstrap(home: Path, path: str, *extra: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8"}
    return subprocess.run(
        ["bash", str(BOOTSTRAP), "--root", ".tpuctl-host", "--deps-key", "k1-cpu",
         "--reqs", ".tpuctl-host/bundles/requirements.txt", "--app-hash", "abc123",
         "--wheel", ".tpuctl-host/bundles/probepkg-0.1-py3-none-any.whl", *extra],
        cwd=home, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def test_fresh_host_without_uv_or_wheelhouse_installs_from_the_index(tmp_path):
    """A host with only the image's python3: uv comes from the index, every path is absolute, deps install."""
    if any(os.access(os.path.join(d, "uv"), os.X_OK) for d in BASE_PATH.split(":")):
        skip_machine("a PATH without uv (uv is on the system PATH here: this test needs a host without it)")
    home = _host_home(tmp_path, "six==1.17.0\n")
    r = _bootstrap(home, BASE_PATH)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "TPUCTL_BOOTSTRAP deps=installed app=installed flavour=cpu" in r.stdout
    uv = home / ".tpuctl-host" / "tools" / "uv"
    assert uv.is_symlink() and os.path.isabs(os.readlink(uv)), os.readlink(uv)
    assert uv.resolve().is_file() and os.access(uv, os.X_OK)  # the link no longer dangles
    py = home / ".tpuctl-host" / "deps" / "k1-cpu" / "bin" / "python"
    app = home / ".tpuctl-host" / "app" / "abc123"
    out = subprocess.run([str(py), "-c", "import six, probepkg; print(six.__version__, probepkg.VALUE)"],
                         env={"PYTHONPATH": str(app), "PATH": BASE_PATH}, capture_output=True, text=True)
    assert out.stdout.split() == ["1.17.0", "42"], out.stderr
    # A rerun with the same keys does nothing.
    again = _bootstrap(home, BASE_PATH)
    assert again.returncode == 0 and "deps=cached app=cached" in again.stdout, again.stderr


def _stub(bindir: Path, name: str, body: str) -> None:
    p = bindir / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)


def test_no_python_311_and_none_to_fetch_says_so_in_one_line(tmp_path):
    """An image whose Python is 3.10 and no way to fetch another: one line naming the host and the fix."""
    home = _host_home(tmp_path, "six==1.17.0\n")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    # Every python3.x on PATH is the image's 3.10 (pip cannot fetch uv); there is no internet (curl fails).
    old_python = ('case "$*" in *platform*) echo 3.10.12;; *) exit 1;; esac')
    for name in ("python3", "python3.11", "python3.12", "python3.13"):
        _stub(stubs, name, old_python)
    _stub(stubs, "curl", "exit 7")
    r = _bootstrap(home, f"{stubs}:{BASE_PATH}")
    assert r.returncode == 3, r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: bootstrap.sh on ") and "no Python >= 3.11" in lines[0]
    assert "python3 here: 3.10.12" in lines[0] and "install python3.11 or newer" in lines[0]
    assert "Traceback" not in r.stdout + r.stderr
