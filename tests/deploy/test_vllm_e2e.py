"""End to end (issue #23 item 3b): vLLM's offline engine (V1, CPU) serves a tiny random-weight
Llama with kvsched's LARS / EWSJF scheduler plugin loaded from the file ``kvsched export
--target vllm-plugin`` writes, and its first tokens come in LARS's slack order -- the short
prompts of a burst before the long ones submitted ahead of them, where vLLM's own FCFS
scheduler (the ``--target vllm`` file of the same engine) serves the long ones first -- step
for step as kvsched's simulator schedules the same requests.

The model (2 layers, hidden size 128, vocabulary 1024; :data:`kvsched.deploy.parity.TINY_LLAMA_CONFIG`)
is written with random weights into a temporary folder by ``transformers``; prompts are token
ids and the tokenizer is skipped, so nothing is downloaded. What the test sets for vLLM's CPU
engine (and restores afterwards):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process (``InprocClient``),
  so the test reads the scheduler's decisions and no worker process is spawned;
- engine arguments over the exported file, for the tiny model on CPU only: ``model``,
  ``skip_tokenizer_init``, ``dtype=float32``, ``enforce_eager`` (no compilation),
  ``seed=0`` and ``kv_cache_memory_bytes`` (on CPU ``gpu_memory_utilization`` is a fraction
  of host RAM; an explicit KV size keeps the engine small). Every scheduling flag (budget,
  ``max_num_seqs``, block size, chunked prefill, prefix caching, ``scheduler_cls``,
  ``additional_config``) is the file's;
- vLLM's CPU worker replaces ``torch.set_num_threads``, lowers torch's threads to 1 and seeds
  the global random generators, its engine core caches vLLM's environment variables, and the
  in-process engine sets up a one-rank torch.distributed group: all restored or torn down
  when the module's runs end.

Needs the ``vllm`` extra; skipped cleanly without it. Three engine runs: ~25 s on 2 idle cores,
vLLM's import included, 40-50 s on a busy machine (figures: docs/vllm-plugin.md, End to end on CPU).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest

from kvsched.deploy import VLLM_INSTALL

pytest.importorskip("vllm", reason=f"the vllm extra is not installed ({VLLM_INSTALL})")

import numpy as np  # noqa: E402

from kvsched.deploy import parity  # noqa: E402
from kvsched.experiments import export as ex  # noqa: E402

pytestmark = pytest.mark.vllm

#: the burst, in submission order: two long prompts first, then four short ones (tokens)
PROMPTS = (512, 512, 24, 28, 32, 36)
LONG = {0, 1}
SHORT = {2, 3, 4, 5}
#: tokens each request generates (greedy, ignore_eos)
OUTPUT_TOKENS = 2
#: the engine: a token budget a quarter of a long prompt, so that the order matters; blocks of
#: 32 tokens (vLLM's CPU attention works on multiples of 32)
BUDGET, BLOCK, MAX_SEQS, MAX_MODEL_LEN, KV_BLOCKS = 128, 32, 8, 2048, 256
KV_CACHE_BYTES = 16 << 20  # the tiny model's 256 blocks take 8 MiB
#: LARS with a short TTFT floor: each request's deadline is kappa x its own predicted prefill,
#: so the short prompts of a burst are the most urgent as soon as any time has passed. (With
#: the default 0.25 s floor a burst shares one deadline for its first 0.25 s, and relative
#: slack per unit of remaining work ranks the long prompts first during that time.)
LARS_PARAMS = {"ttft_floor_s": 0.01}
#: kvsched's simulator starts its first step this long after the burst arrives (s), as the
#: engine's first step starts after the requests are queued
SIM_START_S = 1e-3
#: the runs: label -> (policy, parameters); "fcfs" is vLLM's own scheduler (``--target vllm``)
RUNS = {"fcfs": ("fcfs", {}), "lars": ("lars", LARS_PARAMS), "ewsjf": ("ewsjf", {})}


def case(policy: str, params: dict) -> parity.ParityCase:
    """The burst as a parity case: kvsched's side of the comparison, and the served system the
    exported file describes (Llama-3.1-8B on an H100, whose cost model prices LARS's slack)."""
    reqs = tuple(parity.CaseRequest(i, n, OUTPUT_TOKENS) for i, n in enumerate(PROMPTS))
    return parity.ParityCase("e2e-burst", "end to end", reqs, kv_blocks=KV_BLOCKS, budget=BUDGET,
                             max_num_seqs=MAX_SEQS, max_model_len=MAX_MODEL_LEN, block_size=BLOCK,
                             kvsched_policy=policy, policy_params=params)


def prompt_ids(i: int, n: int) -> list[int]:
    """Request ``i``'s prompt: ``n`` token ids in [3, 1024) (no special tokens), its first block
    unlike any other request's (no prefix-cache hits)."""
    return [3 + (i * 131 + k) % 1000 for k in range(n)]


def write_random_llama(folder) -> str:
    """:data:`~kvsched.deploy.parity.TINY_LLAMA_CONFIG` with random weights (seed 0) as
    ``config.json`` + ``model.safetensors`` in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in parity.TINY_LLAMA_CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    rng = torch.get_rng_state()
    torch.manual_seed(0)
    try:
        LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(folder)
    finally:
        torch.set_rng_state(rng)
    return str(folder)


@dataclasses.dataclass
class EngineRun:
    """One engine run: ``steps[k]`` = the (request, tokens) pairs vLLM's ``schedule()`` returned
    at step k; ``first_token_step[i]`` = the step whose output carried request i's first token;
    ``tokens[i]`` = its generated tokens; wall times (s) for the record, never asserted."""

    scheduler: str
    steps: list[tuple[tuple[int, int], ...]]
    first_token_step: dict[int, int]
    tokens: dict[int, list[int]]
    build_s: float
    run_s: float


def run_engine(model_dir: str, engine_file) -> EngineRun:
    """Serve the burst with vLLM's ``LLMEngine`` configured by ``engine_file`` (an exported
    ``vllm serve --config`` file, parsed by vLLM's own parser) on the tiny model."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    args = dataclasses.replace(ex.check_with_vllm(engine_file.read_text()), model=model_dir, skip_tokenizer_init=True,
                               dtype="float32", enforce_eager=True, seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    build_s = time.perf_counter() - t0
    try:
        sched = engine.engine_core.engine_core.scheduler  # in-process engine core
        index: dict[str, int] = {}
        steps: list[tuple[tuple[int, int], ...]] = []
        schedule = sched.schedule

        def recording_schedule(*a, **kw):
            out = schedule(*a, **kw)
            steps.append(tuple(sorted((index[k], int(n)) for k, n in out.num_scheduled_tokens.items())))
            return out

        sched.schedule = recording_schedule
        t0 = time.perf_counter()
        arrival = time.time()  # one burst: every request arrives at once
        sp = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
        for i, n in enumerate(PROMPTS):
            index[engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt_ids(i, n)), sp,
                                     arrival_time=arrival)] = i
        first: dict[int, int] = {}
        tokens: dict[int, list[int]] = {}
        k = 0
        while engine.has_unfinished_requests():
            for o in engine.step():  # one schedule() and one model pass
                i = int(o.request_id)
                tokens[i] = list(o.outputs[0].token_ids)
                if tokens[i]:
                    first.setdefault(i, k)
            k += 1
        return EngineRun(type(sched).__name__, steps, first, tokens, build_s, time.perf_counter() - t0)
    finally:
        engine.engine_core.shutdown()


