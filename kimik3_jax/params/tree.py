"""The K3 parameter tree: Flax struct dataclasses (pytrees) and their `Leaf` descriptions.

`describe(cfg)` returns the tree with a `Leaf` at every position; `abstract`, `init_params` and the
checkpoint code map over it. Weights keep the release's `[out, in]` layout, so loading is a copy
and the ops contract on the last axis. Layers are stacked by kind (all layers' norms; KDA layers;
MLA layers; dense FFN layers; MoE layers), in ascending layer order; `ModelConfig.stack_index`
maps a layer id to its position in each stack.
"""

from __future__ import annotations

import math
from functools import partial

from flax import struct

from kimik3_jax.config import ModelConfig
from kimik3_jax.params.leaf import BF16, BITS, F32, FAN_IN, NEAR_ONE, U8, Init, Leaf

TEXT = "language_model."
LAYER = TEXT + "model.layers.{layer}."


@struct.dataclass
class LayerNorms:  # every layer: pre-norms and the two AttnRes sites
    input_layernorm: object
    post_attention_layernorm: object
    attn_res_norm: object
    attn_res_proj: object
    mlp_res_norm: object
    mlp_res_proj: object


@struct.dataclass
class KDAParams:
    q_proj: object
    k_proj: object
    v_proj: object
    g_proj: object  # output gate
    q_conv: object
    k_conv: object
    v_conv: object
    f_a: object
    f_b: object
    b_proj: object
    dt_bias: object
    a_log: object  # zero-padded to head_dim, as released; the heads are [:num_heads]
    o_norm: object
    o_proj: object


@struct.dataclass
class MLAParams:
    q_a: object
    q_a_norm: object
    q_b: object
    kv_a: object
    kv_a_norm: object
    kv_b: object
    g_proj: object  # output gate
    o_proj: object


@struct.dataclass
class MLPParams:  # the dense first layers and the fused shared experts
    gate: object
    up: object
    down: object


@struct.dataclass
class ExpertParams:  # MXFP4, packed as released, stacked [layers, experts, ...]
    w1_packed: object
    w1_scale: object
    w3_packed: object
    w3_scale: object
    w2_packed: object
    w2_scale: object


@struct.dataclass
class DenseExpertParams:  # experts dequantised for research use (`kimik3 convert --dequantize bf16`)
    w1: object  # [layers, experts, expert_width, latent_width] (gate)
    w3: object  # same (up)
    w2: object  # [layers, experts, latent_width, expert_width] (down)


@struct.dataclass
class MoEParams:
    router: object
    router_bias: object  # e_score_correction_bias: selection only
    latent_down: object
    latent_norm: object
    latent_up: object
    shared: MLPParams
    experts: ExpertParams  # or DenseExpertParams


@struct.dataclass
class TextParams:
    embed: object
    layers: LayerNorms
    kda: KDAParams
    mla: MLAParams
    dense: MLPParams
    moe: MoEParams
    final_norm: object
    out_res_norm: object
    out_res_proj: object
    lm_head: object


@struct.dataclass
class VisionBlocks:
    norm0: object
    norm1: object
    wqkv: object
    wo: object
    fc0: object
    fc1: object


@struct.dataclass
class VisionParams:
    patch_embed: object
    pos_emb: object
    blocks: VisionBlocks
    final_norm: object
    proj0: object
    proj2: object
    post_norm: object


@struct.dataclass
class Params:
    text: TextParams
    vision: VisionParams | None


def _weight(name, shape, axes, layers=None, dtype=BF16, init=FAN_IN, **kw) -> Leaf:
    return Leaf(name, tuple(shape), dtype, tuple(axes), init, layers=layers, **kw)


def _scale_bytes(fan_in: int) -> Init:
    """E8M0 bytes spread around the scale that gives weights of std ~ 1/sqrt(fan_in)."""
    centre = round(127 - math.log2(2.6 * math.sqrt(fan_in)))
    return Init("scale_bytes", lo=centre - 4, hi=centre + 3)


