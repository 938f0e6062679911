"""Block-aligned dropless dispatch for the grouped expert GEMMs.

The N*k token/expert pairs are sorted by expert (stable, so ties keep pair order) and each expert's
group is padded to a multiple of the row block `bm`: the padded rows ("slots") form T tiles of bm rows,
each tile owned by one expert. T is static: sum_e ceil(size_e / bm) <= (P + min(E, P) * (bm - 1)) // bm
for P pairs over E experts, whatever the skew (all pairs on one expert, empty experts). Tiles past the
used ones carry the expert id E and the kernels skip them. Padding slots point at token 0 with routing
weight 0, and no pair reads them back. A pair whose expert id is outside [0, E) is skipped (expert
parallelism marks pairs owned by another device that way): it gets no slot and contributes zero.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockLayout(NamedTuple):
    tile_expert: jax.Array   # [T] int32: the expert of each tile, E for an unused tile
    slot_token: jax.Array    # [T * bm] int32: the token each slot reads (0 for padding)
    slot_weight: jax.Array   # [T * bm] float32: its routing weight (0 for padding)
    slot_of_pair: jax.Array  # [N * k] int32: where pair (n, j) (row-major) landed
    pair_used: jax.Array     # [N * k] bool: False for a skipped pair (expert id out of range)
    tile_used: jax.Array     # [T] int32: the slots of each tile that hold pairs (its first ones; 0 if unused)


def num_tiles(pairs: int, num_experts: int, bm: int) -> int:
    """The static upper bound on the tiles any routing of `pairs` pairs needs."""
    return max(1, (pairs + min(num_experts, pairs) * (bm - 1)) // bm)


def block_layout(idx: jax.Array, weights: jax.Array, num_experts: int, bm: int) -> BlockLayout:
    """idx [N, k] expert ids, weights [N, k] -> the BlockLayout for row block `bm` (pure jnp; its scatters, the
    group counts and the inverse permutation, are integer adds and writes of distinct indices: deterministic)."""
    n, k = idx.shape
    pairs = n * k
    flat = idx.reshape(-1).astype(jnp.int32)
    pair_used = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(pair_used, flat, num_experts)  # skipped pairs sort last and get no slot
    order = jnp.argsort(flat, stable=True)  # sorted rank -> pair
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    start = jnp.cumsum(sizes) - sizes  # first rank of each expert
    tiles = (sizes + bm - 1) // bm
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    t = jnp.arange(num_tiles(pairs, num_experts, bm), dtype=jnp.int32)
    # E past the last tile; compare_all: one fusion, where the default binary search is a loop of launches
    tile_expert = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    e = jnp.minimum(tile_expert, num_experts - 1)
    offset = ((t - tile_start[e]) * bm)[:, None] + jnp.arange(bm, dtype=jnp.int32)[None, :]  # rank in group
    used = (tile_expert[:, None] < num_experts) & (offset < sizes[e][:, None])
    pair = jnp.where(used, order[jnp.where(used, start[e][:, None] + offset, 0)], 0).reshape(-1)
    used = used.reshape(-1)
    slot_token = jnp.where(used, pair // k, 0).astype(jnp.int32)
    slot_weight = jnp.where(used, weights.reshape(-1).astype(jnp.float32)[pair], 0.0)
    # pair -> sorted rank: the inverse permutation as a scatter (a second sort before)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=order.dtype), unique_indices=True)
    fe = jnp.minimum(flat, num_experts - 1)
    slot_of_pair = jnp.where(pair_used, tile_start[fe] * bm + rank - start[fe], 0).astype(jnp.int32)
    tile_used = jnp.where(tile_expert < num_experts, jnp.clip(sizes[e] - (t - tile_start[e]) * bm, 0, bm), 0)
    return BlockLayout(tile_expert, slot_token, slot_weight, slot_of_pair, pair_used, tile_used.astype(jnp.int32))


def combine(y_slots: jax.Array, layout: BlockLayout, n: int, k: int, weighted: bool = True) -> jax.Array:
    """Per-slot outputs [T * bm, L] -> [N, L]: each token gathers its k pairs and sums them in top-k order
    (a gather, never a scatter-add: deterministic). weighted: the routing weights are already applied;
    False applies them to the gathered rows (one pass over the pairs, none over all the slots). Written as
    k gathers of [N, L] summed, so that XLA makes one fusion reading each pair's row once and writing [N, L]
    (not a [N * k, L] intermediate)."""
    slot = layout.slot_of_pair.reshape(n, k)
    used = layout.pair_used.reshape(n, k)
    weight = None if weighted else layout.slot_weight[layout.slot_of_pair].reshape(n, k)
    # made before the gathers: fused into them, the slots' arithmetic (a chain of dependent loads per pair)
    # ran once per output element: 23 us of a 1-token decode step on the H100, for 16 rows of 3584
    slot, used, weight = jax.lax.optimization_barrier((slot, used, weight))
    out = None
    for j in range(k):
        y = y_slots[slot[:, j]]
        if weight is not None:
            y = y * weight[:, j, None]
        y = jnp.where(used[:, j, None], y, 0.0)
        out = y if out is None else out + y
    return out
