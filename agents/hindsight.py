"""Imitation of a hindsight teacher for ``kvsched/Residency-v0``: label every retention decision
of the *train* windows with the action that knowing the window's future would take, then fit a
classifier from the observation alone to those labels and play it on unseen windows.

This is the learning-to-cache recipe of Parrot (Liu et al., ICML 2020, "An Imitation Learning
Approach for Cache Replacement": imitate Belady's hindsight decisions) and LRB (Song et al., NSDI
2020, "Learning Relaxed Belady for CDN Caching": learn from the next-request distance a
relaxed Belady boundary gives), adapted to Residency-v0's keep-time actions:

* **Teacher** (:func:`teacher_action`, reads the future; a reference, never a policy): when a
  request finishes, the gap (s) until its conversation's next turn arrives in the window (the
  next arrival of the same ``session_id`` after this request's own, :class:`HindsightIndex`;
  0 when it arrived already) is mapped to the smallest keep bin >= gap + ``margin_s`` (the
  margin covers the admission's queueing after the arrival); a conversation that does not come
  back within the largest bin gets ``beyond`` (1 ``drop`` or 0 ``default``, the tier's order).
* **Student** (:class:`ImitationPolicy`): a small MLP from the observation vector (the
  environment's features only, no future) to the teacher's action, fitted by class-weighted
  cross-entropy over the masked logits on (observation, teacher action, mask) triples recorded
  while the teacher plays the train windows (:func:`record`; behaviour cloning: the
  states are the teacher's), optionally refitted after DAgger rounds (Ross et al., AISTATS 2011:
  :func:`record` with ``behaviour``, the student's own states labelled by the teacher). It plays
  argmax over the valid actions' logits.

``python -m kvsched.experiments.tools.residency_imitation`` measures both against the tuned
session keep on held-out windows (docs/environments.md "kvsched/Residency-v0": on
``residency-sessions`` the teacher gains 2.3 SLO points over the tuned keep, the DAgger student
ties it and the behaviour clone loses 1.9).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from kvsched.envs.sim.errors import ConfigError, bounded_repr, require

#: the teacher's margin (s) added to the gap before choosing a keep bin [kvsched choice: the
#: next turn queues and prefills for about a second on residency-sessions before it loads]
MARGIN_S = 2.0
#: the student's hidden layer widths [kvsched choice]
HIDDEN = (64, 64)


class HindsightIndex:
    """The arrival times (s) of every conversation's turns in one episode's workload (by
    ``session_id``), for the teacher's look ahead.

    Raises:
        ConfigError: a workload whose requests carry no session ids (all ``session_id`` < 0:
            e.g. the Mooncake trace, whose conversations are prefix chains; not supported here).
    """

    def __init__(self, workload) -> None:
        sid = np.asarray(workload.session_id)
        t = np.asarray(workload.arrival_s, dtype=np.float64)
        require(len(sid) == 0 or bool((sid >= 0).any()), "workload.session_id", "all < 0",
                "a workload whose requests carry session ids (the hindsight teacher follows conversations by id)")
        self.arrivals: dict[int, np.ndarray] = {}
        for s in np.unique(sid[sid >= 0]):
            self.arrivals[int(s)] = np.sort(t[sid == s])

    def next_arrival_s(self, session_id: int, after_s: float) -> float:
        """The first arrival (s) of conversation ``session_id`` strictly after ``after_s`` (``inf``:
        none in the window, or no session)."""
        ts = self.arrivals.get(int(session_id))
        if ts is None:
            return math.inf
        i = int(np.searchsorted(ts, after_s, side="right"))
        return float(ts[i]) if i < len(ts) else math.inf


def hindsight_action(gap_s: float, keep_bins_s: tuple[float, ...], margin_s: float = MARGIN_S,
                     beyond: int = 1, first_keep: int = 3) -> int:
    """The teacher's label for a conversation that returns after ``gap_s`` seconds (``inf``: never):
    the index (``first_keep`` + bin) of the smallest keep bin >= ``gap_s + margin_s``, else
    ``beyond`` (1 drop, 0 default).

    Raises:
        ConfigError: a negative or NaN gap or margin, ``beyond`` not 0 or 1.
    """
    require(not math.isnan(gap_s) and gap_s >= 0, "gap_s", gap_s, "a number of seconds >= 0 (inf: never returns)")
    require(math.isfinite(margin_s) and margin_s >= 0, "margin_s", margin_s, "a finite number of seconds >= 0")
    require(beyond in (0, 1), "beyond", beyond, "0 (default: the tier's order) or 1 (drop)")
    need = gap_s + margin_s
    for i, b in enumerate(keep_bins_s):
        if b >= need:
            return first_keep + i
    return beyond


def teacher_action(env, index: HindsightIndex, margin_s: float = MARGIN_S, beyond: int = 1) -> int:
    """The hindsight action at ``env``'s current retention point (:func:`hindsight_action` of the
    gap from now to the conversation's next arrival); 0 at any other point.

    ``env`` is an unwrapped :class:`~kvsched.envs.residency_env.ResidencyEnv`; ``index`` the
    :class:`HindsightIndex` of its current ``env.workload``."""
    from kvsched.envs.residency_env import BASE_ACTIONS

    p = env._point
    if p is None or p.kind != "residency":
        return 0
    st = p.request
    nxt = index.next_arrival_s(st.req.session_id, st.arrival_s)
    gap = max(nxt - p.time_s, 0.0) if math.isfinite(nxt) else math.inf
    return hindsight_action(gap, env.keep_bins_s, margin_s, beyond, len(BASE_ACTIONS))


def record(env, episodes: list[tuple[int, int]], margin_s: float = MARGIN_S, beyond: int = 1,
           behaviour: Callable[[np.ndarray, np.ndarray], int] | None = None,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(observations, teacher actions, masks)`` of every decision of ``episodes`` (``(workload
    seed, window)``, train windows) on ``env`` (unwrapped), played by the teacher, or by
    ``behaviour(obs, mask)`` when given (DAgger, Ross et al. AISTATS 2011: the student's own
    states, labelled by the teacher)."""
    obs_l, act_l, mask_l = [], [], []
    for seed, window in episodes:
        obs, _ = env.reset(options={"workload_seed": seed, "window_index": window})
        index = HindsightIndex(env.workload)
        while True:
            a = teacher_action(env, index, margin_s, beyond)
            mask = env.action_masks()
            obs_l.append(np.asarray(obs, np.float32))
            act_l.append(a)
            mask_l.append(mask)
            obs, _, term, trunc, _ = env.step(a if behaviour is None else behaviour(obs, mask))
            if term or trunc:
                break
    if not act_l:
        raise ConfigError(f"episodes={bounded_repr(episodes)} hold no decision to learn from")
    return np.stack(obs_l), np.asarray(act_l, np.int64), np.stack(mask_l).astype(bool)


