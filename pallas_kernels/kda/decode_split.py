"""The KDA decode step in three launches (`kda_decode(..., tuning=dict(split=True, block_v=B))`), fla's layout:

1. `_prologue_kernel`, one program per (sequence, head): the q/k/v causal conv + SiLU over the slot's tails,
   the gate, the q/k L2 norm and beta (the fused kernel's prologue, the same code), written as fp32 rows
   [N, H, 5, K]: q, k, v, the log decay g, and beta repeated along the row; the new conv tails in place.
2. `_state_kernel`, one program per (value tile, sequence, head): the decay, the delta-rule update and the
   read on a [K, B] slice of the state, in place, and its un-normed fp32 output slice.
3. The gated RMSNorm over V, by XLA (`kimik3_jax.ops.kda.gated_output_norm`, the op's own function).

Why: the one-launch kernels put the prologue in front of the state stream, once per head (whole V: about 110
registers held before the first state tile) or once per value tile (the tiles kernel repeats the q/k conv
and norms V / B times and ends on a cross-program counter). Here the state programs carry only the state
arithmetic, as fla's `fused_recurrent_kda` does; the price is two more launches and 5 K fp32 per (sequence,
head) written and read back (2.5 KB against the 128 KB of state traffic at K = V = 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kimik3_jax.ops.kda import gated_output_norm
from pallas_kernels.kda.common import compiler_params
from pallas_kernels.kda.decode_parts import PRE_ROWS, grid, head_inputs, head_loads, state_step
from pallas_kernels.kda.decode_tma import state_tma


def _prologue_kernel(slots_ref, lens_ref, alog_ref, qkv_ref, w_ref, conv_ref, g_ref, b_ref, pre_ref, tails_out, *,
                     lower_bound, gate, qk_norm, ids):
    n, h = ids()
    dk = pre_ref.shape[-1]
    slot = slots_ref[n]
    loaded = head_loads(conv_ref, qkv_ref, w_ref, g_ref, b_ref, alog_ref, slot=slot, n=n, h=h, dk=dk, gate=gate)
    q, k, v, g, beta, tails = head_inputs(loaded, qkv_ref.dtype, tails_out.dtype, active=lens_ref[n] > 0,
                                          lower_bound=lower_bound, gate=gate, qk_norm=qk_norm)
    for i, x in enumerate((q, k, v, g, jnp.broadcast_to(beta, (dk,)))):
        pre_ref[n, h, i, :] = x
    for j, r, t in tails:  # after every load of the tails (the pool is aliased)
        tails_out[slot, j, r, pl.ds(h * dk, dk)] = t


def _state_kernel(slots_ref, lens_ref, pre_ref, s_ref, o_raw, s_out, *, bv, ids):
    t, n, h = ids()
    dk = s_ref.shape[-2]
    cols = pl.ds(t * bv, bv)
    # The slot, the length and the rows before the state (which waits on its slot), v after it: each load is
    # issued at the start, its latency under the slot's and the state's. Read where they were used (beta a
    # reduction over its row, the length just before the state's store), the program waited on memory three
    # times in turn (offline SASS, docs/benchmarks.md, thirty-seventh session).
    slot, active = slots_ref[n], lens_ref[n] > 0
    q, k, g = pre_ref[n, h, 0, :], pre_ref[n, h, 1, :], pre_ref[n, h, 3, :]
    beta = pre_ref[n, h, 4, 0]  # the row holds beta K times: one is read
    s0 = s_ref[slot, h, :, cols]
    v = pre_ref[n, h, 2, cols]
    s, o_raw[n, h, cols] = state_step(s0, q, k, v, g, beta)
    # an inactive row (g = 0, beta = 0) leaves its state as it is: not written at all
    plt.store(s_out.at[slot, h, :, cols], s.astype(s_out.dtype), mask=jnp.broadcast_to(active, (dk, bv)))


def prologue(qkv, conv_w, conv_pool, slots, g, beta, lens, a_log_arr, *, dk, tuning, interpret, lower_bound,
             gate_on, qk_norm):
    """Launch 1: -> (pre [N, H, PRE_ROWS, K] fp32, conv_pool with the new tails in place)."""
    nb, nh = qkv.shape[0], qkv.shape[-1] // dk
    head_grid, head_ids = grid(nb, nh, tuning["heads_fastest"])
    return pl.pallas_call(
        functools.partial(_prologue_kernel, lower_bound=lower_bound, gate=gate_on, qk_norm=qk_norm, ids=head_ids),
        out_shape=(jax.ShapeDtypeStruct((nb, nh, PRE_ROWS, dk), jnp.float32),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)),
        grid=head_grid, input_output_aliases={5: 1}, interpret=interpret, name="kda_decode_prologue",
        compiler_params=compiler_params(tuning["num_warps"], tuning["num_stages"]),
    )(slots, lens, a_log_arr, qkv, conv_w, conv_pool, g, beta)


def state(slots, lens, pre, s_pool, *, bv, tuning, interpret):
    """Launch 2: -> (the un-normed output [N, H, V] fp32, s_pool updated in place). With tuning["tma"], the
    Mosaic GPU kernel of `decode_tma.py` (jax 0.11)."""
    if tuning.get("tma"):
        return state_tma(slots, lens, pre, s_pool, bv=bv, heads_fastest=tuning["heads_fastest"],
                         interpret=interpret)
    nb, nh = pre.shape[:2]
    dv = s_pool.shape[-1]
    tile_grid, tile_ids = grid(nb, nh, tuning["heads_fastest"], (dv // bv,))
    return pl.pallas_call(
        functools.partial(_state_kernel, bv=bv, ids=tile_ids),
        out_shape=(jax.ShapeDtypeStruct((nb, nh, dv), jnp.float32), jax.ShapeDtypeStruct(s_pool.shape, s_pool.dtype)),
        grid=tile_grid, input_output_aliases={3: 1}, interpret=interpret, name="kda_decode_state",
        compiler_params=compiler_params(tuning["num_warps"], tuning["num_stages"]),
    )(slots, lens, pre, s_pool)


def decode_split(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, lens, a_log_arr, *, bv, eps, tuning,
                 interpret, lower_bound, gate_on, qk_norm):
    """The three launches; both pools in place (aliased). Returns (o, conv_pool, s_pool) as `kda_decode`."""
    pre, conv_pool = prologue(qkv, conv_w, conv_pool, slots, g, beta, lens, a_log_arr, dk=s_pool.shape[-2],
                              tuning=tuning, interpret=interpret, lower_bound=lower_bound, gate_on=gate_on,
                              qk_norm=qk_norm)
    o_raw, s_pool = state(slots, lens, pre, s_pool, bv=bv, tuning=tuning, interpret=interpret)
    return gated_output_norm(o_raw, norm_w, gate, eps, qkv.dtype), conv_pool, s_pool
