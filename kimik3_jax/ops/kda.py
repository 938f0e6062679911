"""Kimi Delta Attention: gate, short conv, q/k L2 norm, the recurrence and its chunked scan (SPEC 5).

Shapes: B batch, T tokens, H heads, K key dim, V value dim, C channels (H*K), W conv width.
    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay, <= 0); beta [B, T, H]; s [B, H, K, V]
Every recurrence input is in the accumulation dtype (fp32, or fp64 in the exact mode). A position with
g = 0 and beta = 0 leaves the state exactly unchanged: padding uses that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3_jax.ops.common import HIGHEST, acc_dtype, rms_norm

L2_EPS = 1e-6  # inside the sum of squares (SPEC section 5), a constant of the reference code
DEFAULT_CHUNK = 64
SUB_BLOCK = 16  # anchor spacing inside a chunk: exponents stay within 16 * |gate_lower_bound|


def kda_gate(z: jax.Array, a_log: jax.Array, lower_bound: float) -> jax.Array:
    """Lower-bound gate `lower_bound * sigmoid(exp(A_log[h]) * z)`: z [..., H, K], a_log [H] -> log decay."""
    acc = acc_dtype(z.dtype)
    return lower_bound * jax.nn.sigmoid(jnp.exp(a_log.astype(acc))[:, None] * z.astype(acc))


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in the accumulation dtype."""
    x = x.astype(acc_dtype(x.dtype))
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def short_conv(x: jax.Array, w: jax.Array, tail: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv + SiLU with carried history.

    x [B, T, C] (right-padded; `lengths` [B] real tokens), w [C, 1, W] (tap W-1 multiplies the current
    token), tail [B, W-1, C] = the W-1 inputs before x. Returns SiLU(conv) [B, T, C] in x's dtype and the
    new tail: the last W-1 inputs up to each sequence's last real token."""
    acc = acc_dtype(x.dtype)
    width = w.shape[-1]
    xx = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    t = x.shape[1]
    taps = w[:, 0, :].astype(acc)  # [C, W]
    y = sum(xx[:, j:j + t].astype(acc) * taps[:, j] for j in range(width))
    idx = lengths[:, None] + jnp.arange(width - 1)[None, :]  # positions in xx of the new history
    new_tail = jnp.take_along_axis(xx, idx[:, :, None], axis=1)
    return jax.nn.silu(y).astype(x.dtype), new_tail


def kda_step(s: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array):
    """One token: s [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V]; beta [B, H] -> (o [B, H, V], s)."""
    s = s * jnp.exp(g)[..., None]  # decay first
    pred = jnp.einsum("bhkv,bhk->bhv", s, k, precision=HIGHEST)
    s = s + k[..., None] * (beta[..., None] * (v - pred))[..., None, :]  # delta rule on the decayed state
    return jnp.einsum("bhkv,bhk->bhv", s, q, precision=HIGHEST), s  # read after the update


def kda_recurrent(q, k, v, g, beta, s0):
    """Token by token (the definition). Returns (o [B, T, H, V], final state [B, H, K, V])."""
    def body(s, xs):
        o, s = kda_step(s, *xs)
        return s, o
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    s, o = jax.lax.scan(body, s0, xs)
    return jnp.moveaxis(o, 0, 1), s


def _pad_time(x: jax.Array, t_pad: int) -> jax.Array:
    return jnp.pad(x, [(0, 0), (0, t_pad)] + [(0, 0)] * (x.ndim - 2)) if t_pad else x


def _decay_sums(g: jax.Array, nsub: int, sub: int):
    """Every exponent the chunk form needs, each summed from the g's it spans (never a difference of two
    large cumulative sums, whose rounding would be ~1e-4 at the -5 bound). g [.., C, K] for one chunk."""
    gs = g.reshape(*g.shape[:-2], nsub, sub, g.shape[-1])
    f = jnp.cumsum(gs, axis=-2)  # F_t: from the start of t's sub-block, inclusive
    rev = jnp.flip(jnp.cumsum(jnp.flip(gs, -2), axis=-2), -2)
    r = jnp.concatenate([rev[..., 1:, :], jnp.zeros_like(rev[..., :1, :])], axis=-2)  # R_i: after i, to block end
    tot = f[..., -1, :]  # [.., nsub, K] block totals
    m = jnp.arange(nsub)
    between = ((m[None, :, None] < m[None, None, :]) & (m[None, None, :] < m[:, None, None])).astype(g.dtype)
    before = (m[None, :] < m[:, None]).astype(g.dtype)  # [a, m]: m < a
    after = (m[None, :] > m[:, None]).astype(g.dtype)  # [b, m]: m > b
    sb = jnp.einsum("abm,...mk->...abk", between, tot, precision=HIGHEST)  # blocks strictly between b and a
    g_t = (jnp.einsum("am,...mk->...ak", before, tot, precision=HIGHEST)[..., None, :] + f)  # G_t in the chunk
    to_end = r + jnp.einsum("bm,...mk->...bk", after, tot, precision=HIGHEST)[..., None, :]  # G_C - G_i
    flat = lambda x: x.reshape(*x.shape[:-3], nsub * sub, x.shape[-1])  # noqa: E731
    return f, r, sb, flat(g_t), flat(to_end), jnp.sum(tot, axis=-2)


def unit_lower_inverse(a: jax.Array, block: int = SUB_BLOCK) -> jax.Array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] (C a multiple of `block`, or smaller): forward
    substitution inside the diagonal blocks (all blocks at once), then block forward substitution across
    them. Plain XLA ops: jaxlib's batched LAPACK solve deadlocks XLA:CPU when several devices (or two
    solves) wait on its small thread pool at once, and this runs the same on every backend."""
    c = a.shape[-1]
    block = min(block, c)
    nb = c // block
    eye = jnp.eye(block, dtype=a.dtype)
    diag = jnp.stack([a[..., i * block:(i + 1) * block, i * block:(i + 1) * block] for i in range(nb)], -3)
    inv = jnp.broadcast_to(eye, diag.shape)
    for r in range(1, block):  # row r of the inverse from the rows above it
        row = eye[r] - jnp.einsum("...j,...jk->...k", diag[..., r, :], inv, precision=HIGHEST)
        inv = inv.at[..., r, :].set(row)
    t = {(i, i): inv[..., i, :, :] for i in range(nb)}
    blk = lambda i, j: a[..., i * block:(i + 1) * block, j * block:(j + 1) * block]  # noqa: E731
    for i in range(1, nb):
        for j in range(i - 1, -1, -1):  # T_ij = -T_ii sum_{j <= m < i} A_im T_mj
            acc = sum(jnp.einsum("...ab,...bc->...ac", blk(i, m), t[m, j], precision=HIGHEST) for m in range(j, i))
            t[i, j] = -jnp.einsum("...ab,...bc->...ac", t[i, i], acc, precision=HIGHEST)
    zero = jnp.zeros_like(inv[..., 0, :, :])
    return jnp.concatenate([jnp.concatenate([t.get((i, j), zero) for j in range(nb)], -1) for i in range(nb)], -2)


def kda_chunked(q, k, v, g, beta, s0, chunk: int = DEFAULT_CHUNK, return_chunk_states: bool = False):
    """The same function as `kda_recurrent`, in chunks (WY form of the delta rule).

    Within a chunk with cumulative log decay G_t (per key channel), the corrections u solve the unit
    lower-triangular system (I + diag(beta) A) u = beta (v - (k e^G) S0), A[t, i] = sum_c k_t k_i
    e^(G_t - G_i) for i < t; then o = (q e^G) S0 + M u with M[t, i] = sum_c q_t k_i e^(G_t - G_i), i <= t,
    and S = e^(G_C) S0 + (k e^(G_C - G))^T u. Pairs in the same 16-token sub-block use their exponent
    directly; pairs across sub-blocks factor through the decay at the start of the row's sub-block, so
    both factors are <= 1: nothing overflows, and no exponent is a difference of large sums.
    T need not be a multiple of `chunk`: the tail is padded with identity steps (g = 0, beta = 0).
    With `return_chunk_states`, also returns the state after every whole chunk, [B, T // chunk, H, K, V]."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    sub = min(SUB_BLOCK, chunk)
    if chunk % sub:
        raise ValueError(f"chunk = {chunk} must be a multiple of {sub}")
    full_chunks = t // chunk
    chunk = min(chunk, -(-t // sub) * sub)  # a short sequence is not padded to a whole chunk
    nsub = chunk // sub
    n = -(-t // chunk)
    pad = n * chunk - t
    q, k, v, g, beta = (_pad_time(a, pad) for a in (q, k, v, g, beta))

    def split(x):  # [B, N*chunk, H, ...] -> [B, N, H, chunk, ...]
        return jnp.moveaxis(x.reshape(b, n, chunk, h, *x.shape[3:]), 3, 2)

    q, k, v, g, beta = map(split, (q, k, v, g, beta))  # beta: [B, N, H, chunk]
    f, r, sb, g_t, to_end, g_last = _decay_sums(g, nsub, sub)
    blk = jnp.arange(nsub)
    ti = jnp.arange(sub)

    def pair(x, y):  # sum_c x_t[c] y_i[c] e^(G_t - G_i) for i in a sub-block <= t's -> [.., C, C]
        xs = x.reshape(*x.shape[:-2], nsub, sub, dk)
        ys = y.reshape(*y.shape[:-2], nsub, sub, dk)
        # across sub-blocks b < a: (x_t e^(F_t)) . (y_i e^(R_i + between(b, a)))
        col = r[..., None, :, :, :] + sb[..., :, :, None, :]  # [.., a, b, sub, K]
        col = jnp.where((blk[None, :] < blk[:, None])[:, :, None, None], col, -jnp.inf)
        ycol = (ys[..., None, :, :, :] * jnp.exp(col)).reshape(*ys.shape[:-3], nsub, chunk, dk)
        cross = jnp.einsum("...asc,...aic->...asi", xs * jnp.exp(f), ycol, precision=HIGHEST)
        # inside a sub-block: e^(F_t - F_i), i <= t
        d = f[..., :, None, :] - f[..., None, :, :]  # [.., nsub, sub(t), sub(i), K]
        d = jnp.where((ti[:, None] >= ti[None, :])[:, :, None], d, -jnp.inf)
        intra = jnp.einsum("...atc,...aic,...atic->...ati", xs, ys, jnp.exp(d), precision=HIGHEST)
        full = cross.reshape(*cross.shape[:-3], nsub, sub, nsub, sub)
        full = full + intra[..., :, :, None, :] * jnp.eye(nsub, dtype=x.dtype)[:, None, :, None]
        return full.reshape(*full.shape[:-4], chunk, chunk)

    tc = jnp.arange(chunk)
    strict = tc[:, None] > tc[None, :]
    a_kk = jnp.where(strict, pair(k, k), 0.0) * beta[..., :, None]
    m_qk = jnp.where(tc[:, None] >= tc[None, :], pair(q, k), 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * (k * jnp.exp(g_t))], axis=-1)
    uw = jnp.einsum("...ti,...id->...td", unit_lower_inverse(a_kk), rhs, precision=HIGHEST)
    u0, w = uw[..., :dv], uw[..., dv:]
    q_dec = q * jnp.exp(g_t)
    k_tail = k * jnp.exp(to_end)

    def body(s, xs):
        u0_c, w_c, q_dec_c, m_c, k_tail_c, g_last_c = xs
        u = u0_c - jnp.einsum("bhtk,bhkv->bhtv", w_c, s, precision=HIGHEST)
        o = jnp.einsum("bhtk,bhkv->bhtv", q_dec_c, s, precision=HIGHEST) + \
            jnp.einsum("bhti,bhiv->bhtv", m_c, u, precision=HIGHEST)
        s = s * jnp.exp(g_last_c)[..., None] + jnp.einsum("bhtk,bhtv->bhkv", k_tail_c, u, precision=HIGHEST)
        return s, (o, s) if return_chunk_states else o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (u0, w, q_dec, m_qk, k_tail, g_last))
    s, ys = jax.lax.scan(body, s0, xs)  # o: [N, B, H, C, V]
    o = ys[0] if return_chunk_states else ys
    o = jnp.moveaxis(jnp.moveaxis(o, 0, 1), 2, 3).reshape(b, n * chunk, h, dv)[:, :t]
    if return_chunk_states:
        return o, s, jnp.moveaxis(ys[1], 0, 1)[:, :full_chunks]
    return o, s


# ------------------------------------------------------------------ the ops the kernels implement (SPEC 5)

def _gate_and_norm(q, k, v, g, beta, a_log, lower_bound, qk_norm):
    """The per-token prologue both fused ops share: optional gate from its pre-activation, optional q/k
    L2 norm (q also scaled by K^-1/2), everything in the accumulation dtype."""
    acc = acc_dtype(v.dtype)
    if a_log is not None:
        g = kda_gate(g, a_log, lower_bound)
    if qk_norm:
        q, k = l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)
    return q.astype(acc), k.astype(acc), v.astype(acc), g.astype(acc), beta.astype(acc)


def kda_prefill(q, k, v, g, beta, s0, *, a_log=None, lower_bound=None, qk_norm=False, lengths=None,
                cu_seqlens=None, checkpoint=0, out_dtype=None):
    """Chunked KDA prefill, the op the Pallas prefill kernel implements (same signature).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] the log decay, or its pre-activation z when `a_log`
    [H] is given (then g = kda_gate(z, a_log, lower_bound)); beta [B, T, H]; s0 [B, H, K, V] (fp32).
    lower_bound without a_log: the bound the given g respects (g >= lower_bound); this op ignores it, the
    Pallas kernel needs it to bound its exponents.
    qk_norm: q = l2(q) K^-1/2, k = l2(k) first. lengths [B]: positions t >= lengths[b] are identity steps
    (g = 0, beta = 0: the state passes unchanged). cu_seqlens [N+1]: B = 1 holds N packed sequences,
    sequence n at tokens cu[n]:cu[n+1] with its own state s0[n]. checkpoint > 0: also return the state
    after every `checkpoint` tokens of each sequence, [B, T // checkpoint, H, K, V] (batch form) or
    [T // checkpoint, H, K, V] (packed: sequence n's j-th at row sum_{m<n} len_m // checkpoint + j, rows
    past the last are zero). Returns (o [B, T, H, V] in out_dtype (default fp32), final states[, checkpoints])."""
    q, k, v, g, beta = _gate_and_norm(q, k, v, g, beta, a_log, lower_bound, qk_norm)
    b, t = q.shape[:2]
    if lengths is not None:
        valid = jnp.arange(t)[None, :] < lengths[:, None]
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
    if cu_seqlens is None:
        res = kda_chunked(q, k, v, g, beta, s0, checkpoint or DEFAULT_CHUNK, return_chunk_states=checkpoint > 0)
        return (res[0].astype(out_dtype or res[0].dtype),) + tuple(res[1:])
    if b != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got q {q.shape}")
    # Reference for packed sequences: gather each into its own row (identity steps past its end), scan, scatter.
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    pos = jnp.arange(t)[None, :]
    inside = pos < lens[:, None]  # [N, T]
    idx = jnp.where(inside, cu_seqlens[:-1, None] + pos, 0)
    rows = lambda a: jnp.take(a[0], idx, axis=0)  # noqa: E731  [N, T, ...]
    gq, gk, gv, gg, gb = map(rows, (q, k, v, g, beta))
    gg = jnp.where(inside[..., None, None], gg, 0.0)
    gb = jnp.where(inside[..., None], gb, 0.0)
    res = kda_chunked(gq, gk, gv, gg, gb, s0, checkpoint or DEFAULT_CHUNK, return_chunk_states=checkpoint > 0)
    dest = jnp.where(inside, idx, t)  # out of range: dropped
    o = jnp.zeros_like(v[0]).at[dest].set(res[0], mode="drop")[None].astype(out_dtype or v.dtype)
    if not checkpoint:
        return o, res[1]
    per_seq = lens // checkpoint
    first = jnp.cumsum(per_seq) - per_seq
    j = jnp.arange(res[2].shape[1])[None, :]
    cdest = jnp.where(j < per_seq[:, None], first[:, None] + j, t)
    cps = jnp.zeros((t // checkpoint,) + s0.shape[1:], s0.dtype).at[cdest].set(res[2], mode="drop")
    return o, res[1], cps


def gated_output_norm(o: jax.Array, norm_w: jax.Array, gate: jax.Array, eps: float, dtype) -> jax.Array:
    """KDA's output: the RMSNorm of o over V (weight norm_w) times sigmoid(gate), cast to dtype."""
    o = rms_norm(o, norm_w, eps)
    return (o * jax.nn.sigmoid(gate.astype(o.dtype))).astype(dtype)


def kda_decode(qkv, conv_w, conv_pool, s_pool, slots, g, beta, gate, norm_w, *, eps, lengths=None,
               a_log=None, lower_bound=None, qk_norm=True):
    """One fused decode step for N sequences whose states live in pools, the op the Pallas decode kernel
    implements: conv-tail update, q/k/v causal conv + SiLU, gate, q/k L2 norm, the recurrence step and
    the gated RMSNorm of the output.

    qkv [N, 3, C] the q, k, v projections before the conv (C = H*K); conv_w [3, C, W]; conv_pool
    [P, 3, W-1, C] conv tails; s_pool [P, H, K, V] states (fp32); slots [N] rows of the pools; g [N, H, K]
    (or its pre-activation with `a_log`, as in kda_prefill); beta [N, H]; gate [N, H, V] the output
    gate's pre-activation; norm_w [V]; lengths [N] in {0, 1}: a 0 leaves that slot's tail and state as
    they are. Returns (o [N, H, V] in qkv's dtype, new conv_pool, new s_pool)."""
    nb, h = qkv.shape[0], s_pool.shape[1]
    lens = jnp.ones((nb,), jnp.int32) if lengths is None else lengths
    tails = conv_pool[slots]
    ys, new_tails = [], []
    for j in range(3):
        y, tail = short_conv(qkv[:, j:j + 1], conv_w[j][:, None, :], tails[:, j], lens)
        ys.append(y[:, 0].reshape(nb, h, -1))
        new_tails.append(tail)
    q, k, v, g, beta = _gate_and_norm(*ys, g, beta, a_log, lower_bound, qk_norm)
    active = lens > 0
    g = jnp.where(active[:, None, None], g, 0.0)
    beta = jnp.where(active[:, None], beta, 0.0)
    o, s = kda_step(s_pool[slots], q, k, v, g, beta)
    o = gated_output_norm(o, norm_w, gate, eps, qkv.dtype)
    return o, conv_pool.at[slots].set(jnp.stack(new_tails, axis=1)), s_pool.at[slots].set(s)
