"""prefill and decode_step: the layer loop of SPEC section 4 over the decode state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kimik3_jax.config import FFN_DENSE, LAYER_KDA, ModelConfig
from kimik3_jax.model.layers import kda_layer, mla_layer
from kimik3_jax.model.state import DecodeState
from kimik3_jax.ops.attn_res import attn_res_mix, fold_site
from kimik3_jax.ops.common import acc_dtype, linear, mlp, rms_norm
from kimik3_jax.ops.moe import latent_moe
from kimik3_jax.sharding.plan import constrain

CANDS = (None, "batch", "seq", "embed")  # logical axes of the AttnRes candidate buffer


def _text(params):
    return params.text if hasattr(params, "text") else params


def _at(tree, i):
    """Layer `i` (may be traced) of a stacked parameter tree."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _switch(index, branches: dict, *operands):
    """`lax.switch` over the branches that exist in this config (a kind with no layers has no branch)."""
    present = [branches[k] for k in sorted(branches)]
    if len(present) == 1:
        return present[0](*operands)
    keys = jnp.asarray(sorted(branches), jnp.int32)
    return jax.lax.switch(jnp.argmax(keys == index), present, *operands)


def _forward(params, cfg: ModelConfig, tokens, lengths, state: DecodeState, decode: bool, last_only: bool = False):
    """The layer loop of SPEC section 4 as one `lax.scan` over the layers, so each layer kind compiles
    once whatever the depth. AttnRes keeps its candidates in a fixed buffer `cands [n_blocks + 1, B, T, D]`:
    slots < nb hold the banked blocks, slot nb the live block sum P; banking is `nb += 1` with a zeroed
    new live slot (`0 + a` is exactly `a`), and a mix sees the first nb + 1 slots only."""
    t = _text(params)
    act = t.embed.dtype
    eps = cfg.rms_norm_eps
    start = state.lengths
    kinds = np.array([0 if k == LAYER_KDA else 1 for k in cfg.layer_kinds], np.int32)
    ffns = np.array([0 if k == FFN_DENSE else 1 for k in cfg.ffn_kinds], np.int32)
    slots = np.array([cfg.stack_index(i) for i in range(cfg.num_layers)], np.int32)
    banks = np.arange(cfg.num_layers) % cfg.attn_res_block_size == 0

    def kda(x, ai, st):
        kda_s, kda_conv, mla_kv = st
        a, s, conv = kda_layer(x, _at(t.kda, ai), kda_s[ai], kda_conv[ai], lengths, cfg, decode)
        return a, (kda_s.at[ai].set(s), kda_conv.at[ai].set(conv), mla_kv)

    def mla(x, ai, st):
        kda_s, kda_conv, mla_kv = st
        a, kv = mla_layer(x, _at(t.mla, ai), mla_kv[ai], start, lengths, cfg, decode)
        return a, (kda_s, kda_conv, mla_kv.at[ai].set(kv))

    def dense(x, fi):
        d = _at(t.dense, fi)
        return mlp(x, d.gate, d.up, d.down, cfg.situ_beta, cfg.situ_linear_beta)

    def moe(x, fi):
        return latent_moe(x, _at(t.moe, fi), cfg)

    attn_branches = {k: f for k, f, n in ((0, kda, cfg.kda_layers), (1, mla, cfg.mla_layers)) if n}
    ffn_branches = {k: f for k, f, n in ((0, dense, cfg.dense_layers), (1, moe, cfg.moe_layers)) if n}

    def layer(carry, xs):
        cands, nb, st = carry
        ln, kind, ffn, (ai, fi), bank = xs
        h = attn_res_mix(cands, fold_site(ln.attn_res_norm, ln.attn_res_proj, act), eps, nb + 1)
        nb = nb + bank.astype(nb.dtype)  # bank the raw layer input (the live slot), not h
        live = jnp.where(bank, jnp.zeros_like(h), cands[nb])
        with jax.named_scope("attention"):
            a, st = _switch(kind, attn_branches, rms_norm(h, ln.input_layernorm, eps), ai, st)
        live = live + a
        cands = cands.at[nb].set(live)
        x = rms_norm(attn_res_mix(cands, fold_site(ln.mlp_res_norm, ln.mlp_res_proj, act), eps, nb + 1),
                     ln.post_attention_layernorm, eps)
        with jax.named_scope("ffn"):
            f = _switch(ffn, ffn_branches, x, fi)
        return (constrain(cands.at[nb].set(live + f), cfg, CANDS), nb, st), None

    embedded = constrain(t.embed[tokens], cfg, CANDS[1:])
    cands = jnp.zeros((len(cfg.block_starts) + 1,) + embedded.shape, act).at[0].set(embedded)
    cands = constrain(cands, cfg, CANDS)
    st = (state.kda.s, state.kda.conv, state.mla.kv)
    xs = (t.layers, kinds, ffns, (slots[:, 0], slots[:, 1]), banks)
    (cands, nb, st), _ = jax.lax.scan(layer, (cands, jnp.int32(0), st), xs)
    if last_only:  # the head only where the next token is read: [B, T, V] logits can dwarf the model
        last = jnp.maximum(lengths - 1, 0)[None, :, None, None]
        cands = jnp.take_along_axis(cands, last, axis=2)
    h = attn_res_mix(cands, fold_site(t.out_res_norm, t.out_res_proj, act), eps, nb + 1)
    logits = linear(rms_norm(h, t.final_norm, eps), t.lm_head, acc_dtype(act))
    logits = constrain(logits, cfg, ("batch", "seq", "vocab"))
    kda_s, kda_conv, mla_kv = st
    new = DecodeState(kda=state.kda.replace(s=kda_s, conv=kda_conv), mla=state.mla.replace(kv=mla_kv),
                      lengths=start + lengths.astype(start.dtype))
    return logits, new


