"""A model read from a Hugging Face config.json says what was read and derived from it: `kvsched
simulate` and `compare` used to print only its name, so a sliding-window cap of the context (Mistral-7B-v0.1:
4,096 of 32,768 tokens, longer requests rejected), the parameter count or the quantized weights were
visible only in run.json (docs/cli.md#presets-and-traces). `--model`'s help and `kvsched presets` now say
that such a path is accepted."""

from __future__ import annotations

import json

from kvsched.experiments.cli import main

MISTRAL_V01 = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
               "max_position_embeddings": 32768, "sliding_window": 4096, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16"}


def _model_notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note: model ")]


def test_simulate_notes_a_config_models_parameters_dtype_and_capped_context(tmp_path, capsys):
    (tmp_path / "Mistral-7B-v0.1").mkdir()
    (tmp_path / "Mistral-7B-v0.1" / "config.json").write_text(json.dumps(MISTRAL_V01))
    assert main(["simulate", "--model", str(tmp_path / "Mistral-7B-v0.1"), "--max-requests", "5",
                 "--no-progress"]) == 0
    notes = _model_notes(capsys.readouterr().err)
    assert len(notes) == 1
    assert notes[0].startswith("note: model Mistral-7B-v0.1: 7.24 B parameters, bf16 weights, context 4,096 tokens; ")
    assert "config.json" in notes[0] and "capped at the sliding window of 4096 tokens (otherwise 32768)" in notes[0]
    assert main(["simulate", "--max-requests", "5", "--no-progress"]) == 0  # a preset: no note
    assert _model_notes(capsys.readouterr().err) == []


def test_compare_notes_a_quantized_moe_config_model_once(tmp_path, capsys):
    cfg = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
           "max_position_embeddings": 8192, "num_experts": 60, "num_experts_per_tok": 4,
           "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
           "quantization_config": {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {
               "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"},
                           "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "s.yaml").write_text(
        "name: t\ntrace: azure-conv-2023\nmax_requests: 5\nn_instances: 2\ninstance:\n"
        f"  model: {{hf_config: {tmp_path / 'config.json'}, name: qmoe, routing_skew: 0.5}}\n  gpu: H100-SXM\n")
    assert main(["compare", "--scenario", str(tmp_path / "s.yaml"), "--policies", "fcfs", "--seeds", "1",
                 "--no-progress"]) == 0
    notes = _model_notes(capsys.readouterr().err)
    assert len(notes) == 1  # two instances, one model
    assert notes[0].startswith("note: model qmoe: 14.32 B parameters (2.69 B active; 60 experts, top-4 + 4 shared, "
                               "routing_skew 0.5), fp8 weights on the decoder Linear layers, context 8,192 tokens; HF")


def test_model_help_and_presets_say_a_config_json_path_is_accepted(capsys):
    try:
        main(["simulate", "--help"])
    except SystemExit:
        pass
    assert "Hugging Face config.json" in " ".join(capsys.readouterr().out.split())
    assert main(["presets"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Any other model: --model (or a scenario's model:) takes the path of its Hugging Face config.json" in out


def test_a_config_path_or_name_with_brackets_is_printed_as_written_not_as_markup(tmp_path, capsys):
    """A model read from a folder whose path holds ``[`` and ``/`` (``m[/b]x``: the folder ``m[``
    holding ``b]x``) crashed `kvsched simulate` with rich's MarkupError (``[/b]`` read as a closing
    tag), and a name like ``m[bold]y`` was printed as ``my``: the note, the header and the table
    title are console markup."""
    odd = tmp_path / "m[" / "b]x"
    odd.mkdir(parents=True)
    (odd / "config.json").write_text(json.dumps(MISTRAL_V01))
    assert main(["simulate", "--model", str(odd), "--max-requests", "3", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert str(odd / "config.json") in captured.err and " x b]x / H100-SXM" in captured.err
    (tmp_path / "s.yaml").write_text(
        "name: t\ntrace: azure-conv-2023\nmax_requests: 3\nn_instances: 1\ninstance:\n"
        f"  model: {{hf_config: '{odd}', name: 'm[bold]y [/]'}}\n  gpu: H100-SXM\n")
    assert main(["simulate", "--scenario", str(tmp_path / "s.yaml"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "note: model m[bold]y [/]: 7.24 B" in captured.err and "1 x m[bold]y [/] / H100-SXM" in captured.err
    assert "1 x m[bold]y [/] / H100-SXM" in captured.out  # the table title
    assert main(["compare", "--scenario", str(tmp_path / "s.yaml"), "--policies", "fcfs", "--seeds", "1",
                 "--no-progress"]) == 0
    assert "note: model m[bold]y [/]: 7.24 B" in capsys.readouterr().err