def simulate(policy: str, params: dict) -> tuple[list[tuple[tuple[int, int], ...]], dict[int, int]]:
    """kvsched's simulator on the same burst: its steps and each request's first-token step."""
    c = case(policy, params)
    side = parity.KvschedSide(c)
    for r in c.requests:
        side.add(r, 0.0)
    steps, first, done = [], {}, dict.fromkeys(range(len(PROMPTS)), 0)
    now = SIM_START_S
    while side.unfinished:
        view, end = side.step(now)
        steps.append(view.scheduled)
        for i, n in view.scheduled:
            done[i] += n
            if done[i] >= PROMPTS[i]:
                first.setdefault(i, len(steps) - 1)
        now = end if end is not None else now + 1e-3
    return steps, first


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, EngineRun]:
    """The burst served by vLLM's scheduler and by the two plugins (module docstring)."""
    import torch

    d = tmp_path_factory.mktemp("e2e")
    model = write_random_llama(d / "tiny-llama")
    environ = dict(os.environ)
    threads = torch.get_num_threads()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    out: dict[str, EngineRun] = {}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            mp.setattr(torch, "set_num_threads", torch.set_num_threads)  # vLLM's CPU worker replaces it
            for label, (policy, params) in RUNS.items():
                spec = case(policy, params).instance_spec()
                export = ex.export_vllm if policy == "fcfs" else ex.export_vllm_plugin
                f = d / f"{label}.yaml"
                f.write_text(export(policy, params, {}, spec, {"study": "e2e"}).text)
                out[label] = run_engine(model, f)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        from vllm import envs
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        envs.disable_envs_cache()  # an engine core caches vLLM's environment variables
        cleanup_dist_env_and_memory()
    return out


