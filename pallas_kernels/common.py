"""What the KDA and MoE kernels share: the interpret-mode choice."""

from __future__ import annotations

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """None: interpret (run the kernel body as plain JAX) unless the default backend is a GPU."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)
