"""MXFP4 grouped-GEMM kernels for the routed experts (`routed_experts`), registered on import."""

from pallas_kernels.moe import routed  # noqa: F401  (registers "routed_experts")
