"""GPU probe: at N = 1 the decode kernel and the XLA op differ by ~2e-3 on the GPU; which one is right?
Compares both with the op run on the host CPU."""
import sys

import jax
import numpy as np

sys.path.insert(0, "benchmarks")
from kda import decode_inputs  # noqa: E402

from kimik3_jax.ops.kda import kda_decode as op  # noqa: E402
from pallas_kernels.kda.decode import kda_decode  # noqa: E402

for n in (1, 2):
    args = decode_inputs(n, 96)
    a_log = args[-1]
    args = args[:-1]
    kw = dict(eps=1e-5, a_log=a_log, lower_bound=-5.0)
    k = jax.jit(lambda *a: kda_decode(*a, **kw))(*args)
    g = jax.jit(lambda *a: op(*a, **kw))(*args)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        hc = jax.jit(lambda *a: op(*a, **kw))(*jax.device_put(args, cpu))
    rel = lambda a, b: float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max() / np.abs(np.asarray(b, np.float32)).max())  # noqa: E731
    for name, i in (("o", 0), ("state", 2)):
        print(f"N={n} {name}: kernel vs gpu-op {rel(k[i], g[i]):.2e}  kernel vs cpu-op {rel(k[i], hc[i]):.2e}  "
              f"gpu-op vs cpu-op {rel(g[i], hc[i]):.2e}", flush=True)
