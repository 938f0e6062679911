"""Expert parallelism for the routed experts: dropless, by gather / local compute / reduce.

Under a plan whose `experts` axis is split over E devices (and each expert's hidden width over T), every
device holds E_total / E whole experts (each a 1/T slice of its width). Tokens are not moved: each
device sees all tokens of its data shard, keeps the token/expert pairs whose expert it owns (the
others get an out-of-range expert id and weight 0, which the routed-expert op skips), computes them,
and a `psum` over the expert and tensor axes adds the partial outputs. Nothing is dropped whatever the
skew: a device can hold every pair (all tokens on its experts) in the same fixed shapes, and no
capacity is involved. The sum over devices runs in the accumulation dtype.

Why not `ragged_all_to_all`: XLA:CPU (the CI backend) does not run it, and a fixed-capacity all_to_all
sized for the worst case moves E times the tokens; with tokens already replicated over the expert axis
(attention is data-parallel over `data` only), the reduce is the one collective needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kimik3_jax.params import DenseExpertParams, map_leaves
from kimik3_jax.params.tree import describe_text, dense_experts
from kimik3_jax.sharding.plan import shard_map


def expert_specs(plan, cfg, experts):
    """PartitionSpecs of one layer's experts (the layer axis indexed away), packed or dense."""
    spec = describe_text(cfg).moe.experts
    if isinstance(experts, DenseExpertParams):
        spec = dense_experts(spec)
    return map_leaves(lambda leaf: plan.spec(leaf.full_axes[1:], leaf.full_shape[1:], leaf.name), spec)


def expert_parallel(cfg, routed, xl, idx, weights, experts):
    """`routed(xl, idx, weights, experts) -> [N, L]` (the routed-expert op, dropless, skipping pairs
    whose id is out of range), run expert- and tensor-parallel under `cfg.runtime.sharding`.
    xl [N, L], idx / weights [N, k]; N is split over the batch axes, replicated over the others."""
    plan = cfg.runtime.sharding
    e_axes = plan.mesh_axes("experts") if plan is not None else ()
    f_axes = plan.mesh_axes("expert_mlp") if plan is not None else ()
    if not e_axes and not f_axes:
        return routed(xl, idx, weights, experts)
    rows = PartitionSpec(plan.mesh_axes("batch") or None)

    def local(xl, idx, weights, experts):
        n_local = jax.tree_util.tree_leaves(experts)[0].shape[0]
        first = jax.lax.axis_index(e_axes[0] if len(e_axes) == 1 else e_axes) * n_local if e_axes else 0
        mine = (idx >= first) & (idx < first + n_local)
        y = routed(xl, jnp.where(mine, idx - first, n_local), jnp.where(mine, weights, 0), experts)
        return jax.lax.psum(y, e_axes + f_axes)

    fn = shard_map(local, plan.mesh, (rows, rows, rows, expert_specs(plan, cfg, experts)), rows)
    return fn(xl, idx, weights, experts)
