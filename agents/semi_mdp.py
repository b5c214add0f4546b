"""Discounting by simulated time (semi-MDP) for PPO and MaskablePPO.

A kvsched decision point is an event, not a clock tick: on Scheduling-v0 two decisions may be
1 ms or 2 s of simulated time apart. A per-decision discount ``gamma`` therefore weighs a
request's miss seconds later by how many decisions happened in between, which depends on the
policy (a policy that makes more decisions sees its own future more discounted). In a semi-Markov
decision process the discount of a transition that lasted ``tau`` time units is ``gamma ** tau``
(Bradtke and Duff, "Reinforcement learning methods for continuous-time Markov decision
problems", NIPS 1994, sec. 3; Sutton, Precup and Singh, "Between MDPs and semi-MDPs", AIJ
1999, sec. 3): here ``tau = elapsed_s / discount_time_s``, so ``gamma`` is the discount per
``discount_time_s`` seconds of simulated time, the same for every policy.

Mechanism: every kvsched environment reports ``info["elapsed_s"]``, the simulated seconds from
the decision a step acted on to the next decision (or the episode's end). :class:`ElapsedCallback`
copies it into the rollout buffer at each step (SB3 calls a callback's ``on_step`` after
``env.step`` and before ``rollout_buffer.add``, at the buffer position the step will fill), and
the buffers below compute GAE (Schulman et al., ICLR 2016, eq. 16) with the per-step discount
``gamma_t = gamma ** (elapsed_s_t / discount_time_s)`` in place of ``gamma``:
``delta_t = r_t + gamma_t * V(s_{t+1}) - V(s_t)``, ``A_t = delta_t + gamma_t * lambda * A_{t+1}``.
``lambda`` stays per step (it trades bias for variance, not time preference).

Limits (documented, not silent): SB3 bootstraps a time-limit truncation with ``gamma`` per step
in its own ``collect_rollouts`` (``rewards += gamma * V(terminal)``); bench tasks never truncate
(``horizon_s`` infinite). Potential-based shaping (:mod:`kvsched.envs.reward`) is
policy-invariant only with the per-step discount it was given, so ``kvsched train`` refuses
shaping together with ``--discount-time-s``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sb3_contrib.common.maskable.buffers import MaskableRolloutBuffer
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback

from kvsched.envs.sim.errors import require, bounded_repr


def check_discount_time_s(value: Any) -> float:
    """``value`` as a float: seconds of simulated time per ``gamma`` (finite, > 0).

    Raises:
        ConfigError: naming ``discount_time_s``, the value and what is allowed.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    require(ok, "discount_time_s", value, "a finite number of seconds > 0 (gamma is the discount per that time)")
    return float(value)


