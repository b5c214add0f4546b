"""A run on a GPU other than the H100 says where its cost parameters come from (the H100's are
fitted on real vLLM runs; the A100-80GB's kernel fields on operator profiles; other GPUs run on
literature defaults): `kvsched simulate` and `compare` used to print nothing about it, and
`kvsched presets` listed the GPUs without it (docs/fidelity.md, "GPUs other than the H100")."""

from __future__ import annotations

import pytest

from kvsched.experiments.cli import main


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note: cost parameters for")]


@pytest.mark.parametrize("gpu, expected", [
    ("L40S", "note: cost parameters for L40S: no calibration"),
    ("A100-80GB", "note: cost parameters for A100-80GB: its shipped calibration"),
    ("H100-SXM", None),
])
def test_simulate_names_the_cost_parameters_of_a_gpu_not_calibrated_on_vllm_runs(gpu, expected, capsys):
    assert main(["simulate", "--gpu", gpu, "--model", "RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8",
                 "--max-requests", "5", "--no-progress"]) == 0
    notes = _notes(capsys.readouterr().err)
    if expected is None:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith(expected)
        assert "not validated" in notes[0] and "docs/fidelity.md#gpus-other-than-the-h100" in notes[0]


def test_a_partial_scenario_cost_notes_the_defaults_it_takes_and_compare_notes_a_default(tmp_path, capsys):
    """A ``cost:`` mapping of a few fields takes every other field from the GPU's defaults
    (spec_io), so the note still says where those come from, naming the fields set."""
    base = "name: t\ntrace: azure-conv-2023\nmax_requests: 5\ninstance:\n  model: Qwen2.5-7B\n  gpu: L40S\n"
    (tmp_path / "own.yaml").write_text(base + "  cost: {mbu: 0.7}\n")
    assert main(["simulate", "--scenario", str(tmp_path / "own.yaml"), "--no-progress"]) == 0
    notes = _notes(capsys.readouterr().err)
    assert len(notes) == 1 and notes[0].startswith("note: cost parameters for L40S other than mbu (set away from the "
                                                   "defaults): no calibration")
    (tmp_path / "a100.yaml").write_text(base.replace("L40S", "A100-80GB") + "  cost: {step_time_sigma: 0.0}\n")
    assert main(["simulate", "--scenario", str(tmp_path / "a100.yaml"), "--no-progress"]) == 0
    notes = _notes(capsys.readouterr().err)  # a field given at its default value: every field is a default
    assert len(notes) == 1 and notes[0].startswith("note: cost parameters for A100-80GB: its shipped calibration")
    (tmp_path / "default.yaml").write_text(base)
    assert main(["compare", "--scenario", str(tmp_path / "default.yaml"), "--policies", "fcfs", "--seeds", "1",
                 "--no-progress"]) == 0
    notes = _notes(capsys.readouterr().err)
    assert len(notes) == 1 and notes[0].startswith("note: cost parameters for L40S: no calibration")


def test_presets_lists_each_gpus_cost_parameters_and_the_quantized_checkpoint_names(capsys):
    assert main(["presets"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert "H100-SXM cost parameters: its shipped calibration, fitted on real vLLM runs" in lines
    assert any(line.startswith("A100-80GB cost parameters: its shipped calibration (version") for line in lines)
    assert any(line.startswith("L40S cost parameters: no calibration") for line in lines)
    assert any(line.startswith("A100-80GB: fp8 TFLOPS = bf16 TFLOPS") for line in lines)
    assert not any(line.startswith("H100-SXM: fp8 TFLOPS") for line in lines)
    assert any("RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8 -> Qwen2.5-7B-INT8" in line for line in lines)
