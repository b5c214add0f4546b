"""The roofline cost model (envs/sim/cost_model.py) against REFERENCE §5.3 and its own invariants,
and the hybrid GPU + PNM step of REFERENCE §3.2."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.specs import CostParams, InstanceSpec, LinkSpec, get_gpu, get_link, get_model, get_pnm

# REFERENCE §5.3 worked example: Llama-3.1-8B, 1xH100, bf16, MFU 0.55 (constant), MBU 0.75, no
# overheads. The reference rounds its intermediate numbers (16.06 GB weights, 15.0 GFLOP/token,
# F = 989e12), so we compare within +-5 %.
REF_COST = CostParams(mfu_max=0.55, mfu_half_tokens=0.0, mbu=0.75, step_overhead_s=0.0, allreduce_latency_s=0.0)
REF_TOL = 0.05


def _spec(model: str = "Llama-3.1-8B", gpu: str = "H100-SXM", **kw: object) -> InstanceSpec:
    return InstanceSpec(get_model(model), get_gpu(gpu), **kw)


@pytest.fixture(scope="module")
def ref() -> CostModel:
    return CostModel(_spec(cost=REF_COST))


def test_reference_inputs_match_section_5_3(ref: CostModel) -> None:
    # the numbers the worked example is built from
    assert ref.weight_bytes_per_gpu == pytest.approx(16.06e9, rel=1e-3)
    assert 2 * ref.matmul_params_per_gpu == pytest.approx(15.0e9, rel=5e-3)
    assert ref.attn_flops_per_pair_per_gpu == 524_288
    assert ref.kv_bytes_per_token_per_gpu == 131_072
    assert ref.peak_flops_per_s == 989e12


def test_decode_batch1_ctx1k_is_6_4_ms(ref: CostModel) -> None:
    t = ref.decode_step_time_s(1, 1024)
    assert t == pytest.approx(6.4e-3, rel=REF_TOL)
    assert ref.step_breakdown(1, 1024, 1024)["bound"] == "memory"


def test_decode_batch64_ctx2k_is_13_2_ms(ref: CostModel) -> None:
    t = ref.decode_step_time_s(64, 64 * 2048)
    assert t == pytest.approx(13.2e-3, rel=REF_TOL)


def test_prefill_2048_from_scratch_is_58_ms(ref: CostModel) -> None:
    assert ref.chunk_time_s(2048, 0) == pytest.approx(58e-3, rel=REF_TOL)
    assert ref.prefill_time_s(2048, 0, chunk_tokens=2048) == pytest.approx(58e-3, rel=REF_TOL)
    assert ref.step_breakdown(2048, 2048 * 1024, 2048)["bound"] == "compute"


def test_scalar_and_array_paths_are_bitwise_identical() -> None:
    cm = CostModel(_spec("Llama-3.1-70B", tp=4))  # default CostParams: MFU ramp, overhead, comm
    rng = np.random.default_rng(7)
    n = rng.integers(0, 9000, size=200).astype(np.float64)
    n[:5] = 0.0
    pairs = rng.uniform(0, 5e7, size=200)
    kv = rng.uniform(0, 2e5, size=200)
    arr = cm.step_time_s(n, pairs, kv)
    assert arr.shape == (200,)
    for i in range(200):
        s = cm.step_time_s(float(n[i]), float(pairs[i]), float(kv[i]))
        assert np.float64(s).tobytes() == arr[i].tobytes()
    c = rng.integers(0, 4096, size=50).astype(np.float64)
    p = rng.integers(0, 100_000, size=50).astype(np.float64)
    arr_c = cm.chunk_time_s(c, p)
    for i in range(50):
        assert np.float64(cm.chunk_time_s(float(c[i]), float(p[i]))).tobytes() == arr_c[i].tobytes()
    prompts = rng.integers(1, 50_000, size=30).astype(np.float64)
    cached = np.floor(prompts * rng.uniform(0, 1, size=30))
    arr_p = cm.prefill_time_s(prompts, cached, 512)
    for i in range(30):
        assert np.float64(cm.prefill_time_s(float(prompts[i]), float(cached[i]), 512)).tobytes() == arr_p[i].tobytes()


def test_idle_step_costs_nothing() -> None:
    cm = CostModel(_spec())
    assert cm.step_time_s(0, 0, 0) == 0.0
    assert cm.step_time_s(0, 10, 10) == 0.0
    assert cm.step_breakdown(0, 0, 0)["bound"] == "idle"
    assert cm.step_time_s(1, 0, 0) > cm.spec.cost.step_overhead_s


@pytest.mark.parametrize("arg", [0, 1, 2])
def test_step_time_is_monotone_in_each_argument(arg: int) -> None:
    # constant MFU (mfu_half_tokens=0): more of any argument never makes a step faster
    cm = CostModel(_spec("Llama-3.1-70B", tp=4, cost=CostParams(mfu_half_tokens=0.0)))
    base = np.array([256.0, 256.0 * 2000.0, 4000.0])
    grid = np.linspace(1.0, 1e7 if arg else 20000.0, 400)
    args = [np.full_like(grid, b) for b in base]
    args[arg] = grid
    t = cm.step_time_s(*args)
    assert np.all(np.diff(t) >= 0)
    assert t[-1] > t[0]  # and it does grow over the range


@pytest.mark.parametrize("arg", [1, 2])
def test_step_time_is_monotone_in_pairs_and_kv_with_mfu_ramp(arg: int) -> None:
    cm = CostModel(_spec("Llama-3.1-70B", tp=4))
    grid = np.linspace(0.0, 1e8, 400)
    args = [np.full_like(grid, 64.0), np.full_like(grid, 64.0 * 1000.0), np.full_like(grid, 64.0 * 1000.0)]
    args[arg] = grid
    t = cm.step_time_s(*args)
    assert np.all(np.diff(t) >= 0) and t[-1] > t[0]


def test_step_time_is_monotone_in_batch_size_with_mfu_ramp() -> None:
    # with the MFU ramp, raising n_tokens while holding attn_pairs fixed can lower the compute
    # term (documented); growing a batch of like requests adds their pairs too, and is monotone
    cm = CostModel(_spec("Llama-3.1-70B", tp=4))
    b = np.arange(1.0, 2000.0)
    for ctx in (0.0, 500.0, 32_000.0):
        assert np.all(np.diff(cm.decode_step_time_s(b, b * ctx)) >= 0)
    c = np.arange(1.0, 8192.0)
    assert np.all(np.diff(cm.chunk_time_s(c, 10_000.0)) >= 0)


def test_mfu_ramp_makes_small_steps_less_efficient() -> None:
    cm = CostModel(_spec(cost=CostParams(mfu_max=0.6, mfu_half_tokens=64.0, mbu=0.75, step_overhead_s=0.0)))
    b = cm.step_breakdown(64, 0, 0)
    flops = 2 * cm.matmul_params_per_gpu * 64
    # at n = c_half the MFU is half of mfu_max
    assert b["compute_s"] == pytest.approx(flops / (cm.peak_flops_per_s * 0.3), rel=1e-12)


def test_tp_allreduce_term() -> None:
    cm1 = CostModel(_spec("Llama-3.1-70B", gpu="B200", tp=1))
    assert cm1.step_breakdown(100, 1000, 1000)["comm_s"] == 0.0
    spec4 = _spec("Llama-3.1-70B", tp=4)
    cm4 = CostModel(spec4)
    m, g, c = spec4.model, spec4.gpu, spec4.cost
    link = g.nvlink_bytes_per_s * c.allreduce_bw_efficiency  # the calibrated H100 default is < 1
    assert c.allreduce_bw_efficiency < 1.0
    # ring: 2(tp-1)/tp of the payload per rank, a fixed latency and 2(tp-1) hops per all-reduce
    expected = 2 * m.n_layers * (2 * 3 / 4 * 100 * m.hidden_size * 2 / link + c.allreduce_latency_s
                                 + 2 * 3 * c.allreduce_hop_latency_s)
    comm = cm4.step_breakdown(100, 1000, 1000)["comm_s"]
    assert comm > 0
    assert comm == pytest.approx(expected, rel=1e-12)


def test_tp_splits_per_gpu_coefficients() -> None:
    s1, s4 = _spec("Llama-2-70B", gpu="B200", tp=1), _spec("Llama-2-70B", tp=4)
    c1, c4 = CostModel(s1), CostModel(s4)
    assert c4.matmul_params_per_gpu == pytest.approx(c1.matmul_params_per_gpu / 4)
    assert c4.attn_flops_per_pair_per_gpu == pytest.approx(c1.attn_flops_per_pair_per_gpu / 4)
    assert c4.kv_bytes_per_token_per_gpu == pytest.approx(c1.kv_bytes_per_token_per_gpu / 4)


def test_fp8_kv_halves_kv_bytes_and_memory_time() -> None:
    cost = CostParams(step_overhead_s=0.0)
    bf16 = CostModel(_spec(cost=cost))
    fp8 = CostModel(_spec(kv_dtype="fp8", cost=cost))
    assert fp8.kv_bytes_per_token_per_gpu == bf16.kv_bytes_per_token_per_gpu / 2
    assert fp8.transfer_bytes(10) == bf16.transfer_bytes(10) / 2
    ctx = 1_000_000.0
    kv_part_bf16 = bf16.step_breakdown(1, ctx, ctx)["hbm_bytes"] - bf16.weight_bytes_per_gpu
    kv_part_fp8 = fp8.step_breakdown(1, ctx, ctx)["hbm_bytes"] - fp8.weight_bytes_per_gpu
    assert kv_part_fp8 == pytest.approx(kv_part_bf16 / 2)


def test_fp8_weights_use_fp8_peak() -> None:
    cm = CostModel(_spec(weight_dtype="fp8"))
    assert cm.peak_flops_per_s == get_gpu("H100-SXM").fp8_flops_per_s
    assert cm.weight_bytes_per_gpu == pytest.approx(get_model("Llama-3.1-8B").n_params)


def test_transfer_time_formula() -> None:
    spec = _spec("Llama-3.1-70B", tp=4)
    cm = CostModel(spec)
    link = get_link("pcie5")
    per_gpu = 327_680 * 16 / 4  # bytes of one block on one of 4 ranks
    assert spec.kv_bytes_per_block_per_gpu == per_gpu
    assert cm.transfer_time_s(100, link) == pytest.approx(10e-6 + 100 * per_gpu / 50e9, rel=1e-12)
    arr = cm.transfer_time_s(np.array([0, 1, 100]), link)
    assert arr[0] == 0.0
    assert arr[2] == pytest.approx(10e-6 + 100 * per_gpu / 50e9, rel=1e-12)
    slow = LinkSpec("slow", 1e9, 1e-3)
    assert cm.transfer_time_s(3, slow) == pytest.approx(1e-3 + 3 * per_gpu / 1e9, rel=1e-12)
    assert cm.transfer_bytes(100) == 100 * 327_680 * 16


def test_prefill_time_is_sum_of_hand_computed_chunks() -> None:
    cm = CostModel(_spec())  # default CostParams: MFU ramp and overhead matter here
    # prompt 5000 with 600 cached, chunks of 2048: (2048 after 600), (2048 after 2648), (304 after 4696)
    by_hand = cm.chunk_time_s(2048, 600) + cm.chunk_time_s(2048, 2648) + cm.chunk_time_s(304, 4696)
    assert cm.prefill_time_s(5000, 600, chunk_tokens=2048) == pytest.approx(by_hand, rel=1e-12)
    # the chunks are not all equal, so a wrong split would show
    assert cm.chunk_time_s(304, 4696) < cm.chunk_time_s(2048, 2648)
    # default chunk = token budget (8192 on H100): one chunk
    assert cm.prefill_time_s(5000, 600) == pytest.approx(cm.chunk_time_s(4400, 600), rel=1e-12)
    assert cm.prefill_time_s(5000, 5000) == 0.0


def test_prefill_time_vectorised_over_requests() -> None:
    cm = CostModel(_spec())
    prompts = np.array([5000.0, 100.0, 0.0, 4096.0])
    cached = np.array([600.0, 50.0, 0.0, 0.0])
    out = cm.prefill_time_s(prompts, cached, 2048)
    assert out.shape == (4,)
    expected = [cm.prefill_time_s(p, c, 2048) for p, c in zip(prompts, cached)]
    np.testing.assert_array_equal(out, expected)
    assert out[2] == 0.0
    assert out[3] == pytest.approx(cm.chunk_time_s(2048, 0) + cm.chunk_time_s(2048, 2048), rel=1e-12)


def test_bad_inputs_raise() -> None:
    cm = CostModel(_spec())
    with pytest.raises(ValueError, match="n_tokens"):
        cm.step_time_s(-1, 0, 0)
    with pytest.raises(ValueError, match="kv_tokens"):
        cm.step_time_s(1, 0, np.nan)
    with pytest.raises(ValueError, match="cached_tokens"):
        cm.prefill_time_s(10, 20)
    with pytest.raises(ValueError, match="chunk_tokens"):
        cm.prefill_time_s(10, 0, chunk_tokens=0)


def test_idle_hbm_bytes_is_unused_bandwidth() -> None:
    cm = CostModel(_spec(cost=REF_COST))
    b = cm.step_breakdown(2048, 2048 * 1024, 2048)  # compute-bound prefill leaves HBM idle
    assert b["idle_hbm_bytes"] == pytest.approx(b["step_s"] * cm.hbm_bytes_per_s - b["hbm_bytes"])
    assert b["idle_hbm_bytes"] > 0.5 * b["step_s"] * cm.hbm_bytes_per_s


def test_fast_scalar_and_array_paths_are_bitwise_equal_to_step_time_s():
    """The simulator's fast paths must equal step_time_s bit for bit (fast-forward relies on it)."""
    from kvsched.envs.sim.cost_model import CostModel
    from kvsched.envs.sim.specs import InstanceSpec, get_gpu, get_model

    rng = np.random.default_rng(7)
    for tp, model in ((1, "Llama-3.1-8B"), (4, "Llama-3.1-70B")):
        cm = CostModel(InstanceSpec(model=get_model(model), gpu=get_gpu("H100-SXM"), tp=tp))
        n = rng.integers(1, 8192, 500).astype(float)
        pairs = rng.integers(0, 10**9, 500) / 2.0
        kv = rng.integers(0, 10**6, 500).astype(float)
        ref = cm.step_time_s(n, pairs, kv)
        fast = np.array([cm.step_time_fast(a, b, c) for a, b, c in zip(n, pairs, kv)])
        assert np.array_equal(ref, fast)
        assert np.array_equal(ref, cm.step_times_fast(n, pairs, kv))
        assert cm.step_time_fast(0.0, 0.0, 0.0) == 0.0
        # decode-only steps (pairs = kv = context tokens), as fast-forwarded stretches time them
        for b in (1, 40, 256):
            ctx = rng.integers(0, 10**7, 300).astype(float)
            ref = cm.step_time_s(np.full(300, float(b)), ctx, ctx, n_seqs=float(b))  # b sequences
            assert np.array_equal(ref, cm.decode_step_times_fast(b, ctx))
            assert np.array_equal(ref, [cm.step_time_fast(float(b), c, c, float(b)) for c in ctx])
        # a stretch's step ends, timed in one loop: the same sums as adding step_time_fast one by one
        for b, c0, start in ((1, 0, 0.0), (37, 123_457, 12.345678), (256, 9_999_991, 1e5 / 3)):
            e, ref_ends = start, []
            for j in range(40):
                e += cm.step_time_fast(float(b), float(c0 + b * j), float(c0 + b * j), float(b))
                ref_ends.append(e)
            assert cm.decode_step_ends(start, b, c0, 40) == ref_ends
            cut = cm.decode_step_ends(start, b, c0, 40, horizon_s=ref_ends[16])
            assert cut == ref_ends[:17]  # stops after the step ending at the horizon
            assert cm.decode_step_ends(start, b, c0, 40, horizon_s=(ref_ends[16] + ref_ends[17]) / 2) \
                == ref_ends[:18]


