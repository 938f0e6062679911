"""The pieces the Pallas decode kernels share (`decode.py` and `decode_split.py`): the launch grid, a
channel block's causal conv, the head's prologue (q/k norms, gate, beta), all of a head's inputs with its new
conv tails (loaded by `head_loads`, computed by `head_inputs`: a kernel can issue other loads in between), the
state step, and the output's gated RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kimik3_jax.ops.kda import L2_EPS

PRE_ROWS = 5  # the split prologue's rows a (sequence, head): q, k, v, g, beta (repeated along its row)


def grid(nb: int, nh: int, heads_fastest: bool, tiles: tuple = ()):
    """The launch grid (`tiles` first, then rows and heads in the order asked for) and the kernel's
    (*tile, n, h) from its program ids."""
    k = len(tiles)
    if heads_fastest:
        return tiles + (nh, nb), lambda: (*(pl.program_id(i) for i in range(k)), pl.program_id(k + 1), pl.program_id(k))
    return tiles + (nb, nh), lambda: tuple(pl.program_id(i) for i in range(k + 2))


def gate_inputs(g_ref, b_ref, alog_ref, n, h, gate):
    """One (sequence, head)'s raw gate row, beta and (with the gate on) A_log, loaded: a kernel calls this
    before its conv, so that these loads are issued at its start rather than behind the q/k norms' barriers
    (where the offline SASS had them, each a memory latency in turn)."""
    return g_ref[n, h, :], b_ref[n, h], alog_ref[h] if gate else None


def head_prologue(q, k, raw, active, lower_bound, gate, qk_norm):
    """The q/k L2 norm (q also scaled by K^-1/2), the lower-bound gate and beta of one (sequence, head) from
    its `gate_inputs`; an inactive row gets g = 0 and beta = 0 (its state stays as it is)."""
    f32 = jnp.float32
    dk = q.shape[0]
    g, beta, a_log = raw
    if qk_norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * dk ** -0.5
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    g = g.astype(f32)
    if gate:
        g = lower_bound * jax.nn.sigmoid(jnp.exp(a_log.astype(f32)) * g)
    g = jnp.where(jnp.broadcast_to(active, g.shape), g, 0.0)  # explicit: Mosaic GPU does not broadcast
    beta = jnp.where(active, beta.astype(f32), 0.0)
    return q, k, g, beta


def gated_norm(o, nw, gate_row, eps):
    """The output's RMSNorm over V (weight nw) times sigmoid(gate), in fp32."""
    f32 = jnp.float32
    o = o * jax.lax.rsqrt(jnp.sum(o * o) / o.shape[-1] + eps) * nw.astype(f32)
    return o * jax.nn.sigmoid(gate_row.astype(f32))


def conv_inputs(conv_ref, qkv_ref, w_ref, slot, n, j, chans):
    """Channel block `chans` of projection j of row n, loaded: the conv's history (the slot's tail and the new
    token) and its weights, one row per tap."""
    width = w_ref.shape[-1]
    hist = [conv_ref[slot, j, r, chans] for r in range(width - 1)] + [qkv_ref[n, j, chans]]
    return hist, [w_ref[j, chans, r] for r in range(width)]


def conv_silu(hist, w, dtype):
    """The causal conv of one channel block from its `conv_inputs`, SiLU, rounded to the activation dtype as the
    reference does (returned in fp32)."""
    f32 = jnp.float32
    y = jnp.zeros(hist[0].shape, f32)
    for x, wr in zip(hist, w):
        y = y + x.astype(f32) * wr.astype(f32)
    return jax.nn.silu(y).astype(dtype).astype(f32)


def conv(conv_ref, qkv_ref, w_ref, slot, n, j, chans):
    """Channel block `chans` of projection j of row n: its conv + SiLU (`conv_silu`) and its history."""
    hist, w = conv_inputs(conv_ref, qkv_ref, w_ref, slot, n, j, chans)
    return conv_silu(hist, w, qkv_ref.dtype), hist


def head_loads(conv_ref, qkv_ref, w_ref, g_ref, b_ref, alog_ref, *, slot, n, h, dk, gate):
    """Every input one (sequence, head) reads, loaded: its `gate_inputs` and its q, k, v `conv_inputs`."""
    chans = pl.ds(h * dk, dk)
    raw = gate_inputs(g_ref, b_ref, alog_ref, n, h, gate)
    return raw, [conv_inputs(conv_ref, qkv_ref, w_ref, slot, n, j, chans) for j in range(3)]


def head_inputs(loaded, dtype, tails_dtype, *, active, lower_bound, gate, qk_norm):
    """One (sequence, head)'s q, k, v (conv + SiLU over the slot's tails), gate and beta (`head_prologue`) from
    its `head_loads`, and the new conv tails of its q, k, v channels as (projection, row, tile) for the caller
    to store after its last load: each tail moves by one token, and an inactive row keeps its tail."""
    raw, convs = loaded
    ys, tails = [], []
    for j, (hist, w) in enumerate(convs):
        ys.append(conv_silu(hist, w, dtype))
        keep = jnp.broadcast_to(active, hist[0].shape)
        tails += [(j, r, jnp.where(keep, hist[r + 1], hist[r]).astype(tails_dtype)) for r in range(len(hist) - 1)]
    q, k, v = ys
    q, k, g, beta = head_prologue(q, k, raw, active, lower_bound, gate, qk_norm)
    return q, k, v, g, beta, tails


def state_step(s0, q, k, v, g, beta):
    """The recurrence on a state tile [K, B]: decay first, then the delta-rule update; returns the new tile
    (fp32) and its read by q, the un-normed output [B]."""
    s = s0.astype(jnp.float32) * jnp.exp(g)[:, None]
    pred = jnp.sum(s * k[:, None], axis=0)
    s = s + k[:, None] * (beta * (v - pred))[None, :]
    return s, jnp.sum(s * q[:, None], axis=0)
