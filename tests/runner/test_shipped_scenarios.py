"""Every scenario shipped in experiments/scenarios loads, builds its instance spec and policy, and
is listed in docs/scenarios.md (a shipped file nobody can find, or one that no longer parses after
a schema change, is caught here rather than by a user)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.policies.base import make_policy
from kvsched.runner.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "experiments" / "scenarios").glob("*.yaml"))


def test_there_are_shipped_scenarios():
    assert len(SHIPPED) >= 10


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_shipped_scenario_loads_and_builds_its_spec_and_policy(path):
    sc = load_scenario(path)
    spec = sc.instance_spec()
    assert spec.num_hbm_blocks >= 1
    make_policy(sc.policy, sc.policy_params)


@pytest.mark.parametrize("path", [p for p in SHIPPED if not p.stem.startswith("bench-v1-")], ids=lambda p: p.stem)
def test_a_shipped_scenario_is_listed_in_the_scenarios_page(path):
    """bench v1's scenarios are listed in docs/bench.md instead (one per task)."""
    assert f"`{path.name}`" in (ROOT / "docs" / "scenarios.md").read_text()


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.stem.startswith("bench-v1-")], ids=lambda p: p.stem)
def test_a_bench_scenario_is_named_in_the_bench_page(path):
    assert path.stem in (ROOT / "docs" / "bench.md").read_text()


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.stem.startswith("bench-v1-")], ids=lambda p: p.stem)
def test_a_bench_scenario_pins_every_cost_parameter_so_a_recalibration_leaves_its_results(path):
    """bench v1's committed results were computed with the H100 calibration version 1; a scenario
    that left a CostParams field to the GPU default would change with every ``kvsched calibrate``
    (and a field added later would take the new calibration's value)."""
    from dataclasses import fields

    import yaml

    from kvsched.envs.sim.specs import CostParams

    pinned = (yaml.safe_load(path.read_text()).get("instance") or {}).get("cost") or {}
    missing = sorted({f.name for f in fields(CostParams)} - set(pinned))
    assert not missing, f"{path.name} leaves {missing} to the shipped calibration"