# ------------------------------------------------------------------ the hybrid GPU + PNM step
MODEL = get_model("Llama-3.1-8B")


def spec(**kw) -> InstanceSpec:
    kw.setdefault("cost", CostParams())  # literature cost parameters
    return InstanceSpec(model=MODEL, gpu=get_gpu("H100-SXM"), **kw)


def test_hybrid_step_time_matches_reference_formula_by_hand():
    """REFERENCE §3.2: t = max(GPU part without PNM attention, PNM attention) + overhead
    + 2 t_rpc + q/k/v/o activations over the link; computed here from the raw numbers."""
    sp = spec(pnm=get_pnm("cxl-pnm-ocp2025"))
    cm = CostModel(sp)
    c = sp.cost
    n, pairs, kv, ctx_pnm, n_pnm = 40.0, 30 * 1500.0, 30 * 1500.0, 100_000.0, 10.0
    flops = 2 * MODEL.matmul_params * n + 4 * 32 * 32 * 128 * pairs
    compute = flops / (989e12 * c.mfu_max * n / (n + c.mfu_half_tokens))
    memory = (sp.weight_bytes_per_gpu + 131072 * kv) / (3.35e12 * c.mbu)
    pnm_attn = max(131072 * ctx_pnm / (200e9 * 0.7), 4 * 32 * 32 * 128 * ctx_pnm / 2e12)
    serial = 2 * 10e-6 + n_pnm * 4 * 32 * 32 * 128 * 2 / 50e9
    want = max(compute, memory, pnm_attn) + c.step_overhead_s + serial
    got = cm.pnm_step_time_fast(n, pairs, kv, ctx_pnm, n_pnm)
    assert got == pytest.approx(want, rel=1e-12)
    assert pnm_attn > max(compute, memory)  # one 200 GB/s card: the PNM side bounds this step
    assert cm.pnm_attention_time_s(ctx_pnm) == pytest.approx(pnm_attn, rel=1e-12)
    # the array form is bitwise equal (fast-forward identity relies on it)
    arr = cm.pnm_step_times_fast(*(np.array([v, v + 1]) for v in (n, pairs, kv, ctx_pnm, n_pnm)))
    assert arr[0] == got and arr[1] == cm.pnm_step_time_fast(n + 1, pairs + 1, kv + 1, ctx_pnm + 1, n_pnm + 1)
    # ten cards: the same batch is GPU-bound again, and cheaper than reading that KV from HBM
    cm10 = CostModel(spec(pnm=get_pnm("cxl-pnm-ocp2025-x10")))
    assert cm10.pnm_step_time_fast(n, pairs, kv, ctx_pnm, n_pnm) < got
    with pytest.raises(ValueError, match="no PNM tier"):
        CostModel(spec()).pnm_attention_time_s(1.0)


