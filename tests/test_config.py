"""ModelConfig parsing and presets against the release config (SPEC sections 1, 2, 10, 12)."""

from __future__ import annotations

import copy
import hashlib
import dataclasses
import json
from importlib import resources

import jax
import jax.numpy as jnp
import pytest

from kimik3_jax.config import FFN_DENSE, FFN_MOE, LAYER_KDA, LAYER_MLA, ModelConfig
from kimik3_jax.errors import ConfigError
from kimik3_jax.presets import (
    PRESETS, derive, k3_layer_lists, preset, preset_dict, release_dict, resolve,
)

# sha256 of the release config.json (shared/k3/config.json, checked byte for byte when it was bundled)
RELEASE_CONFIG_SHA256 = "a33a039e0c6f7d7813d91246f41cf45ffaffc8f66a2b4d9ca3edae660ccf5995"
RELEASE_VOCAB = 163840
RELEASE_SPECIAL = {"bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
                   "media_placeholder_token_id": 163605}


def release() -> dict:
    return release_dict()  # a fresh copy each call


@pytest.fixture(scope="module")
def k3() -> ModelConfig:
    return ModelConfig.from_dict(release())


def parse(data: dict) -> ModelConfig:
    return ModelConfig.from_dict(data, origin="test-config.json")


def refused(data: dict, *needles: str) -> str:
    """Parsing must raise ConfigError whose message contains every needle (field paths)."""
    with pytest.raises(ConfigError) as info:
        parse(data)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not named in: {msg}"
    return msg


def both_quant(data: dict) -> list[dict]:
    """The two copies of quantization_config (top level and text_config)."""
    return [data["quantization_config"], data["text_config"]["quantization_config"]]


# ------------------------------------------------------------------------------------------------
# The release config
# ------------------------------------------------------------------------------------------------

