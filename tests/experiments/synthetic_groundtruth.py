"""Builders of a synthetic ground-truth directory in the layout of ``shared/groundtruth`` (for the
tests that read runs never seen before: test_groundtruth_unseen.py, test_groundtruth_model_configs.py)."""

from __future__ import annotations

import json
from pathlib import Path

SP = {"num_unique_system_prompts": 2, "num_users_per_system_prompt": 2, "system_prompt_len": 32,
      "question_len": 200, "output_len": 12, "enable_multi_turn_chat": True}
"""An inference-perf shared-prefix workload: 4 short prompts, 12 output tokens."""
STAGES = [{"rate": 2.0, "duration": 6}]


def measured(scale: float) -> dict[str, float]:
    """Measured values of one stage (ms times ``scale``; the stage JSON holds seconds: 1e-3)."""
    return {"ttft_mean": 30 * scale, "ttft_p90": 40 * scale, "ttft_p99": 50 * scale, "itl_mean": 8 * scale,
            "e2e_mean": 120 * scale, "e2e_p90": 130 * scale, "e2e_p99": 140 * scale}


def csv_rows(folder: str, model: str = "Qwen/Qwen2.5-7B-Instruct", workload: str = "codegen",
             hardware: str = "H100", precision: str = "FP16", **cols) -> list[dict]:
    """The sim-to-real csv rows of one stage-0 run (every metric measured as :func:`measured` (1.0),
    a vidur prediction equal to it), TP1 at a 2,048-token budget unless ``cols`` say otherwise."""
    return [{"simulator": "vidur", "experiment_folder": f"/x/{folder}", "model": model, "workload": workload,
             "stage_index": 0, "metric_name": m, "predicted": v, "actual": v, "exp_id": folder.split("-")[0],
             "hardware": hardware, "precision": precision, "tp": 1, "max_num_batched_tokens": 2048, **cols}
            for m, v in measured(1.0).items()]


def make_root(root: Path, blis: list | None = None) -> Path:
    """The directory's skeleton: README, blis experiments file (``blis`` entries), sim_to_real/."""
    (root / "blis").mkdir()
    (root / "sim_to_real").mkdir()
    (root / "README.md").write_text("synthetic ground truth for tests\n")
    (root / "blis" / "trained_physics_iter29_experiments.json").write_text(json.dumps({"experiments": blis or []}))
    return root


def write_training_run(root: Path, folder: str, model_id: str = "meta-llama/Llama-2-7b-hf",
                       shared_prefix: dict | None = SP, exp_config_extra: str = "") -> Path:
    """A ``training_default_args/<folder>/`` run at TP1 with one measured stage; its profile.yaml
    holds ``shared_prefix`` and :data:`STAGES` (no profile.yaml when None); ``exp_config_extra``
    (YAML lines) is appended to its exp-config.yaml."""
    d = root / "training_default_args" / folder
    (d / "results").mkdir(parents=True)
    (d / "exp-config.yaml").write_text(f"model: {model_id}\ntensor_parallelism: 1\n"
                                       "max_model_len: 4096\nmax_num_batched_tokens: 2048\nmax_num_seqs: 128\n"
                                       + exp_config_extra)
    v = measured(1e-3)
    (d / "results" / "stage_0_lifecycle_metrics.json").write_text(json.dumps({
        "load_summary": {"count": 12}, "failures": {"count": 0},
        "successes": {"latency": {"time_to_first_token": {"mean": v["ttft_mean"], "p90": v["ttft_p90"],
                                                          "p99": v["ttft_p99"]},
                                  "request_latency": {"mean": v["e2e_mean"], "p90": v["e2e_p90"],
                                                      "p99": v["e2e_p99"]}},
                      "output_len": {"mean": 12.0},
                      "prompt_len": {"mean": 1.0, "min": 1.0, "max": 1.0, "p10": 1.0, "p90": 1.0}}}))
    if shared_prefix is not None:
        (d / "profile.yaml").write_text(json.dumps(
            {"data": {"shared_prefix": shared_prefix, "type": "shared_prefix"},
             "load": {"stages": STAGES, "type": "constant"}}))
    return d
