"""Residency-v0's headroom: the clairvoyant reference against the best tuned heuristic, paired on
held-out windows (issue #21's report; docs/environments.md "kvsched/Residency-v0").

Protocol (the bench protocol's, docs/bench.md): the heuristics are LRU, LFU (tier orders, action
0) and session-aware (keep every conversation a fixed time; its keep time tuned over the keep bins
on the *train* windows, by mean SLO attainment); the clairvoyant order reads the window's future
(a reference, not a proven bound). Every candidate then plays the same held-out windows once;
the table gives each one's means and the paired difference (95 % bootstrap interval) of the
clairvoyant reference and of a simple "keep returning conversations" rule over the tuned best.

Scores per episode: SLO attainment (% of the window's requests), DRAM hit rate (% of prompt
tokens loaded from another request's DRAM entries), mean TTFT (s), and the episode's reward.

``--levers`` measures instead the two optional levers of the environment (issue #21 item 3) on
a two-tier scenario (default ``residency-tiers``): HBM residency (``session-hbm``: keep a
conversation in HBM as well as below, its keep time tuned on train windows like ``session``'s) and
prefetching a returning request's prefix from NVMe to DRAM (``+prefetch``), each paired with the
best tuned heuristic without them on the same held-out episodes.

Usage::

    python -m kvsched.experiments.tools.residency_headroom --out residency_headroom.md
    python -m kvsched.experiments.tools.residency_headroom --levers --out residency_levers.md
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvsched import atomic_files

SCENARIO = "residency-mooncake"


def play_with(env, choose, episode: tuple[int, int]) -> dict:
    """Play one episode ``(workload seed, window)`` on ``env`` (unwrapped), ``choose(env, obs,
    state)`` giving each action (``state``: a dict the chooser may keep across the episode; called
    after ``env.reset``, so it may read ``env.workload``). Scores: SLO attainment (%), DRAM (first
    listed tier) and HBM hit rates (%), mean and p99 TTFT (s), the episode's reward.

    Raises:
        RuntimeError: the episode was truncated (no summary; Residency-v0's horizon is 3 windows).
    """
    seed, window = episode
    obs, _ = env.reset(options={"workload_seed": seed, "window_index": window})
    total = 0.0
    state: dict = {}
    while True:
        obs, r, term, trunc, info = env.step(choose(env, obs, state))
        total += r
        if term or trunc:
            break
    s = info.get("summary")
    if s is None:
        raise RuntimeError(f"episode {episode} was truncated")
    a = s["classes"]["all"]
    first = next(iter(s["prefix_tiers"]["tiers"].values()))
    return {"slo": 100 * a["slo"]["attainment"], "dram_hit": 100 * (first["hit_rate"] or 0.0),
            "hbm_hit": 100 * (a["prefix"]["hit_rate"] or 0.0), "ttft_mean_s": a["ttft_s"]["mean"],
            "ttft_p99_s": a["ttft_s"]["p99"], "reward": total}


def play(env, rule: str, episode: tuple[int, int], keep_s: float | None = None) -> dict:
    """Play one episode ``(workload seed, window)`` with ``rule``: ``"order"`` (action 0: the
    environment's eviction order), ``"session"`` (keep every conversation ``keep_s``),
    ``"returning"`` (keep a conversation ``keep_s`` from its second turn on, leave first turns to
    the order); scores as :func:`play_with`."""
    keep = 0 if keep_s is None else env.heuristic_action("session", keep_s)

    def choose(e, obs, state):
        if rule == "order":
            return 0
        if rule == "session":
            return keep
        return keep if obs[4] < 0.5 else 0  # FEATURES[4] = first_turn

    return play_with(env, choose, episode)


def play_policy(env, policy: str | None, episode: tuple[int, int], keep_s: float | None = None) -> dict:
    """Play one episode with a heuristic of :meth:`~kvsched.envs.residency_env.ResidencyEnv.heuristic_action`
    (e.g. ``"session-hbm"``, ``"lru+prefetch"``) at every decision point; scores as :func:`play_with`."""
    return play_with(env, lambda e, obs, state: e.heuristic_action(policy, keep_s), episode)


def paired_row(name: str, rows: list[dict], base: list[dict], keys: tuple[str, ...]) -> tuple[str, dict]:
    """One markdown row ``| name | mean [lo, hi] | ...`` of the paired differences ``rows - base``
    per score in ``keys`` (same episodes, in order; 95 % bootstrap interval,
    :func:`kvsched.experiments.suite.stats.bootstrap_ci`; seconds, keys ending in ``_s``, to 3
    decimals, the rest to 2), and ``{key: (mean, lo, hi)}``."""
    from kvsched.experiments.suite.stats import bootstrap_ci

    cells, stats = [], {}
    for key in keys:
        d = np.array([a[key] - b[key] for a, b in zip(rows, base)])
        lo, hi = bootstrap_ci(d)
        f = ".3f" if key.endswith("_s") else ".2f"
        cells.append(f"{d.mean():+{f}} [{lo:+{f}}, {hi:+{f}}]")
        stats[key] = (float(d.mean()), lo, hi)
    return f"| {name} | " + " | ".join(cells) + " |", stats


def write_or_print(path: str | None, text: str) -> None:
    """Write ``text`` to ``path`` whole (:func:`kvsched.atomic_files.write_text`), or to stdout
    when ``path`` is None (the tools' ``--out``)."""
    if path:
        atomic_files.write_text(path, text)
    else:
        sys.stdout.write(text)


def measure_levers(scenario: str, window_s: float, train_windows: int | None, seeds: int = 8) -> tuple[str, dict]:
    """The HBM-residency and prefetch levers against the best tuned heuristic without them
    (module docstring); returns the markdown table and the numbers."""
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)
    from importlib.resources import files


    path = (scenario if scenario.endswith(".yaml")
            else str(files("kvsched.experiments") / "scenarios" / f"{scenario}.yaml"))

    def make(split: str, eviction: str = "lru"):
        return gym.make("kvsched/Residency-v0", scenario=path, window_s=window_s, split=split, eviction=eviction,
                        hbm_actions=True, prefetch=True).unwrapped

    c0, w0 = time.process_time(), time.perf_counter()
    train = make("train")
    bins = train.keep_bins_s
    tw = episodes(train.source, "train", seeds, train_windows)
    mean = lambda rs: float(np.mean([r["slo"] for r in rs]))  # noqa: E731
    tuning = {pol: {k: mean([play_policy(train, pol, w, k) for w in tw]) for k in bins}
              for pol in ("session", "session-hbm")}
    keep = {pol: max(bins, key=lambda k: (t[k], -k)) for pol, t in tuning.items()}  # ties: the shorter keep
    train_lru = mean([play_policy(train, "lru", w) for w in tw])
    base = "session" if tuning["session"][keep["session"]] > train_lru else "lru"
    held = make("heldout")
    clair = make("heldout", "clairvoyant")
    hw = episodes(held.source, "heldout", seeds)
    cands = {"lru": (held, "lru", None),
             f"session (keep {keep['session']:g} s, tuned)": (held, "session", keep["session"]),
             f"session-hbm (keep {keep['session-hbm']:g} s, tuned)": (held, "session-hbm", keep["session-hbm"]),
             "lru+prefetch": (held, "lru+prefetch", None),
             f"session+prefetch (keep {keep['session']:g} s)": (held, "session+prefetch", keep["session"]),
             "clairvoyant (reference)": (clair, None, None),
             "clairvoyant+prefetch (reference)": (clair, "clairvoyant+prefetch", None)}
    rows = {name: [play_policy(env, pol, w, k) for w in hw] for name, (env, pol, k) in cands.items()}
    best = "lru" if base == "lru" else f"session (keep {keep['session']:g} s, tuned)"
    lines = [f"Residency-v0 levers on `{scenario}` ({window_s:g} s windows, `hbm_actions` and `prefetch` on): "
             f"{len(tw)} train episodes tune the keep times; {len(hw)} held-out episodes, every candidate the same "
             f"ones. Best heuristic without the levers (on train): **{best}**.", "",
             "| candidate | SLO attainment % | HBM hit % | DRAM hit % | mean TTFT (s) | TTFT p99 (s) |",
             "|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        lines.append(f"| {name} | {mean(rs):.2f} | {np.mean([r['hbm_hit'] for r in rs]):.2f} "
                     f"| {np.mean([r['dram_hit'] for r in rs]):.2f} | {np.mean([r['ttft_mean_s'] for r in rs]):.3f} "
                     f"| {np.mean([r['ttft_p99_s'] for r in rs]):.3f} |")
    lines += ["", f"| paired on held-out episodes (vs {best}) | SLO pts (95 % CI) | mean TTFT s (95 % CI) |",
              "|---|---|---|"]
    out: dict = {"best_heuristic": best, "keep_tuning": tuning, "train_lru_slo": train_lru,
                 "heldout_windows": len(hw), "rows": rows, "paired": {}}
    for name in rows:
        if name == best:
            continue
        line, out["paired"][name] = paired_row(name, rows[name], rows[best], ("slo", "ttft_mean_s"))
        lines.append(line)
    lines += ["", f"CPU {time.process_time() - c0:.0f} s, wall {time.perf_counter() - w0:.0f} s."]
    return "\n".join(lines) + "\n", out


def episodes(source, split: str, seeds: int, limit: int | None = None) -> list[tuple[int, int]]:
    """The split's episodes: every window of the trace, or of ``seeds`` workload seeds of a
    synthetic scenario (train seeds 0.., held-out seeds from ``HELDOUT_SEED_BASE``: as the
    environments draw them); the first ``limit`` only when given."""
    from kvsched.envs.episodes import HELDOUT_SEED_BASE

    windows = source.train_windows if split == "train" else source.heldout_windows
    if not source.synthetic:
        out = [(source.scenario.seed, w) for w in windows]
    else:
        base = 0 if split == "train" else HELDOUT_SEED_BASE
        out = [(base + s, w) for s in range(seeds) for w in windows]
    return out if limit is None else out[:limit]


def measure(scenario: str, window_s: float, train_windows: int | None, seeds: int = 8) -> tuple[str, dict]:
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)
    from importlib.resources import files


    path = (scenario if scenario.endswith(".yaml")
            else str(files("kvsched.experiments") / "scenarios" / f"{scenario}.yaml"))

    def make(split: str, eviction: str):
        return gym.make("kvsched/Residency-v0", scenario=path, window_s=window_s, split=split,
                        eviction=eviction).unwrapped

    c0, w0 = time.process_time(), time.perf_counter()
    train = make("train", "lru")
    bins = train.keep_bins_s
    tw = episodes(train.source, "train", seeds, train_windows)
    tuning = {}
    for k in bins:
        tuning[k] = float(np.mean([play(train, "session", w, k)["slo"] for w in tw]))
    best_keep = max(bins, key=lambda k: (tuning[k], -k))  # ties: the shorter keep
    ret_tuning = {k: float(np.mean([play(train, "returning", w, k)["slo"] for w in tw])) for k in bins}
    best_ret = max(bins, key=lambda k: (ret_tuning[k], -k))
    held = {ev: make("heldout", ev) for ev in ("lru", "lfu", "clairvoyant")}
    hw = episodes(held["lru"].source, "heldout", seeds)
    rows = {
        "lru": [play(held["lru"], "order", w) for w in hw],
        "lfu": [play(held["lfu"], "order", w) for w in hw],
        f"session (keep {best_keep:g} s, tuned)": [play(held["lru"], "session", w, best_keep) for w in hw],
        f"returning (keep {best_ret:g} s, tuned)": [play(held["lru"], "returning", w, best_ret) for w in hw],
        "clairvoyant (reference)": [play(held["clairvoyant"], "order", w) for w in hw],
    }
    heur = [k for k in rows if k.startswith(("lru", "lfu", "session"))]
    # the best heuristic is chosen on train windows: LRU and LFU have nothing to tune, so their train
    # scores decide against the tuned session keep
    train_lfu = make("train", "lfu")
    train_score = {"lru": float(np.mean([play(train, "order", w)["slo"] for w in tw])),
                   "lfu": float(np.mean([play(train_lfu, "order", w)["slo"] for w in tw])),
                   heur[2]: tuning[best_keep]}
    best = max(heur, key=lambda k: train_score[k])
    lines = [f"Residency-v0 on `{scenario}` ({window_s:g} s windows): {len(tw)} train episodes tune the keep time; "
             f"{len(hw)} held-out episodes, every candidate the same ones. Best heuristic on train: **{best}**.", "",
             "| candidate | SLO attainment % | DRAM hit % | mean TTFT (s) | reward |", "|---|---|---|---|---|"]
    for name, rs in rows.items():
        lines.append(f"| {name} | {np.mean([r['slo'] for r in rs]):.2f} | {np.mean([r['dram_hit'] for r in rs]):.2f} "
                     f"| {np.mean([r['ttft_mean_s'] for r in rs]):.3f} | {np.mean([r['reward'] for r in rs]):.1f} |")
    lines += ["", "| paired on held-out episodes (vs the best heuristic) | SLO pts (95 % CI) | DRAM hit pts (95 % CI) "
              "| mean TTFT s (95 % CI) |", "|---|---|---|---|"]
    out: dict = {"best_heuristic": best, "train_slo": train_score, "session_keep_tuning": tuning,
                 "returning_keep_tuning": ret_tuning, "heldout_windows": len(hw), "rows": rows}
    for name in ("clairvoyant (reference)", f"returning (keep {best_ret:g} s, tuned)"):
        line, out.setdefault("paired", {})[name] = paired_row(name, rows[name], rows[best],
                                                              ("slo", "dram_hit", "ttft_mean_s"))
        lines.append(line)
    lines.append("")
    lines.append(f"CPU {time.process_time() - c0:.0f} s, wall {time.perf_counter() - w0:.0f} s.")
    return "\n".join(lines) + "\n", out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default=SCENARIO, help=f"a bundled scenario name (default {SCENARIO})")
    from kvsched.experiments.cli_types import count, number

    p.add_argument("--window-s", type=number(0.0, strict=True), default=300.0, help="episode window (s, > 0)")
    p.add_argument("--train-windows", type=count, default=None, help="tune on the first N train episodes only (>= 1)")
    p.add_argument("--seeds", type=count, default=8,
                   help="workload seeds per split of a synthetic scenario (>= 1, default 8)")
    p.add_argument("--levers", action="store_true",
                   help="measure the HBM-residency and prefetch levers instead (default scenario residency-tiers)")
    p.add_argument("--out", help="write the markdown table here (default: stdout)")
    a = p.parse_args(argv)
    if a.levers:
        scenario = "residency-tiers" if a.scenario == SCENARIO else a.scenario
        text, _ = measure_levers(scenario, a.window_s, a.train_windows, a.seeds)
    else:
        text, _ = measure(a.scenario, a.window_s, a.train_windows, a.seeds)
    write_or_print(a.out, text)


if __name__ == "__main__":
    main()
