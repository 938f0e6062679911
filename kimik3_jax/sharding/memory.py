"""`kimik3 plan`: bytes per device of parameters, KDA state and MLA cache under a mesh, from the same
rules table as the real shardings (no devices needed), whether it fits, and the largest batch x context.

Per device, a sharded array holds its size divided by the product of the mesh axes that split it. The
decode state grows as batch x (KDA state + conv tails) + batch x context x MLA bytes per token, each
divided by the ways its axes are split. `headroom` keeps a fraction of the device for activations and
compiler workspace (not modelled).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import K3Error
from kimik3_jax.model.state import STATE_AXES, state_shapes
from kimik3_jax.params import describe, named_leaves
from kimik3_jax.sharding.rules import MESH_AXES, partition_spec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'141GB', '139.5 GiB', '8e10' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise K3Error(f"--device-memory {text!r}: expected a size such as 141GB or 139.5GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _ways(spec, sizes) -> int:
    n = 1
    for entry in spec:
        for axis in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
            n *= sizes[axis]
    return n


@dataclass(frozen=True)
class MemoryPlan:
    sizes: dict
    params: int  # bytes per device (the most loaded device: shards are equal)
    experts: int  # of which routed experts
    state_per_seq: int  # KDA state + conv tails of one sequence, per device
    mla_per_token: int  # MLA cache of one token of one sequence, per device
    device_bytes: int
    headroom: float

    @property
    def batch_ways(self) -> int:
        return math.prod(self.sizes[a] for a in ("data",) if self.sizes.get(a, 1) > 1)

    def state(self, batch: int, context: int) -> int:
        """Decode-state bytes per device for `batch` sequences of `context` tokens."""
        rows = -(-batch // self.batch_ways)
        return rows * (self.state_per_seq + context * self.mla_per_token)

    @property
    def budget(self) -> int:
        return int(self.device_bytes * (1 - self.headroom))

    def largest_batch(self, context: int) -> int:
        free = self.budget - self.params
        per = self.state_per_seq + context * self.mla_per_token
        return max(0, free // per) * self.batch_ways if free > 0 else 0

    def largest_context(self, batch: int) -> int:
        free = self.budget - self.params - self.state(batch, 0)
        rows = -(-batch // self.batch_ways)
        return max(0, free // (rows * self.mla_per_token)) if free > 0 else 0


def plan_memory(cfg: ModelConfig, sizes: dict, *, device_bytes: int, headroom: float = 0.1,
                dtype=jnp.bfloat16, text_only: bool = True) -> MemoryPlan:
    """Bytes per device under a mesh of `sizes` {axis: size}; raises ShardingError (naming the tensor)
    when the mesh cannot split the model as the rules say."""
    sizes = {a: sizes.get(a, 1) for a in MESH_AXES}
    params = experts = 0
    for path, leaf in named_leaves(describe(cfg, text_only=text_only)):
        spec = partition_spec(leaf.full_axes, leaf.full_shape, sizes, path)
        b = math.prod(leaf.full_shape) * leaf.dtype.itemsize // _ways(spec, sizes)
        params += b
        experts += b if ".experts." in path else 0
    ways = max(sizes["data"], 1)
    one = state_shapes(cfg, ways, 1, dtype)  # one sequence per data shard, one cached token
    axes = jax.tree_util.tree_leaves(STATE_AXES, is_leaf=lambda x: isinstance(x, tuple))
    per_leaf = {}
    for (path, a), ax in zip(jax.tree_util.tree_flatten_with_path(one)[0], axes):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        spec = partition_spec(ax, a.shape, sizes, "decode state " + name)
        per_leaf[name] = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize // _ways(spec, sizes)
    state_per_seq = per_leaf["kda.s"] + per_leaf["kda.conv"]
    return MemoryPlan(sizes, params, experts, state_per_seq, per_leaf["mla.kv"], device_bytes, headroom)


def report(cfg: ModelConfig, mp: MemoryPlan, batch: int, context: int) -> str:
    gb = lambda n: f"{n / 1e9:,.2f} GB"  # noqa: E731
    mesh = ",".join(f"{a}={s}" for a, s in mp.sizes.items())
    devices = math.prod(mp.sizes.values())
    need = mp.params + mp.state(batch, context)
    lines = [
        f"mesh {mesh} ({devices} device{'s' if devices > 1 else ''}), device memory {gb(mp.device_bytes)}, "
        f"{mp.headroom:.0%} kept for activations and workspace: budget {gb(mp.budget)} per device",
        f"parameters per device: {gb(mp.params)} (routed experts {gb(mp.experts)}, the rest "
        f"{gb(mp.params - mp.experts)}); all devices together hold {gb(mp.params * devices)}",
        f"decode state per device: KDA {mp.state_per_seq / 2**20:,.1f} MiB per sequence (state + conv tails), "
        f"MLA {mp.mla_per_token:,} B per token of each sequence",
        f"batch {batch} x context {context:,}: state {gb(mp.state(batch, context))}, total {gb(need)} per device: "
        + ("fits" if need <= mp.budget else f"does NOT fit (over by {gb(need - mp.budget)})"),
    ]
    if mp.params > mp.budget:
        lines.append("the parameters alone do not fit: use more devices (expert=, tensor=) or larger ones")
    else:
        longest = min(mp.largest_context(batch), cfg.max_position_embeddings)
        lines.append(f"largest batch at context {context:,}: {mp.largest_batch(context):,}; "
                     f"largest context at batch {batch}: {longest:,} (model maximum {cfg.max_position_embeddings:,})")
        for t in (4096, 32768, 131072, cfg.max_position_embeddings):
            if t <= cfg.max_position_embeddings:
                lines.append(f"  context {t:>9,}: largest batch {mp.largest_batch(t):,}")
    return "\n".join(lines)
