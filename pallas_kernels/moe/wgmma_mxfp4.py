"""The MXFP4 x bf16 expert GEMM (issue 7; right on the H100 and the H200, docs/benchmarks.md, seventeenth and
eighteenth sessions) on Pallas' Mosaic GPU backend,
warp-specialised, the design docs/benchmarks.md ("Still to run", the MoE prefill item) asks for. The Triton
kernels decode a weight tile in registers and then wait on every wgmma, so decoding never overlaps the
tensor cores; here a memory warpgroup streams the packed weights, the scales and the activations into a ring
of shared-memory stages by TMA while the compute warpgroups (two by default) decode and issue wgmma.

out[N, T] = W[N, K] @ x[T, K]^T, with W stored as MXFP4: `packed` [N, K/2] uint8 (low nibble = k even, high
nibble = k odd, as the release stores it) and `scales_t` [K/32, N] uint8 E8M0 (the release's [N, K/32],
transposed: a TMA copy needs 16 bytes along the last dimension, and a row of N bytes gives each step its
scales for 128 output rows; a [rows, 16] box of the release's layout would need a column read of shared
memory, which jax 0.11.2's Mosaic GPU layout inference refuses: docs/benchmarks.md, twenty-sixth session).

How the decode avoids any register shuffles (offline lowering on jax 0.10.2, 2026-12-05):
- K is split into its even and odd halves ("planes"): a GEMM is unchanged when one permutation of K is
  applied to both operands, so W's low nibbles meet x's even columns and the high nibbles the odd ones.
  Each plane is an elementwise op on the packed bytes; `x_planes` ([2, K/2, T] bf16) is x's even and odd
  columns, transposed, made once by XLA (or `token_planes`, [2, T, K/2], read through a transposed view).
- The weights are wgmma's A operand, in registers; the activation planes are B, in shared memory.
- Each wgmma takes 16 plane columns (32 k of the original order): exactly one E8M0 block, so the scale is
  one factor per output row, a row broadcast in the WGMMA layout. (A 128-byte swizzle would make each wgmma
  take 64 columns and need the scale broadcast per 16 columns; the activations use a 32-byte swizzle.)
- e2m1 to bf16 with integer ops: the sign to bit 15 and the three exponent/mantissa bits to bits 6-8 give
  the value times 2^-126 as a bf16 bit pattern (subnormals included), then two exact multiplies by powers of
  two: 2^126 and 2^(s - 127); or (`quick`, for scale bytes s <= 128 only, as the Triton kernels' quick
  decoder) one multiply by 2^(s - 1). The routed path takes the quick one when the weights' largest scale
  byte is known to allow it. `swar` makes the nibbles' bits two per 32-bit word in inlined Mosaic GPU code
  (16-bit lanes have no paired shifts). Both right on the GPU over scale bytes 0..128, subnormal products
  included; on the routed path at 16384 tokens quick + swar took 58.3 to 51.6 ms (H100; swar alone 1.17x on
  the H200), 2026-12-06.

`words` (2026-12-07) decodes instead with the Triton decoder's asm1r PTX on 32-bit words, each thread's word
giving exactly its registers of four wgmmas (no moves), the activations permuted to match (`word_order`): the
gate+up kernel 1-2% faster at prefill counts but the whole routed path no faster (thirty-fifth session), and at
decode counts slower than the Triton decode kernels (docs/benchmarks.md, thirty-fourth session).

Grouped over experts (`grouped_mxfp4_matmul_t`: each token tile's expert from the dispatch's table), it is the
prefill regime of `pallas_kernels/moe/routed_mgpu.py` (the default: `routed.PREFILL_KERNELS = "mgpu"`). The
transposed scales are 3% of the packed bytes, made per call for now.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm

from pallas_kernels.moe.decode import asm1r_body

ROWS_PER_WG = 64  # wgmma's M
SCALE_BLOCK = 32  # k per E8M0 scale
PLANE_STEP = SCALE_BLOCK // 2  # plane columns per wgmma: one scale block
X_TRANSFORMS = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
# The weight tile in shared memory as tiles of 8 rows x 16 bytes, so that each wgmma's [64, 16] slice is whole
# tiles: untiled, the register load of a 16-column slice finds no conflict-free transfer plan at 64 columns
# per stage, and a swizzled tiling (64 or 32 bytes wide) cannot be sliced by 16 (offline, jax 0.10.2).
W_TRANSFORMS = (plgpu.TilingTransform((8, 16)),)


def scale_bits(s):
    """E8M0 bytes (int16) -> the bf16 bit pattern of 2^(s - 127): s in the exponent field; bit 6 set for 0
    (bf16's subnormal 2^-127) and for 255 (a quiet NaN, as `kimik3_jax.mxfp4.dequantize` makes of it). One
    per output row and scale block, so its cost does not count."""
    return (s << 7) | (((s == 0) | (s == 255)).astype(s.dtype) << 6)


QUICK_MAX = 128  # the largest scale byte the quick decode takes: 2^(s - 1) is a finite bf16 up to s = 128


def quick_scale_bits(s):
    """E8M0 bytes 0..QUICK_MAX (int16) -> the bf16 bit pattern of 2^(s - 1), the quick decode's one factor
    (2^-126 from `e2m1_bits` times 2^(s - 1) = 2^(s - 127), byte 0 included). Bytes above QUICK_MAX give wrong
    values, unchecked: the caller knows the weights' largest byte (`Runtime.expert_scale_max`)."""
    return (s + 126) << 7


def e2m1_bits(nibbles):
    """e2m1 nibbles (int16, 0..15) -> the bf16 bit pattern of their value times 2^-126: the sign to bit 15,
    the two exponent bits and the mantissa bit to bits 6-8. Nibbles 1 and 9 (+-0.5) give bf16 subnormals."""
    return ((nibbles & 0x8) << 12) | ((nibbles & 0x7) << 6)


def spread_pair(x):
    """Two packed bytes b0 | b1 << 8 (32-bit lanes) -> b0 | b1 << 16: one byte per 16-bit half."""
    return (x & 0xFF) | ((x & 0xFF00) << 8)


def pair_planes(y):
    """Two bytes, one per 16-bit half of a 32-bit word (`spread_pair`) -> the bf16x2 bit patterns of their low
    and high nibbles (`e2m1_bits` of each, the value times 2^-126), two values per 32-bit operation: each mask
    keeps the bits that its shift moves within their own half."""
    lo = ((y & 0x00080008) << 12) | ((y & 0x00070007) << 6)
    hi = ((y & 0x00800080) << 8) | ((y & 0x00700070) << 2)
    return lo, hi


class _Word:
    """An i32 MLIR value with the integer operators `spread_pair` and `pair_planes` use (int operands become
    i32 constants), so that the kernel emits the same formulas the CPU tests run on NumPy words."""

    def __init__(self, value):
        self.value = value

    def _op(self, fn, other):
        i32 = ir.IntegerType.get_signless(32)
        return _Word(fn(self.value, other.value if isinstance(other, _Word) else arith.constant(i32, other)))

    def __and__(self, other):
        return self._op(arith.andi, other)

    def __or__(self, other):
        return self._op(arith.ori, other)

    def __lshift__(self, other):
        return self._op(arith.shli, other)


def _swar_planes(packed):
    """A [64, 16] uint8 tile in the WGMMA layout -> its (low, high) nibble planes as [64, 16] bf16 (the value
    times 2^-126) in the same layout: each register's two bytes decoded as 32-bit words (`pair_planes`),
    not as 16-bit lanes, whose shifts the GPU has no paired instruction for."""
    out = plgpu.ShapeDtypeStruct(packed.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=(out, out))
    def planes(_, tile):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get([2], ir.BF16Type.get())
        lo_regs, hi_regs = (np.empty(tile.registers.shape, dtype=object) for _ in range(2))
        for idx, reg in np.ndenumerate(tile.registers):  # vector<2xi8>: two bytes of one row
            word = _Word(arith.extui(i32, llvm.bitcast(i16, reg)))
            lo, hi = pair_planes(spread_pair(word))
            lo_regs[idx], hi_regs[idx] = llvm.bitcast(pair, lo.value), llvm.bitcast(pair, hi.value)
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=tile.layout, _is_signed=None)
                     for r in (lo_regs, hi_regs))
    return planes(packed)


