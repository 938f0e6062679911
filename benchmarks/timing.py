"""The benchmarks' timer for jitted JAX calls: device time per call, the quantity a peer's CUDA-event timer
(triton.testing.do_bench, used for the torch peers) reports.

Timing one call at a time from the host (`perf_counter` around a call and `block_until_ready`) adds the
host's dispatch and synchronisation to every call. On the H200 (2026-12-03) that was 0.24-0.54 ms per call
for our KDA prefill and jax-linear-attention's at about 2 ms, a tenth to a quarter of the time, so neither
the rates nor the ratios against do_bench's numbers meant what they said. Here a batch of n calls and one
of 2n calls are dispatched back to back, each blocked on once; (t(2n) - t(n)) / n is the time the device
takes per call, the host's fixed costs cancelling. That holds while the device is busier than the host: a call
shorter than the host's dispatch of one (some tens of us) leaves the device idle between calls, and the result
is the dispatch rate (29 us for a 1.5 MB XLA norm on the H100, 2026-12-06, about 4 us in a device loop). Time
such calls inside one jitted loop instead (`benchmarks/kda.py: steps_loop`).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def device_seconds(fn, *args, calls: int | None = None, reps: int = 5, batch_s: float = 0.02,
                   max_calls: int = 20) -> float:
    """Median over `reps` of the device seconds per call of `fn(*args)` (see the module docstring). n is
    `calls`, or as many calls (2 to `max_calls`) as take about `batch_s`. Only the newest output is kept
    alive, but outputs are allocated as calls are dispatched, ahead of the device: keep n small for calls
    with outputs of several GB."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    n = calls
    if not n:  # one timed call sizes the batches
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        n = max(2, min(max_calls, int(batch_s / max(time.perf_counter() - t0, 1e-6))))

    def batch(k):
        t = time.perf_counter()
        for _ in range(k):
            out = fn(*args)
        jax.block_until_ready(out)
        return time.perf_counter() - t

    return statistics.median((batch(2 * n) - batch(n)) / n for _ in range(reps))


def copy_tbps(size: int = 2 ** 30) -> float:
    """The device's copy bandwidth in TB/s: an XLA elementwise pass over `size` fp32 (read + write), timed by
    `device_seconds`; the ceiling that the benchmarks' bandwidth-bound rates are read against."""
    x = jnp.ones((size,), jnp.float32)
    s = device_seconds(jax.jit(lambda a: a + 1.0), x, calls=3)  # at most 6 queued outputs of 4 GiB
    del x
    return 2 * 4 * size / s / 1e12
