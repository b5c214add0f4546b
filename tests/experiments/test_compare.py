"""`kvsched compare` (experiments/compare.py): one row per policy x class, numbers that match a
plain simulation, files written, identical tables for identical seeds, fast failure on unknown
policies. Small synthetic workloads (~150 requests) keep it fast."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvsched.runner.simulate import simulate
from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.experiments.cli import main
from kvsched.experiments.compare import (METRIC_COLUMNS, OUTPUT_FILES, _params_for, aggregate,
                                         parse_policy_params, run_compare)
from kvsched.runner.scenario import Scenario, load_scenario

SCENARIO = """\
name: tiny-mixed
synthetic:
  rate_per_s: 10.0
  duration_s: 15
  long_fraction: 0.08
  long_min_tokens: 16384
  long_max_tokens: 32768
instance:
  model: Llama-3.1-8B
  gpu: H100-SXM
policy: fcfs
seed: 4
"""


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("sc") / "tiny.yaml"
    p.write_text(SCENARIO)
    return p


@pytest.fixture(scope="module")
def result(scenario_file):
    return run_compare(load_scenario(scenario_file), ["fcfs", "ewsjf"], seeds=2,
                       policy_params={"ewsjf": {"meta_window_s": 5.0}})


def test_one_row_per_policy_seed_and_class(result):
    runs = result.runs
    assert result.seeds == [4, 5] and result.policies == ["fcfs", "ewsjf"]
    assert list(runs.columns) == ["policy", "seed", "window", "class", *METRIC_COLUMNS]
    assert (runs.window == 0).all()
    keys = set(zip(runs.policy, runs.seed, runs["class"]))
    assert keys == {(p, s, c) for p in ("fcfs", "ewsjf") for s in (4, 5) for c in ("all", "short", "long")}
    agg = aggregate(runs, result.policies)
    assert list(zip(agg.policy, agg["class"])) == [(p, c) for p in ("fcfs", "ewsjf")
                                                    for c in ("all", "short", "long")]
    assert (agg.seeds == 2).all()
    # the seed regenerates the synthetic workload
    n = runs[(runs.policy == "fcfs") & (runs["class"] == "all")].n.tolist()
    assert n[0] != n[1]
    # every policy served the same requests for a given seed
    for s in (4, 5):
        sub = runs[(runs.seed == s) & (runs["class"] == "all")]
        assert sub.n.nunique() == 1


def test_numbers_match_a_plain_simulation_and_mean_over_seeds(result, scenario_file):
    sc = load_scenario(scenario_file).with_overrides(seed=5)
    summ = simulate(sc.workload(), sc.instance_spec(), "fcfs", sc.metrics_config()).summary["classes"]
    row = result.runs[(result.runs.policy == "fcfs") & (result.runs.seed == 5)].set_index("class")
    assert row.loc["short", "ttft_p99_s"] == summ["short"]["ttft_s"]["p99"]
    assert row.loc["long", "e2e_p50_s"] == summ["long"]["e2e_s"]["p50"]
    assert row.loc["all", "slo_attainment"] == summ["all"]["slo"]["attainment"]
    assert row.loc["long", "max_wait_s"] == summ["long"]["starvation"]["max_queueing_delay_s"]
    assert row.loc["all", "bytes_hbm_to_dram"] == summ["all"]["bytes_moved"]["hbm_to_dram"]
    agg = aggregate(result.runs).set_index(["policy", "class"])
    both = result.runs[(result.runs.policy == "fcfs") & (result.runs["class"] == "short")].goodput_rps
    assert agg.loc[("fcfs", "short"), "goodput_rps"] == pytest.approx(both.mean(), rel=1e-12)
    assert agg.loc[("fcfs", "short"), "goodput_rps_max"] == both.max()
    assert agg.loc[("fcfs", "short"), "goodput_rps_std"] == pytest.approx(both.std(ddof=0), rel=1e-12)


def test_the_run_seed_seeds_policies_unless_given():
    assert _params_for("ewsjf", {}, 5)["seed"] == 5
    assert _params_for("ewsjf", {"seed": 9}, 5)["seed"] == 9
    assert "seed" not in _params_for("fcfs", {}, 5)


def test_cli_writes_files_and_same_seeds_give_identical_tables(scenario_file, tmp_path, capsys):
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        rc = main(["compare", "--scenario", str(scenario_file), "--policies", "fcfs,ewsjf", "--seeds", "1",
                   "--out", str(out), "--no-progress"])
        assert rc == 0
    printed = capsys.readouterr().out
    assert "fcfs" in printed and "ewsjf" in printed and "max wait s" in printed
    for f in OUTPUT_FILES:
        assert (outs[0] / f).stat().st_size > 0
    for f in ("ttft_cdf.png", "kv_occupancy.png", "slo_attainment.png"):
        assert (outs[0] / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for f in ("compare.csv", "compare_runs.csv", "compare.json"):
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes()
    table = pd.read_csv(outs[0] / "compare.csv")
    assert list(zip(table.policy, table["class"])) == [(p, c) for p in ("fcfs", "ewsjf")
                                                        for c in ("all", "short", "long")]


def test_unknown_policy_fails_fast_listing_the_known_ones(scenario_file, tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["compare", "--scenario", str(scenario_file), "--policies", "fcfs,sjf", "--out", str(out),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "'sjf'" in err and "ewsjf" in err and "fcfs" in err
    assert not out.exists()  # failed before any run or output
    with pytest.raises(UnknownPresetError, match="known"):
        run_compare(load_scenario(scenario_file), ["fcfs", "nope"])


def test_title_says_what_the_spread_is_over(scenario_file, capsys):
    """The table's ± is over every run of a policy (seeds x windows): the title says so, and
    names the windows (it used to read "seeds 0..0 (mean)" above cells with a ± over windows)."""
    assert main(["compare", "--scenario", str(scenario_file), "--policies", "fcfs", "--max-requests", "30",
                 "--windows", "2", "--no-progress"]) == 0
    assert "seeds 4..4 x 2 windows (mean ± std over 2 runs)" in capsys.readouterr().out  # the scenario's seed 4
    assert main(["compare", "--scenario", str(scenario_file), "--policies", "fcfs", "--max-requests", "30",
                 "--no-progress"]) == 0
    assert "seeds 4..4 (one run)" in capsys.readouterr().out


def test_bad_policy_params_are_named():
    with pytest.raises(ConfigError, match="invalid JSON"):
        parse_policy_params("{ewsjf:", ["ewsjf"])
    with pytest.raises(ConfigError, match="not compared"):
        parse_policy_params('{"lars": {}}', ["ewsjf"])
    with pytest.raises(ConfigError, match="step_size"):
        parse_policy_params('{"ewsjf": {"step_size": 0}}', ["ewsjf"])


def test_cli_max_requests_serves_only_the_first_n(scenario_file, tmp_path, capsys):
    out = tmp_path / "head"
    rc = main(["compare", "--scenario", str(scenario_file), "--policies", "fcfs", "--max-requests", "40",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    runs = pd.read_csv(out / "compare_runs.csv")
    assert len(load_scenario(scenario_file).workload()) > 40
    assert int(runs.loc[runs["class"] == "all", "n"].iloc[0]) == 40
    with pytest.raises(SystemExit) as e:  # argparse: exit status 2, the flag named
        main(["compare", "--scenario", str(scenario_file), "--policies", "fcfs", "--max-requests", "0",
              "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --max-requests: 0 is not allowed: expected an integer >= 1" in err
    assert str(scenario_file) not in err  # the value came from the command line, not the file


def test_table_shows_the_spread_of_n_over_seeds():
    """Seeds whose windows hold different request counts: the n column is their mean ± std
    (100 and 110 arrived -> 105±5), as every metric column is."""
    import io

    import numpy as np
    import pandas as pd
    from rich.console import Console

    from kvsched.experiments.compare import METRIC_COLUMNS, aggregate, rich_table

    rows = []
    for seed, n in ((0, 100), (1, 110)):
        row = {m: np.nan for m in METRIC_COLUMNS}
        row.update(policy="fcfs", seed=seed, n=n, finished=n, slo_attainment=0.5, goodput_rps=1.0)
        row["class"] = "all"
        rows.append(row)
    agg = aggregate(pd.DataFrame(rows))
    out = io.StringIO()
    Console(file=out, width=400).print(rich_table(agg, "t"))
    assert "105±5" in out.getvalue()


def test_run_compare_routers_rows():
    sc = Scenario(trace=None, synthetic={"duration_s": 15, "rate_per_s": 3}, n_instances=2)
    res = run_compare(sc, routers=["rr", "least-loaded"])
    assert list(res.runs.columns[:4]) == ["router", "seed", "window", "class"] and res.axis == "router"
    agg = aggregate(res.runs, res.policies)
    allrow = agg[(agg["router"] == "rr") & (agg["class"] == "all")].iloc[0]
    assert allrow["load_imbalance"] >= 1.0 and math.isnan(allrow["shared_kv_bytes_fetched"])
    with pytest.raises(ConfigError, match="either policies or routers"):
        run_compare(sc, ["fcfs"], routers=["rr"])


def test_comparing_routers_on_one_instance_is_refused_not_a_table_of_identical_rows():
    sc = Scenario(trace=None, synthetic={"duration_s": 15, "rate_per_s": 3}, n_instances=1)
    with pytest.raises(ConfigError, match="n_instances >= 2.*n_instances=1"):
        run_compare(sc, routers=["rr", "least-loaded"])


def test_names_in_another_case_or_an_alias_count_as_the_registered_name():
    """The registries accept a name in any case or an alias ("LARS", "rr"); compare compared names
    as typed, so "fcfs,FCFS" ran FCFS twice under two labels, and --policy-params keyed by "lars"
    named a policy "not compared" when --policies said "LARS". Rows keep the names as given."""
    from kvsched.experiments.compare import parse_policies, parse_router_params, parse_routers

    assert parse_policies(" LARS,fcfs ") == ["LARS", "fcfs"]
    with pytest.raises(ConfigError, match="\\['fcfs'\\] given twice"):
        parse_policies("fcfs,FCFS")
    assert parse_policy_params('{"lars": {"tier_aware_preemption": true}}', parse_policies("LARS")) == \
        {"LARS": {"tier_aware_preemption": True}}
    assert parse_policy_params('{"LARS": {}}', ["lars"]) == {"lars": {}}
    with pytest.raises(ConfigError, match="not compared"):
        parse_policy_params('{"LARS": {}}', ["fcfs"])
    assert parse_routers("rr,least-loaded") == ["rr", "least-loaded"]
    with pytest.raises(ConfigError, match="\\['round-robin'\\] given twice"):
        parse_routers("rr,round-robin")
    assert parse_router_params('{"round-robin": {}}', ["rr"]) == {"rr": {}}
    assert parse_router_params('{"Least-Loaded": {"kv_weight": 0.5}}', ["least-loaded"]) == \
        {"least-loaded": {"kv_weight": 0.5}}


def test_an_extra_tiers_links_are_compared_tabled_and_plotted(tmp_path, monkeypatch):
    """Tiers as data reach the comparison: the bytes over an extra tier's links (summary
    ``bytes_moved``) are columns of the runs and aggregate frames and of the table, and its
    occupancy is plotted. They were dropped (fixed standard link columns, a fixed hbm/dram/nvme
    plot), so a policy comparison on a CXL swap tier showed no bytes moved at all."""
    from kvsched.experiments import compare as cmp
    from kvsched.experiments.compare import rich_table

    tier = {"name": "cxl", "capacity_bytes": 400 * 131072 * 16, "write_link": "pcie5", "read_link": "pcie5"}
    sc = Scenario(trace=None, synthetic={"rate_per_s": 10.0, "duration_s": 8, "prompt_median_tokens": 400,
                             "output_median_tokens": 120, "output_max_tokens": 300}, seed=3,
                  instance={"model": "Llama-3.1-8B", "gpu": "H100-SXM", "hbm_kv_blocks": 160,
                            "max_num_batched_tokens": 2048, "max_num_seqs": 64, "extra_tiers": [tier],
                            "preemption_mode": "cxl"})
    res = run_compare(sc, ["fcfs"])
    runs = res.runs
    assert list(runs.columns[-2:]) == ["bytes_hbm_to_cxl", "bytes_cxl_to_hbm"]
    moved = runs[runs["class"] == "all"]["bytes_hbm_to_cxl"].iloc[0]
    assert moved == res.records[("fcfs", 3, 0)]["bytes_hbm_to_cxl"].sum() > 0
    agg = aggregate(runs, res.policies)
    assert agg["bytes_cxl_to_hbm"].iloc[0] > 0 and "bytes_cxl_to_hbm_std" in agg.columns
    assert "GB hbm→cxl" in [c.header for c in rich_table(agg, "t").columns]
    plotted = []
    summed = cmp._summed_occupancy
    monkeypatch.setattr(cmp, "_summed_occupancy", lambda occ, t: (plotted.append(t), summed(occ, t))[1])
    cmp.plot_occupancy(res, tmp_path / "occ.png")
    assert plotted == ["hbm", "cxl"]


def test_paired_differences_are_taken_run_by_run_over_the_runs_both_labels_served():
    """compare_paired.csv: each label minus the first on the same (seed, window) runs, with a
    bootstrap interval and the runs where the label is worse (higher latency, lower attainment)."""
    from kvsched.experiments.compare import paired

    rows = []
    for seed in range(6):
        base_ttft = 0.1 + 0.05 * seed  # runs differ a lot; the pairs differ by exactly -0.01
        rows.append({"policy": "a", "seed": seed, "window": 0, "class": "all", "ttft_p99_s": base_ttft,
                     "slo_attainment": 0.5})
        rows.append({"policy": "b", "seed": seed, "window": 0, "class": "all", "ttft_p99_s": base_ttft - 0.01,
                     "slo_attainment": 0.5 - (0.1 if seed == 0 else 0.0)})
    rows.append({"policy": "b", "seed": 99, "window": 0, "class": "all", "ttft_p99_s": 50.0,
                 "slo_attainment": 0.0})  # a run the baseline did not serve: left out of the pairs
    table = paired(pd.DataFrame(rows), ["a", "b"])
    ttft = table[table.metric == "ttft_p99_s"].iloc[0]
    assert ttft["runs"] == 6 and ttft["diff_mean"] == pytest.approx(-0.01)
    assert ttft["diff_lo"] == pytest.approx(-0.01) and ttft["diff_hi"] == pytest.approx(-0.01)
    assert ttft["worse"] == 0
    slo = table[table.metric == "slo_attainment"].iloc[0]
    assert slo["worse"] == 1 and slo["diff_lo"] <= slo["diff_mean"] <= slo["diff_hi"] <= 0
    assert paired(pd.DataFrame(rows), ["a"]).empty


def test_evaluate_writes_each_agent_against_the_first_episode_by_episode(tmp_path, capsys):
    """kvsched evaluate: paired.csv pairs the agents on the same (window, seed) episodes."""
    out = tmp_path / "ev"
    assert main(["evaluate", "--agents", "fcfs,lars", "--scenario", "short-only", "--windows", "1", "--seeds", "2",
                 "--out", str(out), "--no-progress"]) == 0
    table = pd.read_csv(out / "paired.csv")
    assert set(table["agent"]) == {"lars"} and set(table["baseline"]) == {"fcfs"}
    assert set(table["metric"]) == {"slo_attainment", "goodput_rps", "ttft_p99_s"} and (table["runs"] == 2).all()
    eps = pd.read_csv(out / "episodes.csv")
    allc = eps[eps["class"] == "all"].set_index(["agent", "window", "seed"])["ttft_p99_s"]
    assert table.set_index("metric").loc["ttft_p99_s", "diff_mean"] == pytest.approx(
        (allc.loc["lars"] - allc.loc["fcfs"]).mean())
    assert "each against fcfs" in capsys.readouterr().out
