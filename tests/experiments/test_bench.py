"""`kvsched bench`: the quick set runs, writes the documented JSON, counts requests, and the
same case gives the same simulated results twice (timings are never asserted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments import bench
from kvsched.experiments.cli import main
from kvsched.runner.scenario import load_scenario

# simulated results of a case: everything but timings and memory
SIMULATED_KEYS = ("requests", "instances", "finished", "rejected", "simulated_s", "events", "steps",
                  "fast_forward_steps", "fast_forward_stretches", "folded_steps", "preemptions", "latency_s",
                  "result_sha256")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def _expected_requests(name: str) -> int:
    if name == "blis-1k":
        return 1_000
    if name == "azure-1k":
        return 1_000
    if name == "mooncake-4i-500":
        return 500
    if name == "swap-60s":
        sc = load_scenario(Path(bench.__file__).parent / "scenarios" / "long-context-swap-dram.yaml")
        return len(sc.with_overrides(window_s=(0.0, 60.0)).workload())
    raise AssertionError(name)


def test_quick_bench_writes_documented_json_and_plot(quick_run):
    out, doc = quick_run
    assert list(doc) == list(bench.TOP_KEYS)
    assert [e["case"] for e in doc["cases"]] == bench.quick_cases()
    for e in doc["cases"]:
        assert set(bench.CASE_KEYS) <= set(e), set(bench.CASE_KEYS) - set(e)
        assert e["sim_wall_s"] > 0 and e["process_wall_s"] >= e["sim_wall_s"]
        assert e["peak_rss_mib"] >= e["baseline_rss_mib"] > 0
        assert 0 <= e["fast_forward_share"] <= 1 and e["fast_forward_steps"] <= e["steps"]
        assert len(e["result_sha256"]) == 64 and e["profiled"] is False
    assert doc["envs"] is None and "--envs" in doc["not_measured"][0]
    assert doc["reference"]["blis_requests_per_s"] == pytest.approx(10_000 / 23.0)
    assert out.with_suffix(".png").stat().st_size > 0


def test_plot_points_and_the_empty_instances_panel(quick_run):
    """The plot shows each case at (requests, wall s) and the multi-instance case on the
    instances panel; without one, that panel says so instead of showing an empty grid."""
    import matplotlib.pyplot as plt

    _, doc = quick_run
    fig = bench.plot_figure(doc["cases"])
    ax1, ax2 = fig.axes
    points = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax1.get_lines()}
    by = {e["case"]: e for e in doc["cases"]}
    assert points["azure-1k"] == ([by["azure-1k"]["requests"]], [by["azure-1k"]["sim_wall_s"]])
    assert points["BLIS itself (quoted)"] == ([10_000], [23.0])
    m = by["mooncake-4i-500"]
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax2.get_lines()] == \
        [([m["instances"]], [m["sim_wall_s"]])]
    assert not ax2.texts
    plt.close(fig)
    fig = bench.plot_figure([e for e in doc["cases"] if e["instances"] == 1])
    assert not fig.axes[1].get_lines() and "no multi-instance case" in fig.axes[1].texts[0].get_text()
    plt.close(fig)


def test_quick_bench_counts_requests(quick_run):
    _, doc = quick_run
    for e in doc["cases"]:
        assert e["requests"] == _expected_requests(e["case"]), e["case"]
        assert e["finished"] + e["rejected"] == e["requests"]
    by = {e["case"]: e for e in doc["cases"]}
    assert by["mooncake-4i-500"]["instances"] == 4
    assert by["blis-1k"]["finished"] == 1_000


def test_same_case_same_simulated_results_in_a_new_process(quick_run):
    _, doc = quick_run
    first = next(e for e in doc["cases"] if e["case"] == "mooncake-4i-500")
    again = bench.run_case_subprocess("mooncake-4i-500")
    assert {k: again[k] for k in SIMULATED_KEYS} == {k: first[k] for k in SIMULATED_KEYS}


def test_fixed_length_poisson_workload():
    w = bench.fixed_length_poisson(2_000, 10.0, 800, 400, seed=0, name="blis")
    assert len(w) == 2_000 and set(w.prompt_tokens) == {800} and set(w.output_tokens) == {400}
    assert np.all(np.diff(w.arrival_s) >= 0)
    assert 8.0 < len(w) / w.arrival_s[-1] < 12.0  # Poisson 10/s
    again = bench.fixed_length_poisson(2_000, 10.0, 800, 400, seed=0, name="blis")
    assert again.content_sha256() == w.content_sha256()
    with pytest.raises(ConfigError, match="prompt_tokens=0"):
        bench.fixed_length_poisson(10, 10.0, 0, 400, seed=0, name="x")
    with pytest.raises(ConfigError, match="rate_per_s=-1"):
        bench.fixed_length_poisson(10, -1, 8, 4, seed=0, name="x")


def test_tile_workload_keeps_rate_profile_and_lengths():
    w = bench.fixed_length_poisson(100, 2.0, 8, 4, seed=1, name="small")
    t = bench.tile_workload(w, 3)
    assert len(t) == 300 and np.all(np.diff(t.arrival_s) >= 0)
    assert list(t.request_id) == list(range(300))
    period = (w.arrival_s[-1] - w.arrival_s[0]) * 100 / 99
    assert t.arrival_s.max() < period
    assert t.arrival_s[0] == 0.0  # copy 0 starts at the first arrival
    with pytest.raises(ConfigError, match="copies=0"):
        bench.tile_workload(w, 0)


def test_vidur_configuration_in_kvsched():
    # Vidur 0.0.26's MemoryPlanner gives 54,067 KV tokens -> 13 requests of 4,096 -> 3,328 blocks
    assert bench.vidur_kv_blocks() == 3_328
    spec = bench.vidur_instance_spec()
    assert (spec.model.name, spec.gpu.name, spec.tp) == ("Llama-2-70B", "A100-80GB", 2)
    assert (spec.num_hbm_blocks, spec.token_budget, spec.max_seqs, spec.block_size_tokens) == (3_328, 512, 128, 16)
    case = bench.get_case("vidur-n100-qps1.5")
    assert case.group == "peer" and bench.vidur_case_name(100, 1.5) == "vidur-n100-qps1.5"


def test_vidur_log_parsing():
    log = ("INFO 11-29 09:22:31 simulator.py:57] Starting simulation with cluster: ... and 10 requests\n"
           "INFO 11-29 09:22:50 simulator.py:79] Simulation ended at: 12.3s\n"
           "INFO 11-29 09:22:51 simulator.py:84] Writing output\n"
           "\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02.11\n"
           "\tMaximum resident set size (kbytes): 4870144\n")
    assert bench._vidur_event_loop_s(log) == 20.0
    wall, rss = bench._time_v(log)
    assert wall == pytest.approx(62.11) and rss == pytest.approx(4870144 / 1024)


def test_unknown_case_is_a_clean_error(capsys):
    assert main(["bench", "--cases", "blis-2k"]) == 2
    err = capsys.readouterr().err
    assert "blis-2k" in err and "blis-1k" in err and "Traceback" not in err
    assert main(["bench", "--quick", "--cases", "blis-1k"]) == 2


def test_case_names_take_spaces_or_commas_each_once():
    assert bench.case_names(["blis-1k,azure-1k", "blis-1k", "swap-60s"]) == ["blis-1k", "azure-1k", "swap-60s"]
    assert bench.case_names(None) == []
    with pytest.raises(ConfigError, match="empty item in a comma list"):  # a name went missing: not skipped
        bench.case_names(["swap-60s,"])


def test_an_out_that_the_plot_would_overwrite_is_refused(capsys, monkeypatch, tmp_path):
    """`bench --out r.png` (the plot defaults to --out with .png) or `--plot` equal to --out
    wrote the plot over the JSON results."""
    monkeypatch.setattr(bench, "run_case_subprocess", lambda *a: pytest.fail("a case ran"))
    for extra in (["--out", str(tmp_path / "r.png")], ["--out", str(tmp_path / "r.json"), "--plot",
                                                       str(tmp_path / "." / "r.json")]):
        assert main(["bench", "--cases", "blis-1k", *extra]) == 2
        assert "the plot goes to the same file" in capsys.readouterr().err


def test_cases_that_name_no_case_are_refused_not_the_default_set(capsys, monkeypatch):
    """`--cases ,` (or an empty string from a script's variable) named no case and the whole
    default set ran instead (minutes)."""
    monkeypatch.setattr(bench, "run_case_subprocess", lambda *a: pytest.fail("a case ran"))
    for cases in (",", " , "):
        assert main(["bench", "--cases", cases]) == 2
        assert "empty item in a comma list" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # an empty value, refused for every flag by the parser
        main(["bench", "--cases", ""])
    assert e.value.code == 2 and "argument --cases: an empty value is not allowed" in capsys.readouterr().err


def test_profile_without_pyinstrument_fails_before_any_case_runs(capsys, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyinstrument" else real(name, *a))

    def no_case(*a, **k):
        raise AssertionError("a case ran")

    monkeypatch.setattr(bench, "run_case_subprocess", no_case)
    assert main(["bench", "--cases", "blis-1k", "--profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pyinstrument" in err and "pip install -e '.[profile]'" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--out", "--plot"])
@pytest.mark.parametrize("where", ["under a file", "a folder"])
def test_an_unwritable_output_fails_before_any_case_runs(capsys, monkeypatch, tmp_path, flag, where):
    """--out / --plot under a file, or naming a folder, was a traceback (FileExistsError,
    IsADirectoryError) after every case had run: minutes of results lost."""
    def no_case(*a, **k):
        raise AssertionError("a case ran")

    monkeypatch.setattr(bench, "run_case_subprocess", no_case)
    (tmp_path / "f").write_text("")
    path = tmp_path / "f" / "x.json" if where == "under a file" else tmp_path
    assert main(["bench", "--cases", "blis-1k", flag, str(path)]) == 2
    err = capsys.readouterr().err
    why = "is not a folder" if where == "under a file" else "it is a folder"
    assert f"{flag} {str(path)!r} is not allowed" in err.replace("\n", "") and why in err and "Traceback" not in err


@pytest.mark.parametrize("argv, flags", [
    (["--qps", "2"], "--qps"),
    (["--peer-requests", "500", "--peer-dir", "x"], "--peer-requests, --peer-dir"),
    (["--env-steps", "50"], "--env-steps"),
    (["--train-steps", "50", "--train-envs", "2"], "--train-steps, --train-envs"),
])
def test_options_of_a_part_that_does_not_run_are_refused(capsys, monkeypatch, argv, flags):
    """--qps, --peer-requests and --peer-dir without --peer, and --env-steps without --envs,
    were silently ignored (the run measured something else than asked)."""
    def no_case(*a, **k):
        raise AssertionError("a case ran")

    monkeypatch.setattr(bench, "run_case_subprocess", no_case)
    assert main(["bench", "--cases", "blis-1k", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{flags}: not allowed here" in err and "Traceback" not in err


def test_bench_train_reports_training_beside_cartpole_in_one_run(capsys, monkeypatch, tmp_path):
    """--train runs no simulator case by default, puts the rows in the JSON and prints each
    environment's rate relative to CartPole-v1 (measured in the same run)."""
    rows = [{"env": e, "part": p, "n_envs": 8 if p == "training" else 1, "steps": 100, "cpu_s": c, "wall_s": c,
             "steps_per_cpu_s": 100 / c, "steps_per_wall_s": 100 / c}
            for e, p, c in (("kvsched/Scheduling-v0", "training", 0.1), ("kvsched/Scheduling-v0", "environment", 0.05),
                            ("CartPole-v1", "training", 0.01), ("CartPole-v1", "environment", 0.001))]
    monkeypatch.setattr(bench, "run_case_subprocess", lambda *a, **k: (_ for _ in ()).throw(AssertionError("case")))
    monkeypatch.setattr(bench, "run_training_subprocess", lambda steps, n: rows)
    out = tmp_path / "b.json"
    assert main(["bench", "--train", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0.100" in printed  # 1,000 / 10,000 steps per CPU-s
    # no case ran: the notes about the cases' memory column and unmeasured environments are not printed
    assert "Memory:" not in printed and "not measured in this run" not in printed
    import json

    assert json.loads(out.read_text())["training"] == rows


def test_list_names_every_case(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in bench.CASES:
        assert name in out


@pytest.mark.skipif(os.environ.get("KVSCHED_RUN_PEERS") != "1",
                    reason="runs the Vidur peer (minutes; installs Vidur); set KVSCHED_RUN_PEERS=1")
def test_peer_vidur_side_by_side(tmp_path):
    out = tmp_path / "peer.json"
    assert main(["bench", "--peer", "vidur", "--peer-requests", "200", "--qps", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["peer"]["runs"][0]
    assert run["vidur"]["completed"] == 200 and run["kvsched"]["finished"] == 200
    assert run["vidur"]["num_blocks"] in (None, run["kvsched_kv_blocks"])
    for sim in ("vidur", "kvsched"):
        for metric in ("ttft", "tpot", "e2e"):
            assert run[sim]["latency_s"][metric]["p50"] > 0


def test_vidur_dir_is_beside_the_checkout_and_scenario_params_reach_simulate():
    from pathlib import Path

    repo = Path(bench.__file__).resolve().parent.parent
    assert bench.DEFAULT_VIDUR_DIR == repo.parent / "shared" / "peers" / "vidur"
    prep = bench._scenario_file("long-context-nvme-tiered", (0.0, 5.0))()
    assert prep.policy_params == {"tier_aware_preemption": True, "prefetch": True}
    assert bench._scenario_file("long-context-swap-dram", (0.0, 5.0))().policy_params is None


def test_env_throughput_measures_steps_and_splits_simulator_from_overhead():
    """Every environment steps the requested number of times; the simulator's CPU share and the
    environment's own overhead are both positive and add up to the timed env.step CPU time."""
    from kvsched.agents import throughput

    rows = throughput.measure_all(steps=25, agents=("random", "fcfs"))
    assert [(r["env"], r["agent"]) for r in rows] == [
        ("kvsched/Scheduling-v0", "random"), ("kvsched/Scheduling-v0", "fcfs"),
        ("kvsched/Knobs-v0", "random"), ("kvsched/Routing-v0", "random")]
    for r in rows:
        assert r["steps"] == 25
        assert r["sim_us_per_step"] > 0 and r["overhead_us_per_step"] > 0
        assert (r["sim_us_per_step"] + r["overhead_us_per_step"]) * 25 / 1e6 == pytest.approx(r["cpu_s"])
    # on Routing-v0 a heuristic agent is a router: a scheduler's name is refused, saying where it goes
    with pytest.raises(ValueError, match="expected a router name .* policy='fcfs'"):
        throughput.measure("kvsched/Routing-v0", "fcfs", steps=1)


@pytest.mark.parametrize("argv, fragment", [
    (["--steps", "-5"], "--steps -5 is not allowed: expected an integer >= 1"),
    (["--envs", "kvsched/Nope-v0"],
     "--envs: unknown environment(s) ['kvsched/Nope-v0']; allowed: kvsched/Scheduling-v0"),
    (["--agents", "random,bogus"], "--agents: unknown agent(s) ['bogus']; allowed: random, "),  # then the policies
])
def test_env_throughput_command_line_refuses_bad_flags(argv, fragment, capsys):
    """`python -m kvsched.agents.throughput` exits 2 naming the flag (it raised a traceback, or for
    an unknown environment id Gymnasium's NameNotFound)."""
    from kvsched.agents import throughput

    with pytest.raises(SystemExit) as e:
        throughput.main(argv)
    assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_env_throughput_says_which_agent_pairs_it_skips(capsys):
    """A policy agent asked for on an environment it cannot act in is named on stderr, not
    dropped silently (it printed nothing and exited 0)."""
    from kvsched.agents import throughput

    throughput.main(["--steps", "2", "--envs", "kvsched/Routing-v0", "--agents", "random,lars", "--json"])
    cap = capsys.readouterr()
    rows = json.loads(cap.out.strip().splitlines()[-1])
    assert [(r["env"], r["agent"], r["steps"]) for r in rows] == [("kvsched/Routing-v0", "random", 2)]
    assert "not measured (policy agents act only in kvsched/Scheduling-v0): lars on kvsched/Routing-v0" in cap.err
