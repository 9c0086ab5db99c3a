"""Two processes x 4 CPU devices joined by jax.distributed load one Gemma checkpoint onto a 4x2 mesh:
each reads about half of the safetensors bytes (only the blocks its devices hold), half of an Orbax
checkpoint stored in per-shard chunks (tensorstore's own byte counter), and every layout gives the logits
one process computes."""
from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import _gemma_ckpt as gc
from _trainer_util import REPO, env, session_cache
from test_trainer_multiproc import free_port
from trainer.common import mesh as mesh_lib
from trainer.models import gemma

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import tensorstore as ts
from trainer.common import mesh as M
from trainer.gemma import weights
M.init_distributed()

def ts_read():  # bytes tensorstore fetched from local files so far (the Orbax path)
    m = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v["value"] for x in m for v in x["values"])

mesh = M.make_mesh({"data": 4, "model": 2})
reads = []
weights.on_read = lambda name, n: reads.append(n)
out = {}
for layout, path, overrides in json.loads(sys.argv[1]):
    reads.clear()
    before = ts_read()
    ck, params = weights.load(path, mesh, **overrides)
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % ck.cfg.vocab)
    from trainer.models import gemma
    with jax.set_mesh(mesh):
        s = jax.jit(lambda p, t: jnp.abs(gemma.from_flat(ck.cfg, p)(t)[0]).sum(),
                    out_shardings=M.replicated(mesh))(params, tokens)
    out[layout] = {"read": sum(reads), "total": sum(x.nbytes for x in params.values()), "ts_read": ts_read() - before,
                   "abs_sum": float(s), "local_devices": jax.local_device_count()}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow  # ~60 s on 2 busy cores: two jax.distributed processes, three loads each
def test_two_processes_each_read_their_half(tmp_path, tmp_path_factory):
    cfg = gc.TINY["gemma2"]
    flat = gemma.random_params(cfg, seed=21)
    flax = gc.write_flax(str(tmp_path / "flax"), cfg, flat)
    sharded = gc.write_flax(str(tmp_path / "flax-sharded"), cfg, flat, mesh=mesh_lib.make_mesh({"data": 4, "model": 2}))
    hf = gc.write_hf(str(tmp_path / "hf"), cfg, flat)
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % cfg.vocab)
    want = float(jnp.abs(gemma.from_flat(cfg, flat)(tokens)[0]).sum())
    arg = json.dumps([["flax", flax, gc.FLAX_OVERRIDES["gemma2"]], ["flax-sharded", sharded, gc.FLAX_OVERRIDES["gemma2"]],
                      ["transformers", hf, {}]])
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, arg], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=env(session_cache(tmp_path_factory), devices=4,
                                      TPUCTL_COORDINATOR=f"127.0.0.1:{port}", TPUCTL_NUM_PROCESSES="2",
                                      TPUCTL_PROCESS_ID=str(i), TPUCTL_HEARTBEAT_TIMEOUT_S="20",
                                      TPUCTL_INIT_TIMEOUT_S="60", PYTHONPATH=str(REPO)))
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    results = [json.loads(next(ln for ln in log.splitlines() if ln.startswith("RESULT "))[7:]) for log in logs]
    for r in results:
        assert r["flax"]["local_devices"] == 4
        for layout in ("flax", "flax-sharded", "transformers"):
            assert abs(r[layout]["abs_sum"] - want) <= 1e-3 * want, (layout, r[layout], want)
        hf_read = r["transformers"]
        # The norms are replicated (each process reads them whole); everything else is half per process.
        norms = (4 * cfg.n_layers + 1) * cfg.d_model * 4  # bytes of the f32 RMSNorm scales
        assert hf_read["read"] == (hf_read["total"] - norms) // 2 + norms, hf_read
        # Orbax reads whole chunks: a checkpoint stored one chunk per shard is read by half per process
        # (plus metadata); one stored one chunk per array is read whole by every process.
        assert r["flax-sharded"]["ts_read"] < 0.6 * r["flax-sharded"]["total"], r
        # (Whole: about the array bytes; compression and metadata move the count a little either way.)
        assert r["flax"]["ts_read"] > 0.9 * r["flax"]["total"], r
