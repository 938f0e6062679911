"""The K3 text model as pure functions (SPEC sections 4-9).

    state = init_state(cfg, batch, max_len, dtype)                 # DecodeState, fixed shapes
    logits, state = prefill(params, cfg, tokens, lengths, state)   # tokens [B, T] int32 right-padded,
                                                                   # lengths [B]; logits [B, T, V] fp32
    logits, state = prefill_last(params, cfg, tokens, lengths, state)  # only each row's last logits [B, V]
    logits, state = decode_step(params, cfg, state, tokens)        # tokens [B]; logits [B, V] fp32
    params = cast_params(params, jnp.float64)                      # the precision of every op follows

`cfg` is static (hashable); jit with `jax.jit(prefill, static_argnums=1)`. The compute dtype is the
dtype of the embedding table: bfloat16 is the production policy (SPEC section 8), float32 and float64
run every op in that dtype.
"""

from kimik3_jax.model.forward import decode_step, prefill, prefill_last
from kimik3_jax.model.state import DecodeState, KDAState, MLACache, init_state, state_bytes, state_shapes
from kimik3_jax.params import cast_params

__all__ = ["DecodeState", "KDAState", "MLACache", "init_state", "state_bytes", "state_shapes",
           "prefill", "prefill_last", "decode_step", "cast_params"]
