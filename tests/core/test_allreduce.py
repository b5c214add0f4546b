"""The TP all-reduce price (envs/sim/allreduce.py): the ring, and vLLM's choice of one-shot /
two-shot custom all-reduce or NCCL by message size (``CostParams.allreduce_algorithm``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsched.envs.sim.allreduce import CUSTOM_ALLREDUCE_MAX_BYTES, vllm_allreduce_kernel
from kvsched.envs.sim.calibration import CalibrationFile
from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.parallelism import ParallelSpec
from kvsched.envs.sim.spec_io import instance_spec_from_dict
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model, get_pnm

KIB, MIB = 1024, 1024 * 1024
#: the shape of the H100 calibration (version 2): no per-call latency, a hop latency, a low link share
CAL = CostParams(allreduce_latency_s=0.0, allreduce_hop_latency_s=2.3e-6, allreduce_bw_efficiency=0.23,
                 seq_overhead_s=3.4e-6)
VLLM = dataclasses.replace(CAL, allreduce_algorithm="vllm")


def _cm(model: str, tp: int, cost: CostParams, **kw: object) -> CostModel:
    return CostModel(InstanceSpec(get_model(model), get_gpu("H100-SXM"), tp=tp, cost=cost, **kw))


# csrc/custom_all_reduce.cuh, CustomAllreduce::allreduce (REDUCE_CASE): TP2 always one-shot; with full
# NVLink one-shot when (ws <= 4 && bytes < 512 KiB) || (ws <= 8 && bytes < 256 KiB), else two-shot;
# custom_all_reduce.py: should_custom_ar takes inp_size < max_size (8 MiB) at world sizes 2, 4, 6, 8
@pytest.mark.parametrize("tp, nbytes, kernel", [
    (1, 1 * MIB, "none"),
    (2, 16, "one_shot"), (2, 8 * MIB - 16, "one_shot"), (2, 8 * MIB, "ring"),
    (4, 512 * KIB - 16, "one_shot"), (4, 512 * KIB, "two_shot"), (4, 8 * MIB - 16, "two_shot"), (4, 8 * MIB, "ring"),
    (6, 256 * KIB - 16, "one_shot"), (6, 256 * KIB, "two_shot"),
    (8, 256 * KIB - 16, "one_shot"), (8, 256 * KIB, "two_shot"), (8, 8 * MIB, "ring"),
    (3, 16, "ring"), (16, 16, "ring"),  # no custom all-reduce at these world sizes
])
def test_vllm_kernel_choice_follows_the_custom_all_reduce_thresholds(tp: int, nbytes: int, kernel: str) -> None:
    assert CUSTOM_ALLREDUCE_MAX_BYTES == 8 * MIB
    assert vllm_allreduce_kernel(tp, nbytes) == kernel


def test_vllm_step_comm_is_the_chosen_kernels_alpha_beta_price() -> None:
    # Llama-3.1-70B: 80 layers, hidden 8192 -> 16 KiB per token per all-reduce; TP4 one-shot below
    # 32 tokens (512 KiB), two-shot below 512 tokens (8 MiB), the ring above
    cm = _cm("Llama-3.1-70B", 4, VLLM)
    link = get_gpu("H100-SXM").nvlink_bytes_per_s * 0.23
    hop, n_ar, per_token = 2.3e-6, 160, 8192 * 2.0

    def comm(n: float) -> float:
        return float(cm.step_breakdown(n, n, n)["comm_s"])

    assert comm(31) == pytest.approx(n_ar * (hop + 3 * 31 * per_token / link), rel=1e-12)
    assert comm(300) == pytest.approx(n_ar * (2 * hop + 1.5 * 300 * per_token / link), rel=1e-12)
    assert comm(600) == pytest.approx(n_ar * (6 * hop + 1.5 * 600 * per_token / link), rel=1e-12)
    # just past the one-shot limit the two-shot's α-β price is lower: floored at the one-shot's (documented)
    assert comm(32) == pytest.approx(n_ar * (hop + 3 * 32 * per_token / link), rel=1e-12)


def test_tp1_all_reduce_costs_nothing_under_either_algorithm() -> None:
    for cost in (CAL, VLLM):
        assert _cm("Llama-3.1-8B", 1, cost).step_breakdown(100, 1000, 1000)["comm_s"] == 0.0


# step_time_s of main before allreduce_algorithm existed (commit 1406509), same CostParams: the
# default "ring" must give these bytes
RING_GOLDEN = [
    ("Llama-3.1-70B", 4, False, ["0x1.1bc6d2b965d18p-6", "0x1.462255d714752p-6", "0x1.26eb213063285p-4"]),
    ("Llama-3.1-70B", 8, False, ["0x1.b1db6ea328380p-7", "0x1.01096df3f6104p-6", "0x1.e9ebf4664a744p-5"]),
    ("Llama-3.1-8B", 2, False, ["0x1.281bd8ceb3082p-8", "0x1.698cba7895821p-8", "0x1.5a3e4b9103b9ap-6"]),
    ("Mixtral-8x7B", 2, True, ["0x1.a69b7913a3276p-8", "0x1.56915f2252270p-6", "0x1.2b369ef34328fp-5"]),
]


@pytest.mark.parametrize("model, tp, ep, golden", RING_GOLDEN, ids=lambda v: str(v))
def test_the_default_ring_reproduces_the_step_times_from_before_the_option(model, tp, ep, golden) -> None:
    assert CostParams().allreduce_algorithm == "ring"
    cm = _cm(model, tp, CAL, expert_parallel=ep)
    got = [float(cm.step_time_s(n, n * 700.0, n * 700.0, n)).hex() for n in (1.0, 37.0, 600.0)]
    assert got == golden


def test_at_tp8_vllm_charges_less_than_the_ring_for_small_all_reduces() -> None:
    ring, vllm = _cm("Llama-3.1-70B", 8, CAL), _cm("Llama-3.1-70B", 8, VLLM)
    for n in (1.0, 8.0, 15.0, 64.0, 256.0):  # one-shot and two-shot sizes (16 KiB/token, 8 MiB = 512 tokens)
        assert vllm.step_breakdown(n, n, n)["comm_s"] < ring.step_breakdown(n, n, n)["comm_s"]
    # above 8 MiB vLLM hands over to NCCL: the ring's price
    assert vllm.step_breakdown(2048, 1, 1)["comm_s"] == ring.step_breakdown(2048, 1, 1)["comm_s"]


@pytest.mark.parametrize("model, tp, ep", [("Llama-3.1-70B", 2, False), ("Llama-3.1-70B", 4, False),
                                           ("Llama-3.1-70B", 8, False), ("Llama-3.1-8B", 8, False),
                                           ("Mixtral-8x7B", 4, True)])
def test_vllm_step_time_is_non_decreasing_in_tokens_across_the_kernel_switches(model, tp, ep) -> None:
    for cost in (VLLM, dataclasses.replace(VLLM, allreduce_latency_s=10e-6, allreduce_bw_efficiency=1.0)):
        cm = _cm(model, tp, dataclasses.replace(cost, mfu_half_tokens=0.0), expert_parallel=ep)
        n = np.arange(1.0, 1200.0)
        assert np.all(np.diff(cm.step_time_s(n, n * 500.0, n * 500.0)) >= 0)
        assert np.all(np.diff(cm.step_breakdown(n, n, n)["comm_s"]) >= 0)


@pytest.mark.parametrize("model, tp, ep", [("Llama-3.1-70B", 4, False), ("Llama-3.1-70B", 8, False),
                                           ("Llama-3.1-8B", 2, False), ("Mixtral-8x7B", 4, True)])
def test_vllm_scalar_and_batched_paths_are_bitwise_equal(model, tp, ep) -> None:
    cm = _cm(model, tp, VLLM, expert_parallel=ep)
    rng = np.random.default_rng(3)
    n = np.concatenate([np.arange(1.0, 70.0), rng.integers(70, 9000, size=60).astype(np.float64)])
    pairs, kv = n * rng.uniform(10, 3000, size=n.size), n * 900.0
    arr = cm.step_time_s(n, pairs, kv)
    fast = cm.step_times_fast(n, pairs, kv)
    for i in range(n.size):
        one = cm.step_time_fast(float(n[i]), float(pairs[i]), float(kv[i]))
        assert np.float64(one).tobytes() == arr[i].tobytes() == fast[i].tobytes()
    ctx = np.array([1000.0, 5000.0, 40000.0])
    for b in (1.0, 16.0, 33.0, 600.0):
        dec = cm.decode_step_times_fast(b, ctx)
        assert dec.tobytes() == cm.step_times_fast(np.full(3, b), ctx, ctx, b).tobytes()
        ends = cm.decode_step_ends(0.0, int(b), 1000, 3)
        assert ends[0] == float(cm.step_time_fast(b, 1000.0, 1000.0, b))


def test_vllm_prices_pnm_and_pipeline_steps_with_the_same_pieces() -> None:
    pnm = _cm("Llama-3.1-70B", 4, VLLM, pnm=get_pnm("cxl-pnm-ocp2025"))
    n = np.array([10.0, 40.0, 700.0])
    arr = pnm.pnm_step_times_fast(n, n * 100.0, n * 100.0, n * 50.0, n)
    for i in range(3):
        x = float(n[i])
        assert np.float64(pnm.pnm_step_time_fast(x, x * 100.0, x * 100.0, x * 50.0, x)).tobytes() == arr[i].tobytes()
    pp = _cm("Llama-3.1-70B", 4, VLLM, parallel=ParallelSpec(pp_stages=2))
    ring_pp = _cm("Llama-3.1-70B", 4, CAL, parallel=ParallelSpec(pp_stages=2))
    assert pp.parallel is not None and ring_pp.parallel is not None
    for x in (8.0, 100.0):  # a stage's all-reduces are vLLM's too: cheaper than the ring at these sizes
        assert pp.parallel.stage_time(x, x, x) < ring_pp.parallel.stage_time(x, x, x)
        assert np.float64(pp.parallel.stage_time(x, x, x)).tobytes() == pp.parallel.stage_time(
            np.array([x]), np.array([x]), np.array([x]))[0].tobytes()


@pytest.mark.parametrize("value", ["tree", "", "RING", 3])
def test_a_bad_allreduce_algorithm_is_a_one_line_error_naming_field_value_and_choices(value) -> None:
    with pytest.raises(ConfigError) as e:
        CostParams(allreduce_algorithm=value)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "\n" not in msg and "allreduce_algorithm" in msg and repr(value) in msg and "ring, vllm" in msg


def test_allreduce_algorithm_is_read_from_spec_dicts_and_calibration_files() -> None:
    spec = instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "tp": 2,
                                    "cost": {"allreduce_algorithm": "vllm"}})
    assert spec.cost_params.allreduce_algorithm == "vllm"
    with pytest.raises(ConfigError, match="allreduce_algorithm"):
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "cost": {"allreduce_algorithm": 1.0}})
    cal = CalibrationFile(gpu="H100-SXM", version=3, cost=VLLM, fitted=("mbu",))
    assert CalibrationFile.from_dict(cal.to_dict()).cost == VLLM
    bad = cal.to_dict()
    bad["cost_params"]["allreduce_algorithm"] = "tree"
    with pytest.raises(ConfigError, match="allreduce_algorithm='tree'"):
        CalibrationFile.from_dict(bad)
