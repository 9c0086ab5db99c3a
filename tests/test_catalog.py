"""The accelerator catalog and the offline validation of a slice spec."""
from __future__ import annotations

import pytest

from orchestrator import catalog
from orchestrator.spec import (SliceSpec, UserError, check_name, load_slice_spec, parse_duration, parse_labels)


@pytest.mark.parametrize("name, chips, hosts, topology, per_host", [
    ("v4-8", 4, 1, "2x2x1", 4), ("v4-16", 8, 2, "2x2x2", 4), ("v4-32", 16, 4, "2x2x4", 4),
    ("v5p-8", 4, 1, "2x2x1", 4), ("v5p-32", 16, 4, "2x2x4", 4),
    ("v5litepod-1", 1, 1, "1x1", 1), ("v5litepod-8", 8, 1, "2x4", 8), ("v5litepod-16", 16, 4, "4x4", 4),
    ("v6e-8", 8, 1, "2x4", 8), ("v6e-16", 16, 4, "4x4", 4), ("v6e-256", 256, 64, "16x16", 4),
])
def test_shapes(name, chips, hosts, topology, per_host):
    a = catalog.lookup(name)
    assert (a.chips, a.hosts, a.topology, a.chips_per_host) == (chips, hosts, topology, per_host)
    assert a.devices_per_host == per_host


def test_figures_and_prices():
    v4, v5e, v5p, v6e = (catalog.lookup(n) for n in ("v4-16", "v5litepod-16", "v5p-8", "v6e-4"))
    assert (v4.hbm_gib_per_chip, v4.generation.peak_bf16_tflops) == (32, 275)
    assert (v5e.hbm_gib_per_chip, v5e.generation.peak_bf16_tflops) == (16, 197)
    assert (v5p.hbm_gib_per_chip, v5p.generation.peak_bf16_tflops) == (95, 459)
    assert (v6e.hbm_gib_per_chip, v6e.generation.peak_bf16_tflops) == (32, 918)
    assert v4.hbm_gib == 256 and v4.peak_bf16_tflops == 8 * 275
    assert v4.price_per_hour("us-central2-b") == pytest.approx(8 * 3.22)
    assert v4.price_per_hour("us-central2-b", spot=True) == pytest.approx(8 * 0.92)
    assert v5e.price_per_hour("us-west4-a", spot=True) == pytest.approx(16 * 0.469)
    assert v5e.price_per_hour("us-central1-a", spot=True) == pytest.approx(16 * 0.213)
    assert v6e.price_per_hour("europe-west4-a", spot=True) == pytest.approx(4 * 0.648)  # default spot price
    assert v4.default_runtime_version == "tpu-ubuntu2204-base"
    assert v5e.default_runtime_version == "v2-alpha-tpuv5-lite"
    assert catalog.zones_for("v4-8") == ("us-central2-b",)
    assert "us-central2-b" in catalog.all_zones() and "europe-west4-a" in catalog.all_zones()
    for a in catalog.all_types():  # every entry is self-consistent
        assert a.chips % a.hosts == 0 and a.price_per_hour() > 0 and a.topology


def test_aliases_and_unknown():
    assert catalog.lookup("v5e-16").name == "v5litepod-16"
    assert catalog.lookup(" V4-16 ").name == "v4-16"
    with pytest.raises(catalog.UnknownAccelerator, match="did you mean v4-16"):
        catalog.lookup("v4-17")
    with pytest.raises(catalog.UnknownAccelerator, match="known types: v4-8..v4-4096"):
        catalog.lookup("h100")


@pytest.mark.parametrize("bad", ["X", "1abc", "a_b", "abc-", "a" * 64, "", "my slice"])
def test_bad_names(bad):
    with pytest.raises(UserError, match="invalid slice name"):
        check_name(bad)


def test_good_names_durations_labels():
    assert check_name("a") == "a" and check_name("my-slice-1") == "my-slice-1"
    assert parse_duration("8h") == 8 * 3600 and parse_duration("90s") == 90 and parse_duration("2d") == 172800
    assert parse_duration("500ms") == 0.5 and parse_duration(None) is None
    for bad in ("8 hours", "-1h", "0"):
        with pytest.raises(UserError):
            parse_duration(bad)
    assert parse_labels(["team=nlp,run=7", "x=y"]) == {"team": "nlp", "run": "7", "x": "y"}
    for bad, msg in (("Team=x", "label key"), ("a=B", "label value"), ("novalue", "key=value"),
                     ("tpuctl-name=x", "reserved")):
        with pytest.raises(UserError, match=msg):
            parse_labels([bad])