def test_bundled_config_is_the_release_file():
    data = resources.files("kimik3_jax").joinpath("configs/k3.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == RELEASE_CONFIG_SHA256
    assert release() == json.loads(data)


def test_release_layer_kinds(k3):
    mla = tuple(range(3, 92, 4)) + (92,)
    assert mla[:3] == (3, 7, 11) and mla[-3:] == (87, 91, 92)
    assert k3.num_layers == 93
    assert k3.mla_layers == mla and len(mla) == 24
    assert k3.kda_layers == tuple(i for i in range(93) if i not in mla) and len(k3.kda_layers) == 69
    assert len(k3.layer_kinds) == 93
    assert all(k3.layer_kinds[i] == (LAYER_MLA if i in mla else LAYER_KDA) for i in range(93))
    # layer i (0-based) is KDA iff (i + 1) is in the 1-based kda_layers
    lin = release()["text_config"]["linear_attn_config"]
    assert k3.kda_layers == tuple(x - 1 for x in lin["kda_layers"])
    assert k3.mla_layers == tuple(x - 1 for x in lin["full_attn_layers"])


def test_release_ffn_kinds_and_blocks(k3):
    assert k3.dense_layers == (0,)
    assert k3.moe_layers == tuple(range(1, 93))
    assert k3.ffn_kinds == (FFN_DENSE,) + (FFN_MOE,) * 92
    assert k3.block_starts == (0, 12, 24, 36, 48, 60, 72, 84)
    # stack positions: index within the attention-kind stack and within the FFN-kind stack
    assert k3.stack_index(0) == (0, 0)
    assert k3.stack_index(1) == (1, 0)
    assert k3.stack_index(3) == (0, 2)
    assert k3.stack_index(4) == (3, 3)
    assert k3.stack_index(91) == (22, 90)
    assert k3.stack_index(92) == (23, 91)
    for i in range(93):
        a, f = k3.stack_index(i)
        assert k3.layers_of(k3.layer_kinds[i])[a] == i
        assert k3.layers_of(k3.ffn_kinds[i])[f] == i


def test_release_sizes(k3):
    assert k3.vocab_size == 163840
    assert k3.hidden_size == 7168
    assert k3.intermediate_size == 33792
    assert k3.rms_norm_eps == 1e-5
    assert k3.attn_res_block_size == 12
    assert k3.situ_beta == 4.0 and k3.situ_linear_beta == 25.0
    assert k3.max_position_embeddings == 1048576
    # KDA
    assert (k3.kda.num_heads, k3.kda.head_dim) == (96, 128)
    assert k3.kda.conv_size == 4
    assert k3.kda.gate_lower_bound == -5.0
    # MLA
    m = k3.mla
    assert m.num_heads == 96
    assert (m.q_lora_rank, m.kv_lora_rank) == (1536, 512)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (128, 64, 128)
    assert m.qk_head_dim == 192
    assert m.lora_norm_eps == 1e-6
    # MoE
    e = k3.moe
    assert (e.num_experts, e.top_k) == (896, 16)
    assert e.latent_width == 3584 and e.expert_width == 3072
    assert e.num_shared_experts == 2 and e.shared_width == 6144
    assert e.latent_use_norm is True
    assert e.first_k_dense_replace == 1 and e.layer_freq == 1
    assert e.routed_scaling_factor == 1.0
    assert e.renormalize is True
    # MXFP4
    assert (k3.quant.format, k3.quant.num_bits, k3.quant.group_size) == ("mxfp4-pack-quantized", 4, 32)
    # special tokens
    for name, value in RELEASE_SPECIAL.items():
        assert getattr(k3, name) == value, name


def test_release_vision(k3):
    v = k3.vision
    assert v is not None
    assert v.patch_size == 14
    assert v.hidden_size == 1024 and v.mm_hidden_size == 1024
    assert v.num_layers == 27
    assert v.num_heads == 12 and v.qkv_hidden_size == 1536 and v.head_dim == 128
    assert v.intermediate_size == 4096
    assert (v.pos_emb_height, v.pos_emb_width) == (64, 64)
    assert v.merge_kernel == (2, 2)
    assert v.merged_width == 4096
    assert v.text_hidden_size == 7168
    assert v.projector_eps == 1e-5
    assert "27 layers" in k3.summary() and "69 KDA" in k3.summary()


# ------------------------------------------------------------------------------------------------
# Hashable, static under jit
# ------------------------------------------------------------------------------------------------

def test_hashable_and_equal_when_parsed_separately():
    a, b = parse(release()), parse(release())
    assert a is not b and a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != preset("tiny") and a != preset("slice")
    assert hash(preset("tiny")) == hash(preset("tiny"))


def test_static_argument_under_jit_no_retrace():
    traces = []

    def f(cfg: ModelConfig, x):
        traces.append(cfg.hidden_size)
        return x * cfg.hidden_size + len(cfg.mla_layers)

    g = jax.jit(f, static_argnums=0)
    a, b = parse(release()), parse(release())
    x = jnp.float32(2.0)
    assert float(g(a, x)) == 2.0 * 7168 + 24
    assert float(g(b, x)) == 2.0 * 7168 + 24
    assert traces == [7168]  # an equal config from a separate parse hits the cache
    tiny = preset("tiny")
    assert float(g(tiny, x)) == 2.0 * tiny.hidden_size + len(tiny.mla_layers)
    assert traces == [7168, tiny.hidden_size]
    g(preset("tiny"), x)
    assert len(traces) == 2


# ------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------

def test_k3_preset_is_the_release(k3):
    assert preset("k3") == k3
    assert resolve("k3") == k3
    assert set(PRESETS) >= {"k3", "tiny", "slice"}


def test_tiny_preset():
    t = preset("tiny")
    assert t.num_layers >= 8
    assert len(t.mla_layers) >= 2 and len(t.kda_layers) >= 2
    assert len([s for s in t.block_starts if s > 0]) >= 2  # at least two AttnRes block boundaries
    assert (t.moe.num_experts, t.moe.top_k) == (16, 4)
    assert t.dense_layers == (0,) and t.moe_layers == tuple(range(1, t.num_layers))
    g = t.quant.group_size
    assert g == 32
    for width in (t.moe.latent_width, t.moe.expert_width):
        assert width % 32 == 0 and width % g == 0
    # same structure as the release: MLA every 4th layer and the last
    kda, mla = k3_layer_lists(t.num_layers)
    assert t.mla_layers == tuple(x - 1 for x in mla)
    assert t.mla_layers[-1] == t.num_layers - 1
    assert t.vision is not None and t.vision.text_hidden_size == t.hidden_size
    # much smaller than the release
    assert t.vocab_size < RELEASE_VOCAB and t.hidden_size < 7168


def test_tiny_special_ids_at_top_of_vocab():
    t = preset("tiny")
    for name, value in RELEASE_SPECIAL.items():
        got = getattr(t, name)
        assert 0 <= got < t.vocab_size, name
        assert t.vocab_size - got == RELEASE_VOCAB - value, name
    d = preset_dict("tiny")
    for section in (d, d["text_config"]):
        for name, value in RELEASE_SPECIAL.items():
            if name in section:
                assert section[name] == t.vocab_size - (RELEASE_VOCAB - value), name


def test_slice_preset(k3):
    s = preset("slice")
    assert s.num_layers == 4
    assert s.moe.num_experts == 896 and s.moe.top_k == 16
    assert s.hidden_size == k3.hidden_size and s.vocab_size == k3.vocab_size
    assert s.kda == k3.kda and s.mla == k3.mla and s.moe == k3.moe and s.quant == k3.quant
    assert s.vision == k3.vision
    assert s.mla_layers == (3,) and s.kda_layers == (0, 1, 2)
    for name, value in RELEASE_SPECIAL.items():
        assert getattr(s, name) == value


def test_derive_recomputes_layer_lists():
    base = release()
    for n in (1, 2, 4, 5, 8, 13, 24):
        d = derive(base, num_layers=n)
        lin = d["text_config"]["linear_attn_config"]
        assert sorted(lin["kda_layers"] + lin["full_attn_layers"]) == list(range(1, n + 1))
        cfg = parse(d)
        assert cfg.num_layers == n
        want_mla = tuple(i for i in range(n) if (i + 1) % 4 == 0 or i == n - 1)
        assert cfg.mla_layers == want_mla
        assert cfg.kda_layers == tuple(i for i in range(n) if i not in want_mla)
        assert cfg.dense_layers == (0,) and cfg.moe_layers == tuple(range(1, n))
        assert cfg.block_starts == tuple(range(0, n, 12))
    # deriving 93 layers reproduces the release lists exactly
    assert derive(base, num_layers=93) == base
    assert base == release()  # derive does not mutate its input
    assert preset("tiny", num_layers=12).num_layers == 12
    assert resolve("tiny", num_layers=5).mla_layers == (3, 4)


def test_derive_on_bare_text_config():
    bare = release()["text_config"]
    d = derive(bare, num_layers=6, text={"vocab_size": 2048})
    cfg = parse(d)
    assert cfg.num_layers == 6 and cfg.vision is None
    assert cfg.vocab_size - cfg.bos_token_id == RELEASE_VOCAB - RELEASE_SPECIAL["bos_token_id"]


def test_resolve_path_and_unknown_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(release()))
    assert resolve(str(tmp_path)) == preset("k3")
    assert resolve(str(tmp_path / "config.json"), num_layers=4) == preset("slice")
    with pytest.raises(ConfigError, match="nope"):
        preset("nope")
    with pytest.raises(ConfigError, match="no-such-thing"):
        resolve(str(tmp_path / "no-such-thing"))


