"""The MXFP4 x bf16 expert GEMM (issue 7; right on the H100 and the H200, docs/benchmarks.md, seventeenth and
eighteenth sessions) on Pallas' Mosaic GPU backend,
warp-specialised, the design docs/benchmarks.md ("Still to run", the MoE prefill item) asks for. The Triton
kernels decode a weight tile in registers and then wait on every wgmma, so decoding never overlaps the
tensor cores; here a memory warpgroup streams the packed weights, the scales and the activations into a ring
of shared-memory stages by TMA while two compute warpgroups decode and issue wgmma.

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


def scaled(value, factor, quick: bool = False):
    """A plane's values times 2^-126 (`planes_of`) times a bf16 factor broadcast to their shape: two exact
    multiplies, by 2^126 and by the factor (`scale_bits`), or with `quick` one, by the factor from
    `quick_scale_bits`. The operand is subnormal for +-0.5, so this needs a multiply that keeps bf16
    subnormals, as the GPU's bf16 multiplies do (the Triton kernels' quick decoder relies on the same, and was
    bit-exact on the H200); XLA's CPU backend flushes them (tests/test_moe_wgmma.py checks the bits)."""
    if not quick:
        value = value * jnp.asarray(2.0 ** 126, jnp.bfloat16)
    return value * factor


def _kernel(tile_expert, *refs, mats: int, tile_t: int, plane_cols: int, stages: int, delay: int, epilogue,
            persistent: bool, x_tk: bool, plane_rows: bool, transpose_out: bool, row_blocks: int, quick: bool,
            swar: bool):
    """Tile (n block, token tile): the tile's expert e = tile_expert[t] (E for an unused tile: skipped),
    out[128 rows, tile_t] = epilogue(W_m[e] rows @ x tile^T for each of the `mats` weight matrices). One tile
    per program, or (persistent) one program per SM looping over the tiles, n blocks fastest, with one set of
    pipeline buffers, so that a tile's first loads overlap the previous tile's epilogue."""
    w_gmem, s_gmem, (x_gmem, out_gmem) = refs[:mats], refs[mats:2 * mats], refs[2 * mats:]
    n_tile = 2 * ROWS_PER_WG * row_blocks  # rows per tile: each compute warpgroup takes 64 of each 128
    num_experts, half_k = w_gmem[0].shape[0], w_gmem[0].shape[-1]
    n = s_gmem[0].shape[-1]
    subs = plane_cols // PLANE_STEP

    def body(_, *smem):
        w_smem, s_smem, (xlo_smem, xhi_smem), accs = smem[:mats], smem[mats:2 * mats], smem[2 * mats:-1], smem[-1]
        wg = lax.axis_index("wg")
        for i in range(subs):
            cols = pl.ds(i * PLANE_STEP, PLANE_STEP)
            for j in range(row_blocks):
                rows = pl.ds(j * 2 * ROWS_PER_WG + wg * ROWS_PER_WG, ROWS_PER_WG)
                for m in range(mats):
                    s = s_smem[m][i, rows].astype(jnp.int16)  # [64]: this block's scale per row
                    factor = lax.bitcast_convert_type((quick_scale_bits if quick else scale_bits)(s), jnp.bfloat16)
                    factor = lax.broadcast_in_dim(factor, (ROWS_PER_WG, PLANE_STEP), (0,))
                    for value, x_smem in zip(planes_of(w_smem[m][rows, cols], swar), (xlo_smem, xhi_smem)):
                        b = plgpu.transpose_ref(x_smem.at[:, cols], (1, 0)) if x_tk else x_smem.at[cols]
                        plgpu.wgmma(accs[j * mats + m], scaled(value, factor, quick), b)
        plgpu.wgmma_wait(delay * subs * 2 * mats * row_blocks)  # with delay 1, this step's wgmmas may still run
        return accs

    def pipeline_for(n_idx, t_idx):
        def compute_context(eval_pipeline):
            def scope(*accs):
                eval_pipeline(accs)
                wg = lax.axis_index("wg")
                toks = pl.ds(t_idx * tile_t, tile_t)
                for j in range(row_blocks):
                    out = epilogue(*(a[...] for a in accs[j * mats:(j + 1) * mats])).astype(out_gmem.dtype)
                    rows = pl.ds(n_idx * n_tile + j * 2 * ROWS_PER_WG + wg * ROWS_PER_WG, ROWS_PER_WG)
                    if transpose_out:
                        out = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
                        plgpu.transpose_ref(out_gmem.at[toks, rows], (1, 0))[...] = out
                    else:
                        out_gmem.at[rows, toks][...] = out
            pl.run_scoped(scope, *(plgpu.ACC((ROWS_PER_WG, tile_t), jnp.float32) for _ in range(mats * row_blocks)))

        w_spec = plgpu.BlockSpec((n_tile, plane_cols), lambda k: (0, k), transforms=W_TRANSFORMS,
                                 delay_release=delay)
        s_spec = plgpu.BlockSpec((subs, n_tile), lambda k: (k, 0), delay_release=delay)
        x_spec = plgpu.BlockSpec((tile_t, plane_cols) if x_tk else (plane_cols, tile_t),
                                 (lambda k: (0, k)) if x_tk else (lambda k: (k, 0)), transforms=X_TRANSFORMS,
                                 delay_release=delay)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(half_k // plane_cols,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute_context,
            in_specs=[w_spec] * mats + [s_spec] * mats + [x_spec] * 2)

    def operands(e, n_idx, t_idx):
        rows, toks = pl.ds(n_idx * n_tile, n_tile), pl.ds(t_idx * tile_t, tile_t)
        if plane_rows:  # output rows p * N/2 + i are weight rows 2 i + p: w is [E, N/2, 2, K/2]
            half_blocks = n // (2 * n_tile)
            w_rows = (pl.ds(lax.rem(n_idx, half_blocks) * n_tile, n_tile), lax.div(n_idx, half_blocks))
        else:
            w_rows = (rows,)
        x_tiles = (x_gmem.at[0, toks], x_gmem.at[1, toks]) if x_tk else (x_gmem.at[0, :, toks], x_gmem.at[1, :, toks])
        return (*(w.at[e].at[w_rows] for w in w_gmem), *(sc.at[e].at[:, rows] for sc in s_gmem), *x_tiles)

    def run_tile(n_idx, t_idx, **allocations):
        e = tile_expert[t_idx]

        @pl.when(e < num_experts)
        def _():
            pipeline_for(n_idx, t_idx)(*operands(e, n_idx, t_idx), **allocations)

    if not persistent:
        run_tile(lax.axis_index("n"), lax.axis_index("t"))
        return
    n_blocks, t_tiles = n // n_tile, out_gmem.shape[0 if transpose_out else 1] // tile_t
    allocs = pipeline_for(0, 0).get_allocations(*operands(0, 0, 0))

    def scope(allocations):
        @plgpu.nd_loop((t_tiles, n_blocks), collective_axes="sm")
        def _(info):
            t_idx, n_idx = info.index
            run_tile(n_idx, t_idx, allocations=allocations)
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


