"""Checkpoint conversion: release safetensors <-> Orbax, streaming, validated, resumable (docs/convert.md).

    convert_checkpoint(src, dst, ...)     release directory -> converted directory (`kimik3 convert`)
    export_checkpoint(src, dst, ...)      converted directory -> release layout (`kimik3 export`)
    verify_checkpoint(out, src)           every difference between a converted directory and its source
    load_orbax(dir, text_only, shardings) (config, params) restored into the given shardings
    dry_run(src, dst, ...)                the plan and every problem, from config.json and the shard headers
"""

_API = {
    "convert_checkpoint": "convert.run", "export_checkpoint": "convert.export", "verify_checkpoint": "convert.verify",
    "load_orbax": "convert.restore", "dry_run": "convert.dry_run", "is_orbax_checkpoint": "convert.manifest",
    "plan_units": "convert.plan",
}
__all__ = ["convert_checkpoint", "dry_run", "export_checkpoint", "is_orbax_checkpoint", "load_orbax",
           "plan_units", "verify_checkpoint"]


def __getattr__(name):  # lazy: `import convert` stays cheap (no jax / Orbax import until used)
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")
