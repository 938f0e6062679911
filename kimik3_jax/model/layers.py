"""One layer of each kind, composed from the pure ops. x is the normed layer input [B, T, D]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3_jax.config import ModelConfig
from kimik3_jax.ops.common import acc_dtype, linear, rms_norm
from kimik3_jax.ops.impl import dispatch
from kimik3_jax.ops.kda import kda_decode, kda_prefill, short_conv
from kimik3_jax.ops.mla import mla_attend, mla_attend_absorbed, mla_project, write_cache


def kda_layer(x, p, s, conv, lengths, cfg: ModelConfig, decode: bool):
    """KDA (SPEC section 5). s [B, H, K, V] state, conv [B, 3, W-1, H*K] conv tails, lengths [B] real
    tokens in x. Padded positions get g = 0 and beta = 0: they leave the state exactly unchanged.
    The fused ops `kda_decode` / `kda_prefill` run as cfg.runtime.impl selects (ops/impl.py).
    Returns (out [B, T, D], new s, new conv)."""
    kc = cfg.kda
    b, t, _ = x.shape
    h, dk = kc.num_heads, kc.head_dim
    act, acc = x.dtype, acc_dtype(x.dtype)
    heads = lambda a: a.reshape(b, t, h, dk)  # noqa: E731
    impl = cfg.runtime.impl
    z = heads(linear(linear(x, p.f_a), p.f_b, acc) + p.dt_bias.astype(acc))  # the gate's pre-activation
    beta = jax.nn.sigmoid(linear(x, p.b_proj, acc))  # [B, T, H]
    gate = heads(linear(x, p.g_proj, acc))
    gate_args = dict(a_log=p.a_log[:h], lower_bound=kc.gate_lower_bound)
    projs = [linear(x, w) for w in (p.q_proj, p.k_proj, p.v_proj)]
    if decode:
        slots = jnp.arange(b)
        conv_w = jnp.stack([w[:, 0, :] for w in (p.q_conv, p.k_conv, p.v_conv)])
        o, conv, s = dispatch("kda_decode", impl, kda_decode, jnp.stack(projs, 1)[:, :, 0], conv_w, conv, s, slots,
                              z[:, 0], beta[:, 0], gate[:, 0], p.o_norm, eps=cfg.rms_norm_eps, lengths=lengths,
                              qk_norm=True, **gate_args)
        return linear(o.reshape(b, 1, h * dk), p.o_proj), s, conv
    qkv, tails = [], []
    for j, (y, w) in enumerate(zip(projs, (p.q_conv, p.k_conv, p.v_conv))):
        y, tail = short_conv(y, w, conv[:, j], lengths)
        qkv.append(heads(y))
        tails.append(tail)
    o, s = dispatch("kda_prefill", impl, kda_prefill, *qkv, z, beta, s, lengths=lengths, qk_norm=True, **gate_args)
    o = rms_norm(o, p.o_norm, cfg.rms_norm_eps)  # per head, shared weight, in the accumulation dtype
    o = (o * jax.nn.sigmoid(gate)).astype(act).reshape(b, t, h * dk)
    return linear(o, p.o_proj), s, jnp.stack(tails, axis=1)


def mla_layer(x, p, cache, start, lengths, cfg: ModelConfig, decode: bool):
    """Gated MLA (SPEC section 6). cache [B, S, R+P]; start [B] = tokens already cached; lengths [B].
    Returns (out [B, T, D], new cache)."""
    mc = cfg.mla
    b, t, _ = x.shape
    act, acc = x.dtype, acc_dtype(x.dtype)
    q_nope, q_pe, entry = mla_project(x, p.q_a, p.q_a_norm, p.q_b, p.kv_a, p.kv_a_norm, mc)
    cache = write_cache(cache, entry, start, lengths)
    if decode:
        o = mla_attend_absorbed(q_nope[:, 0], q_pe[:, 0], cache, p.kv_b, start, mc)[:, None]
    else:
        o = mla_attend(q_nope, q_pe, cache, p.kv_b, start[:, None] + jnp.arange(t)[None, :], mc)
    o = o.reshape(b, t, mc.num_heads * mc.v_head_dim).astype(acc) * jax.nn.sigmoid(linear(x, p.g_proj, acc))
    return linear(o.astype(act), p.o_proj), cache
