"""Test configuration: Hypothesis runs derandomized in CI (same examples every run), randomized
elsewhere so local runs keep exploring new cases."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