class _TimeDiscountMixin:
    """GAE with a discount per step from the simulated time it lasted (module docstring).

    Attributes:
        discount_time_s: seconds of simulated time over which rewards are discounted by ``gamma``.
        elapsed_s: ``(buffer_size, n_envs)`` float64, seconds each stored step lasted; NaN until
            :meth:`record_elapsed` fills it.
    """

    buffer_size: int
    n_envs: int
    pos: int
    gamma: float
    gae_lambda: float
    rewards: np.ndarray
    values: np.ndarray
    episode_starts: np.ndarray
    advantages: np.ndarray
    returns: np.ndarray

    def __init__(self, *args: Any, discount_time_s: float, **kwargs: Any) -> None:
        self.discount_time_s = check_discount_time_s(discount_time_s)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]  # calls reset()

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        self.elapsed_s = np.full((self.buffer_size, self.n_envs), np.nan, dtype=np.float64)

    def record_elapsed(self, elapsed_s: np.ndarray) -> None:
        """Store the simulated seconds of the step about to be added (shape ``(n_envs,)``).

        Raises:
            ValueError: a wrong shape, a negative or non-finite value (an environment that does
                not report ``info["elapsed_s"]`` is refused by :class:`ElapsedCallback`).
        """
        e = np.asarray(elapsed_s, dtype=np.float64)
        if e.shape != (self.n_envs,) or not np.all(np.isfinite(e)) or np.any(e < 0):
            raise ValueError(f"elapsed_s: expected {self.n_envs} finite seconds >= 0, got shape {e.shape} "
                             f"min {bounded_repr(np.min(e) if e.size else None)}")
        self.elapsed_s[self.pos] = e

    def step_discounts(self) -> np.ndarray:
        """``gamma ** (elapsed_s / discount_time_s)`` per stored step, ``(buffer_size, n_envs)``.

        Raises:
            RuntimeError: a step without its elapsed time (no :class:`ElapsedCallback` in ``learn``).
        """
        missing = np.isnan(self.elapsed_s)
        if missing.any():
            step = int(np.argwhere(missing)[0][0])
            raise RuntimeError(f"semi-MDP rollout buffer: step {step} has no elapsed_s; train with "
                               "kvsched.agents.semi_mdp.ElapsedCallback (kvsched train --discount-time-s adds it)")
        return np.power(self.gamma, self.elapsed_s / self.discount_time_s)

    def compute_returns_and_advantage(self, last_values, dones: np.ndarray) -> None:
        """SB3's GAE (``RolloutBuffer.compute_returns_and_advantage``) with ``gamma_t`` per step."""
        last = last_values.clone().cpu().numpy().flatten()
        discounts = self.step_discounts()
        last_gae_lam = np.zeros(self.n_envs, dtype=np.float64)
        for step in reversed(range(self.buffer_size)):
            if step == self.buffer_size - 1:
                next_non_terminal = 1.0 - dones.astype(np.float32)
                next_values = last
            else:
                next_non_terminal = 1.0 - self.episode_starts[step + 1]
                next_values = self.values[step + 1]
            g = discounts[step]
            delta = self.rewards[step] + g * next_values * next_non_terminal - self.values[step]
            last_gae_lam = delta + g * self.gae_lambda * next_non_terminal * last_gae_lam
            self.advantages[step] = last_gae_lam
        self.returns = self.advantages + self.values


class TimeDiscountRolloutBuffer(_TimeDiscountMixin, RolloutBuffer):
    """SB3 ``RolloutBuffer`` with the semi-MDP discount (``rollout_buffer_class`` of PPO;
    ``rollout_buffer_kwargs={"discount_time_s": T}``)."""


class MaskableTimeDiscountRolloutBuffer(_TimeDiscountMixin, MaskableRolloutBuffer):
    """sb3-contrib ``MaskableRolloutBuffer`` with the semi-MDP discount (MaskablePPO)."""


def time_discount_buffer_class(masked: bool) -> type:
    """The buffer class for PPO (``masked`` False) or MaskablePPO (True)."""
    return MaskableTimeDiscountRolloutBuffer if masked else TimeDiscountRolloutBuffer


class ElapsedCallback(BaseCallback):
    """Copies each step's ``info["elapsed_s"]`` into the model's semi-MDP rollout buffer.

    Raises (from ``on_step``):
        ValueError: an environment whose ``info`` has no ``elapsed_s`` (not a kvsched environment),
            or a bad value.
    """

    def _on_step(self) -> bool:
        infos = self.locals.get("infos")
        buffer = getattr(self.model, "rollout_buffer", None)  # off-policy algorithms have none
        if infos is None or not isinstance(buffer, _TimeDiscountMixin):
            return True  # not in a rollout (or not a semi-MDP buffer): nothing to record
        try:
            elapsed = [float(info["elapsed_s"]) for info in infos]
        except (KeyError, TypeError):
            raise ValueError("discount_time_s: the environment's info has no 'elapsed_s' (the simulated seconds a "
                             "step lasted; every kvsched environment reports it)") from None
        buffer.record_elapsed(np.asarray(elapsed))
        return True
