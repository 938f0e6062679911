"""GPU probe (twenty-fourth session): the XLA glue of the Mosaic GPU MoE prefill alone, in variants, at K3's
widths and 16384 tokens (tiles of `routed_mgpu.tile_slots`): the slots' activation planes (a row gather of the
token planes, fused or after the planes are made) and the per-call scale transposition, beside a plain copy of
the same bytes (the bandwidth bound of the same run).

    python3 tests/gpu/probe_moe_glue.py        # MGPU_TOKENS=4096,16384 for other counts
"""
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe import _random_experts, routing  # noqa: E402
from timing import device_seconds  # noqa: E402

from pallas_kernels.moe import dispatch as dsp  # noqa: E402
from pallas_kernels.moe import routed_mgpu as rm  # noqa: E402
from pallas_kernels.moe.gather import slot_planes  # noqa: E402
from pallas_kernels.moe.wgmma_mxfp4 import token_planes, transpose_scales  # noqa: E402

TOKENS = [int(t) for t in os.environ.get("MGPU_TOKENS", "16384").split(",")]


def main():
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    ex = _random_experts(jax.random.key(0), 896)
    for n in TOKENS:
        xl, idx, w = routing(n, n)
        tile_t = rm.tile_slots(idx.size, 896)
        lo = jax.jit(lambda i, w: dsp.block_layout(i, w, 896, tile_t))(idx, w)
        used = int(np.sum(np.asarray(lo.tile_expert) < 896)) * tile_t
        st = lo.slot_token
        slots = st.shape[0]
        tp = jax.jit(token_planes)(xl)
        out_bytes = 2 * slots * xl.shape[1]
        variants = {
            "fused (now)": (jax.jit(lambda x, s: token_planes(x)[:, s]), xl, st),
            "planes then gather": (jax.jit(lambda x, s: token_planes(jax.lax.optimization_barrier(x))[:, s]), xl, st),
            "gather of made planes": (jax.jit(lambda p, s: p[:, s]), tp, st),
            "take clip sorted-free": (jax.jit(lambda p, s: jnp.take(p, s, axis=1, mode="clip")), tp, st),
            "rows then planes": (jax.jit(lambda x, s: token_planes(x[s])), xl, st),
            "kernel, used tiles": (jax.jit(lambda x, te, s: slot_planes(token_planes(x), te, s, tile_t, 896)),
                                   xl, lo.tile_expert, st),
            "kernel of made planes": (jax.jit(lambda p, te, s: slot_planes(p, te, s, tile_t, 896)), tp, lo.tile_expert, st),
            "copy of the output bytes": (jax.jit(lambda a: a + 1), jnp.zeros((2, slots, xl.shape[1] // 2), jnp.bfloat16)),
            "token planes alone": (jax.jit(token_planes), xl),
        }
        want = np.asarray(variants["fused (now)"][0](xl, st))
        print(f"tokens {n}: tile {tile_t}, slots {slots} ({used} in used tiles), planes {out_bytes / 1e9:.2f} GB",
              flush=True)
        for name, (f, *a) in variants.items():
            if "copy" not in name and "alone" not in name:
                got = np.asarray(f(*a))
                rows = np.repeat(np.asarray(lo.tile_expert) < 896, tile_t) if "kernel" in name else slice(None)
                assert np.array_equal(got[:, rows], want[:, rows]), name
            s = device_seconds(f, *a, calls=3)
            print(f"  {name}: {s * 1e3:.3f} ms ({out_bytes / s / 1e12:.2f} TB/s written)", flush=True)
        sc = ex.w1_scale
        for name, f in {"scales w1 plane_rows": lambda s: transpose_scales(s, plane_rows=True),
                        "scales w1": transpose_scales, "copy w1 scales": lambda s: s + 1}.items():
            s = device_seconds(jax.jit(f), sc, calls=3)
            print(f"  {name}: {s * 1e3:.3f} ms ({2 * sc.size / s / 1e12:.2f} TB/s read+write)", flush=True)


if __name__ == "__main__":
    main()
