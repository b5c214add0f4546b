"""Calibrating a GPU's kernel-side cost parameters from Vidur-format operator profiles
(``kvsched calibrate --operator-profiles``, experiments/operator_profiles.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsched.envs.sim.calibration import HOST_FIELDS, calibrated_cost_params, load_calibration
from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.experiments.operator_profiles import LAYER_OPS, fit_operator_profiles, load_operator_profiles

REPO = Path(__file__).resolve().parents[2]
SHARED_PROFILES = Path(os.environ.get("KVSCHED_SHARED", REPO.parent / "shared")) / "peers" / "vidur-profiling"
MODEL = get_model("Llama-2-70B")
A100 = get_gpu("A100-80GB")
TRUE = {"mfu_max": 0.71, "mfu_half_tokens": 80.0, "mbu": 0.64}
TOKENS = list(range(1, 129)) + [192, 256, 384, 512, 768, 1024, 1536, 2048]


def _kernel_s(tp: int, n, pairs, kv) -> np.ndarray:
    b = CostModel(InstanceSpec(model=MODEL, gpu=A100, tp=tp, hbm_kv_blocks=1024,
                               cost=CostParams(step_overhead_s=0.0, **TRUE))).step_breakdown(n, pairs, kv)
    return np.maximum(b["compute_s"], b["memory_s"])


def _write_profiles(root: Path, *, mlp_edit=None, model_dir="meta-llama/Llama-2-70b-hf") -> Path:
    """A Vidur-layout directory whose steps are exactly the roofline of TRUE (all of a layer's time
    put in mlp_up_proj, the embedding 0; attention = the full step minus the layer operators)."""
    rows = []
    for tp in (2, 4):
        n = np.array(TOKENS, dtype=float)
        per_layer_ms = _kernel_s(tp, n, 0 * n, 0 * n) * 1e3 / MODEL.n_layers
        for t, ms in zip(TOKENS, per_layer_ms):
            row = {f"time_stats.{op}.median": 0.0 for op in LAYER_OPS} | {"time_stats.emb.median": 0.0}
            row.update({"time_stats.mlp_up_proj.median": ms, "n_head": 64, "n_kv_head": 8, "n_embd": 8192,
                        "n_expanded_embd": 28672, "num_tokens": t, "num_tensor_parallel_workers": tp})
            rows.append(row)
    mlp = pd.DataFrame(rows)
    if mlp_edit:
        mlp = mlp_edit(mlp)
    folder = root / "compute" / "a100" / model_dir
    folder.mkdir(parents=True)
    mlp.to_csv(folder / "mlp.csv", index=False)
    attn = []
    for b in (1, 8, 32, 100, 128):
        for ctx in (64, 1024, 4000):
            full = _kernel_s(2, np.array([b * 1.0]), np.array([b * ctx * 1.0]), np.array([b * ctx * 1.0]))[0]
            lin = _kernel_s(2, np.array([b * 1.0]), np.zeros(1), np.zeros(1))[0]
            attn.append({"num_tensor_parallel_workers": 2, "is_prefill": False, "batch_size": b, "kv_cache_size": ctx,
                         "prefill_chunk_size": 0, "time_stats.attn_decode.median": (full - lin) * 1e3 / MODEL.n_layers,
                         "time_stats.attn_prefill.median": np.nan})
    for c in (64, 512, 2048):
        for cached in (0, 1024):
            full = _kernel_s(2, np.array([c * 1.0]), np.array([c * (cached + c / 2.0)]),
                             np.array([cached + c * 1.0]))[0]
            lin = _kernel_s(2, np.array([c * 1.0]), np.zeros(1), np.zeros(1))[0]
            attn.append({"num_tensor_parallel_workers": 2, "is_prefill": True, "batch_size": 1, "kv_cache_size": cached,
                         "prefill_chunk_size": c, "time_stats.attn_decode.median": np.nan,
                         "time_stats.attn_prefill.median": (full - lin) * 1e3 / MODEL.n_layers})
    pd.DataFrame(attn).to_csv(folder / "attention.csv", index=False)
    net = root / "network" / "a100_dgx"
    net.mkdir(parents=True)
    sizes = 2.0 ** np.arange(11, 27)
    ar = [{"num_workers": tp, "devices_per_node": tp, "size": s, "time_stats.all_reduce.median":
           1e3 * (2 * (tp - 1) * 5e-6 + 2 * (tp - 1) / tp * s / (A100.nvlink_bytes_per_s * 0.5))}
          for tp in (2, 4, 8) for s in sizes]
    ar.append({"num_workers": 16, "devices_per_node": 8, "size": 2048, "time_stats.all_reduce.median": 1.0})
    pd.DataFrame(ar).to_csv(net / "all_reduce.csv", index=False)
    return root


def test_a_fit_on_profiles_made_from_known_parameters_recovers_them(tmp_path):
    """Steps composed from the profiles equal the roofline of TRUE, so the kernel fit finds TRUE and
    the diagnostic NCCL fit finds the ring that made the network rows (the 16-GPU, two-node rows
    are left out); the calibration keeps every non-kernel field of the host calibration."""
    p = load_operator_profiles(_write_profiles(tmp_path))
    assert p.model.name == "Llama-2-70B" and p.device == "a100" and sorted(p.all_reduce) == [2, 4, 8]
    host = dataclasses.replace(CostParams(), request_overhead_s=1.234e-3, step_overhead_s=0.9e-3,
                               allreduce_bw_efficiency=0.3)
    fit = fit_operator_profiles(p, A100, host)
    for name, want in TRUE.items():
        assert getattr(fit.cost, name) == pytest.approx(want, rel=2e-3), name
    assert max(v for k, v in fit.group_mape.items() if not k.startswith("all-reduce")) < 0.2
    assert fit.allreduce is not None
    assert fit.allreduce.values["allreduce_bw_efficiency"] == pytest.approx(0.5, rel=1e-2)
    assert fit.allreduce.values["allreduce_hop_latency_s"] == pytest.approx(5e-6, rel=1e-2)
    assert (fit.cost.request_overhead_s, fit.cost.step_overhead_s, fit.cost.allreduce_bw_efficiency) == \
        (1.234e-3, 0.9e-3, 0.3)


@pytest.mark.parametrize("edit, match", [
    (lambda df: df.drop(columns=["time_stats.mlp_act.median"]), "missing column 'time_stats.mlp_act.median'"),
    (lambda df: df.assign(n_embd=4096), "n_embd = \\[4096\\] does not match preset Llama-2-70B"),
    (lambda df: df.assign(**{"time_stats.add.median": -1.0}), "time_stats.add.median row 0 = -1.0"),
    (lambda df: df.assign(num_tokens=0), "num_tokens row 0 = 0 is not allowed"),
])
def test_a_bad_profile_is_a_one_line_error_naming_the_field(tmp_path, edit, match):
    root = _write_profiles(tmp_path, mlp_edit=edit)
    with pytest.raises(ConfigError, match=match) as e:
        load_operator_profiles(root)
    assert "\n" not in str(e.value)


def test_a_directory_that_is_not_one_profiled_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        load_operator_profiles(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="no compute/<device>/<org>/<model>/mlp.csv"):
        load_operator_profiles(tmp_path)
    with pytest.raises(ConfigError, match="not a kvsched model preset.*kvsched presets lists them"):
        load_operator_profiles(_write_profiles(tmp_path / "a", model_dir="acme/unknown-9b"))
    root = _write_profiles(tmp_path / "b")
    other = root / "compute" / "h100" / "meta-llama" / "Llama-2-70b-hf"
    other.mkdir(parents=True)
    (other / "mlp.csv").write_text((root / "compute/a100/meta-llama/Llama-2-70b-hf/mlp.csv").read_text())
    with pytest.raises(ConfigError, match="2 mlp.csv profiles"):
        load_operator_profiles(root)


def test_the_cli_writes_a_calibration_with_the_kernel_fields_fitted_and_the_host_fields_of_the_h100(tmp_path, capsys):
    from kvsched.experiments.cli import main

    root = _write_profiles(tmp_path / "p")
    out = tmp_path / "A100.json"
    assert main(["calibrate", "--gpu", "A100-80GB", "--operator-profiles", str(root), "--version", "3",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # the NCCL fit is printed beside a table showing other all-reduce fields: it must say it is not applied
    assert "all-reduce fit (NCCL ring; a diagnostic, not applied)" in printed
    assert all("not applied" in line for line in printed.splitlines() if "all-reduce tp" in line)
    cal = load_calibration(out)
    h100 = calibrated_cost_params("H100-SXM")
    assert cal.gpu == "A100-80GB" and cal.version == 3 and set(cal.fitted) == set(TRUE)
    assert cal.cost.mbu == pytest.approx(TRUE["mbu"], rel=2e-3)
    assert all(getattr(cal.cost, f) == getattr(h100, f) for f in HOST_FIELDS)
    assert cal.cost.allreduce_bw_efficiency == h100.allreduce_bw_efficiency  # the NCCL fit is not applied
    assert any("NCCL ring fit" in n for n in cal.notes)
    assert "compute/a100/meta-llama/Llama-2-70b-hf/mlp.csv" in cal.train
    assert json.loads(out.read_text())["format"] == "kvsched-calibration/1"
    for argv, match in ((["--host-from", "A100-80GB"], "it is the GPU being calibrated"),
                        (["--host-from", "L40S"], "ships no calibration for L40S"),
                        (["--tail-only"], "--tail-only with --operator-profiles")):
        capsys.readouterr()
        assert main(["calibrate", "--gpu", "A100-80GB", "--operator-profiles", str(root), "--out", str(out),
                     *argv]) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1


@pytest.mark.skipif(not (SHARED_PROFILES / "README.md").is_file(),
                    reason="Vidur's A100 profiles not found at ../shared/peers/vidur-profiling (or $KVSCHED_SHARED)")
def test_the_shipped_a100_calibration_is_what_the_command_fits_on_vidurs_a100_profiles():
    """A regression guard: the kernel fields of the shipped A100-80GB file are the fit of Vidur's
    measured A100 operator times, within the errors reported in docs/fidelity.md."""
    shipped = load_calibration(Path(__file__).resolve().parents[2] / "envs/sim/calibration/A100-80GB.json")
    fit = fit_operator_profiles(load_operator_profiles(SHARED_PROFILES), A100, calibrated_cost_params("H100-SXM"))
    for name in shipped.fitted:
        assert getattr(fit.cost, name) == pytest.approx(getattr(shipped.cost, name), rel=1e-6), name
    kernel = {k: v for k, v in fit.group_mape.items() if not k.startswith("all-reduce")}
    assert set(kernel) == {"layers tp2", "layers tp4", "layers tp8", "decode tp2", "prefill tp2"}
    assert max(kernel.values()) < 7.0


def _edit_csv(path: Path, column: str, value, row: int = 0) -> None:
    df = pd.read_csv(path)
    df[column] = df[column].astype(object)
    df.loc[row, column] = value
    df.to_csv(path, index=False)


_MLP = "compute/a100/meta-llama/Llama-2-70b-hf/mlp.csv"
_ATTN = "compute/a100/meta-llama/Llama-2-70b-hf/attention.csv"
_AR = "network/a100_dgx/all_reduce.csv"


@pytest.mark.parametrize("file, column, value, match", [
    (_MLP, "time_stats.add.median", "abc", "time_stats.add.median row 0 = 'abc' is not allowed: expected a finite"),
    (_MLP, "num_tokens", float("nan"), "num_tokens row 0 = nan is not allowed: expected an integer >= 1"),
    (_MLP, "num_tokens", 1.5, "num_tokens row 0 = 1.5 is not allowed"),
    (_MLP, "num_tensor_parallel_workers", 2.5, "num_tensor_parallel_workers row 0 = 2.5 is not allowed"),
    (_MLP, "num_tensor_parallel_workers", "two", "num_tensor_parallel_workers row 0 = 'two'"),
    (_MLP, "n_head", float("nan"), "n_head row 0 = nan is not allowed"),
    (_ATTN, "batch_size", -3, "batch_size row 0 = -3 is not allowed: expected an integer >= 1"),
    (_ATTN, "kv_cache_size", "x", "kv_cache_size row 0 = 'x' is not allowed: expected an integer >= 0"),
    (_ATTN, "is_prefill", 1, "is_prefill row 0 = '1' is not allowed: expected True or False"),
    (_ATTN, "time_stats.attn_decode.median", float("inf"), "time_stats.attn_decode.median row 0 = inf"),
    (_AR, "size", float("nan"), "size row 0 = nan is not allowed: expected an integer >= 1"),
    (_AR, "num_workers", "x", "num_workers row 0 = 'x' is not allowed"),
    (_AR, "time_stats.all_reduce.median", 0.0, "time_stats.all_reduce.median row 0 = 0.0 is not allowed: "
                                               "expected a finite time > 0"),
])
def test_a_cell_that_is_not_a_number_in_range_is_a_one_line_error_naming_file_column_row_and_value(
        tmp_path, file, column, value, match):
    """Text, NaN, inf, fractions and out-of-range values in any numeric column are refused, never
    dropped (pandas' groupby drops NaN keys), truncated (int(2.5)) or passed on as a traceback."""
    root = _write_profiles(tmp_path)
    _edit_csv(root / file, column, value)
    with pytest.raises(ConfigError, match=match) as e:
        load_operator_profiles(root)
    assert "\n" not in str(e.value) and Path(file).name in str(e.value)


@pytest.mark.parametrize("column, value, row", [("batch_size", 4096, 0), ("prefill_chunk_size", 4096, 15)])
def test_attention_rows_beyond_the_measured_layer_tokens_are_refused_not_extrapolated(tmp_path, column, value, row):
    root = _write_profiles(tmp_path)
    _edit_csv(root / _ATTN, column, value, row)
    with pytest.raises(ConfigError, match=f"{column} = 4096 at num_tensor_parallel_workers 2 is not allowed: "
                                          "expected 1..2048"):
        load_operator_profiles(root)


def test_profile_rows_the_fit_cannot_use_are_reported_as_skipped(tmp_path):
    """Attention rows at a TP degree without mlp.csv rows, and a network file without rows within
    one node, are named in the fit's skipped lines (the calibration's notes), not dropped silently."""
    root = _write_profiles(tmp_path)
    attn = pd.read_csv(root / _ATTN)
    pd.concat([attn, attn.assign(num_tensor_parallel_workers=8)]).to_csv(root / _ATTN, index=False)
    pd.read_csv(root / _AR).assign(devices_per_node=1).to_csv(root / _AR, index=False)
    p = load_operator_profiles(root)
    assert sorted(p.decode) == [2] and not p.all_reduce
    fit = fit_operator_profiles(p, A100, CostParams())
    assert any(s.startswith("attention tp8: mlp.csv has no rows") for s in fit.skipped)
    assert any(s.startswith("all-reduce: a100_dgx/all_reduce.csv has no rows within one node") for s in fit.skipped)


@pytest.mark.parametrize("model_dir, what", [
    ("RedHatAI/Llama-2-70b-hf-quantized.w8a8", "int8 weights"),
    ("mistralai/Mixtral-8x7B-v0.1", "mixture of experts"),
    ("deepseek-ai/DeepSeek-V2-Lite", "latent attention"),
])
def test_profiles_of_a_model_vidur_does_not_profile_are_refused(tmp_path, model_dir, what):
    """Vidur profiles dense 16-bit layers: a folder resolving to a quantized, MoE or MLA preset
    would be fitted with a cost model of another computation."""
    with pytest.raises(ConfigError, match=f"{what}.*expected a dense 16-bit model"):
        load_operator_profiles(_write_profiles(tmp_path, model_dir=model_dir))


@pytest.mark.parametrize("device, gpu, match", [
    ("a100", "H100-SXM", "compute/a100 is A100-80GB, not the GPU being calibrated: expected profiles measured on "
                         "H100-SXM"),
    ("a40", "L40S", "compute/a40 is not a kvsched GPU preset or alias"),
])
def test_profiles_measured_on_another_gpu_are_refused(tmp_path, device, gpu, match):
    root = _write_profiles(tmp_path)
    (root / "compute" / "a100").rename(root / "compute" / device)
    with pytest.raises(ConfigError, match=match):
        fit_operator_profiles(load_operator_profiles(root), get_gpu(gpu), CostParams())


def test_the_cli_prints_paths_with_rich_markup_characters_verbatim_and_fits_byte_identically(tmp_path, capsys):
    """A path holding ``[/x]`` is printed as it is (not parsed as console markup, which raised
    after the file was written); two runs on the same profiles write the same file but wall_s."""
    from kvsched.experiments.cli import main

    root = _write_profiles(tmp_path / "p [/x]")
    texts = []
    for i in range(2):
        out = tmp_path / f"new [/z] {i}" / "A100.json"
        assert main(["calibrate", "--gpu", "A100-80GB", "--operator-profiles", str(root), "--out", str(out)]) == 0
        assert f"wrote {out}" in capsys.readouterr().out.replace("\n", "")
        d = json.loads(out.read_text())
        d.pop("wall_s")
        texts.append(json.dumps(d, sort_keys=True))
    assert texts[0] == texts[1]


def test_the_cli_refuses_profiles_of_another_gpu_before_the_host_checks_and_names_the_gpu_to_give(tmp_path, capsys):
    """`calibrate --operator-profiles <A100 profiles>` without --gpu (default H100-SXM) was refused
    for its --host-from ("it is the GPU being calibrated"), which does not tell a newcomer to give
    --gpu A100-80GB; the device check comes first and says so."""
    from kvsched.experiments.cli import main

    root = _write_profiles(tmp_path / "p")
    out = tmp_path / "x.json"
    for gpu_args, gpu in ((["--gpu", "L40S"], "L40S"), ([], "H100-SXM")):
        capsys.readouterr()
        assert main(["calibrate", *gpu_args, "--operator-profiles", str(root), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (f"compute/a100 is A100-80GB, not the GPU being calibrated: expected profiles measured on {gpu} "
                "(or --gpu A100-80GB)") in err and err.count("\n") == 1
    assert not out.exists()
