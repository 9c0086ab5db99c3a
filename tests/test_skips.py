"""tests/_skips.py in a pytest of its own: on a developer's machine every skip is a skip; on CI (CI=true) only a
skip no setup can cure stays one, and the others fail the run naming what `make setup` should have installed."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SUITE = '''
import pytest
from _skips import needs_machine, needs_setup, skip_machine, skip_setup

@needs_setup(True, "sshd (openssh-server: make sys-deps)")
def test_marked_setup(): pass

@needs_setup(False, "present")
def test_setup_present(): pass

@needs_machine(True, "a TPU chip")
def test_marked_machine(): pass

def test_called_setup(): skip_setup("chromium")

def test_called_machine(): skip_machine("glibc")

def test_bare_skip(): pytest.skip("some reason nobody classified")

@pytest.mark.xfail(reason="a known failure", strict=True)
def test_xfail(): assert False
'''


MODULE = '''
from _skips import skip_setup
skip_setup("libtpu, for the whole module", allow_module_level=True)
def test_never(): pass
'''


def _pytest(tmp_path: Path, ci: str | None, *test_files: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_tiny.py").write_text(SUITE)
    (tmp_path / "test_tiny_module.py").write_text(MODULE)
    (tmp_path / "test_tiny_ok.py").write_text("def test_ok(): pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    if ci is not None:
        env["CI"] = ci
    # -p _skips: the plugin as tests/conftest.py registers it; -c /dev/null: none of this repository's settings
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "_skips", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-c", os.devnull, "--rootdir", str(tmp_path), "-rA", "-v",
                           *(test_files or ["test_tiny.py"])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _outcomes(out: str) -> dict[str, str]:
    """test name -> PASSED, SKIPPED, ERROR, FAILED or XFAIL, from -v's line per test."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^test_tiny\.py::(\w+) (PASSED|SKIPPED|ERROR|FAILED|XFAIL)\b", out, re.M)}


def test_on_ci_only_a_machine_skip_stays_a_skip_and_the_others_fail_naming_what_setup_installs(tmp_path):
    here = _pytest(tmp_path, None)
    assert here.returncode == 0, here.stdout + here.stderr
    assert _outcomes(here.stdout) == {
        "test_marked_setup": "SKIPPED", "test_setup_present": "PASSED", "test_marked_machine": "SKIPPED",
        "test_called_setup": "SKIPPED", "test_called_machine": "SKIPPED", "test_bare_skip": "SKIPPED",
        "test_xfail": "XFAIL"}, here.stdout

    ci = _pytest(tmp_path, "true")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert _outcomes(ci.stdout) == {
        "test_marked_setup": "ERROR", "test_setup_present": "PASSED", "test_marked_machine": "SKIPPED",
        "test_called_setup": "FAILED", "test_called_machine": "SKIPPED", "test_bare_skip": "FAILED",
        "test_xfail": "XFAIL"}, ci.stdout
    assert "on CI (CI=true) `make setup` has run, yet this test skipped: missing (`make setup` installs it): " \
           "sshd (openssh-server: make sys-deps)" in ci.stdout
    assert "missing (`make setup` installs it): chromium" in ci.stdout and "some reason nobody classified" in ci.stdout
    assert re.search(r"^=* ?2 failed, 1 passed, 2 skipped, 1 xfailed, 1 error in ", ci.stdout.splitlines()[-1]), \
        ci.stdout
    assert _pytest(tmp_path, "false").returncode == 0  # CI=false is not CI
    # A module that skips itself whole: a skip here, a collection error on CI, naming what is missing.
    here = _pytest(tmp_path, None, "test_tiny_module.py", "test_tiny_ok.py")
    assert here.returncode == 0 and re.search(r"^=* ?1 passed, 1 skipped in ", here.stdout.splitlines()[-1]), \
        here.stdout
    ci = _pytest(tmp_path, "true", "test_tiny_module.py", "test_tiny_ok.py")
    assert ci.returncode != 0 and "ERROR test_tiny_module.py - on CI (CI=true) `make setup` has run, yet this test " \
        "skipped: missing (`make setup` installs it): libtpu, for the whole module" in ci.stdout, ci.stdout
