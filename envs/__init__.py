"""Simulator core and workloads. The core (``kvsched.envs.sim``) never imports gymnasium."""
