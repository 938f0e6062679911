"""Helpers shared by the KDA kernels: Triton compiler parameters across jax
versions, the two transposed matmuls (as dot_generals, which the Triton lowering turns into
tt.trans + tt.dot), the unit lower triangular inverse by matmuls, and the pieces both prefill kernels run
per chunk (the serial loop over a sequence's chunks, the state step, the checkpoint store)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def compiler_params(num_warps: int, num_stages: int):
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def cdiv(a, b):
    return (a + b - 1) // b


LOG2E = 1.4426950408889634


def exp_fast(x):
    """e^x as 2^(x log2 e) on fp32 tiles. jnp.exp lowers to libdevice's __nv_expf, about nine instructions
    per element (a range reduction kept exact to 1 ulp); exp2 lowers to one MUFU.EX2 (ex2.approx, 2^-22
    relative error, flushing results below 2^-126 to zero), so with the scale it costs two. Our products
    round its results to bf16 (2^-8) or TF32 (2^-11), so the difference does not reach them."""
    return jnp.exp2(x * LOG2E)


def sigmoid_fast(x):
    """1 / (1 + e^-x) with `exp_fast`."""
    return 1.0 / (1.0 + exp_fast(-x))


def dot_nt(a, b):
    """a [M, K] . b [N, K]^T -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a [K, M]^T . b [K, N] -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def series_inverse(a, eye, index: int):
    """(I + A)^-1 for A nilpotent of index `index` (a power of two: A^index = 0), as the product
    (I - A)(I + A^2)(I + A^4)...: matmuls only (fp32 accumulation; fp32 operands run as TF32 on the GPU)."""
    x, p = eye - a, a
    for _ in range(int(math.log2(index)) - 1):
        p = jnp.dot(p, p, preferred_element_type=jnp.float32)
        x = x + jnp.dot(x, p, preferred_element_type=jnp.float32)
    return x


def checkpoint_table(first, reached, fill_end):
    """The int32 [3 * nseq] table the prefill kernels read their checkpoint rows from: sequence n's first
    row, how many checkpoints it reaches, and the row (exclusive) up to which its programs fill the rows
    past those (`serial_chunks`)."""
    return jnp.concatenate([first, reached, fill_end]).astype(jnp.int32)


def store_checkpoint(cp_ref, cpo_ref, s, *, n, h, vt, done, every: int):
    """After chunk `done` (1-based) of sequence n, store the state tile s at that sequence's checkpoint
    row when `done` is a multiple of `every` chunks and the sequence reaches that checkpoint (cpo_ref: the
    `checkpoint_table`; lax.rem / lax.div: jnp's `%` and `//` fail the Triton lowering on jax 0.10.2)."""
    nseq = cpo_ref.shape[0] // 3
    idx = jax.lax.div(done, jnp.int32(every))
    full = (jax.lax.rem(done, jnp.int32(every)) == 0) & (idx <= cpo_ref[nseq + n])
    row = jnp.minimum(cpo_ref[n] + idx - 1, cp_ref.shape[0] - 1)
    plt.store(cp_ref.at[row, h, :, vt], s.astype(cp_ref.dtype), mask=jnp.broadcast_to(full, s.shape))


