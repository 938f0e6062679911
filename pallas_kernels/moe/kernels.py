"""Grouped GEMMs over packed MXFP4 expert weights (Triton-style `pl.pallas_call`).

Both kernels run on the block-aligned layout of dispatch.py: grid (N block, tile); a program reads its
tile's expert id, skips the whole body for an unused tile, and otherwise loops over K, decoding each
weight tile [bn, bk] from its bytes in registers (decode.py) and accumulating bf16 x bf16 -> fp32.

- `gate_up`: x [N, L] gathered by slot (token ids, no copy of x per pair), w1 and w3 [E, F, L] in one
  pass (two accumulators), SiTU epilogue -> h [T*bm, F] in the activation dtype.
- `down`: h [T*bm, F] by w2 [E, L, F], times each slot's routing weight -> y [T*bm, L] in fp32.

Two regimes share the code and differ in tiles (see `TileConfig`): decode (few tokens per expert, bm 16:
weight streaming, the F or L axis split into many N blocks to fill the SMs) and prefill (bm 64-128,
tensor-core bound). Weight refs are whole arrays in HBM indexed by the tile's expert (64-bit offsets).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimik3_jax.ops.common import situ
from pallas_kernels.common import resolve_interpret
from pallas_kernels.moe import decode as dec

_CompilerParams = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams


@dataclass(frozen=True)
class Tiles:
    """One kernel's tiles: bn output columns, bk reduction elements (a multiple of 32), Triton knobs, and
    two ways to shape the MMA around the decoded weights (same math, different instruction streams):
    - swap: compute the transposed tile, W [bn, bk] . act^T -> [bn, bm], so that the decoded weights are
      the MMA's left operand (M = bn) and the few activation rows its narrow right operand, as weight-only
      quantised decode GEMMs do; the epilogue transposes back;
    - split: no nibble interleave in registers: the even and odd elements of each bk block are two dots of
      bk/2 each, against the activation's even and odd columns (the wrapper reorders the activation's
      columns once per call so that both halves are contiguous loads).
    Neither is faster on the H200 (2026-12-01, docs/benchmarks.md): both stay off by default."""
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    split: bool = False
    n_first: bool = True  # grid (N block, tile): the programs of one tile run back to back (see `_grid`)

    @property
    def min_bk(self) -> int:
        """The smallest bk: one scale group, or with split one group per half."""
        return dec.GROUP * (2 if self.split else 1)


@dataclass(frozen=True)
class TileConfig:
    bm: int  # rows per tile (slots of one expert); 16 is the smallest tensor-core tile
    gate_up: Tiles
    down: Tiles

    @classmethod
    def from_dict(cls, d: dict) -> "TileConfig":
        """From {"bm": .., "gate_up": {Tiles fields}, "down": {Tiles fields}} (the benchmarks' JSON form)."""
        return cls(d["bm"], Tiles(**d["gate_up"]), Tiles(**d["down"]))


def _dot_t(a, b):
    """a [m, k] @ b[n, k]^T in fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def split_columns(a: jax.Array, bk: int) -> jax.Array:
    """[R, K] -> [R, K] with each bk block's even columns first, then its odd ones (for `Tiles.split`)."""
    rows, k = a.shape
    return a.reshape(rows, k // bk, bk // 2, 2).swapaxes(2, 3).reshape(rows, k)


def _block_product(act_ref, act_rows, w_p_ref, w_s_ref, e, n, kb, *, bk, decode, swap, split):
    """One K block's product of the activation rows with expert e's decoded weight rows n: [bm, bn], or
    [bn, bm] with swap. act columns are in `split_columns` order when split; decode is a `decode.Decoder`."""
    kp, ks = pl.ds(kb * (bk // 2), bk // 2), pl.ds(kb * (bk // dec.GROUP), bk // dec.GROUP)
    if split:
        ws = decode.halves(w_p_ref[e, n, kp], w_s_ref[e, n, ks])
        acts = (act_ref[act_rows, pl.ds(kb * bk, bk // 2)], act_ref[act_rows, pl.ds(kb * bk + bk // 2, bk // 2)])
    else:
        ws = (decode.full(w_p_ref[e, n, kp], w_s_ref[e, n, ks]),)
        acts = (act_ref[act_rows, pl.ds(kb * bk, bk)],)
    parts = [_dot_t(w, a) if swap else _dot_t(a, w) for a, w in zip(acts, ws)]
    return sum(parts[1:], parts[0])


def _k_loop(loop, decode, scale_refs, e, n, *, bn, bk, num_k):
    """`loop(d)` (the program's K loop with decoder d) with `decode`, or with its quick decoder when every
    scale byte of the program's weight rows (expert e, rows n, in each of scale_refs) allows it: one
    decision per program, taken before the loop (the elementwise maximum over K blocks, then one reduction),
    so the loop itself has no branch."""
    if decode.quick is None:
        return loop(decode)
    gb = bk // dec.GROUP

    def block_max(kb, m):
        for ref in scale_refs:
            m = jnp.maximum(m, ref[e, n, pl.ds(kb * gb, gb)].astype(jnp.int32))
        return m

    top = jnp.max(jax.lax.fori_loop(0, num_k, block_max, jnp.zeros((bn, gb), jnp.int32)))
    return jax.lax.cond(top > decode.quick_max, lambda: loop(decode), lambda: loop(decode.quick))


def _grid(tiles: int, blocks: int, n_first: bool):
    """The launch grid, and the kernel's (tile, N block) from its program ids. CUDA runs the first axis
    fastest: with the N blocks first, the programs that read one tile's activation rows run back to back,
    so those rows stay in L2; with the tiles first they run `tiles` programs apart, and the weights streamed
    in between evict the rows (at 16 tokens the down kernel moved 2.15 GB from DRAM for 1.30 GB of weights:
    Nsight Compute on the H200, 2026-12-02; 7% faster at 16 tokens and 28% at 4096 with the N blocks
    first, docs/benchmarks.md)."""
    if n_first:
        return (blocks, tiles), lambda: (pl.program_id(1), pl.program_id(0))
    return (tiles, blocks), lambda: (pl.program_id(0), pl.program_id(1))


def _permuted_rows(start, size: int, perm8):
    """The row indices start + 8w + perm8[p] for positions 8w + p < size: the weight rows whose outputs land in
    a `decode.Decoder.perm8` order."""
    i = jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
    p = i % 8
    src = jnp.zeros_like(i)
    for k, v in enumerate(perm8):
        src = jnp.where(p == k, v, src)
    return start + i - p + src


def _gate_up_kernel(tile_expert_ref, slot_token_ref, x_ref, w1p_ref, w1s_ref, w3p_ref, w3s_ref, h_ref, *,
                    bm, bn, bk, num_k, num_experts, beta, linear_beta, decode, swap, split, ids):
    t, j = ids()
    e = tile_expert_ref[t]

    @pl.when(e < num_experts)
    def _():
        rows = slot_token_ref[pl.ds(t * bm, bm)]  # x is gathered by the tile's tokens
        n = pl.ds(j * bn, bn)
        # With a permuting decoder, h's columns come out in its order (down's K takes them so): column
        # 8w + p is computed from weight row 8w + perm8[p].
        n_w = n if decode.perm8 is None else _permuted_rows(j * bn, bn, decode.perm8)
        zero = jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32)

        def loop(d):
            prod = functools.partial(_block_product, x_ref, rows, e=e, n=n_w, bk=bk, decode=d, swap=swap,
                                     split=split)

            def step(kb, accs):
                a1, a3 = accs
                return a1 + prod(w1p_ref, w1s_ref, kb=kb), a3 + prod(w3p_ref, w3s_ref, kb=kb)

            return jax.lax.fori_loop(0, num_k, step, (zero, zero))

        a1, a3 = _k_loop(loop, decode, (w1s_ref, w3s_ref), e, n_w, bn=bn, bk=bk, num_k=num_k)
        h = situ(a1, a3, beta, linear_beta).astype(h_ref.dtype)
        h_ref[pl.ds(t * bm, bm), n] = h.T if swap else h


def _down_kernel(tile_expert_ref, slot_weight_ref, h_ref, w2p_ref, w2s_ref, y_ref, *,
                 bm, bn, bk, num_k, num_experts, decode, swap, split, ids):
    t, j = ids()
    e = tile_expert_ref[t]

    @pl.when(e < num_experts)
    def _():
        slots, n = pl.ds(t * bm, bm), pl.ds(j * bn, bn)
        def loop(d):
            prod = functools.partial(_block_product, h_ref, slots, w2p_ref, w2s_ref, e, n, bk=bk, decode=d,
                                     swap=swap, split=split)
            return jax.lax.fori_loop(0, num_k, lambda kb, acc: acc + prod(kb),
                                     jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))

        acc = _k_loop(loop, decode, (w2s_ref,), e, n, bn=bn, bk=bk, num_k=num_k)
        y_ref[slots, n] = (acc.T if swap else acc) * slot_weight_ref[slots][:, None]


# "asm" (decode.decode_asm, PTX): the same bits as "exact" (every byte and scale 1..254, and whole paths at
# K3 widths, compiled on the H200) in about 4 instructions per element; at 16 tokens gate+up 1.92x and down
# 1.54x faster than "fast" there (2026-12-02, docs/benchmarks.md). "asm1" runs asm's one-multiply variant in
# each program whose scale bytes are all <= 128 (real weights: the release's scales sit near 2^-7), else
# asm: the same bits as asm on the H200 at 16 and 512 tokens, gate+up 7-8% and down 9-15% faster (2026-12-02,
# sixth session). The interpreter runs "fast1" (the same bits) in its place.
DEFAULT_DECODE = "asm1"


def check_tiles(what: str, n: int, k: int, tiles: Tiles) -> None:
    """Raise ValueError unless the tiles divide [n, k] (bk a multiple of 32, powers of two for Triton)."""
    for name, size, dim in (("bn", tiles.bn, n), ("bk", tiles.bk, k)):
        if size < 16 or size & (size - 1) or dim % size:
            raise ValueError(f"{what}: {name}={size} must be a power of two >= 16 dividing {dim}")
    if tiles.bk % tiles.min_bk:
        raise ValueError(f"{what}: bk={tiles.bk} must be a multiple of {tiles.min_bk}"
                         + (" (split: one scale group per half)" if tiles.split else ""))


def _decoders(what: str, name: str, tiles: Tiles, interpret: bool) -> dec.Decoder:
    """The `decode.DECODERS` entry for `name`, or a ValueError naming the kernel and the choices. A GPU-only
    decoder ("asm", "asm1") runs as its bit-identical stand-in (`decode.GPU_ONLY`) in the interpreter and
    for tiles whose threads would hold fewer packed bytes than one asm instance takes."""
    if name not in dec.DECODERS:
        raise ValueError(f"{what}: decode={name!r} is not one of {sorted(dec.DECODERS)}")
    if name in dec.GPU_ONLY and (interpret or tiles.bn * tiles.bk // 2 < dec.ASM_PACK * 32 * tiles.num_warps):
        name = dec.GPU_ONLY[name]
    decoder = dec.DECODERS[name]
    if tiles.split and decoder.halves is None:
        raise ValueError(f"{what}: decode={name!r} has no halves for split tiles")
    return decoder


def gate_up(x, tile_expert, slot_token, w1p, w1s, w3p, w3s, beta, linear_beta, bm: int, tiles: Tiles,
            interpret: bool | None = None, decode: str = DEFAULT_DECODE):
    """x [N, L] bf16, w1/w3 packed [E, F, L/2] + scales [E, F, L/32] -> h [T*bm, F] in x's dtype, its columns
    in the decoder's `perm8` order if it has one (as `down` with the same decode takes h)."""
    num_experts, f, half = w1p.shape
    latent = 2 * half
    check_tiles("gate_up", f, latent, tiles)
    interpret = resolve_interpret(interpret)
    slots = slot_token.shape[0]
    grid, ids = _grid(slots // bm, f // tiles.bn, tiles.n_first)
    decoder = _decoders("gate_up", decode, tiles, interpret)
    kernel = functools.partial(_gate_up_kernel, bm=bm, bn=tiles.bn, bk=tiles.bk, num_k=latent // tiles.bk,
                               num_experts=num_experts, beta=beta, linear_beta=linear_beta, decode=decoder,
                               swap=tiles.swap, split=tiles.split, ids=ids)
    if decoder.perm8 is not None:  # one pass over the tokens' rows, in the decoded weights' K order
        x = dec.permute8(x, decoder.perm8)
    if tiles.split:
        x = split_columns(x, tiles.bk)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((slots, f), x.dtype), grid=grid,
        compiler_params=_CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="moe_gate_up_mxfp4",
    )(tile_expert, slot_token, x, w1p, w1s, w3p, w3s)


def down(h, tile_expert, slot_weight, w2p, w2s, bm: int, tiles: Tiles, interpret: bool | None = None,
         decode: str = DEFAULT_DECODE):
    """h [T*bm, F] bf16 (as `gate_up` with the same decode writes it: its columns in the decoder's `perm8`
    order if it has one), w2 packed [E, L, F/2] + scales [E, L, F/32] -> y [T*bm, L] fp32, each slot's row
    times its routing weight."""
    num_experts, latent, half = w2p.shape
    f = 2 * half
    check_tiles("down", latent, f, tiles)
    interpret = resolve_interpret(interpret)
    slots = h.shape[0]
    grid, ids = _grid(slots // bm, latent // tiles.bn, tiles.n_first)
    kernel = functools.partial(_down_kernel, bm=bm, bn=tiles.bn, bk=tiles.bk, num_k=f // tiles.bk,
                               num_experts=num_experts, decode=_decoders("down", decode, tiles, interpret),
                               swap=tiles.swap, split=tiles.split, ids=ids)
    if tiles.split:
        h = split_columns(h, tiles.bk)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((slots, latent), jnp.float32), grid=grid,
        compiler_params=_CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="moe_down_mxfp4",
    )(tile_expert, slot_weight, h, w2p, w2s)
