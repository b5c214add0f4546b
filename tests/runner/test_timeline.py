"""The schedule as a Chrome/Perfetto trace (kvsched/runner/timeline.py, envs/sim/observer.py):
valid trace-event JSON by the format's rules, each step's batch accounting for every token the
records say was computed, preemptions with their mode and victim, copies on their links, routing
decisions, the same bytes for the same run, the window, and no cost or change without it."""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict

import pytest

from kvsched.envs.sim import instance as instance_module
from kvsched.envs.sim.errors import ConfigError, KvschedError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.shared_kv import SharedKVSpec
from kvsched.runner.simulate import simulate
from kvsched.runner.timeline import TimelineWriter, instance_labels, parse_window, timeline_path
from simkit import BLOCK_BYTES, build_workload, cluster, make_spec, routing_spec, short_only, with_longs


# ------------------------------------------------------------------------------ helpers
def load(path) -> dict:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data)


def check_trace(trace: dict, n_instances: int) -> list[dict]:
    """The Trace Event Format's rules as Perfetto and chrome://tracing read them; returns the events."""
    assert set(trace) >= {"traceEvents", "displayTimeUnit"} and trace["displayTimeUnit"] in ("ms", "ns")
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    named_threads, named_processes = set(), {}
    end_of = defaultdict(lambda: -1)  # (pid, tid) -> end (ns) of its last complete event
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and not isinstance(e["ts"], bool) and e["ts"] >= 0, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str), e
        assert e["ph"] in ("X", "i", "M"), e
        if e["ph"] == "M":
            if e["name"] == "process_name":
                named_processes[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
            continue
        assert (e["pid"], e["tid"]) in named_threads, f"track of {e} not named before it"
        if e["ph"] == "i":
            assert e["s"] in ("t", "p", "g"), e
            continue
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        start = round(e["ts"] * 1000)
        track = (e["pid"], e["tid"])
        assert start >= end_of[track], f"{e} starts before the end of the previous event on its track"
        end_of[track] = start + round(e["dur"] * 1000)
    for i in range(n_instances):
        assert named_processes.get(i + 1, "").startswith(f"instance {i}")
    return events


def run_timeline(tmp_path, w, spec, name="t.json", window=None, **kw):
    path = tmp_path / name
    n = kw.get("n_instances", 1)
    with TimelineWriter(path, instance_labels(n, spec), window) as tl:
        res = simulate(w, spec, observer=tl, **kw)
        tl.add_records(res.records)
    return res, load(path), path


def step_tokens(events) -> tuple[Counter, Counter]:
    """Per request: tokens computed in prefill and recompute chunks, and decode tokens."""
    chunks, decodes = Counter(), Counter()
    for e in events:
        if e["ph"] != "X" or e.get("cat") != "step":
            continue
        a = e["args"]
        if e["name"] == "decode stretch":
            for rid, k in a.get("decode_steps", [(rid, a["steps"]) for rid in a["decode"]]):
                decodes[rid] += k
            continue
        for rid, n in a["prefill"] + a["recompute"]:
            chunks[rid] += n
        for rid in a["decode"]:
            decodes[rid] += 1
    return chunks, decodes


def link_bytes(events, pid=None) -> Counter:
    """Bytes of the copies on each link (of process ``pid``, or every one)."""
    out: Counter = Counter()
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    for e in events:
        if e.get("cat") == "transfer" and pid in (None, e["pid"]):
            out[names[(e["pid"], e["tid"])].removeprefix("link ")] += e["args"]["bytes"]
    return out


def shared_prefix_workload() -> Workload:
    """Conversations sharing prefixes, two long prompts that preempt (recompute) on a small HBM."""
    rows = [(0.3 * i, 600 + 40 * (i % 5), 150 + 37 * (i % 4), 1 + i % 3) for i in range(30)]
    return build_workload(rows)


# ------------------------------------------------------------------------------ format
def test_a_cluster_timeline_is_valid_trace_event_json_naming_every_instance_and_routing_each_request(tmp_path):
    w = short_only(rate=6.0, dur=15.0)
    spec = make_spec(hbm_kv_blocks=800)
    res, trace, _ = run_timeline(tmp_path, w, spec, "c.json.gz", n_instances=3, router="least-loaded")
    events = check_trace(trace, 3)
    routes = [e for e in events if e.get("cat") == "routing"]
    placed = {e["args"]["request"]: e["args"]["instance"] for e in routes}
    rec = res.records.set_index("request_id")
    assert len(routes) == len(w) and placed == rec.instance_id.to_dict()
    assert all(e["pid"] == 0 and e["name"] == f"-> instance {e['args']['instance']}" for e in routes)
    finishes = [e for e in events if e["name"] == "finish"]
    assert len(finishes) == len(w)
    assert all(e["pid"] == rec.loc[e["args"]["request"], "instance_id"] + 1 for e in finishes)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_the_step_batches_account_for_every_token_the_records_say_was_computed(tmp_path, fast_forward):
    """For every request never preempted, its prefill chunks add up to its prompt minus its prefix
    hit and its decodes (one per step, a stretch's per member) to its tokens after the first; a
    preempted one computes at least that much again, in recompute chunks once it had emitted tokens."""
    spec = make_spec(hbm_kv_blocks=180, max_num_batched_tokens=512)
    w = shared_prefix_workload()
    res, trace, _ = run_timeline(tmp_path, w, spec, options=InstanceOptions(fast_forward=fast_forward))
    events = check_trace(trace, 1)
    rec = res.records.set_index("request_id")
    assert rec.prefix_hit_tokens.sum() > 0 and rec.preemptions.sum() > 0  # the scenario exercises both
    chunks, decodes = step_tokens(events)
    calm = rec[rec.preemptions == 0]
    assert {rid: chunks[rid] for rid in calm.index} == (calm.prompt_tokens - calm.prefix_hit_tokens).to_dict()
    assert {rid: decodes[rid] for rid in calm.index} == (calm.generated_tokens - 1).to_dict()
    hit = rec[rec.preemptions > 0]
    assert all(chunks[rid] >= r.prompt_tokens - r.prefix_hit_tokens + 1 for rid, r in hit.iterrows())
    recomputed = {rid for e in events if e.get("cat") == "step" and "recompute" in e["args"]
                  for rid, _ in e["args"]["recompute"]}
    assert recomputed and recomputed <= set(hit.index)
    if fast_forward:
        assert any(e["name"] == "decode stretch" for e in events)
    else:
        n_steps = sum(1 for e in events if e.get("cat") == "step")
        assert n_steps == res.stats["steps"]


# ------------------------------------------------------------------------------ preemptions, copies
@pytest.mark.parametrize("dram_blocks, mode", [(100, "swap"), (2, "recompute")])
def test_preemptions_show_the_mode_the_victim_got_and_swaps_their_copies_on_the_pcie_links(tmp_path, dram_blocks,
                                                                                             mode):
    """Swap preemption into a DRAM tier with room: ``preempt (swap)`` with the victim, and its
    copies out and back on the PCIe links; into a DRAM tier too small, swap falls back to
    recompute and the event says so."""
    spec = make_spec(hbm_kv_blocks=40, max_num_batched_tokens=2048, dram_kv_bytes=dram_blocks * BLOCK_BYTES,
                     preemption_mode="swap", enable_prefix_caching=False)
    w = Workload.from_requests([Request(i, 0.0, 150, 120) for i in range(3)])
    res, trace, _ = run_timeline(tmp_path, w, spec)
    events = check_trace(trace, 1)
    pre = [e for e in events if e.get("cat") == "preemption"]
    rec = res.records.set_index("request_id")
    assert Counter(e["args"]["victim"] for e in pre) == {k: v for k, v in rec.preemptions.items() if v}
    assert {e["args"]["mode"] for e in pre} == {mode} and all(e["name"] == f"preempt ({mode})" for e in pre)
    assert all(e["args"]["cause"] == "blocks" and e["args"]["for_request"] in rec.index for e in pre)
    copies = Counter(e["name"] for e in events if e.get("cat") == "transfer")
    if mode == "swap":
        assert copies["swap_out"] >= len(pre) and copies["swap_in"] >= 1
    else:
        assert not copies
    assert link_bytes(events) == {k: v for k, v in res.stats["link_bytes"].items() if v}


def test_prefix_tier_writes_and_loads_are_on_their_links_and_add_up_to_the_links_bytes(tmp_path):
    spec = make_spec(hbm_kv_blocks=160, max_num_batched_tokens=2048, dram_kv_bytes=2.0e9,
                     prefix_offload=PrefixOffloadSpec(tiers=("dram",)))
    rows = [(0.0, 1024, 4, 1)] + [(1.0 + i, 1024, 4, 2 + i) for i in range(4)] + [(20.0, 1088, 4, 1)]
    res, trace, _ = run_timeline(tmp_path, build_workload(rows), spec)
    events = check_trace(trace, 1)
    kinds = Counter(e["name"] for e in events if e.get("cat") == "transfer")
    assert kinds["prefix_write"] >= 1 and kinds["prefix_load"] >= 1
    assert link_bytes(events) == {k: v for k, v in res.stats["link_bytes"].items() if v}


def test_a_cluster_kv_tier_shows_its_writes_and_fetches_on_the_cluster_links(tmp_path):
    hashes = tuple(range(16))
    w = Workload.from_requests([Request(i, 30.0 * i, 8292, 2, prefix_hashes=hashes + (900 + i,), hash_block_tokens=512)
                                for i in range(2)])
    spec = routing_spec(max_num_batched_tokens=8192)
    path = tmp_path / "s.json"
    with TimelineWriter(path, instance_labels(2)) as tl:
        res = cluster(2, spec=spec, shared_kv=SharedKVSpec(capacity_bytes=1e12), observer=tl).run(w)
    events = check_trace(load(path), 2)
    shared = [e for e in events if e.get("cat") == "transfer" and e["pid"] == 0]
    assert {e["name"] for e in shared} == {"shared_write", "shared_fetch"}
    by_link = link_bytes(events, pid=0)
    assert by_link["shared_pool_write"] == res.summary["shared_kv"]["bytes_written"]
    assert by_link["shared_pool_read"] == res.summary["shared_kv"]["bytes_fetched"]


# ------------------------------------------------------------------------------ same run, same bytes
def test_the_same_run_writes_the_same_bytes_and_the_observer_changes_no_result(tmp_path):
    w = with_longs(short_only(rate=8.0, dur=10.0), [3.0], [6000])
    spec = make_spec(hbm_kv_blocks=500)
    a, _, pa = run_timeline(tmp_path, w, spec, "a.json.gz", n_instances=2)
    b, _, pb = run_timeline(tmp_path, w, spec, "b.json.gz", n_instances=2)
    assert pa.read_bytes() == pb.read_bytes()
    plain = simulate(w, spec, n_instances=2)
    assert summary_to_json(a.summary) == summary_to_json(plain.summary)
    assert a.records.equals(plain.records) and a.stats == plain.stats


def test_without_an_observer_no_event_object_is_built(monkeypatch):
    """The default path builds nothing for an observer: every event constructor raises here."""
    def boom(*a, **k):
        raise AssertionError("an event was built without an observer")

    for name in ("StepEvent", "batch_entries"):
        monkeypatch.setattr(instance_module, name, boom)
    monkeypatch.setattr("kvsched.envs.sim.preemption.PreemptionEvent", boom)
    monkeypatch.setattr("kvsched.envs.sim.cluster.RouteEvent", boom)
    monkeypatch.setattr("kvsched.envs.sim.observer.TransferEvent", boom)
    spec = make_spec(hbm_kv_blocks=40, max_num_batched_tokens=2048, dram_kv_bytes=100 * BLOCK_BYTES,
                     preemption_mode="swap", enable_prefix_caching=False)
    res = simulate(Workload.from_requests([Request(i, 0.1 * i, 150, 120) for i in range(3)]), spec, n_instances=2)
    assert res.stats["steps"] > 0


def test_the_window_keeps_the_events_that_touch_it(tmp_path):
    w = short_only(rate=6.0, dur=20.0)
    spec = make_spec()
    _, trace, _ = run_timeline(tmp_path, w, spec, window=(5.0, 8.0))
    events = [e for e in check_trace(trace, 1) if e["ph"] != "M"]
    assert events and trace["otherData"]["window_s"] == [5.0, 8.0]
    for e in events:
        assert e["ts"] <= 8.0e6 and e["ts"] + e.get("dur", 0.0) >= 5.0e6, e


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("text", ["5:2", "a:3", "3", "-1:4", "nan:4", "1:2:3"])
def test_a_bad_timeline_window_is_refused_naming_it(text):
    with pytest.raises(ConfigError, match="--timeline-window"):
        parse_window(text)


@pytest.mark.parametrize("value", ["", "  ", "run.txt", "run", None, 3])
def test_a_timeline_file_must_be_named_json_or_json_gz(value):
    with pytest.raises(ConfigError, match="--timeline"):
        timeline_path(value)


def test_a_failed_run_leaves_no_timeline_file(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(RuntimeError, match="boom"):
        with TimelineWriter(path, instance_labels(1)):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ CLI and environments
def test_simulate_and_compare_write_timelines(tmp_path):
    from kvsched.experiments.cli import main

    out = tmp_path / "sim" / "run.json.gz"
    assert main(["simulate", "--max-requests", "40", "--instances", "2", "--timeline", str(out),
                 "--timeline-window", "0:", "--json"]) == 0
    check_trace(load(out), 2)
    scenario = "experiments/scenarios/short-only.yaml"
    assert main(["compare", "--scenario", scenario, "--policies", "fcfs,lars", "--max-requests", "30",
                 "--timeline", str(tmp_path / "cmp"), "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["timeline-fcfs-seed0.json.gz",
                                                                    "timeline-lars-seed0.json.gz"]
    assert main(["simulate", "--max-requests", "5", "--timeline-window", "0:1"]) == 2  # needs --timeline


@pytest.mark.parametrize("argv", [["simulate", "--timeline", ""], ["simulate", "--timeline", "run.csv"],
                                  ["simulate", "--timeline", "t.json", "--timeline-window", "9:3"],
                                  ["compare", "--scenario", "x.yaml", "--timeline", ""]])
def test_the_cli_refuses_a_bad_timeline_flag_naming_it(argv, capsys):
    from kvsched.experiments.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "argument --timeline" in capsys.readouterr().err


def test_an_environment_writes_one_timeline_per_episode(tmp_path):
    gym = pytest.importorskip("gymnasium")
    import kvsched.envs  # noqa: F401  (registers the ids)

    env = gym.make("kvsched/Scheduling-v0", max_requests=15, window_s=30.0,
                   timeline=str(tmp_path / "ep-{episode:02d}.json"))
    for seed in (0, 1):
        env.reset(seed=seed)
        done = False
        while not done:
            _, _, term, trunc, _ = env.step(env.action_space.sample() * 0)
            done = term or trunc
    env.reset(seed=2)  # left unfinished: written when the environment closes
    env.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ep-00.json", "ep-01.json", "ep-02.json"]
    for name in files:
        trace = load(tmp_path / name)
        check_trace(trace, 1)
    assert trace["otherData"]["complete"] is False and load(tmp_path / "ep-00.json")["otherData"]["complete"]
    with pytest.raises(KvschedError, match="timeline"):
        gym.make("kvsched/Scheduling-v0", timeline=str(tmp_path / "no-field.json"))


def test_a_routing_agents_placements_are_the_callers_on_the_routing_track(tmp_path):
    gym = pytest.importorskip("gymnasium")
    import kvsched.envs  # noqa: F401  (registers the ids)

    env = gym.make("kvsched/Routing-v0", max_requests=12, window_s=30.0, timeline=str(tmp_path / "r{episode}.json"))
    env.reset(seed=0)
    done, chosen = False, []
    while not done:
        a = len(chosen) % 2
        chosen.append(a)
        _, _, term, trunc, _ = env.step(a)
        done = term or trunc
    env.close()
    routes = [e for e in check_trace(load(tmp_path / "r0.json"), 2) if e.get("cat") == "routing"]
    assert [e["args"]["instance"] for e in routes] == chosen[:len(routes)] and len(routes) == 12
    assert {e["args"]["by"] for e in routes} == {"caller"}