def describe_text(cfg: ModelConfig) -> TextParams:
    d, v, kda, mla, moe = cfg.hidden_size, cfg.vocab_size, cfg.kda, cfg.mla, cfg.moe
    g = cfg.quant.group_size
    hk = kda.num_heads * kda.head_dim
    every = tuple(range(cfg.num_layers))
    norm = partial(_weight, init=NEAR_ONE)
    w_all = partial(_weight, layers=every)
    n_all = partial(norm, layers=every)
    layers = LayerNorms(
        input_layernorm=n_all(LAYER + "input_layernorm.weight", [d], ["embed"]),
        post_attention_layernorm=n_all(LAYER + "post_attention_layernorm.weight", [d], ["embed"]),
        attn_res_norm=n_all(LAYER + "self_attention_res_norm.weight", [d], ["embed"]),
        attn_res_proj=w_all(LAYER + "self_attention_res_proj.weight", [1, d], [None, "embed"]),
        mlp_res_norm=n_all(LAYER + "mlp_res_norm.weight", [d], ["embed"]),
        mlp_res_proj=w_all(LAYER + "mlp_res_proj.weight", [1, d], [None, "embed"]),
    )

    at = LAYER + "self_attn."
    w = partial(_weight, layers=cfg.kda_layers)
    conv = partial(w, dtype=F32, init=Init("fan_in", 1.0))
    kda_p = KDAParams(
        q_proj=w(at + "q_proj.weight", [hk, d], ["kda_heads", "embed"]),
        k_proj=w(at + "k_proj.weight", [hk, d], ["kda_heads", "embed"]),
        v_proj=w(at + "v_proj.weight", [hk, d], ["kda_heads", "embed"]),
        g_proj=w(at + "g_proj.weight", [hk, d], ["kda_heads", "embed"]),
        q_conv=conv(at + "q_conv1d.weight", [hk, 1, kda.conv_size], ["kda_heads", None, None]),
        k_conv=conv(at + "k_conv1d.weight", [hk, 1, kda.conv_size], ["kda_heads", None, None]),
        v_conv=conv(at + "v_conv1d.weight", [hk, 1, kda.conv_size], ["kda_heads", None, None]),
        f_a=w(at + "f_a_proj.weight", [kda.head_dim, d], [None, "embed"]),
        f_b=w(at + "f_b_proj.weight", [hk, kda.head_dim], ["kda_heads", None]),
        b_proj=w(at + "b_proj.weight", [kda.num_heads, d], ["kda_heads", "embed"]),
        dt_bias=w(at + "dt_bias", [hk], ["kda_heads"], dtype=F32, init=Init("normal", 1.0)),
        a_log=w(at + "A_log", [kda.head_dim], [None], dtype=F32, init=Init("alog", lo=kda.num_heads)),
        o_norm=w(at + "o_norm.weight", [kda.head_dim], [None], dtype=F32, init=NEAR_ONE),
        o_proj=w(at + "o_proj.weight", [d, hk], ["embed", "kda_heads"]),
    )

    w = partial(_weight, layers=cfg.mla_layers)
    n = partial(norm, layers=cfg.mla_layers)
    mla_p = MLAParams(
        q_a=w(at + "q_a_proj.weight", [mla.q_lora_rank, d], [None, "embed"]),
        q_a_norm=n(at + "q_a_layernorm.weight", [mla.q_lora_rank], [None]),
        q_b=w(at + "q_b_proj.weight", [mla.num_heads * mla.qk_head_dim, mla.q_lora_rank], ["mla_heads", None]),
        kv_a=w(at + "kv_a_proj_with_mqa.weight", [mla.kv_lora_rank + mla.qk_rope_head_dim, d], [None, "embed"]),
        kv_a_norm=n(at + "kv_a_layernorm.weight", [mla.kv_lora_rank], [None]),
        kv_b=w(at + "kv_b_proj.weight", [mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank],
               ["mla_heads", None]),
        g_proj=w(at + "g_proj.weight", [mla.num_heads * mla.v_head_dim, d], ["mla_heads", "embed"]),
        o_proj=w(at + "o_proj.weight", [d, mla.num_heads * mla.v_head_dim], ["embed", "mla_heads"]),
    )

    def mlp(prefix: str, width: int, layer_ids) -> MLPParams:
        w = partial(_weight, layers=layer_ids)
        return MLPParams(
            gate=w(prefix + "gate_proj.weight", [width, d], ["mlp", "embed"]),
            up=w(prefix + "up_proj.weight", [width, d], ["mlp", "embed"]),
            down=w(prefix + "down_proj.weight", [d, width], ["embed", "mlp"]),
        )

    moe_ids = cfg.moe_layers
    at = LAYER + "block_sparse_moe."
    w = partial(_weight, layers=moe_ids)
    lat, f, e = moe.latent_width, moe.expert_width, moe.num_experts
    ex = partial(_weight, layers=moe_ids, dtype=U8, experts=e)
    ename = at + "experts.{expert}."
    experts = ExpertParams(
        w1_packed=ex(ename + "w1.weight_packed", [f, lat // 2], ["expert_mlp", None], init=BITS, mx="packed"),
        w1_scale=ex(ename + "w1.weight_scale", [f, lat // g], ["expert_mlp", None], init=_scale_bytes(lat), mx="scale"),
        w3_packed=ex(ename + "w3.weight_packed", [f, lat // 2], ["expert_mlp", None], init=BITS, mx="packed"),
        w3_scale=ex(ename + "w3.weight_scale", [f, lat // g], ["expert_mlp", None], init=_scale_bytes(lat), mx="scale"),
        w2_packed=ex(ename + "w2.weight_packed", [lat, f // 2], [None, "expert_mlp"], init=BITS, mx="packed"),
        w2_scale=ex(ename + "w2.weight_scale", [lat, f // g], [None, "expert_mlp"], init=_scale_bytes(f), mx="scale"),
    )
    moe_p = MoEParams(
        router=w(at + "gate.weight", [e, d], [None, "embed"]),
        router_bias=w(at + "gate.e_score_correction_bias", [e], [None], dtype=F32, init=Init("normal", 0.1)),
        latent_down=w(at + "routed_expert_down_proj.weight", [lat, d], ["latent", "embed"]),
        latent_norm=partial(norm, layers=moe_ids)(at + "routed_expert_norm.weight", [lat], ["latent"]),
        latent_up=w(at + "routed_expert_up_proj.weight", [d, lat], ["embed", "latent"]),
        shared=mlp(at + "shared_experts.", moe.shared_width, moe_ids),
        experts=experts,
    )

    top = TEXT + "model."
    return TextParams(
        embed=_weight(top + "embed_tokens.weight", [v, d], ["vocab", "embed"]),
        layers=layers,
        kda=kda_p,
        mla=mla_p,
        dense=mlp(LAYER + "mlp.", cfg.intermediate_size, cfg.dense_layers),
        moe=moe_p,
        final_norm=norm(top + "norm.weight", [d], ["embed"]),
        out_res_norm=norm(top + "output_attn_res_norm.weight", [d], ["embed"]),
        out_res_proj=_weight(top + "output_attn_res_proj.weight", [1, d], [None, "embed"]),
        lm_head=_weight(TEXT + "lm_head.weight", [v, d], ["vocab", "embed"]),
    )


def describe_vision(cfg: ModelConfig) -> VisionParams | None:
    vc = cfg.vision
    if vc is None:
        return None
    w, p, qkv, ff = vc.hidden_size, vc.patch_size, vc.qkv_hidden_size, vc.intermediate_size
    merged, d = vc.merged_width, cfg.hidden_size
    blk = "vision_tower.encoder.blocks.{layer}."
    b = partial(_weight, layers=tuple(range(vc.num_layers)), stack_axis="vision_layers")
    nb = partial(b, init=NEAR_ONE)
    return VisionParams(
        patch_embed=_weight("vision_tower.patch_embed.proj.weight", [w, 3, p, p], ["vision_embed", None, None, None]),
        pos_emb=_weight("vision_tower.patch_embed.pos_emb.weight", [vc.pos_emb_height, vc.pos_emb_width, w],
                        [None, None, "vision_embed"], init=Init("normal", 0.02)),
        blocks=VisionBlocks(
            norm0=nb(blk + "norm0.weight", [w], ["vision_embed"]),
            norm1=nb(blk + "norm1.weight", [w], ["vision_embed"]),
            wqkv=b(blk + "wqkv.weight", [3 * qkv, w], ["vision_qkv", "vision_embed"]),
            wo=b(blk + "wo.weight", [w, qkv], ["vision_embed", "vision_qkv"]),
            fc0=b(blk + "mlp.fc0.weight", [ff, w], ["vision_mlp", "vision_embed"]),
            fc1=b(blk + "mlp.fc1.weight", [w, ff], ["vision_embed", "vision_mlp"]),
        ),
        final_norm=_weight("vision_tower.encoder.final_layernorm.weight", [w], ["vision_embed"], init=NEAR_ONE),
        proj0=_weight("mm_projector.proj.0.weight", [merged, merged], ["projector", None]),
        proj2=_weight("mm_projector.proj.2.weight", [d, merged], ["embed", "projector"]),
        post_norm=_weight("mm_projector.post_norm.weight", [d], ["embed"], init=NEAR_ONE),
    )


def dense_experts(packed: ExpertParams) -> DenseExpertParams:
    """Leaves of dequantised experts: bf16 [layers, experts, out, in], stacked like the packed leaves."""
    def dense(leaf: Leaf) -> Leaf:
        out, packed_in = leaf.shape
        return Leaf(leaf.name.removesuffix("_packed"), (out, 2 * packed_in), BF16, leaf.axes, FAN_IN,
                    layers=leaf.layers, experts=leaf.experts)
    return DenseExpertParams(w1=dense(packed.w1_packed), w3=dense(packed.w3_packed), w2=dense(packed.w2_packed))


def describe(cfg: ModelConfig, text_only: bool = False) -> Params:
    return Params(text=describe_text(cfg), vision=None if text_only else describe_vision(cfg))
