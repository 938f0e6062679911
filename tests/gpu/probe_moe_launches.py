"""GPU probe (twenty-fourth session): every launch of one whole routed-experts call (the Triton path, as the
model runs it on real scales) at decode token counts, for Nsight Compute to time one by one: where a small
step's time goes besides the two grouped kernels. Run under ncu; each token count's call runs three times (the
warm-up and two more), so its launches repeat three times in ncu's list, in launch order, and the last third
is one call (the twenty-fourth session read it so: docs/benchmarks.md):

    XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
        python3 tests/gpu/probe_moe_launches.py > launches.csv        # MOE_TOKENS=1,16 (the default)
"""
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402

from moe import BETA, LINEAR_BETA, _random_experts, routing  # noqa: E402

from pallas_kernels.moe import routed as kern  # noqa: E402


def main():
    ex = _random_experts(jax.random.key(0), 896)
    f = jax.jit(lambda x, i, w, e: kern.routed_experts(x, i, w, e, BETA, LINEAR_BETA, scale_max=120))
    for n in [int(t) for t in os.environ.get("MOE_TOKENS", "1,16").split(",")]:
        args = routing(n, n)
        jax.block_until_ready(args)
        jax.block_until_ready(f(*args, ex))
        for _ in range(2):
            jax.block_until_ready(f(*args, ex))


if __name__ == "__main__":
    main()
