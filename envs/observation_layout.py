"""The layout of each observation version of the scheduling environment: features per
candidate row and instance features (what a learner needs to split the flat vector)."""

from __future__ import annotations

from kvsched.envs.observation import CANDIDATE_FEATURES, INSTANCE_FEATURES
from kvsched.envs.observation_v1 import CANDIDATE_FEATURES_V1, INSTANCE_FEATURES_V1
from kvsched.envs.sim.errors import require

#: observation version -> (candidate-row features, instance features)
LAYOUTS: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    0: (CANDIDATE_FEATURES, INSTANCE_FEATURES),
    1: (CANDIDATE_FEATURES_V1, INSTANCE_FEATURES_V1),
}


def layout(version: int) -> tuple[int, int]:
    """``(features per candidate row, instance features)`` of observation ``version``.

    Raises:
        ConfigError: an unknown version.
    """
    require(version in LAYOUTS and not isinstance(version, bool), "observation_version", version,
            f"one of {sorted(LAYOUTS)}")
    rows, inst = LAYOUTS[version]
    return len(rows), len(inst)
