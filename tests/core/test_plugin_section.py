"""The vLLM plugins' ``additional_config.kvsched`` section is checked without vLLM: a malformed
field is one line naming it, an unknown field is refused, not ignored."""

from __future__ import annotations

import pytest

from kvsched.deploy.plugin_section import check_section
from kvsched.envs.sim.errors import ConfigError

GOOD = {"policy": "lars", "policy_params": {"alpha": 1.0}, "spec": {"model": "m"}}


def test_a_well_formed_section_is_returned_as_is():
    assert check_section(GOOD) is GOOD


@pytest.mark.parametrize("field, value", [("policy_params", "abc"), ("policy_params", [1, 2]),
                                          ("policy_params", None), ("policy_params", {1: 2}),
                                          ("spec", "x"), ("spec", None), ("spec", [1]), ("policy", None)])
def test_a_malformed_field_is_one_line_naming_it(field, value):
    with pytest.raises(ConfigError, match=rf"^additional_config\.kvsched\.{field}=.* is not allowed: expected") as e:
        check_section({**GOOD, field: value})
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("section, said", [({**GOOD, "extra": 1}, r"unknown field\(s\) \['extra'\]"),
                                           ({"policy": "lars"}, "missing policy_params, spec"),
                                           ("x" * 10_000, r"additional_config\.kvsched='x+\.\.\.")])
def test_a_missing_unknown_or_non_mapping_section_is_refused(section, said):
    with pytest.raises(ConfigError, match=said) as e:
        check_section(section)
    assert len(str(e.value)) < 500
