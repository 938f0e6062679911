"""Kimi Delta Attention: gate, short conv, q/k L2 norm, the recurrence and its chunked scan (SPEC 5).

Shapes: B batch, T tokens, H heads, K key dim, V value dim, C channels (H*K), W conv width.
    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay, <= 0); beta [B, T, H]; s [B, H, K, V]
Every recurrence input is in the accumulation dtype (fp32, or fp64 in the exact mode). A position with
g = 0 and beta = 0 leaves the state exactly unchanged: padding uses that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from kimik3_jax.ops.common import HIGHEST, acc_dtype

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


def kda_chunked(q, k, v, g, beta, s0, chunk: int = DEFAULT_CHUNK):
    """The same function as `kda_recurrent`, in chunks (WY form of the delta rule).

    Within a chunk with cumulative log decay G_t (per key channel), the corrections u solve the unit
    lower-triangular system (I + diag(beta) A) u = beta (v - (k e^G) S0), A[t, i] = sum_c k_t k_i
    e^(G_t - G_i) for i < t; then o = (q e^G) S0 + M u with M[t, i] = sum_c q_t k_i e^(G_t - G_i), i <= t,
    and S = e^(G_C) S0 + (k e^(G_C - G))^T u. Pairs in the same 16-token sub-block use their exponent
    directly; pairs across sub-blocks factor through the decay at the start of the row's sub-block, so
    both factors are <= 1: nothing overflows, and no exponent is a difference of large sums.
    T need not be a multiple of `chunk`: the tail is padded with identity steps (g = 0, beta = 0)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    sub = min(SUB_BLOCK, chunk)
    if chunk % sub:
        raise ValueError(f"chunk = {chunk} must be a multiple of {sub}")
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
    tri = jnp.eye(chunk, dtype=k.dtype) + a_kk
    # One solve for both right-hand sides: two independent batched LAPACK solves can deadlock XLA:CPU's
    # thread pool when it has 2 threads (each blocks a worker waiting for the other's work).
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * (k * jnp.exp(g_t))], axis=-1)
    uw = solve_triangular(tri, rhs, lower=True, unit_diagonal=True)
    u0, w = uw[..., :dv], uw[..., dv:]
    q_dec = q * jnp.exp(g_t)
    k_tail = k * jnp.exp(to_end)

    def body(s, xs):
        u0_c, w_c, q_dec_c, m_c, k_tail_c, g_last_c = xs
        u = u0_c - jnp.einsum("bhtk,bhkv->bhtv", w_c, s, precision=HIGHEST)
        o = jnp.einsum("bhtk,bhkv->bhtv", q_dec_c, s, precision=HIGHEST) + \
            jnp.einsum("bhti,bhiv->bhtv", m_c, u, precision=HIGHEST)
        s = s * jnp.exp(g_last_c)[..., None] + jnp.einsum("bhtk,bhtv->bhkv", k_tail_c, u, precision=HIGHEST)
        return s, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (u0, w, q_dec, m_qk, k_tail, g_last))
    s, o = jax.lax.scan(body, s0, xs)  # o: [N, B, H, C, V]
    o = jnp.moveaxis(jnp.moveaxis(o, 0, 1), 2, 3).reshape(b, n * chunk, h, dv)[:, :t]
    return o, s
