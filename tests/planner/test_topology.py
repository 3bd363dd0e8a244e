"""Topology files: presets, device kinds, and one-line errors that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from isthmus.errors import ConfigError
from isthmus.planner.topology import device_kinds, list_presets, load_topology, parse_topology, shipped_topologies_dir

REPO = Path(__file__).resolve().parents[2]

TWO_DC = {
    "name": "two",
    "datacenters": [
        {
            "name": "a",
            "device": "h100-sxm",
            "nodes": 2,
            "devices_per_node": 8,
            "intra_node": {"bandwidth_gb_s": 360, "latency_us": 3},
            "fabric": {"bandwidth_gb_s": 45, "latency_us": 6},
        },
        {
            "name": "b",
            "device": "h200",
            "nodes": 4,
            "devices_per_node": 8,
            "intra_node": {"bandwidth_gb_s": 360, "latency_us": 3},
            "fabric": {"bandwidth_gb_s": 45, "latency_us": 6},
        },
    ],
    "wan": [{"between": ["a", "b"], "bandwidth_gb_s": 10, "latency_us": 20000}],
}


def test_presets_and_device_kinds() -> None:
    assert {"local", "selene-a100", "geo-3dc-h100"} <= set(list_presets())
    kinds = device_kinds()
    assert {"a100-80g", "h100-sxm", "h200", "cpu"} <= set(kinds)
    assert kinds["a100-80g"].peak("bf16") == 312e12 and kinds["a100-80g"].memory_bytes == 80e9
    assert kinds["h200"].memory_bytes == 141e9 and kinds["h100-sxm"].peak("fp8") == 1979e12
    assert kinds["cpu"].default_dtype == "fp32"


def test_selene_and_geo_shapes() -> None:
    selene = load_topology("selene-a100")
    assert selene.n_devices == 3072 and selene.datacenters[0].devices_per_node == 8
    dc = selene.datacenters[0]
    assert dc.intra_node.bandwidth > 5 * dc.fabric.bandwidth  # NVLink inside, InfiniBand between nodes
    geo = load_topology("geo-3dc-h100")
    assert len(geo.datacenters) == 3 and geo.n_devices == 12288
    names = [d.name for d in geo.datacenters]
    assert len(geo.wan) == 3 and geo.wan_link(names[0], names[2]).latency > geo.wan_link(names[0], names[1]).latency
    local = load_topology("local")
    assert local.n_devices == 2 and local.datacenters[0].kind.name == "cpu-local"


def test_presets_ship_as_package_data_and_repo_symlink() -> None:
    assert (shipped_topologies_dir() / "devices.toml").is_file()
    link = REPO / "topologies"
    assert link.is_symlink() and (link / "selene-a100.toml").is_file()


def test_load_from_file_mixed_kinds_subset_and_wan_override(tmp_path: Path) -> None:
    path = tmp_path / "two.toml"
    path.write_text(Path(shipped_topologies_dir() / "geo-3dc-h100.toml").read_text().replace("geo-3dc-h100", "copy"))
    assert load_topology(str(path)).name == "copy"
    topo = parse_topology(TWO_DC)
    assert [d.kind.name for d in topo.datacenters] == ["h100-sxm", "h200"]
    assert topo.subset(24).n_devices == 24 and len(topo.subset(16).datacenters) == 1
    assert topo.with_wan(bandwidth_gb_s=1).wan_link("a", "b").bandwidth == 1e9


def test_custom_device_kind_inherits_from_base() -> None:
    data = {**TWO_DC, "devices": {"fast": {"base": "h100-sxm", "peak_tflops": {"bf16": 1500}}}}
    data["datacenters"] = [dict(TWO_DC["datacenters"][0], device="fast")]
    data["wan"] = []
    kind = parse_topology(data).datacenters[0].kind
    assert kind.peak("bf16") == 1500e12 and kind.memory_bytes == 80e9


def _copy(x: object) -> object:
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, key, rule",
    [
        ("datacenters.1.nodes", 0, "topology.datacenters[1].nodes", "at least 1"),
        ("datacenters.1.nodes", "four", "topology.datacenters[1].nodes", "integer"),
        ("datacenters.0.device", "tpu9", "topology.datacenters[0].device", "unknown device kind"),
        ("datacenters.1.fabric", _DELETE, "topology.datacenters[1].fabric", "required when nodes > 1"),
        (
            "datacenters.0.intra_node.bandwidth_gb_s",
            -1,
            "topology.datacenters[0].intra_node.bandwidth_gb_s",
            "positive",
        ),
        ("datacenters.0.gpus", 8, "topology.datacenters[0].gpus", "unknown key"),
        ("datacenters.1.name", "a", "topology.datacenters[1].name", "unique"),
        ("wan.0.between", ["a", "c"], "topology.wan[0].between", "unknown datacenter"),
        ("wan", [], "topology.wan", "missing a [[wan]] link"),
        ("wan.0.latency_us", -5, "topology.wan[0].latency_us", "0 or more"),
    ],
)
def test_bad_topology_names_key_and_rule(path: str, value: object, key: str, rule: str) -> None:
    data = _copy(TWO_DC)
    node: object = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]  # type: ignore[index]
    last: object = int(keys[-1]) if isinstance(node, list) else keys[-1]
    if value is _DELETE:
        del node[last]  # type: ignore[index]
    else:
        node[last] = value  # type: ignore[index]
    with pytest.raises(ConfigError) as info:
        parse_topology(data)  # type: ignore[arg-type]
    message = str(info.value)
    assert info.value.key == key and rule in message and "\n" not in message


def test_bad_device_table_and_missing_file(tmp_path: Path) -> None:
    data = {**_copy(TWO_DC), "devices": {"x": {"memory_gb": 10, "peak_tflops": {"bf17": 1}}}}  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"topology\.devices\.x\.peak_tflops\.bf17"):
        parse_topology(data)
    with pytest.raises(ConfigError, match="no such file or preset"):
        load_topology(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[[datacenters]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_topology(str(bad))
