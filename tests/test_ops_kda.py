"""KDA ops (kimik3_jax/ops/kda.py) against the float64 NumPy reference: gate, L2 norm, short conv with
carried tails and right padding, the token recurrence, and the chunked scan (vs the recurrence and vs the
reference, on outputs and final state, at the -5 bound and with mixed gates), exact identity (padding)
steps, and that the jitted chunked scan cannot deadlock a 2-thread CPU pool.

Tolerances and helpers come from test_ops_basic.py.
"""
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kimik3_jax.ops.kda import kda_chunked, kda_gate, kda_recurrent, kda_step, l2_normalize, short_conv
from reference import k3_numpy as ref
from test_ops_basic import (
    CFG, DTYPE_IDS, DTYPES, NO_DB, RTOL, acc_of, acc_rtol, assert_close, make, precision,
)

LOWER_BOUND = CFG.kda.gate_lower_bound  # -5 in the release
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ gate

@pytest.mark.parametrize("lower_bound", [LOWER_BOUND, -3.5])
def test_kda_gate(lower_bound):
    rng = np.random.default_rng(201)
    h, k = 4, 32
    a_log0 = rng.uniform(-1.5, 1.5, size=h)
    z0 = rng.standard_normal((2, 6, h, k)) * 4
    decay_rate = np.exp(a_log0)[:, None]
    z0[0, :3] = rng.uniform(30, 60, size=(3, h, k)) / decay_rate  # exp(A_log) z >= 30: g at the lower bound
    z0[1, :3] = -rng.uniform(30, 60, size=(3, h, k)) / decay_rate  # g ~ 0
    for dtype in DTYPES:
        with precision(dtype):
            z, z64 = make(z0, dtype)
            a_log, a64 = make(a_log0, acc_of(dtype))  # A_log is an F32 tensor
            g = kda_gate(z, a_log, lower_bound)
        assert g.dtype == acc_of(dtype)
        want = ref.kda_gate(z64, a64, lower_bound)
        assert np.abs(want[0, :3] - lower_bound).max() < 1e-6  # the data does reach the bound
        # g is a log decay: its absolute error is the relative error of the decay factor exp(g), so the error
        # is measured against |lower_bound|
        err = np.abs(np.asarray(g, dtype=np.float64) - want).max() / abs(lower_bound)
        assert err <= acc_rtol(dtype), f"kda_gate {np.dtype(dtype)}: {err:.3e}"
        g = np.asarray(g, dtype=np.float64)
        assert np.all(g <= 0) and np.all(g >= lower_bound)


# ---------------------------------------------------------------------------------------------- L2 norm

def test_l2_normalize_eps_inside_the_sum():
    rng = np.random.default_rng(202)
    # row norms from 1e-5 (eps = 1e-6 inside the sum dominates) to 1e3; one all-zero row
    x0 = rng.standard_normal((2, 5, 4, 32)) * 10.0 ** rng.uniform(-6, 3, size=(2, 5, 4, 1))
    x0[0, 0, 0] = 0.0
    for dtype in DTYPES:
        with precision(dtype):
            x, x64 = make(x0, dtype)
            y = l2_normalize(x)
            y_eps = l2_normalize(x, 1e-2)
        assert y.dtype == acc_of(dtype)
        assert_close(y, ref.l2_normalize(x64, ref.L2_EPS), acc_rtol(dtype), axis=-1, what=f"l2 {np.dtype(dtype)}")
        assert_close(y_eps, ref.l2_normalize(x64, 1e-2), acc_rtol(dtype), axis=-1, what="l2 eps=1e-2")
        assert np.all(np.asarray(y[0, 0, 0]) == 0)


# ------------------------------------------------------------------------------------------- short conv

