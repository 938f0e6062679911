"""Parameters: one `Leaf` description per array, and what is derived from it.

    spec = describe(cfg)              # tree of Leaf records (no arrays)
    abstract(cfg)                     # tree of ShapeDtypeStruct, nothing allocated
    init_params(cfg, seed)            # random tree, tensor for tensor equal to `make-checkpoint --seed`
    param_count(cfg)                  # logical parameters, as the release counts them
    named_leaves(spec)                # [(path, Leaf)], e.g. ("text.kda.q_proj", Leaf)
"""

from __future__ import annotations

from typing import Any

import jax

from kimik3_jax.config import ModelConfig
from kimik3_jax.params.leaf import Init, Leaf
from kimik3_jax.params.random import draw_leaf_host, draw_leaf_traced, draw_tensor
from kimik3_jax.params.tree import (
    DenseExpertParams, ExpertParams, KDAParams, LayerNorms, MLAParams, MLPParams, MoEParams, Params, TextParams,
    VisionBlocks, VisionParams, dense_experts, describe,
)

__all__ = [
    "Init", "Leaf", "Params", "TextParams", "VisionParams", "VisionBlocks", "LayerNorms", "KDAParams",
    "MLAParams", "MLPParams", "MoEParams", "ExpertParams", "DenseExpertParams", "dense_experts", "describe", "abstract", "init_params",
    "param_count", "cast_params", "named_leaves", "leaf_shardings", "map_leaves", "draw_tensor", "init_params_traced",
]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, Leaf)


def map_leaves(fn, spec: Params) -> Any:
    """`fn(leaf)` at every leaf of a described tree, keeping the tree's structure."""
    return jax.tree_util.tree_map(fn, spec, is_leaf=_is_leaf)


def named_leaves(spec: Any) -> list[tuple[str, Leaf]]:
    """Every leaf with its dotted path in the tree, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_leaf)
    return [(jax.tree_util.keystr(path, simple=True, separator="."), leaf) for path, leaf in flat]


def leaf_shardings(spec: Params, shardings: Any = None) -> Any:
    """A tree of `jax.sharding.Sharding` matching `spec`, from: None (the first device), one sharding for
    every leaf, a `kimik3_jax.sharding.ShardingPlan` (its rules), or such a tree as given. A tree of
    another structure raises ValueError."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        one = shardings or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return map_leaves(lambda _: one, spec)
    from kimik3_jax.sharding.plan import ShardingPlan  # lazily: sharding builds on params

    if isinstance(shardings, ShardingPlan):
        return shardings.params(spec)
    try:
        return jax.tree_util.tree_map(lambda _, s: s, spec, shardings, is_leaf=_is_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the shardings tree does not match the parameter tree ({e})") from None


def abstract(cfg: ModelConfig, text_only: bool = False) -> Params:
    """ShapeDtypeStructs of every parameter; allocates nothing (works for the full 2.8 T model)."""
    return map_leaves(Leaf.abstract, describe(cfg, text_only))


def init_params(cfg: ModelConfig, seed: int = 0, text_only: bool = False) -> Params:
    """Random parameters, drawn on the host and put on the default device. Every release tensor has
    its own stream keyed by (seed, name, layer, expert), so the values equal, bit for bit, what
    `kimik3 make-checkpoint --seed` writes."""
    return map_leaves(lambda leaf: jax.device_put(draw_leaf_host(leaf, seed)), describe(cfg, text_only))


def init_params_traced(cfg: ModelConfig, seed: int = 0, text_only: bool = False) -> Params:
    """The same values computed with jax.numpy, for models too big for the host: call it under
    `jax.jit(..., static_argnums=(0, 1, 2), out_shardings=...)` to initialise straight into device memory."""
    return map_leaves(lambda leaf: draw_leaf_traced(leaf, seed), describe(cfg, text_only))


def cast_params(params, dtype):
    """Every floating leaf in `dtype` (float32/float64 run every op of the model in that dtype); packed
    expert bytes stay uint8 and decode exactly into the compute dtype. bfloat16 keeps the released dtypes
    (the production policy: bf16 weights, the seven fp32 kinds stay fp32)."""
    import jax.numpy as jnp

    if jnp.dtype(dtype) == jnp.bfloat16:
        return params
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


def param_count(cfg: ModelConfig, *, experts: bool | None = None, vision: bool = False) -> int:
    """Logical parameters of the text model (routed experts unpacked, scales not counted).
    `experts=True` counts only the routed experts, `False` all but them; `vision=True` counts the vision tower."""
    spec = describe(cfg)
    tree = spec.vision if vision else spec.text
    if tree is None:
        return 0
    total = 0
    for _, leaf in named_leaves(tree):
        if experts is None or experts == (leaf.mx is not None):
            total += leaf.num_params
    return total
