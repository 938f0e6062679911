"""MXFP4 -> bf16 inside a kernel, with integer bit operations only (no float4 dtype: its casts are
Blackwell-only on the GPU). Layout as released (kimik3_jax/mxfp4.py): byte j of a row holds element 2j
in its low nibble and 2j+1 in its high nibble; one E8M0 scale byte s per 32 elements means 2^(s-127).

A nibble is sign (bit 3) and em = exponent-mantissa (bits 0-2), magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
Their bf16 bit patterns are 0 and 0x3F00 + 0x40 * q with q = 0, 2, 3, 4, 5, 6, 7 for em = 1..7, that
is q = em + min(em, 2) - 2. The scale is an add to the exponent field ((s - 127) << 7), and a clamp
makes the ends exact: results of 2^128 or more become inf (0x7F80), as `mxfp4.dequantize` gives, and the
only subnormal result of a scale byte >= 1 (0.5 * 2^-126, em = 1 with s = 1) comes out as its exact bit
pattern 0x40. Exact for every nibble and scale bytes 1..254; byte 0 is exact for zero groups (how the
release uses it), while its subnormal values 0.5 and 1.5 * 2^-127 round to 2^-127. Byte 255 (E8M0
NaN) is refused when weights are loaded (`mxfp4.check_scales`); here it decodes as inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 32  # elements per scale byte
_BIAS = 0x3E80 - (127 << 7)  # 0x3F00 - 2 * 0x40, minus the E8M0 bias in the bf16 exponent field


def exponent_offsets(scale: jax.Array, width: int) -> jax.Array:
    """scale uint8 [r, c/32] -> int32 [r, c]: what each element's scale adds to its bf16 bits
    (the group's value computed once, then repeated over its 32 elements)."""
    rows, groups = scale.shape
    c = (scale.astype(jnp.int32) << 7) + _BIAS
    return jnp.broadcast_to(c[:, :, None], (rows, groups, width // groups)).reshape(rows, width)


def nibbles(packed: jax.Array) -> jax.Array:
    """packed uint8 [r, c/2] -> int32 [r, c] nibbles in element order (low nibble first)."""
    rows, half = packed.shape
    p = packed.astype(jnp.int32)
    return jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(rows, 2 * half)


def decode_bits(nib: jax.Array, offset: jax.Array) -> jax.Array:
    """int32 nibbles and exponent offsets (same shape) -> the bf16 bit patterns as int32."""
    em = nib & 7
    mag = ((em + jnp.minimum(em, 2)) << 6) + offset
    mag = jnp.where(em == 0, 0, jnp.clip(mag, 0x40, 0x7F80))
    return mag | ((nib & 8) << 12)


def decode(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """packed uint8 [r, c/2], scale uint8 [r, c/32] -> bf16 [r, c] (values already in registers)."""
    nib = nibbles(packed)
    bits = decode_bits(nib, exponent_offsets(scale, nib.shape[-1]))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def reinterpret(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """NOT a decode: the same bytes turned into bf16 with the fewest operations (wrong values). Only for
    the benchmark's diagnostic run that separates the cost of reading bytes from the cost of decoding."""
    nib = nibbles(packed)
    bits = (nib << 6) + exponent_offsets(scale, nib.shape[-1])
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)
