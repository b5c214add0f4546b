"""GPU, link and PNM device specs (envs/sim/hardware.py): link transfer time, PNM device bad
input, and GPU / link / PNM presets."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.hardware import CXL_LINK, GPU_PRESETS, LinkSpec, PNMSpec, get_gpu, get_link, get_pnm


def test_link_transfer_time() -> None:
    lk = LinkSpec("x", 2e9, 5e-6)
    assert lk.transfer_time_s(4e9) == pytest.approx(5e-6 + 2.0)
    assert lk.transfer_time_s(0) == 0.0
    assert list(lk.transfer_time_s([0.0, 2e9])) == [0.0, pytest.approx(1.0 + 5e-6)]


@pytest.mark.parametrize("field,value,match", [
    ("capacity_bytes", 0, "capacity_bytes=0"),
    ("mem_bytes_per_s", -1.0, "mem_bytes_per_s=-1.0"),
    ("attn_flops_per_s", float("nan"), "attn_flops_per_s=nan"),
    ("mbu", 1.5, r"mbu=1.5 .*\(0, 1\]"),
    ("mbu", 0.0, "mbu=0.0"),
    ("n_devices", 0, "n_devices=0 .*>= 1"),
    ("n_devices", 1.5, "n_devices=1.5"),
    ("rpc_latency_s", -1e-6, "rpc_latency_s"),
    ("link", "pcie5", "link='pcie5' .*LinkSpec"),
])
def test_pnm_spec_bad_input_names_field_and_value(field, value, match):
    kw = dict(name="x", capacity_bytes=1e12, mem_bytes_per_s=1e11, attn_flops_per_s=1e12, link=CXL_LINK)
    kw[field] = value
    with pytest.raises(ConfigError, match=match):
        PNMSpec(**kw)


def test_pnm_capacity_is_per_device_times_devices() -> None:
    one = get_pnm("cxl-pnm-ocp2025")
    ten = get_pnm("cxl-pnm-ocp2025-x10")
    assert one.total_capacity_bytes == one.capacity_bytes * one.n_devices == 4e12
    assert ten.total_capacity_bytes == 10 * one.total_capacity_bytes


def test_link_spec_bad_values_name_the_field() -> None:
    for kw, match in (({"bytes_per_s": 0.0}, "bytes_per_s"), ({"bytes_per_s": 1e9, "latency_s": -1.0}, "latency_s")):
        with pytest.raises(ConfigError, match=match):
            LinkSpec("x", **kw)
    assert get_link("pcie5").bytes_per_s > get_link("pcie4").bytes_per_s


def test_gpu_aliases_resolve_to_the_presets() -> None:
    assert get_gpu("H100") is get_gpu("h100-80gb") is GPU_PRESETS["H100-SXM"]
    assert get_gpu("a100") is GPU_PRESETS["A100-80GB"]
