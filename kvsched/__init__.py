"""kvsched: LLM-serving scheduling studied as a KV-cache residency problem.

Sub-packages (each a top-level folder of the repository, mapped under ``kvsched``):

- :mod:`kvsched.envs` -- the discrete-event simulator (``envs/sim``) and workloads (``envs/workload``).
- :mod:`kvsched.policies` -- reference schedulers and routers from the literature.
- :mod:`kvsched.agents` -- learned agents.
- :mod:`kvsched.runner` -- scenarios, simulate by policy and router name, sweeps (local or Ray).
- :mod:`kvsched.experiments` -- the ``kvsched`` command line, scenarios and reports.
"""

__version__ = "0.2.0"
