"""MXFP4 weights as stored by compressed-tensors (`mxfp4-pack-quantized`).

A weight W[out, in] (optionally with leading dims, e.g. [layers, experts, out, in]) is split into
groups of GROUP_SIZE = 32 consecutive elements along the input (last) axis of each row.

* `weight_packed [..., out, in/2]` uint8: byte j holds element 2j in bits 0-3 (low nibble) and
  element 2j+1 in bits 4-7. (ggml pairs element j with j+16 instead; that layout is NOT this one.)
* Each nibble is E2M1: bit 3 is the sign, bits 0-2 index the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
* `weight_scale [..., out, in/32]` uint8, E8M0: the group's factor is 2^(byte - 127). Byte 255 is
  NaN in the OCP MX spec; `check_scales` rejects it, `dequantize` turns such a group into NaN.

Decoding uses integer bit operations only (no float4 dtypes, no float multiply): the float32 bit
pattern of the E2M1 value from a 16-entry table gets the scale exponent added to its exponent
field. This is exact on every backend, including the subnormal results of scale bytes 0 and 1
(e.g. 0.5 * 2^-127): XLA CPU flushes subnormal *products* of a float multiply to zero, so the
obvious `table[n] * 2^(s-127)` would not be. Results of 2^128 or more (possible only for scale
bytes 253 and 254) become +-inf, as an IEEE float32 multiply would give.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kimik3_jax.errors import MXFP4Error

GROUP_SIZE = 32
_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_VALUES = np.concatenate([_MAGNITUDES, -_MAGNITUDES])  # indexed by nibble; nibble 8 is -0.0
_E2M1_BITS = E2M1_VALUES.view(np.uint32)
_MIDPOINTS = (_MAGNITUDES[:-1] + _MAGNITUDES[1:]) / 2  # 0.25, 0.75, ..., 5.0: the rounding ties


def check_shapes(name, packed_shape, scale_shape, logical_shape=None, group_size=GROUP_SIZE):
    """Raise MXFP4Error unless packed is [..., out, in/2] and scale [..., out, in/group_size].

    With `logical_shape` ([..., out, in]) both are compared with what it implies. Returns the
    logical shape.
    """
    packed_shape, scale_shape = tuple(packed_shape), tuple(scale_shape)
    got = f"got packed {packed_shape} and scale {scale_shape}"
    if logical_shape is not None:
        logical_shape = tuple(logical_shape)
        n_in = logical_shape[-1] if logical_shape else 0
        if len(logical_shape) < 2 or n_in % group_size:
            raise MXFP4Error(f"{name}: expected logical shape [..., out, in] with in divisible "
                             f"by {group_size}, got {logical_shape}")
        want = (logical_shape[:-1] + (n_in // 2,), logical_shape[:-1] + (n_in // group_size,))
        if (packed_shape, scale_shape) != want:
            raise MXFP4Error(f"{name}: for logical shape {logical_shape} expected packed {want[0]} "
                             f"and scale {want[1]}, {got}")
        return logical_shape
    if len(packed_shape) < 2 or len(scale_shape) != len(packed_shape):
        raise MXFP4Error(f"{name}: expected packed [..., out, in/2] and scale [..., out, "
                         f"in/{group_size}] of equal rank >= 2, {got}")
    n_in = 2 * packed_shape[-1]
    if n_in % group_size:
        raise MXFP4Error(f"{name}: expected in = 2 * packed.shape[-1] divisible by {group_size}, "
                         f"got in = {n_in} ({got})")
    want_scale = packed_shape[:-1] + (n_in // group_size,)
    if scale_shape != want_scale:
        raise MXFP4Error(f"{name}: expected scale {want_scale} for packed {packed_shape}, {got}")
    return packed_shape[:-1] + (n_in,)


def check_dtypes(name, packed, scale):
    """Raise MXFP4Error unless both packed and scale (arrays or tracers) are uint8."""
    for what, arr in (("packed", packed), ("scale", scale)):
        if np.dtype(arr.dtype) != np.uint8:
            raise MXFP4Error(f"{name}: {what} dtype: expected uint8, got {np.dtype(arr.dtype)}")


def check_scales(name, scale, offset=()):
    """Raise MXFP4Error naming the first position of a scale byte 255 (NaN in E8M0), if any.
    `offset` is where `scale` starts inside the whole tensor when it is a slice of it."""
    scale = np.asarray(scale)
    bad = np.argwhere(scale == 255)
    if len(bad):
        start = tuple(offset) + (0,) * (scale.ndim - len(offset))
        pos = tuple(int(i) + o for i, o in zip(bad[0], start))
        raise MXFP4Error(f"{name}: scale byte 255 (E8M0 NaN) at index {pos} "
                         f"({len(bad)} such byte(s) in the {scale.shape} block read)")


def _unpack(xp, packed):
    nib = xp.stack([packed & 0xF, packed >> 4], axis=-1)  # element 2j low nibble, 2j+1 high
    return nib.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def unpack_nibbles(packed):
    """[..., in/2] uint8 -> [..., in] uint8 nibbles (0..15) in element order."""
    return _unpack(jnp, jnp.asarray(packed))


def _decode_bits(xp, packed, scale):
    """float32 bit patterns (uint32 [..., out, in]) of the decoded values; xp is np or jnp."""
    tb = xp.asarray(_E2M1_BITS)[_unpack(xp, packed)]
    grp = tb.reshape(scale.shape + (-1,))  # [..., out, in/32, 32]
    s = scale.astype(xp.int32)[..., None]
    sign = grp & np.uint32(0x80000000)
    mag = grp & np.uint32(0x7FFFFFFF)
    frac = mag & np.uint32(0x7FFFFF)
    e = (mag >> 23).astype(xp.int32) + s - 127  # exponent field of the result
    normal = sign | (xp.clip(e, 1, 254).astype(xp.uint32) << 23) | frac
    subnormal = sign | ((frac | np.uint32(0x800000)) >> xp.clip(1 - e, 0, 31).astype(xp.uint32))
    bits = xp.where(e >= 255, sign | np.uint32(0x7F800000), xp.where(e >= 1, normal, subnormal))
    bits = xp.where(mag == 0, sign, bits)
    bits = xp.where(s == 255, np.uint32(0x7FC00000), bits)
    return bits.reshape(tb.shape)


def _cast(bits, dtype, bitcast):
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
        # Exact: decoded values have at most 2 significant bits, so the low 16 bits are zero.
        return bitcast((bits >> 16).astype(np.uint16), ml_dtypes.bfloat16)
    return bitcast(bits, np.float32).astype(dtype)


def dequantize(packed, scale, dtype=jnp.bfloat16, name="weight"):
    """jax: packed [..., out, in/2], scale [..., out, in/32] (uint8) -> [..., out, in] of dtype."""
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    check_dtypes(name, packed, scale)
    check_shapes(name, packed.shape, scale.shape)
    return _cast(_decode_bits(jnp, packed, scale), dtype, jax.lax.bitcast_convert_type)


def dequantize_np(packed, scale, dtype=np.float32, name="weight"):
    """NumPy twin of `dequantize` for host-side tools; raises on scale byte 255."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    check_dtypes(name, packed, scale)
    check_shapes(name, packed.shape, scale.shape)
    check_scales(name, scale)
    return _cast(_decode_bits(np, packed, scale), dtype, lambda a, t: a.view(t))


