"""Pallas (Triton-style) chunked KDA prefill: one program per (sequence, head, value tile) walks the
sequence's chunks serially with its [K, BV] slice of the fp32 state in registers.

Per chunk of C tokens (G_t = cumulative log decay from the chunk start, per key channel):
    A[t, i] = beta_t sum_c k_t k_i e^(G_t - G_i), i < t        M[t, i] = sum_c q_t k_i e^(G_t - G_i), i <= t
    X = (I + A)^-1 (A is nilpotent: X = (I - A)(I + A^2)(I + A^4)... by repeated squaring, all matmuls)
    u = X (beta v) - X (beta k e^G) S;   o = (q e^G) S + M u;   S = e^(G_C) S + (k e^(G_C - G))^T u
The pair factor e^(G_t - G_i) is split as e^(G_t - a) e^(a - G_i) around an anchor a = G at the chunk's
middle, so each factor stays within e^(+-C/2 |g|) (e^80 at C = 32 and the -5 bound: no fp32/bf16
overflow), while every other exponent is <= 0. Matmuls on the state and the chunk's q/k run in bf16 with
fp32 accumulation (the peers' precision); the inverse and X's products in fp32 (TF32 on the GPU).

The exponents are bounded by the log decays' lower bound, so the kernel needs it: `lower_bound` with
`a_log` (K3's gate, g = lower_bound * sigmoid(...)), or alone as the bound that a g given directly respects
(the XLA op ignores it there); without it `supports` refuses (impl "auto" then runs the XLA op). Two phases
at chunk 16 allow bounds down to -5, chunk 32 and up -10 (`prefill_two_phase.anchor_span`).

Sequences: cu [N+1] token offsets into the flattened [B*T] rows (batch form: cu = arange(B+1) * T);
positions at or past `ends[n]` are identity steps (the `lengths` of the batch form). Everything the op
`kimik3_jax.ops.kda.kda_prefill` takes is supported except float64 and head dims that are not powers of
two >= 16; `supports` says why it refuses.

The default is the two-phase variant (pallas_kernels/kda/prefill_two_phase.py, `phases=2`): the
state-independent per-chunk work in a kernel parallel over (chunk, head), then a serial kernel with only
the three state products per chunk. It was the fastest on the H200 (docs/benchmarks.md), but its HBM
workspaces grow with the tokens (about 1.3 KB per token and head at chunk 16: 1 GB at T = 8192, H = 96),
so a call whose workspaces would pass MAX_WORKSPACE_BYTES runs this one-phase kernel (`phases=1`, no
workspace) with the same chunk and tiles, unless the caller's tuning names `phases` itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kimik3_jax.ops.impl import Unsupported, register
from kimik3_jax.ops.kda import L2_EPS
from pallas_kernels.common import resolve_interpret
from pallas_kernels.kda import prefill_two_phase as two_phase
from pallas_kernels.kda.common import (
    cdiv,
    checkpoint_table,
    chunk_state_step,
    compiler_params,
    dot_nt,
    exp_fast,
    serial_chunks,
    series_inverse,
    sigmoid_fast,
)

# Best of the H200 sweeps (docs/benchmarks.md, 2026-11-29 to 2026-12-04): two phases at chunk 16, value tiles
# of 64; phase 2 on the transposed state with its loop's loads pipelined three stages deep by Triton
# (num_stages = 3; the one-phase kernel at chunk 32 passed its GPU checks at 3 stages, not timed). The
# two-phase keys (phase 1's launch and inverse, the workspaces' precision and prefetch) are described at
# two_phase.TWO_PHASE_DEFAULTS. chunk, block_v, num_warps, num_stages apply to the serial kernel (phase 2, or
# the one-phase kernel). One-phase chunks are limited by the gate bound (chunk 32 keeps the anchored factors
# within e^80 at -5).
TUNING = dict(phases=2, chunk=16, block_v=64, num_warps=4, num_stages=3, **two_phase.TWO_PHASE_DEFAULTS)
MAX_WORKSPACE_BYTES = 4 << 30  # above this the default falls back to one phase (see the module docstring)
MAX_ANCHOR_EXPONENT = 80.0  # e^80 = 5.5e34 < bf16/fp32 max 3.4e38, with room for |q|, |k| <= 1


def _prefill_kernel(cu_ref, ends_ref, cpo_ref, alog_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref,
                    o_ref, sf_ref, *cp_ref, heads, chunk, block_v, lower_bound, gate, qk_norm, cp_every,
                    cp_fill_zero):
    f32, bf16 = jnp.float32, jnp.bfloat16
    pid, iv = pl.program_id(0), pl.program_id(1)
    n, h = pid // heads, pid % heads
    bos, eos, end = cu_ref[n], cu_ref[n + 1], ends_ref[n]
    dk = q_ref.shape[-1]
    vt = pl.ds(iv * block_v, block_v)
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(f32)
    a_log = alog_ref[h].astype(f32) if gate else None

    def step(j, s):
        t0 = bos + j * chunk
        inb = (t0 + rows) < eos  # [C, 1] rows of this sequence
        real = (t0 + rows) < end  # rows before the identity tail
        mk = jnp.broadcast_to(inb, (chunk, dk))
        q = plt.load(q_ref.at[pl.ds(t0, chunk), h, :], mask=mk, other=0.0).astype(f32)
        k = plt.load(k_ref.at[pl.ds(t0, chunk), h, :], mask=mk, other=0.0).astype(f32)
        v = plt.load(v_ref.at[pl.ds(t0, chunk), h, vt], mask=jnp.broadcast_to(inb, (chunk, block_v)),
                     other=0.0).astype(f32)
        g = plt.load(g_ref.at[pl.ds(t0, chunk), h, :], mask=mk, other=0.0).astype(f32)
        beta = plt.load(b_ref.at[pl.ds(t0, chunk), h], mask=inb[:, 0], other=0.0).astype(f32)[:, None]
        if gate:
            g = lower_bound * sigmoid_fast(exp_fast(a_log) * g)
        if qk_norm:
            q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2_EPS) * dk ** -0.5
            k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2_EPS)
        g = jnp.where(real, g, 0.0)
        beta = jnp.where(real, beta, 0.0)

        gc = jnp.cumsum(g, axis=0)  # G_t, inclusive
        anchor = jnp.sum(jnp.where(rows == chunk // 2 - 1, gc, 0.0), axis=0, keepdims=True)
        g_end = jnp.sum(jnp.where(rows == chunk - 1, gc, 0.0), axis=0, keepdims=True)
        up, down = exp_fast(gc - anchor), exp_fast(anchor - gc)
        k_down = (k * down).astype(bf16)
        a = jnp.where(rows > cols, dot_nt((k * up).astype(bf16), k_down), 0.0) * beta
        m = jnp.where(rows >= cols, dot_nt((q * up).astype(bf16), k_down), 0.0)
        x = series_inverse(a, eye, chunk)  # (I + A)^-1: A^C = 0
        decay = exp_fast(gc)
        w = jnp.dot(x, k * decay * beta, preferred_element_type=f32)
        u0 = jnp.dot(x, v * beta, preferred_element_type=f32)
        return chunk_state_step(s, u0, w.astype(bf16), (q * decay).astype(bf16), m.astype(bf16),
                                (k * exp_fast(g_end - gc)).astype(bf16), exp_fast(g_end).T, o_ref, t0=t0, h=h,
                                vt=vt, rows_in=inb)

    serial_chunks(step, s0_ref, sf_ref, cp_ref, cpo_ref, n=n, h=h, vt=vt, bos=bos, eos=eos, chunk=chunk,
                  cp_every=cp_every, cp_fill_zero=cp_fill_zero)


def _tuning(tuning, q=None, v=None, cu_seqlens=None):
    """TUNING with the caller's overrides; without an explicit `phases`, one phase when the two-phase
    workspaces for q [B, T, H, K] and v would pass MAX_WORKSPACE_BYTES."""
    t = dict(TUNING, **(tuning or {}))
    if q is not None and "phases" not in (tuning or {}) and t["phases"] == 2:
        b, tt, nh, dk = q.shape
        n_chunks = _n_chunks(b, tt, t["chunk"], cu_seqlens)
        if two_phase.workspace_bytes(n_chunks, nh, t["chunk"], dk, v.shape[-1], t["u0_bf16"]) > MAX_WORKSPACE_BYTES:
            t["phases"] = 1
    return t


def _n_chunks(b, tt, chunk, cu_seqlens):
    """Static bound on the sequence-local chunks: ceil(T / C) per batch row, or for packed sequences
    floor(total / C) + one per sequence."""
    return b * cdiv(tt, chunk) if cu_seqlens is None else (b * tt) // chunk + cu_seqlens.shape[0] - 1


def supports(q, k, v, g, beta, s0, *, a_log=None, lower_bound=None, qk_norm=False, lengths=None,
             cu_seqlens=None, checkpoint=0, out_dtype=None, interpret=None, tuning=None):
    t = _tuning(tuning, q, v, cu_seqlens)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("s0", s0)):
        if jnp.dtype(x.dtype) == jnp.float64:
            raise Unsupported(f"kda_prefill kernel: {name} is float64 (the kernel computes in fp32)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) != jnp.bfloat16:  # a float32 model keeps fp32 math through the XLA op
            raise Unsupported(f"kda_prefill kernel: {name} is {jnp.dtype(x.dtype)}; its matmuls take bfloat16 "
                              "operands, so it serves bfloat16 q, k, v only")
    dk, dv = q.shape[-1], v.shape[-1]
    for name, d in (("K", dk), ("V", dv)):
        if d < 16 or d & (d - 1):
            raise Unsupported(f"kda_prefill kernel: head dim {name} = {d} is not a power of two >= 16")
    if dv % min(t["block_v"], dv):
        raise Unsupported(f"kda_prefill kernel: V = {dv} is not a multiple of block_v = {t['block_v']}")
    if checkpoint and checkpoint % t["chunk"]:
        raise Unsupported(f"kda_prefill kernel: checkpoint = {checkpoint} is not a multiple of the chunk {t['chunk']}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise Unsupported(f"kda_prefill kernel: packed sequences need batch 1, got q {q.shape}")
    if lower_bound is None:  # raw log decays of unknown range could overflow the anchored exponents
        raise Unsupported("kda_prefill kernel: needs lower_bound, the log decays' lower bound (with a_log the "
                          "gate's; without, the bound the given g respects), to keep its exponents finite"
                          + (" (a_log given without it)" if a_log is not None else ""))
    if t["phases"] not in (1, 2):
        raise Unsupported(f"kda_prefill kernel: phases = {t['phases']} is not 1 or 2")
    if t["phases"] == 2:
        two_phase.check(t["chunk"], lower_bound, Unsupported, t["phase1_chunks"], t["phase1_inverse"],
                        t["phase2_transposed"], t["wq_interleaved"], t["phase2_prefetch"], t["phase1_products"])
    elif t["chunk"] // 2 * abs(lower_bound) > MAX_ANCHOR_EXPONENT:
        raise Unsupported(f"kda_prefill kernel: gate bound {lower_bound} with chunk {t['chunk']} could overflow")


@register("kda_prefill", supports)
def kda_prefill(q, k, v, g, beta, s0, *, a_log=None, lower_bound=None, qk_norm=False, lengths=None,
                cu_seqlens=None, checkpoint=0, out_dtype=None, interpret=None, tuning=None):
    """The Pallas implementation of `kimik3_jax.ops.kda.kda_prefill` (same arguments and results), plus
    `interpret` (None: interpret unless on a GPU) and `tuning` (overrides of TUNING)."""
    supports(q, k, v, g, beta, s0, a_log=a_log, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
             checkpoint=checkpoint, tuning=tuning)
    t = _tuning(tuning, q, v, cu_seqlens)
    b, tt, nh, dk = q.shape
    dv = v.shape[-1]
    block_v = min(t["block_v"], dv)
    chunk = t["chunk"]
    flat = lambda x: x.reshape(b * tt, *x.shape[2:])
    if cu_seqlens is None:
        cu = (jnp.arange(b + 1) * tt).astype(jnp.int32)
        ends = cu[:-1] + (cu[1:] - cu[:-1] if lengths is None else jnp.minimum(lengths, tt).astype(jnp.int32))
    else:
        cu = cu_seqlens.astype(jnp.int32)
        ends = cu[1:]
    nseq = cu.shape[0] - 1
    if nseq != s0.shape[0]:
        raise ValueError(f"s0 {s0.shape} holds {s0.shape[0]} states for {nseq} sequences")
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    n_cp = (tt // checkpoint) * (b if cu_seqlens is None else 1) if checkpoint else 0
    cp_every = checkpoint // chunk if n_cp else 0
    # The checkpoint rows, all written by the kernels: a batch row's tt // checkpoint rows hold its states,
    # the final one past its length; packed sequences' rows follow each other, zeros after the last.
    reached = (ends - cu[:-1]) // max(checkpoint, 1)
    if cu_seqlens is None:
        per = tt // checkpoint if checkpoint else 0
        first = jnp.arange(nseq, dtype=jnp.int32) * per
        fill_end = first + per
    else:
        first = jnp.cumsum(reached) - reached
        fill_end = jnp.where(jnp.arange(nseq) == nseq - 1, n_cp, first + reached)
    cpo = checkpoint_table(first, reached, fill_end)
    a_log_arr = jnp.zeros((nh,), jnp.float32) if a_log is None else a_log.astype(jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((b * tt, nh, dv), out_dtype),
                 jax.ShapeDtypeStruct((nseq, nh, dk, dv), jnp.float32)]
    if n_cp:
        out_shape.append(jax.ShapeDtypeStruct((n_cp, nh, dk, dv), jnp.float32))
    lb = float(lower_bound) if lower_bound is not None else 0.0
    if t["phases"] == 2:
        n_chunks = _n_chunks(b, tt, chunk, cu_seqlens)
        outs = two_phase.run(
            cu, ends, cpo, a_log_arr, flat(q), flat(k), flat(v), flat(g), flat(beta), s0.astype(jnp.float32),
            out_shape=out_shape, heads=nh, chunk=chunk, block_v=block_v, lower_bound=lb, gate=a_log is not None,
            qk_norm=qk_norm, cp_every=cp_every, cp_fill_zero=cu_seqlens is not None, n_chunks=n_chunks,
            interpret=resolve_interpret(interpret), tuning=t)
    else:
        kernel = functools.partial(
            _prefill_kernel, heads=nh, chunk=chunk, block_v=block_v, lower_bound=lb, gate=a_log is not None,
            qk_norm=qk_norm, cp_every=cp_every, cp_fill_zero=cu_seqlens is not None)
        outs = pl.pallas_call(
            kernel, out_shape=out_shape, grid=(nseq * nh, dv // block_v),
            interpret=resolve_interpret(interpret), name="kda_prefill",
            compiler_params=compiler_params(t["num_warps"], t["num_stages"]),
        )(cu, ends, cpo, a_log_arr, flat(q), flat(k), flat(v), flat(g), flat(beta), s0.astype(jnp.float32))
    o = outs[0].reshape(b, tt, nh, dv)
    if not checkpoint:
        return o, outs[1]
    cps = outs[2] if n_cp else jnp.zeros((0, nh, dk, dv), jnp.float32)
    return o, outs[1], (cps.reshape(b, tt // checkpoint, nh, dk, dv) if cu_seqlens is None else cps)
