"""What each test costs in CPU, not only in wall time: a pytest plugin that writes one JSON line per test (node id,
wall seconds, core-seconds, the machine's 1-minute load) to $TPUCTL_SUITE_CPU.

The core-seconds are read from a cgroup (v1 cpuacct) that holds the pytest process, so they count every process a
test starts (trainer subprocesses, the local hosts' sshd namespaces, the emulators) and nothing else running on
the machine. On CI's 2 cores the suite's wall time cannot fall below its core-seconds / 2, however it is scheduled:
this is the figure to cut. As root:

    mkdir -p /sys/fs/cgroup/cpuacct/suite && echo $$ > /sys/fs/cgroup/cpuacct/suite/cgroup.procs
    TPUCTL_SUITE_CPU=/tmp/suite-cpu.jsonl PYTHONPATH=tests .venv/bin/python -m pytest -q -p suite_cpu

For CI's cold caches, also point TPUCTL_TEST_CACHE at an empty folder.
"""
import json
import os
import time

import pytest

CGROUP = os.environ.get("TPUCTL_SUITE_CGROUP", "/sys/fs/cgroup/cpuacct/suite")


def _core_seconds() -> float:
    with open(os.path.join(CGROUP, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0 = time.monotonic(), _core_seconds()
    yield  # setup, call and teardown: a module fixture's cost lands on the module's first test
    t1, c1 = time.monotonic(), _core_seconds()
    with open(os.environ["TPUCTL_SUITE_CPU"], "a") as f:
        f.write(json.dumps({"id": item.nodeid, "wall_s": round(t1 - t0, 3), "core_s": round(c1 - c0, 3),
                            "load": float(open("/proc/loadavg").read().split()[0])}) + "\n")