CONV_B, CONV_T, CONV_C = 3, 9, 24
_conv = jax.jit(short_conv)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@NO_DB
@given(lengths=st.lists(st.integers(0, CONV_T), min_size=CONV_B, max_size=CONV_B), seed=st.integers(0, 2 ** 16))
def test_short_conv_carried_tail_and_right_padding(width, dtype, lengths, seed):
    """The width comes from the weight [C, 1, W]; the tail [B, W-1, C] carries the previous inputs; each
    sequence has lengths[b] real tokens followed by padding."""
    rng = np.random.default_rng([203, width, seed])
    x0 = rng.standard_normal((CONV_B, CONV_T, CONV_C)) * 2
    tail0 = rng.standard_normal((CONV_B, width - 1, CONV_C)) * 2
    w0 = rng.standard_normal((CONV_C, 1, width)) / np.sqrt(width)
    lens = np.asarray(lengths)
    padding = np.arange(CONV_T)[None, :, None] >= lens[:, None, None]
    with precision(dtype):
        x, x64 = make(x0, dtype)
        tail, tail64 = make(tail0, dtype)
        w, w64 = make(w0, acc_of(dtype))  # conv weights are F32 tensors
        y, new_tail = _conv(x, w, tail, jnp.asarray(lens, jnp.int32))
        # different garbage in the padded positions
        x_other, _ = make(np.where(padding, 1e3 * rng.standard_normal(x0.shape), x0), dtype)
        y_other, new_tail_other = _conv(x_other, w, tail, jnp.asarray(lens, jnp.int32))
    assert y.dtype == x.dtype and y.shape == x.shape
    assert new_tail.dtype == x.dtype and new_tail.shape == tail.shape
    for b, n in enumerate(lens):
        y_ref, tail_ref = ref.causal_conv(x64[b, :n], w64, tail64[b])
        assert_close(y[b, :n], ref.silu(y_ref), RTOL[np.dtype(dtype)], axis=-1, what=f"conv b={b} n={n}")
        # the new tail is the last W-1 real inputs (reaching into the old tail when n < W-1), copied exactly
        np.testing.assert_array_equal(np.asarray(new_tail[b], dtype=np.float64), tail_ref)
    real = ~padding[..., 0]
    np.testing.assert_array_equal(np.asarray(y_other)[real], np.asarray(y)[real])
    np.testing.assert_array_equal(np.asarray(new_tail_other), np.asarray(new_tail))


# ------------------------------------------------------------------------------------------ recurrence

def kda_inputs(rng, b, t, h, k, v, gates="random"):
    """Recurrence inputs as the KDA layer makes them (q, k L2-normed, q scaled by K^-1/2, beta in (0, 1))
    and a non-zero initial state. gates: "random" (the gate of random pre-activations), "bound"
    (-5 + tiny), "mixed" (each entry -4.99 or -0.001 at random)."""
    q = ref.l2_normalize(rng.standard_normal((b, t, h, k))) * k ** -0.5
    kk = ref.l2_normalize(rng.standard_normal((b, t, h, k)))
    vv = rng.standard_normal((b, t, h, v))
    if gates == "random":
        g = ref.kda_gate(rng.standard_normal((b, t, h, k)) * 3, rng.uniform(-1, 1, size=h), LOWER_BOUND)
    elif gates == "bound":
        g = LOWER_BOUND + rng.uniform(0, 1e-6, size=(b, t, h, k))
    elif gates == "mixed":
        g = np.where(rng.random((b, t, h, k)) < 0.5, -4.99, -0.001)
    else:
        raise ValueError(gates)
    beta = ref.sigmoid(rng.standard_normal((b, t, h)) * 2)
    s0 = rng.standard_normal((b, h, k, v))
    return [q, kk, vv, g, beta, s0]


def to_dtype(arrays, dtype):
    """make() for a list: (jax arrays, float64 copies)."""
    pairs = [make(a, dtype) for a in arrays]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def reference_run(x64):
    """ref.kda_recurrent per batch element -> (o [B, T, H, V], s [B, H, K, V])."""
    q, k, v, g, beta, s0 = x64
    runs = [ref.kda_recurrent(q[i], k[i], v[i], g[i], beta[i], s0[i]) for i in range(q.shape[0])]
    return np.stack([r[0] for r in runs]), np.stack([r[1] for r in runs])


def assert_run_close(o, s, o_want, s_want, rtol, what):
    """Outputs relative to each head's output scale over the sequence, states per head."""
    assert_close(o, o_want, rtol, axis=(1, 3), what=f"{what} outputs")
    assert_close(s, s_want, rtol, axis=(-2, -1), what=f"{what} state")