def test_spec_validation():
    s = SliceSpec(name="ok", accelerator="v5e-16", zones=["us-west4-a,us-central1-a"]).validate()
    assert s.accelerator == "v5litepod-16" and s.zones == ["us-west4-a", "us-central1-a"]
    assert s.runtime == "v2-alpha-tpuv5-lite"
    for kw, msg in ((dict(spot=True, reserved=True), "exclude each other"),
                    (dict(accelerator="v9-8"), "unknown accelerator"),
                    (dict(zones=["uscentral"]), "invalid zone"),
                    (dict(wait_capacity=True, queued=False), "--no-queue"),
                    (dict(timeout_s=0), "--timeout")):
        base = dict(name="ok", accelerator="v4-8")
        with pytest.raises(UserError, match=msg):
            SliceSpec(**{**base, **kw}).validate()


def test_spec_files(tmp_path):
    y = tmp_path / "s.yaml"
    y.write_text("name: from-yaml\naccelerator: v4-16\nzone: us-central2-b\nttl: 8h\nlabels: {team: nlp}\nspot: true\n")
    s = load_slice_spec(y).validate()
    assert (s.name, s.zones, s.ttl_s, s.labels, s.spot) == ("from-yaml", ["us-central2-b"], 28800, {"team": "nlp"}, True)
    t = tmp_path / "s.toml"
    t.write_text('[slice]\nname = "from-toml"\naccelerator = "v6e-4"\nzones = ["us-east1-d"]\ntimeout = "5m"\n')
    s = load_slice_spec(t).validate()
    assert (s.name, s.zones, s.timeout_s) == ("from-toml", ["us-east1-d"], 300)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\naccelerator: v4-8\ncolour: blue\n")
    with pytest.raises(UserError, match="unknown key.*colour"):
        load_slice_spec(bad)
    with pytest.raises(UserError, match="cannot read spec file"):
        load_slice_spec(tmp_path / "missing.yaml")


_BASE = {"name": "name: typed", "accelerator": "accelerator: v4-8"}


@pytest.mark.parametrize("line,key", [
    ('spot: "false"', "spot"),                 # a quoted "false" must not turn spot on
    ("zones: 7", "zones"),
    ("accelerator: 16", "accelerator"),
    ("timeout_s: abc", "timeout_s"),
    ("timeout: [1]", "timeout"),
    ("labels: [a, b]", "labels"),
    ("metadata: {ssh-keys: 5}", "metadata"),
    ("queued: yes please", "queued"),
])
def test_spec_file_values_are_type_checked_and_name_their_key(tmp_path, line, key):
    lines = dict(_BASE)
    lines[key if key in lines else "extra"] = line
    f = tmp_path / "s.yaml"
    f.write_text("\n".join(lines.values()) + "\n")
    with pytest.raises(UserError, match=f"`{key}`") as e:
        load_slice_spec(f).validate()
    assert "\n" not in str(e.value)


def test_spec_file_zone_string_non_utf8_and_huge_durations(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: typed\naccelerator: v4-8\nzones: us-central2-b\n")   # one zone as a string, not 'u', 's', ...
    assert load_slice_spec(f).validate().zones == ["us-central2-b"]
    f.write_bytes(b"name: caf\xe9\naccelerator: v4-8\n")
    with pytest.raises(UserError, match="not UTF-8"):
        load_slice_spec(f)
    with pytest.raises(UserError, match=r"at most 366d"):
        parse_duration("9" * 400, "--ttl")
    with pytest.raises(UserError, match="invalid --ttl"):
        parse_duration("1e999", "--ttl")


def test_catalog_agrees_with_what_the_service_offers():
    """The stand-in keeps its own table of offerings (infra/fake_tpu_api.py): every catalog zone hint must
    offer that generation there, and every catalog shape must be the service's."""
    from infra import fake_tpu_api as svc
    offered = svc.default_zones()
    for a in catalog.all_types():
        assert svc._shape(a.name) == (a.generation.api_type, a.topology, a.hosts), a.name
        for z in a.zone_hints:
            assert a.name in offered.get(z, []), f"{a.name} is not offered in {z}"
        assert a.default_runtime_version in svc.RUNTIME_VERSIONS
    assert catalog.lookup("v2-8").zone_hints == ("us-central1-b", "us-central1-c", "us-central1-f", "europe-west4-a")
    assert catalog.lookup("v3-8").zone_hints == ("us-central1-a", "us-central1-b", "us-central1-f", "europe-west4-a")
    assert catalog.lookup("v3-8").devices_per_host == 8 and catalog.lookup("v2-8").hbm_gib == 64
    assert "europe-west4-b" in catalog.zones_for("v5p-8") and "europe-west4-b" in catalog.zones_for("v5e-4")
    assert not (set(catalog.all_zones()) - set(offered))   # gc's default scan covers every catalog zone
