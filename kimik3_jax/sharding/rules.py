"""The one table from logical axes to mesh axes, and the partition specs derived from it.

Every array of the model names its dimensions with logical axes: the parameters in their `Leaf`
records (`params/tree.py`), the decode state in `model/state.py` (`STATE_AXES`), activations where the
model constrains them. `RULES` maps each logical axis to the mesh axes that split it; nothing else in
the project spells a PartitionSpec. A spec uses only mesh axes of size > 1, so one table serves every
mesh shape, and building a spec fails (naming the array) when a mesh axis would split two dimensions
of one array, or when a dimension does not divide by the devices that split it.
"""

from __future__ import annotations

import math
from typing import Mapping

from jax.sharding import PartitionSpec

from kimik3_jax.errors import K3Error

MESH_AXES = ("data", "expert", "tensor")

# logical axis -> mesh axes that split it (in this order); () replicates.
RULES: dict[str, tuple[str, ...]] = {
    # activations and decode state
    "batch": ("data",),  # sequences: data parallel
    "seq": (),
    "cache_seq": (),  # MLA latent cache positions (the latent is shared by all heads: not split by tensor)
    # routed experts: expert parallel, each expert's hidden width tensor parallel
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    # tensor parallel: heads of both attentions, dense and shared FFN width, vocabulary
    "kda_heads": ("tensor",),
    "mla_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    # replicated
    "layers": (),
    "embed": (),
    "latent": (),
    "vision_layers": (),
    "vision_embed": (),
    "vision_qkv": (),
    "vision_mlp": (),
    "projector": (),
}


class ShardingError(K3Error, ValueError):
    """A rules table, mesh or array that cannot be sharded as asked; the message names the array."""


def check_rules(rules: Mapping[str, tuple[str, ...]], mesh_axes=MESH_AXES) -> None:
    for logical, axes in rules.items():
        unknown = [a for a in axes if a not in mesh_axes]
        if unknown:
            raise ShardingError(f"rule {logical!r} -> {axes}: unknown mesh axis {unknown[0]!r} "
                                f"(mesh axes: {', '.join(mesh_axes)})")
        if len(set(axes)) != len(axes):
            raise ShardingError(f"rule {logical!r} -> {axes} names a mesh axis twice")


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: Mapping[str, int],
                   what: str, rules: Mapping[str, tuple[str, ...]] = RULES) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dimensions have logical `axes` (None: replicated),
    under a mesh of `mesh_shape` {axis: size}. `what` names the array in errors."""
    if len(axes) != len(shape):
        raise ShardingError(f"{what}: {len(axes)} logical axes {axes} for a {len(shape)}-d shape {shape}")
    used: dict[str, str] = {}
    entries = []
    for dim, (logical, size) in enumerate(zip(axes, shape)):
        if logical is None:
            entries.append(None)
            continue
        if logical not in rules:
            raise ShardingError(f"{what}: logical axis {logical!r} has no rule in the sharding table")
        mesh_axes = tuple(a for a in rules[logical] if mesh_shape.get(a, 1) > 1)
        for a in mesh_axes:
            if a in used:
                raise ShardingError(f"{what}: mesh axis {a!r} would split both {used[a]!r} and {logical!r}")
            used[a] = logical
        ways = math.prod(mesh_shape[a] for a in mesh_axes)
        if size % ways:
            split = " x ".join(f"{a}={mesh_shape[a]}" for a in mesh_axes)
            raise ShardingError(f"{what}: dimension {dim} ({logical!r}, size {size}) does not divide by {split}")
        entries.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*entries)
