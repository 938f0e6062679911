"""`ShardingPlan`: a mesh plus the rules table; every sharding of the model comes from it.

    plan = ShardingPlan.create({"expert": 4, "tensor": 2})     # or ShardingPlan.preset("ep_tp")
    cfg, params = load_checkpoint(path, shardings=plan)       # or shardings=plan.params(spec)
    cfg = cfg.with_runtime(sharding=plan)     # the model constrains its activations, runs the experts
    state = init_state(cfg, batch, max_len)   # expert-parallel, and makes its state in shards
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimik3_jax.params import Leaf, named_leaves
from kimik3_jax.sharding.mesh import make_mesh, preset_sizes
from kimik3_jax.sharding.rules import MESH_AXES, RULES, ShardingError, check_rules, partition_spec


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


@dataclass(frozen=True)
class ShardingPlan:
    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...] = tuple(RULES.items())

    def __post_init__(self):
        if tuple(self.mesh.axis_names) != MESH_AXES:
            raise ShardingError(f"the mesh axes must be {MESH_AXES}, got {tuple(self.mesh.axis_names)}")
        check_rules(self.table)

    @classmethod
    def create(cls, sizes: Mapping[str, int], devices=None, rules: Mapping[str, tuple[str, ...]] = RULES):
        return cls(make_mesh(dict(sizes), devices), tuple(rules.items()))

    @classmethod
    def preset(cls, name: str, devices=None, rules: Mapping[str, tuple[str, ...]] = RULES):
        devices = list(jax.devices() if devices is None else devices)
        return cls.create(preset_sizes(name, len(devices)), devices, rules)

    @property
    def table(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def describe(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.sizes.items())

    def mesh_axes(self, logical: str) -> tuple[str, ...]:
        """The mesh axes (size > 1) that split `logical`."""
        return tuple(a for a in self.table.get(logical, ()) if self.sizes[a] > 1)

    def ways(self, logical: str) -> int:
        return math.prod(self.sizes[a] for a in self.mesh_axes(logical))

    # specs and shardings ---------------------------------------------------------------------------
    def spec(self, axes: tuple[str | None, ...], shape: tuple[int, ...], what: str) -> PartitionSpec:
        return partition_spec(tuple(axes), tuple(shape), self.sizes, what, self.table)

    def sharding(self, axes, shape, what: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape, what))

    def params(self, spec) -> Any:
        """A tree of NamedSharding for a described parameter tree (of `Leaf`); raises ShardingError naming
        the first tensor that cannot be split as the table says, before anything loads."""
        shardings = [self.sharding(leaf.full_axes, leaf.full_shape, f"{path} ({leaf.name})")
                     for path, leaf in named_leaves(spec)]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(spec, is_leaf=_is_leaf), shardings)

    def state_specs(self, shapes) -> Any:
        """PartitionSpecs of a DecodeState of arrays or ShapeDtypeStructs."""
        from kimik3_jax.model.state import STATE_AXES

        paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
        axes = jax.tree_util.tree_leaves(STATE_AXES, is_leaf=_is_axes)
        specs = [self.spec(ax, a.shape, "decode state " + jax.tree_util.keystr(p, simple=True, separator="."))
                 for (p, a), ax in zip(paths, axes)]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), specs)

    def state(self, shapes) -> Any:
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), self.state_specs(shapes),
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))

    def constrain(self, x: jax.Array, axes: tuple[str | None, ...], what: str = "activation") -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape, what))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def constrain(x: jax.Array, cfg, axes: tuple[str | None, ...], what: str = "activation") -> jax.Array:
    """`x` constrained to its logical axes under the config's sharding plan (unchanged without one)."""
    plan = cfg.runtime.sharding
    return x if plan is None else plan.constrain(x, axes, what)



def shard_map(f, mesh, in_specs, out_specs):
    """`jax.shard_map` without the replication check (its keyword differs across jax versions)."""
    sm = jax.shard_map
    check = "check_vma" if "check_vma" in inspect.signature(sm).parameters else "check_rep"
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{check: False})


def local_call(cfg, fn, args: tuple, in_axes: tuple, out_axes, what: str):
    """`fn(*args)` on each device's shard under the config's plan (shard_map with the specs of the
    arguments' and results' logical axes), so a kernel sees, and XLA keeps, only the local heads and
    sequences; a plain call without a plan or when the plan splits none of these axes. `fn` must be
    correct on any shard of its arguments (per-head, per-sequence work)."""
    plan = cfg.runtime.sharding
    if plan is None:
        return fn(*args)
    outs = jax.eval_shape(fn, *args)
    spec = lambda ax, a, i: plan.spec(ax, a.shape, f"{what} {i}")  # noqa: E731
    in_specs = tuple(spec(ax, a, f"argument {i}") for i, (ax, a) in enumerate(zip(in_axes, args)))
    out_specs = jax.tree_util.tree_map(lambda ax, a: spec(ax, a, "result"), out_axes, outs,
                                       is_leaf=lambda x: isinstance(x, tuple) and _is_axes(x))
    if all(all(e is None for e in sp) for sp in jax.tree_util.tree_leaves(
            (in_specs, out_specs), is_leaf=lambda x: isinstance(x, PartitionSpec))):
        return fn(*args)
    return shard_map(fn, plan.mesh, in_specs, out_specs)(*args)