# ------------------------------------------------------------------------------------------------
# Tolerated: unknown fields
# ------------------------------------------------------------------------------------------------

def test_unknown_fields_tolerated(k3):
    d = release()
    d["some_future_field"] = {"x": [1, 2]}
    d["text_config"]["rope_scaling"] = None
    d["text_config"]["brand_new"] = 3
    d["text_config"]["linear_attn_config"]["extra_knob"] = "on"
    d["vision_config"]["video_attn_type"] = "spatial_temporal"
    for q in both_quant(d):
        q["sparsity_config"] = None
    assert parse(d) == k3


# ------------------------------------------------------------------------------------------------
# Missing / wrong type / inconsistent
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    "text_config.hidden_size",
    "text_config.linear_attn_config.kda_layers",
    "text_config.linear_attn_config.full_attn_layers",
    "text_config.linear_attn_config.head_dim",
    "text_config.num_experts",
    "text_config.num_experts_per_token",
    "text_config.rms_norm_eps",
    "text_config.routed_expert_hidden_size",
    "text_config.attn_res_block_size",
    "text_config.activation_situ_beta",
    "text_config.linear_attn_config",
    "vision_config.patch_size",
    "vision_config.vt_hidden_size",
    "vision_config.text_hidden_size",
])
def test_missing_required_field(path):
    d = release()
    *parents, leaf = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    del node[leaf]
    refused(d, f"`{path}`", "missing")


def test_missing_quantization_config():
    d = release()
    del d["quantization_config"]
    del d["text_config"]["quantization_config"]
    refused(d, "quantization_config", "missing")
    # one copy alone is enough
    for drop_top in (True, False):
        d = release()
        del (d if drop_top else d["text_config"])["quantization_config"]
        assert parse(d).quant.group_size == 32


