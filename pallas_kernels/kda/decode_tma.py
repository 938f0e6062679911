"""The KDA decode step on Mosaic GPU with the state through shared memory (`kda_decode(..., tuning=dict(tma=True))`):
each program's state tile comes in by TMA, 32 columns at a time, and goes back the same way. Two launches, as
the Triton kernels have them:

- `decode_tma`, the whole step in one launch, a program per (head, sequence), whole V (below SPLIT_FROM rows, or
  split=False): the state's copies are issued first, and the prologue (the q/k/v causal conv + SiLU over the
  slot's tails, the new tails stored in place, the q/k L2 norm, the gate and beta) runs while they are in
  flight, since no register waits for them; then the recurrence, block by block, and the gated RMSNorm of the
  output row.
- `state_tma`, the split launches' state kernel (split=True: `decode_split.state`'s contract), a program per
  (value tile, head, sequence), its row's q, k, v, g and beta copied in from the prologue kernel's output.

Why (docs/benchmarks.md, thirty-sixth to thirty-eighth sessions): the Triton kernels hold the state tile in
registers from load to store. At two whole-V programs an SM (202 registers a thread) an SM has at most 128 KB
of state in flight, and on the H200 the Triton state kernel streams at 79-84% of the copy bandwidth (92-96% on
the H100); the split's prologue launch is a further 7-8% of the step. Here the tile lands in shared memory (up
to 227 KB an SM) with no register held for it, a program computes on its first columns while the rest are
still arriving, and each column block is stored as soon as it is done.

The arithmetic is the Triton kernels', by the same functions of `decode_parts`: `state_step` per block (the
state in WGMMA's layout, q, k and g in its row layout), `conv_silu` and `head_prologue` for the prologue and
`gated_norm` for the output, one element a thread. An inactive row's state and tails are not written.

Needs jax 0.11 (the GPU machine's): `plgpu.kernel` with the pools passed as mutable references (its custom call
aliases them: updated in place) and the Mosaic GPU interpreter for the CPU tests; under jax 0.10 it raises
`Unsupported`. fp32 state pools, K = V a multiple of 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kimik3_jax.ops.impl import Unsupported
from pallas_kernels.kda.decode_parts import PRE_ROWS, conv_silu, gated_norm, head_prologue, state_step

COLS = 32  # a block's columns: 128 bytes of fp32, one row of the 128-byte swizzle


def available() -> bool:
    """Whether this jax has what the kernels need (jax 0.11: the Mosaic GPU interpreter and kernels that write
    a reference in place)."""
    return hasattr(plgpu, "InterpretGPUParams")


def _cols(start, size=COLS):
    return pl.ds(start, size)


def _drain():
    """Before the program exits: its stores have read their shared memory (which the next program on the SM
    takes). Their writes to memory are not waited for, as CUTLASS's TMA epilogues do: the launch's end makes
    them visible, and a program that waited for them would hold its 64 KB of shared memory for a round trip."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _fetch_state(s_ref, tile, bars, slot, h, col0):
    """Issue the copies of the state's column blocks [K, 32] at col0, each on its own barrier."""
    for c in range(tile.shape[0]):
        plgpu.copy_gmem_to_smem(s_ref.at[slot, h, :, _cols(col0 + c * COLS)], tile.at[c], bars.at[c])


def _recurrence(s_ref, tile, bars, rows, o_smem, *, slot, h, col0, beta, active):
    """`decode_parts.state_step` on the tile's blocks as they arrive: rows holds q, k, v (from column 0 of the
    state's V) and g in rows 0 to 3; each new block is stored by TMA (an active row only) and its output slice
    written to o_smem."""
    wg = plgpu.Layout.WGMMA
    along_k, along_v = wg.reduce(1), wg.reduce(0)
    q, k, g = (plgpu.load(rows.at[i], layout=along_k) for i in (0, 1, 3))
    for c in range(tile.shape[0]):
        v = plgpu.load(rows.at[2, _cols(col0 + c * COLS)], layout=along_v)
        plgpu.barrier_wait(bars.at[c])
        tile.at[c][...], o_smem[_cols(c * COLS)] = state_step(plgpu.load(tile.at[c], layout=wg), q, k, v, g, beta)
        plgpu.commit_smem()

        @pl.when(active)  # an inactive row's state is not written at all (another row may hold its slot)
        def _store(c=c):
            plgpu.copy_smem_to_gmem(tile.at[c], s_ref.at[slot, h, :, _cols(col0 + c * COLS)])


