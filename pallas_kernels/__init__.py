"""Pallas GPU kernels for K3's hot paths. Each is a drop-in implementation of a pure op in
`kimik3_jax.ops`, registered with `kimik3_jax.ops.impl.register` under that op's name; the model picks
it with `cfg.with_runtime(impl="pallas" | "auto")`. On a non-GPU backend kernels run with
`interpret=True` (how CI tests them)."""

import importlib

KERNEL_MODULES = ("kda", "moe")  # each package here registers its kernels on import

for _name in KERNEL_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
