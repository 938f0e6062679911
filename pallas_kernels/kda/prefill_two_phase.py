"""Two-phase Pallas (Triton-style) chunked KDA prefill, selected by `tuning=dict(phases=2)` of
`pallas_kernels.kda.prefill.kda_prefill` (same op, same arguments; the default, see prefill.py).

Phase 1, one program per (chunk, head), all in parallel: everything that does not depend on the state.
Per chunk of C tokens (G_t = cumulative log decay from the chunk start, per key channel):
    A[t, i] = beta_t sum_c k_t k_i e^(G_t - G_i), i < t        M[t, i] = sum_c q_t k_i e^(G_t - G_i), i <= t
    X = (I + A)^-1;  w = X (beta k e^G);  u0 = X (beta v);  q_dec = q e^G;  k_tail = k e^(G_C - G);  e^(G_C)
Phase 2, one program per (sequence, head, value tile), serial over the sequence's chunks:
    u = u0 - w S;   o = q_dec S + M u;   S = e^(G_C) S + k_tail^T u   (checkpoints at chunk boundaries)
By default (tuning phase2_transposed) phase 2 carries the transposed tile S^T [BV, K] and computes the
transposes of these products (`common.chunk_state_step_t`), so that the operand in registers is always the
left one and the products have BV rows instead of C. Against the untransposed form, same runs (H200,
docs/benchmarks.md): 1.19x faster at (16, 4096, 12), 1.02x at (1, 8192, 96), 0.94x at (1, 32768, 96);
1.20x at (8, 2048, 12), measured with an earlier variant that wrote u0 transposed.

Exponents (the sub-block scheme of `kimik3_jax.ops.kda.kda_chunked`, 16-token sub-blocks): a pair (t, i)
with i in an earlier sub-block than t factors through the decay at the start of t's sub-block,
e^(G_t - G_a) e^(G_a - G_i), both factors <= 1; a pair inside one sub-block factors through an anchor in
it (the pure op uses the exact pairwise exponent there, which is not a matmul): the sub-block's middle when
the chunk has several, each factor within e^(8 |g|) (e^40 at the -5 bound); the chunk's start when the chunk
is one sub-block (chunk 16, the default), so that the factors are e^(G_t) (the decay q_dec and w use anyway)
and e^(-G_i), within e^(16 |g|) = e^80 at the -5 bound (fp32's range ends at e^88; e^-80 is still a normal
number). That saves two of the four exponentials per element and the anchor row's reduction: 1544 -> 1384
SASS instructions per warp offline, phase 1 772 -> 740 us on the H200 and the whole prefill 2.4% faster
(2026-12-04, fourteenth session). Every other exponent is <= 0. So no factor overflows at any chunk size at
the -5 bound: chunk 64 is allowed there (the one-phase kernel's single anchor stops at 32). `anchor_span`
gives the limit `check` applies to a known bound.

X: forward substitution (fp32, elementwise: exact fp32) inside the 16 x 16 diagonal blocks, all blocks at
once, then the blocks are joined as in `unit_lower_inverse`: with D the block-diagonal inverse and L the
part of A below the diagonal blocks, (I + A)^-1 = (I + D L)^-1 D, where N = D L is nilpotent of index
C / 16, so (I + N)^-1 = (I - N)(I + N^2)... (one factor at C = 32, two at C = 64). That is
tuning phase1_inverse="substitution"; the default, "series", takes the whole chunk's
(I + A)^-1 = (I - A)(I + A^2)... by matmuls (`common.series_inverse`, TF32 on the GPU, as the one-phase
kernel does): fewer instructions, 14% faster on the H200 with the same errors (docs/benchmarks.md).

Workspaces in HBM, [chunks, H, C, ...] (chunks never straddle sequences: sequence n's chunks are rows
choff[n] .. choff[n] + ceil(len_n / C) - 1):
    w, q_dec, k_tail [C, K] and M [C, C] in bf16: the one-phase kernel casts exactly these to bf16 for its
        matmuls, so storing them in bf16 loses nothing against it;
    u0 [C, V] in bf16 by default, as fla stores it (tuning u0_bf16=False keeps fp32, the precision the
        one-phase kernel has): u = u0 - w S can cancel (u is the delta rule's residual, small when S
        predicts v well) and u feeds every later state, but u0 is itself X (beta v) with v in bf16, and on
        the H200 the bf16 store left the errors against the fp32 reference unchanged at every benchmark
        shape (6.8e-3 / 4.7e-3 relative on o / final state at (1, 8192, 96)) while saving a third of the
        workspace traffic: 1.382 against 1.463 ms there, 1.191 against 1.218 at (16, 4096, 12);
    e^(G_C) in fp32, a row [1, K] for the transposed phase 2 (a column [K, 1] otherwise): it multiplies the
        fp32 state once per chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kimik3_jax.ops.kda import L2_EPS, SUB_BLOCK
from pallas_kernels.kda.common import (
    LOG2E,
    cdiv,
    chunk_state_step,
    chunk_state_step_t,
    compiler_params,
    dot_nt,
    exp_fast,
    serial_chunks,
    series_inverse,
    sigmoid_fast,
)

MAX_INTRA_EXPONENT = 80.0  # same margin as the one-phase kernel: e^80 < bf16/fp32 max with |q|, |k| <= 1
# The two-phase variant's own tuning keys (prefill.TUNING adds the keys both variants share). Each default
# won its H200 comparison, same run, device time; the numbers and the losing alternatives are in
# docs/benchmarks.md under the date given.
# phase1_warps (4; 2026-12-03), phase1_stages, phase1_chunks: phase 1's launch, and chunks per program (a
#     loop Triton can pipeline with phase1_stages > 1; it lost: 168 registers, 3 blocks per SM).
# phase1_inverse: "series" ((I + A)^-1 = (I - A)(I + A^2)... by 2 log2(C) - 2 TF32 matmuls, as the one-phase
#     kernel does; 14% faster, same errors, 2026-12-02) or "substitution" (exact fp32, elementwise; see the
#     module docstring).
# phase1_early_stores, phase1_v_early: see _phase1_kernel (at 4 warps, 128 registers instead of 168;
#     2026-12-03).
# u0_bf16: see the module docstring (2026-12-04).
# phase2_transposed: phase 2 carries S^T [BV, K], so that the operand in registers (S^T, then u^T) is the
#     left one of every product on its serial chain: wgmma with BV rows, its A operand in registers
#     (2026-12-02). Phase 1 then writes e^(G_C) as a row [1, K]; u0 stays [C, V], phase 2 transposes its tile
#     (phase 1 writing u0^T by a transposed product was 1.20x slower).
# wq_interleaved (transposed only): w and q_dec in one [2C, K] workspace, rows interleaved, so that S^T w^T
#     and S^T q_dec^T are one MMA of N = 2C split by columns in registers (one wait fewer per chunk). Off:
#     with today's prefetch it is 11% slower at (1, 8192, 96), at 168 registers (190 before), 2026-12-04.
# (phase1_pairs, chunk 32 in phase 2 with phase 1 building each chunk from two halves of 16, merged in the WY
#     form, was removed on 2026-12-04 after its GPU run: 1.709 ms against 1.309 at (1, 8192, 96), phase 1 at
#     231 registers there (168 offline); phase 2 at chunk 32 alone took 407 us against 552, docs/benchmarks.md.)
# phase2_prefetch: the workspaces phase 2 loads one chunk ahead into registers (`common.serial_chunks`).
#     Triton's own pipelining (prefill.TUNING num_stages = 3: async copies into shared memory two chunks
#     ahead; u0 it prefetches into registers itself) beat that for w, q_dec, k_tail and M (2026-12-03), but
#     it leaves e^(G_C)'s [1, K] row as a plain load waited on in the same chunk (offline TTGIR), so the
#     default takes that one ahead: phase 2 632 -> 581 us at (1, 8192, 96) (2026-12-04, twelfth session).
#     u0 Triton does prefetch into registers, but it issues that load after the chunk's o store, about 150
#     SASS instructions before its use; taking it a whole chunk ahead too (166 registers, 3 blocks per SM):
#     phase 2 578 -> 552 us, the whole prefill 1.342 -> 1.304 ms at (1, 8192, 96) and 1.162 -> 1.131 at
#     (16, 4096, 12) (2026-12-04, thirteenth session).
# phase1_products: the operands of w = X (beta k e^G) and u0 = X (beta v), X = (I + A)^-1 [C, C]. "tf32": fp32
#     (TF32 MMAs on the GPU, the tiles through shared memory in fp32); "bf16": X diag(beta) in bf16 for both,
#     with k e^G (the bf16 operand the A products already round) and v as loaded. Offline (2026-12-04,
#     fourteenth session): 1384 -> 1240 SASS instructions per warp, 128 -> 96 registers (4 -> 5 blocks per SM);
#     at 8 warps 952 instructions and 61 registers. Errors against float64 (CPU, (1, 1024, 8), fp32 dots as the
#     baseline): o RMS 2.62e-4 -> 2.84e-4 and final state RMS 2.59e-4 -> 3.19e-4, the largest errors unchanged
#     (6.1e-3 / 5.0e-3): u0's rounding of X diag(beta) is what costs. (X and beta k e^G in bf16 for w gave the
#     same output errors at 1264 instructions and 128 registers.) On the H200 (2026-12-05, fifteenth session,
#     three interleaved rounds): "bf16" 1.160 against 1.274 ms at (1, 8192, 96) and 0.988 against 1.108 at
#     (16, 4096, 12), phase 1 740 -> 621 us at 96 registers (Nsight Compute); errors against the fp32 reference
#     o / state 8.6e-3 / 4.6e-3 (was 8.6e-3 / 4.7e-3) and 7.3e-3 / 6.8e-3 (was 9.2e-3 / 4.0e-3). 8 warps: 1.46
#     and 1.28 ms. The default since.
TWO_PHASE_DEFAULTS = dict(phase1_warps=4, phase1_stages=1, phase1_chunks=1, u0_bf16=True, phase1_inverse="series",
                          phase2_transposed=True, phase1_early_stores=True, wq_interleaved=False,
                          phase2_prefetch=("dec", "u0"), phase1_v_early=True, phase1_products="bf16")


def sub_block(chunk: int) -> int:
    return min(SUB_BLOCK, chunk)


def anchor_span(chunk: int) -> int:
    """The most tokens between a row and its exponents' anchor (see the module docstring): the whole chunk
    when it is one sub-block (anchored at its start), else half a sub-block (anchored at the middle)."""
    return chunk if chunk <= SUB_BLOCK else SUB_BLOCK // 2


def _row_of(x, rows, idx):
    """Row `idx` (static or traced) of x [C, K] as [1, K], without slicing registers."""
    return jnp.sum(jnp.where(rows == idx, x, 0.0), axis=0, keepdims=True)


PHASE1_PRODUCTS = ("tf32", "bf16")


def workspace_names(wq_interleaved: bool) -> tuple[str, ...]:
    """Phase 1's outputs, in order (phase 2 takes them in the same order)."""
    return ("wq", "u0", "kt", "m", "dec") if wq_interleaved else ("w", "u0", "qd", "kt", "m", "dec")


