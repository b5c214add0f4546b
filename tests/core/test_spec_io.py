"""Spec readers and writers (envs/sim/spec_io.py): YAML round trips, presets by name or inline
fields, unknown keys and wrong types named, the PNM entry, and the presets table."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.envs.sim.specs import (GPU_PRESETS, LINK_PRESETS, MODEL_PRESETS, CostParams, InstanceSpec, get_gpu,
                                    get_link, get_model, get_pnm, instance_spec_from_dict, instance_spec_to_dict,
                                    load_instance_spec, presets_rows, save_instance_spec)

BLOCK_BYTES = 131072 * 16  # Llama-3.1-8B bf16 KV per 16-token block


def _spec(model: str, gpu: str = "H100-SXM", **kw: object) -> InstanceSpec:
    return InstanceSpec(get_model(model), get_gpu(gpu), **kw)


def spec(**kw) -> InstanceSpec:
    kw.setdefault("cost", CostParams())  # literature cost parameters, as tests/policies/test_policies.py
    return InstanceSpec(model=get_model("Llama-3.1-8B"), gpu=get_gpu("H100-SXM"), **kw)


def test_yaml_round_trip(tmp_path: Path) -> None:
    spec = _spec("Qwen2.5-7B", gpu="A100-80GB", tp=2, kv_dtype="fp8", dram_kv_bytes=64e9, nvme_kv_bytes=1e12,
                 preemption_mode="swap", max_num_batched_tokens=1024, max_num_seqs=128, max_model_len=8192,
                 nvme_read=get_link("nvme_gen5_read"), cost=CostParams(mfu_max=0.5, step_overhead_s=2e-3))
    path = tmp_path / "inst.yaml"
    save_instance_spec(spec, path)
    back = load_instance_spec(path)
    assert back == spec
    assert back.num_hbm_blocks == spec.num_hbm_blocks and back.num_dram_blocks == spec.num_dram_blocks
    assert instance_spec_to_dict(back) == instance_spec_to_dict(spec)
    # the file is self-contained: the model is written inline
    assert "n_layers" in path.read_text()


def test_from_dict_accepts_preset_names_and_inline_specs() -> None:
    d = {"model": "Llama-3.1-8B", "gpu": "H100", "pcie": "pcie4"}
    s = instance_spec_from_dict(d)
    assert s.model is MODEL_PRESETS["Llama-3.1-8B"] and s.pcie == LINK_PRESETS["pcie4"]
    inline = instance_spec_to_dict(s)["model"]
    inline["name"] = "my-8b"
    s2 = instance_spec_from_dict({"model": inline, "gpu": "H100-SXM"})
    assert s2.model.name == "my-8b" and s2.kv_bytes_per_token == s.kv_bytes_per_token


def test_from_dict_unknown_key_names_key_source_and_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "tpp": 2}, source="scen.yaml")
    msg = str(info.value)
    assert "'tpp'" in msg and "scen.yaml" in msg and "max_num_seqs" in msg
    with pytest.raises(ConfigError, match="bogus"):
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "cost": {"bogus": 1}})


def test_partial_prefill_limit_reads_null_as_no_limit_and_round_trips(tmp_path: Path) -> None:
    """A file that leaves the key out or writes null has no limit; an integer is a limit (1
    included); both round-trip through YAML. A wrong value names the key and what is allowed."""
    base = {"model": "Llama-3.1-8B", "gpu": "H100-SXM"}
    assert instance_spec_from_dict(base).max_num_partial_prefills is None
    assert instance_spec_from_dict({**base, "max_num_partial_prefills": None}).max_num_partial_prefills is None
    assert instance_spec_from_dict({**base, "max_num_partial_prefills": 1}).max_num_partial_prefills == 1
    for k in (None, 1, 3):
        s = instance_spec_from_dict({**base, "max_num_partial_prefills": k})
        save_instance_spec(s, tmp_path / "s.yaml")
        assert load_instance_spec(tmp_path / "s.yaml") == s
        assert instance_spec_to_dict(s)["max_num_partial_prefills"] == k
    for bad in ("2", 2.5, True):
        with pytest.raises(ConfigError, match=r"x.yaml: max_num_partial_prefills=.* expected an integer or null"):
            instance_spec_from_dict({**base, "max_num_partial_prefills": bad}, source="x.yaml")
    with pytest.raises(ConfigError, match="max_num_partial_prefills=0"):
        instance_spec_from_dict({**base, "max_num_partial_prefills": 0}, source="x.yaml")


def test_from_dict_wrong_types_raise() -> None:
    base = {"model": "Llama-3.1-8B", "gpu": "H100-SXM"}
    for key, value in [("tp", "2"), ("tp", 2.0), ("enable_prefix_caching", "yes"), ("gpu_memory_utilization", "lots"),
                       ("kv_dtype", 8), ("model", 3)]:
        with pytest.raises(ConfigError, match=key):
            instance_spec_from_dict({**base, key: value}, source="x.yaml")


def test_presets_rows() -> None:
    rows = presets_rows()
    assert set(rows) == {"models", "gpus", "links", "pnm"}
    pnm = {r["name"]: r for r in rows["pnm"]}
    assert pnm["cxl-pnm-ocp2025-x10"]["mem_TB_per_s"] == 2.0 and pnm["cxl-pnm-ocp2025"]["capacity_TB"] == 4.0
    by_name = {r["name"]: r for r in rows["models"]}
    assert by_name["Llama-3.1-8B"]["kv_bytes_per_token_bf16"] == 131_072
    assert by_name["Llama-3.1-8B"]["weights_GB_bf16"] == pytest.approx(16.1)
    assert len(rows["gpus"]) == len(GPU_PRESETS) and len(rows["links"]) == len(LINK_PRESETS)


def test_pnm_presets_and_yaml_round_trip():
    s = spec(pnm=get_pnm("cxl-pnm-ocp2025"))
    assert s.num_pnm_blocks == int(4e12 // BLOCK_BYTES)
    assert spec().num_pnm_blocks == 0
    assert spec(pnm=get_pnm("cxl-pnm-ocp2025-x10")).num_pnm_blocks == int(40e12 // BLOCK_BYTES)
    d = instance_spec_to_dict(s)
    assert instance_spec_from_dict(d) == s
    over = instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM",
                                    "pnm": {"preset": "cxl-pnm-ocp2025", "n_devices": 2, "link": "pcie4"}})
    assert over.pnm.n_devices == 2 and over.pnm.link.bytes_per_s == 25e9
    assert over.num_pnm_blocks == int(8e12 // BLOCK_BYTES)


@pytest.mark.parametrize("pnm,err,match", [
    ("nope", UnknownPresetError, "unknown PNM device 'nope'.*cxl-pnm-ocp2025"),
    ({"preset": "cxl-pnm-ocp2025", "bandwidth": 1}, ConfigError, "unknown key 'bandwidth'"),
    ({"name": "x", "capacity_bytes": 1e12}, ConfigError, "missing key.*mem_bytes_per_s"),
    ({"preset": "cxl-pnm-ocp2025", "capacity_bytes": 1000}, ConfigError, "pnm.capacity_bytes=1000.*one KV block"),
    ({"preset": "cxl-pnm-ocp2025", "n_devices": "two"}, ConfigError, "n_devices='two'"),
    ({"preset": "cxl-pnm-ocp2025", "link": "warp"}, UnknownPresetError, "unknown link 'warp'"),
    (7, ConfigError, "pnm must be a PNM preset name or a mapping"),
])
def test_instance_spec_pnm_bad_input(pnm, err, match):
    with pytest.raises(err, match=match):
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "pnm": pnm})
    with pytest.raises(ConfigError, match="InstanceSpec.pnm='cxl'"):
        spec(pnm="cxl")


def test_load_instance_spec_names_the_file_of_a_bad_entry(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("model: Llama-3.1-8B\ngpu: H100-SXM\ntp: 3\n")
    with pytest.raises(ConfigError, match="tp"):
        load_instance_spec(p)
    p.write_text("model: Llama-3.1-8B\ngpu: H100-SXM\nhbm_kv_blocks: 321\n")
    assert load_instance_spec(p).num_hbm_blocks == 321