def test_engine_loads_the_scheduler_each_exported_file_names(runs):
    assert {k: r.scheduler for k, r in runs.items()} == {"fcfs": "Scheduler", "lars": "LARSScheduler",
                                                          "ewsjf": "EWSJFScheduler"}


def test_lars_plugin_gives_a_bursts_short_prompts_their_first_token_before_the_long_ones_fcfs_serves_first(runs):
    lars, fcfs = runs["lars"].first_token_step, runs["fcfs"].first_token_step
    assert max(lars[i] for i in SHORT) < min(lars[i] for i in LONG)
    assert fcfs[0] < min(fcfs[i] for i in SHORT)  # vLLM's FCFS: the first long prompt first
    assert all(lars[i] < fcfs[i] for i in SHORT)


def test_first_tokens_follow_larss_slack_order_of_the_burst(runs):
    """Ranked by kvsched's LARS at the engine's first step, each request's first token comes no
    later than that of any request ranked after it."""
    from kvsched.envs.sim.cost_model import CostModel
    from kvsched.envs.sim.features import FeatureTable
    from kvsched.envs.sim.policy_api import PolicyContext
    from kvsched.policies.base import make_policy

    c = case("lars", LARS_PARAMS)
    policy = make_policy("lars", LARS_PARAMS)
    policy.bind(PolicyContext(spec=c.instance_spec(), cost=CostModel(c.instance_spec()), instance_id=0))
    side = parity.KvschedSide(c)
    for r in c.requests:
        side.add(r, 0.0)
    states = [side.states[i] for i in range(len(PROMPTS))]
    rank = [int(i) for i in policy.order_prefills(FeatureTable(states, SIM_START_S))]
    assert set(rank[:len(SHORT)]) == SHORT  # the slack order puts the short prompts first
    first = runs["lars"].first_token_step
    steps = [first[i] for i in rank]
    assert steps == sorted(steps), (rank, first)


@pytest.mark.parametrize("label", list(RUNS))
def test_engine_schedules_the_burst_step_for_step_as_kvscheds_simulator(runs, label):
    steps, first = simulate(*RUNS[label])
    run = runs[label]
    assert run.first_token_step == first
    assert run.steps == steps


def test_every_request_completes_with_the_same_tokens_under_every_scheduler(runs):
    """The plugins change when requests run, not what they generate (greedy, one seed)."""
    for run in runs.values():
        assert sorted(run.tokens) == list(range(len(PROMPTS)))
        assert all(len(t) == OUTPUT_TOKENS for t in run.tokens.values())
    assert runs["lars"].tokens == runs["fcfs"].tokens == runs["ewsjf"].tokens
