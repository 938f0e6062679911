"""Independent float64 NumPy ground truth for the Kimi K3 text model (see `k3_numpy`).

Nothing in this package imports `kimik3_jax`: it is written from `SPEC.md` alone so that the JAX
model can be checked against it.
"""