def chunk_state_step(s, u0, w, q_dec, m, k_tail, decay_end, o_ref, *, t0, h, vt, rows_in):
    """The serial part of one chunk (both prefill kernels): u = u0 - w S, o = q_dec S + M u (stored for the
    chunk's rows that belong to the sequence), then S' = e^(G_C) S + k_tail^T u. w, q_dec, m, k_tail are
    bf16 (the MMA operands), S and u fp32 and rounded to bf16 for the products; returns S'."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    chunk, block_v = u0.shape
    s16 = s.astype(bf16)
    u16 = (u0 - jnp.dot(w, s16, preferred_element_type=f32)).astype(bf16)
    o = jnp.dot(q_dec, s16, preferred_element_type=f32) + jnp.dot(m, u16, preferred_element_type=f32)
    plt.store(o_ref.at[pl.ds(t0, chunk), h, vt], o.astype(o_ref.dtype),
              mask=jnp.broadcast_to(rows_in, (chunk, block_v)))
    return s * decay_end + dot_tn(k_tail, u16)


def chunk_state_step_t(st, u0t, products, m, k_tail, decay_row, o_ref, *, t0, h, vt, rows_in):
    """`chunk_state_step` on the transposed state S^T [BV, K] (u0^T [BV, C], e^(G_C) as a row [1, K];
    `products(S^T in bf16)` returns (S^T w^T, S^T q_dec^T), fp32 [BV, C] each):
    u^T = u0^T - S^T w^T;  o^T = S^T q_dec^T + u^T M^T;  S'^T = S^T e^(G_C) + u^T k_tail. The operand carried
    in registers (S^T, then u^T) is the left one of every product, so one MMA's accumulator can be the next
    one's A operand without a trip through shared memory, and the MMAs have BV rows (wgmma: the offline
    Triton 3.9 build of benchmarks/sass_report.py shows HGMMA with A in registers; jaxlib's build is not
    yet read). Returns S'^T."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    block_v, chunk = u0t.shape
    s16 = st.astype(bf16)
    sw, sq = products(s16)
    u16 = (u0t - sw).astype(bf16)
    o = sq + dot_nt(u16, m)
    plt.store(o_ref.at[pl.ds(t0, chunk), h, vt], o.T.astype(o_ref.dtype),
              mask=jnp.broadcast_to(rows_in, (chunk, block_v)))
    return st * decay_row + jnp.dot(u16, k_tail, preferred_element_type=f32)


def serial_chunks(step, s0_ref, sf_ref, cp_refs, cpo_ref, *, n, h, vt, bos, eos, chunk: int, cp_every: int,
                  cp_fill_zero: bool = False, transposed: bool = False, prefetch=None):
    """A program's walk over sequence n's chunks: its state tile from s0, `step(j, s) -> s'` per chunk j,
    the checkpoint after each chunk when asked (cp_refs holds the checkpoint output, or is empty; cpo_ref
    the `checkpoint_table`), and the final state into sf. After the walk the program also writes its tile
    of the checkpoint rows past those the sequence reaches, up to the table's fill end: the final state
    (a batch row shorter than T), or zeros with cp_fill_zero (the rows after the last packed sequence), so
    that every checkpoint row is written by the kernel and no pass over them follows. transposed: `step`
    carries the tile as S^T [BV, K] (the refs hold [K, BV]).
    prefetch: `prefetch(j)` loads what chunk j needs from memory (any pytree of tiles); the loop then issues
    chunk j + 1's loads before chunk j's products, carries them, and calls `step(j, s, loaded)`, so that the
    serial chain does not wait on those loads (j + 1 may be one past the sequence's last chunk: `prefetch`
    must keep its index in bounds; the tiles it loads there are never used)."""
    out = (lambda s: s.T) if transposed else (lambda s: s)

    def after(j, s):
        if cp_every:
            store_checkpoint(cp_refs[0], cpo_ref, out(s), n=n, h=h, vt=vt, done=j + 1, every=cp_every)
        return s

    s0 = out(s0_ref[n, h, :, vt].astype(jnp.float32))
    count = cdiv(eos - bos, chunk)
    if prefetch is None:
        s = jax.lax.fori_loop(0, count, lambda j, s: after(j, step(j, s)), s0)
    else:
        def body(j, carry):
            s, loaded = carry
            ahead = prefetch(j + 1)
            return after(j, step(j, s, loaded)), ahead

        s, _ = jax.lax.fori_loop(0, count, body, (s0, prefetch(0)))
    sf_ref[n, h, :, vt] = out(s).astype(sf_ref.dtype)
    if cp_every:
        cp_ref, nseq = cp_refs[0], cpo_ref.shape[0] // 3
        fill = (jnp.zeros_like if cp_fill_zero else lambda x: x)(out(s)).astype(cp_ref.dtype)

        def fill_row(r, carry):
            cp_ref[r, h, :, vt] = fill
            return carry

        jax.lax.fori_loop(cpo_ref[n] + cpo_ref[nseq + n], cpo_ref[2 * nseq + n], fill_row, 0)
