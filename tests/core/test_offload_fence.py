"""vLLM's OffloadingConnector fences block reuse behind pending stores
(``PrefixOffloadSpec.fence_pending_writes``, envs/sim/prefix_offload.py): a step whose allocations
evict a segment whose write to DRAM has not landed starts when the write lands."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import MetricsConfig
from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
from kvsched.envs.sim.specs import InstanceSpec, LinkSpec, get_gpu, get_model
from kvsched.envs.workload.inference_perf import LoadStage, SharedPrefixConfig, generate
from kvsched.runner.simulate import simulate

# 40 distinct 1,000-token prompts at 8 req/s through 1,200 HBM blocks: HBM turns over every ~2.4 s
WORKLOAD = generate(SharedPrefixConfig(num_groups=40, users_per_group=1, system_prompt_len=0, question_len=1000,
                                       output_len=16, stages=(LoadStage(8.0, 8.0),)), seed=0)


def _ttft_ms(link_bytes_per_s: float, fence: bool | None) -> np.ndarray:
    spec = InstanceSpec(get_model("Llama-3.1-8B"), get_gpu("H100-SXM"), max_num_seqs=64, hbm_kv_blocks=1200,
                        pcie=LinkSpec("pcie-test", link_bytes_per_s, 10e-6), max_model_len=2048)
    if fence is not None:
        spec = spec.with_overrides(dram_kv_bytes=400 * spec.kv_bytes_per_block,
                                   prefix_offload=PrefixOffloadSpec(("dram",), load_policy="always",
                                                                    fence_pending_writes=fence))
    r = simulate(WORKLOAD, spec, "fcfs", MetricsConfig(), InstanceOptions()).records
    return (r["first_token_s"] - r["arrival_s"]).to_numpy() * 1e3


def test_stores_slower_than_cache_turnover_delay_steps_only_with_the_fence():
    # 2 MiB blocks, ~63 per prompt: 8 req/s write ~1 GB/s, more than a 0.5 GB/s link carries
    none, unfenced, fenced = _ttft_ms(0.5e9, None), _ttft_ms(0.5e9, False), _ttft_ms(0.5e9, True)
    assert np.array_equal(none, unfenced)  # asynchronous writes alone never delay a step
    assert np.percentile(fenced, 99) > 2 * np.percentile(none, 99)


def test_stores_that_land_before_their_blocks_are_reused_cost_nothing():
    assert np.array_equal(_ttft_ms(50e9, True), _ttft_ms(50e9, None))  # a PCIe 5 link keeps up


def test_the_fence_is_only_for_write_through():
    with pytest.raises(ConfigError, match="fence_pending_writes"):
        PrefixOffloadSpec(("dram",), write_policy="write_back", fence_pending_writes=True)


def test_fast_forward_equals_stepping_with_the_fence_and_host_overheads():
    """The decode stretches time steps with the per-sequence and per-token host terms as single
    steps do, and never evict behind a pending write."""
    from simkit import assert_identical, growing_sessions, make_spec, run

    from kvsched.envs.sim.specs import CostParams

    spec = make_spec(hbm_kv_blocks=260, max_num_batched_tokens=512, dram_kv_bytes=60 * 16 * 131072,
                     pcie=LinkSpec("pcie-slow", 1e9, 10e-6),
                     prefix_offload=PrefixOffloadSpec(fence_pending_writes=True),
                     cost=CostParams(seq_overhead_s=17e-6, step_token_overhead_s=0.3e-6))
    w = growing_sessions(7, n=60)
    assert_identical(run(w, spec, fast_forward=True), run(w, spec, fast_forward=False))
