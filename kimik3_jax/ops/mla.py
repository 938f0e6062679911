"""Gated MLA without positions (SPEC section 6): projections, prefill attention over the latent cache,
and the absorbed decode form.

Shapes: B batch, T queries, S cache slots, H heads, N = qk_nope, P = qk_rope ("pe", never rotated),
R = kv_lora_rank, Dv = v_head_dim. The cache holds per token the normed latent c[R] then k_pe[P].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3_jax.config import MLAConfig
from kimik3_jax.ops.common import HIGHEST, acc_dtype, linear, rms_norm


def mla_project(x: jax.Array, q_a, q_a_norm, q_b, kv_a, kv_a_norm, cfg: MLAConfig):
    """x [B, T, D] -> q_nope [B, T, H, N], q_pe [B, T, H, P], cache entries [B, T, R+P]."""
    cq = rms_norm(linear(x, q_a), q_a_norm, cfg.lora_norm_eps)
    q = linear(cq, q_b).reshape(*x.shape[:-1], cfg.num_heads, cfg.qk_head_dim)
    ckv = linear(x, kv_a)
    c = rms_norm(ckv[..., :cfg.kv_lora_rank], kv_a_norm, cfg.lora_norm_eps)
    entry = jnp.concatenate([c, ckv[..., cfg.kv_lora_rank:]], axis=-1)  # k_pe is not normed
    return q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:], entry


def _masked_softmax(scores: jax.Array, visible: jax.Array) -> jax.Array:
    scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
    return jax.nn.softmax(scores, axis=-1)


def mla_attend(q_nope, q_pe, cache: jax.Array, kv_b: jax.Array, q_pos: jax.Array, cfg: MLAConfig) -> jax.Array:
    """Prefill form: the cache's latents are expanded to per-head keys and values.

    q_nope [B, T, H, N], q_pe [B, T, H, P], cache [B, S, R+P], kv_b [H*(N+Dv), R], q_pos [B, T] (the
    absolute position of each query; it sees cache slots <= its position). Returns [B, T, H, Dv]."""
    act, acc = cache.dtype, acc_dtype(cache.dtype)
    n, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    c, k_pe = cache[..., :r], cache[..., r:]
    kv = linear(c, kv_b).reshape(*c.shape[:-1], cfg.num_heads, n + cfg.v_head_dim)
    k_nope, v = kv[..., :n], kv[..., n:]
    scores = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=acc, precision=HIGHEST)
              + jnp.einsum("bthp,bsp->bhts", q_pe, k_pe, preferred_element_type=acc, precision=HIGHEST))
    visible = jnp.arange(cache.shape[1])[None, None, None, :] <= q_pos[:, None, :, None]
    p = _masked_softmax(scores * cfg.qk_head_dim ** -0.5, visible)
    o = jnp.einsum("bhts,bshv->bthv", p.astype(act), v, preferred_element_type=acc, precision=HIGHEST)
    return o.astype(act)


def mla_attend_absorbed(q_nope, q_pe, cache: jax.Array, kv_b: jax.Array, q_pos: jax.Array,
                        cfg: MLAConfig) -> jax.Array:
    """Decode form over the latent cache: q_nope is absorbed through W_UK and the output through W_UV,
    so per-head keys and values are never formed. q_nope [B, H, N], q_pe [B, H, P], q_pos [B].
    Returns [B, H, Dv]. Latent-space products run in the accumulation dtype."""
    act, acc = cache.dtype, acc_dtype(cache.dtype)
    n, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    w = kv_b.reshape(cfg.num_heads, n + cfg.v_head_dim, r).astype(acc)
    w_uk, w_uv = w[:, :n], w[:, n:]
    c, k_pe = cache[..., :r].astype(acc), cache[..., r:].astype(acc)
    q_lat = jnp.einsum("bhn,hnr->bhr", q_nope.astype(acc), w_uk, precision=HIGHEST)
    scores = (jnp.einsum("bhr,bsr->bhs", q_lat, c, precision=HIGHEST)
              + jnp.einsum("bhp,bsp->bhs", q_pe.astype(acc), k_pe, precision=HIGHEST))
    visible = jnp.arange(cache.shape[1])[None, None, :] <= q_pos[:, None, None]
    p = _masked_softmax(scores * cfg.qk_head_dim ** -0.5, visible)
    o_lat = jnp.einsum("bhs,bsr->bhr", p, c, precision=HIGHEST)
    return jnp.einsum("bhr,hvr->bhv", o_lat, w_uv, precision=HIGHEST).astype(act)


def write_cache(cache: jax.Array, entries: jax.Array, start: jax.Array, lengths: jax.Array) -> jax.Array:
    """cache [B, S, E] <- entries [B, T, E] at slots start[b] + t for t < lengths[b]; padding is not
    written (and nothing past S)."""
    b, t = entries.shape[:2]
    slot = start[:, None] + jnp.arange(t)[None, :]
    slot = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], slot, cache.shape[1])  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return cache.at[rows, slot].set(entries.astype(cache.dtype), mode="drop")
