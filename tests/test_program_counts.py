"""A plan's figures found by the program it compiles (trainer/common/program_counts.py): a program counted once is
read from its record, not compiled again; another program, a changed one or --no-cache compiles; and tpuctl's own
records of the default Gemma 4 steps whose layers are written out still match the steps their commands build, so a
cold plan of them lowers the step and reads the record instead of compiling for minutes."""
from __future__ import annotations

import json
import os
import shlex

import pytest
from click.testing import CliRunner

from _skips import needs_libtpu
from bench.compiler import ship_counts
from orchestrator.cli.app import cli
from orchestrator.cli.plan_verbs import render
from orchestrator.plan import step as P
from trainer import plan as tplan
from trainer.common import program_counts

TINY = ["pretrain", "--preset", "gpt2-tiny", "--ckpt-dir", "gs://b/run"]


def _plan(args: list[str]) -> dict:
    res = CliRunner().invoke(cli, ["plan", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@needs_libtpu
def test_a_program_counted_once_is_read_from_its_record(tmp_path, monkeypatch):
    """The same program under a new plan cache entry is answered from this machine's record with the same figures
    (lowered, not compiled), and the text says so; --no-cache has the planner compile it again."""
    home = tmp_path / "home"
    monkeypatch.setenv("TPUCTL_HOME", str(home))
    first = P.plan("v5litepod-8", TINY, alternatives=False)
    assert "counted_earlier" not in first.figures and "compile" in first.time_spent()["step_phases"]
    records = list((home / "plans" / "programs").glob("*.json"))
    assert len(records) == 1, records
    rec = json.loads(records[0].read_text())
    assert rec["key"] == records[0].stem and rec["versions"]["libtpu"] != "-"

    for entry in (home / "plans").glob("*.json"):  # the plan cache's entry gone: only the program's record left
        entry.unlink()
    again = P.plan("v5litepod-8", TINY, alternatives=False)
    earlier = again.to_json()["counted_earlier"]
    assert earlier["where"] == program_counts.THIS_MACHINE and earlier["compile_s"] == first.figures["compile_s"]
    assert again.to_json()["per_device"] == first.to_json()["per_device"]
    assert again.timing() == first.timing()
    phases = again.time_spent()["step_phases"]
    assert "found" in phases and "lower" in phases and "compile" not in phases, phases
    text = render(again)
    assert "this machine's record" in text and "not compiled again" in text and "its program's record read" in text
    # --no-cache: the planner reads no record (Store's recount, below) and records the compile again
    assert P._counts_argv(False) == ["--counts-dir", str(home / "plans" / "programs"), "--recount"]
    assert "--recount" not in P._counts_argv(True)
    assert tplan._options().parse_args(["--devices", "8", *P._counts_argv(False)]).recount


KERNEL = """
import jax
from jax.experimental import pallas as pl


def _scaled(x_ref, o_ref):
    o_ref[...] = x_ref[...] * FACTOR


def scaled(x):
    return pl.pallas_call(_scaled, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
"""


def test_a_kernel_is_keyed_by_its_program_not_by_where_its_python_is_installed(tmp_path):
    """A Pallas kernel lowered for TPU carries its Mosaic module with the source paths of the install that traced
    it (the splash kernel: this venv's site-packages). The same kernel traced from another folder (a CI clone,
    another venv) is the same program and key; a kernel that computes otherwise is not."""
    import importlib.util

    import jax
    import jax.numpy as jnp

    def lowered(folder: str, factor: int) -> str:
        src = tmp_path / folder / "kernel.py"
        src.parent.mkdir()
        src.write_text(KERNEL.replace("FACTOR", str(factor)))
        spec = importlib.util.spec_from_file_location("kernel", src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
        return jax.jit(mod.scaled).trace(x).lower(lowering_platforms=("tpu",)).as_text()

    here, there, other = lowered("here", 2), lowered("there", 2), lowered("other", 3)
    assert program_counts.KERNEL_BODY.search(here), "the kernel's module is no longer where a key reads it"
    assert here != there  # the paths the compiler is handed differ ...

    def key(text):
        return program_counts.Store.key(text, [], {}, 1, 1, "tpu")
    assert key(here) == key(there)  # ... the program does not
    assert key(other) != key(here)


def test_a_record_is_found_only_under_its_own_key(tmp_path, monkeypatch):
    """A record is read from this machine's folder first, then the shared ones, then tpuctl's; one whose key or format is not the one
    asked for, or a recount, finds nothing."""
    mine, shipped = tmp_path / "mine", tmp_path / "shipped"
    store = program_counts.Store(mine, shipped=shipped)
    assert store.find("k1") is None
    shipped.mkdir()
    (shipped / "k1.json").write_text(json.dumps({"format": program_counts.FORMAT, "key": "k1", "recorded": "d",
                                                 "figures": {"compile_s": 9.0, "compile_phases": {"x": 1}}}))
    found = store.find("k1")
    assert found["where"] == program_counts.TPUCTL
    answer = program_counts.answer(found, {"settings": {"batch_size": 8}, "compile_s": 0.0})
    assert answer["compile_phases"] == {} and answer["counted_earlier"]["compile_phases"] == {"x": 1}
    assert answer["settings"] == {"batch_size": 8} and answer["compile_s"] == 9.0  # the step's own, the record's
    team = tmp_path / "team"  # a shared folder ($TPUCTL_PLAN_RECORDS): read before tpuctl's, never written
    team.mkdir()
    (team / "k1.json").write_text((shipped / "k1.json").read_text())
    monkeypatch.setenv(program_counts.SHARED_ENV, f"{tmp_path / 'none'}{os.pathsep}{team}")
    assert program_counts.Store(mine, shipped=shipped).find("k1")["where"] == program_counts.SHARED
    store.save("k1", {"compile_s": 2.0}, {"compile": 2.0})
    assert store.find("k1")["where"] == program_counts.THIS_MACHINE
    assert sorted(p.name for p in team.iterdir()) == ["k1.json"]
    assert program_counts.Store(mine, recount=True, shipped=shipped).find("k1") is None
    (shipped / "k2.json").write_text(json.dumps({"format": program_counts.FORMAT, "key": "k1", "figures": {}}))
    (shipped / "k3.json").write_text(json.dumps({"format": program_counts.FORMAT + 1, "key": "k3", "figures": {}}))
    (shipped / "k5.json").write_text("{not json")  # a damaged record: not found (compiled, and written over)
    assert store.find("k2") is None and store.find("k3") is None and store.find("k5") is None
    assert program_counts.Store(None, shipped=shipped).save("k4", {}, {}) is None  # no folder: nothing kept
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert program_counts.Store(blocked / "programs").save("k4", {}, {}) is None  # unwritable: the plan goes on


def _shipped() -> dict[str, dict]:
    out = {}
    for path in program_counts.SHIPPED.glob("*.json"):
        rec = json.loads(path.read_text())
        out[rec["command"]] = rec
    return out


def test_every_default_written_out_step_has_a_record_shipped():
    """One record for each default whose layers `--remat auto` writes out (bench/compiler/ship_counts.py), made by
    the pinned compiler, and none for any other command."""
    shipped = _shipped()
    wanted = {shlex.join(ship_counts.command(a, s)) for a, s in ship_counts.DEFAULTS}
    assert set(shipped) == wanted, f"run `python -m bench.compiler.ship_counts`: {set(shipped) ^ wanted}"
    for cmd, rec in shipped.items():
        assert rec["versions"]["libtpu"] == "0.0.42.1" and rec["figures"]["settings"]["remat"] == "none", cmd


@needs_libtpu
@pytest.mark.parametrize("accelerator,size", ship_counts.DEFAULTS, ids=[f"{a}-{s}" for a, s in ship_counts.DEFAULTS])
def test_a_cold_plan_of_a_default_written_out_step_reads_tpuctls_record(tmp_path, monkeypatch, accelerator, size):
    """The command as a user types it, in a fresh plan cache: the step is lowered and found in tpuctl's records
    (so the program the code builds today is the one recorded); its figures are the record's."""
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    argv = ship_counts.command(accelerator, size)
    rec = _shipped()[shlex.join(argv)]
    plan = _plan([a for a in argv[2:] if a != "--json"])
    earlier = plan.get("counted_earlier")
    assert earlier and earlier["where"] == program_counts.TPUCTL, (
        f"the step `{shlex.join(argv)}` builds is no longer the program tpuctl recorded: run "
        f"`python -m bench.compiler.ship_counts --only {accelerator}:{size}`")
    assert plan["per_device"]["total_bytes"] == rec["figures"]["total_bytes"] and plan["fits"]
    assert "compile" not in plan["time_spent"]["step_phases"]
