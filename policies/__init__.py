"""Reference schedulers and routers from the literature."""
