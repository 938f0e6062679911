"""MXFP4 (compressed-tensors mxfp4-pack-quantized) decode / encode / checks."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kimik3_jax import mxfp4
from kimik3_jax.errors import MXFP4Error

# Written from the format description, independent of the module's table.
MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_nibble(n, s):
    sign = -1.0 if n & 8 else 1.0
    return sign * MAGS[n & 7] * 2.0 ** (s - 127)


def ref_dequantize(packed, scale):
    """float64 reference by plain Python math: [..., out, in/2], [..., out, in/32] -> float32."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.float64)
    for idx in np.ndindex(packed.shape):
        byte = int(packed[idx])
        j = idx[-1]
        s = int(scale[idx[:-1] + ((2 * j) // 32,)])
        out[idx[:-1] + (2 * j,)] = ref_nibble(byte & 0x0F, s)
        out[idx[:-1] + (2 * j + 1,)] = ref_nibble(byte >> 4, s)
    with np.errstate(over="ignore"):  # 6 * 2^127 and the like overflow float32 to inf
        return out.astype(np.float32)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype == ml_dtypes.bfloat16 else np.uint32)


def assert_bits_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    mismatch = np.argwhere(bits(got) != bits(want))
    assert len(mismatch) == 0, (
        f"{len(mismatch)} mismatches, first at {tuple(mismatch[0])}: "
        f"got {got[tuple(mismatch[0])]!r}, want {want[tuple(mismatch[0])]!r}")


def test_worked_bytes():
    packed = np.zeros((2, 16), np.uint8)
    packed[:, :3] = [0x10, 0x32, 0xFE]
    scale = np.array([[127], [124]], np.uint8)
    want = np.array([0.0, 0.5, 1.0, 1.5, -4.0, -6.0], np.float32)
    np.testing.assert_array_equal(np.asarray(mxfp4.unpack_nibbles(packed[0, :3])),
                                  [0, 1, 2, 3, 14, 15])
    for out in (mxfp4.dequantize(packed, scale, jnp.float32), mxfp4.dequantize_np(packed, scale)):
        out = np.asarray(out)
        assert out.shape == (2, 32)
        np.testing.assert_array_equal(out[0, :6], want)
        np.testing.assert_array_equal(out[1, :6], want / 8)  # scale byte 124 = 2^-3
        np.testing.assert_array_equal(out[:, 6:], 0.0)
    assert mxfp4.E2M1_VALUES.dtype == np.float32
    np.testing.assert_array_equal(mxfp4.E2M1_VALUES, [ref_nibble(n, 127) for n in range(16)])


@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_dequantize_matches_reference_all_bytes(lead):
    rng = np.random.default_rng(len(lead))
    # Every scale byte 0..254 gets a row; packed bytes include all 256 values.
    n = int(np.prod(lead, dtype=int)) * 255 * 2
    scale = rng.permutation(np.resize(np.arange(255, dtype=np.uint8), n)).reshape(lead + (255, 2))
    packed = rng.integers(0, 256, lead + (255, 32), dtype=np.uint8)
    packed[(0,) * len(lead)].reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    want = ref_dequantize(packed, scale)
    assert np.isinf(want).any() and (np.abs(want[want != 0]) < 2.0**-126).any()  # edges covered
    assert_bits_equal(mxfp4.dequantize(packed, scale, jnp.float32), want)
    assert_bits_equal(mxfp4.dequantize_np(packed, scale), want)
    # bf16 output is the exact cast of the float32 one (NumPy's IEEE cast keeps subnormals).
    assert_bits_equal(mxfp4.dequantize(packed, scale), want.astype(ml_dtypes.bfloat16))
    assert_bits_equal(mxfp4.dequantize_np(packed, scale, ml_dtypes.bfloat16),
                      want.astype(ml_dtypes.bfloat16))
    assert np.array_equal(want.astype(ml_dtypes.bfloat16).astype(np.float32), want)


def test_subnormal_scale_bytes_exact():
    # Scale bytes 0 and 1 give float32 subnormals; XLA CPU flushes subnormal float products to 0.
    packed = np.full((2, 16), 0x21, np.uint8)  # elements 0.5, 1.0 alternating
    scale = np.array([[0], [1]], np.uint8)
    out = np.asarray(mxfp4.dequantize(packed, scale, jnp.float32))
    assert out[0, 0] == np.float32(2.0**-128) and out[0, 1] == np.float32(2.0**-127)
    assert out[1, 0] == np.float32(2.0**-127) and out[1, 1] == np.float32(2.0**-126)
    assert np.asarray(mxfp4.dequantize(packed, scale))[0, 0] == ml_dtypes.bfloat16(2.0**-128)


def test_dequantize_jit_and_nan_scale():
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (3, 4, 32), dtype=np.uint8)
    scale = rng.integers(100, 150, (3, 4, 2), dtype=np.uint8)
    f = jax.jit(mxfp4.dequantize, static_argnames=("dtype",))
    assert_bits_equal(f(packed, scale, dtype=jnp.float32), ref_dequantize(packed, scale))
    assert f(packed, scale).dtype == jnp.bfloat16
    scale[1, 2, 0] = 255
    out = np.asarray(f(packed, scale, dtype=jnp.float32))
    assert np.isnan(out[1, 2, :32]).all()
    assert not np.isnan(np.delete(out.reshape(-1, 32), (1 * 4 + 2) * 2, axis=0)).any()
    with pytest.raises(MXFP4Error, match=r"experts\.w1.*\(1, 2, 0\)"):
        mxfp4.dequantize_np(packed, scale, name="experts.w1")


def random_representable(rng, shape):
    """Per group: E2M1 values times 2^(s-127), s in 0..254, kept finite in float32."""
    nib = rng.integers(0, 16, shape).astype(np.uint8)
    s = rng.integers(0, 255, shape[:-1] + (shape[-1] // 32,)).astype(np.uint8)
    s.reshape(-1)[:3] = [0, 1, 254]
    big = np.repeat(s >= 253, 32, axis=-1)
    nib = np.where(big, nib & 0b1011, nib)  # magnitudes <= 1.5 so 2^126..2^127 scales stay finite
    nib.reshape(-1, 32)[3] = 0  # an all-zero group
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    x = ref_dequantize(packed, s)
    assert np.isfinite(x).all()
    return x


@pytest.mark.parametrize("seed", range(5))
def test_roundtrip_representable(seed):
    rng = np.random.default_rng(seed)
    x = random_representable(rng, (2, 8, 64))
    packed, scale = mxfp4.quantize(x)
    assert packed.dtype == scale.dtype == np.uint8
    assert packed.shape == (2, 8, 32) and scale.shape == (2, 8, 2)
    assert_bits_equal(mxfp4.dequantize_np(packed, scale), x)
    assert_bits_equal(mxfp4.dequantize(packed, scale, jnp.float32), x)
    assert scale.reshape(-1)[3] == 0  # all-zero group takes the smallest scale byte


@pytest.mark.parametrize("seed", range(4))
def test_quantize_nearest_and_minimal_scale(seed):
    rng = np.random.default_rng(100 + seed)
    mag_exp = rng.integers(-150, 120, (64, 1))  # includes float32 subnormal inputs
    x = (rng.standard_normal((64, 64)) * np.exp2(mag_exp)).astype(np.float32)
    packed, scale = mxfp4.quantize(x)
    dq = mxfp4.dequantize_np(packed, scale).astype(np.float64)
    x64 = x.astype(np.float64)
    unit = np.exp2(scale.astype(np.float64) - 127)  # 2^(s-127) per group
    amax = np.abs(x64).reshape(64, 2, 32).max(-1)
    assert (amax <= 6 * unit).all()
    assert ((scale == 0) | (amax > 3 * unit)).all()  # s - 1 would not fit: 6 * 2^(s-128) < amax
    unit_el = np.repeat(unit, 32, axis=-1)
    err = np.abs(dq - x64)
    y = np.abs(x64) / unit_el
    step = np.where(y < 2, 0.5, np.where(y < 4, 1.0, 2.0))  # E2M1 spacing in each binade
    assert (err <= 0.5 * step * unit_el).all()
    grid = np.array(MAGS)[None, None, :] * unit_el[..., None]
    best = np.min(np.abs(np.abs(x64)[..., None] - grid), axis=-1)
    assert np.array_equal(err, best)  # nearest grid point, not merely within the bound
    assert (np.signbit(dq) == np.signbit(x64)).all()
    assert (err > 0).any()  # the data really was not representable


def test_quantize_ties_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = np.zeros(32, np.float32)
    x[0] = 6.0  # pins the scale byte to 127
    x[1:8], x[8:15] = ties, np.negative(ties)
    packed, scale = mxfp4.quantize(x[None])
    assert scale[0, 0] == 127
    dq = mxfp4.dequantize_np(packed, scale)[0]
    np.testing.assert_array_equal(dq[1:8], want)
    np.testing.assert_array_equal(dq[8:15], np.negative(want))


def test_quantize_errors():
    with pytest.raises(MXFP4Error, match="w_bad"):
        mxfp4.quantize(np.zeros((2, 48)), name="w_bad")
    x = np.zeros((2, 32), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(MXFP4Error, match=r"\(1, 5\)"):
        mxfp4.quantize(x)


@pytest.mark.parametrize("packed_shape, scale_shape, logical", [
    ((4, 16), (4, 2), None),  # scale: in = 32 has 1 group
    ((4, 24), (4, 1), None),  # in = 48 not divisible by 32
    ((16,), (1,), None),  # no out axis
    ((2, 4, 16), (4, 1), None),  # rank mismatch
    ((3, 4, 16), (2, 4, 1), None),  # leading dims differ
    ((4, 16), (4, 1), (4, 64)),  # logical in mismatch
    ((4, 16), (4, 1), (5, 32)),  # logical out mismatch
    ((4, 16), (4, 1), (4, 33)),  # logical in not divisible
])
def test_check_shapes_errors(packed_shape, scale_shape, logical):
    with pytest.raises(MXFP4Error, match=r"layers\.3\.mlp\.experts\.w2") as info:
        mxfp4.check_shapes("layers.3.mlp.experts.w2", packed_shape, scale_shape, logical)
    msg = str(info.value)
    assert "expected" in msg and "got" in msg
    got = [str(logical)] if logical and logical[-1] % 32 else [str(packed_shape), str(scale_shape)]
    assert all(g in msg for g in got), msg


def test_check_shapes_ok_and_dtypes():
    assert mxfp4.check_shapes("w", (3, 4, 16), (3, 4, 1)) == (3, 4, 32)
    assert mxfp4.check_shapes("w", (3, 4, 16), (3, 4, 1), logical_shape=(3, 4, 32)) == (3, 4, 32)
    packed, scale = np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.uint8)
    mxfp4.check_dtypes("w", packed, scale)
    with pytest.raises(MXFP4Error, match=r"w_packed.*packed.*int8"):
        mxfp4.check_dtypes("w_packed", packed.view(np.int8), scale)
    with pytest.raises(MXFP4Error, match=r"w_scale.*scale.*float32"):
        mxfp4.dequantize(packed, scale.astype(np.float32), name="w_scale")
    with pytest.raises(MXFP4Error, match="w_shape"):
        mxfp4.dequantize(packed, np.zeros((4, 2), np.uint8), name="w_shape")


def test_check_scales():
    scale = np.full((2, 3, 4), 127, np.uint8)
    mxfp4.check_scales("fine", scale)
    scale[1, 2, 3] = scale[1, 0, 1] = 255
    with pytest.raises(MXFP4Error, match=r"blk\.7\.scale.*\(1, 0, 1\)"):
        mxfp4.check_scales("blk.7.scale", scale)


def test_check_scales_reports_position_in_the_whole_tensor():
    block = np.full((3, 4), 127, np.uint8)
    block[2, 1] = 255
    with pytest.raises(MXFP4Error, match=r"w2\.weight_scale.*\(10, 5\)"):
        mxfp4.check_scales("w2.weight_scale", block, offset=(8, 4))