def grouped_mxfp4_matmul_t(tile_expert, packed, scales_t, planes, *, epilogue=None, out_dtype=jnp.float32,
                          tile_t: int = 128, plane_cols: int = 64, stages: int = 4, delay: int = 0,
                          persistent: bool = False, sms: int | None = None, x_tk: bool = False,
                          plane_rows: bool = False, transpose_out: bool = False, row_blocks: int = 1,
                          quick: bool = False, swar: bool = False):
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
    row_blocks: 128-row blocks per tile (each compute warpgroup holds mats x row_blocks accumulators), so that
    each activation tile in shared memory feeds more rows (2 for one matrix: as many accumulators as w1+w3).
    quick: one multiply per weight instead of two, for scale bytes up to QUICK_MAX only (unchecked). swar: the
    nibbles' bits made two per 32-bit word (`pair_planes`) instead of per 16-bit lane.

    N a multiple of 128 (of 256 with plane_rows), S of tile_t (<= 256), K/2 of plane_cols (a multiple of
    16). delay: 0 waits for each pipeline step's wgmmas before its shared-memory stage is released; 1
    releases a stage one step later and waits only for the previous step's wgmmas, so a step's decode
    overlaps the tensor cores' work on the step before (stages > 1). persistent: one program per SM (`sms`,
    default the device's count) looping over the tiles."""
    packed, scales_t = tuple(packed), tuple(scales_t)
    mats = len(packed)
    num_experts, n, half_k = packed[0].shape
    t = planes.shape[1 if x_tk else 2]
    rows = 2 * ROWS_PER_WG * row_blocks * (1 + plane_rows)
    if n % rows or t % tile_t or half_k % plane_cols or plane_cols % PLANE_STEP or tile_t > 256:
        raise ValueError(f"mxfp4_matmul: N = {n} (multiple of {rows}), T = {t} (of tile_t = "
                         f"{tile_t} <= 256), K/2 = {half_k} (of plane_cols = {plane_cols}, a multiple of "
                         f"{PLANE_STEP})")
    if delay not in (0, 1) or stages <= delay:
        raise ValueError(f"mxfp4_matmul: delay = {delay} must be 0 or 1 and below stages = {stages}")
    for i, (p, sc) in enumerate(zip(packed, scales_t, strict=True)):
        if p.shape != packed[0].shape or sc.shape != (num_experts, 2 * half_k // SCALE_BLOCK, n):
            raise ValueError(f"mxfp4_matmul: matrix {i}: packed {p.shape} / scales_t {sc.shape} do not match "
                             f"packed {packed[0].shape} as [E, N, K/2] / [E, K/32, N]")
    if planes.shape != ((2, t, half_k) if x_tk else (2, half_k, t)) or tile_expert.shape != (t // tile_t,):
        raise ValueError(f"mxfp4_matmul: planes {planes.shape} / tile_expert {tile_expert.shape} do not match "
                         f"K/2 = {half_k} and {t // tile_t} tiles of {tile_t}")
    if epilogue is None:
        if mats != 1:
            raise ValueError(f"mxfp4_matmul: {mats} matrices need an epilogue that combines them")
        epilogue = lambda acc: acc  # noqa: E731
    if plane_rows:
        packed = tuple(p.reshape(num_experts, n // 2, 2, half_k) for p in packed)
    kernel = functools.partial(_kernel, mats=mats, tile_t=tile_t, plane_cols=plane_cols, stages=stages,
                               delay=delay, epilogue=epilogue, persistent=persistent, x_tk=x_tk,
                               plane_rows=plane_rows, transpose_out=transpose_out, row_blocks=row_blocks,
                               quick=quick, swar=swar)
    if persistent:
        grid, names = (sms or _sm_count(),), ("sm",)
    else:
        grid, names = (n // (2 * ROWS_PER_WG * row_blocks), t // tile_t), ("n", "t")
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((t, n) if transpose_out else (n, t), out_dtype), grid=grid,
        grid_names=names, num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(tile_expert.astype(jnp.int32), *packed, *scales_t, planes)


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
