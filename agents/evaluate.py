"""``kvsched evaluate``: learned and heuristic agents on the same held-out windows and seeds.

Every agent serves the same episodes: held-out window ``w`` (the first ``--windows`` held-out
windows of the scenario, :mod:`kvsched.envs.episodes`) x seed ``s`` (``--seeds``; for a
synthetic scenario the workload generated with seed ``HELDOUT_SEED_BASE + s``, for a trace
the same window again). Episodes run to completion (no horizon), so every request is judged.

- a learned agent (``path.zip``) acts in ``kvsched/Scheduling-v0`` with the environment
  arguments it was trained with (``<stem>.json`` beside the checkpoint, or ``train.json`` in
  its folder or the folder above), deterministically, with its action masks;
- with ``--stochastic`` the learned agent is also run with sampled actions (torch seeded per
  episode), reported as ``<name> (stochastic)``;
- ``random`` is the uniform random agent over the masked actions (seeded per episode), the
  floor a learned agent must beat;
- a heuristic (a policy name) runs directly in the simulator on the same requests (identical
  to acting through the environment with itself as reference; tested).

Output (``--out``): ``episodes.csv`` (one row per agent x window x seed x class),
``table.csv`` and ``table.md`` (mean and 95% confidence interval per agent and class:
Student-t interval over episodes, ``scipy.stats.t``), ``ttft_cdf.png`` (per-agent CDF of
TTFT over all requests), ``learning_curve.png`` (from the checkpoint's ``evaluations.npz``
when found).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvsched.envs import SCHEDULING_IDS
from kvsched.envs.sim.errors import ConfigError, bounded_repr, MAX_PATH_CHARS
from kvsched import atomic_files

METRICS = ("slo_attainment", "goodput_rps", "ttft_p99_s")

#: learners whose checkpoints take the action mask (Scheduling's): sb3-contrib's MaskablePPO and
#: the evolution-strategy scheduler (kvsched.agents.es)
MASKED_ALGOS = ("maskable_ppo", "es")


def _read_metadata(p: Path, check: bool = True) -> Any:
    """The training metadata in ``p`` (a JSON object, duplicate keys refused), checked for the keys
    evaluation reads: ``env_id`` (text), ``env_kwargs`` (a mapping) and ``algo`` (text; not for
    an RLlib checkpoint, ``backend: "rllib"``); with ``check`` False, the JSON value unchecked.

    Raises:
        ConfigError: unreadable, not JSON, not an object, or a key missing or of the wrong type
            (one line naming the file and the key).
    """
    from kvsched.envs.sim.strict_json import DuplicateKeyError, loads

    from .train import ALGOS

    shown = str(p) if len(str(p)) <= MAX_PATH_CHARS else bounded_repr(str(p), MAX_PATH_CHARS)
    if p.exists() and not p.is_file():  # a FIFO would block read_text()
        raise ConfigError(f"training metadata {shown} is not a regular file")
    try:
        meta = loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) else ("nested too deeply" if isinstance(e, RecursionError)
                                                          else str(e) if isinstance(e, DuplicateKeyError)
                                                          else f"not JSON ({bounded_repr(str(e))})")
        raise ConfigError(f"training metadata {shown}: cannot be read: {why}") from None
    if not check:  # the caller checks the content itself
        return meta
    if not isinstance(meta, dict):
        raise ConfigError(f"training metadata {shown}: expected a JSON object (written by `kvsched train`), "
                          f"got {type(meta).__name__}")
    required = {"env_id": str, "env_kwargs": dict}
    if meta.get("backend") != "rllib":
        required["algo"] = str
    for key, typ in required.items():
        if key not in meta:
            raise ConfigError(f"training metadata {shown}: missing key {bounded_repr(key)} (written by "
                              "`kvsched train`; "
                              "is this file from another program, or edited?)")
        if not isinstance(meta[key], typ):
            raise ConfigError(f"training metadata {shown}: {key}={bounded_repr(meta[key])} is not allowed: expected "
                              f"{'text' if typ is str else 'a mapping'}")
    if "algo" in required and meta["algo"] not in ALGOS + ("es",):
        raise ConfigError(f"training metadata {shown}: algo={bounded_repr(meta['algo'])} is not allowed: expected one "
                          f"of {ALGOS + ('es',)} (written by `kvsched train`; is this file edited?)")
    return meta


def _sidecar(ckpt: Path, check: bool = True) -> Any:
    """The training metadata beside checkpoint ``ckpt`` (:func:`_read_metadata`).

    Raises:
        ConfigError: none found, or unreadable (or, with ``check``, without its keys).
    """
    for p in (ckpt.with_suffix(".json"), ckpt.parent / "train.json", ckpt.parent.parent / "train.json"):
        if p.is_file():
            return _read_metadata(p, check)
    raise ConfigError(f"no training metadata for {bounded_repr(str(ckpt), MAX_PATH_CHARS)}: expected "
                      f"{bounded_repr(str(ckpt.with_suffix('.json')), MAX_PATH_CHARS)} or train.json "
                      "beside it (written by `kvsched train`)")


def _is_rllib_checkpoint(agent: str) -> bool:
    """An RLlib ``checkpoint/`` folder written by ``kvsched train --backend rllib``."""
    p = Path(agent)
    meta = p.parent / "train.json"
    return p.is_dir() and meta.is_file() and _read_metadata(meta).get("backend") == "rllib"


def _load_model(ckpt: Path, meta: dict):
    if meta.get("backend") == "rllib":
        from kvsched.agents.rllib import RLlibAgent

        return RLlibAgent(ckpt, masked=meta["env_id"] in SCHEDULING_IDS)
    if meta.get("algo") == "es":
        from kvsched.agents.es import LinearScheduler

        return LinearScheduler.load(ckpt)
    from kvsched.agents.train import _algo_class

    return _algo_class(meta["algo"]).load(str(ckpt), device="cpu")


def _summary_rows(agent: str, window: int, seed: int, summary: dict) -> list[dict]:
    rows = []
    for cls, c in summary["classes"].items():
        rows.append({"agent": agent, "window": window, "seed": seed, "class": cls,
                     "requests": c["counts"]["arrived"], "slo_attainment": c["slo"]["attainment"],
                     "goodput_rps": c["goodput_rps"], "ttft_p99_s": c["ttft_s"].get("p99")})
    return rows


def run_learned(ckpt: Path, episodes: list[tuple[int, int, int]], scenario: str | None,
                window_s: float | None = None, stochastic: bool = False) -> tuple[list[dict], np.ndarray]:
    """Episodes of a learned agent (argmax actions, or sampled with ``stochastic``, torch seeded
    per episode); returns summary rows and all requests' TTFT (s)."""
    import gymnasium as gym
    import torch

    import kvsched.envs  # noqa: F401  (registers the ids)

    meta = _sidecar(ckpt)
    kw = dict(meta["env_kwargs"])
    if scenario is not None:
        kw["scenario"] = scenario
    if window_s is not None:
        kw["window_s"] = window_s
    kw.update(split="heldout", horizon_s=math.inf)
    env = gym.make(meta["env_id"], **kw).unwrapped
    model = _load_model(ckpt, meta)
    # MaskablePPO and RLlib's masking module take the mask (Scheduling-v0; all-True elsewhere)
    masked = meta["algo"] in MASKED_ALGOS or (meta.get("backend") == "rllib"
                                                 and meta["env_id"] in SCHEDULING_IDS)
    rows, ttfts = [], []
    name = ckpt.name + (" (stochastic)" if stochastic else "")
    for wseed, widx, seed in episodes:
        obs, info = env.reset(seed=seed, options={"workload_seed": wseed, "window_index": widx})
        torch.manual_seed(seed * 100_003 + widx)
        done = False
        while not done:
            if masked:
                action, _ = model.predict(obs, deterministic=not stochastic, action_masks=env.action_masks())
            else:
                action, _ = model.predict(obs, deterministic=not stochastic)
            obs, _, term, trunc, info = env.step(action)
            done = term or trunc
        rows += _summary_rows(name, widx, seed, info["summary"])
        rec = env.cluster.recorder.records_frame()
        ttfts.append((rec["first_token_s"] - rec["arrival_s"]).to_numpy())
    return rows, np.concatenate(ttfts) if ttfts else np.zeros(0)


