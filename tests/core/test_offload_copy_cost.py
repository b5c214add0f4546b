"""vLLM's OffloadingConnector: which blocks it stores (``PrefixOffloadSpec.write_hbm_hits``) and what
its copies cost the engine (``copy_layout``, ``copy_fragment_s``; envs/sim/prefix_offload.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import MetricsConfig
from kvsched.envs.sim.prefix_offload import PER_LAYER_FRAGMENT_S, PrefixOffloadSpec
from kvsched.envs.sim.specs import InstanceSpec, get_gpu, get_model
from kvsched.envs.workload.inference_perf import LoadStage, SharedPrefixConfig, generate
from kvsched.runner.simulate import simulate

ONE_PROMPT = generate(SharedPrefixConfig(num_groups=1, users_per_group=1, system_prompt_len=0, question_len=1000,
                                         output_len=8, stages=(LoadStage(1.0, 1.0),)), seed=0)
# 12 distinct 1,000-token prompts, round robin, every prompt sent 4 times: HBM holds them all,
# a 300-block DRAM store (62 blocks a prompt) holds fewer than 5
ROUND_ROBIN = generate(SharedPrefixConfig(num_groups=12, users_per_group=1, system_prompt_len=0, question_len=1000,
                                          output_len=8, stages=(LoadStage(2.0, 24.0),)), seed=0)


def _spec(model: str = "Llama-3.1-8B", dram_blocks: int = 400, **offload) -> InstanceSpec:
    spec = InstanceSpec(get_model(model), get_gpu("H100-SXM"), max_model_len=4096)
    return spec.with_overrides(dram_kv_bytes=dram_blocks * spec.kv_bytes_per_block,
                               prefix_offload=PrefixOffloadSpec(("dram",), **offload))


def _run(workload, spec, fast_forward: bool = True):
    return simulate(workload, spec, "fcfs", MetricsConfig(), InstanceOptions(fast_forward=fast_forward))


def _dram(res) -> dict:
    return res.summary["prefix_tiers"]["tiers"]["dram"]


def test_a_store_delays_the_next_step_by_its_pieces_times_the_host_time_per_piece():
    """The prompt's blocks are stored after its prefill; with per-layer copies the engine submits
    2 x layers pieces a block (K and V of every layer) before the next forward pass."""
    t = 5e-6
    base = _run(ONE_PROMPT, _spec(copy_layout="per_layer"))
    slow = _run(ONE_PROMPT, _spec(copy_layout="per_layer", copy_fragment_s=t))
    blocks = _dram(slow)["bytes_written"] // slow_block_bytes()
    assert blocks == 62 and _dram(base)["bytes_written"] == _dram(slow)["bytes_written"]
    pieces = blocks * 2 * get_model("Llama-3.1-8B").n_layers
    delay_s = float(slow.records["finish_s"].iloc[0] - base.records["finish_s"].iloc[0])
    assert delay_s == pytest.approx(pieces * t, rel=1e-9)
    per_block = _run(ONE_PROMPT, _spec(copy_fragment_s=t))  # one piece a block
    assert float(per_block.records["finish_s"].iloc[0] - base.records["finish_s"].iloc[0]) == pytest.approx(
        blocks * t, rel=1e-9)


def slow_block_bytes() -> int:
    return int(round(_spec().kv_bytes_per_block))


def test_latent_attention_copies_one_piece_per_layer():
    """An MLA layer's cache is one tensor (no K/V split)."""
    model = "DeepSeek-V2-Lite"
    base = _run(ONE_PROMPT, _spec(model, copy_layout="per_layer"))
    slow = _run(ONE_PROMPT, _spec(model, copy_layout="per_layer", copy_fragment_s=1e-5))
    blocks = _dram(slow)["bytes_written"] // int(round(_spec(model).kv_bytes_per_block))
    delay_s = float(slow.records["finish_s"].iloc[0] - base.records["finish_s"].iloc[0])
    assert delay_s == pytest.approx(blocks * get_model(model).n_layers * 1e-5, rel=1e-9)


