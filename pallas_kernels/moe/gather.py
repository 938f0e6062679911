"""The slots' activation planes of a block-aligned dispatch, gathered by a Pallas (Triton) kernel that writes
only the used tiles: the dispatch's slot count is the static worst case over all routings, and at 16384
tokens (K3's widths, top-16 of 896, tiles of 160) only 73% of it is in used tiles. An XLA row gather writes
every slot (2.9 GB there: 1.94 ms on the H100, the same as a copy of its output's bytes); this one leaves the
unused tiles' rows unwritten (undefined), which the grouped GEMMs skip and the combine never reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import resolve_interpret

_CompilerParams = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams

MAX_ROWS = 16  # slots per program: the largest power of two up to this dividing the tile (16 for the tiles of
#   `routed_mgpu.tile_slots`, multiples of 16)
MAX_COLS = 256  # plane columns per load (a power of two, as Triton's blocks are)


def _largest_power_of_two_dividing(n: int, most: int) -> int:
    size = most
    while n % size:
        size //= 2
    return size


def _kernel(tile_expert_ref, slot_token_ref, planes_ref, out_ref, *, tokens, slots, tile_t, rows, cols, num_cols,
            num_experts):
    r, p = pl.program_id(0), pl.program_id(1)

    @pl.when(tile_expert_ref[(r * rows) // tile_t] < num_experts)
    def _():
        src = slot_token_ref[pl.ds(r * rows, rows)] + p * tokens
        dst = pl.ds(p * slots + r * rows, rows)
        for c in range(num_cols):
            out_ref[dst, pl.ds(c * cols, cols)] = planes_ref[src, pl.ds(c * cols, cols)]


def slot_planes(token_planes, tile_expert, slot_token, tile_t: int, num_experts: int, *,
                interpret: bool | None = None):
    """token_planes [P, N, C] (`wgmma_mxfp4.token_planes`: P = 2, C = K/2; `token_words`: P = 1, C = K), the
    dispatch's tile_expert [T] and slot_token [T * tile_t] -> the slots' planes [P, T * tile_t, C], the rows of
    unused tiles (tile_expert == E) undefined. C needs a power-of-two divisor of at least 16."""
    num_planes, tokens, half = token_planes.shape
    slots = slot_token.shape[0]
    if slots != tile_expert.shape[0] * tile_t:
        raise ValueError(f"slot_planes: slot_token {slot_token.shape} must be {tile_expert.shape[0]} tiles of "
                         f"tile_t = {tile_t}")
    rows, cols = _largest_power_of_two_dividing(tile_t, MAX_ROWS), _largest_power_of_two_dividing(half, MAX_COLS)
    if cols < 16:
        raise ValueError(f"slot_planes: token_planes {token_planes.shape}: its row length ({half}) needs a "
                         f"power-of-two divisor >= 16")
    kernel = functools.partial(_kernel, tokens=tokens, slots=slots, tile_t=tile_t, rows=rows, cols=cols,
                               num_cols=half // cols, num_experts=num_experts)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((num_planes * slots, half), token_planes.dtype),
        grid=(slots // rows, num_planes), compiler_params=_CompilerParams(num_warps=4, num_stages=1),
        interpret=resolve_interpret(interpret), name="moe_slot_planes",
    )(tile_expert.astype(jnp.int32), slot_token.astype(jnp.int32), token_planes.reshape(num_planes * tokens, half))
    return out.reshape(num_planes, slots, half)
