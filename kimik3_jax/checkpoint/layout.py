"""The release layout: which tensors a config implies, and how they are split into shards.

Release facts (SPEC section 2): shards are `model-{i:05d}-of-{n:06d}.safetensors`; the index maps
every tensor name to its shard and states `total_size` = tensor bytes; each MoE layer's expert
tensors sit together in one shard (in the safetensors data order, which is name order for the
uint8 experts: 0, 1, 10, 100, ...); vision tensors are in the last shards.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import CheckpointError
from kimik3_jax.params import Leaf, describe, named_leaves

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
RELEASE_SHARD_BYTES = 16 * 2**30  # about the release's average shard (1.56 TB / 96)


def shard_name(i: int, n: int) -> str:
    """1-based shard `i` of `n`, named as in the release (5-digit index, 6-digit total)."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


@dataclass(frozen=True)
class Tensor:
    """One release tensor and where it lives in the parameter tree."""

    name: str
    leaf: Leaf
    path: str  # dotted path of the leaf in the tree
    index: tuple[int, ...]  # position inside the leaf's layer/expert stack
    layer: int | None
    expert: int | None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.leaf.shape

    @property
    def nbytes(self) -> int:
        return self.leaf.tensor_bytes


@functools.lru_cache(maxsize=8)
def inventory(cfg: ModelConfig, text_only: bool = False) -> tuple[Tensor, ...]:
    """Every tensor of the release layout of `cfg`, in tree order (cached: ~3 s for the real model)."""
    return tuple(Tensor(name, leaf, path, index, layer, expert)
                 for path, leaf in named_leaves(describe(cfg, text_only))
                 for index, name, layer, expert in leaf.tensors())


def _unit_of(t: Tensor) -> tuple:
    """Tensors that must share a shard: a layer's experts; everything else by layer (or global)."""
    if t.name.startswith("vision_tower.") or t.name.startswith("mm_projector."):
        return (3, t.layer if t.layer is not None else -1, "vision")
    if t.layer is None:  # embedding first, the output head after the last layer
        return (0, -1, "") if "embed_tokens" in t.name else (2, -1, "")
    return (1, t.layer, "experts" if t.expert is not None else "")


def plan_shards(tensors: Iterable[Tensor], num_shards: int | None = None) -> list[list[Tensor]]:
    """Split the tensors into shards of about equal bytes, keeping each unit (a layer's experts, a
    layer's other tensors, a global) whole, in model order. `None` picks the release's shard size."""
    units: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        units.setdefault(_unit_of(t), []).append(t)
    ordered = [units[k] for k in sorted(units)]
    total = sum(t.nbytes for u in ordered for t in u)
    if num_shards is None:
        num_shards = min(len(ordered), max(4, math.ceil(total / RELEASE_SHARD_BYTES)))
    if not 1 <= num_shards <= len(ordered):
        raise CheckpointError(f"--shards {num_shards}: must be between 1 and {len(ordered)} for this model "
                              "(each layer's experts, each layer's other tensors and each global stay whole)")
    shards: list[list[Tensor]] = [[]]
    left = total  # bytes not yet in a closed shard
    current = 0  # bytes in the open shard
    for i, unit in enumerate(ordered):
        more = sum(t.nbytes for t in unit)
        open_after = num_shards - len(shards)  # shards still to open after the current one
        if shards[-1] and open_after:
            target = left / (open_after + 1)
            # close the current shard if this unit fits better in the next one, or if every
            # remaining unit is needed to fill the remaining shards
            if len(ordered) - i == open_after or current + more - target > target - current:
                left -= current
                current = 0
                shards.append([])
        shards[-1].extend(unit)
        current += more
    return shards


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
