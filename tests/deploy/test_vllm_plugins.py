"""kvsched's LARS and EWSJF as vLLM scheduler plugins (issue #23 item 3): in the parity harness
the plugins' decisions equal kvsched's ``lars`` / ``ewsjf`` on the same requests (but for the
documented differences), and ``kvsched export --target vllm-plugin`` writes a file vLLM accepts
that configures them. Needs the ``vllm`` extra; skipped cleanly without it."""

from __future__ import annotations

import pytest

from kvsched.deploy import VLLM_INSTALL

pytest.importorskip("vllm", reason=f"the vllm extra is not installed ({VLLM_INSTALL})")

from kvsched.deploy import parity  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402
from kvsched.experiments import export as ex  # noqa: E402

pytestmark = pytest.mark.vllm

FCFS_CASES = [c for c in parity.cases() if c.scheduling_policy == "fcfs"]


@pytest.mark.parametrize("policy", ["lars", "ewsjf"])
def test_plugin_decisions_equal_kvscheds_policy_step_by_step(policy):
    for case in FCFS_CASES:
        r = parity.run_plugin_case(case, policy)
        assert r.finished, case.name
        known = parity.PLUGIN_DIFFERENCES.get((policy, case.name)) or parity.KNOWN_DIFFERENCES.get(case.name)
        if known is None:
            i = r.first_difference
            assert r.fraction == 1.0, (case.name, i, r.kvsched[i].describe(), r.vllm[i].describe())
        else:
            assert r.fraction >= known.min_fraction, (case.name, r.fraction)
            if (policy, case.name) in parity.PLUGIN_DIFFERENCES:  # a plugin note must not go stale
                assert r.fraction < 1.0, f"{policy} {case.name}: identical now; drop it from PLUGIN_DIFFERENCES"


def _spec():
    from kvsched.experiments.tune import scenario_for
    from kvsched.runner.scenario import Scenario

    return scenario_for(Scenario(name="t", trace=None, synthetic={"rate_per_s": 4.0, "duration_s": 10}, seed=0),
                        (0.0, 8.0), 0, {}).instance_spec()


@pytest.mark.parametrize("policy, cls", [("lars", "LARSScheduler"), ("ewsjf", "EWSJFScheduler")])
def test_plugin_export_is_accepted_by_vllm_and_carries_every_tuned_parameter(policy, cls):
    from kvsched.policies.base import make_policy

    params = {"kappa": 2.5, "tbt_target_s": 0.08} if policy == "lars" else {"step_size": 200}
    res = ex.export_vllm_plugin(policy, params, {}, _spec(), {"study": "x"})
    ea = ex.check_with_vllm(res.text)
    assert ea.scheduler_cls == f"kvsched.deploy.vllm.{cls}" and ea.scheduling_policy == "fcfs"
    cfg = ea.additional_config["kvsched"]
    assert cfg["policy"] == policy and cfg["policy_params"] == params
    make_policy(policy, cfg["policy_params"])  # loadable as the plugin loads it
    assert not [n for n, _, _ in res.unexpressible if n.startswith("policy")]


def test_plugin_export_refuses_a_policy_without_a_plugin():
    with pytest.raises(ConfigError, match="no vLLM scheduler plugin; allowed: lars, ewsjf"):
        ex.export_vllm_plugin("sarathi", {}, {}, _spec(), {"study": "x"})


def test_plugin_refuses_a_missing_or_foreign_configuration():
    case = FCFS_CASES[0]
    from kvsched.deploy import vllm as plugins

    with pytest.raises(ConfigError, match="additional_config.kvsched"):
        parity.VllmSide(case, plugins.LARSScheduler)
    with pytest.raises(ConfigError, match="expected 'lars'"):
        parity.VllmSide(case, plugins.LARSScheduler,
                        additional_config={"kvsched": {"policy": "ewsjf", "policy_params": {}, "spec": {}}})


@pytest.mark.parametrize("field, value", [("policy_params", "abc"), ("policy_params", [1, 2]),
                                          ("policy_params", None), ("spec", "x"), ("spec", None), ("policy", 3)])
def test_plugin_refuses_a_malformed_section_naming_the_field(field, value):
    from kvsched.deploy import vllm as plugins

    section = {"policy": "lars", "policy_params": {}, "spec": _spec_dict(), field: value}
    with pytest.raises(ConfigError, match=rf"additional_config\.kvsched\.{field}=.* is not allowed") as e:
        parity.VllmSide(FCFS_CASES[0], plugins.LARSScheduler, additional_config={"kvsched": section})
    assert len(str(e.value).splitlines()) == 1
    extra = {"policy": "lars", "policy_params": {}, "spec": _spec_dict(), "polcy_params": {"x": 1}}
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['polcy_params'\]"):
        parity.VllmSide(FCFS_CASES[0], plugins.LARSScheduler, additional_config={"kvsched": extra})


def _spec_dict() -> dict:
    from kvsched.envs.sim.spec_io import instance_spec_to_dict

    return instance_spec_to_dict(_spec())


@pytest.mark.parametrize("field, value", [("block_size_tokens", 32), ("max_num_batched_tokens", 777),
                                          ("max_num_seqs", 3)])
def test_plugin_refuses_a_spec_that_describes_another_engine(field, value):
    from kvsched.deploy import vllm as plugins

    case = FCFS_CASES[0]
    spec = {**_case_spec_dict(case), field: value}
    with pytest.raises(ConfigError, match=rf"spec\.{field}={value} is not allowed: expected \d+, vLLM's --") as e:
        parity.VllmSide(case, plugins.LARSScheduler,
                        additional_config={"kvsched": {"policy": "lars", "policy_params": {}, "spec": spec}})
    assert len(str(e.value).splitlines()) == 1


def _case_spec_dict(case) -> dict:
    from kvsched.envs.sim.spec_io import instance_spec_to_dict

    return instance_spec_to_dict(case.instance_spec())