def _state_body(slots_ref, lens_ref, pre_ref, s_ref, o_ref, tile, rows, o_smem, row_bar, bars, *, bv):
    t, n, h = (jax.lax.axis_index(a) for a in ("t", "n", "h"))
    slot = slots_ref[n]
    plgpu.copy_gmem_to_smem(pre_ref.at[n, h], rows, row_bar)
    _fetch_state(s_ref, tile, bars, slot, h, t * bv)
    active = lens_ref[n] > 0
    plgpu.barrier_wait(row_bar)
    beta = rows[4, 0]  # the row holds beta K times: one is read (as the Triton kernel does)
    _recurrence(s_ref, tile, bars, rows, o_smem, slot=slot, h=h, col0=t * bv, beta=beta, active=active)
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, h, _cols(t * bv, bv)])
    _drain()


def _decode_body(slots_ref, lens_ref, alog_ref, qkv_ref, w_ref, g_ref, b_ref, gate_ref, nw_ref, conv_ref, s_ref,
                 o_ref, tile, rows, o_smem, bars, *, lower_bound, gate, qk_norm, eps):
    n, h = jax.lax.axis_index("n"), jax.lax.axis_index("h")
    dk = rows.shape[1]
    width = w_ref.shape[-1]
    one = plgpu.Layout.WG_STRIDED((dk,), 1)  # a [K] vector, an element a thread
    load = lambda ref: plgpu.load(ref, layout=one)  # noqa: E731
    chans = pl.ds(h * dk, dk)
    slot, active = slots_ref[n], lens_ref[n] > 0
    # Every load that does not wait on the slot is issued with it, so that their latency runs under the slot's
    # round trip; then the state's copies (the slot's first use), then the slot's conv tails. The prologue
    # computes while the state arrives.
    new = [load(qkv_ref.at[n, j, chans]) for j in range(3)]
    taps = [[load(w_ref.at[j, chans, r]) for r in range(width)] for j in range(3)]
    g, b, gate_row, nw = load(g_ref.at[n, h]), b_ref[n, h], load(gate_ref.at[n, h]), load(nw_ref)
    a_log = alog_ref[h] if gate else None
    _fetch_state(s_ref, tile, bars, slot, h, 0)
    tails = [[load(conv_ref.at[slot, j, r, chans]) for r in range(width - 1)] for j in range(3)]
    ys = []
    for j in range(3):  # decode_parts.head_inputs, with the tails stored here
        hist = tails[j] + [new[j]]
        ys.append(conv_silu(hist, taps[j], qkv_ref.dtype))

        @pl.when(active)  # the tail moves by one token; an inactive row's is not written (it keeps its tail)
        def _tails(j=j, hist=hist):
            for r in range(width - 1):
                conv_ref.at[slot, j, r, chans][...] = hist[r + 1].astype(conv_ref.dtype)
    q, k, v = ys
    q, k, g, beta = head_prologue(q, k, (g, b, a_log), active, lower_bound, gate, qk_norm)
    for i, x in enumerate((q, k, v, g)):
        rows[i, :] = x
    plgpu.commit_smem()
    _recurrence(s_ref, tile, bars, rows, o_smem, slot=slot, h=h, col0=0, beta=beta, active=active)
    o_ref.at[n, h][...] = gated_norm(load(o_smem), nw, gate_row, eps).astype(o_ref.dtype)
    _drain()


def check(s_pool, dk, bv):
    """Raises Unsupported unless this jax runs the kernels on this pool at value tiles of bv."""
    if not available():
        raise Unsupported(f"kda_decode kernel: tma needs jax >= 0.11 (Mosaic GPU kernels that update a pool in "
                          f"place), this is jax {jax.__version__}")
    dv = s_pool.shape[-1]
    if jnp.dtype(s_pool.dtype) != jnp.float32:
        raise Unsupported(f"kda_decode kernel: tma takes fp32 state pools, got {jnp.dtype(s_pool.dtype)}")
    if dk % 64 or dk != dv or bv % COLS or dv % bv:
        raise Unsupported(f"kda_decode kernel: tma needs K = V, a multiple of 64, and a value tile that is a "
                          f"multiple of {COLS} dividing V: state {s_pool.shape[-2:]}, block_v {bv}")


