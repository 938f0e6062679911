"""`ModelConfig`: every size, epsilon and switch of K3, parsed from a release-style `config.json`.

The config is a frozen, hashable dataclass tree, so it can be a static argument under `jax.jit`.
Parsing accepts the release file (top level with `text_config`, `vision_config` and the nested
`quantization_config`) or a bare text config; unknown fields are ignored, missing required fields and
inconsistent or unsupported values raise `ConfigError` naming the field (SPEC sections 1 and 12).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kimik3_jax.errors import ConfigError

LAYER_KDA = "kda"
LAYER_MLA = "mla"
FFN_DENSE = "dense"
FFN_MOE = "moe"


class _Fields:
    """Typed access to one JSON object, with errors that name `where.field`."""

    def __init__(self, data: Any, where: str, origin: str):
        if not isinstance(data, Mapping):
            raise ConfigError(f"{origin}: `{where}` must be a JSON object, got {type(data).__name__}")
        self.data, self.where, self.origin = data, where, origin

    def path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def fail(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"{self.origin}: `{self.path(name)}` {why}")

    def get(self, name: str, kind: type | tuple, default: Any = dataclasses.MISSING) -> Any:
        if name not in self.data or self.data[name] is None:
            if default is dataclasses.MISSING:
                raise self.fail(name, "is missing")
            return default
        value = self.data[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(name, f"must be {_kind_name(kinds)}, got {value!r}")
        if not isinstance(value, kinds):
            raise self.fail(name, f"must be {_kind_name(kinds)}, got {value!r}")
        return value

    def positive(self, name: str, default: Any = dataclasses.MISSING) -> int:
        value = self.get(name, int, default)
        if value <= 0:
            raise self.fail(name, f"must be a positive integer, got {value}")
        return value

    def sub(self, name: str) -> "_Fields":
        return _Fields(self.get(name, dict), self.path(name), self.origin)

    def expect(self, name: str, allowed: tuple, default: Any = dataclasses.MISSING) -> Any:
        """A field K3 fixes to one of `allowed` (same type too: `1` is not `true`)."""
        if self.data.get(name) is None:
            if default is dataclasses.MISSING:
                raise self.fail(name, "is missing")
            return default
        value = self.data[name]
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise self.fail(name, f"= {value!r} is not supported by K3 (supported: {', '.join(map(repr, allowed))})")
        return value


def _kind_name(kinds: tuple) -> str:
    return " or ".join({int: "an integer", float: "a number", bool: "a boolean", str: "a string",
                        list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int  # K = V = head_dim; also the width of f_a_proj and of the padded A_log
    conv_size: int
    gate_lower_bound: float


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    lora_norm_eps: float = 1e-6  # fixed in the reference code, not a config field (SPEC section 6)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_width: int  # moe_intermediate_size
    latent_width: int  # routed_expert_hidden_size
    num_shared_experts: int
    latent_use_norm: bool
    first_k_dense_replace: int
    layer_freq: int
    routed_scaling_factor: float
    renormalize: bool

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * self.expert_width


@dataclass(frozen=True)
class QuantConfig:
    format: str
    num_bits: int
    group_size: int


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    qkv_hidden_size: int
    intermediate_size: int
    pos_emb_height: int
    pos_emb_width: int
    merge_kernel: tuple[int, int]
    mm_hidden_size: int
    text_hidden_size: int
    projector_eps: float

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_width(self) -> int:
        return self.mm_hidden_size * self.merge_kernel[0] * self.merge_kernel[1]


IMPLS = ("auto", "xla", "pallas")


@dataclass(frozen=True)
class Runtime:
    """Execution choices that do not change the model's function (static under `jax.jit`).

    impl: which implementation of the hot ops runs: "xla" (the pure-JAX functions), "pallas" (the
      kernels; an unsupported call is an error) or "auto" (the kernels where the backend and the call
      are supported, else the pure functions).
    sharding: a `kimik3_jax.sharding.ShardingPlan` (mesh + rules) or None for one device.
    expert_scale_max: the largest E8M0 scale byte of the routed experts' weights, or None (unknown).
      `load_checkpoint` sets it. The MoE kernels use it to pick their decode: at most 128 (real weights'
      scales sit near 120) lets every program take the one-multiply decode without checking its own
      scale bytes first. A value below the weights' true maximum gives wrong results."""
    impl: str = "auto"
    sharding: Any = None
    expert_scale_max: int | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ConfigError(f"impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        m = self.expert_scale_max
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= 255):
            raise ConfigError(f"expert_scale_max must be None or a scale byte 0..255, got {m!r}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # the dense FFN of the first_k_dense_replace layers
    rms_norm_eps: float
    attn_res_block_size: int
    situ_beta: float
    situ_linear_beta: float
    max_position_embeddings: int
    layer_kinds: tuple[str, ...]  # LAYER_KDA or LAYER_MLA per 0-based layer
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    quant: QuantConfig
    vision: VisionConfig | None
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    media_placeholder_token_id: int | None
    source: Mapping[str, Any] = field(default=None, compare=False, hash=False, repr=False)
    runtime: "Runtime" = field(default_factory=lambda: Runtime())  # how it runs, not what it is

    def with_runtime(self, **changes) -> "ModelConfig":
        """The same model with other execution choices, e.g. `cfg.with_runtime(impl="pallas")`."""
        return dataclasses.replace(self, runtime=dataclasses.replace(self.runtime, **changes))

    # Derived facts -----------------------------------------------------------------------------
    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        m = self.moe
        return tuple(FFN_MOE if i >= m.first_k_dense_replace and i % m.layer_freq == 0 else FFN_DENSE
                     for i in range(self.num_layers))

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """0-based layer ids of an attention kind (kda, mla) or FFN kind (dense, moe), ascending."""
        kinds = self.layer_kinds if kind in (LAYER_KDA, LAYER_MLA) else self.ffn_kinds
        return tuple(i for i, k in enumerate(kinds) if k == kind)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return self.layers_of(LAYER_KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return self.layers_of(LAYER_MLA)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.layers_of(FFN_MOE)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return self.layers_of(FFN_DENSE)

    @property
    def block_starts(self) -> tuple[int, ...]:
        """Layers at which AttnRes banks its running block (`i % attn_res_block_size == 0`)."""
        return tuple(range(0, self.num_layers, self.attn_res_block_size))

    def stack_index(self, layer: int) -> tuple[int, int]:
        """(index in the attention-kind stack, index in the FFN-kind stack) of a 0-based layer."""
        return (self.layers_of(self.layer_kinds[layer]).index(layer),
                self.layers_of(self.ffn_kinds[layer]).index(layer))

    def summary(self) -> str:
        m = self.moe
        lines = [
            f"text: {self.num_layers} layers ({len(self.kda_layers)} KDA, {len(self.mla_layers)} MLA; "
            f"{len(self.dense_layers)} dense FFN, {len(self.moe_layers)} MoE), hidden {self.hidden_size}, "
            f"vocab {self.vocab_size}",
            f"  KDA {self.kda.num_heads}x{self.kda.head_dim}, conv {self.kda.conv_size}; "
            f"MLA {self.mla.num_heads} heads, q_lora {self.mla.q_lora_rank}, kv_lora {self.mla.kv_lora_rank}",
            f"  MoE {m.num_experts} experts top-{m.top_k}, latent {m.latent_width}, expert {m.expert_width}, "
            f"shared {m.shared_width}; AttnRes blocks of {self.attn_res_block_size} "
            f"(starts {list(self.block_starts)})",
        ]
        if self.vision is not None:
            v = self.vision
            lines.append(f"vision: {v.num_layers} layers, width {v.hidden_size}, {v.num_heads} heads, "
                         f"patch {v.patch_size} -> projector {v.merged_width} -> {v.text_hidden_size}")
        return "\n".join(lines)

    # Parsing --------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, origin=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "config.json") -> "ModelConfig":
        top = _Fields(data, "", origin)
        text = top.sub("text_config") if "text_config" in data else top
        vision = _parse_vision(top.sub("vision_config")) if "vision_config" in data else None
        cfg = _parse_text(text, top, vision, source=data)
        _check(cfg, text, top)
        return cfg


def _parse_text(t: _Fields, top: _Fields, vision: VisionConfig | None, source) -> ModelConfig:
    n = t.positive("num_hidden_layers")
    lin = t.sub("linear_attn_config")
    kda_1 = lin.get("kda_layers", list)
    full_1 = lin.get("full_attn_layers", list)
    for name, lst in (("kda_layers", kda_1), ("full_attn_layers", full_1)):
        bad = [x for x in lst if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= n]
        if bad:
            raise lin.fail(name, f"holds {bad[:5]}: entries must be 1-based layer numbers in 1..{n}")
    both = sorted(set(kda_1) & set(full_1))
    if both:
        raise lin.fail("full_attn_layers", f"and `kda_layers` both name layers {both[:5]} (1-based)")
    missing = sorted(set(range(1, n + 1)) - set(kda_1) - set(full_1))
    if missing:
        raise lin.fail("kda_layers", f"and `full_attn_layers` leave layers {missing[:5]} (1-based) without a kind")
    kinds = tuple(LAYER_KDA if (i + 1) in set(kda_1) else LAYER_MLA for i in range(n))

    for name, value in (("hidden_act", "situ"), ("moe_router_activation_func", "sigmoid"),
                        ("topk_method", "noaux_tc")):
        t.expect(name, (value,))
    t.expect("mla_use_nope", (True,))
    t.expect("mla_use_output_gate", (True,))
    t.expect("tie_word_embeddings", (False,), default=False)
    top.expect("tie_word_embeddings", (False,), default=False)  # the top level ties in HF too
    t.expect("num_nextn_predict_layers", (0,), default=0)
    t.expect("num_expert_group", (1,), default=1)
    t.expect("topk_group", (1,), default=1)
    lin.expect("use_full_rank_gate", (True,))

    heads = t.positive("num_attention_heads")
    if t.positive("num_key_value_heads", heads) != heads:
        raise t.fail("num_key_value_heads", f"= {t.data['num_key_value_heads']} must equal "
                     f"num_attention_heads = {heads} (MLA has one latent shared by all heads)")

    def token_id(name: str, default=dataclasses.MISSING):
        copies = [f for f in (t, top) if f.data.get(name) is not None]
        if len(copies) == 2 and t.data is not top.data and t.get(name, int) != top.get(name, int):
            raise t.fail(name, f"= {t.data[name]} differs from the top-level {name} = {top.data[name]}")
        return (copies[0] if copies else t).get(name, int, default)

    return ModelConfig(
        vocab_size=t.positive("vocab_size"),
        hidden_size=t.positive("hidden_size"),
        num_layers=n,
        intermediate_size=t.positive("intermediate_size"),
        rms_norm_eps=t.get("rms_norm_eps", float),
        attn_res_block_size=t.positive("attn_res_block_size"),
        situ_beta=t.get("activation_situ_beta", float),
        situ_linear_beta=t.get("activation_situ_linear_beta", float),
        max_position_embeddings=t.positive("max_position_embeddings"),
        layer_kinds=kinds,
        kda=KDAConfig(
            num_heads=lin.positive("num_heads"),
            head_dim=lin.positive("head_dim"),
            conv_size=lin.positive("short_conv_kernel_size"),
            gate_lower_bound=lin.get("gate_lower_bound", float),
        ),
        mla=MLAConfig(
            num_heads=heads,
            q_lora_rank=t.positive("q_lora_rank"),
            kv_lora_rank=t.positive("kv_lora_rank"),
            qk_nope_head_dim=t.positive("qk_nope_head_dim"),
            qk_rope_head_dim=t.positive("qk_rope_head_dim"),
            v_head_dim=t.positive("v_head_dim"),
        ),
        moe=MoEConfig(
            num_experts=t.positive("num_experts"),
            top_k=t.positive("num_experts_per_token"),
            expert_width=t.positive("moe_intermediate_size"),
            latent_width=t.positive("routed_expert_hidden_size"),
            num_shared_experts=t.positive("num_shared_experts"),
            latent_use_norm=t.get("latent_moe_use_norm", bool),
            first_k_dense_replace=t.get("first_k_dense_replace", int),
            layer_freq=t.positive("moe_layer_freq"),
            routed_scaling_factor=t.get("routed_scaling_factor", float),
            renormalize=t.get("moe_renormalize", bool),
        ),
        quant=_parse_quant(t, top),
        vision=vision,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("pad_token_id"),
        media_placeholder_token_id=token_id("media_placeholder_token_id", None),
        source=source,
    )


def _parse_quant(t: _Fields, top: _Fields) -> QuantConfig:
    copies = [f for f in (t, top) if "quantization_config" in f.data]
    if not copies:
        raise t.fail("quantization_config", "is missing (K3 routed experts are MXFP4)")
    if len(copies) == 2 and t.data is not top.data and t.data["quantization_config"] != top.data["quantization_config"]:
        raise t.fail("quantization_config", "differs from the top-level `quantization_config`")
    q = copies[0].sub("quantization_config")
    q.expect("quant_method", ("compressed-tensors",))
    fmt = q.expect("format", ("mxfp4-pack-quantized",))
    groups = q.sub("config_groups")
    if len(groups.data) != 1:
        raise q.fail("config_groups", f"has {len(groups.data)} groups; K3 has exactly one")
    g = groups.sub(next(iter(groups.data)))
    g.expect("format", ("mxfp4-pack-quantized",), default=fmt)  # a group format overrides the outer one
    w = g.sub("weights")
    w.expect("type", ("float",))
    w.expect("strategy", ("group",))
    w.expect("symmetric", (True,))
    w.expect("scale_dtype", ("torch.uint8",), default="torch.uint8")
    return QuantConfig(format=fmt, num_bits=w.expect("num_bits", (4,)), group_size=w.expect("group_size", (32,)))


def _parse_vision(v: _Fields) -> VisionConfig:
    v.expect("norm_type", ("rmsnorm",))
    v.expect("merge_type", ("sd2_tpool",))
    v.expect("mm_projector_type", ("patchmergerv2",))
    v.expect("activation_func", ("gelu_pytorch_tanh",))
    for flag in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
        v.expect(flag, (False,))
    merge = v.get("merge_kernel_size", list)
    if len(merge) != 2 or not all(isinstance(m, int) and m > 0 for m in merge):
        raise v.fail("merge_kernel_size", f"must be two positive integers, got {merge!r}")
    cfg = VisionConfig(
        patch_size=v.positive("patch_size"),
        hidden_size=v.positive("vt_hidden_size"),
        num_layers=v.positive("vt_num_hidden_layers"),
        num_heads=v.positive("vt_num_attention_heads"),
        qkv_hidden_size=v.positive("qkv_hidden_size"),
        intermediate_size=v.positive("vt_intermediate_size"),
        pos_emb_height=v.positive("init_pos_emb_height"),
        pos_emb_width=v.positive("init_pos_emb_width"),
        merge_kernel=(merge[0], merge[1]),
        mm_hidden_size=v.positive("mm_hidden_size"),
        text_hidden_size=v.positive("text_hidden_size"),
        projector_eps=v.get("projector_ln_eps", float),
    )
    if cfg.qkv_hidden_size % cfg.num_heads:
        raise v.fail("qkv_hidden_size", f"= {cfg.qkv_hidden_size} is not divisible by "
                     f"vt_num_attention_heads = {cfg.num_heads}")
    if cfg.head_dim % 4:
        raise v.fail("qkv_hidden_size", f"gives head dim {cfg.head_dim}; 2-D RoPE needs a multiple of 4")
    if cfg.mm_hidden_size != cfg.hidden_size:
        raise v.fail("mm_hidden_size", f"= {cfg.mm_hidden_size} must equal vt_hidden_size = {cfg.hidden_size}")
    return cfg


def _check(cfg: ModelConfig, t: _Fields, top: _Fields) -> None:
    """Cross-field consistency that the shapes of the checkpoint rely on."""
    m, q, k = cfg.moe, cfg.quant, cfg.kda
    if m.top_k > m.num_experts:
        raise t.fail("num_experts_per_token", f"= {m.top_k} exceeds num_experts = {m.num_experts}")
    for name, width in (("routed_expert_hidden_size", m.latent_width), ("moe_intermediate_size", m.expert_width)):
        if width % q.group_size:
            raise t.fail(name, f"= {width} is not a multiple of the MXFP4 group size {q.group_size}")
    if not 0 <= m.first_k_dense_replace <= cfg.num_layers:
        raise t.fail("first_k_dense_replace", f"= {m.first_k_dense_replace} is outside 0..{cfg.num_layers}")
    if k.num_heads > k.head_dim:
        lin = t.sub("linear_attn_config")
        raise lin.fail("num_heads", f"= {k.num_heads} exceeds head_dim = {k.head_dim}: the release stores "
                       "A_log zero-padded to head_dim")
    if not cfg.rms_norm_eps > 0:
        raise t.fail("rms_norm_eps", f"= {cfg.rms_norm_eps} must be positive")
    if not k.gate_lower_bound < 0:
        raise t.sub("linear_attn_config").fail("gate_lower_bound", f"= {k.gate_lower_bound} must be negative")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
        value = getattr(cfg, name)
        if value is not None and not 0 <= value < cfg.vocab_size:
            where = t if name in t.data else top
            raise where.fail(name, f"= {value} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    if cfg.vision is not None and cfg.vision.text_hidden_size != cfg.hidden_size:
        raise top.sub("vision_config").fail(
            "text_hidden_size", f"= {cfg.vision.text_hidden_size} must equal text hidden_size = {cfg.hidden_size}")
