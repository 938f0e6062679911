"""Load a converted directory into the parameter tree, straight into the shardings asked for.

Any target sharding works, whatever the conversion saved (it saved plain host arrays): each part is
restored by Orbax with a sharding derived from the target one, so every device reads only the zarr
chunks of its own block, and the layer slices are written into their stacked arrays on the devices:

* whole leaves (`globals`, `vision`): restored with the target sharding itself;
* a layer slice of a stacked leaf: restored with the target sharding minus the layer axis, then
  placed at its layer by a jitted, donated `dynamic_update_slice` (no second copy of the stack).
  If the target shards the layer axis too, the slice is restored replicated over that mesh axis
  (correct, but those devices also read the layers they do not keep);
* `A_log`: stored as its `num_heads` real entries, restored replicated (a few hundred bytes) and
  written into a zero-filled `[layers, head_dim]` array, which equals the release tensor bit for bit.

Peak device memory is the loaded tree plus one part (about 1 GiB, or one bigger piece); host memory is what Orbax stages per array.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from convert.manifest import open_converted
from convert.orbax_io import restore_sharded
from convert.plan import UNITS_DIR, Piece, output_spec
from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import CheckpointError
from kimik3_jax.params import Leaf, Params, leaf_shardings, named_leaves


def load_orbax(directory: str | Path, *, text_only: bool = True, shardings: Any = None) -> tuple[ModelConfig, Params]:
    """(config, parameters) of a converted directory. `shardings`: None (the first device), one
    Sharding for every leaf, or a tree of Shardings matching the returned tree."""
    directory = Path(directory)
    cfg, manifest, units = open_converted(directory)
    if manifest["text_only"] and not text_only and cfg.vision is not None:
        raise CheckpointError(f"{directory}: converted with --text-only, it holds no vision tensors "
                              "(load it with text_only=True)")
    spec = output_spec(cfg, text_only, manifest["experts"])
    targets = _targets(spec, shardings, directory)
    if text_only:
        units = tuple(u for u in units if u.name != "vision")
    out: dict[str, jax.Array] = {}
    for unit, part, pieces in ((u, part, pieces) for u in units for part, pieces in u.parts):
        restore = {p.key: _slice_sharding(targets[p.key], p) for p in pieces}
        arrays = restore_sharded(directory / UNITS_DIR / unit.name / part, list(pieces), restore)
        for p in pieces:
            if p.stack is None:
                out[p.key] = arrays[p.key]
                continue
            if p.key not in out:
                out[p.key] = _zeros(p.leaf.full_shape, p.leaf.dtype, targets[p.key])()
            out[p.key] = _placer(targets[p.key])(out[p.key], arrays[p.key], p.stack)
        del arrays
    _, treedef = jax.tree_util.tree_flatten(spec, is_leaf=lambda x: isinstance(x, Leaf))
    return cfg, jax.tree_util.tree_unflatten(treedef, [out[key] for key, _ in named_leaves(spec)])


def _targets(spec: Params, shardings: Any, directory: Path) -> dict[str, Sharding]:
    try:
        targets = dict(named_leaves(leaf_shardings(spec, shardings)))
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    for key, s in targets.items():
        if not isinstance(s, (NamedSharding, SingleDeviceSharding)):
            raise CheckpointError(f"shardings for {key}: {type(s).__name__} is not supported "
                                  "(use NamedSharding or SingleDeviceSharding)")
    return targets


def _slice_sharding(target: Sharding, piece: Piece) -> Sharding:
    """The sharding to restore `piece` with, so that each device reads the part of its target block."""
    if piece.stack is None or isinstance(target, SingleDeviceSharding):
        return target
    if piece.how == "alog":  # stored shorter than the loaded leaf: a few bytes, replicated
        return NamedSharding(target.mesh, PartitionSpec())
    spec = tuple(target.spec) + (None,) * (len(piece.leaf.full_shape) - len(target.spec))
    return NamedSharding(target.mesh, PartitionSpec(*spec[1:]), memory_kind=target.memory_kind)


@functools.cache
def _zeros(shape: tuple[int, ...], dtype, sharding: Sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _placer(sharding: Sharding):
    """stack[layer] = piece (a shorter piece fills the start of the row: A_log's padding stays zero)."""
    def place(stack, piece, layer):
        start = (layer,) + (0,) * piece.ndim
        return jax.lax.dynamic_update_slice(stack, piece[None].astype(stack.dtype), start)
    return jax.jit(place, donate_argnums=0, out_shardings=sharding)


def check_sharded_restore(directory: str | Path, plan, *, text_only: bool = True) -> str:
    """Restore a converted directory sharded by `plan` (a ShardingPlan) and check every array landed in
    the sharding the plan gives it; returns a one-line summary, raises CheckpointError otherwise."""
    cfg, params = load_orbax(directory, text_only=text_only, shardings=plan)
    _, manifest, _ = open_converted(Path(directory))
    spec = output_spec(cfg, text_only, manifest["experts"])
    want = plan.params(spec)
    per_device: dict[Any, int] = {}
    leaves = named_leaves(spec)
    for (path, _), array, target in zip(leaves, jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
        if not array.sharding.is_equivalent_to(target, array.ndim):
            raise CheckpointError(f"{directory}: {path} restored as {array.sharding}, expected {target}")
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    most = max(per_device.values()) if per_device else 0
    return (f"restored {directory} over mesh {plan.describe()}: {len(leaves)} arrays in their planned shardings, "
            f"at most {most / 2**30:.3f} GiB on one device")
