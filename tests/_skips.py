"""Every skip in the suite says why, in one of two kinds, and on CI only one kind may skip.

- needs_setup / skip_setup: something `make setup` installs or fetches is missing (openssh-server, root for the
  local slice's namespaces, libtpu of the `plan` extra, chromium, Google's Gemma tokenizers). On a developer's
  machine that is a skip; on CI (`CI=true`, as `.ci/run` runs after its own `make setup`) it is a failure that
  names what setup should have installed: a suite that skipped every test on a local slice must not pass.
- needs_machine / skip_machine: the machine itself lacks it (a TPU chip, a Linux C library, a host PATH without
  uv); no setup can add it, so it stays a skip everywhere.

A skip from anywhere else (a bare pytest.skip, importorskip, a plugin) counts as a setup skip: on CI it fails
until it is classified here. conftest.py registers the hook below.
"""
from __future__ import annotations

import os

import pytest

SETUP = "missing (`make setup` installs it): "
MACHINE = "not on this machine: "


def on_ci() -> bool:
    """CI=true, as GitHub Actions, GitLab and `.ci/run`'s machines set it."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def needs_setup(missing: bool, what: str) -> pytest.MarkDecorator:
    """Skip (on CI: fail) when `missing`; `what` names the missing thing and what installs it."""
    return pytest.mark.skipif(missing, reason=SETUP + what)


def _has_libtpu() -> bool:
    from trainer.common.aot import has_libtpu
    return has_libtpu()


# the TPU compiler for ahead-of-time compiles (a plan's), which the `plan` extra installs
needs_libtpu = needs_setup(not _has_libtpu(), "libtpu (the `plan` extra, which `make setup` installs)")


def skip_setup(what: str, *, allow_module_level: bool = False):
    pytest.skip(SETUP + what, allow_module_level=allow_module_level)


def needs_machine(missing: bool, what: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(missing, reason=MACHINE + what)


def skip_machine(what: str, *, allow_module_level: bool = False):
    pytest.skip(MACHINE + what, allow_module_level=allow_module_level)


def _fail_a_setup_skip(report) -> None:
    if report.skipped and on_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not reason.startswith(MACHINE):
            report.outcome = "failed"
            report.longrepr = (f"on CI (CI=true) `make setup` has run, yet this test skipped: {reason}\n"
                               "(a skip that no setup can cure is declared with tests/_skips.needs_machine)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_a_setup_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips itself whole (allow_module_level=True): the same rule, as a collection error, which
    stops the run before any test (pytest's own rule for those)."""
    report = yield
    _fail_a_setup_skip(report)
    return report
