"""A float64 NumPy reference of the Kimi K3 text model, written from `shared/k3/SPEC.md` alone.

This module is ground truth for the JAX model, so it is deliberately plain: every weight is
upcast to float64, every step of the SPEC is written out literally (no bf16 rounding emulated,
no fusion, no chunking), and it imports nothing from `kimik3_jax`.

* KDA (SPEC 5) runs the token-by-token delta-rule recurrence.
* MLA (SPEC 6) runs the non-absorbed form with full softmax and an explicit causal mask.
* MoE (SPEC 7) loops over tokens and over each token's chosen experts.
* AttnRes (SPEC 4) follows the SPEC's layer loop line by line.

Shapes are for one sequence (no batch axis): activations are [T, D].
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  (must be imported before safetensors' numpy backend reads BF16)
import numpy as np
from safetensors import safe_open

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

MLA_NORM_EPS = 1e-6  # SPEC 6/12: the two MLA low-rank norms; not a config field
L2_EPS = 1e-6        # SPEC 5: KDA q/k normalisation, eps inside the sum of squares
ROUTER_EPS = 1e-20   # SPEC 7: renormalisation denominator
MXFP4_GROUP = 32     # SPEC 3
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


# ------------------------------------------------------------------------------------ elementwise

def sigmoid(x):
    """1 / (1 + e^-x), evaluated without overflow for large |x|."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x):
    x = np.asarray(x, dtype=np.float64)
    return x * sigmoid(x)


