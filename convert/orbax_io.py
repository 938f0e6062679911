"""Orbax in one place: how a unit is saved, restored and inspected.

Units are written by Orbax's PyTree handler without OCDBT and without compression: each array is a
zarr array of raw chunks of at most CHUNK_BYTES (experts chunked along the expert axis first), so
restoring into a mesh reads only the chunks a device owns, nothing is copied on save (OCDBT would
stage a second copy of the unit in memory, and so would Orbax's default deep copy of host arrays,
turned off here), and no CPU time goes into compressing weights that do not compress (MXFP4 nibbles
are close to random). The save is synchronous: when `save_unit`
returns, Orbax has written, fsynced and atomically renamed the unit directory.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from convert.plan import Piece, flat_items, piece_tree
from kimik3_jax.errors import CheckpointError

CHUNK_BYTES = 64 << 20
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax writes a checkpoint under this name, then renames it

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every save and restore at INFO/WARNING


@functools.lru_cache(maxsize=1)
def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False))


@functools.lru_cache(maxsize=1)
def _saver() -> ocp.Checkpointer:
    """Saves host arrays without Orbax's defensive deep copy (the default doubles a unit in memory;
    the arrays are ours and untouched until the synchronous save returns)."""
    try:
        numpy = ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:  # Orbax 0.12.4 (the GPU image's) has no such option; the memory bound is measured on 0.12.8
        numpy = ocp.type_handlers.NumpyHandler()
    registry = ocp.type_handlers.create_type_handler_registry((np.ndarray, numpy))
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False,
                                                        type_handler_registry=registry))


def save_unit(path: Path, pieces: list[Piece], arrays: dict[str, np.ndarray]) -> None:
    """Write pieces (host arrays keyed by piece key) as one Orbax checkpoint at `path`."""
    tree = piece_tree(pieces, lambda p: arrays[p.key])
    args = piece_tree(pieces, lambda p: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES,
                                                     shard_axes=(0,) if len(p.lead) else ()))
    _saver().save(epath.Path(path), args=ocp.args.PyTreeSave(tree, save_args=args))


def restore_numpy(path: Path, pieces: list[Piece]) -> dict[str, np.ndarray]:
    """The arrays of `pieces` (all or some of a unit) as host NumPy arrays, keyed by piece key."""
    item = piece_tree(pieces, lambda p: 0)
    args = piece_tree(pieces, lambda p: ocp.RestoreArgs(restore_type=np.ndarray))
    return _restore(path, item, args)


def restore_sharded(path: Path, pieces: list[Piece], shardings: dict) -> dict[str, jax.Array]:
    """The arrays of `pieces` as jax Arrays laid out by `shardings[key]`: each device reads its chunks."""
    item = piece_tree(pieces, lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=shardings[p.key]))
    args = piece_tree(pieces, lambda p: ocp.ArrayRestoreArgs(sharding=shardings[p.key], global_shape=p.shape))
    return _restore(path, item, args)


def _restore(path: Path, item: dict, args: dict) -> dict:
    if not (path / "_METADATA").is_file():
        raise CheckpointError(f"{path}: not a complete Orbax unit (no _METADATA)")
    try:
        tree = _checkpointer().restore(epath.Path(path), args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  tensorstore / Orbax errors: missing or corrupt chunks, wrong shapes
        raise CheckpointError(f"{path}: cannot restore {sorted(flat_items(item))[:3]}... "
                              f"({type(e).__name__}: {e})") from None
    return flat_items(tree)


def unit_arrays(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{key: (shape, dtype)} of a saved checkpoint, from its metadata (no data read)."""
    meta = _checkpointer().metadata(epath.Path(path))
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in flat_items(dict(tree)).items()}