def _phase1_kernel(t0_ref, eos_ref, end_ref, alog_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *out_refs, chunk,
                   lower_bound, gate, qk_norm, per_program, inverse, transposed, early_stores, wq_interleaved,
                   v_early, products):
    """Program (cb, h) does chunks cb * per_program ... + per_program - 1 of head h, one after the other
    (per_program > 1: a loop over chunks, which Triton can software-pipeline with phase1_stages > 1).
    early_stores: each workspace is stored as soon as it is known and v is loaded only for u0, so that fewer
    [C, K] tiles are live at once (the default loads everything first and stores everything last); the
    same values either way. v_early (with early_stores): v is loaded with q, k and g and held in bf16 until
    u0, so that its load's latency overlaps the chunk's other work (Nsight Compute, (16, 4096, 12): 7.5% of
    phase 1's stall samples waited on the late load; offline, the same 128 registers). wq_interleaved: w
    and q_dec go to the rows 0, 2, 4, ... and 1, 3, 5, ... of one [2C, K] workspace. products: the operands
    of w and u0 (tuning phase1_products)."""
    cb, h = pl.program_id(0), pl.program_id(1)
    rows_of = {name: (ref, slice(None)) for name, ref in zip(workspace_names(wq_interleaved), out_refs)}
    if wq_interleaved:  # w and q_dec: the even and the odd rows of wq
        wq = rows_of["wq"][0]
        rows_of.update(w=(wq, pl.ds(0, chunk, stride=2)), qd=(wq, pl.ds(1, chunk, stride=2)))

    def one(c):
        t0, eos, end = t0_ref[c], eos_ref[c], end_ref[c]
        f32, bf16 = jnp.float32, jnp.bfloat16
        dk, dv = q_ref.shape[-1], v_ref.shape[-1]
        sub = sub_block(chunk)
        nsub = chunk // sub
        rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        eye = jnp.where(rows == cols, 1.0, 0.0).astype(f32)
        inb = (t0 + rows) < eos  # rows of this chunk's sequence
        real = (t0 + rows) < end  # rows before the identity tail
        mk = jnp.broadcast_to(inb, (chunk, dk))
        q = plt.load(q_ref.at[pl.ds(t0, chunk), h, :], mask=mk, other=0.0).astype(f32)
        k = plt.load(k_ref.at[pl.ds(t0, chunk), h, :], mask=mk, other=0.0).astype(f32)

        def load_v():
            return plt.load(v_ref.at[pl.ds(t0, chunk), h, :], mask=jnp.broadcast_to(inb, (chunk, dv)), other=0.0)

        v_first = load_v() if v_early or not early_stores else None  # kept in bf16 until u0 needs it
        g = plt.load(g_ref.at[pl.ds(t0, chunk), h, :], mask=mk, other=0.0).astype(f32)
        beta = plt.load(b_ref.at[pl.ds(t0, chunk), h], mask=inb[:, 0], other=0.0).astype(f32)[:, None]
        # g in log2 units from here, so that every e^x below is one exp2 (the scale folded into the bound's)
        if gate:
            g = (lower_bound * LOG2E) * sigmoid_fast(exp_fast(alog_ref[h].astype(f32)) * g)
        else:
            g = g * LOG2E
        if qk_norm:  # the scales per row, then one product per element
            q = q * (jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2_EPS) * dk ** -0.5)
            k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2_EPS)
        g = jnp.where(real, g, 0.0)
        beta = jnp.where(real, beta, 0.0)

        # G_t (inclusive; non-increasing down the chunk) and the chunk's total, g_end [1, K] (as a column sum:
        # one reduction, no row selection)
        gc = jnp.cumsum(g, axis=0)
        outputs = {  # each workspace's value, built when stored
            "w": lambda: jnp.dot(*products_w(), preferred_element_type=f32),
            "u0": lambda: jnp.dot(*products_u0(), preferred_element_type=f32),
            "qd": lambda: q * decay,
            # one sub-block: e^(-G) is there already (`down`, anchored at the chunk start)
            "kt": lambda: k * (down * jnp.exp2(g_end)) if nsub == 1 else k * jnp.exp2(g_end - gc),
            "m": lambda: m,
            "dec": lambda: jnp.exp2(g_end) if transposed else jnp.exp2(g_end).T,
        }

        def store(*names):  # each workspace as soon as it is known (its value a thunk in `outputs`)
            for name in names:
                ref, rows_ = rows_of[name]
                ref[c, h, rows_] = outputs[name]().astype(ref.dtype)

        def products_w():  # the operands of X (beta k e^G), see phase1_products
            if products == "tf32":
                return inv, k * decay * beta
            return inv_beta(), (k * decay).astype(bf16)

        def products_u0():  # the operands of X (beta v)
            vv = load_v() if v_first is None else v_first
            if products == "tf32":
                return inv, vv.astype(f32) * beta
            return inv_beta(), vv.astype(bf16)

        def inv_beta():  # X diag(beta) in bf16 (Triton computes it once: both uses are the same expression)
            return (inv * beta.T).astype(bf16)

        if early_stores:
            decay, g_end = jnp.exp2(gc), jnp.sum(g, axis=0, keepdims=True)
        blk_r, blk_c = rows // sub, cols // sub
        same = blk_r == blk_c  # [C, C] pairs inside one sub-block
        if nsub == 1:  # anchor at the chunk start: up is the decay itself
            up, down = jnp.exp2(gc), jnp.exp2(-gc)
        else:  # anchor at each sub-block's middle row
            mid = sum(jnp.where(blk_r == a, _row_of(gc, rows, a * sub + sub // 2 - 1), 0.0) for a in range(nsub))
            up, down = jnp.exp2(gc - mid), jnp.exp2(mid - gc)
        if early_stores:
            store("dec", "kt")
        k_down = (k * down).astype(bf16)
        pkk = dot_nt((k * up).astype(bf16), k_down)
        pqk = dot_nt((q * up).astype(bf16), k_down)
        # across sub-blocks, row block a >= 1: anchor at the decay just before a's first row (both factors <= 1)
        for a in range(1, nsub):
            anchor = _row_of(gc, rows, a * sub - 1)
            row_f = jnp.exp2(jnp.where(blk_r == a, gc - anchor, -jnp.inf))  # rows t of block a
            col_f = jnp.exp2(jnp.where(rows < a * sub, anchor - gc, -jnp.inf))  # keys i before block a
            kc = (k * col_f).astype(bf16)
            in_a = (blk_r == a) & ~same
            pkk = jnp.where(in_a, dot_nt((k * row_f).astype(bf16), kc), pkk)
            pqk = jnp.where(in_a, dot_nt((q * row_f).astype(bf16), kc), pqk)
        a_mat = jnp.where(rows > cols, pkk, 0.0) * beta
        m = jnp.where(rows >= cols, pqk, 0.0)
        if early_stores:
            store("m", "qd")

        if inverse == "series":  # (I + A)^-1 by matmuls alone: A^C = 0
            inv = series_inverse(a_mat, eye, chunk)
        else:
            # forward substitution inside the diagonal sub-blocks, all at once: row r of every block from the
            # rows above it, X[t] = e_t - sum_{i<t} A[t, i] X[i] (the inverse stays block-diagonal)
            a_diag = jnp.where(same, a_mat, 0.0)
            inv = eye
            for r in range(1, sub):
                at_r = (rows % sub) == r
                coef = jnp.sum(jnp.where(at_r, a_diag, 0.0), axis=0)  # [C]: A[row r of block(j), j]
                acc = jnp.sum(coef[:, None] * inv, axis=0)  # [C]: sum_j coef_j X[j, :], each block's own columns
                inv = jnp.where(at_r & same, eye - acc[None, :], inv)
            if nsub > 1:  # join the blocks: (I + A)^-1 = (I + N)^-1 D, N = D L nilpotent of index nsub
                nmat = jnp.dot(inv, jnp.where(same, 0.0, a_mat), preferred_element_type=f32)
                inv = jnp.dot(series_inverse(nmat, eye, nsub), inv, preferred_element_type=f32)

        if early_stores:
            store("w", "u0")
        else:
            decay, g_end = jnp.exp2(gc), jnp.sum(g, axis=0, keepdims=True)
            store("w", "u0", "qd", "kt", "m", "dec")

    if per_program == 1:
        one(cb)
    else:
        jax.lax.fori_loop(0, per_program, lambda i, carry: (one(cb * per_program + i), carry)[1], 0)


def _phase2_kernel(cu_ref, choff_ref, cpo_ref, *refs, heads, chunk, block_v, cp_every, cp_fill_zero,
                   transposed, wq_interleaved, prefetch):
    f32 = jnp.float32
    names = workspace_names(wq_interleaved)
    work = dict(zip(names, refs))
    s0_ref, o_ref, sf_ref, *cp_ref = refs[len(names):]
    pid, iv = pl.program_id(0), pl.program_id(1)
    n, h = pid // heads, pid % heads
    bos, eos, base = cu_ref[n], cu_ref[n + 1], choff_ref[n]
    last = work["dec"].shape[0] - 1
    vt = pl.ds(iv * block_v, block_v)
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)

    def load(name, j, ahead=False):
        ci = jnp.minimum(base + j, last) if ahead else base + j  # ahead: j may be one past the sequence
        return work[name][ci, h, :, vt] if name == "u0" else work[name][ci, h]

    def step(j, s, loaded=None):
        tile = lambda name: loaded[name] if name in (loaded or {}) else load(name, j)  # noqa: E731
        t0 = bos + j * chunk
        u0 = tile("u0").astype(f32)
        tail = (tile("m"), tile("kt"), tile("dec"), o_ref)
        kw = dict(t0=t0, h=h, vt=vt, rows_in=(t0 + rows) < eos)
        if wq_interleaved:  # S^T [w; q_dec]^T, one MMA [BV, 2C], its columns alternating w, q_dec
            wq = tile("wq")
            products = lambda s16: jnp.unstack(dot_nt(s16, wq).reshape(block_v, chunk, 2), axis=-1)  # noqa: E731
            return chunk_state_step_t(s, u0.T, products, *tail, **kw)
        w, qd = tile("w"), tile("qd")
        if transposed:
            return chunk_state_step_t(s, u0.T, lambda s16: (dot_nt(s16, w), dot_nt(s16, qd)), *tail, **kw)
        return chunk_state_step(s, u0, w, qd, *tail, **kw)

    load_ahead = (lambda j: {name: load(name, j, ahead=True) for name in prefetch}) if prefetch else None
    serial_chunks(step, s0_ref, sf_ref, cp_ref, cpo_ref, n=n, h=h, vt=vt, bos=bos, eos=eos, chunk=chunk,
                  cp_every=cp_every, cp_fill_zero=cp_fill_zero, transposed=transposed, prefetch=load_ahead)


def chunk_table(cu, ends, chunk, n_chunks, search="compare_all"):
    """Sequence-local chunks, numbered across sequences: choff[n] = sequence n's first chunk; for each of
    the n_chunks (a static upper bound) its first token, its sequence's end and identity-tail start
    (chunks past the last get t0 >= eos: every row masked). `search`: `jnp.searchsorted`'s method for each
    chunk's sequence: one compare of every chunk with every sequence end, rather than the default loop of
    launches: 3-4% faster prefill at (16, 4096, 12) on the H100, two runs (tests/gpu/probe_kda_chunk_search.py)."""
    nch = cdiv(cu[1:] - cu[:-1], chunk)
    last = jnp.cumsum(nch)
    choff = (last - nch).astype(jnp.int32)
    cid = jnp.arange(n_chunks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(last, cid, side="right", method=search), cu.shape[0] - 2)
    t0 = (cu[seq] + (cid - choff[seq]) * chunk).astype(jnp.int32)
    return choff, t0, cu[seq + 1].astype(jnp.int32), ends[seq].astype(jnp.int32)


def workspace_bytes(n_chunks, heads, chunk, dk, dv, u0_bf16):
    """HBM bytes phase 1 writes (phase 2 reads them once, and all but u0 once per value tile)."""
    per = chunk * (3 * dk * 2 + chunk * 2 + dv * (2 if u0_bf16 else 4)) + dk * 4
    return n_chunks * heads * per


def phase1(t0, eos, end, a_log_arr, q, k, v, g, beta, *, heads, chunk, lower_bound, gate, qk_norm, n_chunks,
           interpret, tuning):
    """Phase 1 alone (the workspaces w, u0, q_dec, k_tail, M, e^(G_C)), given `chunk_table`'s t0, eos, end
    (n_chunks a multiple of tuning phase1_chunks)."""
    if n_chunks % tuning["phase1_chunks"]:
        raise ValueError(f"phase 1: {n_chunks} chunks do not divide into programs of {tuning['phase1_chunks']}")
    dk, dv = q.shape[-1], v.shape[-1]
    tr, wq = tuning["phase2_transposed"], tuning["wq_interleaved"]
    ws = lambda *shape, dt: jax.ShapeDtypeStruct((n_chunks, heads, *shape), dt)  # noqa: E731
    shapes = dict(w=ws(chunk, dk, dt=jnp.bfloat16), qd=ws(chunk, dk, dt=jnp.bfloat16),
                  wq=ws(2 * chunk, dk, dt=jnp.bfloat16),
                  u0=ws(chunk, dv, dt=jnp.bfloat16 if tuning["u0_bf16"] else jnp.float32),
                  kt=ws(chunk, dk, dt=jnp.bfloat16), m=ws(chunk, chunk, dt=jnp.bfloat16),
                  dec=ws(*((1, dk) if tr else (dk, 1)), dt=jnp.float32))
    return pl.pallas_call(
        functools.partial(_phase1_kernel, chunk=chunk, lower_bound=lower_bound, gate=gate, qk_norm=qk_norm,
                          per_program=tuning["phase1_chunks"], inverse=tuning["phase1_inverse"], transposed=tr,
                          early_stores=tuning["phase1_early_stores"], wq_interleaved=wq,
                          v_early=tuning["phase1_v_early"], products=tuning["phase1_products"]),
        out_shape=[shapes[name] for name in workspace_names(wq)],
        grid=(n_chunks // tuning["phase1_chunks"], heads), interpret=interpret, name="kda_prefill_phase1",
        compiler_params=compiler_params(tuning["phase1_warps"], tuning["phase1_stages"]),
    )(t0, eos, end, a_log_arr, q, k, v, g, beta)


def run(cu, ends, cpo, a_log_arr, q, k, v, g, beta, s0, *, out_shape, heads, chunk, block_v, lower_bound,
        gate, qk_norm, cp_every, cp_fill_zero, n_chunks, interpret, tuning):
    """Both phases on the flattened [rows, H, ...] inputs; returns what the one-phase pallas_call does."""
    dv = v.shape[-1]
    per = tuning["phase1_chunks"]
    n_chunks = cdiv(n_chunks, per) * per  # whole programs; the extra chunks are masked and never read
    choff, t0, eos, end = chunk_table(cu, ends, chunk, n_chunks)
    work = phase1(t0, eos, end, a_log_arr, q, k, v, g, beta, heads=heads, chunk=chunk, lower_bound=lower_bound,
                  gate=gate, qk_norm=qk_norm, n_chunks=n_chunks, interpret=interpret, tuning=tuning)
    nseq = cu.shape[0] - 1
    return pl.pallas_call(
        functools.partial(_phase2_kernel, heads=heads, chunk=chunk, block_v=block_v, cp_every=cp_every,
                          cp_fill_zero=cp_fill_zero,
                          transposed=tuning["phase2_transposed"], wq_interleaved=tuning["wq_interleaved"],
                          prefetch=tuple(tuning["phase2_prefetch"])),
        out_shape=out_shape, grid=(nseq * heads, dv // block_v), interpret=interpret,
        name="kda_prefill_phase2",
        compiler_params=compiler_params(tuning["num_warps"], tuning["num_stages"]),
    )(cu, choff, cpo, *work, s0)


def check(chunk, lower_bound, unsupported, phase1_chunks, phase1_inverse, phase2_transposed, wq_interleaved,
          phase2_prefetch, phase1_products):
    """The two-phase variant's own limits (raises `unsupported(msg)`); the tuning's values come from the caller's
    merged tuning (TWO_PHASE_DEFAULTS holds the defaults, so none are repeated here)."""
    if phase1_products not in PHASE1_PRODUCTS:
        raise unsupported(f"kda_prefill two-phase kernel: phase1_products = {phase1_products!r} is not one of "
                          f"{PHASE1_PRODUCTS}")
    names = workspace_names(wq_interleaved)
    if isinstance(phase2_prefetch, str) or set(phase2_prefetch) - set(names):
        raise unsupported(f"kda_prefill two-phase kernel: phase2_prefetch = {phase2_prefetch!r} is not a "
                          f"list of the workspaces {names}")
    if wq_interleaved and not phase2_transposed:
        raise unsupported("kda_prefill two-phase kernel: wq_interleaved needs phase2_transposed")
    if phase1_inverse not in ("substitution", "series"):
        raise unsupported(f"kda_prefill two-phase kernel: phase1_inverse = {phase1_inverse!r} is not "
                          "'substitution' or 'series'")
    if not isinstance(phase1_chunks, int) or phase1_chunks < 1:
        raise unsupported(f"kda_prefill two-phase kernel: phase1_chunks = {phase1_chunks!r} is not an integer >= 1")
    if chunk < 16 or chunk & (chunk - 1):
        raise unsupported(f"kda_prefill two-phase kernel: chunk = {chunk} is not a power of two >= 16")
    if lower_bound is not None and anchor_span(chunk) * abs(lower_bound) > MAX_INTRA_EXPONENT:
        raise unsupported(f"kda_prefill two-phase kernel: gate bound {lower_bound} could overflow")


