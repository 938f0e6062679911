"""The fused KDA decode step as persistent programs (`kda_decode(..., tuning=dict(split=False, programs=P,
block_v=B))`): one launch, P programs, each over the heads p, p + P, p + 2P, ... (head i: head i % H of row
i // H), every head in value tiles of B taken one after another.

Each program keeps one state tile in flight: the next tile's loads (the state slice and its value channels'
conv inputs; after a head's last tile, the next head's first tile with its q/k conv inputs, gate row and
beta, and the row of the head after it) are issued before this tile's arithmetic and stores. A head's q/k
conv + SiLU, norms and gate are computed once, before its first tile; its output's gated RMSNorm after its
last, from the tiles' un-normed outputs held in registers. So the step does in one launch what the split
launches do in three (`decode_split.py`), with no program waiting on its slot, its inputs and then its
state before it computes, as the one-program-a-head kernel does (`decode.py`). Past the last head the state's
loads and every store are masked off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda.common import cdiv, compiler_params
from pallas_kernels.kda.decode_parts import conv_inputs, conv_silu, gate_inputs, head_prologue, state_step


def _decode_loop_kernel(slots_ref, lens_ref, alog_ref, qkv_ref, w_ref, conv_ref, s_ref, g_ref, b_ref, gate_ref,
                        nw_ref, o_ref, tails_out, s_out, *, bv, programs, rounds, lower_bound, gate, qk_norm, eps):
    p = pl.program_id(0)
    nb, nh = slots_ref.shape[0], s_ref.shape[1]
    dk, dv = s_ref.shape[-2:]
    nv = dv // bv
    total = nb * nh
    f32, dtype = jnp.float32, qkv_ref.dtype

    def where(i):  # -> (in range, row, head), clamped to the last head
        c = jnp.minimum(i, total - 1)
        return i < total, c // nh, c % nh

    def row(i):  # the slot and length of head i's row: loaded with the head before it
        n = where(i)[1]
        return slots_ref[n], lens_ref[n]

    def load_tile(at, c):
        valid, slot, n, h = at
        cols = pl.ds(c * bv, bv)
        s0 = plt.load(s_ref.at[slot, h, :, cols], mask=jnp.broadcast_to(valid, (dk, bv)), other=0.0)
        return s0, conv_inputs(conv_ref, qkv_ref, w_ref, slot, n, 2, pl.ds(h * dk + c * bv, bv)), gate_ref[n, h, cols]

    def load_head(i, slot_len):
        valid, n, h = where(i)
        slot, length = slot_len
        at = (valid, slot, n, h)
        chans = pl.ds(h * dk, dk)
        qk = [conv_inputs(conv_ref, qkv_ref, w_ref, slot, n, j, chans) for j in range(2)]
        return at, length > 0, gate_inputs(g_ref, b_ref, alog_ref, n, h, gate), qk, load_tile(at, 0), row(i + programs)

    def store_tails(at, active, j, chans, hist):  # the tail moves by one token (an inactive row keeps its tail)
        valid, slot = at[:2]
        keep, mask = jnp.broadcast_to(active, hist[0].shape), jnp.broadcast_to(valid, hist[0].shape)
        for r in range(len(hist) - 1):  # the indices as int32: plt.store's masked form refuses Python ints
            new = jnp.where(keep, hist[r + 1], hist[r]).astype(tails_out.dtype)
            plt.store(tails_out.at[slot, jnp.int32(j), jnp.int32(r), chans], new, mask=mask)

    nws = [nw_ref[pl.ds(c * bv, bv)].astype(f32) for c in range(nv)]

    def body(r, cur):
        at, active, raw, qk, tile, nxt_row = cur
        valid, slot, n, h = at
        i = p + r * programs
        (hq, wq), (hk, wk) = qk
        q, k, g, beta = head_prologue(conv_silu(hq, wq, dtype), conv_silu(hk, wk, dtype), raw, active, lower_bound,
                                      gate, qk_norm)
        outs = []
        for c in range(nv):
            nxt = load_tile(at, c + 1) if c + 1 < nv else load_head(i + programs, nxt_row)
            s0, (hv, wv), gate_c = tile
            s, o = state_step(s0, q, k, conv_silu(hv, wv, dtype), g, beta)
            plt.store(s_out.at[slot, h, :, pl.ds(c * bv, bv)], s.astype(s_out.dtype),
                      mask=jnp.broadcast_to(valid & active, (dk, bv)))
            store_tails(at, active, 2, pl.ds(h * dk + c * bv, bv), hv)
            outs.append((o, gate_c))
            tile = nxt if c + 1 < nv else None
        scale = jax.lax.rsqrt(sum(jnp.sum(o * o) for o, _ in outs) / dv + eps)
        for c, (o, gate_c) in enumerate(outs):
            y = o * scale * nws[c] * jax.nn.sigmoid(gate_c.astype(f32))
            plt.store(o_ref.at[n, h, pl.ds(c * bv, bv)], y.astype(o_ref.dtype), mask=jnp.broadcast_to(valid, (bv,)))
        for j, (hist, _) in enumerate(qk):
            store_tails(at, active, j, pl.ds(h * dk, dk), hist)
        return nxt

    jax.lax.fori_loop(0, rounds, body, load_head(p, row(p)))


def decode_loop(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, lens, a_log_arr, *, bv, programs, eps,
                tuning, interpret, lower_bound, gate_on, qk_norm):
    """The persistent launch; both pools in place (aliased). Returns (o, conv_pool, s_pool) as `kda_decode`."""
    nb, nh, dv = qkv.shape[0], s_pool.shape[1], s_pool.shape[-1]
    programs = min(int(programs), nb * nh)
    kernel = functools.partial(_decode_loop_kernel, bv=bv, programs=programs, rounds=cdiv(nb * nh, programs),
                               lower_bound=lower_bound, gate=gate_on, qk_norm=qk_norm, eps=eps)
    out_shape = (jax.ShapeDtypeStruct((nb, nh, dv), qkv.dtype),
                 jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
                 jax.ShapeDtypeStruct(s_pool.shape, s_pool.dtype))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(programs,), input_output_aliases={5: 1, 6: 2}, interpret=interpret,
        name="kda_decode_loop", compiler_params=compiler_params(tuning["num_warps"], tuning["num_stages"]),
    )(slots, lens, a_log_arr, qkv, conv_w, conv_pool, s_pool, g, beta, gate, norm_w)