def planes_of(packed, swar: bool = False):
    """A [64, 16] uint8 tile -> its (low, high) nibble planes as bf16, each value times 2^-126: as 16-bit lanes
    (`e2m1_bits`), or with `swar` two values per 32-bit word (`_swar_planes`; GPU only)."""
    if swar:
        return _swar_planes(packed)
    p16 = packed.astype(jnp.int16)  # 8-bit values take bit ops only
    return tuple(lax.bitcast_convert_type(e2m1_bits(nib), jnp.bfloat16) for nib in (p16 & 0xF, (p16 >> 4) & 0xF))


WORD_BYTES = 32  # packed bytes a row that one `word_steps` call decodes: 64 k, two scale blocks, 4 wgmmas
# _ASM1R on the word of two 16-bit register halves (bytes 2j, 2j + 1 and 2j + 8, 2j + 9 of a scale block's 16 in
# the WGMMA layout, j = lane % 4), all four results times one factor ($6): the row's 2^(s - 1) as bf16x2
_WORD_ASM = ("{ .reg .b32 q, a, b, c, t, m, z; mov.b32 z, 0x80008000; prmt.b32 q, $4, $5, 0x5410; "
             + asm1r_body("q", ("$6",) * 4) + "}")


def word_order(k: int) -> np.ndarray:
    """The k order of the words decode's wgmmas (`word_steps`): column p of its activations is x's column
    order[p]. In each 64 k (32 bytes a row, scale blocks 2i and 2i + 1), wgmma s takes block s // 2's residue
    c = 2 (s % 2) + h mod 4, where h = 0 for its columns 0-7 and 1 for 8-15, column 2 j + e (j < 4, e < 2)
    taking k = 4 j + c + 16 e: thread j of a quad holds bytes 2 j, 2 j + 1, 2 j + 8, 2 j + 9 of the block,
    whose 8 elements asm1r places as (lo0, lo2), (hi0, hi2), (lo1, lo3), (hi1, hi3), the pairs of k = 4 j + c
    and 4 j + c + 16 for c = 0..3."""
    if k % (2 * WORD_BYTES):
        raise ValueError(f"word_order: K = {k} must be a multiple of {2 * WORD_BYTES}")
    col = np.arange(16)
    j, e, h = (col % 8) // 2, col % 2, col // 8
    span = np.concatenate([(s // 2) * 32 + 4 * j + 2 * (s % 2) + h + 16 * e for s in range(4)])
    return (np.arange(k // (2 * WORD_BYTES))[:, None] * (2 * WORD_BYTES) + span).reshape(-1)


def word_steps(tile, f0, f1):
    """A [64, 32] uint8 tile in the WGMMA layout and its two scale blocks' factors ([64, 16] bf16 in the WGMMA
    layout, each row's 2^(s - 1): `quick_scale_bits`) -> the four [64, 16] bf16 wgmma A operands of its 64 k in
    `word_order`, decoded by asm1r in PTX on 32-bit words (quick decode: scale bytes <= QUICK_MAX). Each
    thread holds, per row, two 16-bit registers of a scale block (columns 2 j, 2 j + 1 and 2 j + 8, 2 j + 9),
    one word, whose 8 elements are the block's four wgmmas' 2 x 2 registers of that row: no moves."""
    out = plgpu.ShapeDtypeStruct((ROWS_PER_WG, PLANE_STEP), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 3, return_type=(out,) * 4)
    def steps(_, tile, f0, f1):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get([2], ir.BF16Type.get())
        out_shape = f0.registers.shape
        # WGMMA registers: [8-column group, row half] once the unit dimensions are dropped
        if tile.registers.size != 8 or out_shape != f1.registers.shape or f0.registers.size != 4:
            raise NotImplementedError(f"word_steps: unexpected WGMMA registers {tile.registers.shape} / {out_shape}")
        groups = tile.registers.reshape(4, 2)
        factors = [f.registers.reshape(2, 2) for f in (f0, f1)]
        regs = [np.empty((2, 2), dtype=object) for _ in range(4)]
        result = llvm.StructType.get_literal([i32] * 4)
        for blk in range(2):
            for half in range(2):
                lo, hi = (arith.extui(i32, llvm.bitcast(i16, groups[2 * blk + g, half])) for g in range(2))
                res = llvm.inline_asm(result, [lo, hi, llvm.bitcast(i32, factors[blk][0, half])], _WORD_ASM,
                                      "=r,=r,=r,=r,r,r,r")
                hi1, lo1, hi0, lo0 = (llvm.bitcast(pair, llvm.extractvalue(i32, res, [k])) for k in range(4))
                # c = 0, 1 in wgmma 2 blk (columns 0-7, 8-15), c = 2, 3 in wgmma 2 blk + 1
                regs[2 * blk][:, half] = lo0, hi0
                regs[2 * blk + 1][:, half] = lo1, hi1
        return tuple(mgpu.FragmentedArray(_registers=r.reshape(out_shape), _layout=f0.layout, _is_signed=None)
                     for r in regs)
    return steps(tile, f0, f1)


def scaled(value, factor, quick: bool = False):
    """A plane's values times 2^-126 (`planes_of`) times a bf16 factor broadcast to their shape: two exact
    multiplies, by 2^126 and by the factor (`scale_bits`), or with `quick` one, by the factor from
    `quick_scale_bits`. The operand is subnormal for +-0.5, so this needs a multiply that keeps bf16
    subnormals, as the GPU's bf16 multiplies do (the Triton kernels' quick decoder relies on the same, and was
    bit-exact on the H200); XLA's CPU backend flushes them (tests/test_moe_wgmma.py checks the bits)."""
    if not quick:
        value = value * jnp.asarray(2.0 ** 126, jnp.bfloat16)
    return value * factor


def _kernel(tile_expert, tile_width, tile_order, *refs, mats: int, tile_t: int, plane_cols: int, stages: int,
            delay: int, epilogue, persistent: bool, x_tk: bool, plane_rows: bool, transpose_out: bool, row_blocks: int,
            quick: bool, swar: bool, words: bool, wgs: int, widths: tuple):
    """Tile (n block, token tile): the tile's expert e = tile_expert[t] (E for an unused tile: skipped),
    out[n_tile rows, w] = epilogue(W_m[e] rows @ x tile^T for each of the `mats` weight matrices), over the
    tile's first w = widths[tile_width[t]] slots (tile_t unless narrowed: tile_width and tile_order are read only
    with several widths). One tile per program, or (persistent) one program per SM looping over the tiles (in
    tile_order's order), n blocks fastest, with one set of pipeline buffers, so that a tile's first loads
    overlap the previous tile's epilogue."""
    w_gmem, s_gmem, (x_gmem, out_gmem) = refs[:mats], refs[mats:2 * mats], refs[2 * mats:]
    n_tile = wgs * ROWS_PER_WG * row_blocks  # rows per tile: each of the wgs compute warpgroups takes 64 of a block
    num_experts, half_k = w_gmem[0].shape[0], w_gmem[0].shape[-1]
    n = s_gmem[0].shape[-1]
    subs = plane_cols // PLANE_STEP

    def b_operand(x_smem, cols, width):
        if x_tk:
            return plgpu.transpose_ref(x_smem.at[pl.ds(0, width), cols], (1, 0))
        return x_smem.at[cols, pl.ds(0, width)]

    def factors(s_smem, i, rows):  # scale block i's factor per row, as a [64, 16] WGMMA-layout operand
        s = s_smem[i, rows].astype(jnp.int16)  # [64]: this block's scale per row
        factor = lax.bitcast_convert_type((quick_scale_bits if quick else scale_bits)(s), jnp.bfloat16)
        return lax.broadcast_in_dim(factor, (ROWS_PER_WG, PLANE_STEP), (0,))

    def words_body(width, _, *smem):  # x in `word_order`: 4 wgmmas per 32 bytes a row (`word_steps`)
        w_smem, s_smem, (x_smem,), accs = smem[:mats], smem[mats:2 * mats], smem[2 * mats:-1], smem[-1]
        wg = lax.axis_index("wg")
        for i in range(plane_cols // WORD_BYTES):
            for j in range(row_blocks):
                rows = pl.ds((j * wgs + wg) * ROWS_PER_WG, ROWS_PER_WG)
                for m in range(mats):
                    a = word_steps(w_smem[m][rows, pl.ds(i * WORD_BYTES, WORD_BYTES)],
                                   *(factors(s_smem[m], 2 * i + b, rows) for b in range(2)))
                    for st, value in enumerate(a):
                        cols = pl.ds((4 * i + st) * PLANE_STEP, PLANE_STEP)
                        plgpu.wgmma(accs[j * mats + m], value, b_operand(x_smem, cols, width))
        plgpu.wgmma_wait(delay * subs * 2 * mats * row_blocks)  # the same count of wgmmas a step as `body`
        return accs

    def body(width, _, *smem):
        w_smem, s_smem, (xlo_smem, xhi_smem), accs = smem[:mats], smem[mats:2 * mats], smem[2 * mats:-1], smem[-1]
        wg = lax.axis_index("wg")
        for i in range(subs):
            cols = pl.ds(i * PLANE_STEP, PLANE_STEP)
            for j in range(row_blocks):
                rows = pl.ds((j * wgs + wg) * ROWS_PER_WG, ROWS_PER_WG)
                for m in range(mats):
                    factor = factors(s_smem[m], i, rows)
                    for value, x_smem in zip(planes_of(w_smem[m][rows, cols], swar), (xlo_smem, xhi_smem)):
                        plgpu.wgmma(accs[j * mats + m], scaled(value, factor, quick), b_operand(x_smem, cols, width))
        plgpu.wgmma_wait(delay * subs * 2 * mats * row_blocks)  # with delay 1, this step's wgmmas may still run
        return accs

    def pipeline_for(n_idx, t_idx, width):  # products over the tile's first `width` slots
        def compute_context(eval_pipeline):
            def scope(*accs):
                eval_pipeline(accs)
                wg = lax.axis_index("wg")
                toks = pl.ds(t_idx * tile_t, width)
                for j in range(row_blocks):
                    out = epilogue(*(a[...] for a in accs[j * mats:(j + 1) * mats])).astype(out_gmem.dtype)
                    rows = pl.ds(n_idx * n_tile + (j * wgs + wg) * ROWS_PER_WG, ROWS_PER_WG)
                    if transpose_out:
                        out = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
                        plgpu.transpose_ref(out_gmem.at[toks, rows], (1, 0))[...] = out
                    else:
                        out_gmem.at[rows, toks][...] = out
            pl.run_scoped(scope, *(plgpu.ACC((ROWS_PER_WG, width), jnp.float32) for _ in range(mats * row_blocks)))

        w_spec = plgpu.BlockSpec((n_tile, plane_cols), lambda k: (0, k), transforms=W_TRANSFORMS,
                                 delay_release=delay)
        s_spec = plgpu.BlockSpec((subs, n_tile), lambda k: (k, 0), delay_release=delay)
        x_cols = plane_cols * (1 + words)  # the step's k: plane columns of each plane, or x's in word_order
        x_spec = plgpu.BlockSpec((tile_t, x_cols) if x_tk else (x_cols, tile_t),
                                 (lambda k: (0, k)) if x_tk else (lambda k: (k, 0)), transforms=X_TRANSFORMS,
                                 delay_release=delay)
        return plgpu.emit_pipeline_warp_specialized(
            functools.partial(words_body if words else body, width), grid=(half_k // plane_cols,),
            memory_registers=40, wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=stages,
            compute_context=compute_context,
            in_specs=[w_spec] * mats + [s_spec] * mats + [x_spec] * (2 - words))

    def operands(e, n_idx, t_idx):
        rows, toks = pl.ds(n_idx * n_tile, n_tile), pl.ds(t_idx * tile_t, tile_t)
        if plane_rows:  # output rows p * N/2 + i are weight rows 2 i + p: w is [E, N/2, 2, K/2]
            half_blocks = n // (2 * n_tile)
            w_rows = (pl.ds(lax.rem(n_idx, half_blocks) * n_tile, n_tile), lax.div(n_idx, half_blocks))
        else:
            w_rows = (rows,)
        x_tiles = tuple(x_gmem.at[p, toks] if x_tk else x_gmem.at[p, :, toks] for p in range(2 - words))
        return (*(w.at[e].at[w_rows] for w in w_gmem), *(sc.at[e].at[:, rows] for sc in s_gmem), *x_tiles)

    def run_tile(n_idx, t_pos, **allocations):
        t_idx = t_pos if len(widths) == 1 else tile_order[t_pos]
        e = tile_expert[t_idx]

        def run(width):  # the same buffers whatever the width: the specs do not depend on it
            return lambda: pipeline_for(n_idx, t_idx, width)(*operands(e, n_idx, t_idx), **allocations)

        @pl.when(e < num_experts)
        def _():
            if len(widths) == 1:
                run(tile_t)()
            else:  # a pipeline per width (a width switched at each wgmma, the accumulators carried through
                # the branches, made gate+up 25% slower on the H100: docs/benchmarks.md, thirty-fifth session)
                lax.switch(tile_width[t_idx], [run(w) for w in widths])

    if not persistent:
        run_tile(lax.axis_index("n"), lax.axis_index("t"))
        return
    n_blocks, t_tiles = n // n_tile, out_gmem.shape[0 if transpose_out else 1] // tile_t
    allocs = pipeline_for(0, 0, tile_t).get_allocations(*operands(0, 0, 0))

    def scope(allocations):
        @plgpu.nd_loop((t_tiles, n_blocks), collective_axes="sm")
        def _(info):
            t_pos, n_idx = info.index
            run_tile(n_idx, t_pos, allocations=allocations)
    pl.run_scoped(scope, allocs, collective_axes="wg")


def x_planes(x):
    """x [T, K] -> [2, K/2, T]: the even and the odd columns, transposed (wgmma's B operand, [K, N])."""
    t, k = x.shape
    return jnp.transpose(x.reshape(t, k // 2, 2), (2, 1, 0))


def token_planes(x):
    """x [T, K] -> [2, T, K/2]: the even and the odd columns, each token's a contiguous row (the x_tk
    operand; a row gather of it gives the slots')."""
    t, k = x.shape
    return jnp.transpose(x.reshape(t, k // 2, 2), (2, 0, 1))


def token_words(x):
    """x [T, K] -> [1, T, K]: each token's columns in `word_order` (the x_tk operand of the words decode), as a
    gather by a constant index: as the equivalent 7-d transpose, XLA took 1.11 ms for [16384, 3584] bf16 on the
    H100, as a gather 0.08 ms (2026-12-07)."""
    return jnp.take(x, jnp.asarray(word_order(x.shape[1]), jnp.int32), axis=1)[None]


def tile_widths(tile_used, narrow: int, tile_t: int, tiles: int):
    """The kernel's widths for `narrow` (0: the one width tile_t), each tile's index among them (the fewest
    columns covering its used slots; an unused tile the narrowest) and the tiles' order of work: widest
    first, stable, so that an SM runs one width's code for many tiles in a row and the loop ends on the
    shortest tiles (in the dispatch's expert order, narrow 16's gate+up took 29.2 ms against 26.2 widest first
    at 16384 tokens on the H100: docs/benchmarks.md, thirty-seventh session)."""
    if not narrow:
        return (tile_t,), jnp.zeros((tiles,), jnp.int32), jnp.arange(tiles, dtype=jnp.int32)
    widths = tuple(range(narrow, tile_t + 1, narrow))
    width_idx = jnp.clip((tile_used + narrow - 1) // narrow - 1, 0, len(widths) - 1).astype(jnp.int32)
    order = jnp.argsort(-width_idx, stable=True)
    return widths, width_idx, order.astype(jnp.int32)


def grouped_mxfp4_matmul_t(tile_expert, packed, scales_t, planes, *, epilogue=None, out_dtype=jnp.float32,
                          tile_t: int = 128, plane_cols: int = 64, stages: int = 4, delay: int = 0,
                          persistent: bool = False, sms: int | None = None, x_tk: bool = False,
                          plane_rows: bool = False, transpose_out: bool = False, row_blocks: int = 1,
                          quick: bool = False, swar: bool = False, words: bool = False, wgs: int = 2,
                          tile_used=None, narrow: int = 0):
    """The expert GEMMs of a block-aligned dispatch, transposed: out[N, S] with column block t (tile_t slots)
    = epilogue(W_m[e_t] @ planes' slots^T, for each matrix m), e_t = tile_expert[t]; columns of an unused
    tile (e_t = E) are left unwritten. packed: a tuple of [E, N, K/2] uint8 (one or more matrices with the
    same shapes, e.g. w1 and w3), scales_t: theirs as [E, K/32, N] uint8 (`transpose_scales`), planes: the
    slots' activations as even/odd K planes, [2, K/2, S] bf16 (`x_planes`), or [2, S, K/2] with x_tk (each
    slot's planes a contiguous row: `token_planes` then a row gather). epilogue: fp32 [64, tile_t]
    accumulators, one per matrix -> the output block (default: the one matrix's product).

    plane_rows: the output's rows in plane order, row p * N/2 + i = weight row 2 i + p, so that out [N, S] is
    the next GEMM's [2, N/2, S] planes with no pass between (scales_t from `transpose_scales(..., plane_rows=
    True)`, in the same order). transpose_out: out is [S, N] (each block stored transposed from registers).
    row_blocks: row blocks per tile (each compute warpgroup holds mats x row_blocks accumulators), so that
    each activation tile in shared memory feeds more rows (2 for one matrix: as many accumulators as w1+w3).
    wgs: compute warpgroups (2 or 3), each taking 64 rows of a row block (a block: wgs x 64 rows).
    narrow (a multiple of 16, the activation tiles' width, dividing tile_t; 0: off) with tile_used ([T] int32,
    the slots of each tile that hold pairs, a prefix): each tile's wgmmas cover only its first used slots
    rounded up to `narrow`, chosen per tile among tile_t / narrow static widths (a whole pipeline each, on the
    same buffers); its other columns are left unwritten, as an unused tile's. The tiles then run widest first
    (`tile_widths`).
    quick: one multiply per weight instead of two, for scale bytes up to QUICK_MAX only (unchecked). swar: the
    nibbles' bits made two per 32-bit word (`pair_planes`) instead of per 16-bit lane. words: the weights
    decoded by asm1r in PTX, a 32-bit word of a scale block's bytes at a time (`word_steps`; quick only), with
    the activations not as planes but as one array in `word_order`: [1, K, S], or [1, S, K] with x_tk.

    N a multiple of wgs x 64 x row_blocks (twice that with plane_rows), S of tile_t (<= 256), K/2 of plane_cols
    (a multiple of 16; of 32 with words). delay: 0 waits for each pipeline step's wgmmas before its
    shared-memory stage is released; 1 releases a stage one step later and waits only for the previous step's
    wgmmas, so a step's decode overlaps the tensor cores' work on the step before (stages > 1). persistent:
    one program per SM (`sms`, default the device's count) looping over the tiles."""
    packed, scales_t = tuple(packed), tuple(scales_t)
    mats = len(packed)
    num_experts, n, half_k = packed[0].shape
    t = planes.shape[1 if x_tk else 2]
    rows = wgs * ROWS_PER_WG * row_blocks * (1 + plane_rows)
    if n % rows or t % tile_t or half_k % plane_cols or plane_cols % PLANE_STEP or tile_t > 256:
        raise ValueError(f"mxfp4_matmul: N = {n} (multiple of {rows}), T = {t} (of tile_t = "
                         f"{tile_t} <= 256), K/2 = {half_k} (of plane_cols = {plane_cols}, a multiple of "
                         f"{PLANE_STEP})")
    if wgs not in (2, 3):  # 4 hung on the H100 (planes, swar, 16-slot tiles; 2026-12-07, not looked into)
        raise ValueError(f"mxfp4_matmul: wgs = {wgs} compute warpgroups: 2 or 3 are the counts run on the GPU")
    if delay not in (0, 1) or stages <= delay:
        raise ValueError(f"mxfp4_matmul: delay = {delay} must be 0 or 1 and below stages = {stages}")
    for i, (p, sc) in enumerate(zip(packed, scales_t, strict=True)):
        if p.shape != packed[0].shape or sc.shape != (num_experts, 2 * half_k // SCALE_BLOCK, n):
            raise ValueError(f"mxfp4_matmul: matrix {i}: packed {p.shape} / scales_t {sc.shape} do not match "
                             f"packed {packed[0].shape} as [E, N, K/2] / [E, K/32, N]")
    if words and (not quick or plane_cols % WORD_BYTES):
        raise ValueError(f"mxfp4_matmul: words needs quick and plane_cols a multiple of {WORD_BYTES}, got quick = "
                         f"{quick}, plane_cols = {plane_cols}")
    if narrow and (narrow % 16 or tile_t % narrow or tile_used is None or tile_used.shape != (t // tile_t,)):
        raise ValueError(f"mxfp4_matmul: narrow = {narrow} must be a multiple of 16 dividing tile_t = {tile_t}, with "
                         f"tile_used [{t // tile_t}] (got {None if tile_used is None else tile_used.shape})")
    widths, width_idx, order = tile_widths(tile_used, narrow, tile_t, t // tile_t)
    x_shape = (1, 2 * half_k) if words else (2, half_k)  # [planes, k per plane]
    want = (x_shape[0], t, x_shape[1]) if x_tk else (*x_shape, t)
    if planes.shape != want or tile_expert.shape != (t // tile_t,):
        raise ValueError(f"mxfp4_matmul: planes {planes.shape} / tile_expert {tile_expert.shape} do not match "
                         f"{want} (K/2 = {half_k}) and {t // tile_t} tiles of {tile_t}")
    if epilogue is None:
        if mats != 1:
            raise ValueError(f"mxfp4_matmul: {mats} matrices need an epilogue that combines them")
        epilogue = lambda acc: acc  # noqa: E731
    if plane_rows:
        packed = tuple(p.reshape(num_experts, n // 2, 2, half_k) for p in packed)
    kernel = functools.partial(_kernel, mats=mats, tile_t=tile_t, plane_cols=plane_cols, stages=stages,
                               delay=delay, epilogue=epilogue, persistent=persistent, x_tk=x_tk,
                               plane_rows=plane_rows, transpose_out=transpose_out, row_blocks=row_blocks,
                               quick=quick, swar=swar, words=words, wgs=wgs, widths=widths)
    if persistent:
        grid, names = (sms or _sm_count(),), ("sm",)
    else:
        grid, names = (n // (wgs * ROWS_PER_WG * row_blocks), t // tile_t), ("n", "t")
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((t, n) if transpose_out else (n, t), out_dtype), grid=grid,
        grid_names=names, num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(tile_expert.astype(jnp.int32), width_idx, order, *packed, *scales_t, planes)


def mxfp4_matmul(packed, scales_t, planes, *, tile_t: int = 128, **options):
    """One matrix: W @ x^T in fp32 [N, T] for packed [N, K/2] uint8, scales_t [K/32, N] uint8 and planes =
    x_planes(x) ([2, K/2, T] bf16, or token_planes(x) with x_tk): `grouped_mxfp4_matmul_t` with one expert
    (its other options too: plane_rows, transpose_out, the tuning)."""
    t = planes.shape[1 if options.get("x_tk") else 2]
    tiles = jnp.zeros((t // tile_t,), jnp.int32)
    return grouped_mxfp4_matmul_t(tiles, (packed[None],), (scales_t[None],), planes, tile_t=tile_t, **options)


def _sm_count() -> int:
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise ValueError("mxfp4_matmul: persistent needs the GPU's SM count: pass sms= off the GPU")
    return device.core_count


def transpose_scales(scales, plane_rows: bool = False):
    """The release's E8M0 scales [..., N, K/32] -> [..., K/32, N], the kernel's layout; with plane_rows the
    N rows in plane order (row p * N/2 + i = row 2 i + p), as `grouped_mxfp4_matmul_t(plane_rows=True)`
    reads them."""
    if plane_rows:
        *lead, n, kb = scales.shape
        scales = jnp.swapaxes(scales.reshape(*lead, n // 2, 2, kb), -2, -3).reshape(*lead, n, kb)
    return jnp.swapaxes(scales, -1, -2)
