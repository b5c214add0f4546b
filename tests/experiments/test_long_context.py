"""The long-context comparison tool (``python -m kvsched.experiments.long_context``): bad input is one
line and exit status 2, a request longer than the instance's KV is refused before any run naming
the limit, and a small comparison writes its table and ratios."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.parallelism import ParallelSpec
from kvsched.envs.sim.specs import InstanceSpec, get_gpu, get_model
from kvsched.experiments import long_context

TINY = """name: {name}
synthetic: {{rate_per_s: 2.0, duration_s: 6, long_fraction: 0.2, long_min_tokens: 60000, long_max_tokens: 120000}}
instance: {{model: Llama-3.1-8B, gpu: H100-SXM, parallel: {parallel}}}
policy: {policy}
metrics: {{long_prompt_tokens: 50000}}
seed: 2
"""


def test_a_request_longer_than_the_kv_is_refused_naming_the_limit():
    spec = InstanceSpec(model=get_model("Llama-3.1-8B"), gpu=get_gpu("H100-SXM"), parallel=ParallelSpec(pp_stages=2))
    with pytest.raises(ConfigError) as e:
        long_context.check_capacity("s", spec, np.array([10, spec.model_len_limit]), np.array([5, 1]))
    msg = str(e.value)
    assert "\n" not in msg and "request 1" in msg and f"{spec.model_len_limit:,} tokens" in msg
    long_context.check_capacity("s", spec, np.array([10, spec.model_len_limit - 1]), np.array([5, 1]))


@pytest.mark.parametrize("argv, text", [(["--scenarios", "only-one"], "--scenarios"),
                                        (["--seeds", "0"], "--seeds"),
                                        (["--scenarios", "no-such-file,long-context-esp"], "no-such-file")])
def test_bad_input_is_one_line_and_exit_status_2(argv, text, capsys):
    assert long_context.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err


def test_an_out_that_is_a_file_is_one_line_and_exit_status_2(tmp_path, capsys):
    f = tmp_path / "results"
    f.write_text("")
    assert long_context.main(["--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "not a file" in err


def test_a_small_comparison_writes_its_rows_and_ratios(tmp_path, capsys):
    a = tmp_path / "medha.yaml"
    b = tmp_path / "esp.yaml"
    a.write_text(TINY.format(name="m", parallel="{pp_stages: 2, kvp_groups: 2}", policy="lars"))
    b.write_text(TINY.format(name="e", parallel="{esp_groups: 4}", policy="nonpreemptive"))
    out_dir = tmp_path / "results"  # a missing --out folder is created, as kvsched's commands do
    assert long_context.main(["--scenarios", f"{a},{b}", "--out", str(out_dir)]) == 0
    out = json.loads((out_dir / "long_context.json").read_text())
    assert [r["scenario"] for r in out["rows"]] == ["m", "e"]
    assert out["rows"][0]["gpus"] == out["rows"][1]["gpus"] == 4
    assert out["ratios"][0]["short_ttft_p99_s"] > 1  # the non-preemptive baseline makes short requests wait
    assert (out_dir / "long_context.csv").read_text().count("\n") == 3


@pytest.mark.parametrize("make, text", [
    (lambda a, b, c: ["--scenarios", f"{a},{b},"], "empty item"),
    (lambda a, b, c: ["--scenarios", f"{a},{b}", "--rate-scales", "1,,2"], "--rate-scales"),
    (lambda a, b, c: ["--scenarios", f"{a},{b}", "--rate-scales", "1,1"], "--rate-scales"),
    (lambda a, b, c: ["--scenarios", f"{a},{a}"], "both named"),
    (lambda a, b, c: ["--scenarios", f"{a},{c}"], "one instance"),
    (lambda a, b, c: ["--scenarios", f"{a},no-such-file"], "no-such-file"),
])
def test_bad_scenarios_or_scales_are_refused_before_any_run(tmp_path, capsys, monkeypatch, make, text):
    """Malformed lists, duplicates, a scenario with several instances or roles (run_one would run
    its instance alone) and a missing baseline are refused before the first scenario runs."""
    monkeypatch.setattr(long_context, "run_one", lambda *a, **k: pytest.fail("a scenario ran"))
    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text(TINY.format(name="a", parallel="{pp_stages: 2}", policy="lars"))
    b.write_text(TINY.format(name="b", parallel="{esp_groups: 2}", policy="nonpreemptive"))
    c.write_text(TINY.format(name="c", parallel="null", policy="fcfs")
                 + "cluster: {prefill: {count: 1}, decode: {count: 1}}\n")
    assert long_context.main(make(a, b, c)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err
