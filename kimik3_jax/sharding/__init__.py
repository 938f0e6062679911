"""Sharding: named mesh axes (data, expert, tensor), one rules table from logical axes to mesh axes,
and everything derived from it (parameter, decode-state and activation shardings, expert parallelism,
multi-host start-up, memory planning). See docs/multihost.md.

Names load lazily, so the command line can import `sharding.distributed` without importing JAX."""

import importlib

_EXPORTS = {
    "MESH_AXES": "rules", "RULES": "rules", "ShardingError": "rules", "partition_spec": "rules",
    "PRESETS": "mesh", "make_mesh": "mesh", "parse_mesh": "mesh", "preset_sizes": "mesh",
    "ShardingPlan": "plan", "constrain": "plan",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