def test_missing_text_config_fields_report_origin():
    d = release()
    del d["text_config"]["num_experts"]
    with pytest.raises(ConfigError, match="my-origin.json"):
        ModelConfig.from_dict(d, origin="my-origin.json")


@pytest.mark.parametrize("path,value", [
    ("text_config.hidden_size", "7168"),
    ("text_config.hidden_size", 7168.0),
    ("text_config.num_experts", True),
    ("text_config.rms_norm_eps", "1e-5"),
    ("text_config.latent_moe_use_norm", 1),
    ("text_config.moe_renormalize", "true"),
    ("text_config.linear_attn_config.kda_layers", "1,2,3"),
    ("text_config.linear_attn_config.num_heads", [96]),
    ("vision_config.patch_size", 14.5),
    ("vision_config.merge_kernel_size", 2),
])
def test_wrong_type_names_field(path, value):
    d = release()
    *parents, leaf = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    node[leaf] = value
    refused(d, f"`{path}`")


def test_non_object_sections():
    d = release()
    d["text_config"] = [1, 2]
    refused(d, "`text_config`", "object")
    d = release()
    d["text_config"]["linear_attn_config"] = "kda"
    refused(d, "`text_config.linear_attn_config`", "object")
    refused([], "object")


def test_integer_accepted_for_float_fields():
    d = release()
    d["text_config"]["activation_situ_beta"] = 4
    d["text_config"]["linear_attn_config"]["gate_lower_bound"] = -5
    cfg = parse(d)
    assert cfg.situ_beta == 4.0 and isinstance(cfg.situ_beta, float)
    assert cfg.kda.gate_lower_bound == -5.0


def test_overlapping_layer_lists():
    d = release()
    lin = d["text_config"]["linear_attn_config"]
    lin["full_attn_layers"].append(2)  # 2 is also in kda_layers
    refused(d, "full_attn_layers", "kda_layers", "text_config.linear_attn_config")


def test_layer_without_kind():
    d = release()
    d["text_config"]["linear_attn_config"]["kda_layers"].remove(10)
    refused(d, "text_config.linear_attn_config.kda_layers", "10")


def test_layer_list_out_of_range():
    d = release()
    d["text_config"]["linear_attn_config"]["full_attn_layers"].append(94)
    refused(d, "text_config.linear_attn_config.full_attn_layers")
    d = release()
    d["text_config"]["linear_attn_config"]["kda_layers"][0] = 0  # lists are 1-based
    refused(d, "text_config.linear_attn_config.kda_layers")


def test_top_k_exceeds_experts():
    d = release()
    d["text_config"]["num_experts_per_token"] = 897
    refused(d, "text_config.num_experts_per_token", "896")


@pytest.mark.parametrize("name", ["routed_expert_hidden_size", "moe_intermediate_size"])
def test_expert_width_not_multiple_of_group(name):
    d = release()
    d["text_config"][name] += 16
    refused(d, f"text_config.{name}", "32")


def test_kda_heads_exceed_head_dim():
    d = release()
    d["text_config"]["linear_attn_config"]["num_heads"] = 129
    refused(d, "text_config.linear_attn_config.num_heads", "head_dim")


def test_quantization_copies_disagree():
    d = release()
    d["quantization_config"]["quantization_status"] = "frozen"
    refused(d, "quantization_config", "differs")
    d = release()
    d["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    refused(d, "quantization_config", "differs")


@pytest.mark.parametrize("name,section", [
    ("bos_token_id", "text"), ("eos_token_id", "text"), ("pad_token_id", "text"),
    ("media_placeholder_token_id", "top"),
])
def test_special_id_outside_vocab(name, section):
    d = release()
    for where in (d, d["text_config"]):
        if name in where:
            where[name] = 163840
    path = f"text_config.{name}" if section == "text" else name
    refused(d, f"`{path}`", "vocab")
    d = release()
    for where in (d, d["text_config"]):
        if name in where:
            where[name] = -1
    refused(d, f"`{path}`")


def test_vision_text_hidden_size_mismatch():
    d = release()
    d["vision_config"]["text_hidden_size"] = 4096
    refused(d, "vision_config.text_hidden_size", "7168")


def test_num_key_value_heads_must_match():
    d = release()
    d["text_config"]["num_key_value_heads"] = 8
    refused(d, "text_config.num_key_value_heads")


# ------------------------------------------------------------------------------------------------
# Unsupported K3 settings
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("num_expert_group", 2),
    ("topk_group", 2),
    ("hidden_act", "silu"),
    ("mla_use_nope", False),
    ("mla_use_output_gate", False),
    ("tie_word_embeddings", True),
    ("moe_router_activation_func", "softmax"),
    ("topk_method", "greedy"),
    ("num_nextn_predict_layers", 1),
])
def test_unsupported_text_setting(field, value):
    d = release()
    d["text_config"][field] = value
    refused(d, f"`text_config.{field}`", "not supported")


