"""A shared per-candidate encoder for ``kvsched/Scheduling-v0``: a DeepSets policy whose slot
choice is equivariant and whose other choices are invariant to the order of the candidate rows.

The flat MLP of Stable-Baselines3 sees the ``K x 9`` candidate block as one vector: it must learn
the same function of a request once per row position, and a candidate moved to another row looks
new to it. This encoder applies one network to every row (Zaheer et al., "Deep Sets", NeurIPS
2017, Thm. 2: a permutation-invariant function is rho(sum phi(x_i))):

- ``phi``: each candidate row (``CANDIDATE_FEATURES``, 9 values) -> ``row_dim`` (MLP, ReLU);
- pooled over the valid rows (``valid`` = column 0): their mean and max (0 when no row is valid);
- ``rho``: ``[mean, max, instance features]`` -> ``ctx_dim``, the decision's context;
- the slot logits score each row from ``[phi(row), context]`` with one shared head (so the slot
  distribution permutes with the rows); the chunk, victim and mode logits and the value come
  from the context alone (unchanged by a permutation).

No weight depends on ``K``: the same parameters serve any number of candidate rows (a policy
built for one ``K`` can take another's ``state_dict``). Observation layout and feature scales:
:mod:`kvsched.envs.observation`.

Use it with ``kvsched train --policy-net candidate-set`` (PPO or MaskablePPO on
Scheduling-v0), or in Python ``MaskablePPO(CandidateSetMaskablePolicy, env)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from kvsched.agents.fast_sampling import FastMaskedSamplingMixin
from kvsched.envs.observation import CANDIDATE_FEATURES, INSTANCE_FEATURES
from kvsched.envs.sim.errors import ConfigError

ROW = len(CANDIDATE_FEATURES)
INSTANCE = len(INSTANCE_FEATURES)


def rows_of(observation_space: spaces.Space, row: int = ROW, instance: int = INSTANCE) -> int:
    """``K``, the candidate rows of a Scheduling observation space of ``row`` features per row and
    ``instance`` instance features (version 0: 9 and 10; version 1: 11 and 18).

    Raises:
        ConfigError: a space that is not a flat Box of ``K * row + instance`` values.
    """
    shape = getattr(observation_space, "shape", None)
    if not isinstance(observation_space, spaces.Box) or shape is None or len(shape) != 1 \
            or shape[0] < instance + row or (shape[0] - instance) % row:
        raise ConfigError(f"the candidate-set encoder needs a kvsched/Scheduling observation (a flat Box of "
                          f"K x {row} + {instance} values); got {observation_space}")
    return (shape[0] - instance) // row


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class CandidateSetExtractor(BaseFeaturesExtractor):
    """Features ``[context (ctx_dim), phi(row_1), ..., phi(row_K)]`` of shape
    ``(batch, ctx_dim + K * row_dim)`` from observations ``(batch, K * 9 + 10)``."""

    def __init__(self, observation_space: spaces.Box, row_dim: int = 64, ctx_dim: int = 64, row_features: int = ROW,
                 instance_features: int = INSTANCE) -> None:
        k = rows_of(observation_space, row_features, instance_features)
        super().__init__(observation_space, ctx_dim + k * row_dim)
        self.k, self.row_dim, self.ctx_dim, self.row_features = k, row_dim, ctx_dim, row_features
        self.phi = _mlp([row_features, row_dim, row_dim])
        self.rho = _mlp([2 * row_dim + instance_features, ctx_dim, ctx_dim])

    def forward(self, obs: th.Tensor) -> th.Tensor:
        b = obs.shape[0]
        rows = obs[:, :self.k * self.row_features].reshape(b, self.k, self.row_features)
        valid = rows[:, :, :1]  # (b, K, 1): 1 for a candidate, 0 for padding
        h = self.phi(rows) * valid
        count = valid.sum(dim=1)
        mean = h.sum(dim=1) / count.clamp(min=1.0)
        biggest = (h - (1.0 - valid) * 1e6).max(dim=1).values
        biggest = th.where(count > 0, biggest, th.zeros_like(biggest))
        ctx = self.rho(th.cat([mean, biggest, obs[:, self.k * self.row_features:]], dim=1))
        return th.cat([ctx, h.reshape(b, self.k * self.row_dim)], dim=1)


class _Heads(nn.Module):
    """Logits ``[slot (K), the other parts' choices]`` from the extractor's features."""

    def __init__(self, k: int, row_dim: int, ctx_dim: int, other_choices: int, hidden: int = 64) -> None:
        super().__init__()
        self.k, self.row_dim, self.ctx_dim = k, row_dim, ctx_dim
        self.slot = nn.Sequential(_mlp([row_dim + ctx_dim, hidden]), nn.Linear(hidden, 1))
        self.other = nn.Linear(ctx_dim, other_choices) if other_choices else None
        # a fixed bias on row 0's slot logit (the reference's first choice; 0 unless a warm start
        # sets it: kvsched.agents.warm_start.reference_bias)
        self.register_buffer("first_row_bias", th.zeros(()))

    def forward(self, features: th.Tensor) -> th.Tensor:
        b = features.shape[0]
        ctx = features[:, :self.ctx_dim]
        rows = features[:, self.ctx_dim:].reshape(b, self.k, self.row_dim)
        per_row = th.cat([rows, ctx.unsqueeze(1).expand(b, self.k, self.ctx_dim)], dim=2)
        slot = self.slot(per_row).squeeze(2)
        slot = th.cat([slot[:, :1] + self.first_row_bias, slot[:, 1:]], dim=1)
        return slot if self.other is None else th.cat([slot, self.other(ctx)], dim=1)


class _Value(nn.Module):
    """The state value from the context alone (invariant to the rows' order)."""

    def __init__(self, ctx_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.ctx_dim = ctx_dim
        self.net = nn.Sequential(_mlp([ctx_dim, hidden]), nn.Linear(hidden, 1))

    def forward(self, features: th.Tensor) -> th.Tensor:
        return self.net(features[:, :self.ctx_dim])


def _choices(action_space: spaces.Space, k: int) -> int:
    """The number of non-slot logits; the first part of the action must be the slot (``K``)."""
    nvec = [int(action_space.n)] if isinstance(action_space, spaces.Discrete) else \
        [int(n) for n in getattr(action_space, "nvec", [])]
    if not nvec or nvec[0] != k:
        raise ConfigError(f"the candidate-set encoder needs an action whose first part picks one of the {k} "
                          f"candidate rows (Scheduling-v0); got {action_space}")
    return int(sum(nvec[1:]))


class _CandidateSetMixin:
    """Builds the heads of :class:`_Heads` and :class:`_Value` on the shared extractor, in place
    of SB3's linear action and value nets (the MLP extractor is the identity: ``net_arch`` empty)."""

    def __init__(self, observation_space, action_space, lr_schedule, row_dim: int = 64, ctx_dim: int = 64,
                 row_features: int = ROW, instance_features: int = INSTANCE, **kwargs: Any) -> None:
        kwargs.setdefault("features_extractor_class", CandidateSetExtractor)
        kwargs.setdefault("features_extractor_kwargs", {"row_dim": row_dim, "ctx_dim": ctx_dim,
                                                        "row_features": row_features,
                                                        "instance_features": instance_features})
        kwargs["net_arch"] = {"pi": [], "vf": []}
        kwargs["share_features_extractor"] = True
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)  # type: ignore[call-arg]

    def _build(self, lr_schedule) -> None:
        self._build_mlp_extractor()  # type: ignore[attr-defined]
        ext: CandidateSetExtractor = self.features_extractor  # type: ignore[attr-defined]
        self.action_net = _Heads(ext.k, ext.row_dim, ext.ctx_dim,
                                 _choices(self.action_space, ext.k))  # type: ignore[attr-defined]
        self.value_net = _Value(ext.ctx_dim)
        if self.ortho_init:  # type: ignore[attr-defined]
            for module, gain in ((ext, np.sqrt(2)), (self.action_net, 0.01), (self.value_net, 1.0)):
                module.apply(lambda m, g=gain: self.init_weights(m, gain=g))  # type: ignore[attr-defined]
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1),  # type: ignore[attr-defined]
                                              **self.optimizer_kwargs)  # type: ignore[attr-defined]


class CandidateSetPolicy(_CandidateSetMixin, ActorCriticPolicy):
    """The candidate-set policy for PPO (Stable-Baselines3)."""


class CandidateSetMaskablePolicy(FastMaskedSamplingMixin, _CandidateSetMixin, MaskableActorCriticPolicy):
    """The candidate-set policy for MaskablePPO (sb3-contrib), its rollouts sampled in one batched
    pass (:mod:`kvsched.agents.fast_sampling`)."""
