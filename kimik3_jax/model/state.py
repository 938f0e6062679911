"""The decode state: a fixed-shape pytree per layer kind, so nothing recompiles while generating.

Shapes (SPEC section 9), stacked over the layers of each kind in ascending order:
    KDAState.s      [Lk, B, H, K, V]        fp32 recurrent state (key rows, value columns)
    KDAState.conv   [Lk, B, 3, C-1, H*K]    activation dtype: the last C-1 inputs of the q, k, v convs
    MLACache.kv     [Lm, B, S, R+P]          activation dtype: per token the normed latent c[R] then k_pe[P]
    DecodeState.lengths [B]                 int32: tokens consumed so far by each sequence
`S` is the cache capacity chosen at `init_state`; AttnRes keeps no state across tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from kimik3_jax.config import ModelConfig


@struct.dataclass
class KDAState:
    s: jax.Array
    conv: jax.Array


@struct.dataclass
class MLACache:
    kv: jax.Array


@struct.dataclass
class DecodeState:
    kda: KDAState
    mla: MLACache
    lengths: jax.Array

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.mla.kv.shape[2]


# Logical axes of every state leaf (mapped to mesh axes by kimik3_jax.sharding.rules): KDA states and
# conv tails split by heads; the MLA latent is shared by all heads, so its cache is split only by batch.
STATE_AXES = DecodeState(
    kda=KDAState(s=("layers", "batch", "kda_heads", None, None), conv=("layers", "batch", None, None, "kda_heads")),
    mla=MLACache(kv=("layers", "batch", "cache_seq", None)),
    lengths=("batch",),
)


def state_shapes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> DecodeState:
    """ShapeDtypeStructs of the state; allocates nothing."""
    k, m = cfg.kda, cfg.mla
    acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    sds = jax.ShapeDtypeStruct
    lk, lm = len(cfg.kda_layers), len(cfg.mla_layers)
    return DecodeState(
        kda=KDAState(s=sds((lk, batch, k.num_heads, k.head_dim, k.head_dim), acc),
                     conv=sds((lk, batch, 3, k.conv_size - 1, k.num_heads * k.head_dim), dtype)),
        mla=MLACache(kv=sds((lm, batch, max_len, m.kv_lora_rank + m.qk_rope_head_dim), dtype)),
        lengths=sds((batch,), jnp.int32),
    )


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> DecodeState:
    """An empty state for `batch` sequences of up to `max_len` tokens (prompt plus generated), created
    directly in its shards when `cfg.runtime.sharding` holds a plan."""
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len = {max_len} exceeds max_position_embeddings = {cfg.max_position_embeddings}")
    if cfg.runtime.sharding is None:
        return _zeros(state_shapes(cfg, batch, max_len, dtype))
    return _sharded_zeros(cfg, batch, max_len, jnp.dtype(dtype))()


def _zeros(shapes):
    return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


@functools.lru_cache(maxsize=16)
def _sharded_zeros(cfg: ModelConfig, batch: int, max_len: int, dtype):
    """A compiled maker of the zero state straight into its shards (once per config, batch and length)."""
    shapes = state_shapes(cfg, batch, max_len, dtype)
    return jax.jit(lambda: _zeros(shapes), out_shardings=cfg.runtime.sharding.state(shapes))


def state_bytes(cfg: ModelConfig, max_len: int = 0, dtype=jnp.bfloat16) -> dict[str, int]:
    """Bytes of decode state for ONE sequence: fixed KDA state and conv tails, MLA cache per token."""
    one = state_shapes(cfg, 1, 1, dtype)
    nbytes = lambda a: math.prod(a.shape) * jnp.dtype(a.dtype).itemsize  # noqa: E731
    per_token = nbytes(one.mla.kv)
    return {"kda_state": nbytes(one.kda.s), "kda_conv": nbytes(one.kda.conv),
            "mla_per_token": per_token, "mla": per_token * max_len}
