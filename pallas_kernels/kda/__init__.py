"""Pallas KDA kernels: chunked prefill (`kda_prefill`) and the fused decode step (`kda_decode`),
registered as implementations of the ops of the same names in `kimik3_jax.ops.kda`."""

from pallas_kernels.kda import decode, prefill  # noqa: F401  (registers on import)
