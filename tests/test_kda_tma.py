"""The KDA decode on Mosaic GPU with the state through shared memory by TMA (`pallas_kernels/kda/decode_tma.py`,
tuning tma=True) on the CPU: the one-launch kernel and the split launches' state kernel. They need jax 0.11, the
GPU machine's: there, in the Mosaic GPU interpreter, the state kernel against float64 NumPy (an inactive row's
state and the slots no row names left bit for bit) and the Triton state kernel; the whole step, one launch and
split, against the pure op and float64 NumPy, and over three steps against the Triton one-launch kernel; and
their CUDA lowering with the pools aliased. Under jax 0.10 (CI's) each of these asks is refused by name
instead. `bash tests/lower_jax_gpu_version.sh` runs this file under jax 0.11."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from test_kda_kernels import H, LB, STATE_RTOL, assert_close, check_decode, check_over_steps, decode_inputs

from kimik3_jax.ops import impl as impl_mod
from kimik3_jax.ops.impl import Unsupported
from pallas_kernels.kda import decode_split as split
from pallas_kernels.kda.decode import TUNING, kda_decode
from pallas_kernels.kda.decode_tma import available, decode_tma, state_tma

K = 128  # the kernel's rows are WGMMA's 64-row layout: K = V a multiple of 64
REFUSED = "tma needs jax >= 0.11"
ONE_LAUNCH, SPLIT, SPLIT_32 = dict(tma=True, split=False), dict(tma=True, split=True), dict(tma=True, split=True,
                                                                                          block_v=32)


def refused(call):
    """Under jax 0.10: `call` raises Unsupported naming the version; True there (the test stops)."""
    if available():
        return False
    with pytest.raises(Unsupported, match=REFUSED):
        call()
    return True


def state_inputs(rng, n=3, heads=H, pool=6):
    """The prologue's rows (q and k of unit norm, g at up to the -5 bound, beta in [0, 1)) and an fp32 pool; row
    1 inactive. The prologue repeats beta along its row and the kernels read its first element: here the row
    varies, so that a kernel reading any other element fails."""
    pre = rng.standard_normal((n, heads, 5, K)).astype(np.float32)
    pre[:, :, :2] /= np.linalg.norm(pre[:, :, :2], axis=-1, keepdims=True)
    pre[:, :, 3] = LB * rng.random((n, heads, K))
    pre[:, :, 4] = rng.random((n, heads, K))
    slots = rng.permutation(pool)[:n].astype(np.int32)
    lens = np.array([1, 0, 1][:n], np.int32)
    return slots, lens, pre, (0.3 * rng.standard_normal((pool, heads, K, K))).astype(np.float32)


@pytest.mark.parametrize("bv,heads_fastest", [(128, True), (64, False), (32, True)])
def test_state_kernel_equals_float64_and_the_triton_kernel(bv, heads_fastest):
    rng = np.random.default_rng(701 + bv)
    slots, lens, pre, s = state_inputs(rng)
    run = jax.jit(lambda *a: state_tma(*a, bv=bv, heads_fastest=heads_fastest, interpret=True))
    if refused(lambda: run(slots, lens, pre, s)):
        return
    o, s_new = (np.asarray(a) for a in run(slots, lens, pre, s))
    for i, slot in enumerate(slots):
        for h in range(pre.shape[1]):
            q, k, v, g, beta = pre[i, h].astype(np.float64)
            want = s[slot, h] * np.exp(g)[:, None]
            want = want + np.outer(k, beta[0] * (v - k @ want))
            assert_close(o[i, h], q @ want, STATE_RTOL, what=f"row {i} head {h} output")
            if lens[i]:
                assert_close(s_new[slot, h], want, STATE_RTOL, what=f"row {i} head {h} state")
            else:
                np.testing.assert_array_equal(s_new[slot, h], s[slot, h])
    unnamed = np.setdiff1d(np.arange(s.shape[0]), slots)
    np.testing.assert_array_equal(s_new[unnamed], s[unnamed])
    o2, s2 = jax.jit(lambda *a: split.state(*a, bv=bv, tuning=dict(TUNING, heads_fastest=heads_fastest),
                                            interpret=True))(slots, lens, pre, s)
    assert_close(o, o2, STATE_RTOL, axis=-1, what="output vs the Triton state kernel")
    assert_close(s_new, s2, STATE_RTOL, axis=(-2, -1), what="states vs the Triton state kernel")


@pytest.mark.parametrize("tuning", [ONE_LAUNCH, SPLIT, SPLIT_32], ids=["one-launch", "split", "split-bv32"])
def test_decode_matches_op_and_float64(tuning):
    x = decode_inputs(np.random.default_rng(0), 1, 2, d=K)
    if refused(lambda: kda_decode(*x.values(), eps=1e-5, interpret=True, tuning=tuning)):
        return
    check_decode(K, tuning)


@pytest.mark.parametrize("tuning", [ONE_LAUNCH, SPLIT_32], ids=["one-launch", "split-bv32"])
def test_decode_equals_the_triton_kernel_over_steps(tuning):
    """Against the Triton one-launch kernel over three steps (`check_over_steps`)."""
    x = decode_inputs(np.random.default_rng(0), 1, 2, d=64)
    if refused(lambda: kda_decode(*x.values(), eps=1e-5, interpret=True, tuning=tuning)):
        return
    check_over_steps(tuning, np.random.default_rng(709))


def test_lowers_for_cuda_with_the_pools_in_place():
    """At the benchmark's widths (H = 96, 32 rows, K3's conv width 4): Mosaic GPU custom calls whose pool outputs
    alias the pools."""
    n, h, p, c = 32, 96, 64, 96 * K
    i32, f32, bf16 = jnp.int32, jnp.float32, jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    rows = [sds((n,), i32)] * 2
    pool = sds((p, h, K, K), f32)
    calls = [(lambda *a: state_tma(*a, bv=128), rows + [sds((n, h, 5, K), f32), pool], 1),
             (lambda *a: state_tma(*a, bv=32, heads_fastest=False), rows + [sds((n, h, 5, K), f32), pool], 1),
             (lambda *a: decode_tma(*a, eps=1e-5, lower_bound=LB, gate_on=True, qk_norm=True),
              [sds((n, 3, c), bf16), sds((3, c, 4), f32), sds((p, 3, 3, c), bf16), pool, rows[0], sds((n, h, K), f32),
               sds((n, h), f32), sds((n, h, K), f32), sds((K,), f32), rows[1], sds((h,), f32)], 2)]
    for fn, args, pools in calls:
        if refused(lambda: lower_for_cuda(fn, *args)):
            return
        hlo = lower_for_cuda(fn, *args)
        assert "mosaic_gpu" in hlo and hlo.count("stablehlo.output_operand_alias<") == pools


def test_bad_asks_are_refused_by_name():
    rng = np.random.default_rng(719)
    x = decode_inputs(rng, 2, 4, d=64)
    for tuning in (dict(tma=True, split=False, block_v=32), dict(tma=True, split=False, tails_in_place=False)):
        with pytest.raises(ValueError, match="tma in one launch takes whole V with the tails in place"
                           if available() else REFUSED):
            kda_decode(*x.values(), eps=1e-5, interpret=True, tuning=tuning)
    # before any work, so that impl="auto" falls back: K = 32 is not a multiple of 64 (or this jax is 0.10)
    with pytest.raises(Unsupported, match="a multiple of 64" if available() else REFUSED):
        impl_mod.kernel("kda_decode").supports(*decode_inputs(rng, 2, 4, d=32).values(), eps=1e-5,
                                               tuning=dict(tma=True))
    slots, lens, pre, s = state_inputs(rng)
    for bad, match in ((dict(bv=16), "multiple of 32 dividing V"), (dict(bv=32, s=s.astype(jnp.bfloat16)),
                                                                    "fp32 state pools")):
        with pytest.raises(Unsupported, match=match if available() else REFUSED):
            state_tma(slots, lens, pre, bad.get("s", s), bv=bad["bv"], interpret=True)
