"""Test-wide setup. Runs before any test module imports jax."""
import os

# 8 emulated CPU devices for every in-process JAX test (an inherited count wins, as in the trainer).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compile cache for this process and every trainer subprocess the tests start here, under the machine's
# test cache (tests/_local_hosts.TEST_CACHE): the same tiny programs are compiled by test after test (a reference
# run, a resume, a sweep's trials), and on 2 CPU cores a compile costs more than the steps. Local slice hosts read
# the one under their wheelhouse (infra/local_slice.py).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("TPUCTL_TEST_CACHE") or os.path.expanduser("~/.cache/tpuctl-test"), "jax"))

# `tpuctl up` makes the user's SSH key for new VMs when there is none: tests get a key of their own, never the
# user's ~/.ssh/google_compute_engine.
if "TPUCTL_SSH_KEY" not in os.environ:
    import tempfile
    os.environ["TPUCTL_SSH_KEY"] = os.path.join(tempfile.mkdtemp(prefix="tpuctl-test-ssh-"), "google_compute_engine")