def softmax(x, axis):
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def rms_norm(x, w, eps):
    """w * x / sqrt(mean(x^2) + eps) over the last axis; `w` None means no weight."""
    x = np.asarray(x, dtype=np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = y * np.asarray(w, dtype=np.float64)
    return y


def situ(g, u, beta, linear_beta):
    """SPEC 7: [beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)]."""
    g = np.asarray(g, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    return (beta * np.tanh(g / beta) * sigmoid(g)) * (linear_beta * np.tanh(u / linear_beta))


def l2_normalize(x, eps=L2_EPS):
    """x / sqrt(sum(x^2) + eps) over the last axis (eps inside the sum, SPEC 5)."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


# ----------------------------------------------------------------------------------- AttnRes (4)

def attn_res_mix(candidates, norm_w, proj_w, eps):
    """SPEC 4 `Mix`: candidates [n, ..., D] -> [..., D].

    Keys are the candidates RMS-normed without weight; the query vector is norm_w * proj_w[0];
    the logits are plain dot products (no temperature), softmaxed over the n candidates, and the
    result mixes the RAW candidates.
    """
    v = np.asarray(candidates, dtype=np.float64)
    w = np.asarray(norm_w, dtype=np.float64) * np.asarray(proj_w, dtype=np.float64).reshape(-1, v.shape[-1])[0]
    keys = rms_norm(v, None, eps)
    logits = np.sum(keys * w, axis=-1)          # [n, ...]
    p = softmax(logits, axis=0)                 # over the candidates
    return np.sum(p[..., None] * v, axis=0)


# ---------------------------------------------------------------------------------------- KDA (5)

def kda_gate(z, a_log, lower_bound):
    """g = lower_bound * sigmoid(exp(A_log[h]) * z): z [..., H, K], a_log [H] -> [..., H, K]."""
    z = np.asarray(z, dtype=np.float64)
    a = np.exp(np.asarray(a_log, dtype=np.float64))
    return lower_bound * sigmoid(a[:, None] * z)


def causal_conv(x, w, tail=None):
    """Depthwise causal conv: y_t[c] = sum_j w[c, 0, j] x_{t-(Kc-1)+j}[c] (tap Kc-1 = current token).

    x [T, C], w [C, 1, Kc], tail [Kc-1, C] = the Kc-1 inputs before x (zeros when None).
    Returns (y [T, C] before any activation, new_tail = last Kc-1 rows of concat(tail, x)).
    """
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    T, C = x.shape
    if w.shape[:2] != (C, 1):
        raise ValueError(f"conv weight {w.shape} does not fit {C} channels")
    kc = w.shape[2]
    if tail is None:
        tail = np.zeros((kc - 1, C), dtype=np.float64)
    tail = np.asarray(tail, dtype=np.float64)
    if tail.shape != (kc - 1, C):
        raise ValueError(f"conv tail {tail.shape}, expected {(kc - 1, C)}")
    xp = np.concatenate([tail, x], axis=0)      # row r is x_{r-(Kc-1)}
    y = np.zeros((T, C), dtype=np.float64)
    for j in range(kc):
        y += w[:, 0, j] * xp[j:j + T]
    new_tail = xp[xp.shape[0] - (kc - 1):]
    return y, new_tail


def kda_recurrent(q, k, v, g, beta, s0=None):
    """SPEC 5 recurrence, one token at a time, every head at once.

    q, k [T, H, K] used as given; v [T, H, V]; g [T, H, K] log decay; beta [T, H]; s0 [H, K, V].
        S = diag(exp(g_t)) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    Returns (o [T, H, V], S_final [H, K, V]).
    """
    q, k, v, g, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta))
    T, H, K = q.shape
    V = v.shape[-1]
    S = np.zeros((H, K, V), dtype=np.float64) if s0 is None else np.array(s0, dtype=np.float64)
    o = np.zeros((T, H, V), dtype=np.float64)
    for t in range(T):
        S = np.exp(g[t])[:, :, None] * S                         # decay first
        pred = np.einsum("hkv,hk->hv", S, k[t])                  # S^T k_t
        delta = beta[t][:, None] * (v[t] - pred)                 # [H, V]
        S = S + k[t][:, :, None] * delta[:, None, :]             # rank-1 update
        o[t] = np.einsum("hkv,hk->hv", S, q[t])                  # read after the update
    return o, S


# ---------------------------------------------------------------------------------------- MLA (6)

def mla_attention(q_nope, q_pe, k_nope, k_pe, v, scale, causal=True, q_offset=0):
    """Full-softmax attention with the shared (per-token, not per-head) k_pe slot.

    q_nope [T, H, Dn], q_pe [T, H, Dr], k_nope [S, H, Dn], k_pe [S, Dr], v [S, H, Dv].
    Query t sits at position q_offset + t and sees keys at positions <= its own. -> [T, H, Dv].
    """
    q_nope, q_pe, k_nope, k_pe, v = (np.asarray(a, dtype=np.float64) for a in (q_nope, q_pe, k_nope, k_pe, v))
    T = q_nope.shape[0]
    S = k_nope.shape[0]
    scores = (np.einsum("thd,shd->hts", q_nope, k_nope) + np.einsum("thd,sd->hts", q_pe, k_pe)) * scale
    if causal:
        qpos = q_offset + np.arange(T)[:, None]
        kpos = np.arange(S)[None, :]
        visible = kpos <= qpos                                   # [T, S]
        if not visible.any(axis=1).all():
            raise ValueError("a query sees no key (q_offset too small)")
        scores = np.where(visible[None], scores, -np.inf)
    p = softmax(scores, axis=-1)
    return np.einsum("hts,shv->thv", p, v)


# ---------------------------------------------------------------------------------------- MoE (7)

def router(x, w_router, bias, top_k, renormalize, scaling):
    """Sigmoid router: x [T, D] -> (idx [T, top_k] int64, weights [T, top_k]).

    Experts are chosen by s + bias in descending order, ties going to the lower expert index (a
    stable sort on -(s + bias)); the weights use s alone.
    """
    x = np.asarray(x, dtype=np.float64)
    s = sigmoid(x @ np.asarray(w_router, dtype=np.float64).T)   # [T, E]
    E = s.shape[-1]
    if not 0 < top_k <= E:
        raise ValueError(f"top_k {top_k} with {E} experts")
    choice = s if bias is None else s + np.asarray(bias, dtype=np.float64)
    idx = np.zeros((s.shape[0], top_k), dtype=np.int64)
    for t in range(s.shape[0]):
        order = np.argsort(-choice[t], kind="stable")            # equal keys keep index order
        idx[t] = order[:top_k]
    w = np.take_along_axis(s, idx, axis=-1)
    if renormalize:
        w = w / (np.sum(w, axis=-1, keepdims=True) + ROUTER_EPS)
    return idx, w * scaling


def mxfp4_dequantize(packed, scale):
    """SPEC 3: uint8 packed [..., out, in/2] and scale [..., out, in/32] -> float64 [..., out, in]."""
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise ValueError(f"MXFP4 needs uint8 packed and scale, got {packed.dtype} and {scale.dtype}")
    if packed.ndim < 2 or scale.ndim != packed.ndim or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"MXFP4 shapes do not match: packed {packed.shape}, scale {scale.shape}")
    n_in = 2 * packed.shape[-1]
    if n_in % MXFP4_GROUP or scale.shape[-1] != n_in // MXFP4_GROUP:
        raise ValueError(f"MXFP4 shapes do not match: packed {packed.shape}, scale {scale.shape}")
    if np.any(scale == 255):
        raise ValueError("MXFP4 scale byte 255 (E8M0 NaN)")
    low = packed & 0x0F                                          # element 2j
    high = packed >> 4                                           # element 2j+1
    nib = np.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (n_in,))
    mag = E2M1_MAGNITUDES[nib & 0x7]
    val = np.where((nib & 0x8) != 0, -mag, mag)
    factor = np.ldexp(1.0, scale.astype(np.int64) - 127)         # 2^(byte - 127), exact in float64
    groups = val.reshape(packed.shape[:-1] + (n_in // MXFP4_GROUP, MXFP4_GROUP))
    return (groups * factor[..., None]).reshape(val.shape)


# ------------------------------------------------------------------------------------------ config

@dataclass(frozen=True)
class RefConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    attn_res_block_size: int
    kda_layers: frozenset      # 0-based
    mla_layers: frozenset      # 0-based
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    situ_beta: float
    situ_linear_beta: float
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_norm_eps: float = MLA_NORM_EPS

    def is_kda(self, i):
        return i in self.kda_layers

    def is_moe(self, i):
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


def parse_config(data):
    """RefConfig from a config.json dict (top level with `text_config`, or the text config itself)."""
    tc = data.get("text_config", data)
    lin = tc["linear_attn_config"]

    def refuse(cond, what):
        if cond:
            raise ValueError(f"the K3 reference does not support {what}")

    refuse(tc.get("hidden_act", "situ") != "situ", f"hidden_act {tc.get('hidden_act')!r}")
    refuse(tc.get("moe_router_activation_func", "sigmoid") != "sigmoid",
           f"router activation {tc.get('moe_router_activation_func')!r}")
    refuse(tc.get("topk_method", "noaux_tc") != "noaux_tc", f"topk_method {tc.get('topk_method')!r}")
    refuse(tc.get("use_grouped_topk", False) and (tc.get("num_expert_group", 1) or 1) > 1, "expert groups > 1")
    refuse((tc.get("topk_group", 1) or 1) > 1, "topk_group > 1")
    refuse(not tc.get("mla_use_nope", True), "RoPE in MLA (mla_use_nope false)")
    refuse(not tc.get("mla_use_output_gate", True), "MLA without the output gate")
    refuse(not lin.get("use_full_rank_gate", True), "a low-rank KDA output gate")
    refuse(tc.get("q_lora_rank") is None, "MLA without q_lora_rank")

    n = int(tc["num_hidden_layers"])
    kda = frozenset(int(i) - 1 for i in lin["kda_layers"])
    mla = frozenset(int(i) - 1 for i in lin["full_attn_layers"])
    if kda & mla or (kda | mla) != frozenset(range(n)):
        raise ValueError("kda_layers and full_attn_layers must split layers 1..num_hidden_layers")
    return RefConfig(
        vocab_size=int(tc["vocab_size"]),
        hidden_size=int(tc["hidden_size"]),
        num_layers=n,
        rms_norm_eps=float(tc["rms_norm_eps"]),
        attn_res_block_size=int(tc["attn_res_block_size"]),
        kda_layers=kda,
        mla_layers=mla,
        kda_num_heads=int(lin["num_heads"]),
        kda_head_dim=int(lin["head_dim"]),
        conv_kernel=int(lin["short_conv_kernel_size"]),
        gate_lower_bound=float(lin["gate_lower_bound"]),
        first_k_dense_replace=int(tc["first_k_dense_replace"]),
        moe_layer_freq=int(tc["moe_layer_freq"]),
        num_experts=int(tc["num_experts"]),
        top_k=int(tc["num_experts_per_token"]),
        num_shared_experts=int(tc.get("num_shared_experts", 0) or 0),
        latent_moe_use_norm=bool(tc["latent_moe_use_norm"]),
        routed_scaling_factor=float(tc["routed_scaling_factor"]),
        moe_renormalize=bool(tc["moe_renormalize"]),
        situ_beta=float(tc["activation_situ_beta"]),
        situ_linear_beta=float(tc["activation_situ_linear_beta"]),
        num_attention_heads=int(tc["num_attention_heads"]),
        q_lora_rank=int(tc["q_lora_rank"]),
        kv_lora_rank=int(tc["kv_lora_rank"]),
        qk_nope_head_dim=int(tc["qk_nope_head_dim"]),
        qk_rope_head_dim=int(tc["qk_rope_head_dim"]),
        v_head_dim=int(tc["v_head_dim"]),
    )


# ------------------------------------------------------------------------------------------ layers

def _w(p, key):
    return np.asarray(p[key], dtype=np.float64)


def kda_layer(x, p, cfg, state=None, return_state=False):
    """SPEC 5: x [T, D] (already RMSNorm_input-ed) -> [T, D].

    `state` (optional) continues a sequence: {"q_tail", "k_tail", "v_tail": [Kc-1, C], "S": [H, K, V]}.
    With return_state the new state is returned as well: (out, state).
    """
    x = np.asarray(x, dtype=np.float64)
    T = x.shape[0]
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    a = "self_attn."
    st = state or {}

    streams = {}
    tails = {}
    for name in ("q", "k", "v"):
        pre = x @ _w(p, f"{a}{name}_proj.weight").T                       # [T, H*dim]
        y, tails[f"{name}_tail"] = causal_conv(pre, _w(p, f"{a}{name}_conv1d.weight"), st.get(f"{name}_tail"))
        streams[name] = silu(y).reshape(T, H, -1)
    q, k, v = streams["q"], streams["k"], streams["v"]
    if q.shape[-1] != K or k.shape[-1] != K:
        raise ValueError(f"q/k head width {q.shape[-1]}/{k.shape[-1]} != head_dim {K}")
    V = v.shape[-1]

    z = (x @ _w(p, a + "f_a_proj.weight").T) @ _w(p, a + "f_b_proj.weight").T + _w(p, a + "dt_bias")
    g = kda_gate(z.reshape(T, H, K), _w(p, a + "A_log")[:H], cfg.gate_lower_bound)
    beta = sigmoid(x @ _w(p, a + "b_proj.weight").T)                      # [T, H]

    q = l2_normalize(q, L2_EPS) * K ** -0.5
    k = l2_normalize(k, L2_EPS)
    o, S = kda_recurrent(q, k, v, g, beta, st.get("S"))

    o = rms_norm(o, _w(p, a + "o_norm.weight"), cfg.rms_norm_eps)         # per head, shared weight
    gate = sigmoid(x @ _w(p, a + "g_proj.weight").T).reshape(T, H, V)
    out = (o * gate).reshape(T, H * V) @ _w(p, a + "o_proj.weight").T
    if return_state:
        return out, {**tails, "S": S}
    return out


def mla_layer(x, p, cfg, past=None, return_cache=False):
    """SPEC 6 (non-absorbed): x [T, D] (already RMSNorm_input-ed) -> [T, D].

    `past` (optional) holds earlier tokens' {"k_nope": [S0, H, Dn], "k_pe": [S0, Dr], "v": [S0, H, Dv]};
    the new tokens sit at positions S0.. . With return_cache the extended cache is returned as well.
    """
    x = np.asarray(x, dtype=np.float64)
    T = x.shape[0]
    H = cfg.num_attention_heads
    Dn, Dr, Dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    a = "self_attn."

    cq = rms_norm(x @ _w(p, a + "q_a_proj.weight").T, _w(p, a + "q_a_layernorm.weight"), cfg.mla_norm_eps)
    q = (cq @ _w(p, a + "q_b_proj.weight").T).reshape(T, H, Dn + Dr)
    q_nope, q_pe = q[..., :Dn], q[..., Dn:]

    ckv = x @ _w(p, a + "kv_a_proj_with_mqa.weight").T                    # [T, R + Dr]
    c = rms_norm(ckv[:, :R], _w(p, a + "kv_a_layernorm.weight"), cfg.mla_norm_eps)
    k_pe = ckv[:, R:]                                                      # not normed, not rotated
    kv = (c @ _w(p, a + "kv_b_proj.weight").T).reshape(T, H, Dn + Dv)
    k_nope, v = kv[..., :Dn], kv[..., Dn:]

    offset = 0
    if past is not None:
        offset = past["k_pe"].shape[0]
        k_nope = np.concatenate([past["k_nope"], k_nope], axis=0)
        k_pe = np.concatenate([past["k_pe"], k_pe], axis=0)
        v = np.concatenate([past["v"], v], axis=0)

    o = mla_attention(q_nope, q_pe, k_nope, k_pe, v, (Dn + Dr) ** -0.5, causal=True, q_offset=offset)
    o = o.reshape(T, H * Dv) * sigmoid(x @ _w(p, a + "g_proj.weight").T)
    out = o @ _w(p, a + "o_proj.weight").T
    if return_cache:
        return out, {"k_nope": k_nope, "k_pe": k_pe, "v": v}
    return out


def _situ_mlp(x, w_gate, w_up, w_down, cfg):
    return situ(x @ w_gate.T, x @ w_up.T, cfg.situ_beta, cfg.situ_linear_beta) @ w_down.T


def dense_ffn(x, p, cfg):
    """SPEC 7 dense SiTU MLP (`mlp.*`): x [T, D] (already RMSNorm_post-ed) -> [T, D]."""
    x = np.asarray(x, dtype=np.float64)
    return _situ_mlp(x, _w(p, "mlp.gate_proj.weight"), _w(p, "mlp.up_proj.weight"),
                     _w(p, "mlp.down_proj.weight"), cfg)


def _expert_weight(p, e, which):
    """Expert e's w1/w2/w3 as float64: `.weight` if given, else dequantised from packed + scale."""
    base = f"block_sparse_moe.experts.{e}.{which}."
    if base + "weight" in p:
        return _w(p, base + "weight")
    return mxfp4_dequantize(p[base + "weight_packed"], p[base + "weight_scale"])


def latent_moe(x, p, cfg):
    """SPEC 7 latent MoE (`block_sparse_moe.*`): x [T, D] (already RMSNorm_post-ed) -> [T, D]."""
    x = np.asarray(x, dtype=np.float64)
    m = "block_sparse_moe."
    idx, weights = router(x, _w(p, m + "gate.weight"), _w(p, m + "gate.e_score_correction_bias"),
                          cfg.top_k, cfg.moe_renormalize, cfg.routed_scaling_factor)
    xl = x @ _w(p, m + "routed_expert_down_proj.weight").T                # [T, L]
    y = np.zeros_like(xl)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            w1, w3, w2 = (_expert_weight(p, e, n) for n in ("w1", "w3", "w2"))
            h = situ(xl[t] @ w1.T, xl[t] @ w3.T, cfg.situ_beta, cfg.situ_linear_beta)
            y[t] += weights[t, j] * (h @ w2.T)
    if cfg.latent_moe_use_norm:
        y = rms_norm(y, _w(p, m + "routed_expert_norm.weight"), cfg.rms_norm_eps)
    y = y @ _w(p, m + "routed_expert_up_proj.weight").T
    if cfg.num_shared_experts > 0:
        s = m + "shared_experts."
        y = y + _situ_mlp(x, _w(p, s + "gate_proj.weight"), _w(p, s + "up_proj.weight"),
                          _w(p, s + "down_proj.weight"), cfg)
    return y


# ------------------------------------------------------------------------------------- checkpoint

class _LayerView(Mapping):
    """Lazy float64 view of one layer's tensors, keyed by the name after `layers.{i}.`.

    A quantized weight `X.weight_packed` + `X.weight_scale` is also reachable as `X.weight`.
    """

    def __init__(self, ref, i):
        self._ref = ref
        self._prefix = f"{PREFIX}layers.{i}."
        self._keys = None

    def _names(self):
        if self._keys is None:
            self._keys = sorted(n[len(self._prefix):] for n in self._ref.names if n.startswith(self._prefix))
        return self._keys

    def __getitem__(self, key):
        if key not in self:
            raise KeyError(key)
        return self._ref.tensor(self._prefix + key)

    def __contains__(self, key):
        return isinstance(key, str) and self._ref.has(self._prefix + key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self):
        return len(self._names())


class Reference:
    """A checkpoint directory opened for the reference: parsed config plus lazy float64 tensors."""

    def __init__(self, ckpt_dir, cache=True):
        self.dir = Path(ckpt_dir)
        self.config_dict = json.loads((self.dir / CONFIG_FILE).read_text())
        self.cfg = parse_config(self.config_dict)
        index = json.loads((self.dir / INDEX_FILE).read_text())
        self.weight_map = dict(index["weight_map"])
        self.names = frozenset(self.weight_map)
        self._cache = {} if cache else None

    def has(self, name):
        if name in self.weight_map:
            return True
        return name.endswith(".weight") and name + "_packed" in self.weight_map

    def raw(self, name):
        """The tensor exactly as stored (its own dtype)."""
        with safe_open(self.dir / self.weight_map[name], framework="np") as f:
            return f.get_tensor(name)

    def tensor(self, name):
        """The tensor as float64; `X.weight` of a quantized weight is dequantised (SPEC 3)."""
        if self._cache is not None and name in self._cache:
            return self._cache[name]
        if name in self.weight_map:
            arr = np.asarray(self.raw(name)).astype(np.float64)
        elif name.endswith(".weight") and name + "_packed" in self.weight_map:
            arr = mxfp4_dequantize(self.raw(name + "_packed"), self.raw(name + "_scale"))
        else:
            raise KeyError(name)
        if self._cache is not None:
            self._cache[name] = arr
        return arr

    def layer(self, i):
        return _LayerView(self, i)


def load_reference(ckpt_dir):
    return Reference(ckpt_dir)


# ----------------------------------------------------------------------------------------- forward

def forward(model, tokens, trace=None):
    """Logits [T, vocab] (float64) for one sequence of token ids, per SPEC 4's layer loop.

    `model` is a checkpoint directory or a `Reference`. `trace`, if a list, receives one tuple per
    step: ("bank", i, n_blocks_after), ("mix", site, i, n_candidates), ("attn", i, "kda"|"mla"),
    ("ffn", i, "dense"|"moe"); the output mix has i = None.
    """
    ref = model if isinstance(model, Reference) else load_reference(model)
    cfg = ref.cfg
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D integer sequence, got {ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
    eps = cfg.rms_norm_eps
    log = trace.append if trace is not None else (lambda _event: None)

    def mix(site, p_norm, p_proj, cands, i):
        log(("mix", site, i, len(cands)))
        return attn_res_mix(np.stack(cands), p_norm, p_proj, eps)

    P = ref.tensor(PREFIX + "embed_tokens.weight")[ids]                 # [T, D]
    blocks = []
    for i in range(cfg.num_layers):
        p = ref.layer(i)
        if blocks:
            h = mix("self_attention_res", p["self_attention_res_norm.weight"],
                    p["self_attention_res_proj.weight"], blocks + [P], i)
        else:
            h = P
        if i % cfg.attn_res_block_size == 0:
            blocks.append(P)                                             # the raw layer input, not h
            P = None
            log(("bank", i, len(blocks)))
        x = rms_norm(h, p["input_layernorm.weight"], eps)
        if cfg.is_kda(i):
            log(("attn", i, "kda"))
            a = kda_layer(x, p, cfg)
        else:
            log(("attn", i, "mla"))
            a = mla_layer(x, p, cfg)
        P = a if P is None else P + a
        h2 = mix("mlp_res", p["mlp_res_norm.weight"], p["mlp_res_proj.weight"], blocks + [P], i)
        x2 = rms_norm(h2, p["post_attention_layernorm.weight"], eps)
        if cfg.is_moe(i):
            log(("ffn", i, "moe"))
            f = latent_moe(x2, p, cfg)
        else:
            log(("ffn", i, "dense"))
            f = dense_ffn(x2, p, cfg)
        P = P + f
    h = mix("output_attn_res", ref.tensor(PREFIX + "output_attn_res_norm.weight"),
            ref.tensor(PREFIX + "output_attn_res_proj.weight"), blocks + [P], None)
    return rms_norm(h, ref.tensor(PREFIX + "norm.weight"), eps) @ ref.tensor(LM_HEAD).T
