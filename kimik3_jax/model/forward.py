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


def _text(params):
    return params.text if hasattr(params, "text") else params


def _take(tree, i: int):
    return jax.tree_util.tree_map(lambda a: a[i], tree)


def cast_params(params, dtype):
    """Every floating leaf in `dtype` (float32/float64 run every op in that dtype); packed expert bytes
    stay uint8 and decode exactly into the compute dtype. bfloat16 keeps the released dtypes (the
    production policy: bf16 weights, the seven fp32 kinds stay fp32)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return params
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


def _forward(params, cfg: ModelConfig, tokens, lengths, state: DecodeState, decode: bool):
    t = _text(params)
    act = t.embed.dtype
    eps = cfg.rms_norm_eps
    start = state.lengths
    kda_s, kda_conv, mla_kv = state.kda.s, state.kda.conv, state.mla.kv

    def mix(blocks, live, norm_w, proj_w):
        return attn_res_mix(jnp.stack(blocks + [live]), fold_site(norm_w, proj_w, act), eps)

    live = t.embed[tokens]  # P: the running sum of the current block
    blocks: list = []
    for i in range(cfg.num_layers):
        ln = _take(t.layers, i)
        ai, fi = cfg.stack_index(i)
        with jax.named_scope(f"layer_{i}"):
            h = mix(blocks, live, ln.attn_res_norm, ln.attn_res_proj) if blocks else live
            if i % cfg.attn_res_block_size == 0:  # bank the raw layer input, not h
                blocks.append(live)
                live = None
            x = rms_norm(h, ln.input_layernorm, eps)
            if cfg.layer_kinds[i] == LAYER_KDA:
                a, s, conv = kda_layer(x, _take(t.kda, ai), kda_s[ai], kda_conv[ai], lengths, cfg, decode)
                kda_s, kda_conv = kda_s.at[ai].set(s), kda_conv.at[ai].set(conv)
            else:
                a, kv = mla_layer(x, _take(t.mla, ai), mla_kv[ai], start, lengths, cfg, decode)
                mla_kv = mla_kv.at[ai].set(kv)
            live = a if live is None else live + a
            x = rms_norm(mix(blocks, live, ln.mlp_res_norm, ln.mlp_res_proj), ln.post_attention_layernorm, eps)
            if cfg.ffn_kinds[i] == FFN_DENSE:
                d = _take(t.dense, fi)
                f = mlp(x, d.gate, d.up, d.down, cfg.situ_beta, cfg.situ_linear_beta)
            else:
                f = latent_moe(x, _take(t.moe, fi), cfg)
            live = live + f
    h = mix(blocks, live, t.out_res_norm, t.out_res_proj)
    logits = linear(rms_norm(h, t.final_norm, eps), t.lm_head, acc_dtype(act))
    new = DecodeState(kda=state.kda.replace(s=kda_s, conv=kda_conv), mla=state.mla.replace(kv=mla_kv),
                      lengths=start + lengths.astype(start.dtype))
    return logits, new


def _check_room(state: DecodeState, lengths) -> None:
    """Host-side check when the values are known (not under a trace): the cache must hold the tokens."""
    try:
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


def prefill(params, cfg: ModelConfig, tokens, lengths, state: DecodeState):
    """Run `tokens` [B, T] (right-padded; `lengths` [B] real tokens each) after what `state` holds.
    Returns (logits [B, T, V] in the accumulation dtype, new state). Padded positions change neither
    a real token's result nor the state; continuing from a saved state equals one longer prefill."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (tokens.shape[0],) or state.batch != tokens.shape[0]:
        raise ValueError(f"lengths {lengths.shape} and state batch {state.batch} must match tokens batch "
                         f"{tokens.shape[0]}")
    _check_room(state, lengths)
    return _forward(params, cfg, tokens, lengths, state, decode=False)


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
