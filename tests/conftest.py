"""Test-wide setup. Runs before any test module imports jax."""
import glob
import os
import signal
import time
import warnings

import pytest

# A suite started as a background job of a non-interactive shell (`make test &`, a script's `nohup ... &`) inherits
# SIGINT ignored, and so would every process it starts: the tests of what Ctrl-C does would see it lost. Python
# leaves an ignored SIGINT ignored; the tests need it delivered, as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# 8 emulated CPU devices for every in-process JAX test (an inherited count wins, as in the trainer).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The machine-wide test cache (wheelhouse, compile caches, downloaded reference files), set once here for every
# test module (tests/_local_hosts.TEST_CACHE) and every process they start.
from bench import test_cache  # noqa: E402 (stdlib only at import: no jax before the flags above)
TEST_CACHE = os.environ.setdefault("TPUCTL_TEST_CACHE", str(test_cache()))

# One XLA compile cache for this process and every trainer subprocess the tests start here, under the machine's
# test cache (tests/_local_hosts.TEST_CACHE): the same tiny programs are compiled by test after test (a reference
# run, a resume, a sweep's trials), and on 2 CPU cores a compile costs more than the steps. Local slice hosts read
# the one under their wheelhouse (infra/local_slice.py).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(TEST_CACHE, "jax"))
# ... every compile, however short, as the trainer keeps them (trainer/common/loop.enable_compile_cache): the
# suite's in-process tests compile the same small programs test after test.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Trainers serve jax.profiler on 9999 + their process id by default, one port for the whole machine: the trainers
# the tests start here (in-process or as subprocesses, tests/_trainer_util.env) serve none unless a test gives
# one a free port of its own, so two modules running at once (pytest-xdist) never race for it. A local slice's
# hosts have their slice's own ports (infra/local_slice.PROFILER_PORTS).
os.environ.setdefault("TPUCTL_PROFILER_PORT", "0")

# `tpuctl up` makes the user's SSH key for new VMs when there is none: tests get a key of their own, never the
# user's ~/.ssh/google_compute_engine.
if "TPUCTL_SSH_KEY" not in os.environ:
    import tempfile
    os.environ["TPUCTL_SSH_KEY"] = os.path.join(tempfile.mkdtemp(prefix="tpuctl-test-ssh-"), "google_compute_engine")


# `make test` runs the modules on 2 workers (pytest-xdist, one module per worker at a time, so a module's shared
# slice or emulator stays in one process). Workers take modules in collection order: the longest go first, so
# that no worker starts a long module while the other has nothing left. Core-seconds measured on a cold cache
# (test caches and compile cache empty, as on CI); the rest keep their order after these.
LONGEST_FIRST = (
    "test_plan.py", "test_preemption_e2e.py", "test_lora.py", "test_multislice_e2e.py", "test_run_e2e.py",
    "test_gemma_sharding.py",
    "test_attention.py", "test_trainer_train.py", "test_demo.py", "test_sweep_e2e.py", "test_bench.py",
    "test_trainer_multiproc.py", "test_fresh_vm_e2e.py", "test_access.py", "test_tpu_check.py",
)


# The TPU compiler's figures of the programs the `recorded_plans` tests plan, recorded (trainer/common/
# program_counts.py) so that the suite does not compile, on CI's 2 cores, the same large programs at every run
# (gemma2-27b's refused written-out step and its scanned one alone are minutes): those tests read them as shared
# records ($TPUCTL_PLAN_RECORDS), keyed by the program the code lowers today, so a changed program is compiled
# (and a note says which test to record again), never answered by an older one. Every other test reads none.
# `TPUCTL_TESTS_RECORD=1 pytest -m recorded_plans` writes them.
PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")


@pytest.fixture(autouse=True)
def _recorded_programs(request, monkeypatch, tmp_path_factory):
    if request.node.get_closest_marker("recorded_plans") is None:
        monkeypatch.delenv("TPUCTL_PLAN_RECORDS", raising=False)
        yield
        return
    monkeypatch.setenv("TPUCTL_PLAN_RECORDS", PROGRAMS)
    began = time.time()
    yield
    base = tmp_path_factory.getbasetemp()
    new = [p for p in glob.glob(os.path.join(base, "**", "plans", "programs", "*.json"), recursive=True)
           if os.path.getmtime(p) >= began]
    if os.environ.get("TPUCTL_TESTS_RECORD"):
        os.makedirs(PROGRAMS, exist_ok=True)
        from trainer.common.program_counts import shareable
        for path in new:
            with open(path) as f:
                text = shareable(f.read())
            with open(os.path.join(PROGRAMS, os.path.basename(path)), "w") as f:
                f.write(text)
    elif new:
        warnings.warn(f"{request.node.nodeid} compiled {len(new)} program(s) tests/programs has no record of: "
                      f"`TPUCTL_TESTS_RECORD=1 pytest {request.node.nodeid}` records them")


# A skip fails the run on CI unless it is one no setup can cure (tests/_skips.py): the hook that decides.
from _skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401 (hooks: found by name)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sorted() is stable: tests keep their order inside a module, and the modules not named keep theirs
    items[:] = sorted(items, key=lambda it: rank.get(it.path.name, len(rank)))


# `make setup` downloads the wheels the demo's hosts install (orchestrator/demo.py --prefetch, into the demo's
# home). The local slices of the tests install the same dependency lists from the test cache's wheelhouse:
# a list the demo's wheelhouse already holds is hard-linked in rather than downloaded a second time (on a clean
# machine, as on CI, that download is a minute or more of the first e2e test). Keyed by the dependency hash, as
# orchestrator/jobs/bundle.fill_wheelhouse keys it; only lists it marked complete.
def _seed_wheelhouse() -> None:
    import shutil
    from orchestrator.demo import HOME  # stdlib only at import: no jax before the flags above
    for done in sorted(glob.glob(os.path.join(HOME, "wheelhouse", "*", ".complete"))):
        src = os.path.dirname(done)
        dst = os.path.join(TEST_CACHE, "wheelhouse", os.path.basename(src))
        if os.path.exists(dst):
            continue
        tmp = f"{dst}.seeding-{os.getpid()}"
        try:
            shutil.copytree(src, tmp, copy_function=os.link, ignore=shutil.ignore_patterns(".lock"))
            os.rename(tmp, dst)  # whole or not at all: a fill that began meanwhile keeps its own
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once per run: in the controller, not in each xdist worker
        _seed_wheelhouse()