def run_random(episodes, scenario: str | None, window_s: float, env_kwargs: dict,
               env_id: str = "kvsched/Scheduling-v0") -> tuple[list[dict], np.ndarray]:
    """Episodes of the uniform random agent over the allowed actions of ``env_id`` (Scheduling-v0:
    the masked parts of ``MultiDiscrete``, on top of the reference policy and its parameters;
    Routing-v0: an instance; Knobs-v0: a point of the knob box), seeded per episode: the floor a
    learned agent must beat. ``env_kwargs``: the environment's (a checkpoint's training ones)."""
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)

    kw = dict(env_kwargs)
    if scenario is not None:
        kw["scenario"] = scenario
    kw.update(window_s=window_s, split="heldout", horizon_s=math.inf)
    kw.pop("action_mode", None)
    env = gym.make(env_id, **kw).unwrapped
    rows, ttfts = [], []
    for wseed, widx, seed in episodes:
        obs, info = env.reset(seed=seed, options={"workload_seed": wseed, "window_index": widx})
        rng = np.random.default_rng(seed * 100_003 + widx)
        done = False
        while not done:
            obs, _, term, trunc, info = env.step(_random_action(env.action_space, info["action_mask"], rng))
            done = term or trunc
        rows += _summary_rows("random", widx, seed, info["summary"])
        rec = env.cluster.recorder.records_frame()
        ttfts.append((rec["first_token_s"] - rec["arrival_s"]).to_numpy())
    return rows, np.concatenate(ttfts) if ttfts else np.zeros(0)


