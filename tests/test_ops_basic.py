"""The small pure ops (kimik3_jax/ops/common.py, attn_res.py) against the float64 NumPy reference.

Every op runs on fresh random inputs in float64 (the exact mode, x64 enabled only inside the test),
float32 and, where the model uses it, bfloat16. The reference always sees the same values the op saw
(inputs rounded to the test dtype, then upcast to float64).

The tolerance constants and helpers here are shared with test_ops_kda.py and test_ops_mla_moe.py.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kimik3_jax.ops.attn_res import attn_res_mix, fold_site
from kimik3_jax.ops.common import linear, mlp, rms_norm, situ
from kimik3_jax.presets import preset
from reference import k3_numpy as ref

BF16 = jnp.bfloat16

# Tolerances, relative to the magnitude of the reference (see `rel_err` for the normalisation each test
# uses). They are the rounding of the compute dtype times a modest growth factor, never tuned to pass:
F64_RTOL = 1e-12  # float64 path: unit roundoff 1.1e-16, so 1e-12 leaves room only for conditioning
F32_RTOL = 1e-5   # float32 path (also fp32 internals fed exact bf16 values): unit roundoff 6e-8
BF16_RTOL = 1e-2  # bfloat16 activations: each cast to bf16 rounds by up to 2^-8 = 3.9e-3
RTOL = {np.dtype(np.float64): F64_RTOL, np.dtype(np.float32): F32_RTOL, np.dtype(BF16): BF16_RTOL}
DTYPES = (np.float64, np.float32, BF16)
DTYPE_IDS = ("f64", "f32", "bf16")

CFG = preset("tiny")
EPS = CFG.rms_norm_eps
NO_DB = settings(database=None, deadline=None, max_examples=12)


@contextlib.contextmanager
def precision(dtype):
    """x64 on exactly when the test computes in float64; restored afterwards, so no other test sees it."""
    with jax.enable_x64(np.dtype(dtype) == np.float64):
        yield


def make(a, dtype):
    """`a` rounded to `dtype`: (jax array, the same values as float64 NumPy for the reference).
    Call inside `precision(dtype)`."""
    a_dt = np.asarray(a, dtype=np.float64).astype(dtype)
    return jnp.asarray(a_dt), a_dt.astype(np.float64)


def acc_of(dtype):
    """The dtype of the ops' "fp32" internals for inputs of `dtype` (float64 in the exact mode)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def acc_rtol(dtype):
    """Results computed in the accumulation dtype (fp32 internals on exact bf16 inputs included)."""
    return RTOL[acc_of(dtype)]


