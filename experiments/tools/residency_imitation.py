"""Residency-v0: imitation of a hindsight teacher (Parrot, Liu et al. ICML 2020; LRB, Song et al.
NSDI 2020; :mod:`kvsched.agents.hindsight`) against the tuned session keep, paired on held-out
windows (docs/environments.md "kvsched/Residency-v0").

Protocol (the headroom tool's, :mod:`kvsched.experiments.tools.residency_headroom`): on the
*train* episodes the session keep time is tuned over the keep bins and the teacher's action for
conversations that do not return within the largest bin (``drop`` or ``default``) and its
admission margin (:data:`MARGINS_S`) are chosen, both
by mean SLO attainment; the teacher then plays the first ``--record-windows`` train episodes while
every decision's (observation, teacher action, mask) is recorded, and the student (an MLP on the
observation only) is fitted to them (behaviour cloning); ``--dagger-rounds`` rounds of DAgger
(Ross et al., AISTATS 2011) then let the latest student play those windows, the teacher label its
states, and a student refit on everything recorded. Every candidate plays the same held-out episodes once: LRU,
the tuned session keep, the student, and two references that read the window's future (the
teacher and the clairvoyant order). The table gives each one's means and the paired difference
over the tuned session keep (95 % bootstrap interval).

Usage::

    python -m kvsched.experiments.tools.residency_imitation --out residency_imitation.md
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvsched.experiments.tools.residency_headroom import paired_row, play_with, write_or_print

SCENARIO = "residency-sessions"
#: the teacher's admission margins tried on train (s) [kvsched choice: about one prefill, and a
#: long queue's wait]
MARGINS_S = (2.0, 10.0)


def measure(scenario: str, window_s: float, train_windows: int | None, record_windows: int, seeds: int = 8,
            heldout_limit: int | None = None, dagger_rounds: int = 0, log=None) -> tuple[str, dict]:
    """The table of the module docstring (markdown) and the numbers."""
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)
    from importlib.resources import files

    from kvsched.agents.hindsight import HindsightIndex, ImitationPolicy, record, teacher_action
    from kvsched.experiments.tools.residency_headroom import episodes

    say = log or (lambda msg: None)
    path = (scenario if scenario.endswith(".yaml")
            else str(files("kvsched.experiments") / "scenarios" / f"{scenario}.yaml"))

    def make(split: str, eviction: str = "lru"):
        return gym.make("kvsched/Residency-v0", scenario=path, window_s=window_s, split=split,
                        eviction=eviction).unwrapped

    def keep(k):
        return lambda env, obs, st: env.heuristic_action("session", k)

    def teacher(margin_s, beyond):
        def choose(env, obs, st):
            if st.get("w") is not env.workload:
                st["w"], st["index"] = env.workload, HindsightIndex(env.workload)
            return teacher_action(env, st["index"], margin_s, beyond)
        return choose

    mean = lambda rs: float(np.mean([r["slo"] for r in rs]))  # noqa: E731
    c0, w0 = time.process_time(), time.perf_counter()
    train = make("train")
    bins = train.keep_bins_s
    tw = episodes(train.source, "train", seeds, train_windows)
    tuning = {k: mean([play_with(train, keep(k), w) for w in tw]) for k in bins}
    best_keep = max(bins, key=lambda k: (tuning[k], -k))  # ties: the shorter keep
    say(f"train: session keep tuning {tuning} -> {best_keep:g} s")
    train_lru = mean([play_with(train, lambda e, o, s: 0, w) for w in tw])
    variants = [(m, b) for m in MARGINS_S for b in (1, 0)]  # ties: the first (the smaller margin, drop)
    teacher_train = {v: mean([play_with(train, teacher(*v), w) for w in tw]) for v in variants}
    margin_s, beyond = max(variants, key=lambda v: teacher_train[v])
    say(f"train: lru {train_lru:.2f}; teacher (margin s, beyond) {teacher_train} -> ({margin_s:g}, {beyond})")
    obs, acts, masks = record(train, tw[:record_windows], margin_s, beyond)
    student = ImitationPolicy(obs.shape[1], train.n_actions, seed=0)
    fit = student.fit(obs, acts, masks)
    data, dagger, dagger_fits = [(obs, acts, masks)], student, []
    for r in range(dagger_rounds):  # the latest student plays the recorded windows, the teacher labels
        data.append(record(train, tw[:record_windows], margin_s, beyond, behaviour=dagger.act))
        dagger = ImitationPolicy(obs.shape[1], train.n_actions, seed=0)
        dagger_fits.append(dagger.fit(*(np.concatenate(x) for x in zip(*data))))
        say(f"DAgger round {r + 1}: {dagger_fits[-1]}")
    labels = {train.labels[a]: int(c) for a, c in enumerate(np.bincount(acts, minlength=train.n_actions)) if c}
    say(f"student fitted on {len(acts)} decisions of {min(record_windows, len(tw))} train episodes: {fit}; "
        f"teacher labels {labels}")
    held, clair = make("heldout"), make("heldout", "clairvoyant")
    hw = episodes(held.source, "heldout", seeds, heldout_limit)
    beyond_name = "drop" if beyond == 1 else "default"
    base = f"session (keep {best_keep:g} s, tuned)"
    cands: dict[str, tuple] = {
        "lru": (held, lambda e, o, s: 0),
        base: (held, keep(best_keep)),
        "student (MLP on the observation)": (held, lambda e, o, s: student.act(o, e.action_masks())),
        **({f"student, DAgger ({dagger_rounds} rounds)": (held, lambda e, o, s: dagger.act(o, e.action_masks()))}
           if dagger_rounds else {}),
        f"teacher (hindsight, margin {margin_s:g} s, beyond {beyond_name}; reference)":
            (held, teacher(margin_s, beyond)),
        "clairvoyant order (reference)": (clair, lambda e, o, s: 0),
    }
    rows = {}
    for name, (env, choose) in cands.items():
        rows[name] = [play_with(env, choose, w) for w in hw]
        say(f"held-out {name}: SLO {mean(rows[name]):.2f}")
    lines = [f"Residency-v0 imitation of the hindsight teacher on `{scenario}` ({window_s:g} s windows): {len(tw)} "
             f"train episodes tune the session keep and the teacher; the student learns from the teacher's "
             f"{len(acts)} decisions on {min(record_windows, len(tw))} of them (train accuracy "
             f"{100 * fit['train_accuracy']:.1f} %); {len(hw)} held-out episodes, every candidate the same ones.", "",
             "| candidate | SLO attainment % | DRAM hit % | mean TTFT (s) | reward |", "|---|---|---|---|---|"]
    for name, rs in rows.items():
        lines.append(f"| {name} | {mean(rs):.2f} | {np.mean([r['dram_hit'] for r in rs]):.2f} "
                     f"| {np.mean([r['ttft_mean_s'] for r in rs]):.3f} | {np.mean([r['reward'] for r in rs]):.1f} |")
    lines += ["", f"| paired on held-out episodes (vs {base}) | SLO pts (95 % CI) | DRAM hit pts (95 % CI) "
              "| mean TTFT s (95 % CI) |", "|---|---|---|---|"]
    out: dict = {"session_keep_tuning": tuning, "best_keep_s": best_keep, "train_lru_slo": train_lru,
                 "teacher_train_slo": {f"margin {m:g} s, beyond {b}": v for (m, b), v in teacher_train.items()},
                 "margin_s": margin_s, "beyond": beyond, "fit": fit, "dagger_fits": dagger_fits,
                 "teacher_labels": labels,
                 "heldout_episodes": hw, "rows": rows, "paired": {}}
    for name in rows:
        if name == base:
            continue
        line, out["paired"][name] = paired_row(name, rows[name], rows[base], ("slo", "dram_hit", "ttft_mean_s"))
        lines.append(line)
    lines += ["", f"CPU {time.process_time() - c0:.0f} s, wall {time.perf_counter() - w0:.0f} s."]
    return "\n".join(lines) + "\n", out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from kvsched.experiments.cli_types import count, integer, number

    p.add_argument("--scenario", default=SCENARIO, help=f"a bundled scenario name or a .yaml (default {SCENARIO})")
    p.add_argument("--window-s", type=number(0.0, strict=True), default=300.0, help="episode window (s, > 0)")
    p.add_argument("--train-windows", type=count, default=12,
                   help="tune and choose on the first N train episodes (>= 1, default 12)")
    p.add_argument("--record-windows", type=count, default=8,
                   help="record the teacher on the first N of those (>= 1, default 8)")
    p.add_argument("--seeds", type=count, default=8,
                   help="workload seeds per split of a synthetic scenario (>= 1, default 8)")
    p.add_argument("--heldout-windows", type=count, default=None,
                   help="play the first N held-out episodes only (>= 1; default all)")
    p.add_argument("--dagger-rounds", type=integer(0), default=2,
                   help="DAgger rounds after behaviour cloning (>= 0, default 2; 0: no DAgger row)")
    p.add_argument("--out", help="write the markdown table here (default: stdout)")
    a = p.parse_args(argv)
    text, _ = measure(a.scenario, a.window_s, a.train_windows, a.record_windows, a.seeds, a.heldout_windows,
                      a.dagger_rounds, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    write_or_print(a.out, text)


if __name__ == "__main__":
    main()