class ImitationPolicy:
    """The student: an MLP (:data:`HIDDEN`, ReLU) from the observation vector to one logit per
    action, fitted to a teacher's labels (:meth:`fit`); :meth:`act` is the argmax over the valid
    actions. Deterministic for a seed (torch seeded, one thread for the fit)."""

    def __init__(self, n_features: int, n_actions: int, seed: int = 0) -> None:
        import torch

        require(isinstance(n_features, int) and n_features >= 1, "n_features", n_features, "an integer >= 1")
        require(isinstance(n_actions, int) and n_actions >= 2, "n_actions", n_actions, "an integer >= 2")
        self.n_features, self.n_actions, self.seed = n_features, n_actions, seed
        torch.manual_seed(seed)
        layers: list[Any] = []
        width = n_features
        for h in HIDDEN:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, n_actions))
        self.net = torch.nn.Sequential(*layers)

    def fit(self, obs: np.ndarray, actions: np.ndarray, masks: np.ndarray, epochs: int = 60,
            batch_size: int = 256, learning_rate: float = 3e-3, class_weights: bool = True) -> dict[str, float]:
        """Fit to ``(obs, actions, masks)`` by cross-entropy over the masked logits, each class
        weighted by the inverse of its frequency (balanced; ``class_weights=False``: unweighted);
        returns the train accuracy and loss.

        Raises:
            ConfigError: arrays of other shapes, or an action its mask forbids.
        """
        import torch

        n = len(actions)
        require(obs.shape == (n, self.n_features), "obs", f"shape {obs.shape}", f"({n}, {self.n_features})")
        require(masks.shape == (n, self.n_actions), "masks", f"shape {masks.shape}", f"({n}, {self.n_actions})")
        require(bool(masks[np.arange(n), actions].all()), "actions", "a masked action", "valid actions only")
        counts = np.bincount(actions, minlength=self.n_actions).astype(np.float64)
        weights = (np.where(counts > 0, n / (np.maximum(counts, 1) * max((counts > 0).sum(), 1)), 0.0)
                   if class_weights else np.ones(self.n_actions))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.manual_seed(self.seed)
            x, y = torch.as_tensor(obs, dtype=torch.float32), torch.as_tensor(actions)
            m = torch.as_tensor(masks)
            loss_fn = torch.nn.CrossEntropyLoss(weight=torch.as_tensor(weights, dtype=torch.float32))
            opt = torch.optim.Adam(self.net.parameters(), lr=learning_rate)
            gen = torch.Generator().manual_seed(self.seed)
            for _ in range(epochs):
                for idx in torch.randperm(n, generator=gen).split(batch_size):
                    logits = self.net(x[idx]).masked_fill(~m[idx], -1e9)
                    loss = loss_fn(logits, y[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            with torch.no_grad():
                logits = self.net(x).masked_fill(~m, -1e9)
                acc = float((logits.argmax(1) == y).float().mean())
                final = float(loss_fn(logits, y))
        finally:
            torch.set_num_threads(threads)
        return {"train_accuracy": acc, "train_loss": final}

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        """The valid action of highest logit for observation ``obs`` (the environment's vector only).

        Raises:
            ConfigError: an observation of another length.
        """
        import torch

        o = np.asarray(obs, np.float32)
        require(o.shape == (self.n_features,), "obs", f"shape {o.shape}", f"({self.n_features},)")
        with torch.no_grad():
            logits = self.net(torch.as_tensor(o)[None])[0].numpy()
        logits = np.where(np.asarray(mask, bool), logits, -np.inf)
        return int(np.argmax(logits))