def rel_err(got, want, axis=None):
    """max |got - want| / max |want|, both maxima over `axis` (None: the whole array; -1: per row;
    (): element by element), and the worst ratio returned."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite values"
    if got.size == 0:
        return 0.0
    num = np.max(np.abs(got - want), axis=axis)
    den = np.max(np.abs(want), axis=axis)
    return float(np.max(num / np.maximum(den, np.finfo(np.float64).tiny)))


def assert_close(got, want, rtol, axis=None, what="value"):
    err = rel_err(got, want, axis)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


# ------------------------------------------------------------------------------------------------ linear

def test_linear_matches_reference_in_every_dtype():
    for dtype in DTYPES:
        rng = np.random.default_rng(101)
        with precision(dtype):
            x, x64 = make(rng.standard_normal((2, 5, 96)), dtype)
            w, w64 = make(rng.standard_normal((40, 96)) / np.sqrt(96), dtype)
            y = linear(x, w)
            assert y.dtype == x.dtype
            assert_close(y, x64 @ w64.T, RTOL[np.dtype(dtype)], axis=-1, what=f"linear {np.dtype(dtype)}")
            if dtype is BF16:
                # Accumulated in fp32: asked for a float32 result, bf16 inputs give the exact products summed
                # at fp32 precision (a bf16 accumulation would be ~1e-3 off).
                y32 = linear(x, w, jnp.float32)
                assert y32.dtype == jnp.float32
                assert_close(y32, x64 @ w64.T, F32_RTOL, axis=-1, what="linear bf16 -> f32")


# ----------------------------------------------------------------------------------------------- rms_norm

@settings(NO_DB, max_examples=6)  # every new shape compiles: a few suffice
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), d=st.sampled_from([8, 64, 96]),
       log_scale=st.floats(-3.0, 3.0), with_weight=st.booleans())
def test_rms_norm_float32_any_shape(lead, d, log_scale, with_weight):
    rng = np.random.default_rng([len(lead), d, int(with_weight)])
    with precision(np.float32):
        x, x64 = make(rng.standard_normal((*lead, d)) * 10.0 ** log_scale, np.float32)
        w, w64 = make(1 + 0.3 * rng.standard_normal(d), np.float32) if with_weight else (None, None)
        y = rms_norm(x, w, EPS)
        assert y.dtype == jnp.float32 and y.shape == x.shape
        assert_close(y, ref.rms_norm(x64, w64, EPS), F32_RTOL, axis=-1, what="rms_norm f32")


def test_rms_norm_float64_eps_inside_the_root():
    rng = np.random.default_rng(102)
    # row scales from 1e-4 (mean(x^2) far below eps: eps dominates) to 1e3
    scales = 10.0 ** np.linspace(-4, 3, 8)[:, None, None]
    with precision(np.float64):
        for eps in (EPS, 1e-2):
            x, x64 = make(rng.standard_normal((8, 3, 64)) * scales, np.float64)
            w, w64 = make(1 + 0.3 * rng.standard_normal(64), np.float64)
            for weight, weight64 in ((w, w64), (None, None)):
                y = rms_norm(x, weight, eps)
                assert y.dtype == jnp.float64
                assert_close(y, ref.rms_norm(x64, weight64, eps), F64_RTOL, axis=-1, what=f"rms_norm eps={eps}")


def test_rms_norm_bf16_normalises_in_fp32_casts_then_multiplies_by_the_weight():
    """SPEC 12: in bf16 the normalised value is cast to bf16 first, then multiplied by the (bf16) weight."""
    rng = np.random.default_rng(103)
    scales = 10.0 ** rng.uniform(-3, 2, size=(6, 8, 1))
    with precision(BF16):
        x, x64 = make(rng.standard_normal((6, 8, 256)) * scales, BF16)
        w, w64 = make(1 + 0.5 * rng.standard_normal(256), BF16)
        out = rms_norm(x, w, EPS)
    assert out.dtype == BF16
    got = np.asarray(out.astype(jnp.float32), dtype=np.float64)
    y64 = ref.rms_norm(x64, None, EPS)
    want = (y64.astype(BF16).astype(np.float64) * w64).astype(BF16).astype(np.float64)
    wrong_order = (y64 * w64).astype(BF16).astype(np.float64)
    # Elements whose normalised value is not within 1e-5 (relative) of a bf16 rounding boundary: there the
    # fp32 normalisation (error ~1e-7) rounds to the same bf16 as the float64 one, so the result is exact.
    safe = (y64 * (1 - 1e-5)).astype(BF16) == (y64 * (1 + 1e-5)).astype(BF16)
    assert safe.mean() > 0.95
    assert (wrong_order[safe] != want[safe]).mean() > 0.05  # the two orders are distinguishable on this data
    np.testing.assert_array_equal(got[safe], want[safe])
    assert_close(got, ref.rms_norm(x64, w64, EPS), BF16_RTOL, axis=-1, what="rms_norm bf16 vs exact")


# ---------------------------------------------------------------------------------------------------- SiTU

def test_situ_matches_reference_in_fp32_internals():
    rng = np.random.default_rng(104)
    g0 = np.concatenate([rng.standard_normal(500) * 3, rng.uniform(-80, 80, 500), [0.0, -0.0, 1e-30, -1e-30]])
    u0 = np.concatenate([rng.standard_normal(500) * 10, rng.uniform(-200, 200, 500), [5.0, -5.0, 0.0, 1e-3]])
    for beta, lin_beta in ((CFG.situ_beta, CFG.situ_linear_beta), (1.5, 7.0)):
        for dtype in DTYPES:
            with precision(dtype):
                g, g64 = make(g0, dtype)
                u, u64 = make(u0, dtype)
                y = situ(g, u, beta, lin_beta)
                # fp32 internals for bf16 inputs; element by element, so saturated tails are checked too
                assert y.dtype == acc_of(dtype)
                assert_close(y, ref.situ(g64, u64, beta, lin_beta), acc_rtol(dtype), axis=(),
                             what=f"situ {np.dtype(dtype)}")


def test_mlp_matches_reference():
    rng = np.random.default_rng(105)
    d, f = 96, 160
    for dtype in DTYPES:
        with precision(dtype):
            x, x64 = make(rng.standard_normal((2, 7, d)), dtype)
            # pre-activations of a few units: both SiTU factors leave their linear range
            gate, gate64 = make(rng.standard_normal((f, d)) * 3 / np.sqrt(d), dtype)
            up, up64 = make(rng.standard_normal((f, d)) * 20 / np.sqrt(d), dtype)
            down, down64 = make(rng.standard_normal((d, f)) / np.sqrt(f), dtype)
            for beta, lin_beta in ((CFG.situ_beta, CFG.situ_linear_beta), (2.0, 10.0)):
                y = mlp(x, gate, up, down, beta, lin_beta)
                assert y.dtype == x.dtype
                want = ref.situ(x64 @ gate64.T, x64 @ up64.T, beta, lin_beta) @ down64.T
                assert_close(y, want, RTOL[np.dtype(dtype)], axis=-1, what=f"mlp {np.dtype(dtype)}")


# ------------------------------------------------------------------------------------------------- AttnRes

def test_fold_site_is_the_exact_product_in_the_accumulation_dtype():
    rng = np.random.default_rng(106)
    for dtype in DTYPES:
        with precision(dtype):
            norm_w, n64 = make(1 + 0.2 * rng.standard_normal(64), dtype)
            proj_w, p64 = make(rng.standard_normal((1, 64)), dtype)
            w = fold_site(norm_w, proj_w, dtype)
            assert w.dtype == acc_of(dtype)
            want = n64 * p64[0]
            if dtype is np.float32:  # one fp32 rounding of the exact product
                np.testing.assert_array_equal(np.asarray(w), want.astype(np.float32))
            else:  # bf16 x bf16 fits in fp32; fp64 x fp64 is rounded once in fp64
                np.testing.assert_array_equal(np.asarray(w, dtype=np.float64), want)


def _mix_case(rng, n):
    """candidates [n, 2, 3, 64] and a site (norm_w, proj_w [1, 64]). Batch row 0: loosely related candidates,
    logits a few units apart. Batch row 1: keys (the RMS-normed candidates) nearly equal, so the logits sit
    within ~0.3 of each other, while the raw candidates differ in scale by up to 100x: the output still
    depends on every logit difference."""
    d = 64
    norm_w = 1 + 0.3 * rng.standard_normal(d)
    proj_w = rng.standard_normal((1, d))
    scale = 10.0 ** rng.uniform(-1, 1, size=(n, 2, 3, 1))
    apart = rng.standard_normal((3, d)) + 0.25 * rng.standard_normal((n, 3, d))
    close = rng.standard_normal((3, d)) + 1e-2 * rng.standard_normal((n, 3, d))
    return np.stack([apart, close], axis=1) * scale, norm_w, proj_w


@jax.jit
def _mix(cand, norm_w, proj_w):
    return attn_res_mix(cand, fold_site(norm_w, proj_w, cand.dtype), EPS)


def test_attn_res_mix_one_to_nine_candidates():
    for dtype in DTYPES:
        for n in range(1, 10) if dtype is np.float32 else (1, 2, 4, 9):  # every compile costs: all n once
            rng = np.random.default_rng([107, n])
            cand0, nw0, pw0 = _mix_case(rng, n)
            with precision(dtype):
                cand, cand64 = make(cand0, dtype)
                norm_w, nw64 = make(nw0, dtype)
                proj_w, pw64 = make(pw0, dtype)
                out = _mix(cand, norm_w, proj_w)
            assert out.dtype == cand.dtype and out.shape == cand.shape[1:]
            want = ref.attn_res_mix(cand64, nw64, pw64, EPS)
            assert_close(out, want, RTOL[np.dtype(dtype)], axis=-1, what=f"attn_res_mix {np.dtype(dtype)} n={n}")
            if n > 1:
                # the comparison does see the close logits: equal weights would be far outside the tolerance
                assert rel_err(np.mean(cand64[:, 1], axis=0), want[1], axis=-1) > 100 * F32_RTOL
