"""The provider seam: where slices live is one module's business, and nothing above it asks which."""
from __future__ import annotations

import ast
import tokenize
from pathlib import Path

import pytest

from orchestrator import provider
from orchestrator.spec import SliceSpec, UserError, load_slice_spec

ROOT = Path(__file__).resolve().parents[1]
STAND_INS = ("fake_tpu_api", "gcs", "fake_kaggle", "local_slice")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_only_the_local_provider_imports_a_stand_in_and_no_stand_in_imports_the_orchestrator():
    users = {str(p.relative_to(ROOT)) for p in (ROOT / "orchestrator").rglob("*.py")
             if any(i == "infra" or i.startswith("infra.") for i in _imports(p))}
    assert users == {"orchestrator/provider/local.py"}, users
    for name in STAND_INS:
        mods = _imports(ROOT / "infra" / f"{name}.py")
        assert not [m for m in mods if m.split(".")[0] == "orchestrator"], (name, mods)


def _code_names(path: Path) -> dict[int, set[str]]:
    """The names each line's code uses (strings and comments left out)."""
    out: dict[int, set[str]] = {}
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.NAME:
                out.setdefault(tok.start[0], set()).add(tok.string)
    return out


def test_the_layers_above_the_seam_do_not_branch_on_local_mode():
    """No orchestrator module but the provider package and the command lines (the CLI, where the user picks
    --local, and the demo, which runs in local mode) asks whether a slice is local: no condition uses a local flag
    (a plan asks the provider whether its devices are emulated CPU devices instead)."""
    top = ROOT / "orchestrator"
    # The TPU API client (provider/cloud.py) serves both places: it is checked too.
    files = [f for f in sorted(top.rglob("*.py")) if f.relative_to(top).parts[0] not in ("provider", "cli")
             and f.name != "demo.py"] + [top / "provider" / "cloud.py"]
    assert len(files) > 20 and top / "plan" / "step.py" in files
    locals_ = {"local", "is_local", "local_slice", "LocalSlice", "LOCAL"}
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in files for i, names in _code_names(f).items()
            if names & locals_ and names & {"if", "elif", "while", "else"}]
    assert hits == [], hits


def test_each_provider_refuses_what_its_place_cannot_do_before_anything_is_created():
    spec = SliceSpec(name="ok", accelerator="v4-8", provider_options={"fresh": True}).validate()
    with pytest.raises(UserError, match="only for local slices; add --local"):
        provider.get("gcp").check(spec)
    provider.get("local").check(spec)
    with pytest.raises(UserError, match="--local and --api-endpoint exclude each other"):
        provider.get("local").check(SliceSpec(name="ok", accelerator="v4-8", api_endpoint="http://x").validate())
    with pytest.raises(UserError, match="unknown local slice option"):
        provider.get("local").check(SliceSpec(name="ok", accelerator="v4-8", provider_options={"gpu": True}))
    with pytest.raises(UserError, match="unknown provider"):
        provider.get("aws")


def test_zones_default_only_where_the_place_offers_all_of_them():
    spec = SliceSpec(name="ok", accelerator="v5litepod-8").validate()
    assert provider.get("local").default_zones(spec) == [spec.accelerator_type.zone_hints[0]]
    with pytest.raises(UserError, match="no zone given: pass --zone"):
        provider.get("gcp").default_zones(spec)


def test_a_spec_file_and_an_old_record_still_say_local(tmp_path):
    from orchestrator.state import SliceRecord
    f = tmp_path / "s.yaml"
    f.write_text("name: a\naccelerator: v4-8\nlocal: true\n")
    assert load_slice_spec(f).provider == "local"
    old = SliceRecord.from_json({"name": "a", "project": "p", "zone": "z", "accelerator": "v4-8", "node": "n",
                                 "local": True, "fresh_hosts": True})
    assert (old.provider, old.provider_options) == ("local", {"fresh": True})
    assert SliceRecord.from_json({"name": "a", "project": "p", "zone": "z", "accelerator": "v4-8",
                                  "node": "n"}).provider == "gcp"
