"""Checkpoints are written without zstd (trainer/common/checkpoint._uncompressed): compressing weights and Adam
moments saves a few percent of their bytes for ~6x the CPU behind the next steps (on a TPU host they waited on it).
A checkpoint Orbax wrote compressed, as earlier runs did, still restores."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from trainer.common import checkpoint
from trainer.common.config import PRESETS, Config


def _bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def test_saves_are_uncompressed_and_compressed_ones_still_restore(tmp_path):
    m, t = PRESETS["gpt2-tiny"]
    cfg = Config("gpt2-tiny", m, t)
    # f32 normals, as weights and moments are: zstd takes ~7% off them
    params = {"w": jax.random.normal(jax.random.key(0), (512, 1024), jnp.float32)}
    opt = {"mu": jax.random.normal(jax.random.key(1), (512, 1024), jnp.float32)}
    raw = 2 * 512 * 1024 * 4
    ck = checkpoint.Checkpointer(str(tmp_path / "new"), keep=2)
    ck.save(1, params, opt, cfg)
    ck.close()
    assert _bytes(tmp_path / "new" / "1" / "params") + _bytes(tmp_path / "new" / "1" / "opt") >= raw

    # what Orbax's standard handler writes by default (zstd), then read by ours
    old = ocp.CheckpointManager(tmp_path / "old", item_names=("params", "opt", "meta"))
    old.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt),
                                        meta=ocp.args.JsonSave({"step": 1, "config": cfg.to_dict()})))
    old.wait_until_finished()
    old.close()
    assert _bytes(tmp_path / "old" / "1" / "params") + _bytes(tmp_path / "old" / "1" / "opt") < 0.97 * raw
    for folder in ("new", "old"):
        back = checkpoint.Checkpointer(str(tmp_path / folder), keep=2, read_only=True)
        abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                             tree)
        p, o = back.restore(1, abstract(params), abstract(opt))
        assert np.array_equal(np.asarray(p["w"]), np.asarray(params["w"]))
        assert np.array_equal(np.asarray(o["mu"]), np.asarray(opt["mu"]))
