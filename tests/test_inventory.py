"""The release tensor inventory, derived independently from the SPEC tables (sections 2, 2.1, 10).

`expected_inventory` reads only the raw config dict and spells every name, shape and dtype from the
SPEC text; it never calls `kimik3_jax.params`. The library's `inventory`/`describe`/`param_count`
must agree with it for the release config and, with the same formulas, for smaller configs.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import jax
import ml_dtypes
import numpy as np
import pytest

from kimik3_jax import params
from kimik3_jax.checkpoint.layout import inventory
from kimik3_jax.config import ModelConfig
from kimik3_jax.presets import derive, preset_dict

ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1}
DTYPE_NAME = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}

# The seven F32 kinds of SPEC 2.1 (layer and expert numbers replaced by {}).
F32_KINDS = {
    "language_model.model.layers.{}.self_attn.A_log",
    "language_model.model.layers.{}.self_attn.dt_bias",
    "language_model.model.layers.{}.self_attn.q_conv1d.weight",
    "language_model.model.layers.{}.self_attn.k_conv1d.weight",
    "language_model.model.layers.{}.self_attn.v_conv1d.weight",
    "language_model.model.layers.{}.self_attn.o_norm.weight",
    "language_model.model.layers.{}.block_sparse_moe.gate.e_score_correction_bias",
}
EXPERT_RE = re.compile(r"language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\."
                       r"w[123]\.weight_(packed|scale)")
LAYER_RE = re.compile(r"language_model\.model\.layers\.(\d+)\.")


# ------------------------------------------------------------------------------------------------
# The independent derivation (SPEC text -> names, shapes, dtypes), from the raw config dict only
# ------------------------------------------------------------------------------------------------

def expected_inventory(data: dict, text_only: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    tc = data.get("text_config", data)
    lin = tc["linear_attn_config"]
    q = tc.get("quantization_config") or data["quantization_config"]
    (group,) = q["config_groups"].values()
    G = group["weights"]["group_size"]

    V, D, n = tc["vocab_size"], tc["hidden_size"], tc["num_hidden_layers"]
    kda_1based = set(lin["kda_layers"])
    H, K, C = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    HK = H * K
    MH = tc["num_attention_heads"]
    QL, KL = tc["q_lora_rank"], tc["kv_lora_rank"]
    NOPE, ROPE, VD = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    E, F, L = tc["num_experts"], tc["moe_intermediate_size"], tc["routed_expert_hidden_size"]
    S = tc["num_shared_experts"] * F
    I = tc["intermediate_size"]
    first_dense, freq = tc["first_k_dense_replace"], tc["moe_layer_freq"]

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    bf = lambda name, *shape: out.__setitem__(name, (tuple(shape), "BF16"))  # noqa: E731
    f32 = lambda name, *shape: out.__setitem__(name, (tuple(shape), "F32"))  # noqa: E731

    m = "language_model.model."
    # Globals
    bf(m + "embed_tokens.weight", V, D)
    bf(m + "norm.weight", D)
    bf(m + "output_attn_res_norm.weight", D)
    bf(m + "output_attn_res_proj.weight", 1, D)
    bf("language_model.lm_head.weight", V, D)

    for i in range(n):
        p = f"{m}layers.{i}."
        # every layer
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            bf(p + norm + ".weight", D)
        bf(p + "self_attention_res_proj.weight", 1, D)
        bf(p + "mlp_res_proj.weight", 1, D)

        a = p + "self_attn."
        if (i + 1) in kda_1based:  # KDA
            for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
                bf(a + proj + ".weight", HK, D)
            for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
                f32(a + conv + ".weight", HK, 1, C)
            bf(a + "f_a_proj.weight", K, D)
            bf(a + "f_b_proj.weight", HK, K)
            bf(a + "b_proj.weight", H, D)
            f32(a + "dt_bias", HK)
            f32(a + "A_log", K)  # per head, zero padded to head_dim (release: 96 heads in [128])
            f32(a + "o_norm.weight", K)
            bf(a + "o_proj.weight", D, HK)
        else:  # MLA
            bf(a + "q_a_proj.weight", QL, D)
            bf(a + "q_a_layernorm.weight", QL)
            bf(a + "q_b_proj.weight", MH * (NOPE + ROPE), QL)
            bf(a + "kv_a_proj_with_mqa.weight", KL + ROPE, D)
            bf(a + "kv_a_layernorm.weight", KL)
            bf(a + "kv_b_proj.weight", MH * (NOPE + VD), KL)
            bf(a + "g_proj.weight", MH * VD, D)
            bf(a + "o_proj.weight", D, MH * VD)

        if i >= first_dense and i % freq == 0:  # MoE (SPEC 12)
            b = p + "block_sparse_moe."
            bf(b + "gate.weight", E, D)
            f32(b + "gate.e_score_correction_bias", E)
            bf(b + "routed_expert_down_proj.weight", L, D)
            bf(b + "routed_expert_norm.weight", L)
            bf(b + "routed_expert_up_proj.weight", D, L)
            bf(b + "shared_experts.gate_proj.weight", S, D)
            bf(b + "shared_experts.up_proj.weight", S, D)
            bf(b + "shared_experts.down_proj.weight", D, S)
            # w1 (gate) / w3 (up): logical [F, L]; w2 (down): logical [L, F]; packed in/2, scale in/G
            gate_up = (((F, L // 2), "U8"), ((F, L // G), "U8"))
            down = (((L, F // 2), "U8"), ((L, F // G), "U8"))
            for e in range(E):
                x = f"{b}experts.{e}."
                out[x + "w1.weight_packed"], out[x + "w1.weight_scale"] = gate_up
                out[x + "w3.weight_packed"], out[x + "w3.weight_scale"] = gate_up
                out[x + "w2.weight_packed"], out[x + "w2.weight_scale"] = down
        else:  # dense SiTU MLP
            bf(p + "mlp.gate_proj.weight", I, D)
            bf(p + "mlp.up_proj.weight", I, D)
            bf(p + "mlp.down_proj.weight", D, I)

    vc = data.get("vision_config")
    if vc is not None and not text_only:
        w, ps, qkv, ff = vc["vt_hidden_size"], vc["patch_size"], vc["qkv_hidden_size"], vc["vt_intermediate_size"]
        kh, kw = vc["merge_kernel_size"]
        merged = vc["mm_hidden_size"] * kh * kw
        bf("vision_tower.patch_embed.proj.weight", w, 3, ps, ps)
        bf("vision_tower.patch_embed.pos_emb.weight", vc["init_pos_emb_height"], vc["init_pos_emb_width"], w)
        for i in range(vc["vt_num_hidden_layers"]):
            blk = f"vision_tower.encoder.blocks.{i}."
            bf(blk + "norm0.weight", w)
            bf(blk + "norm1.weight", w)
            bf(blk + "wqkv.weight", 3 * qkv, w)
            bf(blk + "wo.weight", w, qkv)
            bf(blk + "mlp.fc0.weight", ff, w)
            bf(blk + "mlp.fc1.weight", w, ff)
        bf("vision_tower.encoder.final_layernorm.weight", w)
        bf("mm_projector.proj.0.weight", merged, merged)
        bf("mm_projector.proj.2.weight", D, merged)
        bf("mm_projector.post_norm.weight", D)
    return out


def expected_param_count(want: dict) -> tuple[int, int]:
    """(routed-expert params, other text params): packed bytes hold two, scales count none."""
    experts = others = 0
    for name, (shape, dt) in want.items():
        if not name.startswith("language_model."):
            continue
        if dt == "U8":
            if name.endswith("weight_packed"):
                experts += 2 * math.prod(shape)
        else:
            others += math.prod(shape)
    return experts, others


def total_bytes(want: dict) -> int:
    return sum(math.prod(shape) * ITEMSIZE[dt] for shape, dt in want.values())


def kind_of(name: str) -> str:
    return re.sub(r"\.\d+\.", ".{}.", name)


# ------------------------------------------------------------------------------------------------
# Fixtures (the release inventory is built once per module)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k3_dict() -> dict:
    return preset_dict("k3")


@pytest.fixture(scope="module")
def k3(k3_dict) -> ModelConfig:
    return ModelConfig.from_dict(k3_dict)


@pytest.fixture(scope="module")
def k3_inventory(k3):
    return inventory(k3)


@pytest.fixture(scope="module")
def k3_want(k3_dict):
    return expected_inventory(k3_dict)


@pytest.fixture(scope="module")
def k3_got(k3_inventory):
    return as_dict(k3_inventory)


def as_dict(tensors) -> dict[str, tuple[tuple[int, ...], str]]:
    per_leaf = {}  # (shape, dtype) once per leaf: 497,220 tensors share a few hundred leaves
    for t in tensors:
        if id(t.leaf) not in per_leaf:
            per_leaf[id(t.leaf)] = (tuple(t.shape), DTYPE_NAME[np.dtype(t.leaf.dtype)])
    got = {t.name: per_leaf[id(t.leaf)] for t in tensors}
    assert len(got) == len(tensors), "duplicate tensor names in the inventory"
    return got


def assert_same(got: dict, want: dict) -> None:
    """Dict equality with a readable report (the dicts are far too big for pytest's diff)."""
    if got == want:
        return
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    lines = [f"{len(missing)} missing, {len(extra)} unexpected, {len(wrong)} with wrong shape/dtype"]
    lines += [f"  missing {k} {want[k]}" for k in missing[:10]]
    lines += [f"  unexpected {k} {got[k]}" for k in extra[:10]]
    lines += [f"  wrong {k}: got {got[k]}, want {want[k]}" for k in wrong[:10]]
    pytest.fail("\n".join(lines))


# ------------------------------------------------------------------------------------------------
# The release inventory
# ------------------------------------------------------------------------------------------------

def test_k3_inventory_matches_spec(k3_got, k3_want):
    assert_same(k3_got, k3_want)


def test_k3_totals(k3_inventory, k3_want):
    assert len(k3_want) == 497_220
    assert total_bytes(k3_want) == 1_560_860_324_864
    assert len(k3_inventory) == 497_220
    assert sum(t.nbytes for t in k3_inventory) == 1_560_860_324_864


def test_k3_spot_shapes(k3_want):
    """A few shapes exactly as printed in SPEC 2.1 and 10 (guards the formulas themselves)."""
    L = "language_model.model.layers."
    spot = {
        "language_model.model.embed_tokens.weight": ((163840, 7168), "BF16"),
        "language_model.model.output_attn_res_proj.weight": ((1, 7168), "BF16"),
        L + "1.self_attn.g_proj.weight": ((12288, 7168), "BF16"),
        L + "1.self_attn.q_conv1d.weight": ((12288, 1, 4), "F32"),
        L + "1.self_attn.f_a_proj.weight": ((128, 7168), "BF16"),
        L + "1.self_attn.f_b_proj.weight": ((12288, 128), "BF16"),
        L + "1.self_attn.b_proj.weight": ((96, 7168), "BF16"),
        L + "1.self_attn.A_log": ((128,), "F32"),
        L + "1.self_attn.o_norm.weight": ((128,), "F32"),
        L + "3.self_attn.q_b_proj.weight": ((18432, 1536), "BF16"),
        L + "3.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), "BF16"),
        L + "3.self_attn.kv_b_proj.weight": ((24576, 512), "BF16"),
        L + "92.self_attn.g_proj.weight": ((12288, 7168), "BF16"),
        L + "0.mlp.down_proj.weight": ((7168, 33792), "BF16"),
        L + "5.block_sparse_moe.shared_experts.up_proj.weight": ((6144, 7168), "BF16"),
        L + "5.block_sparse_moe.experts.895.w1.weight_packed": ((3072, 1792), "U8"),
        L + "5.block_sparse_moe.experts.0.w3.weight_scale": ((3072, 112), "U8"),
        L + "92.block_sparse_moe.experts.100.w2.weight_packed": ((3584, 1536), "U8"),
        L + "92.block_sparse_moe.experts.100.w2.weight_scale": ((3584, 96), "U8"),
        "vision_tower.patch_embed.proj.weight": ((1024, 3, 14, 14), "BF16"),
        "vision_tower.patch_embed.pos_emb.weight": ((64, 64, 1024), "BF16"),
        "vision_tower.encoder.blocks.26.wqkv.weight": ((4608, 1024), "BF16"),
        "vision_tower.encoder.blocks.26.wo.weight": ((1024, 1536), "BF16"),
        "mm_projector.proj.0.weight": ((4096, 4096), "BF16"),
        "mm_projector.proj.2.weight": ((7168, 4096), "BF16"),
    }
    for name, value in spot.items():
        assert k3_want[name] == value, name
    for absent in (L + "0.block_sparse_moe.gate.weight", L + "1.mlp.gate_proj.weight",
                   L + "3.self_attn.q_proj.weight", L + "1.self_attn.q_a_proj.weight",
                   "vision_tower.encoder.blocks.27.wo.weight", L + "93.input_layernorm.weight",
                   L + "1.block_sparse_moe.experts.896.w1.weight_packed"):
        assert absent not in k3_want, absent


def test_k3_dtypes(k3_got):
    got = k3_got
    f32 = {kind_of(name) for name, (_, dt) in got.items() if dt == "F32"}
    assert f32 == F32_KINDS
    u8 = [name for name, (_, dt) in got.items() if dt == "U8"]
    assert len(u8) == 92 * 896 * 6
    assert all(EXPERT_RE.fullmatch(name) for name in u8)
    assert set(dt for _, dt in got.values()) == {"BF16", "F32", "U8"}


def test_k3_counts_per_layer(k3, k3_inventory):
    per_layer: Counter = Counter()
    experts: Counter = Counter()
    globals_, vision = 0, 0
    for t in k3_inventory:
        name = t.name
        if name.startswith(("vision_tower.", "mm_projector.")):
            vision += 1
            continue
        parts = name.split(".", 5)  # language_model.model.layers.{i}.{module}.{rest}
        if parts[2] != "layers":
            globals_ += 1
            assert t.layer is None and t.expert is None, name
            continue
        layer = int(parts[3])
        assert t.layer == layer, name
        if parts[4] == "block_sparse_moe" and parts[5].startswith("experts."):
            experts[layer] += 1
            assert t.expert == int(parts[5].split(".", 2)[1]), name
        else:
            per_layer[layer] += 1
            assert t.expert is None, name
    assert globals_ == 5
    assert vision == 168
    assert per_layer[0] == 23
    for i in range(1, 93):
        want = 28 if i in k3.kda_layers else 22
        assert per_layer[i] == want, i
    assert set(per_layer) == set(range(93))
    assert set(experts) == set(range(1, 93)) and set(experts.values()) == {896 * 6}
    assert sum(experts.values()) == 92 * 896 * 6


def test_k3_stack_positions(k3, k3_inventory):
    """Each tensor's index in its leaf's stack is the layer's position in that kind's stack."""
    attn_paths = ("text.kda.", "text.mla.")
    for t in k3_inventory:
        if t.layer is None or t.path.startswith("vision."):
            continue
        if t.expert is not None:
            if t.expert % 97 == 0:  # a sample is enough for the expert axis
                assert t.index == (k3.stack_index(t.layer)[1], t.expert), t.name
            continue
        a, f = k3.stack_index(t.layer)
        if t.path.startswith("text.layers."):
            want = t.layer
        elif t.path.startswith(attn_paths):
            want = a
        else:
            want = f
        assert t.index == (want,), (t.name, t.path, t.index)


def test_k3_text_only(k3, k3_dict):
    assert params.describe(k3, text_only=True).vision is None
    want = expected_inventory(k3_dict, text_only=True)
    assert len(want) == 497_220 - 168
    assert not any(name.startswith(("vision_tower.", "mm_projector.")) for name in want)
    # the text-only inventory itself is compared at the smaller sizes (test_other_sizes_match_spec)


def test_k3_param_count(k3, k3_want):
    experts, others = expected_param_count(k3_want)
    assert experts == 2_722_740_830_208
    assert others == 56_743_648_000
    assert experts + others == 2_779_484_478_208
    assert params.param_count(k3) == 2_779_484_478_208
    assert params.param_count(k3, experts=True) == 2_722_740_830_208
    assert params.param_count(k3, experts=False) == 56_743_648_000
    vision = sum(math.prod(s) for name, (s, _) in k3_want.items() if not name.startswith("language_model."))
    assert params.param_count(k3, vision=True) == vision


def test_k3_abstract(k3):
    live = len(jax.live_arrays())
    tree = params.abstract(k3)
    leaves = jax.tree_util.tree_leaves(tree)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert len(jax.live_arrays()) == live  # nothing allocated

    spec = params.describe(k3)
    named = params.named_leaves(spec)
    assert len(named) == len(leaves)
    for (path, leaf), sds in zip(named, leaves):
        assert len(leaf.full_axes) == len(leaf.full_shape), path
        assert len(leaf.axes) == len(leaf.shape), path
        assert sds.shape == leaf.full_shape and sds.dtype == leaf.dtype, path

    ex = tree.text.moe.experts
    u8 = np.dtype(np.uint8)
    assert ex.w1_packed.shape == (92, 896, 3072, 1792) and ex.w1_packed.dtype == u8
    assert ex.w1_scale.shape == (92, 896, 3072, 112) and ex.w1_scale.dtype == u8
    assert ex.w3_packed.shape == (92, 896, 3072, 1792) and ex.w3_packed.dtype == u8
    assert ex.w3_scale.shape == (92, 896, 3072, 112) and ex.w3_scale.dtype == u8
    assert ex.w2_packed.shape == (92, 896, 3584, 1536) and ex.w2_packed.dtype == u8
    assert ex.w2_scale.shape == (92, 896, 3584, 96) and ex.w2_scale.dtype == u8

    a_log = spec.text.kda.a_log
    assert a_log.shape == (128,) and a_log.dtype == np.float32
    assert tree.text.kda.a_log.shape == (69, 128)
    assert a_log.layers == k3.kda_layers
    assert tree.text.mla.q_b.shape == (24, 18432, 1536)
    assert tree.text.dense.gate.shape == (1, 33792, 7168)
    assert tree.text.layers.input_layernorm.shape == (93, 7168)
    assert tree.vision.blocks.wqkv.shape == (27, 4608, 1024)
    assert params.abstract(k3, text_only=True).vision is None


# ------------------------------------------------------------------------------------------------
# The same formulas at other sizes
# ------------------------------------------------------------------------------------------------

def _odd_dict() -> dict:
    """tiny sizes, a different MoE pattern (two dense layers, MoE every other layer), no vision."""
    d = derive(preset_dict("tiny"), num_layers=10, text={"first_k_dense_replace": 2, "moe_layer_freq": 2})
    del d["vision_config"]
    return d


@pytest.mark.parametrize("make", [lambda: preset_dict("tiny"), lambda: preset_dict("slice"),
                                  lambda: preset_dict("tiny", num_layers=13), _odd_dict],
                         ids=["tiny", "slice", "tiny13", "odd-moe"])
def test_other_sizes_match_spec(make):
    data = make()
    cfg = ModelConfig.from_dict(data)
    got = as_dict(inventory(cfg))
    want = expected_inventory(data)
    assert_same(got, want)
    assert sum(t.nbytes for t in inventory(cfg)) == total_bytes(want)
    experts, others = expected_param_count(want)
    assert params.param_count(cfg, experts=True) == experts
    assert params.param_count(cfg, experts=False) == others
    for path, leaf in params.named_leaves(params.describe(cfg)):
        assert len(leaf.full_axes) == len(leaf.full_shape), path
    text = as_dict(inventory(cfg, text_only=True))
    assert_same(text, expected_inventory(data, text_only=True))


def test_tiny_structure_counts():
    data = preset_dict("tiny")
    cfg = ModelConfig.from_dict(data)
    want = expected_inventory(data)
    tc = data["text_config"]
    n, E = tc["num_hidden_layers"], tc["num_experts"]
    vision_layers = data["vision_config"]["vt_num_hidden_layers"]
    per_layer = Counter(int(m.group(1)) for name in want
                        if (m := LAYER_RE.match(name)) and ".experts." not in name)
    assert per_layer[0] == 23
    for i in range(1, n):
        assert per_layer[i] == (28 if i in cfg.kda_layers else 22), i
    assert len(want) == 5 + sum(per_layer.values()) + (n - 1) * E * 6 + 6 * vision_layers + 6
    assert len(inventory(cfg)) == len(want)
    ex = params.abstract(cfg).text.moe.experts
    L, F = tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    assert ex.w1_packed.shape == (n - 1, E, F, L // 2)
    assert ex.w2_scale.shape == (n - 1, E, L, F // 32)
    assert params.abstract(cfg).text.kda.a_log.shape == (len(cfg.kda_layers), tc["linear_attn_config"]["head_dim"])


def test_tiny_has_no_square_weight_the_release_lacks(k3_want):
    """presets.py promises tiny widths differ so that a transposed weight cannot pass the loader:
    a 2-D weight with equal dims must be square in the release too (mm_projector.proj.0)."""
    release_square = {kind_of(n) for n, (s, _) in k3_want.items() if len(s) == 2 and s[0] == s[1]}
    assert release_square == {"mm_projector.proj.{}.weight"}  # proj.0 [4096, 4096]
    for name in ("tiny", "slice"):
        want = expected_inventory(preset_dict(name))
        square = {kind_of(n) for n, (s, _) in want.items() if len(s) == 2 and s[0] == s[1]}
        assert square <= release_square, (name, sorted(square - release_square))
