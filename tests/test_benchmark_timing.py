"""benchmarks/timing.py: the device-time timer's batches (the counts of calls, the difference of two batches)
and its result's units, with a host clock that is faked so that the arithmetic is checked exactly; the copy
bandwidth's and the KDA decode's byte counts; the KDA benchmark's decode loop."""
import importlib.util
from pathlib import Path

import jax.numpy as jnp

# loaded from its file: putting benchmarks/ on sys.path would let benchmarks/convert.py shadow the convert
# package for every later test in the process
_SPEC = importlib.util.spec_from_file_location(
    "benchmarks_timing", Path(__file__).resolve().parents[1] / "benchmarks" / "timing.py")
timing = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(timing)


def test_device_seconds_is_the_difference_of_two_batches_over_n(monkeypatch):
    calls = []
    clock = {"now": 0.0}
    per_call, fixed = 0.003, 0.5  # a call costs 3 ms of "device" time; every batch pays a fixed 0.5 s

    def fn(x):
        calls.append(1)
        clock["now"] += per_call
        return x + 1

    def fake_counter():
        return clock["now"]

    def fake_block(out):
        clock["now"] += fixed
        return out

    monkeypatch.setattr(timing.time, "perf_counter", fake_counter)
    monkeypatch.setattr(timing.jax, "block_until_ready", fake_block)
    s = timing.device_seconds(fn, jnp.zeros(3), calls=4, reps=3)
    assert abs(s - per_call) < 1e-12  # the fixed cost cancels
    assert len(calls) == 1 + 3 * (4 + 8)  # warm-up, then batches of n and 2n per rep
    calls.clear()
    # without `calls`: one timed call sizes the batches (0.503 s here: the minimum, 2)
    timing.device_seconds(fn, jnp.zeros(3), reps=1)
    assert len(calls) == 2 + 2 + 4


def test_every_benchmark_and_gpu_script_compiles():
    """The GPU-only scripts (benchmarks/, tests/gpu/) never run in CI; a syntax error in one would surface only
    on the device, at the cost of a call. Byte-compile each (nothing is imported or run)."""
    root = Path(__file__).resolve().parents[1]
    scripts = sorted((root / "benchmarks").glob("*.py")) + sorted((root / "tests" / "gpu").glob("*.py"))
    assert len(scripts) > 5
    for path in scripts:
        compile(path.read_text(), str(path), "exec")


def _kda_benchmark(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "timing", timing)
    spec = importlib.util.spec_from_file_location(
        "benchmarks_kda", Path(__file__).resolve().parents[1] / "benchmarks" / "kda.py")
    kda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kda)
    return kda


def test_copy_tbps_counts_a_read_and_a_write_per_element(monkeypatch):
    monkeypatch.setattr(timing, "device_seconds", lambda fn, x, calls: 1e-3)
    assert abs(timing.copy_tbps(2 ** 20) - 2 * 4 * 2 ** 20 / 1e-3 / 1e12) < 1e-12


def test_decode_step_bytes_counts_states_tails_inputs_and_output(monkeypatch):
    """At K3's widths (H = 96, K = V = 128, conv width 4, bf16 tails and projections, fp32 states, gate and
    beta) a row's step moves its 64 KiB-a-head state twice, 3 x 3 tail rows of H*K twice, and its inputs and
    output once: counted here by hand."""
    kda = _kda_benchmark(monkeypatch)
    n, h, c = 2, 96, 96 * 128
    qkv, conv_w, conv_pool, s_pool, slots, z, beta, gate, norm_w, a_log = kda.decode_inputs(n, h)
    want = n * (2 * h * 128 * 128 * 4 + 2 * 3 * 3 * c * 2 + 3 * c * 2 + h * 128 * 4 + h * 4 + h * 128 * 4
                + h * 128 * 2)
    assert kda.decode_step_bytes(qkv, conv_pool, s_pool, z, beta, gate) == want


def test_decode_steps_loop_carries_the_output_so_none_of_a_step_is_dead_code(monkeypatch):
    """benchmarks/kda.py times decode steps in a loop; a step's output computed by XLA (the split decode's
    norm) must stay in the loop. Here the output is a sqrt of the carried counter: the loop returns the last
    step's output, and the compiled loop still computes it (a loop carrying the pools only drops the sqrt)."""
    import jax
    kda = _kda_benchmark(monkeypatch)
    step = lambda cp, sp: (jnp.sqrt(cp + sp), cp + 1.0, sp)  # noqa: E731
    loop = kda.steps_loop(step, 3)
    o, cp, sp = loop(jnp.zeros(4), jnp.full(4, 2.0))
    assert float(cp[0]) == 3.0 and float(o[0]) == 2.0  # the third step's: sqrt(2 + 2)
    assert "sqrt" in loop.lower(jnp.zeros(4), jnp.full(4, 2.0)).compile().as_text()
    dropped = jax.jit(lambda cp, sp: jax.lax.fori_loop(0, 3, lambda i, c: step(*c)[1:], (cp, sp)))
    assert "sqrt" not in dropped.lower(jnp.zeros(4), jnp.full(4, 2.0)).compile().as_text()