HOST = CostParams(seq_overhead_s=17e-6, step_token_overhead_s=0.3e-6, allreduce_hop_latency_s=4e-6)


def test_host_overheads_add_per_sequence_and_per_token_and_default_to_nothing() -> None:
    base = CostModel(_spec("Llama-3.1-8B", cost=CostParams()))
    host = CostModel(_spec("Llama-3.1-8B", cost=HOST))
    # 96 decodes + one 512-token prefill chunk: 97 sequences, 608 tokens
    n, pairs, kv = 608.0, 96 * 1000.0 + 512 * 256.0, 96 * 1000.0 + 512.0
    extra = host.step_time_s(n, pairs, kv, 97) - base.step_time_s(n, pairs, kv, 97)
    assert extra == pytest.approx(97 * 17e-6 + 608 * 0.3e-6, rel=1e-9)
    assert base.step_time_s(n, pairs, kv, 97) == base.step_time_s(n, pairs, kv, 1)  # neutral default
    assert host.step_breakdown(n, pairs, kv, 97)["host_s"] == pytest.approx(extra, rel=1e-9)
    # a decode step counts each decode as a sequence
    d = host.decode_step_time_s(64, 64_000) - base.decode_step_time_s(64, 64_000)
    assert d == pytest.approx(64 * (17e-6 + 0.3e-6), rel=1e-9)


