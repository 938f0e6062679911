"""The router and the latent MoE with packed MXFP4 experts (SPEC section 7), dropless.

Shapes: N tokens (flattened), D hidden, L latent width, F expert width, E experts, k top-k.
Expert weights stay as released: w1/w3 [E, F, L], w2 [E, L, F] (packed: [.., in/2] + [.., in/32] bytes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3_jax.config import ModelConfig
from kimik3_jax.mxfp4 import dequantize
from kimik3_jax.ops.common import HIGHEST, acc_dtype, linear, mlp, rms_norm, situ

ROUTER_EPS = 1e-20  # added to the sum of the chosen scores before renormalising (reference code)


def route(x: jax.Array, w_router: jax.Array, bias: jax.Array, top_k: int, renormalize: bool,
          scaling: float) -> tuple[jax.Array, jax.Array]:
    """Sigmoid router: x [N, D] -> (expert ids [N, k] int32, weights [N, k] in the accumulation dtype).
    The bias only chooses (ties go to the lower expert id); the weights are the unbiased scores."""
    acc = acc_dtype(x.dtype)
    scores = jax.nn.sigmoid(linear(x.astype(acc), w_router.astype(acc)))
    _, idx = jax.lax.top_k(scores + bias.astype(acc), top_k)  # stable: equal values keep index order
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + ROUTER_EPS)
    return idx.astype(jnp.int32), w * scaling


def expert_weights(experts, dtype):
    """(w1, w3, w2) dense in `dtype` from packed MXFP4 experts (exact), or as given if already dense."""
    if hasattr(experts, "w1_packed"):
        return (dequantize(experts.w1_packed, experts.w1_scale, dtype, "w1"),
                dequantize(experts.w3_packed, experts.w3_scale, dtype, "w3"),
                dequantize(experts.w2_packed, experts.w2_scale, dtype, "w2"))
    return experts.w1.astype(dtype), experts.w3.astype(dtype), experts.w2.astype(dtype)


def dispatch(idx: jax.Array, num_experts: int):
    """Sort the N*k token/expert pairs by expert. Returns (order [N*k]: pair ids grouped by expert,
    token of each sorted pair [N*k], group sizes [E]). Dropless: every pair is kept, whatever the skew."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tokens = order // idx.shape[-1]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, tokens, sizes


def routed_experts(xl: jax.Array, idx: jax.Array, weights: jax.Array, experts, beta: float,
                   linear_beta: float) -> jax.Array:
    """sum_e w_e SiTU(xl W1_e^T, xl W3_e^T) W2_e^T over each token's chosen experts, in the
    accumulation dtype. xl [N, L] (activation dtype), idx/weights [N, k] -> [N, L]."""
    act, acc = xl.dtype, acc_dtype(xl.dtype)
    w1, w3, w2 = expert_weights(experts, act)
    order, tokens, sizes = dispatch(idx, w1.shape[0])
    xs = xl[tokens]  # [N*k, L]
    rd = lambda lhs, w: jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=acc,  # noqa: E731
                                           precision=HIGHEST)
    h = situ(rd(xs, w1), rd(xs, w3), beta, linear_beta).astype(act)
    y = rd(h, w2)
    # Back to [N, k] pair order with a gather (not a scatter-add, whose atomics sum in a run-dependent
    # order on GPUs): each token's k contributions are combined in its top-k order, deterministically.
    y = y[jnp.argsort(order)].reshape(*idx.shape, -1)
    return jnp.einsum("nk,nkl->nl", weights.astype(acc), y, precision=HIGHEST)


def latent_moe(x: jax.Array, p, cfg: ModelConfig) -> jax.Array:
    """The MoE FFN of one layer: x [..., D] (already normed) -> [..., D]. `p` is one layer's MoEParams."""
    m = cfg.moe
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    idx, w = route(x, p.router, p.router_bias, m.top_k, m.renormalize, m.routed_scaling_factor)
    xl = linear(x, p.latent_down)
    y = routed_experts(xl, idx, w, p.experts, cfg.situ_beta, cfg.situ_linear_beta).astype(x.dtype)
    if m.latent_use_norm:
        y = rms_norm(y, p.latent_norm, cfg.rms_norm_eps)
    y = linear(y, p.latent_up)
    s = p.shared
    y = y + mlp(x, s.gate, s.up, s.down, cfg.situ_beta, cfg.situ_linear_beta)
    return y.reshape(shape)

