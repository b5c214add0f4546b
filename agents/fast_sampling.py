"""Masked action sampling in one batched pass, for MaskablePPO's rollouts.

sb3-contrib's ``MaskableActorCriticPolicy.forward`` builds one ``MaskableCategorical`` per part
of a ``MultiDiscrete`` action at every rollout step (``MaskableMultiCategoricalDistribution``:
split, mask, renormalise, sample and ``log_prob`` part by part). On ``kvsched/Scheduling-v0``
(four parts) that was 73 % of training CPU with one environment (issue #20's profile). This
mixin replaces only ``forward`` (what ``collect_rollouts`` calls) with the same distribution
computed at once over a padded ``(batch, parts, max choices)`` tensor:

- the flat logits ``(batch, sum(nvec))`` are gathered into ``(batch, parts, max(nvec))``, the
  masked entries set to -1e8 (sb3-contrib's ``HUGE_NEG``, so a masked choice has probability
  exactly 0 in float32, as there) and the padding to -inf (never drawn, even in a part whose
  every choice is masked);
- ``x - logsumexp(x)`` over the last axis gives every part's log-probabilities (as torch's
  ``Categorical``, so they equal sb3-contrib's to the last bit);
- a sample is the arg-max of log-probabilities plus Gumbel noise (Gumbel-max: an exact sample
  of the categorical), drawn from torch's seeded generator; ``deterministic`` takes the arg-max;
- the log-probability of the action is the sum over parts, as sb3-contrib's.

The training loss (``evaluate_actions``) and ``predict`` are sb3-contrib's, unchanged, so a
checkpoint trained with this mixin is an ordinary MaskablePPO checkpoint of the same network.
Tested: the log-probabilities equal sb3-contrib's for the same logits and masks, masked
choices are never drawn, and the empirical frequencies match the probabilities.
"""

from __future__ import annotations

import math

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy

#: the logit given to masked choices (sb3-contrib ``MaskableCategorical``'s HUGE_NEG; padding is -inf)
MASKED_LOGIT = -1e8


def part_sizes(action_space: spaces.Space) -> list[int]:
    """Choices per action part: ``nvec`` of a MultiDiscrete space, ``[n]`` of a Discrete one.

    Raises:
        ValueError: another action space.
    """
    if isinstance(action_space, spaces.Discrete):
        return [int(action_space.n)]
    if isinstance(action_space, spaces.MultiDiscrete) and action_space.nvec.ndim == 1:
        return [int(n) for n in action_space.nvec]
    raise ValueError(f"batched masked sampling needs a Discrete or 1-D MultiDiscrete action space; got {action_space}")


class PaddedParts:
    """Index maps between flat per-part logits ``(batch, sum(nvec))`` and padded
    ``(batch, parts, max(nvec))`` (padding reads a column fixed at :data:`MASKED_LOGIT`)."""

    def __init__(self, nvec: list[int]) -> None:
        self.nvec = list(nvec)
        width = max(self.nvec)
        total = sum(self.nvec)
        index = np.full((len(self.nvec), width), total, dtype=np.int64)  # ``total`` = the padding column
        start = 0
        for p, n in enumerate(self.nvec):
            index[p, :n] = np.arange(start, start + n)
            start += n
        self.index = th.as_tensor(index)
        self.total = total

    def pad(self, flat: th.Tensor, fill: float | bool) -> th.Tensor:
        """``flat`` ``(batch, sum(nvec))`` -> ``(batch, parts, max(nvec))``, padding = ``fill``."""
        col = th.full((flat.shape[0], 1), fill, dtype=flat.dtype)
        return th.cat((flat, col), dim=1)[:, self.index]


def sample_masked(logits: th.Tensor, masks: np.ndarray | th.Tensor | None, parts: PaddedParts,
                  deterministic: bool = False) -> tuple[th.Tensor, th.Tensor]:
    """Sample a masked multi-part categorical action in one pass.

    Args:
        logits: ``(batch, sum(nvec))`` unnormalised logits, parts concatenated.
        masks: ``(batch, sum(nvec))`` booleans (True = allowed; any shape that reshapes to it), or
            ``None`` (everything allowed).
        parts: the action's :class:`PaddedParts`.
        deterministic: the most likely choice of each part instead of a sample.

    Returns:
        ``(actions (batch, parts) int64, log_prob (batch,))``: the log-probability is the sum over
        parts of each chosen choice's masked log-probability.
    """
    if masks is not None:
        m = th.as_tensor(np.asarray(masks, dtype=bool) if not isinstance(masks, th.Tensor) else masks,
                         dtype=th.bool).reshape(logits.shape)
        logits = th.where(m, logits, th.tensor(MASKED_LOGIT, dtype=logits.dtype))
    # padding at -inf (probability 0 even in a part whose every choice is masked: sb3-contrib then
    # draws uniformly among the part's own choices, never past them); x - logsumexp(x) as torch's
    # Categorical computes it
    # (sb3-contrib's log-probabilities, which the training loss compares with, to the last bit)
    padded = parts.pad(logits, -math.inf)
    logp = padded - th.logsumexp(padded, dim=-1, keepdim=True)
    if deterministic:
        actions = logp.argmax(dim=-1)
    else:
        u = th.rand(logp.shape, dtype=logp.dtype).clamp_(min=1e-20)  # torch's generator, seeded by SB3
        actions = (logp - th.log(-th.log(u))).argmax(dim=-1)
    log_prob = logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1).sum(dim=1)
    return actions, log_prob


class FastMaskedSamplingMixin:
    """Replaces ``MaskableActorCriticPolicy.forward`` by :func:`sample_masked` (module docstring)."""

    def forward(self, obs: th.Tensor, deterministic: bool = False,
                action_masks: np.ndarray | None = None) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
        parts = getattr(self, "_padded_parts", None)
        if parts is None:
            parts = self._padded_parts = PaddedParts(part_sizes(self.action_space))  # type: ignore[attr-defined]
        features = self.extract_features(obs)  # type: ignore[attr-defined]
        if self.share_features_extractor:  # type: ignore[attr-defined]
            latent_pi, latent_vf = self.mlp_extractor(features)  # type: ignore[attr-defined]
        else:
            pi_features, vf_features = features
            latent_pi = self.mlp_extractor.forward_actor(pi_features)  # type: ignore[attr-defined]
            latent_vf = self.mlp_extractor.forward_critic(vf_features)  # type: ignore[attr-defined]
        values = self.value_net(latent_vf)  # type: ignore[attr-defined]
        actions, log_prob = sample_masked(self.action_net(latent_pi), action_masks, parts,  # type: ignore[attr-defined]
                                          deterministic)
        return actions.reshape((-1, *self.action_space.shape)), values, log_prob  # type: ignore[attr-defined]


class FastMaskablePolicy(FastMaskedSamplingMixin, MaskableActorCriticPolicy):
    """sb3-contrib's ``MlpPolicy`` for MaskablePPO with :class:`FastMaskedSamplingMixin`'s rollouts."""
