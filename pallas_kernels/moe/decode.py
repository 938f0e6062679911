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

`decode_fast` gets the same bits with fewer integer operations (see its docstring); `decode_asm` with
fewer still, in PTX (GPU only; see its docstring); `decode_asm1` with fewer again, exact for scale bytes up
to 128 only (GPU only; a kernel program uses it when all its scale bytes allow it: `Decoder`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

GROUP = 32  # elements per scale byte
_BIAS = 0x3E80 - (127 << 7)  # 0x3F00 - 2 * 0x40, minus the E8M0 bias in the bf16 exponent field


def per_column(per_group: jax.Array, width: int) -> jax.Array:
    """[r, groups] -> [r, width]: each group's value (computed once per scale byte) repeated over its
    width/groups columns (width c gives it per element, c/2 per packed byte)."""
    rows, groups = per_group.shape
    return jnp.broadcast_to(per_group[:, :, None], (rows, groups, width // groups)).reshape(rows, width)


def exponent_offsets(scale: jax.Array, width: int) -> jax.Array:
    """scale uint8 [r, groups] -> int32 [r, width]: what each column's scale adds to the bf16 bits."""
    return per_column((scale.astype(jnp.int32) << 7) + _BIAS, width)


def decode_bits(nib: jax.Array, offset: jax.Array) -> jax.Array:
    """int32 nibbles and exponent offsets (same shape) -> the bf16 bit patterns as int32."""
    em = nib & 7
    mag = ((em + jnp.minimum(em, 2)) << 6) + offset
    mag = jnp.where(em == 0, 0, jnp.clip(mag, 0x40, 0x7F80))
    return mag | ((nib & 8) << 12)


def interleave(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The low- and high-nibble halves [r, c/2] -> [r, c] in element order (2j from lo, 2j + 1 from hi)."""
    rows, half = lo.shape
    return jnp.stack([lo, hi], axis=-1).reshape(rows, 2 * half)


def _bf16(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def decode_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """packed uint8 [r, c/2], scale uint8 [r, c/32] -> bf16 (even elements, odd elements), each [r, c/2]:
    the low and high nibbles of every byte, with no interleave (see kernels.py, `Tiles.split`)."""
    p = packed.astype(jnp.int32)
    offset = exponent_offsets(scale, packed.shape[-1])  # per byte: both nibbles share the group's scale
    return _bf16(decode_bits(p & 0xF, offset)), _bf16(decode_bits(p >> 4, offset))


def decode(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """packed uint8 [r, c/2], scale uint8 [r, c/32] -> bf16 [r, c] (values already in registers)."""
    return interleave(*decode_halves(packed, scale))


def _fp16_pairs(p: jax.Array) -> jax.Array:
    """uint32 packed bytes -> per byte two fp16 bit patterns in one word: low half the low nibble's,
    high half the high nibble's, each sign << 15 | em << 9. Two multiplies place shifted copies of the
    byte that never overlap (so no carries): 2^9 and 2^21 put the em bits at 9-11 and 25-27, 2^12 and
    2^24 the sign bits at 15 and 31."""
    u = lambda c: jnp.uint32(c)  # Python ints would be taken as int32 (0x80008000 does not fit)
    return ((p * u(0x00200200)) & u(0x0E000E00)) | ((p * u(0x01001000)) & u(0x80008000))


def decode_fast(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """`decode_fast_halves` interleaved into element order: the same bits as `decode`."""
    return interleave(*decode_fast_halves(packed, scale))


def decode_fast_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Same bits as `decode_halves` (scale bytes 1..254), fewer integer operations, and exact under any
    denormal mode (XLA on the CPU flushes subnormal inputs and results of float arithmetic).

    E2M1 s e1 e0 m written as sign << 15 | em << 9 is the fp16 of value * 2^-14: fp16's subnormals
    (e = 0) line up with E2M1's, and the conversion to fp32 is exact and normalises them, so no float
    operation ever sees a subnormal input. Then (x * 2^14) * 2^(s - 127), with the group factor built
    once per group from its bits (s << 23): the first product is the E2M1 value (0.5 .. 6), the second
    is exact, +-inf at 2^128 and beyond as `mxfp4.dequantize` gives. One result is subnormal: 0.5 *
    2^-126 (code 1, byte 1), which a flushing backend turns into +-0; for byte 1 each element ORs its
    m bit into fp32 bit 22, which restores it and changes nothing else (a normal result's bit 22 is
    m already). Byte 0 gives +-0 for every code (exact for the all-zero groups the release stores);
    byte 255 gives +-inf and NaN for code 0 (refused on load)."""
    half = packed.shape[-1]
    w = _fp16_pairs(packed.astype(jnp.uint32))  # [r, c/2]
    s = scale.astype(jnp.uint32)
    factor = per_column(jax.lax.bitcast_convert_type(s << 23, jnp.float32), half)
    fix = per_column(jnp.where(s == 1, jnp.uint32(0x00400000), jnp.uint32(0)), half)

    def one(h16, m22):  # fp16 bits (uint16), the element's m at bit 22 of m22 -> bf16
        e2m1 = jax.lax.bitcast_convert_type(h16, jnp.float16) * jnp.float16(2.0 ** 14)  # exact, in fp16
        y = e2m1.astype(jnp.float32) * factor
        y = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(y, jnp.uint32) | (m22 & fix),
                                         jnp.float32)
        return y.astype(jnp.bfloat16)

    lo = one(w.astype(jnp.uint16), w << 13)  # m of the low nibble: bit 9 -> 22
    hi = one((w >> 16).astype(jnp.uint16), w >> 3)  # m of the high nibble: bit 25 -> 22
    return lo, hi


# One instance per 4 packed bytes q = b0..b3 ($4): $0-$3 are bytes 0-3's two elements as bf16x2 (low
# nibble's element in the low half), $5-$8 and $9-$12 each byte's two factors as bf16x2. A nibble s e1 e0 m
# at bits 12-15 (or 28-31) of a word w becomes the bf16 bits s << 15 | e1 e0 m << 6 by (w & 0x8000) |
# (w & 0x7000) >> 6, in both halves at once: the bf16 of value * 2^-126 (E2M1's subnormal 0.5 lands on
# bf16's subnormal 2^-127). q, q << 4, q << 8, q << 12 bring (hi1, hi3), (lo1, lo3), (hi0, hi2), (lo0, lo2)
# there; prmt regroups them by byte; two exact bf16x2 multiplies (fma with -0, which keeps zeros' signs)
# scale by 2^(s - 1). 32-bit results: Triton's unpacking of 16-bit results packed in pairs put elements
# out of order on the H200 (jax 0.11.2, 2026-12-02), its unpacking of 32-bit ones is one value per element.
def _place(dst: str, shift: int) -> str:
    return (f"shl.b32 w, $4, {shift}; and.b32 t, w, 0x70007000; shr.b32 t, t, 6; and.b32 m, w, 0x80008000; "
            f"or.b32 {dst}, t, m; ")


_ASM = ("{ .reg .b32 w, t, m, a, b, c, d, z; mov.b32 z, 0x80008000; "
        + _place("a", 0) + _place("b", 4) + _place("c", 8) + _place("d", 12)
        + "prmt.b32 $0, d, c, 0x5410; prmt.b32 $1, b, a, 0x5410; prmt.b32 $2, d, c, 0x7632; "
          "prmt.b32 $3, b, a, 0x7632; "
        + "".join(f"fma.rn.bf16x2 ${k}, ${k}, ${5 + k}, z; fma.rn.bf16x2 ${k}, ${k}, ${9 + k}, z; "
                  for k in range(4))
        + "}")
ASM_PACK = 4  # bytes per asm instance: a thread must hold a multiple of 4 of the packed tile's bytes


def _factor_word(e: jax.Array, half: int) -> jax.Array:
    """bf16 exponent fields e uint32 [r, c/32] -> the bf16x2 word of 2^(e - 127) in both halves, per packed
    byte [r, c/2] (the asm decoders' factor arguments)."""
    return per_column((e << 7) | (e << 23), half)


def asm_factors(scale: jax.Array, half: int) -> tuple[jax.Array, jax.Array]:
    """scale uint8 [r, c/32] -> _ASM's two factor arguments per packed byte [r, c/2]: the bf16x2 words of
    2^(min(s, 128) - 1) and 2^(max(s, 128) - 128)."""
    s = scale.astype(jnp.uint32)
    return (_factor_word(jnp.minimum(s, jnp.uint32(128)) + jnp.uint32(126), half),
            _factor_word(jnp.maximum(s, jnp.uint32(128)) - jnp.uint32(1), half))


def decode_asm_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Same bits as `decode_halves` for scale bytes 1..254, in about 4 instructions per element (PTX through
    `pltriton.elementwise_inline_asm`; compiled for the GPU only, no interpreter). Each byte's nibbles are
    placed as the bf16 of value * 2^-126 (exact, zeros and E2M1's subnormal included), then multiplied by
    2^(min(s, 128) - 1) and by 2^(max(s, 128) - 128): both factors are bf16 numbers and both products exact
    (+-inf from 2^128 on, as `mxfp4.dequantize`). Byte 0 gives the exact values times 2^-127 (the other
    decoders round its subnormal results); byte 255 gives +-inf and zeros (refused on load)."""
    rows, half = packed.shape
    pairs = pltriton.elementwise_inline_asm(
        _ASM, args=[packed, *asm_factors(scale, half)], constraints="=r,=r,=r,=r," + ",".join(["r"] * 9),
        pack=ASM_PACK,
        result_shape_dtypes=[jax.ShapeDtypeStruct((rows, half), jnp.int32)])[0]  # signless i32 (ui32 is refused)
    return _bf16(pairs), _bf16(jax.lax.shift_right_logical(pairs, 16))  # _bf16 keeps the low 16 bits


def decode_asm(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """`decode_asm_halves` in element order (GPU only)."""
    return interleave(*decode_asm_halves(packed, scale))


def reinterpret_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NOT a decode: the same bytes turned into bf16 with the fewest operations (wrong values). Only for
    the benchmark's diagnostic run that separates the cost of reading bytes from the cost of decoding."""
    p = packed.astype(jnp.int32)
    offset = exponent_offsets(scale, packed.shape[-1])
    return _bf16(((p & 0xF) << 6) + offset), _bf16(((p >> 4) << 6) + offset)


def reinterpret(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """`reinterpret_halves` in element order (the diagnostic; wrong values)."""
    return interleave(*reinterpret_halves(packed, scale))


# "asm1": one multiply where the scale allows it. For scale bytes s <= 128 the factor 2^(s - 1) is itself a
# bf16 number, so value * 2^-126 * 2^(s - 1) is one exact bf16x2 multiply. Each byte's word is assembled in
# place: a = q << 4 puts every byte's low nibble where its high nibble is, and prmt takes byte k of a (low
# nibble) into byte 1 and byte k of q (high nibble) into byte 3, so the placement needs no regrouping. Per 4
# bytes: 1 shift and 4 x (prmt, 2 ands, shift, or, multiply), against 4 placements, 4 prmt and 8 multiplies
# in _ASM (15% fewer instructions in the gate+up kernel at 16 tokens, Nsight Compute on the H200, 2026-12-02).
def _word(k: int) -> str:
    sel = 0x4400 + 0x1111 * k  # d.byte0, byte1 <- a.byte k; d.byte2, byte3 <- q.byte k (prmt bytes 4-7 are q's)
    return (f"prmt.b32 w, a, $4, {sel:#x}; and.b32 t, w, 0x70007000; shr.b32 t, t, 6; and.b32 m, w, 0x80008000; "
            f"or.b32 w, t, m; fma.rn.bf16x2 ${k}, w, ${5 + k}, z; ")


_ASM1 = ("{ .reg .b32 a, w, t, m, z; mov.b32 z, 0x80008000; shl.b32 a, $4, 4; "
         + "".join(_word(k) for k in range(4)) + "}")
QUICK_MAX_SCALE = 128  # the largest scale byte for which _ASM1 is exact (2^(s - 1) <= 2^127)


def asm1_factor(scale: jax.Array, half: int) -> jax.Array:
    """scale uint8 [r, c/32] -> _ASM1's factor argument per packed byte [r, c/2]: the bf16x2 word of 2^(s - 1)
    (a bf16 number for s <= QUICK_MAX_SCALE only)."""
    return _factor_word(scale.astype(jnp.uint32) + jnp.uint32(126), half)


def decode_asm1_halves(packed: jax.Array, scale: jax.Array, asm: str = _ASM1) -> tuple[jax.Array, jax.Array]:
    """Same bits as `decode_asm_halves` for scale bytes up to QUICK_MAX_SCALE, with one multiply and no
    regrouping (see _ASM1; asm may be _ASM1R, the same bits in another order); wrong above it. Kernels use it
    only for a program whose scale bytes all allow it (`Decoder.quick`). GPU only."""
    rows, half = packed.shape
    pairs = pltriton.elementwise_inline_asm(
        asm, args=[packed, asm1_factor(scale, half)], constraints="=r,=r,=r,=r," + ",".join(["r"] * 5),
        pack=ASM_PACK, result_shape_dtypes=[jax.ShapeDtypeStruct((rows, half), jnp.int32)])[0]
    return _bf16(pairs), _bf16(jax.lax.shift_right_logical(pairs, 16))


def decode_asm1(packed: jax.Array, scale: jax.Array, asm: str = _ASM1) -> jax.Array:
    """`decode_asm1_halves` in element order (GPU only; scale bytes <= QUICK_MAX_SCALE)."""
    return interleave(*decode_asm1_halves(packed, scale, asm))


# "asm1r": _ASM1 without the prmt. The shifted copies q, q << 4, q << 8 and q << 12 bring the nibble pairs
# (hi1, hi3), (lo1, lo3), (hi0, hi2) and (lo0, lo2) to bits 12-15 and 28-31, each then placed and scaled as in
# _ASM1: per 4 bytes 3 shifts and 4 x (2 ands, shift, or, multiply). The results come in a fixed order within
# every 8 elements, R_PERM: position 8w + p holds element 8w + R_PERM[p]. The kernels take the activation's
# columns in that order (`Decoder.perm8`), and gate+up writes h in it for down.
def _place_r(dst: str, src: str, factor: str) -> str:
    return (f"and.b32 t, {src}, 0x70007000; shr.b32 t, t, 6; and.b32 m, {src}, 0x80008000; or.b32 t, t, m; "
            f"fma.rn.bf16x2 {dst}, t, {factor}, z; ")


def asm1r_body(word: str, factors) -> str:
    """_ASM1R's instructions on the packed word `word` with the four results' factor operands `factors`
    (registers t, m, a, b, c and z declared by the caller; z = 0x80008000): $0-$3 get (hi1, hi3), (lo1, lo3),
    (hi0, hi2), (lo0, lo2) of bytes 0-3 (Mosaic GPU's words decode uses it too, `wgmma_mxfp4.word_steps`)."""
    return (f"shl.b32 a, {word}, 4; shl.b32 b, {word}, 8; shl.b32 c, {word}, 12; "
            + "".join(_place_r(f"${k}", src, f) for k, (src, f) in enumerate(zip((word, "a", "b", "c"), factors))))


_ASM1R = "{ .reg .b32 a, b, c, t, m, z; mov.b32 z, 0x80008000; " + asm1r_body("$4", ("$5", "$6", "$7", "$8")) + "}"
R_PERM = (3, 7, 2, 6, 1, 5, 0, 4)


def decode_asm1r(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """_ASM1R's decode [r, c], in R_PERM order within every 8 elements (GPU only; scale bytes up to
    QUICK_MAX_SCALE, wrong above)."""
    return decode_asm1(packed, scale, _ASM1R)


def _fast_capped_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The interpreter's stand-in for `decode_asm1_halves`: "fast" with scale bytes above QUICK_MAX_SCALE
    taken as QUICK_MAX_SCALE, so the same bits where _ASM1 is exact and wrong values where it is wrong: the
    CPU suite's wide-scale cases fail if a kernel uses the quick decoder where it must not."""
    return decode_fast_halves(packed, jnp.minimum(scale, jnp.uint8(QUICK_MAX_SCALE)))


def _fast_capped(packed: jax.Array, scale: jax.Array) -> jax.Array:
    return interleave(*_fast_capped_halves(packed, scale))


def permute8(a: jax.Array, perm8) -> jax.Array:
    """[..., K] -> [..., K] with position 8w + p taken from 8w + perm8[p] (a decoder's `perm8` order)."""
    *lead, k = a.shape
    v = a.reshape(*lead, k // 8, 8)
    return jnp.stack([v[..., p] for p in perm8], axis=-1).reshape(*lead, k)  # static slices: no constants


def _fast_capped_r(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """The interpreter's stand-in for `decode_asm1r`: `_fast_capped`'s values in the same R_PERM order."""
    return permute8(_fast_capped(packed, scale), R_PERM)


class Decoder(NamedTuple):
    """An in-register decode: into element order [r, c] (`full`) and into (even, odd) halves [r, c/2] each;
    optionally a quicker decoder, exact only for scale bytes up to quick_max, which a kernel program runs
    in place of this one when all of its weight rows' scale bytes allow it (one decision per program)."""
    full: Callable
    halves: Callable
    quick: "Decoder | None" = None
    quick_max: int = 0
    perm8: tuple | None = None  # `full` puts element 8w + perm8[p] at position 8w + p (None: element order)


DECODERS = {"exact": Decoder(decode, decode_halves), "fast": Decoder(decode_fast, decode_fast_halves),
            "asm": Decoder(decode_asm, decode_asm_halves),
            "asm1": Decoder(decode_asm, decode_asm_halves, Decoder(decode_asm1, decode_asm1_halves), QUICK_MAX_SCALE),
            "fast1": Decoder(decode_fast, decode_fast_halves, Decoder(_fast_capped, _fast_capped_halves),
                             QUICK_MAX_SCALE),
            "reinterpret": Decoder(reinterpret, reinterpret_halves)}
# Quick decoders alone (no per-program choice): for weights whose scale bytes are all <= QUICK_MAX_SCALE (the
# caller's promise; wrong values past it). The R_PERM ones have no halves: split tiles take UNCHECKED_HALVES.
DECODERS.update({"asm1-unchecked": DECODERS["asm1"].quick, "fast1-unchecked": DECODERS["fast1"].quick,
                 "asm1r-unchecked": Decoder(decode_asm1r, None, perm8=R_PERM),
                 "fast1r-unchecked": Decoder(_fast_capped_r, None, perm8=R_PERM)})
# A decoder with a quick one, and the unchecked decoder that replaces it when the caller knows every scale byte
# is <= its quick_max (`routed.decoder_for`).
UNCHECKED = {"asm1": "asm1r-unchecked", "fast1": "fast1-unchecked"}
UNCHECKED_HALVES = {"asm1": "asm1-unchecked", "fast1": "fast1-unchecked"}  # the same, for split tiles
# Decoders that only compile for the GPU, and the decoder with the same bits (in the same order) that stands
# in for them in the interpreter (and for tiles too small for their packing).
GPU_ONLY = {"asm": "fast", "asm1": "fast1", "asm1-unchecked": "fast1-unchecked", "asm1r-unchecked": "fast1r-unchecked"}