def test_no_host_time_no_change():
    """copy_fragment_s 0 (the default) is the model before the field: byte for byte."""
    a = _run(ROUND_ROBIN, _spec(dram_blocks=300))
    b = _run(ROUND_ROBIN, _spec(dram_blocks=300, copy_layout="per_layer", copy_fragment_s=0.0))
    assert a.records.equals(b.records)


def test_hbm_hits_the_cpu_store_lacks_are_stored_again_as_vllm_does():
    """Every prompt stays in HBM, so only its first send computes it; DRAM holds fewer than 5 of
    the 12 prompts and loses each before it returns. vLLM stores a request's HBM-hit blocks the
    CPU store lacks: every send writes its prompt. Without the field only the first sends do."""
    new_only = _dram(_run(ROUND_ROBIN, _spec(dram_blocks=300)))
    with_hits = _dram(_run(ROUND_ROBIN, _spec(dram_blocks=300, write_hbm_hits=True)))
    assert new_only["writes"] == 12
    assert with_hits["writes"] == len(ROUND_ROBIN) == 48
    # a store large enough for every prompt: the hits find them there and nothing is written twice
    assert _dram(_run(ROUND_ROBIN, _spec(dram_blocks=1000, write_hbm_hits=True)))["writes"] == 12


def test_re_stored_hits_under_per_layer_copies_slow_every_later_step():
    """The knob's direction on a workload whose prompts cycle through a small CPU store: the
    re-stores of HBM hits cost host time, so latency rises; with a store that keeps every prompt
    (or no copy cost) it does not."""
    def e2e_s(dram_blocks: int, t: float) -> float:
        spec = _spec(dram_blocks=dram_blocks, write_hbm_hits=True, copy_layout="per_layer", copy_fragment_s=t)
        r = _run(ROUND_ROBIN, spec).records
        return float((r["finish_s"] - r["arrival_s"]).mean())

    free, cycling, kept = e2e_s(300, 0.0), e2e_s(300, PER_LAYER_FRAGMENT_S), e2e_s(1000, PER_LAYER_FRAGMENT_S)
    assert cycling > 1.2 * free
    assert free < kept and (cycling - free) > 3 * (kept - free)  # kept: the 12 first stores only


def test_loads_wait_for_their_submission_too():
    """A returning prompt HBM lost loads from DRAM: the pieces of its load are submitted before
    the step that admits it, so its TTFT grows by at least their host time."""
    w = generate(SharedPrefixConfig(num_groups=30, users_per_group=1, system_prompt_len=0, question_len=1000,
                                    output_len=4, stages=(LoadStage(4.0, 15.0),)), seed=0)

    def run(t: float):
        spec = InstanceSpec(get_model("Llama-3.1-8B"), get_gpu("H100-SXM"), hbm_kv_blocks=900, max_model_len=4096)
        spec = spec.with_overrides(dram_kv_bytes=4000 * spec.kv_bytes_per_block,
                                   prefix_offload=PrefixOffloadSpec(("dram",), load_policy="always",
                                                                    copy_layout="per_layer", copy_fragment_s=t))
        return _run(w, spec)

    base, slow = run(0.0), run(2e-6)
    assert _dram(base)["loads"] > 0 and _dram(base)["loads"] == _dram(slow)["loads"]
    ttft = lambda r: (r.records["first_token_s"] - r.records["arrival_s"]).to_numpy()  # noqa: E731
    loaded = slow.records["bytes_dram_to_hbm"].to_numpy() > 0
    assert np.all(ttft(slow)[loaded] > ttft(base)[loaded])


def test_stepping_equals_fast_forward_with_copy_costs():
    """Copy costs turn fast-forward off (a stretch does not see the submissions): both option
    values give the same bytes."""
    spec = _spec(dram_blocks=300, write_hbm_hits=True, copy_layout="per_layer", copy_fragment_s=3e-6)
    a, b = _run(ROUND_ROBIN, spec, True), _run(ROUND_ROBIN, spec, False)
    assert a.records.equals(b.records) and a.summary == b.summary


