"""Parallel sampling, n > 1 (issue #21 item 4): vLLM V1 fans a request with ``SamplingParams.n > 1``
out into n child requests with the same prompt (``vllm/v1/engine/parallel_sampling.py``
``ParentRequest``), whose full prompt blocks the prefix cache shares (``allocate_slots`` caches
them when scheduled, so a child admitted in the same step hits them). These tests protect: the
prompt's blocks are held once by the n children; n = 1 (given or not) changes nothing; the
children are routed together; bad n values are refused naming the field; ``n`` is carried
through every workload transformation and read from traces with one-line errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from simkit import NO_FRONT_END, assert_identical, make_spec, run

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError, TraceFormatError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.invariants import check_instance
from kvsched.envs.sim.request import N_MAX, NO_PARENT, Request, Workload
from kvsched.envs.workload import synthetic as syn
from kvsched.envs.workload import traces as tr
from kvsched.policies.base import make_policy

SEG = 32  # tokens per prefix hash: 2 blocks of 16 tokens
PROMPT = 300  # 9 full segments (288 tokens, 18 blocks) + 12 tokens in a partial block


def _one(n: int, prompt: int = PROMPT, output: int = 20) -> Workload:
    hashes = tuple(range(1, prompt // SEG + 1))
    return Workload.from_requests([Request(0, 0.0, prompt, output, prefix_hashes=hashes, hash_block_tokens=SEG,
                                           n=n)])


def _run_until(c: Cluster, done) -> None:
    """Advance ``c`` 5 ms of simulated time at a time until ``done()`` (at most 10 s)."""
    t = 0.0
    while not done():
        t += 0.005
        assert t < 10.0 and c.run_until_decision(until_s=t) is not None


def _cluster(specs, check=True, router=None) -> Cluster:
    return Cluster(specs, lambda: make_policy("fcfs"), router=router,
                   options=InstanceOptions(check_invariants=check, fast_forward=False))


# ---------------------------------------------------------------------------- block sharing
@pytest.mark.parametrize("budget", [2048, 128])  # the whole prompt in one step / chunked over several
def test_n4_sampling_uses_the_prompts_blocks_once(budget):
    c = _cluster([make_spec(cost=NO_FRONT_END, max_num_batched_tokens=budget)])
    c.start(_one(4))
    inst = c.instances[0]
    # run until every child decodes (all four hold their whole prompt)
    _run_until(c, lambda: len(inst.running) == 4 and all(s.generated >= 2 for s in inst.running))
    check_instance(inst)
    prompt_blocks = (PROMPT // SEG) * SEG // 16  # 18 full prompt blocks, shared
    per_child = [s.private_blocks for s in inst.running]
    assert [s.shared_blocks for s in inst.running] == [prompt_blocks] * 4
    assert inst.kv.used_blocks()[0] == prompt_blocks + sum(per_child)
    assert all(p == -(-(PROMPT + s.generated) // 16) - prompt_blocks for p, s in zip(per_child, inst.running))
    assert len(inst.kv.hbm.segments) == PROMPT // SEG  # one cached copy of each prompt segment
    assert c.run_until_decision() is None
    rec = c.result().records
    assert rec["parent_id"].tolist() == [0, 0, 0, 0] and rec["generated_tokens"].tolist() == [20] * 4
    # one child computed the prompt; the other three hit all its full segments
    assert sorted(rec["prefix_hit_tokens"].tolist()) == [0, 288, 288, 288]


def test_children_admitted_in_one_step_compute_the_prompt_once():
    # as vLLM V1: allocate_slots caches the first child's scheduled blocks before the next
    # child's get_computed_blocks in the same schedule() call
    res = run(_one(4), make_spec(cost=NO_FRONT_END, max_num_batched_tokens=2048), fast_forward=False)
    rec = res.records
    assert rec["first_scheduled_s"].nunique() == 1  # all four admitted in the first step
    assert rec["first_token_s"].nunique() == 1
    assert sorted(rec["prefix_hit_tokens"].tolist()) == [0, 288, 288, 288]


def test_n_with_prefix_caching_off_gives_each_child_its_own_prompt_blocks():
    c = _cluster([make_spec(cost=NO_FRONT_END, max_num_batched_tokens=2048, enable_prefix_caching=False)])
    c.start(_one(4))
    inst = c.instances[0]
    _run_until(c, lambda: len(inst.running) == 4 and all(s.generated >= 1 for s in inst.running))
    assert all(s.shared_blocks == 0 for s in inst.running)
    assert inst.kv.used_blocks()[0] == sum(-(-(PROMPT + s.generated) // 16) for s in inst.running)


# ----------------------------------------------------------------------- n = 1 changes nothing
def test_n1_given_explicitly_is_byte_identical_to_no_n_column():
    w = syn.generate(syn.SyntheticConfig(rate_per_s=20.0, num_requests=200, system_prompt_tokens=256), seed=1)
    ones = Workload(name=w.name, request_id=w.request_id, arrival_s=w.arrival_s, prompt_tokens=w.prompt_tokens,
                    output_tokens=w.output_tokens, session_id=w.session_id, slo_class=w.slo_class,
                    hash_offsets=w.hash_offsets, hashes=w.hashes, hash_block_tokens=w.hash_block_tokens,
                    slo_class_names=w.slo_class_names, source_sha256=w.source_sha256, notes=w.notes,
                    priority=w.priority, n=np.ones(len(w), dtype=np.int64))
    assert ones.content_sha256() == w.content_sha256() and not ones.has_parallel_sampling
    spec = make_spec(hbm_kv_blocks=2048)
    a, b = run(w, spec), run(ones, spec)
    assert_identical(a, b)
    assert "parent_id" not in a.records.columns and "parallel_sampling" not in a.summary


def test_the_content_hash_is_unchanged_without_n_and_changes_with_it():
    reqs = [Request(i, float(i), 10, 5) for i in range(3)]
    plain = Workload.from_requests(reqs)
    h = hashlib.sha256()  # the hash the workload had before the column existed
    for arr in (plain.request_id, plain.arrival_s, plain.prompt_tokens, plain.output_tokens, plain.session_id,
                plain.slo_class, plain.hash_offsets, plain.hashes):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(repr((plain.hash_block_tokens, plain.slo_class_names)).encode())
    assert plain.content_sha256() == h.hexdigest()
    two = Workload.from_requests([Request(i, float(i), 10, 5, n=2 if i == 1 else 1) for i in range(3)])
    assert two.content_sha256() != plain.content_sha256() and two.num_sequences == 4


def test_default_synthetic_provenance_leaves_n_samples_out():
    cfg = syn.SyntheticConfig(rate_per_s=5.0, num_requests=50)
    w = syn.generate(cfg, seed=2)
    assert "n_samples" not in w.notes[1] and (w.n == 1).all()
    w4 = syn.generate(syn.SyntheticConfig(rate_per_s=5.0, num_requests=50, n_samples=4), seed=2)
    assert (w4.n == 4).all() and np.array_equal(w4.prompt_tokens, w.prompt_tokens)  # no random draws
    assert w4.source_sha256 != w.source_sha256 and "n_samples=4" in w4.name


# ------------------------------------------------------------------------------------ routing
def test_children_route_together_across_instances():
    reqs = [Request(i, 0.01 * i, 64 + i, 8, n=(3 if i % 2 else 1)) for i in range(12)]
    w = Workload.from_requests(reqs)
    c = _cluster([make_spec(cost=NO_FRONT_END)] * 3, check=False)
    res = c.run(w)
    rec = res.records
    assert len(rec) == w.num_sequences == 6 * 3 + 6
    assert (rec.groupby("parent_id")["instance_id"].nunique() == 1).all()
    sizes = rec.groupby("parent_id").size()
    assert sizes.to_dict() == {i: (3 if i % 2 else 1) for i in range(12)}
    assert sum(res.summary["routing"]["requests"]) == 12  # the router saw each parent once
    # round-robin places parents, not sequences: parent i on instance i % 3
    first = rec.groupby("parent_id")["instance_id"].first()
    assert first.tolist() == [i % 3 for i in range(12)]
    ps = res.summary["parallel_sampling"]
    assert ps["parents"] == 12 and ps["sequences"] == 24 and ps["finished_parents"] == 12
    # child ids: child 0 keeps the parent's id, the others come after every workload id
    kids = rec[rec["parent_id"] == 1]["request_id"].tolist()
    assert kids[0] == 1 and min(kids[1:]) >= 12


def test_parent_latencies_are_first_child_token_and_last_child_finish():
    res = run(_one(3), make_spec(cost=NO_FRONT_END, max_num_batched_tokens=128), fast_forward=False)
    rec = res.records
    ps = res.summary["parallel_sampling"]
    assert ps["ttft_s"]["mean"] == pytest.approx(float((rec["first_token_s"] - rec["arrival_s"]).min()))
    assert ps["e2e_s"]["mean"] == pytest.approx(float((rec["finish_s"] - rec["arrival_s"]).max()))


def test_children_are_copies_of_the_parent():
    r = Request(7, 1.5, 40, 9, session_id=3, prefix_hashes=(1, 2), hash_block_tokens=16, slo_class="x",
                priority=2, n=3)
    kids = r.children(100)
    assert [k.request_id for k in kids] == [7, 100, 101]
    assert all((k.arrival_s, k.prompt_tokens, k.output_tokens, k.session_id, k.prefix_hashes, k.slo_class,
                k.priority, k.n, k.parent_id) == (1.5, 40, 9, 3, (1, 2), "x", 2, 1, 7) for k in kids)
    plain = Request(7, 1.5, 40, 9)
    assert plain.children(100) == (plain,) and plain.parent_id == NO_PARENT


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [0, -1, 1.5, "x", True, N_MAX + 1])
def test_a_bad_n_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"n=.* is not allowed: expected an integer in \[1, 16384\]") as e:
        Request(0, 0.0, 10, 5, n=bad)
    assert "\n" not in str(e.value)
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(ConfigError, match=rf"Workload n \(row 1\)={bad} is not allowed"):
            Workload.from_requests([Request(0, 0.0, 10, 5)])  # valid
            w = Workload.from_requests([Request(0, 0.0, 10, 5), Request(1, 1.0, 10, 5)])
            Workload(name="x", request_id=w.request_id, arrival_s=w.arrival_s, prompt_tokens=w.prompt_tokens,
                     output_tokens=w.output_tokens, session_id=w.session_id, slo_class=w.slo_class,
                     hash_offsets=w.hash_offsets, hashes=w.hashes, n=np.array([1, bad]))
    with pytest.raises(ConfigError, match=r"SyntheticConfig.n_samples=.* is not allowed"):
        syn.SyntheticConfig(rate_per_s=1.0, num_requests=3, n_samples=bad)


def test_a_float_n_column_is_refused():
    w = Workload.from_requests([Request(0, 0.0, 10, 5)])
    with pytest.raises(ConfigError, match="column n has dtype float64"):
        Workload(name="x", request_id=w.request_id, arrival_s=w.arrival_s, prompt_tokens=w.prompt_tokens,
                 output_tokens=w.output_tokens, session_id=w.session_id, slo_class=w.slo_class,
                 hash_offsets=w.hash_offsets, hashes=w.hashes, n=np.array([1.5]))


# ------------------------------------------------------------------------ column and traces
def _six() -> Workload:
    return Workload.from_requests([Request(i, float(i), 10 + i, 5, n=k) for i, k in enumerate([3, 1, 2, 4, 1, 5])])


def test_n_stays_with_its_request_through_every_transformation():
    w = _six()
    assert [w.request(i).n for i in range(6)] == [3, 1, 2, 4, 1, 5]
    assert w.subset(np.array([1, 3, 4])).n.tolist() == [1, 4, 1]
    assert tr.window(w, 2.0, 5.0).n.tolist() == [2, 4, 1]
    assert tr.head(w, 2).n.tolist() == [3, 1]
    assert tr.scale_rate(w, 2.0).n.tolist() == [3, 1, 2, 4, 1, 5]
    from kvsched.experiments.bench import tile_workload

    t = tile_workload(w, 2)
    assert np.array_equal(t.n, np.array([3, 1, 2, 4, 1, 5])[t.prompt_tokens - 10])


def _ts(sec: float) -> str:
    return f"2023-11-16 18:00:{sec:010.7f}"


def test_an_azure_csv_n_column_is_read_and_sorted_with_its_rows(tmp_path: Path):
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,n\n" + f"{_ts(5)},10,3,2\n{_ts(1)},20,4,4\n{_ts(3)},30,5,1\n")
    w = tr.load_azure_csv(p)
    assert w.prompt_tokens.tolist() == [20, 30, 10] and w.n.tolist() == [4, 1, 2]
    assert any("parallel samples from column 'n'" in x for x in w.notes)


@pytest.mark.parametrize("cell", ["0", "-1", "1.5", "x", ""])
def test_a_bad_trace_n_is_named_by_file_line_and_value_on_one_line(tmp_path: Path, cell):
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,n\n" + f"{_ts(1)},10,3,1\n{_ts(2)},10,3,{cell}\n")
    with pytest.raises(TraceFormatError) as e:
        tr.load_azure_csv(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and "line 3:" in msg and "'n'" in msg and repr(cell) in msg
    j = tmp_path / "mc.jsonl"
    rows = [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], "n": 2},
            {"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0], "n": cell}]
    j.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceFormatError, match=r"mc.jsonl: line 2: field 'n' "):
        tr.load_mooncake_jsonl(j)


def test_load_generic_maps_an_n_column(tmp_path: Path):
    c = tmp_path / "g.csv"
    c.write_text("t,p,m,samples\n2,10,1,3\n1,11,1,1\n")
    cols = {"arrival_s": "t", "prompt_tokens": "p", "output_tokens": "m", "n": "samples"}
    assert tr.load_generic(c, cols).n.tolist() == [1, 3]
    assert tr.load_generic(c, {k: v for k, v in cols.items() if k != "n"}).n.tolist() == [1, 1]


def test_fast_forward_serves_children_as_stepping_one_by_one_does():
    from simkit import three_way

    reqs = [Request(i, 0.02 * i, 200 + 40 * (i % 3), 30 + i, prefix_hashes=tuple(range(100 * i, 100 * i + 6)),
                    hash_block_tokens=SEG, n=1 + i % 4) for i in range(10)]
    w = Workload.from_requests(reqs)
    for specs in ([make_spec(max_num_batched_tokens=256)], [make_spec(max_num_batched_tokens=256)] * 2):
        three_way(w, specs)  # fold on (invariants checked) == fold off == one step at a time


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_children_with_prefix_tiers_conserve_blocks_and_fast_forward_equals_stepping(write_policy):
    """n > 1 on an instance whose DRAM caches prefixes: the siblings' segments cached when
    scheduled are written below too; blocks stay conserved in every tier (invariants checked every
    step) and fast-forward equals stepping."""
    from simkit import BLOCK_BYTES

    from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec

    reqs = [Request(i, 0.05 * i, 200 + 40 * (i % 3), 20 + i, hash_block_tokens=SEG, n=1 + i % 4,
                    prefix_hashes=tuple(range(100 * (i % 4), 100 * (i % 4) + 6))) for i in range(16)]
    w = Workload.from_requests(reqs)
    spec = make_spec(hbm_kv_blocks=60, max_num_batched_tokens=256, dram_kv_bytes=200 * BLOCK_BYTES,
                     prefix_offload=PrefixOffloadSpec(write_policy=write_policy))
    a, b = run(w, spec, fast_forward=True), run(w, spec, fast_forward=False)
    assert_identical(a, b)
    assert a.summary["prefix_tiers"]["tiers"]["dram"]["writes"] > 0
    assert a.summary["parallel_sampling"]["parents"] == 16
