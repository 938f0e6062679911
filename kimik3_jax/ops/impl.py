"""One switch between the pure-JAX ops and their Pallas kernels.

Every hot op has a pure function (the reference, runs anywhere) and may have a kernel registered under
the same name with the same signature. `dispatch(name, impl, reference)` returns what to call:

    impl="xla"     the pure function;
    impl="pallas"  the kernel (an error if none is registered or it refuses the call);
    impl="auto"    the kernel when the default backend is a GPU and the kernel accepts the call,
                   otherwise the pure function.

A kernel refuses a call it does not support (shape, dtype, backend) by raising `Unsupported` from its
`supports(*args, **kwargs)` check, before any work; "auto" then falls back. Kernels live in
`pallas_kernels` and register themselves when that package is imported (lazily, on first dispatch),
so importing the model never imports Pallas.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import jax

from kimik3_jax.config import IMPLS


class Unsupported(ValueError):
    """A kernel cannot run this call; the message says why (shape, dtype, backend...)."""


@dataclass(frozen=True)
class Kernel:
    fn: Callable
    supports: Callable  # (*args, **kwargs) -> None, raises Unsupported


_KERNELS: dict[str, Kernel] = {}
_LOADED = False


def register(name: str, supports: Callable):
    """Decorator: `fn` is the Pallas implementation of the pure op `name`."""
    def wrap(fn):
        _KERNELS[name] = Kernel(fn, supports)
        return fn
    return wrap


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        importlib.import_module("pallas_kernels")


def kernel(name: str) -> Kernel | None:
    _load()
    return _KERNELS.get(name)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def dispatch(name: str, impl: str, reference: Callable, *args, **kwargs):
    """Call op `name` with the implementation `impl` selects (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "xla":
        return reference(*args, **kwargs)
    k = kernel(name)
    if impl == "auto":
        if k is None or not on_gpu():
            return reference(*args, **kwargs)
        try:
            k.supports(*args, **kwargs)
        except Unsupported:
            return reference(*args, **kwargs)
        return k.fn(*args, **kwargs)
    if k is None:
        raise Unsupported(f"no Pallas kernel is registered for {name!r}")
    k.supports(*args, **kwargs)
    return k.fn(*args, **kwargs)