def _grid(nb, nh, heads_fastest, tiles=()):
    """(grid, names): a row's heads next to each other (heads_fastest) or a head's rows, a head's value tiles
    next to each other. Mosaic GPU runs the last axis fastest (the Triton grids of `decode_parts.grid` the first)."""
    names, sizes = (("n", "h"), (nb, nh)) if heads_fastest else (("h", "n"), (nh, nb))
    return sizes + tuple(tiles), names + ("t",) * len(tiles)


def _scratch(dk, bv):
    swizzled = (plgpu.TilingTransform((8, COLS)), plgpu.SwizzleTransform(128))
    return [plgpu.SMEM((bv // COLS, dk, COLS), jnp.float32, transforms=swizzled),
            plgpu.SMEM((PRE_ROWS, dk), jnp.float32), plgpu.SMEM((bv,), jnp.float32)]


def state_tma(slots, lens, pre, s_pool, *, bv, heads_fastest=True, interpret=False):
    """The split decode's state launch: -> (the un-normed output [N, H, V] fp32, s_pool updated in place).
    slots, lens: [N] int32; pre: [N, H, 5, K] fp32 (`decode_split.prologue`); s_pool: [P, H, K, V] fp32; bv:
    the value columns a program takes, a multiple of 32 dividing V. interpret: the Mosaic GPU interpreter."""
    nb, nh, rows, dk = pre.shape
    check(s_pool, dk, bv)
    if jnp.dtype(pre.dtype) != jnp.float32 or rows != PRE_ROWS:
        raise Unsupported(f"kda_decode kernel: tma's state launch takes the prologue's fp32 rows [N, H, "
                          f"{PRE_ROWS}, K], got {pre.shape} {jnp.dtype(pre.dtype)}")
    grid, names = _grid(nb, nh, heads_fastest, (s_pool.shape[-1] // bv,))
    kernel = plgpu.kernel(
        functools.partial(_state_body, bv=bv), out_type=jax.ShapeDtypeStruct((nb, nh, s_pool.shape[-1]), jnp.float32),
        grid=grid, grid_names=names, interpret=plgpu.InterpretGPUParams() if interpret else False,
        scratch_types=_scratch(dk, bv) + [plgpu.Barrier(num_arrivals=1),
                                          plgpu.Barrier(num_arrivals=1, num_barriers=bv // COLS)])
    pool = jax.new_ref(s_pool)
    o_raw = kernel(slots, lens, pre, pool)
    return o_raw, jax.freeze(pool)


def decode_tma(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, lens, a_log_arr, *, eps, lower_bound,
               gate_on, qk_norm, heads_fastest=True, interpret=False):
    """The whole step in one launch: -> (o [N, H, V] in qkv's dtype, conv_pool, s_pool), both pools updated in
    place; the arguments as `decode.kda_decode` passes them to its kernels."""
    nb, nh, dk = g.shape
    check(s_pool, dk, s_pool.shape[-1])
    grid, names = _grid(nb, nh, heads_fastest)
    kernel = plgpu.kernel(
        functools.partial(_decode_body, lower_bound=lower_bound, gate=gate_on, qk_norm=qk_norm, eps=eps),
        out_type=jax.ShapeDtypeStruct((nb, nh, s_pool.shape[-1]), qkv.dtype), grid=grid, grid_names=names,
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        scratch_types=_scratch(dk, dk) + [plgpu.Barrier(num_arrivals=1, num_barriers=dk // COLS)])
    conv, pool = jax.new_ref(conv_pool), jax.new_ref(s_pool)
    o = kernel(slots, lens, a_log_arr, qkv, conv_w, g, beta, gate, norm_w, conv, pool)
    return o, jax.freeze(conv), jax.freeze(pool)
