"""Configuration knobs move the prediction the way vLLM's mechanisms do (issue #22 item 2):
``gpu_memory_utilization`` sets the KV capacity as vLLM's memory profile does, and so preemption."""

from __future__ import annotations

import math

from kvsched.envs.sim.hardware import GiB
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import MetricsConfig
from kvsched.envs.sim.specs import InstanceSpec, get_gpu, get_model
from kvsched.envs.workload.inference_perf import LoadStage, SharedPrefixConfig, generate
from kvsched.runner.simulate import simulate


def _spec(util: float) -> InstanceSpec:
    return InstanceSpec(get_model("Llama-2-7B"), get_gpu("L40S"), gpu_memory_utilization=util, max_num_seqs=128,
                        max_model_len=2048)


def test_kv_capacity_is_the_utilised_memory_left_after_weights_and_activations_in_blocks():
    """vllm/v1/worker/gpu_worker.py: requested = util x device memory; KV = requested - weights -
    peak activations - non-torch memory (kvsched: activation_reserve_bytes), in whole blocks."""
    for util in (0.9, 0.95):
        s = _spec(util)
        free = util * s.gpu.hbm_bytes - s.weight_bytes_per_gpu - s.activation_reserve_bytes
        assert s.num_hbm_blocks == math.floor(free / s.kv_bytes_per_block_per_gpu)
    gained = _spec(0.95).num_hbm_blocks - _spec(0.9).num_hbm_blocks
    assert abs(gained - 0.05 * _spec(0.9).gpu.hbm_bytes / _spec(0.9).kv_bytes_per_block_per_gpu) <= 1
    assert _spec(0.9).activation_reserve_bytes == 1.5 * GiB


def test_a_higher_memory_utilisation_preempts_less_under_kv_pressure():
    # 80 requests of 600 + 400 tokens within 2 s: ~80k tokens of KV wanted, ~54k / ~58k held
    wl = generate(SharedPrefixConfig(num_groups=80, users_per_group=1, system_prompt_len=0, question_len=600,
                                     output_len=400, stages=(LoadStage(40.0, 2.0),)), seed=0)
    preempted = {u: int(simulate(wl, _spec(u), "fcfs", MetricsConfig(), InstanceOptions()).records["preemptions"].sum())
                 for u in (0.9, 0.95)}
    assert 0 < preempted[0.95] < preempted[0.9]
