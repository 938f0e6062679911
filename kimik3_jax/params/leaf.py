"""`Leaf`: the one description of a parameter array, from which everything else is derived.

A leaf stacks release tensors of the same role: over layers (leading axis), and for routed experts
over experts (next axis). It records the release tensor name template, the per-tensor shape and
dtype exactly as released (PyTorch `[out, in]`, never transposed), logical axis names for sharding,
and an initialiser. The abstract tree, random init, checkpoint generation, loading, inventories and
(later) shardings all read these records; nothing else spells a shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import jax
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)


@dataclass(frozen=True)
class Init:
    """How a random tensor is drawn. Values aim to be realistic enough to exercise the math."""

    kind: str  # fan_in | near_one | normal | alog | bits | scale_bytes
    scale: float = 1.0  # std multiplier (fan_in, normal, near_one)
    lo: int = 0  # scale_bytes: inclusive byte range; alog: number of real (unpadded) heads
    hi: int = 0


FAN_IN = Init("fan_in")
NEAR_ONE = Init("near_one", 0.1)
BITS = Init("bits")


@dataclass(frozen=True)
class Leaf:
    name: str  # release tensor name; `{layer}` and `{expert}` are filled in per tensor
    shape: tuple[int, ...]  # one release tensor
    dtype: np.dtype
    axes: tuple[str | None, ...]  # logical axis name per tensor dimension
    init: Init
    layers: tuple[int, ...] | None = None  # 0-based layer ids stacked on the leading axis
    experts: int = 0  # routed experts stacked after the layer axis
    stack_axis: str = "layers"
    mx: str | None = None  # "packed" or "scale" for MXFP4 expert tensors

    def __post_init__(self):
        assert len(self.axes) == len(self.shape), (self.name, self.axes, self.shape)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return ((len(self.layers),) if self.layers is not None else ()) + ((self.experts,) if self.experts else ())

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.stack_shape + self.shape

    @property
    def full_axes(self) -> tuple[str | None, ...]:
        lead = ((self.stack_axis,) if self.layers is not None else ()) + (("experts",) if self.experts else ())
        return lead + self.axes

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def num_params(self) -> int:
        """Logical parameters: a packed byte holds two, scales count as none (the release's count)."""
        factor = {None: 1, "packed": 2, "scale": 0}[self.mx]
        return math.prod(self.full_shape) * factor

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.full_shape, self.dtype)

    def tensor_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return self.name.format(layer=layer, expert=expert)

    def tensors(self) -> Iterator[tuple[tuple[int, ...], str, int | None, int | None]]:
        """(index into the stack, release name, layer id, expert id) for every tensor of the leaf."""
        layers = list(enumerate(self.layers)) if self.layers is not None else [(None, None)]
        experts = range(self.experts) if self.experts else [None]
        for li, layer in layers:
            for e in experts:
                index = tuple(i for i in (li, e) if i is not None)
                yield index, self.tensor_name(layer, e), layer, e
