"""Pure array functions of K3 (SPEC sections 4-8). Each takes and returns arrays; the model composes
them and the Pallas kernels are drop-in implementations of the same signatures.

Precision: `acc_dtype(x.dtype)` is the dtype of every "fp32" internal of SPEC section 8 (float32, or
float64 when the model runs in float64), so one code path serves the bf16 policy and the exact modes.
"""
