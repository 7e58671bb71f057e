"""cluster/prices.yaml prices every node type of every launcher YAML, with the same shape and market."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[3] / "cluster"
PRICES = yaml.safe_load((CLUSTER / "prices.yaml").read_text())


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_every_launcher_node_type_has_prices_and_matching_resources(cloud: str) -> None:
    launcher = yaml.safe_load((CLUSTER / f"{cloud}.yaml").read_text())
    types = launcher["available_node_types"]
    assert set(PRICES[cloud]) == set(types)
    for name, node in types.items():
        entry = PRICES[cloud][name]
        assert entry["on_demand"] > entry["spot"] > 0, name
        assert entry["cpus"] == node["resources"]["CPU"], name
        assert entry["gpus"] == node["resources"].get("GPU", 0), name
        config = str(node["node_config"])
        is_spot = any(word in config for word in ("spot", "Spot", "preemptible"))
        assert (entry["market"] == "spot") == is_spot, name
