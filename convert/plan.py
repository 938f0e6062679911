"""What a converted checkpoint holds: its units, the arrays of each unit, and where their bytes come from.

An output directory is split into *units*: `globals` (embedding, LM head, final norms), one
`layer_NNN` per text layer and `vision` (the whole tower and projector). A unit holds *pieces*, keyed
by parameter-tree paths (`text.kda.q_proj`, `text.moe.experts.w1_packed`): a layer unit holds each
stacked leaf's slice at that layer, the layer axis dropped (experts stay stacked `[E, ...]`);
`globals` and `vision` hold whole leaves. A unit's directory holds its pieces as a few Orbax
checkpoints `part_J` (consecutive pieces grouped to about 1 GiB, a bigger piece alone). Units are the
resume points; parts bound the memory of conversion (two parts: one written while the next is read).

Every piece is made from source tensors in one of three ways:
  copy     the release bytes, bit for bit (MXFP4 experts stay packed: uint8 nibbles + E8M0 bytes);
  alog     `A_log[:num_heads]` (the release pads it with zeros to head_dim; the loader pads back);
  dequant  `--dequantize bf16`: packed + scale decoded to bf16 `w1`/`w3`/`w2` (DenseExpertParams).
This module is the one place that decides those facts; conversion, loading, export and verification
all read `plan_units`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kimik3_jax.checkpoint.layout import Tensor, inventory
from kimik3_jax.config import ModelConfig
from kimik3_jax.params import Leaf, Params, dense_experts, describe, named_leaves

FORMAT = "kimik3-orbax"
FORMAT_VERSION = 1
MANIFEST_FILE = "kimik3_orbax.json"  # present only in a complete output: its presence marks one
REPORT_FILE = "convert_report.json"
SOURCE_INDEX_FILE = "source.safetensors.index.json"  # the source index, verbatim (used by export)
UNITS_DIR = "units"
PART_BYTES = 1 << 30  # default grouping of pieces into Orbax checkpoints (Unit.parts); recorded in the manifest
EXPERTS_PACKED, EXPERTS_BF16 = "mxfp4", "bf16"
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


@dataclass(frozen=True)
class Piece:
    """One array of a unit: the slice `stack` of output leaf `key` (or the whole leaf if None)."""

    key: str  # parameter-tree path of the output leaf
    leaf: Leaf  # the loaded array's description (full stacked shape)
    stack: int | None  # position on the leaf's layer axis; None: the whole leaf
    how: str  # copy | alog | dequant
    tensors: tuple[Tensor, ...]  # source tensors in row-major order over the piece's leading axes
    scales: tuple[Tensor, ...] = ()  # dequant: the weight_scale tensors beside `tensors`

    @property
    def lead(self) -> tuple[int, ...]:
        """Leading axes of the stored array (stack axes not dropped): () one tensor, (E,) experts, ..."""
        full = self.leaf.stack_shape
        return full if self.stack is None else full[1:]

    @property
    def shape(self) -> tuple[int, ...]:
        """The stored array's shape."""
        inner = (self.leaf.init.lo,) if self.how == "alog" else self.leaf.shape
        return self.lead + inner

    @property
    def dtype(self) -> np.dtype:
        return self.leaf.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def source_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors + self.scales)


@dataclass(frozen=True)
class Unit:
    name: str
    layer: int | None
    pieces: tuple[Piece, ...]
    part_bytes: int = PART_BYTES

    @cached_property
    def parts(self) -> tuple[tuple[str, tuple[Piece, ...]], ...]:
        """The unit's pieces in consecutive groups of at most `part_bytes` (a bigger piece alone), each
        saved as one Orbax checkpoint `part_J` inside the unit's directory: conversion reads part J+1
        while Orbax writes part J, so at most two parts are in memory."""
        groups: list[list[Piece]] = [[]]
        size = 0
        for p in self.pieces:
            if groups[-1] and size + p.nbytes > self.part_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.nbytes
        return tuple((f"part_{j}", tuple(g)) for j, g in enumerate(groups))

    def part_of(self, key: str) -> str:
        return next(name for name, pieces in self.parts if any(p.key == key for p in pieces))

    @cached_property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @cached_property
    def source_bytes(self) -> int:
        return sum(p.source_bytes for p in self.pieces)

    @cached_property
    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(t for p in self.pieces for t in p.tensors + p.scales)


def unit_name(layer: int | None, vision: bool = False) -> str:
    return "vision" if vision else "globals" if layer is None else f"layer_{layer:03d}"


def output_spec(cfg: ModelConfig, text_only: bool = False, experts: str = EXPERTS_PACKED) -> Params:
    """The tree of leaves that loading a converted checkpoint returns (the release tree, or with
    DenseExpertParams when the experts were dequantised)."""
    spec = describe(cfg, text_only)
    if experts == EXPERTS_BF16:
        moe = spec.text.moe.replace(experts=dense_experts(spec.text.moe.experts))
        spec = spec.replace(text=spec.text.replace(moe=moe))
    return spec


def plan_units(cfg: ModelConfig, text_only: bool = False, experts: str = EXPERTS_PACKED,
               part_bytes: int = PART_BYTES) -> tuple[Unit, ...]:
    """Every unit of the output, in conversion order: globals, the layers ascending, vision."""
    by_leaf: dict[str, list[Tensor]] = {}
    for t in inventory(cfg, text_only):
        by_leaf.setdefault(t.path, []).append(t)
    pieces: dict[str, list[Piece]] = {}
    for key, leaf in named_leaves(output_spec(cfg, text_only, experts)):
        vision = key.startswith("vision.")
        if key.startswith("text.moe.experts.") and experts == EXPERTS_BF16:
            w = key.rsplit(".", 1)[1]
            src, scl = by_leaf[f"text.moe.experts.{w}_packed"], by_leaf[f"text.moe.experts.{w}_scale"]
            how = "dequant"
        else:
            src, scl = by_leaf[key], []
            how = "alog" if leaf.init.kind == "alog" else "copy"
        if leaf.layers is None or vision:
            unit = unit_name(None, vision)
            pieces.setdefault(unit, []).append(Piece(key, leaf, None, how, tuple(src), tuple(scl)))
            continue
        for pos, layer in enumerate(leaf.layers):
            at = [i for i, t in enumerate(src) if t.index[0] == pos]
            pieces.setdefault(unit_name(layer), []).append(
                Piece(key, leaf, pos, how, tuple(src[i] for i in at), tuple(scl[i] for i in at) if scl else ()))
    order = [unit_name(None)] + [unit_name(i) for i in range(cfg.num_layers)] + ["vision"]
    return tuple(Unit(n, int(n[6:]) if n.startswith("layer_") else None, tuple(pieces[n]), part_bytes)
                 for n in order if n in pieces)


def piece_tree(pieces, value=lambda p: p) -> dict:
    """A nested dict {"text": {"kda": {"q_proj": value(piece)}}} of pieces, as Orbax stores a unit."""
    tree: dict = {}
    for p in pieces:
        *outer, last = p.key.split(".")
        node = tree
        for k in outer:
            node = node.setdefault(k, {})
        node[last] = value(p)
    return tree


def flat_items(tree: dict, prefix: str = "") -> dict:
    """The inverse of `piece_tree`: {"text.kda.q_proj": value}."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_items(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out
