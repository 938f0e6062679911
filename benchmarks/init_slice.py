"""Initialise a preset's parameters straight into device memory and check them against the host draw.

    PYTHONPATH=$PWD python benchmarks/init_slice.py [--preset slice] [--layers N] [--seed S]

Prints the compile and run time of the jitted init, the bytes placed on the device, and compares
sample tensors (the first 4M elements of the first and last layer/expert of every leaf) with the host
values that `make-checkpoint` writes: integer kinds must be equal, float kinds within one ulp.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import numpy as np

from kimik3_jax import params, presets
from kimik3_jax.params.random import _draw_flat, stream_key

SAMPLE = 1 << 22  # elements compared per sampled tensor (its first ones: the host draw is slow)


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place between two float arrays of the same dtype."""
    ia = a.view(f"i{a.dtype.itemsize}").astype(np.int64)
    ib = b.view(f"i{b.dtype.itemsize}").astype(np.int64)
    return int(np.max(np.abs(ia - ib))) if a.size else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="slice")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = presets.preset(args.preset, args.layers)
    dev = jax.devices()[0]
    print(f"{cfg.summary()}\ndevice: {dev.device_kind}, jax {jax.__version__}")
    spec = params.describe(cfg)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    init = jax.jit(params.init_params_traced, static_argnums=(0, 1, 2),
                   out_shardings=params.map_leaves(lambda _: sharding, spec))
    t0 = time.perf_counter()
    compiled = init.lower(cfg, args.seed, False).compile()
    t1 = time.perf_counter()
    tree = compiled()
    jax.block_until_ready(tree)
    t2 = time.perf_counter()
    total = sum(x.nbytes for x in jax.tree.leaves(tree))
    print(f"compile {t1 - t0:.1f} s, init {t2 - t1:.2f} s, {total / 1e9:.2f} GB on device "
          f"({total / 1e9 / (t2 - t1):.1f} GB/s)")
    worst = 0
    for (path, leaf), arr in zip(params.named_leaves(spec), jax.tree.leaves(tree)):
        tensors = list(leaf.tensors())
        for index, name, layer, expert in {tensors[0][0]: tensors[0], tensors[-1][0]: tensors[-1]}.values():
            n = min(SAMPLE, math.prod(leaf.shape))
            got = np.asarray(arr[index].reshape(-1)[:n])
            key = stream_key(np, args.seed, leaf, layer, expert)
            want = _draw_flat(np, leaf.init, key, leaf.shape, leaf.dtype, 0, n)
            if leaf.dtype.kind == "u":
                assert np.array_equal(got, want), f"{name}: device init differs from the host draw"
            else:
                d = ulps(got, want)
                assert d <= 1, f"{name}: device init is {d} ulps from the host draw"
                worst = max(worst, d)
    print(f"sampled tensors equal the host draw (integer kinds exactly, floats within {worst} ulp)")


if __name__ == "__main__":
    main()
