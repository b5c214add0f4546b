"""The ``additional_config.kvsched`` section the vLLM scheduler plugins read
(:mod:`kvsched.deploy.vllm`; written by ``kvsched export --target vllm-plugin``), checked without
vLLM: a mapping of exactly ``policy`` (a policy name), ``policy_params`` (a mapping of parameter
names to values) and ``spec`` (an instance spec mapping). The values themselves are checked where
they are used (:func:`kvsched.policies.base.make_policy`, ``instance_spec_from_dict``)."""

from __future__ import annotations

from typing import Any, Mapping

from kvsched.envs.sim.errors import ConfigError, bounded_repr

#: key of ``additional_config`` holding the plugin's configuration
CONFIG_KEY = "kvsched"
#: the section's fields
FIELDS = ("policy", "policy_params", "spec")


def check_section(cfg: object) -> Mapping[str, Any]:
    """``cfg`` (the ``additional_config.kvsched`` value) when it has the section's shape.

    Raises:
        ConfigError: one line naming the field, its value (bounded) and what is allowed: not a
            mapping, a field missing, an unknown field, ``policy`` not a string, ``policy_params``
            not a mapping with string keys, ``spec`` not a mapping.
    """
    where = f"additional_config.{CONFIG_KEY}"
    hint = "(write it with kvsched export --target vllm-plugin)"
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{where}={bounded_repr(cfg)} is not allowed: expected a mapping with "
                          f"{', '.join(FIELDS)} {hint}")
    missing = [k for k in FIELDS if k not in cfg]
    extra = [k for k in cfg if k not in FIELDS]
    if missing or extra:
        what = (f"missing {', '.join(missing)}" if missing else "") + ("; " if missing and extra else "") + \
               (f"unknown field(s) {bounded_repr(extra)}" if extra else "")
        raise ConfigError(f"{where} is not allowed: {what}; expected exactly {', '.join(FIELDS)} {hint}")
    if not isinstance(cfg["policy"], str):
        raise ConfigError(f"{where}.policy={bounded_repr(cfg['policy'])} is not allowed: expected a policy name")
    params = cfg["policy_params"]
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise ConfigError(f"{where}.policy_params={bounded_repr(params)} is not allowed: expected a mapping of "
                          f"parameter names to values ({{}} for the policy's defaults) {hint}")
    if not isinstance(cfg["spec"], Mapping):
        raise ConfigError(f"{where}.spec={bounded_repr(cfg['spec'])} is not allowed: expected an instance spec "
                          f"mapping (model, gpu, tp, ...) {hint}")
    return cfg