def test_kda_step_matches_reference_and_identity_step_is_exact():
    for dtype in (np.float64, np.float32):
        rng = np.random.default_rng(204)
        q, k, v, g, beta, s0 = kda_inputs(rng, 2, 1, 3, 16, 8)
        with precision(dtype):
            xs, x64 = to_dtype([q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0], dtype)
            o, s = kda_step(xs[5], *xs[:5])
            zeros_g, zeros_beta = jnp.zeros_like(xs[3]), jnp.zeros_like(xs[4])
            o_id, s_id = kda_step(xs[5], xs[0], xs[1], xs[2], zeros_g, zeros_beta)
        assert o.dtype == s.dtype == np.dtype(dtype)
        o_want, s_want = reference_run([a[:, None] if i < 5 else a for i, a in enumerate(x64)])
        assert_close(o, o_want[:, 0], RTOL[np.dtype(dtype)], axis=-1, what="kda_step output")
        assert_close(s, s_want, RTOL[np.dtype(dtype)], axis=(-2, -1), what="kda_step state")
        # g = 0, beta = 0: the state is returned bit for bit, and the output reads it
        np.testing.assert_array_equal(np.asarray(s_id), np.asarray(xs[5]))
        assert_close(o_id, np.einsum("bhkv,bhk->bhv", x64[5], x64[0]), RTOL[np.dtype(dtype)], axis=-1,
                     what="identity step output")


_recurrent = jax.jit(kda_recurrent)
_chunked = jax.jit(kda_chunked, static_argnames="chunk")


def test_kda_recurrent_matches_reference():
    for dtype in (np.float64, np.float32):
        rng = np.random.default_rng(205)
        x = kda_inputs(rng, 2, 40, 2, 16, 8)
        x[3][:, 10:14] = 0.0  # a few identity positions inside the sequence
        x[4][:, 10:14] = 0.0
        with precision(dtype):
            xs, x64 = to_dtype(x, dtype)
            o, s = _recurrent(*xs)
        assert o.dtype == s.dtype == np.dtype(dtype)
        assert_run_close(o, s, *reference_run(x64), RTOL[np.dtype(dtype)], f"kda_recurrent {np.dtype(dtype)}")


# ---------------------------------------------------------------------------------------------- chunked

# jaxlib's batched LAPACK triangular solve (used by `solve_triangular` in kda_chunked) hands batches of
# >= 200000 flops to the XLA intra-op thread pool and blocks a pool thread until they finish; kda_chunked
# has two independent solves that XLA may run at the same time, and then both threads of a 2-thread pool
# wait forever (seen with head dims 8 and 16; the bug pinned by
# test_kda_chunked_does_not_hang_on_a_two_thread_pool). The numeric cases below keep the value solve
# (B * chunks * H * chunk^2 * V flops) under that threshold, so it runs inline and at most one solve ever
# waits on the pool: they cannot hang on any host. V is a pure column dimension of the recurrence (the
# state's value columns evolve independently), so a small V loses no coverage of the algorithm.
TRSM_INLINE_FLOPS = 200_000


