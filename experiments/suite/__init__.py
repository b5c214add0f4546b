"""kvsched bench: versioned suites of scheduling tasks with measured headroom, baselines, bounds
and a paired evaluation protocol (``kvsched leaderboard``).

- :mod:`.tasks` -- the frozen task records of each suite version;
- :mod:`.episodes` -- the held-out episode pool of a task and its strata ("all", "hard");
- :mod:`.runs` -- serving one episode with a heuristic, a constant action, the random agent or a
  learned agent;
- :mod:`.search` -- the offline hindsight search that gives the achievable bound;
- :mod:`.bounds` -- the isolation bound and the hindsight bound of an episode;
- :mod:`.stats` -- paired differences with bootstrap confidence intervals, normalised scores;
- :mod:`.compute` -- computing a task's baselines and bounds (tuning on train episodes only);
- :mod:`.results` -- the committed results file and the leaderboard table.
"""
