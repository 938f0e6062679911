"""The split KDA decode's state launch on Mosaic GPU (`kda_decode(..., tuning=dict(split=True, state_tma=True))`):
the same contract as `decode_split.state`, with each program's [K, bv] state tile brought into shared memory by
TMA, 32 columns at a time, and sent back the same way.

Why (docs/benchmarks.md, thirty-sixth to thirty-eighth sessions): the Triton state kernel holds its tile in
registers from load to store. At two whole-V programs an SM (202 registers a thread) an SM has at most 128 KB of
state in flight, and on the H200 that kernel streams at 79-84% of the copy bandwidth (92-96% on the H100). Here
the tile lands in shared memory (up to 227 KB an SM) with no register held for it, and a program computes on
its first columns while the rest are still arriving; each column block is stored as soon as it is done.

A program, one per (value tile, head, sequence): its row's slot (the state's address waits on it), then one TMA
copy for the row's prologue output `pre[n, h]` ([5, K]: q, k, v, g, beta) and one a 32-column block of the
state, each on its own barrier; per block, the decay and the delta-rule update in registers (WGMMA layout, the
K-vectors broadcast along the columns), the block written back to its shared-memory buffer and stored by TMA
(not at all for an inactive row, whose state stays as it is), and its share of the un-normed output. The
arithmetic is `decode_parts.state_step`'s, in the same order.

Needs jax 0.11 (the GPU machine's): `plgpu.kernel` with the pool passed as a mutable reference (the kernel's
custom call aliases it: updated in place) and the Mosaic GPU interpreter for CPU tests. Under jax 0.10 it
raises `Unsupported`. fp32 state pools only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kimik3_jax.ops.impl import Unsupported

COLS = 32  # a block's columns: 128 bytes of fp32, one row of the 128-byte swizzle
PRE_ROWS = 5  # q, k, v, g, beta (decode_split.PRE_ROWS)


def available() -> bool:
    """Whether this jax has what the kernel needs (jax 0.11: the Mosaic GPU interpreter and kernels that write
    a reference in place)."""
    return hasattr(plgpu, "InterpretGPUParams")


def _cols(start, size=COLS):
    return pl.ds(start, size)


def _body(slots_ref, lens_ref, pre_ref, s_ref, o_ref, tile, rows, o_smem, row_bar, col_bar, *, bv):
    t = jax.lax.axis_index("t")
    n, h = jax.lax.axis_index("n"), jax.lax.axis_index("h")
    dk = tile.shape[1]
    blocks = bv // COLS
    slot = slots_ref[n]
    plgpu.copy_gmem_to_smem(pre_ref.at[n, h], rows, row_bar)
    for c in range(blocks):  # every block's copy is issued before any is waited on
        plgpu.copy_gmem_to_smem(s_ref.at[slot, h, :, _cols(t * bv + c * COLS)], tile.at[c], col_bar.at[c])
    active = lens_ref[n] > 0
    wg = plgpu.Layout.WGMMA
    along_k, along_v = wg.reduce(1), wg.reduce(0)
    plgpu.barrier_wait(row_bar)
    q, k, g = (plgpu.load(rows.at[i], layout=along_k) for i in (0, 1, 3))
    decay = jnp.exp(g)
    by_k = lambda x: jax.lax.broadcast_in_dim(x, (dk, COLS), (0,))  # noqa: E731
    by_v = lambda x: jax.lax.broadcast_in_dim(x, (dk, COLS), (1,))  # noqa: E731
    beta = rows[4, 0]  # the row holds beta K times: one is read (as the Triton kernel does)
    for c in range(blocks):
        v = plgpu.load(rows.at[2, _cols(t * bv + c * COLS)], layout=along_v)
        plgpu.barrier_wait(col_bar.at[c])
        s = plgpu.load(tile.at[c], layout=wg) * by_k(decay)  # decode_parts.state_step, column block c
        pred = jnp.sum(s * by_k(k), axis=0)
        s = s + by_k(k) * by_v(beta * (v - pred))
        o_smem[_cols(c * COLS)] = jnp.sum(s * by_k(q), axis=0)
        tile.at[c][...] = s
        plgpu.commit_smem()

        @pl.when(active)  # an inactive row's state is not written at all (another row may hold its slot)
        def _store(c=c):
            plgpu.copy_smem_to_gmem(tile.at[c], s_ref.at[slot, h, :, _cols(t * bv + c * COLS)])
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, h, _cols(t * bv, bv)])
    plgpu.wait_smem_to_gmem(0)  # the buffers stay until the last store has read them


def state_tma(slots, lens, pre, s_pool, *, bv, heads_fastest=True, interpret=False):
    """Launch 2 of the split decode on Mosaic GPU: -> (the un-normed output [N, H, V] fp32, s_pool updated in
    place). slots, lens: [N] int32; pre: [N, H, 5, K] fp32 (`decode_split.prologue`); s_pool: [P, H, K, V] fp32;
    bv: the value columns a program takes, a multiple of 32 dividing V. interpret: the Mosaic GPU interpreter
    (jax 0.11)."""
    if not available():
        raise Unsupported(f"kda_decode kernel: state_tma needs jax >= 0.11 (Mosaic GPU kernels that update a "
                          f"pool in place), this is jax {jax.__version__}")
    nb, nh, rows, dk = pre.shape
    dv = s_pool.shape[-1]
    if jnp.dtype(s_pool.dtype) != jnp.float32 or jnp.dtype(pre.dtype) != jnp.float32:
        raise Unsupported(f"kda_decode kernel: state_tma takes fp32 state pools and rows, got s_pool "
                          f"{jnp.dtype(s_pool.dtype)}, pre {jnp.dtype(pre.dtype)}")
    if bv % COLS or dv % bv or rows != PRE_ROWS or s_pool.shape[1:3] != (nh, dk) or dk % 64 or dk != dv:
        raise Unsupported(f"kda_decode kernel: state_tma needs K = V, a multiple of 64, and a value tile that is a "
                          f"multiple of {COLS} dividing V: s_pool {s_pool.shape}, pre {pre.shape}, block_v {bv}")
    order = (("t", "h", "n"), (dv // bv, nh, nb)) if heads_fastest else (("t", "n", "h"), (dv // bv, nb, nh))
    swizzled = (plgpu.TilingTransform((8, COLS)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        functools.partial(_body, bv=bv),
        out_type=jax.ShapeDtypeStruct((nb, nh, dv), jnp.float32), grid=order[1], grid_names=order[0],
        scratch_types=[plgpu.SMEM((bv // COLS, dk, COLS), jnp.float32, transforms=swizzled),
                       plgpu.SMEM((PRE_ROWS, dk), jnp.float32), plgpu.SMEM((bv,), jnp.float32),
                       plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1, num_barriers=bv // COLS)],
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    pool = jax.new_ref(s_pool)
    o_raw = kernel(slots, lens, pre, pool)
    return o_raw, jax.freeze(pool)
