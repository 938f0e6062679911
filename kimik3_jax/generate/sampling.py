"""Sampling: settings per sequence, one jittable function for a mixed batch.

`sample` applies, per row, the temperature, then top-k (0 = off), then top-p on the tempered
distribution that top-k left (the order of vLLM and Hugging Face); temperature 0 is greedy and returns
the exact argmax (the lowest index among ties).
Settings are arrays [B], so greedy and sampled rows share one compiled function.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kimik3_jax.errors import K3Error


class GenerationArgumentError(K3Error, ValueError):
    """A generation setting or prompt that cannot be used (the message names which one)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0        # 1: off
    top_k: int = 0            # 0: off

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise GenerationArgumentError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise GenerationArgumentError(f"top_p must be a number in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise GenerationArgumentError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls(temperature=0.0)

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def stack_params(params: list[SamplingParams]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """temperature [B] f32, top_p [B] f32, top_k [B] int32 for `sample`."""
    return (jnp.asarray([p.temperature for p in params], jnp.float32),
            jnp.asarray([p.top_p for p in params], jnp.float32),
            jnp.asarray([p.top_k for p in params], jnp.int32))


def sample(logits_BV: jax.Array, key: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array,
           top_k_B: jax.Array) -> jax.Array:
    """Token ids [B] int32 drawn from `logits_BV` (float32) with each row's own settings.

    `key` is one PRNG key (split over the rows) or a batch of keys [B], one per row, which makes a
    row's draw independent of the other rows and of its position in the batch."""
    B, V = logits_BV.shape
    greedy_B = jnp.argmax(logits_BV, axis=-1)  # in the logits' own precision (float64 runs stay exact)
    logits_BV = logits_BV.astype(jnp.float32)
    keys = key if _is_batched_key(key) else jax.random.split(key, B)

    safe_t_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
    logits_BV = logits_BV / safe_t_B[:, None]
    # Sorting descending once serves top-k (a rank cut) and top-p (a cumulative-mass cut).
    order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    rank_V = jnp.arange(V, dtype=jnp.int32)
    keep_BV = (top_k_B[:, None] <= 0) | (rank_V[None, :] < top_k_B[:, None])
    probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # the top token always stays; top_p = 1 keeps everything even where the float sum rounds past 1
    keep_BV &= (mass_before_BV < top_p_B[:, None]) | (rank_V[None, :] == 0) | (top_p_B[:, None] >= 1)
    scaled_BV = jnp.where(keep_BV, sorted_BV, -jnp.inf)
    pick_B = jax.vmap(jax.random.categorical)(keys, scaled_BV)
    sampled_B = jnp.take_along_axis(order_BV, pick_B[:, None], axis=-1)[:, 0]
    return jnp.where(temperature_B > 0, sampled_B, greedy_B).astype(jnp.int32)


def _is_batched_key(key: jax.Array) -> bool:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 1
    return key.ndim == 2  # raw uint32 keys [B, 2]