def _random_action(space, mask: np.ndarray, rng: np.random.Generator):
    """A uniform random action of ``space`` among the allowed ones (``mask``)."""
    if hasattr(space, "nvec"):
        a, i = [], 0
        for n in space.nvec:
            a.append(rng.choice(np.flatnonzero(mask[i:i + n])))
            i += n
        return np.array(a)
    if hasattr(space, "n"):
        return int(rng.choice(np.flatnonzero(mask)))
    return rng.uniform(space.low, space.high).astype(space.dtype)


def run_heuristic(policy: str, source, episodes, env_id: str = "kvsched/Scheduling-v0",
                  env_kwargs: dict | None = None) -> tuple[list[dict], np.ndarray]:
    """Episodes of a heuristic run directly in the simulator: a scheduling policy on every
    instance (Scheduling-v0, Knobs-v0), or a router (Routing-v0: the instances keep the
    environment's policy) -- what :class:`~kvsched.agents.heuristic.HeuristicAgent` plays through
    the environment (tested equal)."""
    from kvsched.envs.common import build_cluster, reference
    from kvsched.policies.routing import make_router

    kw = env_kwargs or {}
    if env_id == "kvsched/Residency-v0":
        return _run_residency_heuristic(policy, source, episodes, kw)
    rows, ttfts = [], []
    for wseed, widx, seed in episodes:
        w = source.workload(wseed, widx)
        if env_id in ("kvsched/Routing-v0", "kvsched/PDRouting-v0"):
            sc = source.scenario
            pol = kw.get("policy") or sc.policy
            n = kw.get("n_instances") or max(2, sc.n_instances)
            cluster = build_cluster(source, lambda i: reference(pol, None, source), n_instances=n)
            cluster.router = make_router(policy)
            # with prefill/decode roles the router picks among the decode and mixed instances
            cluster.router.bind(n if cluster.disagg is None else len(cluster.disagg.decode_ids), sc.seed)
        else:
            cluster = build_cluster(source, lambda i: reference(policy, None, source))
        res = cluster.run(w)
        rows += _summary_rows(policy, widx, seed, res.summary)
        ttfts.append((res.records["first_token_s"] - res.records["arrival_s"]).to_numpy())
    return rows, np.concatenate(ttfts) if ttfts else np.zeros(0)


