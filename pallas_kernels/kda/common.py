"""Helpers shared by the KDA kernels: interpret-mode choice, Triton compiler parameters across jax
versions, and the two transposed matmuls (as dot_generals, which the Triton lowering turns into
tt.trans + tt.dot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt


def resolve_interpret(interpret: bool | None) -> bool:
    """None: interpret (run the kernel body as plain JAX) unless the default backend is a GPU."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def compiler_params(num_warps: int, num_stages: int):
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def cdiv(a, b):
    return (a + b - 1) // b


def dot_nt(a, b):
    """a [M, K] . b [N, K]^T -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a [K, M]^T . b [K, N] -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
