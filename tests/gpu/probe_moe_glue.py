"""GPU probe (twenty-fourth session, docs/benchmarks.md): the XLA glue of the Mosaic GPU MoE prefill alone, in
variants, at K3's widths (tiles of `routed_mgpu.tile_slots`), each variant's output checked against the first:
the slots' activation planes (XLA's row gather, fused with the token planes or after them, against the
used-tile kernel `gather.slot_planes`, the path's), beside a copy of the same bytes (the bound of any pass that
writes every slot); the dispatch's parts (the tile search, the inverse permutation) the old way and the path's;
the per-call scale transposition.

    python3 tests/gpu/probe_moe_glue.py        # MGPU_TOKENS=4096,16384 (the default)
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

TOKENS = [int(t) for t in os.environ.get("MGPU_TOKENS", "4096,16384").split(",")]
E = 896


def timed(name, variants, used_rows=None):
    """Time each (fn, *args) of `variants`, checking each output against the first's (on `used_rows` of axis 1
    for the names with "kernel", whose other rows are undefined)."""
    want = None
    for label, (f, *args) in variants.items():
        got = jax.device_get(f(*args))
        if want is None:
            want = got
        elif "copy" not in label:
            seen = (lambda a: np.asarray(a)[:, used_rows]) if "kernel" in label else np.asarray
            assert all(np.array_equal(seen(g), seen(w))
                       for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))), label
        print(f"  {name}: {label}: {device_seconds(f, *args, calls=3) * 1e3:.3f} ms", flush=True)


def main():
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    ex = _random_experts(jax.random.key(0), E)
    for n in TOKENS:
        xl, idx, w = routing(n, n)
        tile_t = rm.tile_slots(idx.size, E)
        lo = jax.jit(lambda i, w: dsp.block_layout(i, w, E, tile_t))(idx, w)
        used = np.repeat(np.asarray(lo.tile_expert) < E, tile_t)
        st, te = lo.slot_token, lo.tile_expert
        print(f"tokens {n}: tile {tile_t}, slots {st.shape[0]} ({used.sum()} in used tiles), planes "
              f"{2 * st.shape[0] * xl.shape[1] / 1e9:.2f} GB", flush=True)
        tp = jax.jit(token_planes)(xl)
        timed("planes", {
            "XLA, token planes fused into the gather (before)": (jax.jit(lambda x, s: token_planes(x)[:, s]), xl, st),
            "XLA, gather of made planes": (jax.jit(lambda p, s: p[:, s]), tp, st),
            "kernel, used tiles (the path)": (jax.jit(lambda x, te, s: slot_planes(token_planes(x), te, s, tile_t, E)),
                                              xl, te, st),
            "kernel of made planes": (jax.jit(lambda p, te, s: slot_planes(p, te, s, tile_t, E)), tp, te, st),
            "copy of the output bytes": (jax.jit(lambda a: a + 1), jnp.zeros((2, st.shape[0], xl.shape[1] // 2),
                                                                               jnp.bfloat16)),
        }, used)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tile_end = jnp.cumsum((jnp.bincount(flat, length=E) + tile_t - 1) // tile_t)
        t = jnp.arange(te.shape[0], dtype=jnp.int32)
        timed("dispatch", {"the whole layout (the path)": (jax.jit(lambda i, w: dsp.block_layout(i, w, E, tile_t)),
                                                           idx, w)})
        timed("tile search", {
            method: (jax.jit(lambda a, v, m=method: jnp.searchsorted(a, v, side="right", method=m)), tile_end, t)
            for method in ("scan", "compare_all", "sort")})
        timed("inverse permutation", {
            "argsort (before)": (jax.jit(jnp.argsort), order),
            "scatter (the path)": (jax.jit(lambda o: jnp.zeros_like(o).at[o].set(jnp.arange(o.size, dtype=o.dtype),
                                                                                unique_indices=True)), order)})
        timed("scales", {"w1 in plane order": (jax.jit(lambda s: transpose_scales(s, plane_rows=True)), ex.w1_scale),
                         "copy of w1's scales": (jax.jit(lambda s: s + 1), ex.w1_scale)})


if __name__ == "__main__":
    main()
