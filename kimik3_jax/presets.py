"""Presets: the release config, and smaller models made from it by overriding sizes only.

`k3` is the release `config.json` as shipped. `tiny` keeps every structural feature (KDA and MLA
layers, a dense first layer, MoE layers, several AttnRes blocks, MXFP4 experts, the vision tower)
at a few MB. `slice` keeps the real widths and all 896 experts but only a few layers, for GPU work.
A preset is a release-style JSON dict first, so a generated checkpoint writes it as its config.json.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import ConfigError

TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")

# Sizes that differ from the release, by config section. Widths of the routed experts stay multiples
# of the MXFP4 group (32); every width differs from the others so a transposed weight cannot pass.
# Heads (8), vocabulary, FFN widths, experts (16) and each expert's MXFP4 scale groups (256 / 32 = 8)
# divide by 8, so every sharding preset runs it on 8 devices.
_TINY_TEXT = {
    "vocab_size": 1024, "hidden_size": 192, "intermediate_size": 320,
    "num_attention_heads": 8, "num_key_value_heads": 8,
    "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 40,
    "num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 256, "routed_expert_hidden_size": 64,
    "attn_res_block_size": 3, "max_position_embeddings": 4096,
}
_TINY_LINEAR = {"num_heads": 8, "head_dim": 32}
_TINY_VISION = {
    "vt_hidden_size": 64, "mm_hidden_size": 64, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
    "qkv_hidden_size": 96, "vt_intermediate_size": 128, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
    "text_hidden_size": 192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "k3": {},
    "tiny": {"num_layers": 8, "text": _TINY_TEXT, "linear": _TINY_LINEAR, "vision": _TINY_VISION},
    "slice": {"num_layers": 4},
}


def release_dict() -> dict[str, Any]:
    """A fresh copy of the release `config.json` (bundled with the package)."""
    text = resources.files("kimik3_jax").joinpath("configs/k3.json").read_text()
    return json.loads(text)


def k3_layer_lists(num_layers: int) -> tuple[list[int], list[int]]:
    """The release's layer pattern for any depth: MLA every 4th layer and the last; 1-based lists."""
    mla = [i + 1 for i in range(num_layers) if (i + 1) % 4 == 0 or i == num_layers - 1]
    kda = [i + 1 for i in range(num_layers) if i + 1 not in mla]
    return kda, mla


def derive(base: dict[str, Any], *, num_layers: int | None = None, text: dict | None = None,
           linear: dict | None = None, vision: dict | None = None) -> dict[str, Any]:
    """A release-style config dict with some sizes overridden (the layer lists follow the depth)."""
    out = copy.deepcopy(base)
    tc = out.get("text_config", out)
    base_vocab = tc["vocab_size"]
    tc.update(text or {})
    tc["linear_attn_config"].update(linear or {})
    if vision:
        if "vision_config" not in out:
            raise ConfigError("cannot override vision sizes: the config has no `vision_config`")
        out["vision_config"].update(vision)
    if num_layers is not None:
        tc["num_hidden_layers"] = num_layers
        kda, mla = k3_layer_lists(num_layers)
        tc["linear_attn_config"]["kda_layers"] = kda
        tc["linear_attn_config"]["full_attn_layers"] = mla
    shift = tc["vocab_size"] - base_vocab  # special ids keep their distance to the end of the vocabulary
    for section in {id(out): out, id(tc): tc}.values():
        for name in TOKEN_ID_FIELDS:
            if shift and section.get(name) is not None:
                section[name] += shift
    return out


def preset_dict(name: str, num_layers: int | None = None) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or give a config.json path")
    spec = dict(PRESETS[name])
    if num_layers is not None:
        spec["num_layers"] = num_layers
    return derive(release_dict(), **spec)


def preset(name: str, num_layers: int | None = None) -> ModelConfig:
    return ModelConfig.from_dict(preset_dict(name, num_layers), origin=f"preset {name}")


def config_dict(spec: str, num_layers: int | None = None) -> dict[str, Any]:
    """`spec` is a preset name, a config.json path or a checkpoint directory holding one."""
    if spec in PRESETS:
        return preset_dict(spec, num_layers)
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if num_layers is not None:
        data = derive(data, num_layers=num_layers)
    return data


def resolve(spec: str, num_layers: int | None = None) -> ModelConfig:
    return ModelConfig.from_dict(config_dict(spec, num_layers), origin=spec)