def quantize(w, group_size=GROUP_SIZE, name="weight"):
    """NumPy: w [..., in] -> (packed uint8 [..., in/2], scale uint8 [..., in/group_size]).

    Per group the scale byte s is the smallest in 0..254 with max|x| <= 6 * 2^(s-127) (0 for an
    all-zero group). Each x / 2^(s-127) is rounded to the nearest E2M1 value, ties to the even
    code (like IEEE round-half-even: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4);
    the sign of x (also of -0.0 and of values rounding to 0) is kept. Magnitudes above 6 * 2^127
    saturate. Data that is E2M1 times 2^(s-127) per group round-trips exactly.
    """
    w = np.asarray(w, dtype=np.float64)  # exact for float32 / bfloat16 input
    if w.ndim < 1 or w.shape[-1] % group_size:
        raise MXFP4Error(f"{name}: last dim of shape {w.shape} must be divisible by {group_size}")
    if not np.all(np.isfinite(w)):
        pos = tuple(int(i) for i in np.argwhere(~np.isfinite(w))[0])
        raise MXFP4Error(f"{name}: cannot quantize non-finite value at index {pos}")
    g = w.reshape(w.shape[:-1] + (-1, group_size))
    amax = np.max(np.abs(g), axis=-1)
    m, e = np.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): amax <= 6 * 2^(e-3) iff m <= 0.75
    s = np.where(amax == 0, 0, np.clip(e - 3 + (m > 0.75) + 127, 0, 254))
    y = np.minimum(np.abs(g) / np.ldexp(1.0, s - 127)[..., None], 6.0)
    lo = np.searchsorted(_MIDPOINTS, y, side="left")  # y == midpoint k: lo = k, hi = k + 1
    hi = np.searchsorted(_MIDPOINTS, y, side="right")
    code = np.where((lo == hi) | (lo % 2 == 0), lo, hi)
    nib = (code | (np.signbit(g) << 3)).astype(np.uint8).reshape(w.shape)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed.astype(np.uint8), s.astype(np.uint8)