def test_unsupported_top_level_tie_word_embeddings():
    d = release()
    d["tie_word_embeddings"] = True
    refused(d, "tie_word_embeddings")


def test_unsupported_use_full_rank_gate():
    d = release()
    d["text_config"]["linear_attn_config"]["use_full_rank_gate"] = False
    refused(d, "`text_config.linear_attn_config.use_full_rank_gate`", "not supported")


@pytest.mark.parametrize("key,value", [("format", "nvfp4-pack-quantized"), ("quant_method", "gptq")])
def test_unsupported_quant_setting(key, value):
    d = release()
    for q in both_quant(d):
        q[key] = value
    refused(d, f"`text_config.quantization_config.{key}`", "not supported")


def test_unsupported_group_format():
    d = release()
    for q in both_quant(d):
        q["config_groups"]["group_0"]["format"] = "float-quantized"
    refused(d, "text_config.quantization_config.config_groups.group_0.format", "not supported")
    d = release()
    for q in both_quant(d):
        del q["config_groups"]["group_0"]["format"]  # optional in compressed-tensors: the outer one applies
    assert parse(d).quant.format == "mxfp4-pack-quantized"


def test_unsupported_group_size():
    d = release()
    for q in both_quant(d):
        q["config_groups"]["group_0"]["weights"]["group_size"] = 16
    refused(d, "`text_config.quantization_config.config_groups.group_0.weights.group_size`", "not supported")


@pytest.mark.parametrize("key,value", [("num_bits", 8), ("type", "int"), ("symmetric", False),
                                       ("strategy", "channel")])
def test_unsupported_quant_weights(key, value):
    d = release()
    for q in both_quant(d):
        q["config_groups"]["group_0"]["weights"][key] = value
    refused(d, f"`text_config.quantization_config.config_groups.group_0.weights.{key}`", "not supported")


def test_true_is_not_one():
    d = release()
    d["text_config"]["mla_use_nope"] = 1
    refused(d, "`text_config.mla_use_nope`")


# ------------------------------------------------------------------------------------------------
# Files and the bare text config
# ------------------------------------------------------------------------------------------------

def test_from_file(tmp_path, k3):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(release()))
    assert ModelConfig.from_file(p) == k3
    assert ModelConfig.from_file(tmp_path) == k3  # a directory holding config.json
    assert ModelConfig.from_file(str(p)) == k3


def test_from_file_missing(tmp_path):
    p = tmp_path / "absent" / "config.json"
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(p)
    assert str(p) in str(info.value)


def test_from_file_invalid_json(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{"text_config": {')
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(p)
    assert str(p) in str(info.value)


def test_from_file_error_names_path(tmp_path):
    p = tmp_path / "config.json"
    d = release()
    del d["text_config"]["hidden_size"]
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(p)
    assert str(p) in str(info.value) and "text_config.hidden_size" in str(info.value)


def test_bare_text_config(k3):
    bare = copy.deepcopy(release()["text_config"])
    assert "quantization_config" in bare
    cfg = parse(bare)
    assert cfg.vision is None and cfg.media_placeholder_token_id is None
    assert cfg == dataclasses.replace(k3, vision=None, media_placeholder_token_id=None)
    # errors name the bare field path (no text_config prefix)
    del bare["num_experts"]
    refused(bare, "`num_experts`")
    bare = copy.deepcopy(release()["text_config"])
    bare["linear_attn_config"]["num_heads"] = "96"
    refused(bare, "`linear_attn_config.num_heads`")


def test_release_without_vision(k3):
    d = release()
    del d["vision_config"]
    cfg = parse(d)
    assert cfg.vision is None
    assert cfg == dataclasses.replace(k3, vision=None)
