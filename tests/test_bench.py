"""`python -m bench --quick`: the benchmark runs end to end and prints its comparison lines.

It checks that the bench works, not how fast anything is (no timed assertions): the numbers at --quick
sizes mean nothing.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=420):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the bench must set up its own 8 devices
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


@pytest.mark.slow  # ~50 s on 2 idle cores: compiling the seed's step (twice) and ours dominates
def test_quick_bench_prints_ratios():
    r = _run("--quick", "--skip", "124m")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "8 cpu devices" in out
    m = re.search(r"ratio ours/seed tokens/s: ([0-9.]+)x", out)
    assert m and float(m.group(1)) > 0, out
    assert re.search(r"^\[1\] seed .* ([0-9,]+) tokens/s, step [0-9.]+ s", out, re.M), out
    assert re.search(r"^\[2\] ours .* ([0-9,]+) tokens/s, step [0-9.]+ s", out, re.M), out
    assert re.search(r"^\[3\] CPU peak, .*single [0-9.,]+ GFLOP/s, sharded8 [0-9.,]+ GFLOP/s", out, re.M), out
    assert re.search(r"seed: N=[0-9,]+, .* of peak", out), out
    m = re.search(r"ratio save-every-2/no-save step time: ([0-9.]+)x", out)
    assert m and float(m.group(1)) > 0, out
    assert "[4b] gpt2-124m: skipped" in out and "[6] launch bench: skipped" in out
    m = re.search(r"^\[11\] ratio gs/local: ([0-9.]+)x; gs:// against the 2M tokens/s a host needs: ([0-9.]+)x", out,
                  re.M)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out
    m = re.search(r"^     ratio to off: profiled ([0-9.]+)x; inside the window [0-9.]+ ms", out, re.M)
    assert m and float(m.group(1)) > 0, out


def test_bad_flag_is_one_line_error():
    r = _run("--rounds", "0", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --rounds 0: must be at least 1"]
