"""Sharding: named mesh axes (data, expert, tensor), one rules table from logical axes to mesh axes,
and everything derived from it (parameter, decode-state and activation shardings, expert parallelism,
multi-host start-up, memory planning). See docs/multihost.md."""

from kimik3_jax.sharding.mesh import PRESETS, make_mesh, parse_mesh, preset_sizes
from kimik3_jax.sharding.plan import ShardingPlan, constrain
from kimik3_jax.sharding.rules import MESH_AXES, RULES, ShardingError, partition_spec

__all__ = ["MESH_AXES", "RULES", "PRESETS", "ShardingError", "ShardingPlan", "constrain", "make_mesh",
           "parse_mesh", "partition_spec", "preset_sizes"]
