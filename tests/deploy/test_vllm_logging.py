"""kvsched's vLLM-driven commands keep vLLM's warnings off the console and show its errors
(:func:`kvsched.deploy.quiet_vllm_logging`); a logging configuration of the user's is kept.
No vLLM needed: the function configures the standard ``vllm`` logger without importing vLLM."""

from __future__ import annotations

import logging

import pytest

from kvsched.deploy import quiet_vllm_logging
from kvsched.envs.sim.errors import ConfigError


@pytest.fixture
def unconfigured(monkeypatch):
    """No handler on the ``vllm`` logger and vLLM's logging variables unset; all restored
    afterwards. Tests also call :func:`no_root_handlers` (pytest adds its capture handlers to the
    root logger when the test body starts)."""
    log = logging.getLogger("vllm")
    level = log.level
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(log, "propagate", True)
    log.setLevel(logging.NOTSET)
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH"):
        monkeypatch.delenv(name, raising=False)
    yield log
    log.setLevel(level)  # setLevel also clears the loggers' cached levels


def no_root_handlers(monkeypatch) -> None:
    """The root logger without handlers, as in ``kvsched parity`` (restored afterwards)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def _emit() -> None:
    child = logging.getLogger("vllm.platforms.cpu")
    child.warning("CPU backend prefers block_size is multiples of 32")
    child.error("Available memory is less than requested memory for kv")


def test_vllm_warnings_are_quiet_and_its_errors_shown_by_default(unconfigured, capsys, monkeypatch):
    import os

    no_root_handlers(monkeypatch)
    quiet_vllm_logging()
    _emit()
    err = capsys.readouterr().err
    assert "prefers block_size" not in err
    assert "vLLM ERROR [vllm.platforms.cpu] Available memory" in err
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"  # an engine started later logs at ERROR too


def test_a_vllm_logging_level_the_user_set_is_kept(unconfigured, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    no_root_handlers(monkeypatch)
    quiet_vllm_logging()
    _emit()
    err = capsys.readouterr().err
    assert "prefers block_size" in err and "Available memory" in err


@pytest.mark.parametrize("user", ["root handler", "vllm handler", "VLLM_CONFIGURE_LOGGING=0"])
def test_a_logging_configuration_of_the_users_is_left_alone(unconfigured, monkeypatch, user):
    no_root_handlers(monkeypatch)
    if user == "root handler":
        monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    elif user == "vllm handler":
        monkeypatch.setattr(unconfigured, "handlers", [logging.NullHandler()])
    else:
        monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    before = list(unconfigured.handlers)
    quiet_vllm_logging()
    assert unconfigured.handlers == before and unconfigured.propagate


def test_an_unknown_vllm_logging_level_is_a_one_line_error_naming_it(unconfigured, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "loud")
    no_root_handlers(monkeypatch)
    with pytest.raises(ConfigError, match=r"VLLM_LOGGING_LEVEL='loud' is not allowed: expected one of CRITICAL") as e:
        quiet_vllm_logging()
    assert len(str(e.value).splitlines()) == 1
