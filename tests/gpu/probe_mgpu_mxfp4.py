"""GPU probe (written 2026-12-05, not yet run): the warp-specialised Mosaic GPU MXFP4 GEMM
(`pallas_kernels/moe/wgmma_mxfp4.py`) for one expert at K3's widths, the MoE prefill regime.

For each token count and tuning: its output against the float32 product of the dequantised weights
(`kimik3_jax.mxfp4.dequantize_np`) and the bf16-rounded activations (relative max error), and its device time
(`benchmarks/timing.py`) and TFLOP/s beside the same product as a dense bf16 `jnp.dot` (cuBLAS, the ceiling
to compare with) in the same run. Scale bytes 119-121 as in the release, and one case with bytes across
0..200 for the exact two-multiply decode (subnormal products included; above 200 the fp32 reference
itself can overflow).

    python3 tests/gpu/probe_mgpu_mxfp4.py                 # N = 6144 (w1 and w3 of one expert), K = 3584
    MGPU_T=256,1024 MGPU_TUNINGS='[{}, {"tile_t": 256}]' python3 tests/gpu/probe_mgpu_mxfp4.py
"""
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from timing import device_seconds  # noqa: E402

from kimik3_jax.mxfp4 import dequantize_np  # noqa: E402
from pallas_kernels.moe.wgmma_mxfp4 import mxfp4_matmul, token_planes, transpose_scales, x_planes  # noqa: E402

N, K = int(os.environ.get("MGPU_N", 6144)), int(os.environ.get("MGPU_K", 3584))
TOKENS = [int(t) for t in os.environ.get("MGPU_T", "256,512,1024,4096").split(",")]
# shared memory per stage: (128 x plane_cols) weight bytes + plane_cols / 16 x 128 scale bytes + two activation
# planes of plane_cols x tile_t bf16; the default: 41 KB x 4 stages
TUNINGS = json.loads(os.environ.get(
    "MGPU_TUNINGS", '[{}, {"tile_t": 256, "stages": 2}, {"plane_cols": 128, "stages": 2}, {"plane_cols": 32, "stages": 6}]'))


def case(rng, t, scale_lo, scale_hi):
    packed = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scales = rng.integers(scale_lo, scale_hi + 1, (N, K // 32), dtype=np.uint8)
    x = jnp.asarray(rng.standard_normal((t, K)), jnp.bfloat16)
    return packed, scales, x


def layouts(rng, t):
    """The operand and output layouts (x_tk, plane_rows, transpose_out), each alone and all together, with
    the default tuning and the routed path's, against the same float32 product rearranged as each promises."""
    packed, scales, x = case(rng, t, 119, 121)
    want = dequantize_np(packed, scales, np.float32) @ np.asarray(x, np.float32).T
    for opts in ({"x_tk": True}, {"plane_rows": True}, {"transpose_out": True}, {"row_blocks": 2},
                 {"quick": True}, {"quick": True, "row_blocks": 2}, {"swar": True},
                 {"swar": True, "quick": True, "row_blocks": 2},
                 {"x_tk": True, "plane_rows": True, "transpose_out": True, "delay": 1, "persistent": True,
                  "stages": 3}):
        try:
            planes = token_planes(x) if opts.get("x_tk") else x_planes(x)
            sc = transpose_scales(jnp.asarray(scales), plane_rows=opts.get("plane_rows", False))
            got = np.asarray(jax.jit(lambda *a, o=opts: mxfp4_matmul(*a, **o))(jnp.asarray(packed), sc, planes))
            w = want.reshape(N // 2, 2, t).transpose(1, 0, 2).reshape(N, t) if opts.get("plane_rows") else want
            w = w.T if opts.get("transpose_out") else w
            err = np.abs(got - w).max() / np.abs(w).max() if got.shape == w.shape else float("nan")
            s = device_seconds(jax.jit(lambda *a, o=opts: mxfp4_matmul(*a, **o)), jnp.asarray(packed), sc, planes)
            print(f"  layout {opts}: shape {got.shape}, rel. max error {err:.1e}, {s * 1e3:.3f} ms, "
                  f"{2 * N * K * t / s / 1e12:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            print(f"  layout {opts}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


def main():
    print(jax.__version__, jax.devices()[0].device_kind, f"N = {N}, K = {K}")
    rng = np.random.default_rng(0)
    layouts(rng, TOKENS[-1])
    packed, scales, x = case(rng, TOKENS[0], 0, 128)  # the quick decode over its whole range, subnormals included
    want = dequantize_np(packed, scales, np.float32) @ np.asarray(x, np.float32).T
    for opts in ({"quick": True}, {"quick": True, "swar": True}, {"swar": True}):
        got = np.asarray(jax.jit(lambda *a, o=opts: mxfp4_matmul(*a, **o))(
            jnp.asarray(packed), jnp.asarray(np.ascontiguousarray(scales.T)), x_planes(x)))
        print(f"{opts}, scale bytes 0..128, T = {TOKENS[0]}: rel. max error "
              f"{np.abs(got - want).max() / np.abs(want).max():.1e}")
    for t, (lo, hi) in [(TOKENS[0], (0, 200))] + [(t, (119, 121)) for t in TOKENS]:
        packed, scales, x = case(rng, t, lo, hi)
        w = dequantize_np(packed, scales, np.float32)
        want = w @ np.asarray(x, np.float32).T
        args = (jnp.asarray(packed), jnp.asarray(np.ascontiguousarray(scales.T)), x_planes(x))
        w16 = jnp.asarray(w, jnp.bfloat16)
        dense = jax.jit(lambda w16, x: jnp.dot(w16, x.T, preferred_element_type=jnp.float32))
        dense_s = device_seconds(dense, w16, x)
        flops = 2 * N * K * t
        print(f"T = {t}, scale bytes {lo}..{hi}: dense bf16 jnp.dot {dense_s * 1e3:.3f} ms "
              f"({flops / dense_s / 1e12:.0f} TFLOP/s)")
        for tuning in TUNINGS:
            try:
                f = jax.jit(lambda *a, tuning=tuning: mxfp4_matmul(*a, **tuning))
                got = np.asarray(f(*args))
                finite = np.isfinite(want)
                err = np.abs(got - want)[finite].max() / np.abs(want[finite]).max()
                s = device_seconds(f, *args)
                print(f"  {tuning}: {s * 1e3:.3f} ms, {flops / s / 1e12:.0f} TFLOP/s "
                      f"({dense_s / s:.2f}x dense), rel. max error {err:.1e}, "
                      f"non-finite equal: {bool(np.array_equal(np.isfinite(got), finite))}")
            except Exception as e:  # a tuning that does not compile or fit: say so, go on
                print(f"  {tuning}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


if __name__ == "__main__":
    main()
