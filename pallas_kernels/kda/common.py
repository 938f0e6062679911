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


def store_checkpoint(cp_ref, cpo_ref, s, *, n, h, vt, done, every: int, chunk: int, span):
    """After chunk `done` (1-based) of sequence n, store the state tile s at that sequence's checkpoint
    row when `done` is a multiple of `every` chunks inside its `span` tokens (lax.rem / lax.div: jnp's
    `%` and `//` fail the Triton lowering on jax 0.10.2)."""
    full = (jax.lax.rem(done, jnp.int32(every)) == 0) & (done * chunk <= span)
    row = jnp.minimum(cpo_ref[n] + jax.lax.div(done, jnp.int32(every)) - 1, cp_ref.shape[0] - 1)
    plt.store(cp_ref.at[row, h, :, vt], s.astype(cp_ref.dtype), mask=jnp.broadcast_to(full, s.shape))
