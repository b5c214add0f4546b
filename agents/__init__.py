"""Learned and reference agents over the Gymnasium environments (:mod:`kvsched.envs`).

- :mod:`.heuristic` -- any policy of :mod:`kvsched.policies` as an agent with the SB3
  ``predict`` signature.
- :mod:`.factory` -- vectorised, seeded environments.
- :mod:`.train` -- ``kvsched train``: SB3 / sb3-contrib training with checkpoints and evaluation.
- :mod:`.evaluate` -- ``kvsched evaluate``: learned vs heuristic agents on held-out windows.
"""
