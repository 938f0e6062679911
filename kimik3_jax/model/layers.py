"""One layer of each kind, composed from the pure ops. x is the normed layer input [B, T, D]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3_jax.config import ModelConfig
from kimik3_jax.ops.common import acc_dtype, linear, rms_norm
from kimik3_jax.ops.impl import dispatch
from kimik3_jax.ops.kda import kda_decode, kda_prefill, short_conv
from kimik3_jax.ops.mla import mla_attend, mla_attend_absorbed, mla_project, write_cache
from kimik3_jax.sharding.plan import local_call

BTHK = ("batch", "seq", "kda_heads", None)  # logical axes of q, k, v, the gate and the output per head
STATE = ("batch", "kda_heads", None, None)  # one layer's KDA state


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
    bound = kc.gate_lower_bound
    projs = [linear(x, w) for w in (p.q_proj, p.k_proj, p.v_proj)]
    # The recurrence runs per device on its own sequences and heads (local_call: shard_map under a plan).
    if decode:
        def step(qkv, conv_w, conv, s, z, beta, gate, o_norm, lengths, a_log):
            slots = jnp.arange(qkv.shape[0])  # this device's rows of the state
            return dispatch("kda_decode", impl, kda_decode, qkv, conv_w, conv, s, slots, z, beta, gate, o_norm,
                            eps=cfg.rms_norm_eps, lengths=lengths, qk_norm=True, a_log=a_log, lower_bound=bound)
        conv_w = jnp.stack([w[:, 0, :] for w in (p.q_conv, p.k_conv, p.v_conv)])
        bhk = ("batch", "kda_heads", None)
        args = (jnp.stack(projs, 1)[:, :, 0], conv_w, conv, s, z[:, 0], beta[:, 0], gate[:, 0], p.o_norm, lengths,
                p.a_log[:h])
        axes = (("batch", None, "kda_heads"), (None, "kda_heads", None), ("batch", None, None, "kda_heads"),
                STATE, bhk, ("batch", "kda_heads"), bhk, (None,), ("batch",), ("kda_heads",))
        o, conv, s = local_call(cfg, step, args, axes, (bhk, axes[2], STATE), "kda_decode")
        return linear(o.reshape(b, 1, h * dk), p.o_proj), s, conv
    qkv, tails = [], []
    for j, (y, w) in enumerate(zip(projs, (p.q_conv, p.k_conv, p.v_conv))):
        y, tail = short_conv(y, w, conv[:, j], lengths)
        qkv.append(heads(y))
        tails.append(tail)

    def scan(q, k, v, z, beta, s, lengths, a_log):
        return dispatch("kda_prefill", impl, kda_prefill, q, k, v, z, beta, s, lengths=lengths, qk_norm=True,
                        a_log=a_log, lower_bound=bound)
    axes = (BTHK,) * 4 + (("batch", "seq", "kda_heads"), STATE, ("batch",), ("kda_heads",))
    o, s = local_call(cfg, scan, (*qkv, z, beta, s, lengths, p.a_log[:h]), axes, (BTHK, STATE), "kda_prefill")
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