def test_fast_paths_stay_bitwise_equal_with_host_overheads() -> None:
    cm = CostModel(_spec("Llama-3.1-70B", tp=4, cost=HOST))
    n, ctx0, k = 40, 40 * 700, 6
    ends = cm.decode_step_ends(1.0, n, ctx0, k)
    e, manual = 1.0, []
    for j in range(k):
        c = float(ctx0 + j * n)
        e += cm.step_time_fast(float(n), c, c, float(n))
        manual.append(e)
    assert ends == manual
    ctx = np.array([float(ctx0 + j * n) for j in range(k)])
    arr = cm.decode_step_times_fast(float(n), ctx)
    assert list(arr) == [cm.step_time_fast(float(n), c, c, float(n)) for c in ctx]
    assert list(cm.step_times_fast(np.full(k, float(n)), ctx, ctx, float(n))) == list(arr)


def test_ring_allreduce_latency_grows_with_the_ring_steps() -> None:
    """α-β ring: 2(tp-1) hops each pay allreduce_hop_latency_s, two all-reduces per layer."""
    m = get_model("Llama-3.1-70B")
    cost = CostParams(allreduce_bw_efficiency=1.0, allreduce_latency_s=0.0, allreduce_hop_latency_s=4e-6)
    comm = {tp: CostModel(_spec("Llama-3.1-70B", tp=tp, cost=cost)).step_breakdown(1, 1000, 1000)["comm_s"]
            for tp in (2, 4, 8)}
    g = get_gpu("H100-SXM")
    for tp, v in comm.items():
        ring = 2 * (tp - 1) / tp
        expected = 2 * m.n_layers * (ring * m.hidden_size * 2 / g.nvlink_bytes_per_s + 2 * (tp - 1) * 4e-6)
        assert v == pytest.approx(expected, rel=1e-12)
    assert comm[2] < comm[4] < comm[8]
