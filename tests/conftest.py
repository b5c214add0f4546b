"""Test configuration: Hypothesis runs derandomized in CI (same examples every run), randomized
elsewhere so local runs keep exploring new cases."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# checkpoints the tests write are signed with a key of the test session, not the user's
# (~/.config/kvsched/checkpoint.key; kvsched.agents.trust): subprocesses inherit it
if not os.environ.get("KVSCHED_CHECKPOINT_KEY"):
    import tempfile

    os.environ["KVSCHED_CHECKPOINT_KEY"] = os.path.join(tempfile.mkdtemp(prefix="kvsched-test-key-"), "checkpoint.key")
