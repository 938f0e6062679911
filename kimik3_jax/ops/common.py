"""Small shared ops: the accumulation dtype, linear layers, RMSNorm, SiTU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype of fp32 internals: float64 when computing in float64, else float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def linear(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """`x W^T` for a release-layout weight `w[out, in]`, accumulated in the accumulation dtype and
    returned in `out_dtype` (default: x's dtype). Full precision, so fp32 paths are not run in TF32."""
    acc = acc_dtype(x.dtype)
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=acc, precision=HIGHEST)
    return y.astype(out_dtype or x.dtype)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """`w * x / sqrt(mean(x^2) + eps)` over the last axis: normalised in the accumulation dtype, cast back
    to x's dtype, then times the weight (the reference order, SPEC section 12)."""
    xf = x.astype(acc_dtype(x.dtype))
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if w is None else y * w.astype(x.dtype)


def situ(g: jax.Array, u: jax.Array, beta: float, linear_beta: float) -> jax.Array:
    """SiTU(g, u) = [beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)], in the
    accumulation dtype of the inputs (SPEC section 7)."""
    acc = acc_dtype(jnp.result_type(g, u))
    g, u = g.astype(acc), u.astype(acc)
    return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))


def mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, beta: float, linear_beta: float) -> jax.Array:
    """The dense SiTU MLP (layer 0 and the fused shared experts): x [..., D] -> [..., D]."""
    acc = acc_dtype(x.dtype)
    h = situ(linear(x, gate, acc), linear(x, up, acc), beta, linear_beta)
    return linear(h.astype(x.dtype), down)