def test_the_new_fields_stay_out_of_the_spec_at_their_defaults_and_round_trip_otherwise():
    assert set(PrefixOffloadSpec().to_dict()) == {"tiers", "write_policy", "write_threshold", "offload_prompt_only",
                                                  "eviction", "load_policy", "session_keep_s",
                                                  "fence_pending_writes"}
    spec = PrefixOffloadSpec(write_hbm_hits=True, copy_layout="per_layer", copy_fragment_s=PER_LAYER_FRAGMENT_S)
    assert PrefixOffloadSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("kw, field", [
    ({"copy_layout": "per_token"}, "copy_layout"),
    ({"copy_fragment_s": -1e-6}, "copy_fragment_s"),
    ({"copy_fragment_s": math.nan}, "copy_fragment_s"),
    ({"copy_fragment_s": math.inf}, "copy_fragment_s"),
    ({"copy_fragment_s": True}, "copy_fragment_s"),
    ({"copy_fragment_s": "6us"}, "copy_fragment_s"),
    ({"write_hbm_hits": "yes"}, "write_hbm_hits"),
    ({"write_hbm_hits": True, "write_policy": "write_back"}, "write_hbm_hits"),
])
def test_bad_copy_settings_are_named(kw, field):
    with pytest.raises(ConfigError, match=field):
        PrefixOffloadSpec(**kw)


def test_stores_an_idle_engine_submits_are_not_charged_to_a_request_arriving_long_after():
    """vLLM runs a step without a forward pass for pending connector work, so stores left when the
    engine goes idle are submitted then; a request 10 s later does not wait for them."""
    two = generate(SharedPrefixConfig(num_groups=2, users_per_group=1, system_prompt_len=0, question_len=1000,
                                      output_len=1, stages=(LoadStage(0.2, 10.0),)), seed=0)
    ttft = lambda r: (r.records["first_token_s"] - r.records["arrival_s"]).to_numpy()  # noqa: E731
    base = ttft(_run(two, _spec(copy_layout="per_layer")))
    slow = ttft(_run(two, _spec(copy_layout="per_layer", copy_fragment_s=PER_LAYER_FRAGMENT_S)))
    assert len(base) == 2 and np.allclose(slow, base)


def test_only_a_first_admission_without_a_load_stores_its_hbm_hits():
    """vLLM moves a loading request's store index past its hit and loaded chunks (CHUNK_LEVEL), and a
    preemption does not reset the index: only first admissions without a load store their HBM hits
    that the CPU store lacks."""
    from types import SimpleNamespace

    from kvsched.envs.sim.cost_model import CostModel
    from kvsched.envs.sim.kv_manager import KVManager

    spec = _spec(write_hbm_hits=True)

    def stored(admissions: int, loading: bool) -> int:
        tiers = KVManager(spec, CostModel(spec)).prefix_tiers
        tiers.now_s = 1.0
        tiers._admission_loads = loading
        tiers.on_hbm_hit(SimpleNamespace(rid=1, admissions=admissions), [11, 12, 13], 1, lambda h: 7)
        return len(tiers.stores[0].entries)

    assert stored(0, False) == 3
    assert stored(1, False) == 0  # a resumed request
    assert stored(0, True) == 0  # an admission that loads


def test_pipeline_stages_take_the_ceiling_of_their_share_of_the_layers_exactly():
    """58 layers over 4 stages hold 15 each at most: 58 x (15 / 58) is 15.000000000000002 in floats."""
    from kvsched.envs.sim.parallelism import ParallelSpec

    spec = _spec(copy_layout="per_layer", copy_fragment_s=1e-6)
    for layers, stages in ((58, 4), (29, 2), (87, 8)):
        model = dataclasses.replace(get_model("Llama-3.1-8B"), n_layers=layers)
        s = spec.with_overrides(model=model, parallel=ParallelSpec(pp_stages=stages))
        from kvsched.envs.sim.kv_manager import KVManager
        from kvsched.envs.sim.cost_model import CostModel

        tiers = KVManager(s, CostModel(s)).prefix_tiers
        assert tiers.fragments_per_block == 2 * -(-layers // stages)
