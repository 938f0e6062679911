"""GPU probe: the KDA prefill's chunk table (`prefill_two_phase.chunk_table`) finds each chunk's sequence by
`jnp.searchsorted`; its default method is a loop of small launches (log2 of the sequences), which cost the MoE
dispatch's tile search 0.21-0.26 ms on the H100 against 0.03-0.06 with `method="compare_all"`
(docs/benchmarks.md, twenty-fourth session). This times the whole prefill (our kernels, default tuning, K3's
gate bound) with each method, twice in alternating order in one run, outputs and final states checked equal,
and the table alone both ways. The twenty-fifth session's run made compare_all the default:

    python3 tests/gpu/probe_kda_chunk_search.py      # KDA_SHAPES=1x8192x96,16x4096x12 (B x T x H, the default)
"""
import functools
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kda import ours_prefill, prefill_inputs  # noqa: E402
from timing import device_seconds  # noqa: E402

from pallas_kernels.kda import prefill_two_phase as two_phase  # noqa: E402
from pallas_kernels.kda.common import cdiv  # noqa: E402

SHAPES = [tuple(int(d) for d in s.split("x")) for s in os.environ.get("KDA_SHAPES", "1x8192x96,16x4096x12").split(",")]
AS_IS = two_phase.chunk_table
TABLES = {method: functools.partial(AS_IS, search=method) for method in ("scan", "compare_all")}


def main():
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    for b, t, h in SHAPES:
        args = prefill_inputs(b, t, h)
        times, outs = {}, {}
        for _ in range(2):
            for name, table in TABLES.items():
                two_phase.chunk_table = table  # looked up when the prefill is traced: a fresh jit per variant
                f = ours_prefill(None)
                outs.setdefault(name, jax.device_get(f(*args)))
                times.setdefault(name, []).append(device_seconds(f, *args) * 1e3)
        two_phase.chunk_table = AS_IS
        equal = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                    zip(*(jax.tree_util.tree_leaves(o) for o in outs.values())))
        cu = jnp.arange(b + 1, dtype=jnp.int32) * t
        n_chunks = b * cdiv(t, 16)
        alone = {name: device_seconds(jax.jit(lambda c, tab=table: tab(c, c[1:], 16, n_chunks)), cu) * 1e3
                 for name, table in TABLES.items()}
        print(f"({b}, {t}, {h}): prefill ms {times}; outputs equal {equal}; the table alone ms {alone}", flush=True)


if __name__ == "__main__":
    main()