def value_solve_is_inline(b, t, h, v, chunk):
    return b * -(-t // chunk) * h * chunk * chunk * v < TRSM_INLINE_FLOPS


CHUNK_CASES = [  # dtype, T, chunk, B, H, K, V
    (np.float64, 1, 64, 2, 2, 16, 2),
    (np.float64, 15, 16, 2, 2, 16, 2),
    (np.float64, 63, 32, 2, 2, 16, 2),
    (np.float64, 65, 64, 2, 2, 16, 2),
    (np.float64, 200, 64, 2, 2, 16, 2),
    (np.float32, 63, 64, 1, 2, 16, 16),
    (np.float32, 65, 64, 2, 2, 16, 2),
    (np.float32, 200, 16, 2, 2, 16, 2),
    (np.float32, 200, 32, 2, 2, 16, 2),
    (np.float32, 4096, 16, 1, 1, 16, 2),
]


@pytest.mark.parametrize("dtype,t,chunk,b,h,k,v", CHUNK_CASES,
                         ids=[f"{np.dtype(c[0]).name}-T{c[1]}-chunk{c[2]}" for c in CHUNK_CASES])
def test_kda_chunked_matches_recurrence_and_reference(dtype, t, chunk, b, h, k, v):
    assert value_solve_is_inline(b, t, h, v, chunk)
    rtol = RTOL[np.dtype(dtype)]
    for gates in ("random", "bound", "mixed"):
        rng = np.random.default_rng([206, t, chunk, ("random", "bound", "mixed").index(gates)])
        with precision(dtype):
            xs, x64 = to_dtype(kda_inputs(rng, b, t, h, k, v, gates), dtype)
            o, s = _chunked(*xs, chunk=chunk)
            o_rec, s_rec = _recurrent(*xs)
        assert o.dtype == s.dtype == np.dtype(dtype) and o.shape == (b, t, h, v) and s.shape == (b, h, k, v)
        o_ref, s_ref = reference_run(x64)
        what = f"{np.dtype(dtype)} T={t} chunk={chunk} gates={gates}"
        assert_run_close(o, s, o_ref, s_ref, rtol, f"chunked vs reference, {what}")
        assert_run_close(o, s, np.asarray(o_rec), np.asarray(s_rec), rtol, f"chunked vs recurrent, {what}")
        assert_run_close(o_rec, s_rec, o_ref, s_ref, rtol, f"recurrent vs reference, {what}")


def test_identity_positions_leave_the_state_exactly_unchanged():
    """Right padding with g = 0, beta = 0 (and arbitrary q, k, v) changes neither the final state nor the
    real outputs, bit for bit: the recurrence, and the chunked scan (same number of chunks, 65 vs 100)."""
    b, t_real, t_all, h, k, v, chunk = 2, 65, 100, 2, 16, 2, 64
    assert value_solve_is_inline(b, t_all, h, v, chunk)
    for dtype in (np.float64, np.float32):
        rng = np.random.default_rng(207)
        x = kda_inputs(rng, b, t_all, h, k, v)
        x[3][:, t_real:] = 0.0
        x[4][:, t_real:] = 0.0
        with precision(dtype):
            xs, _ = to_dtype(x, dtype)
            cut = [a[:, :t_real] for a in xs[:5]] + [xs[5]]
            for name, run in (("recurrent", _recurrent), ("chunked", lambda *a: _chunked(*a, chunk=chunk))):
                o_all, s_all = run(*xs)
                o_cut, s_cut = run(*cut)
                np.testing.assert_array_equal(np.asarray(s_all), np.asarray(s_cut), err_msg=f"{name} state")
                np.testing.assert_array_equal(np.asarray(o_all)[:, :t_real], np.asarray(o_cut),
                                              err_msg=f"{name} outputs")


HANG_SCRIPT = """
import numpy as np, jax
from kimik3_jax.ops.kda import kda_chunked
rng = np.random.default_rng(0)
b, t, h, d = 2, 200, 2, 16  # tiny-preset-like KDA heads, default chunk 64

def inputs():
    q, k, v = (rng.standard_normal((b, t, h, d), np.float32) * 0.2 for _ in range(3))
    g = -5 * rng.random((b, t, h, d), np.float32)
    return q, k, v, g, rng.random((b, t, h), np.float32), rng.standard_normal((b, h, d, d), np.float32)

f = jax.jit(kda_chunked).lower(*inputs()).compile()
print("compiled", flush=True)
for i in range(30):
    f(*inputs())[1].block_until_ready()
    print("step", i, flush=True)
print("finished", flush=True)
"""
COMPILE_TIMEOUT_S = 120  # child start-up and compilation: ~4 s on an idle 2-core host
STEP_TIMEOUT_S = 10  # one call takes milliseconds; a call without progress for this long is a deadlock


def test_kda_chunked_does_not_hang_on_a_two_thread_pool(tmp_path):
    """kda_chunked under jit on a CPU whose XLA pool has 2 threads (a 2-core CI runner; NPROC=2, which
    XLA's CPU client reads for its pool size, forces it on any host) must finish. Run in a child process
    so that a deadlock fails this test instead of hanging the suite; progress is watched call by call, so
    a slow (loaded) host is not mistaken for a hang."""
    env = dict(os.environ, NPROC="2", JAX_PLATFORMS="cpu")
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", HANG_SCRIPT], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
        lines = queue.Queue()

        def read():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)  # end of output
        threading.Thread(target=read, daemon=True).start()
        seen = []
        try:
            while not seen or seen[-1] != "finished":
                try:
                    line = lines.get(timeout=STEP_TIMEOUT_S if seen else COMPILE_TIMEOUT_S)
                except queue.Empty:
                    pytest.fail(f"jitted kda_chunked stopped making progress after {seen[-1:]} with a 2-thread XLA "
                                "pool (deadlock: two concurrent batched LAPACK triangular solves each block a pool "
                                "thread)")
                if line is None:
                    err.seek(0)
                    pytest.fail(f"the child process ended after {seen[-1:]}: {err.read()[-3000:]}")
                seen.append(line.strip())
            proc.wait(timeout=COMPILE_TIMEOUT_S)  # it exits right after "finished"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == 0