#: Residency-v0's heuristics: the tier eviction orders (action 0 under ``eviction=<name>``), the
#: session keep (``session`` = 30 s, ``session:<s>`` = <s> s, one of the environment's keep bins)
#: and the session keep in HBM too (``session-hbm[:<s>]``, with ``hbm_actions``); any of them with
#: ``+prefetch`` prefetches at every prefetch point (with ``prefetch``)
RESIDENCY_HEURISTICS = ("lru", "lfu", "session", "clairvoyant", "session-hbm")
PREFETCH_SUFFIX = "+prefetch"


def residency_heuristic(name: str) -> tuple[str, float | None] | None:
    """``(heuristic, keep_s)`` of a Residency-v0 agent name (``lru``, ``lfu``, ``clairvoyant``,
    ``session``, ``session:<s>``, ``session-hbm``, ``session-hbm:<s>``, each optionally ending in
    ``+prefetch``, which the heuristic keeps: ``session:30+prefetch`` is ``("session+prefetch",
    30.0)``), or None when ``name`` is none of them."""
    suffix = PREFETCH_SUFFIX if name.endswith(PREFETCH_SUFFIX) else ""
    base = name[:len(name) - len(suffix)]
    if base in RESIDENCY_HEURISTICS:
        return base + suffix, None
    for keeper in ("session", "session-hbm"):
        if base.startswith(keeper + ":"):
            try:
                keep = float(base[len(keeper) + 1:])
            except ValueError:
                return None
            return (keeper + suffix, keep) if math.isfinite(keep) and keep > 0 else None
    return None


def _run_residency_heuristic(name: str, source, episodes, env_kwargs: dict) -> tuple[list[dict], np.ndarray]:
    """Episodes of a Residency-v0 heuristic played through the environment (:class:`HeuristicAgent`;
    action 0 under a tier order equals the direct run, tested)."""
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)

    from .heuristic import HeuristicAgent

    parsed = residency_heuristic(name)
    if parsed is None:
        raise ConfigError(f"agent {bounded_repr(name)} is not a Residency-v0 heuristic; allowed: "
                          f"{', '.join(RESIDENCY_HEURISTICS)}, session:<seconds> or session-hbm:<seconds>, "
                          f"each optionally ending in {PREFETCH_SUFFIX}")
    heuristic, keep = parsed
    base = heuristic.removesuffix(PREFETCH_SUFFIX)
    cfg = source.config
    kw = {k: v for k, v in env_kwargs.items() if k != "eviction"}
    kw.update(scenario=cfg.scenario, window_s=cfg.window_s, split="heldout", heldout_fraction=cfg.heldout_fraction,
              max_requests=cfg.max_requests, horizon_s=math.inf)
    if base == "session-hbm":  # the options the heuristic plays (a checkpoint's own options stay)
        kw.setdefault("hbm_actions", True)
    if heuristic != base:
        kw.setdefault("prefetch", True)
    if base not in ("session", "session-hbm"):
        kw["eviction"] = base
    elif "eviction" in env_kwargs:
        kw["eviction"] = env_kwargs["eviction"]
    env = gym.make("kvsched/Residency-v0", **kw).unwrapped
    agent = HeuristicAgent(heuristic, env, params=None if keep is None else {"keep_s": keep})
    rows, ttfts = [], []
    for wseed, widx, seed in episodes:
        obs, _ = env.reset(seed=seed, options={"workload_seed": wseed, "window_index": widx})
        done = False
        while not done:
            obs, _, term, trunc, info = env.step(int(agent.predict(obs)[0]))
            done = term or trunc
        rows += _summary_rows(name, widx, seed, info["summary"])
        rec = env.cluster.recorder.records_frame()
        ttfts.append((rec["first_token_s"] - rec["arrival_s"]).to_numpy())
    return rows, np.concatenate(ttfts) if ttfts else np.zeros(0)


