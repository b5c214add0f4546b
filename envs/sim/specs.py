"""The public spec API: every spec class, preset table and reader in one import.

The specs live in their own modules (this file only re-exports them, so
``from kvsched.envs.sim.specs import InstanceSpec, get_model`` keeps working):

- :mod:`.model_spec` -- :class:`ModelSpec` and the model presets (REFERENCE §5.1, HF configs);
- :mod:`.hf_config` -- :func:`read_hf_config`: a ModelSpec from any Hugging Face config.json;
- :mod:`.hardware` -- :class:`GPUSpec`, :class:`LinkSpec`, :class:`PNMSpec` and their presets
  (REFERENCE §5.2, §3);
- :mod:`.cost_params` -- :class:`CostParams`, the cost model's efficiencies and overheads;
  :func:`default_cost_params` (in :mod:`.calibration`) picks a GPU's calibrated ones;
- :mod:`.tiers` -- :class:`TierSpec`, KV tiers as data;
- :mod:`.instance_spec` -- :class:`InstanceSpec`, the served system (vLLM engine settings);
- :mod:`.spec_io` -- dict / YAML readers and writers, the presets table;
- :mod:`.spec_validation` -- the validation helpers they share.

Everything is an immutable dataclass validated in ``__post_init__``; a bad value raises
:class:`~kvsched.envs.sim.errors.ConfigError` naming the field, the value and what is allowed.
Conventions: bytes are SI (1 GB = 1e9 B) unless written GiB; times in seconds; rates per second.
"""

from __future__ import annotations

from .calibration import default_cost_params
from .cost_params import CostParams
from .hardware import (CXL_LINK, DEFAULT_LINK_LATENCY_S, GPU_ALIASES, GPU_PRESETS, GPUS, LINK_PRESETS, LINKS,
                       PNM_DEVICES, PNM_PRESETS, GiB, GPUSpec, LinkSpec, PNMSpec, get_gpu, get_link, get_pnm)
from .hf_config import model_from_hf_config, read_hf_config
from .instance_spec import PREEMPTION_MODES, TP_DEGREES, InstanceSpec
from .model_spec import (DTYPE_BYTES, KV_DTYPES, MODEL_ALIASES, MODEL_PRESETS, MODELS, WEIGHT_DTYPES, ModelSpec,
                         get_model)
from .spec_io import (instance_spec_from_dict, instance_spec_to_dict, load_instance_spec, presets_rows,
                      save_instance_spec)
from .tiers import STANDARD_TIERS, TIER_CONTENTS, TierSpec

__all__ = [
    "CXL_LINK", "DEFAULT_LINK_LATENCY_S", "DTYPE_BYTES", "GPUS", "GPU_ALIASES", "GPU_PRESETS", "GiB", "KV_DTYPES",
    "LINKS", "LINK_PRESETS", "MODELS", "MODEL_ALIASES", "MODEL_PRESETS", "PNM_DEVICES", "PNM_PRESETS",
    "PREEMPTION_MODES", "STANDARD_TIERS", "TIER_CONTENTS", "TP_DEGREES", "WEIGHT_DTYPES", "CostParams", "GPUSpec",
    "InstanceSpec", "LinkSpec", "ModelSpec", "PNMSpec", "TierSpec", "default_cost_params", "get_gpu", "get_link",
    "get_model", "get_pnm", "instance_spec_from_dict", "instance_spec_to_dict", "load_instance_spec",
    "model_from_hf_config", "presets_rows", "read_hf_config", "save_instance_spec",
]
