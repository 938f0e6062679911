"""The router and the latent MoE with packed MXFP4 experts (SPEC section 7), dropless.

Shapes: N tokens (flattened), D hidden, L latent width, F expert width, E experts, k top-k.
Expert weights stay as released: w1/w3 [E, F, L], w2 [E, L, F] (packed: [.., in/2] + [.., in/32] bytes).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from kimik3_jax.config import ModelConfig
from kimik3_jax.mxfp4 import dequantize
from kimik3_jax.ops import impl
from kimik3_jax.ops.common import HIGHEST, acc_dtype, linear, mlp, rms_norm, situ
from kimik3_jax.sharding.experts import expert_parallel

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


def _select(experts, ids):
    """The experts `ids` [P] of a layer (packed or dense), one per token/expert pair."""
    return jax.tree_util.tree_map(lambda a: a[ids], experts)


def routed_experts(xl: jax.Array, idx: jax.Array, weights: jax.Array, experts, beta: float,
                   linear_beta: float, strategy: str = "auto", *, scale_max: int | None = None) -> jax.Array:
    """sum_e w_e SiTU(xl W1_e^T, xl W3_e^T) W2_e^T over each token's chosen experts, in the
    accumulation dtype. xl [N, L] (activation dtype), idx/weights [N, k] -> [N, L]. Dropless either way:

    - "sorted": pairs sorted by expert, every expert decoded once, `lax.ragged_dot` per group;
    - "gathered": each pair gathers and decodes its own expert (weight streaming: only the chosen
      experts are read, which is what a few decode tokens want);
    - "auto": "gathered" when there are fewer pairs than experts, else "sorted".
    Each token's k contributions are combined in its top-k order (a gather, never a scatter-add, whose
    GPU atomics would sum in a run-dependent order). A pair whose id is outside [0, E) contributes
    nothing when its weight is 0: expert parallelism hands over the pairs owned elsewhere that way.
    `scale_max` (`Runtime.expert_scale_max`) is for the kernels' choice of decode; the result does not
    depend on it, and this function ignores it."""
    del scale_max
    act, acc = xl.dtype, acc_dtype(xl.dtype)
    n, k = idx.shape
    num_experts = jax.tree_util.tree_leaves(experts)[0].shape[0]  # packed or dense: [E, ...] either way
    if strategy == "auto":
        strategy = "gathered" if n * k < num_experts else "sorted"
    if strategy == "gathered":
        w1, w3, w2 = expert_weights(_select(experts, idx.reshape(-1)), act)  # [P, F, L], [P, L, F]
        xs = jnp.repeat(xl, k, axis=0)
        mm = lambda a, w: jnp.einsum("pi,poi->po", a, w, preferred_element_type=acc, precision=HIGHEST)  # noqa: E731
        h = situ(mm(xs, w1), mm(xs, w3), beta, linear_beta).astype(act)
        y = mm(h, w2)
    elif strategy == "sorted":
        w1, w3, w2 = expert_weights(experts, act)
        order, tokens, sizes = dispatch(idx, num_experts)
        xs = xl[tokens]  # [N*k, L]
        rd = lambda a, w: jax.lax.ragged_dot(a, jnp.swapaxes(w, 1, 2), sizes,  # noqa: E731
                                             preferred_element_type=acc, precision=HIGHEST)
        h = situ(rd(xs, w1), rd(xs, w3), beta, linear_beta).astype(act)
        y = rd(h, w2)[jnp.argsort(order)]  # back to [N*k] pair order
    else:
        raise ValueError(f"strategy must be 'auto', 'sorted' or 'gathered', got {strategy!r}")
    return jnp.einsum("nk,nkl->nl", weights.astype(acc), y.reshape(n, k, -1), precision=HIGHEST)


def latent_moe(x: jax.Array, p, cfg: ModelConfig) -> jax.Array:
    """The MoE FFN of one layer: x [..., D] (already normed) -> [..., D]. `p` is one layer's MoEParams."""
    m = cfg.moe
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    idx, w = route(x, p.router, p.router_bias, m.top_k, m.renormalize, m.routed_scaling_factor)
    xl = linear(x, p.latent_down)
    routed = partial(impl.dispatch, "routed_experts", cfg.runtime.impl, routed_experts, beta=cfg.situ_beta,
                     linear_beta=cfg.situ_linear_beta, scale_max=cfg.runtime.expert_scale_max)
    y = expert_parallel(cfg, routed, xl, idx, w, p.experts).astype(x.dtype)
    if m.latent_use_norm:
        y = rms_norm(y, p.latent_norm, cfg.rms_norm_eps)
    y = linear(y, p.latent_up)
    s = p.shared
    y = y + mlp(x, s.gate, s.up, s.down, cfg.situ_beta, cfg.situ_linear_beta)
    return y.reshape(shape)

