"""Running the simulator from named parts: scenarios, named policies and routers, grids of runs.

The layer between the simulator core (:mod:`kvsched.envs.sim`, which knows no policy by name)
and its users (the Gymnasium environments, the agents, the ``kvsched`` CLI):

- :mod:`.scenario` -- scenario YAML files: workload, instance spec, policy, router, SLOs, seed;
- :mod:`.simulate` -- :func:`~.simulate.simulate` and :func:`~.simulate.build_cluster`: a
  cluster from policy and router *names* (resolved in :mod:`kvsched.policies`);
- :mod:`.sweep` -- grids of runs (policy x seed x window), locally or as Ray tasks;
- :mod:`.ray_connect` -- checks that a Ray address answers before Ray waits on it.

Importing this package imports none of them (each is imported where used).
"""
