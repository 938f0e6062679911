"""Pallas (Triton-style) fused KDA decode step: one launch, one program per (sequence, head).

Each program reads its slot's conv tails for the head's channels and its [K, V] fp32 state once, does
the q/k/v causal conv + SiLU (rounded to the activation dtype, as the reference), the gate, the q/k L2
norm, the decay + delta-rule update + read, the gated RMSNorm of the output, and writes the new state and
the new conv tails back into their slots (both pools are aliased inputs/outputs, updated in place when the
caller donates them). Bandwidth-bound: the state is read and written once. Implements
`kimik3_jax.ops.kda.kda_decode`; refuses float64 and odd head dims.

Value tiles (`tuning=dict(block_v=B)`, B a power of two below V that divides it), still one launch: the grid
becomes (V // B, H, N) (or (V // B, N, H)), more and smaller programs (a [K, B] slice of the state each, fewer
registers). The prediction, the delta-rule update and the read are independent per value column, so each
program recomputes the head's q/k conv + SiLU, the gate and the q/k L2 norm (K channels each), convolves only
its B value channels, updates and reads only its state slice, and writes its un-normed fp32 output slice. The
output RMSNorm needs the whole value row, and the q/k tails are read by every tile of the head: so each
program then increments a per-(sequence, head) counter (an atomic add after a CTA barrier: the grid-sync
pattern, which makes the output slice visible before the count), then stores its state slice and its value
channels' conv tails (no other program reads them), and the program that brings the count to V // B, the
head's last, norms the row and writes the q/k tails.

`tuning=dict(split=True)` takes neither: three launches, a prologue kernel per head, a state-only kernel per
value tile, and the norm by XLA (`decode_split.py`). The default (split=None) splits from SPLIT_FROM sequences
on and keeps the one launch below.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kimik3_jax.ops.impl import Unsupported, register
from pallas_kernels.common import resolve_interpret
from pallas_kernels.kda.common import compiler_params
from pallas_kernels.kda.decode_parts import conv as _conv
from pallas_kernels.kda.decode_parts import gate_inputs as _gate_inputs
from pallas_kernels.kda.decode_parts import gated_norm as _gated_norm
from pallas_kernels.kda.decode_parts import grid as _grid
from pallas_kernels.kda.decode_parts import head_inputs as _head_inputs
from pallas_kernels.kda.decode_parts import head_loads as _head_loads
from pallas_kernels.kda.decode_parts import head_prologue as _head_prologue
from pallas_kernels.kda.decode_parts import state_step as _state_step
from pallas_kernels.kda.decode_split import decode_split
from pallas_kernels.kda.decode_tma import check as tma_check
from pallas_kernels.kda.decode_tma import decode_tma

# block_v None: whole V per program. 4 warps: 1.7x faster than 8 at N = 32, H = 96 on the H200 (2026-11-29).
# tails_in_place (None or True: in place): the kernel writes the new conv tails into their slots of the aliased
# conv pool; False (whole-V kernel only): into a fresh [N, ...] output that a scatter after the kernel puts in
# place (15% of a step at N = 32, H = 96). In place was checked on the H200 at N = 1, 32 and 256, untouched
# slots bit for bit (tests/gpu/test_kda_gpu.py, 2026-12-02).
# heads_fastest: the launch runs a sequence's heads back to back (grid (..., H, N)), so that consecutive programs
# read adjacent states of one slot, instead of the same head of every sequence (grid (..., N, H)). On the H200
# (2026-12-02, H = 96, whole V): 132.6 against 133.8 us per step at N = 32, 997.3 against 1024.1 at N = 256;
# value tiles of 32 gained 5-7%.
# split: three launches (`decode_split.py`): a prologue kernel per (sequence, head), a state-only kernel per
# value tile (block_v; None: whole V), the output norm by XLA. None: split from SPLIT_FROM sequences on (for the
# whole-V default with the tails in place: `splits`). On the H100 (2026-12-05, H = 96, whole V per state program), against the one-launch whole-V
# kernel: 158.9 against 165.2 us per step at N = 32, 1223.7 against 1268.9 at N = 256; at N = 1 the one launch
# is the faster (7.3 against 8.4 us, fewer launches), so it stays below SPLIT_FROM. Those split times left the
# XLA norm out (dead code in the benchmark's loop); with it (2026-12-06, H100): 164.0 against 165.2 at N = 32,
# 1226.4 against 1267.0 at N = 256. With both kernels' loads issued first (2026-12-07, H100, one run): 155.9
# against 157.3 at N = 32, 1191.8 against 1187.1 at N = 256: alike, so SPLIT_FROM stays.
# tma: the state through shared memory by TMA on Mosaic GPU (`decode_tma.py`, jax 0.11): with split the state
# launch, without it the whole step in one launch (whole V, the tails in place), its prologue computed while the
# state arrives. More bytes in flight an SM than registers hold, for the H200, where the Triton state kernel
# streams at 79-84% of copy. Not yet timed on a GPU (written offline, 2026-12-08).
TUNING = dict(num_warps=4, num_stages=1, block_v=None, tails_in_place=None, heads_fastest=True, split=None,
              tma=False)
SPLIT_FROM = 32


def _decode_kernel(slots_ref, lens_ref, alog_ref, qkv_ref, w_ref, conv_ref, s_ref, g_ref, b_ref, gate_ref,
                   nw_ref, o_ref, tails_out, s_out, *, lower_bound, gate, qk_norm, eps, in_place, interpret, ids):
    n, h = ids()
    dk, dv = s_ref.shape[-2], s_ref.shape[-1]
    slot = slots_ref[n]
    active = lens_ref[n] > 0
    cs = pl.ds(h * dk, dk)
    row = slot if in_place else n  # the tails' row: the slot of the aliased pool, or this row of a fresh output
    # The state's loads are issued first, right after the slot's, and every store comes after the last load (a
    # store issued earlier would keep the state load behind it: the pointers may alias). The barrier keeps them
    # there: without it ptxas sank them under the conv, behind the conv inputs' round trip and their SiLU, so
    # that each program waited on memory twice before its state streamed; asked to issue the conv inputs first
    # and the state next, it still computed the SiLU in between (offline SASS, docs/benchmarks.md, thirty-eighth
    # session). On the H200 at H = 96, the state load issued before the conv with the tails in place took a step
    # from 178 to 144 us at N = 32 and from 23.5 to 14.3 us at N = 1 (2026-12-02). Taking the value columns in 2
    # or 4 blocks one after another, the next block's load issued before this one's store, was slower: 131.0 /
    # 164.6 against 130.7 us at N = 32 (2026-12-05).
    s0 = s_ref[slot, h, :, :]
    if not interpret:
        plt.debug_barrier()
    loaded = _head_loads(conv_ref, qkv_ref, w_ref, g_ref, b_ref, alog_ref, slot=slot, n=n, h=h, dk=dk, gate=gate)
    nw, gate_row = nw_ref[...], gate_ref[n, h, :]
    q, k, v, g, beta, tails = _head_inputs(loaded, qkv_ref.dtype, tails_out.dtype, active=active,
                                           lower_bound=lower_bound, gate=gate, qk_norm=qk_norm)
    s, o = _state_step(s0, q, k, v, g, beta)
    o_ref[n, h, :] = _gated_norm(o, nw, gate_row, eps).astype(o_ref.dtype)
    plt.store(s_out.at[slot, h, :, :], s.astype(s_out.dtype), mask=jnp.broadcast_to(active, (dk, dv)))
    for j, r, t in tails:  # after every load (the pools may alias)
        tails_out[row, j, r, cs] = t


def _decode_tiles_kernel(slots_ref, lens_ref, alog_ref, qkv_ref, w_ref, conv_ref, s_ref, g_ref, b_ref, gate_ref,
                         nw_ref, cnt_in, o_ref, tails_out, s_out, o_raw, cnt_ref, *, bv, lower_bound, gate, qk_norm,
                         eps, interpret, ids):
    """One program per (value tile, sequence, head): the whole-V kernel's arithmetic on a [K, bv] slice of
    the state. The last of a head's tiles to finish (a counter per (sequence, head), incremented once per
    program) applies the gated RMSNorm to the head's whole output row and writes the head's new q/k conv
    tails; each tile writes its own v channels' tails (only it reads them)."""
    del cnt_in  # aliased to cnt_ref
    t, n, h = ids()
    dk, dv = s_ref.shape[-2], s_ref.shape[-1]
    width = w_ref.shape[-1]
    slot = slots_ref[n]
    active = lens_ref[n] > 0
    cs = pl.ds(h * dk, dk)  # the head's q and k channels
    vs = pl.ds(h * dk + t * bv, bv)  # this tile's value channels
    cols = pl.ds(t * bv, bv)

    def conv(j, chans):
        return _conv(conv_ref, qkv_ref, w_ref, slot, n, j, chans)

    def store_tails(j, chans, hist, size):  # the tail moves by one token (an inactive row keeps its tail)
        keep = jnp.broadcast_to(active, (size,))
        for r in range(width - 1):
            tails_out[slot, j, r, chans] = jnp.where(keep, hist[r + 1], hist[r]).astype(tails_out.dtype)

    s0 = s_ref[slot, h, :, cols]  # first, and every store last, as in the whole-V kernel
    raw = _gate_inputs(g_ref, b_ref, alog_ref, n, h, gate)
    (q, hq), (k, hk), (v, hv) = conv(0, cs), conv(1, cs), conv(2, vs)
    q, k, g, beta = _head_prologue(q, k, raw, active, lower_bound, gate, qk_norm)
    s, o_raw[n, h, cols] = _state_step(s0, q, k, v, g, beta)  # the read is un-normed fp32
    # Publish: every thread's stores (and loads) come before the CTA barrier, which comes before the counter's
    # atomic add (acquire-release, GPU scope: the grid-sync pattern). The interpreter runs programs one by one.
    if not interpret:
        plt.debug_barrier()
    done = plt.atomic_add(cnt_ref, (n, h), jnp.ones((), jnp.int32))
    # Only the output slice has to be visible to the head's last tile; the state slice and this tile's value
    # tails are read by no other program, so they are stored after the count. The atomic's release fence
    # (MEMBAR.GPU) waits for every store issued before it: with the 16 KB state slice behind it, each program
    # waited for its state to reach memory before it could finish.
    plt.store(s_out.at[slot, h, :, cols], s.astype(s_out.dtype), mask=jnp.broadcast_to(active, (dk, bv)))
    store_tails(2, vs, hv, bv)  # after the barrier: every thread of this program has read these channels

    @pl.when(done == dv // bv - 1)
    def _last():  # every tile of the head has stored its output slice and has read the q/k tails
        o = plt.load(o_raw.at[n, h, :], volatile=True)  # the other tiles' slices from L2, not a stale L1 line
        o_ref[n, h, :] = _gated_norm(o, nw_ref[...], gate_ref[n, h, :], eps).astype(o_ref.dtype)
        store_tails(0, cs, hq, dk)
        store_tails(1, cs, hk, dk)


def splits(tuning: dict, nb: int) -> bool:
    """Whether a tuning takes the split launches for nb sequences. split None (the default): from SPLIT_FROM on,
    for the whole-V default only (block_v None, the tails in place); an explicit block_v without split keeps
    the one-launch value tiles."""
    t = dict(TUNING, **tuning)
    if t["split"] is None:
        return t["tails_in_place"] is not False and t["block_v"] is None and nb >= SPLIT_FROM
    return bool(t["split"])


def block_v_of(tuning: dict, dv: int) -> int:
    """The value tile a tuning asks for: V when None; else a power of two >= 16 dividing V."""
    bv = tuning.get("block_v")
    if bv is None:
        return dv
    bv = int(bv)
    if bv < 16 or bv & (bv - 1) or dv % bv:
        raise ValueError(f"kda_decode kernel: block_v = {bv} is not a power of two >= 16 dividing V = {dv}")
    return bv


def supports(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, *, eps, lengths=None, a_log=None,
             lower_bound=None, qk_norm=True, interpret=None, tuning=None):
    for name, x in (("qkv", qkv), ("conv_pool", conv_pool), ("s_pool", s_pool), ("g", g), ("gate", gate)):
        if jnp.dtype(x.dtype) == jnp.float64:
            raise Unsupported(f"kda_decode kernel: {name} is float64 (the kernel computes in fp32)")
    dk, dv = s_pool.shape[-2:]
    for name, d in (("K", dk), ("V", dv)):
        if d < 16 or d & (d - 1):
            raise Unsupported(f"kda_decode kernel: head dim {name} = {d} is not a power of two >= 16")
    if qkv.shape[-1] != s_pool.shape[1] * dk:
        raise Unsupported(f"kda_decode kernel: qkv {qkv.shape} does not hold H*K = {s_pool.shape[1] * dk} channels")
    if a_log is not None and lower_bound is None:
        raise Unsupported("kda_decode kernel: a_log given without lower_bound")
    t = dict(TUNING, **(tuning or {}))
    if t["tma"]:  # the Mosaic GPU kernels: jax 0.11, fp32 pools, K = V a multiple of 64
        tma_check(s_pool, dk, block_v_of(t, dv))


@register("kda_decode", supports)
def kda_decode(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, *, eps, lengths=None, a_log=None,
               lower_bound=None, qk_norm=True, interpret=None, tuning=None):
    """The Pallas implementation of `kimik3_jax.ops.kda.kda_decode` (same arguments and results), plus
    `interpret` (None: interpret unless on a GPU) and `tuning` (overrides of TUNING). The state pool is
    updated in place when the caller donates it (under jit, without donation XLA copies it first)."""
    supports(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, eps=eps, a_log=a_log,
             lower_bound=lower_bound, tuning=tuning)
    t = dict(TUNING, **(tuning or {}))
    nb = qkv.shape[0]
    nh = s_pool.shape[1]
    lens = jnp.ones((nb,), jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    a_log_arr = jnp.zeros((nh,), jnp.float32) if a_log is None else a_log.astype(jnp.float32)
    dv = s_pool.shape[-1]
    bv = block_v_of(t, dv)
    in_place = t["tails_in_place"] is not False
    t["split"] = splits(t, nb)
    if not in_place and (bv < dv or t["split"]):
        which = "split=True" if t["split"] else f"the value tiles (block_v = {bv})"
        raise ValueError(f"kda_decode kernel: {which} always writes the tails in place; tails_in_place=False "
                         "needs the one-launch whole-V kernel")
    slots = slots.astype(jnp.int32)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    if t["tma"] and not t["split"]:
        if bv < dv or not in_place:
            raise ValueError("kda_decode kernel: tma in one launch takes whole V with the tails in place (block_v "
                             f"None, tails_in_place not False), got block_v {t['block_v']}, tails_in_place "
                             f"{t['tails_in_place']}; value tiles are the split launches' (split=True)")
        return decode_tma(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, lens, a_log_arr,
                          eps=float(eps), lower_bound=lb, gate_on=a_log is not None, qk_norm=qk_norm,
                          heads_fastest=t["heads_fastest"], interpret=resolve_interpret(interpret))
    if t["split"]:
        return decode_split(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, lens, a_log_arr, bv=bv,
                            eps=float(eps), tuning=t, interpret=resolve_interpret(interpret), lower_bound=lb,
                            gate_on=a_log is not None, qk_norm=qk_norm)
    if bv < dv:
        return _decode_tiles(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, lens, a_log_arr, bv=bv,
                             eps=float(eps), tuning=t, interpret=resolve_interpret(interpret), lower_bound=lb,
                             gate_on=a_log is not None, qk_norm=qk_norm)
    grid, ids = _grid(nb, nh, t["heads_fastest"])
    kernel = functools.partial(_decode_kernel, lower_bound=lb, gate=a_log is not None, qk_norm=qk_norm,
                               eps=float(eps), in_place=in_place, interpret=resolve_interpret(interpret), ids=ids)
    # Both pools are aliased (updated in place) by default; without tails_in_place the kernel writes each
    # row's new tails (221 KB per sequence at K3's widths, 4% of its state traffic) and a scatter puts them
    # in their slots.
    out_shape = (jax.ShapeDtypeStruct((nb, nh, s_pool.shape[-1]), qkv.dtype),
                 jax.ShapeDtypeStruct(conv_pool.shape if in_place else (nb,) + conv_pool.shape[1:], conv_pool.dtype),
                 jax.ShapeDtypeStruct(s_pool.shape, s_pool.dtype))
    o, tails, s_pool = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, input_output_aliases={5: 1, 6: 2} if in_place else {6: 2},
        interpret=resolve_interpret(interpret), name="kda_decode",
        compiler_params=compiler_params(t["num_warps"], t["num_stages"]),
    )(slots, lens, a_log_arr, qkv, conv_w, conv_pool, s_pool, g, beta, gate, norm_w)
    return o, (tails if in_place else conv_pool.at[slots].set(tails)), s_pool


def _decode_tiles(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, lens, a_log_arr, *, bv, eps,
                  tuning, interpret, lower_bound, gate_on, qk_norm):
    """The value-tile launch: grid (V // bv, then heads and sequences as `_grid` orders them), a head's tiles
    next to each other (they share the q/k prologue's inputs and the output row in L2); both pools in place,
    plus a zeroed counter per (sequence, head) and the un-normed fp32 output row that the head's last tile
    norms."""
    nb, nh, dv = qkv.shape[0], s_pool.shape[1], s_pool.shape[-1]
    grid, ids = _grid(nb, nh, tuning["heads_fastest"], (dv // bv,))
    kernel = functools.partial(_decode_tiles_kernel, bv=bv, lower_bound=lower_bound, gate=gate_on, qk_norm=qk_norm,
                               eps=eps, interpret=interpret, ids=ids)
    out_shape = (jax.ShapeDtypeStruct((nb, nh, dv), qkv.dtype),
                 jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
                 jax.ShapeDtypeStruct(s_pool.shape, s_pool.dtype),
                 jax.ShapeDtypeStruct((nb, nh, dv), jnp.float32),
                 jax.ShapeDtypeStruct((nb, nh), jnp.int32))
    o, conv_pool, s_pool, _, _ = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, input_output_aliases={5: 1, 6: 2, 11: 4},
        interpret=interpret, name="kda_decode_tiles",
        compiler_params=compiler_params(tuning["num_warps"], tuning["num_stages"]),
    )(slots, lens, a_log_arr, qkv, conv_w, conv_pool, s_pool, g, beta, gate, norm_w, jnp.zeros((nb, nh), jnp.int32))
    return o, conv_pool, s_pool
