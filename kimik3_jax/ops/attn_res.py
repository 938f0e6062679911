"""Block Attention Residuals: the depth mix that replaces the residual stream (SPEC section 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3_jax.ops.common import HIGHEST, acc_dtype


def fold_site(norm_w: jax.Array, proj_w: jax.Array, dtype) -> jax.Array:
    """The one vector a mix site uses: `norm.weight * proj.weight[0]`, in the accumulation dtype."""
    acc = acc_dtype(dtype)
    return norm_w.astype(acc) * proj_w.reshape(-1).astype(acc)


def attn_res_mix(candidates: jax.Array, w: jax.Array, eps: float, count: jax.Array | None = None) -> jax.Array:
    """candidates [n, ..., D] (activation dtype), w [D] (folded site vector) -> [..., D].

    Keys are the candidates RMS-normalised without weight; logits `<K_j, w>` (no temperature);
    softmax over j; the output mixes the RAW candidates. All in the accumulation dtype: the logits sit
    close together, so this path is kept exact. `count` (may be traced): only the first `count`
    candidates take part (the others get weight exactly 0), so a fixed-size buffer can hold them."""
    acc = acc_dtype(candidates.dtype)
    v = candidates.astype(acc)
    keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    logits = jnp.einsum("n...d,d->n...", keys, w.astype(acc), precision=HIGHEST)
    if count is not None:
        live = (jnp.arange(candidates.shape[0]) < count).reshape((-1,) + (1,) * (logits.ndim - 1))
        logits = jnp.where(live, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=0)
    return jnp.einsum("n...,n...d->...d", p, v, precision=HIGHEST).astype(candidates.dtype)
