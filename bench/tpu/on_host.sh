#!/usr/bin/env bash
# The chip check on a TPU host with no internet, from the repository's root (docs/tpu-check.md):
#   bash bench/tpu/on_host.sh WHEELS RESULTS [python -m bench.tpu's flags]
# WHEELS: the project's dependencies as wheels, less what the host has (jax, jaxlib, libtpu, numpy, scipy) and
# less pandas, which tunix's import needs and the one-chip host's own index holds (12 MB of the 64 MiB a call
# may carry). They are installed once into /tmp/tpuctl-site, after the host's own packages on PYTHONPATH.
# RESULTS: where the JSON, the log and the traces go; the check's runs (checkpoints of 1.5 GB) stay in /tmp/tpuctl-check.
set -uo pipefail
wheels=$1 results=$2
shift 2
site=/tmp/tpuctl-site
if [ ! -f "$site/.done" ]; then
  t0=$(date +%s)
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
    --no-cache-dir --target "$site" "$wheels"/*.whl || exit 3
  # tunix imports pandas at its top; the host's index has it (its version, not the suite's: tunix only imports it)
  for p in pandas pytz tzdata; do  # pytz and tzdata: what an older pandas there may need
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
      --only-binary=:all: --index-url file:///opt/pypi/simple --target "$site" "$p" \
      || echo "on_host: $p not installed from the host's index (pandas: the tunix row will fail to import)"
  done
  touch "$site/.done"
  echo "on_host: wheels installed in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site" JAX_PLATFORMS="${JAX_PLATFORMS:-tpu,cpu}" PYTHONUNBUFFERED=1
mkdir -p "$results" /tmp/tpuctl-check
name=${CHECK_NAME:-check}
# A check killed mid-row leaves libtpu's machine-wide lock file behind on a host kept warm for the next call,
# which then cannot open the chip; with no check process left, nothing holds the chip. (The pattern is anchored:
# a shell whose command line merely names the check is not one.)
if [ -e /tmp/libtpu_lockfile ] && ! pgrep -f "^python3 -m bench[.]tpu" >/dev/null; then
  rm -f /tmp/libtpu_lockfile && echo "on_host: removed the lock file a killed check left (/tmp/libtpu_lockfile)"
fi
python3 -m bench.tpu --out /tmp/tpuctl-check --json "$results/$name.json" "$@" > >(
  grep --line-buffered -v "^WARNING: Logging before\|^E0000 .*TPU_WORKER_HOSTNAMES\|Source Location Trace\|libtpu_init_utils" \
  | tee "$results/$name.log") 2>&1 &
check=$!
# Cut by `timeout` (a call's time limit), the check would finish its row on its own, holding the chip from the
# next command: the trainer's code it runs takes SIGTERM as a preemption notice. Stop it, and free the lock.
trap 'kill -KILL "$check" 2>/dev/null; wait "$check" 2>/dev/null; rm -f /tmp/libtpu_lockfile
      echo "on_host: stopped by a signal; the check killed, the lock file removed"; exit 143' TERM INT
wait "$check"
rc=$?
# the traces (--trace, the profile section) come back with the JSON, which names them; gzipped (a written-out
# step's trace is 33-37 MB, over what a lent chip's call brings back; ~5 MB gzipped), --summarize reads them so
for t in /tmp/tpuctl-check/*.xplane.pb; do [ -f "$t" ] && gzip -c "$t" > "$results/$(basename "$t").gz"; done
exit "$rc"
