"""Workloads: real trace loaders, windows, rate scaling and synthetic generators."""