def _check_room(state: DecodeState, lengths) -> None:
    """Host-side check when the values are known: not under a trace, and not for a multi-host state split
    over `data`, which no one process can read (there, writes past the capacity are dropped)."""
    try:
        if not all(getattr(x, "is_fully_addressable", True) for x in (state.lengths, lengths)):
            return
        used, new = np.asarray(state.lengths), np.asarray(lengths)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    over = np.nonzero(used + new > state.capacity)[0]
    if over.size:
        b = int(over[0])
        raise ValueError(f"sequence {b}: {int(used[b])} cached + {int(new[b])} new tokens exceed the state's "
                         f"capacity of {state.capacity} (init_state max_len)")
    if np.any(new < 0):
        raise ValueError(f"lengths must be >= 0, got {new.tolist()}")


def _prefill_args(tokens, lengths, state: DecodeState):
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (tokens.shape[0],) or state.batch != tokens.shape[0]:
        raise ValueError(f"lengths {lengths.shape} and state batch {state.batch} must match tokens batch "
                         f"{tokens.shape[0]}")
    _check_room(state, lengths)
    return tokens, lengths


def prefill(params, cfg: ModelConfig, tokens, lengths, state: DecodeState):
    """Run `tokens` [B, T] (right-padded; `lengths` [B] real tokens each) after what `state` holds.
    Returns (logits [B, T, V] in the accumulation dtype, new state). Padded positions change neither
    a real token's result nor the state; continuing from a saved state equals one longer prefill."""
    tokens, lengths = _prefill_args(tokens, lengths, state)
    return _forward(params, cfg, tokens, lengths, state, decode=False)


def prefill_last(params, cfg: ModelConfig, tokens, lengths, state: DecodeState):
    """`prefill` that returns only each sequence's logits at its last real token, [B, V]: the LM head
    runs on B rows instead of B*T (at K3's vocabulary, [B, T, V] fp32 logits of a long batch would be
    tens of GB). A row with length 0 gets the logits of its position 0 (meaningless; ignore it)."""
    tokens, lengths = _prefill_args(tokens, lengths, state)
    logits, state = _forward(params, cfg, tokens, lengths, state, decode=False, last_only=True)
    return logits[:, 0], state


def decode_step(params, cfg: ModelConfig, state: DecodeState, tokens):
    """One token per sequence, tokens [B] -> (logits [B, V], new state). MLA reads its latent cache in
    the absorbed form; KDA takes one recurrence step."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.shape != (state.batch,):
        raise ValueError(f"tokens must be [batch] = [{state.batch}], got shape {tokens.shape}")
    ones = jnp.ones_like(tokens)
    _check_room(state, ones)
    logits, state = _forward(params, cfg, tokens[:, None], ones, state, decode=True)
    return logits[:, 0], state