def confidence_table(df: pd.DataFrame, level: float = 0.95) -> pd.DataFrame:
    """Mean, half-width and bounds of a Student-t ``level`` interval per agent, class, metric."""
    from scipy import stats

    out = []
    for (agent, cls), g in df.groupby(["agent", "class"], sort=False):
        row: dict[str, Any] = {"agent": agent, "class": cls, "episodes": len(g)}
        for m in METRICS:
            x = g[m].dropna().to_numpy(dtype=float)
            mean = float(x.mean()) if len(x) else math.nan
            if len(x) > 1:
                half = float(stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
            else:
                half = math.nan
            row[m] = mean
            row[f"{m}_ci95"] = half
            row[f"{m}_lo"] = mean - half
            row[f"{m}_hi"] = mean + half
        out.append(row)
    return pd.DataFrame(out)


def _plots(out: Path, ttft: dict[str, np.ndarray], ckpts: list[Path]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, x in ttft.items():
        x = np.sort(x[np.isfinite(x)])
        if len(x):
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.legend()
    fig.tight_layout()
    with atomic_files.replacing(out / "ttft_cdf.png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    made.append("ttft_cdf.png")
    for ck in ckpts:
        for npz in (ck.parent / "eval" / "evaluations.npz", ck.parent.parent / "eval" / "evaluations.npz",
                    ck.with_suffix(".evaluations.npz")):
            if npz.is_file():
                d = np.load(npz)
                fig, ax = plt.subplots(figsize=(6, 4))
                r = d["results"]
                ax.errorbar(d["timesteps"], r.mean(axis=1), yerr=r.std(axis=1), marker="o")
                ax.set_xlabel("environment steps")
                ax.set_ylabel("held-out episode return")
                ax.set_title(ck.name)
                fig.tight_layout()
                with atomic_files.replacing(out / "learning_curve.png") as tmp:
                    fig.savefig(tmp, dpi=120)
                plt.close(fig)
                made.append("learning_curve.png")
                break
    return made


def _one_episode(kind: str, agent: str, episode: tuple[int, int, int], scenario: str | None, window_s: float,
                 stochastic: bool, env_kw: dict | None, source, env_id: str = "kvsched/Scheduling-v0"
                 ) -> tuple[list[dict], np.ndarray]:
    """One agent on one held-out episode (a task of :func:`evaluate`; pure, so any backend)."""
    if kind == "learned":
        return run_learned(Path(agent), [episode], scenario, window_s, stochastic=stochastic)
    if kind == "random":
        return run_random([episode], scenario, window_s, env_kw or {}, env_id)
    return run_heuristic(agent, source, [episode], env_id, env_kw)


#: held-out windows evaluated when none are asked for (fewer when the scenario holds fewer)
DEFAULT_WINDOWS = 4


def evaluate(agents: list[str], scenario: str | None, windows: int | None, seeds: int, out: str | Path,
             window_s: float | None = None, stochastic: bool = False, backend: str = "local",
             address: str | None = None, progress=None, env_id: str | None = None,
             trust_checkpoint: bool = False) -> pd.DataFrame:
    """Run every agent on the same held-out episodes; write the table and plots to ``out``.

    Every (agent, episode) pair is one task (:func:`kvsched.runner.sweep.map_tasks`): with
    ``backend="ray"`` they run as Ray tasks (``address``: a running cluster), with the same
    table as the local run (each episode is seeded on its own). ``progress(done, total)``
    counts finished episodes.

    ``windows=None``: the first :data:`DEFAULT_WINDOWS` held-out windows, or all of them when
    the scenario holds fewer (an explicit count above what it holds is an error). On a trace
    scenario a window is the same requests for every seed, so heuristics and deterministic
    learned agents play each window once; ``seeds`` then vary only the random agent and
    ``stochastic`` learned agents.

    Environments: the checkpoints' (their training metadata; all must share one), else ``env_id``
    (default ``kvsched/Scheduling-v0``). Heuristics are policy names (Scheduling-v0, Knobs-v0),
    router names (Routing-v0) or residency heuristics (Residency-v0: ``lru``, ``lfu``,
    ``clairvoyant``, ``session``, ``session:<s>``). ``random`` acts in the checkpoints' environment with their training
    arguments (reference policy and its parameters included). Windows without requests are left out.

    Checkpoints are loaded (unpickled) only when kvsched wrote or shipped them
    (:func:`kvsched.agents.trust.check`), unless ``trust_checkpoint``.

    Raises:
        ConfigError: no agents, counts < 1, more windows than held out, missing metadata,
            checkpoints of different environments, or an ``env_id`` that contradicts them; a
            checkpoint kvsched did not write (without ``trust_checkpoint``).
    """
    from kvsched.envs.common import episode_config
    from kvsched.envs.episodes import HELDOUT_SEED_BASE, EpisodeSource
    from kvsched.policies.base import policy_names

    if not agents:
        raise ConfigError("--agents must name at least one agent (checkpoint.zip or policy name)")
    names = [Path(a).name if a.endswith(".zip") or _is_rllib_checkpoint(a) else a for a in agents]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--agents names {bounded_repr(', '.join(twice))} twice (a table row per agent: two "
                          "checkpoints with the same file name need different names)")
    for name, v in (("windows", windows), ("seeds", seeds)):
        if v is None and name == "windows":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{name}={bounded_repr(v)} is not allowed: expected an integer >= 1")
    ckpts = [Path(a) for a in agents if a.endswith(".zip") or _is_rllib_checkpoint(a)]
    for c in ckpts:
        if not c.exists():
            raise ConfigError(f"checkpoint {bounded_repr(str(c), MAX_PATH_CHARS)} does not exist")
    metas = [_sidecar(c) for c in ckpts]
    from . import trust

    for c in ckpts:  # before any episode: loading unpickles
        trust.check(c, trust_checkpoint)
    env_ids = sorted({m.get("env_id", "?") for m in metas})
    if len(env_ids) > 1:
        raise ConfigError(f"the checkpoints were trained on different environments {env_ids}; evaluate one at a time")
    if env_ids and env_id is not None and env_id != env_ids[0]:
        raise ConfigError(f"--env {env_id} but the checkpoints were trained on {env_ids[0]}")
    env_id = env_ids[0] if env_ids else (env_id or "kvsched/Scheduling-v0")
    if env_id in ("kvsched/Routing-v0", "kvsched/PDRouting-v0"):
        from kvsched.policies.routing import router_names

        known, what = set(router_names()), "router"
    elif env_id == "kvsched/Residency-v0":
        known, what = {*RESIDENCY_HEURISTICS, "session:<seconds>", "session-hbm:<seconds>"}, "residency heuristic"
    else:
        known, what = set(policy_names()), "policy"
    if env_id == "kvsched/Residency-v0":  # session:<s> names a keep action: <s> must be one of its bins
        from kvsched.envs.residency_env import KEEP_BINS_S

        bins = tuple(float(b) for b in (metas[0]["env_kwargs"] if metas else {}).get("keep_bins_s", KEEP_BINS_S))
        for a in agents:
            parsed = residency_heuristic(a) if a.startswith(("session:", "session-hbm:")) else ("", None)
            if parsed is None or (parsed[1] is not None and parsed[1] not in bins):
                raise ConfigError(f"agent {bounded_repr(a)} is not allowed: expected session:<seconds> or "
                                  f"session-hbm:<seconds> with seconds one of the keep bins "
                                  f"{', '.join(f'{b:g}' for b in bins)}")
    for a in agents:  # before the windows are checked: a typo must not be reported as --windows
        if not (a.endswith(".zip") or _is_rllib_checkpoint(a) or a == "random" or a in known
                or (env_id == "kvsched/Residency-v0" and residency_heuristic(a) is not None)):
            raise ConfigError(f"agent {bounded_repr(a)} is neither a checkpoint (.zip, or an RLlib checkpoint/ folder) "
                              f"nor a {what} of {env_id}; known: {sorted(known)}")
    trained = metas[0]["env_kwargs"] if metas else {}
    if window_s is None:
        # the environment's own default window (Residency-v0's turns come back after minutes)
        window_s = float(trained.get("window_s", 300.0 if env_id == "kvsched/Residency-v0" else 60.0))
    scen = scenario if scenario is not None else trained.get("scenario")
    if scen is None:  # the environment's own default (Residency-v0, PDRouting-v0: not the mixed long/short one)
        from kvsched.envs import default_scenario

        scen = default_scenario(env_id)
    source = EpisodeSource(episode_config(scen, window_s, "heldout", trained.get("heldout_fraction", 0.25),
                                          trained.get("max_requests")))
    if windows is None:
        windows = min(DEFAULT_WINDOWS, len(source.heldout_windows))
    if windows > len(source.heldout_windows):
        raise ConfigError(f"--windows={windows} is more than the {len(source.heldout_windows)} held-out windows of "
                          f"{window_s:g} s in {source.config.scenario}")
    episodes = [(HELDOUT_SEED_BASE + s if source.synthetic else source.scenario.seed, w, s)
                for w in source.heldout_windows[:windows] for s in range(seeds)]
    episodes = [ep for ep in episodes if len(source.workload(ep[0], ep[1]))]  # an empty window has no score
    # a trace's window is the same requests whatever the seed: an agent whose actions do not depend
    # on it (a heuristic, a learned agent acting deterministically) plays it once; counting the
    # replays as episodes would narrow its interval without new evidence
    once = episodes if source.synthetic else [ep for ep in episodes if ep[2] == 0]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # the random agent acts in the checkpoint's environment: every training argument but where and
    # how long (the reference policy's parameters included)
    env_kw = {k: v for k, v in trained.items() if k not in ("scenario", "window_s", "split", "horizon_s")}
    jobs: list[tuple[str, tuple]] = []  # (agent name, arguments of one episode's task), in table order
    for a in agents:
        if a.endswith(".zip") or _is_rllib_checkpoint(a):
            name = Path(a).name
            if stochastic:
                jobs += [(name + " (stochastic)", ("learned", a, ep, scen, window_s, True, None, None))
                         for ep in episodes]
            jobs += [(name, ("learned", a, ep, scen, window_s, False, None, None)) for ep in once]
        elif a == "random":
            jobs += [(a, ("random", a, ep, scen, window_s, False, env_kw, None, env_id)) for ep in episodes]
        else:  # a policy or router name (checked above)
            jobs += [(a, ("heuristic", a, ep, scen, window_s, False, env_kw, source, env_id)) for ep in once]
    from kvsched.runner.sweep import map_tasks

    outs = map_tasks(_one_episode, [j for _, j in jobs], backend=backend, address=address, progress=progress)
    rows, parts = [], {}
    for (name, _), (r, t) in zip(jobs, outs):
        rows += r
        parts.setdefault(name, []).append(t)
    ttft = {name: np.concatenate(ts) if ts else np.zeros(0) for name, ts in parts.items()}
    df = pd.DataFrame(rows)
    with atomic_files.replacing(out / "episodes.csv") as tmp:
        df.to_csv(tmp, index=False)
    table = confidence_table(df)
    with atomic_files.replacing(out / "table.csv") as tmp:
        table.to_csv(tmp, index=False)
    atomic_files.write_text(out / "table.md", format_markdown(table))
    _plots(out, ttft, ckpts)
    table.attrs["windows"] = windows  # the count evaluated (the default depends on the scenario)
    return table


def format_cell(mean: float, half: float) -> str:
    """``mean ± half`` to 4 decimals; ``mean ± -`` when there is no interval (one episode), ``-``
    when there is no mean (no request of the class)."""
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.4f} ± " + (f"{half:.4f}" if math.isfinite(half) else "-")


def format_markdown(table: pd.DataFrame) -> str:
    """The table as Markdown: mean ± 95% CI half-width per metric (see :func:`format_cell`)."""
    lines = ["| agent | class | episodes | SLO attainment | goodput (req/s) | TTFT p99 (s) |",
             "|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        cells = [format_cell(r[m], r[m + "_ci95"]) for m in METRICS]
        lines.append(f"| {r['agent']} | {r['class']} | {r['episodes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
