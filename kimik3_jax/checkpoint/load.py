"""Read a release-layout checkpoint (the real release or a generated one) into the parameter tree.

`Checkpoint(dir)` reads only the index and the shard headers. `problems(cfg)` lists everything that
does not match the layout the config implies (missing or extra tensors, wrong dtype or shape, shards
missing, truncated or disagreeing with the index, orphan `weight_packed`), without reading data.
`load_params` refuses a checkpoint with problems before reading any data, then fills each parameter
array through `jax.make_array_from_callback`: every device reads only the layers, experts and slices
it owns, straight from the memory-mapped shards. Data-level checks (scale byte 255, A_log padding)
run on the bytes as they are read; an error leaves nothing half-loaded behind.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (safetensors' numpy backend needs it registered to read BF16)
import numpy as np
from safetensors import safe_open

from kimik3_jax import mxfp4
from kimik3_jax.checkpoint.layout import CONFIG_FILE, INDEX_FILE, inventory
from kimik3_jax.checkpoint.safetensors_io import NUMPY_TO_SAFETENSORS, TensorInfo, read_header
from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import CheckpointError
from kimik3_jax.params import Leaf, Params, describe, leaf_shardings

MAX_LISTED = 20  # problems listed in an error message; the count says how many more


class Checkpoint:
    """A release-layout directory: `config.json`, `model.safetensors.index.json` and its shards."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: checkpoint directory not found")
        path = self.dir / INDEX_FILE
        try:
            index = json.loads(path.read_text())
            self.weight_map: dict[str, str] = dict(index["weight_map"])
            self.total_size = index.get("metadata", {}).get("total_size")
        except FileNotFoundError:
            raise CheckpointError(f"{path}: index file not found") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: not a safetensors index ({type(e).__name__}: {e})") from None
        self._handles: dict[str, Any] = {}

    def config(self) -> ModelConfig:
        path = self.dir / CONFIG_FILE
        if not path.is_file():  # a checkpoint problem (a malformed config.json stays a ConfigError)
            raise CheckpointError(f"{path}: config file not found in the checkpoint directory")
        return ModelConfig.from_file(path)

    @cached_property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    @cached_property
    def _headers(self) -> tuple[dict[str, dict[str, TensorInfo]], list[str]]:
        headers, problems = {}, []
        for f in self.files:
            path = self.dir / f
            if not path.is_file():
                n = sum(1 for v in self.weight_map.values() if v == f)
                problems.append(f"{path}: shard missing (the index maps {n} tensors to it)")
                continue
            try:
                headers[f] = read_header(path)[0]
            except CheckpointError as e:
                problems.append(str(e))
        return headers, problems

    @property
    def headers(self) -> dict[str, dict[str, TensorInfo]]:
        return self._headers[0]

    def problems(self, cfg: ModelConfig, text_only: bool = False) -> list[str]:
        """Every mismatch between this directory and the layout `cfg` implies (headers only)."""
        headers, shard_problems = self._headers
        problems = list(shard_problems)  # a copy: the header problems are cached across calls
        expected = {t.name: t for t in inventory(cfg, text_only)}
        for name, t in expected.items():
            f = self.weight_map.get(name)
            if f is None:
                problems.append(f"tensor {name} is missing (not in {INDEX_FILE})")
                continue
            if f not in headers:
                continue  # the shard's own problem is already listed
            info = headers[f].get(name)
            if info is None:
                problems.append(f"{self.dir / f}: has no tensor {name}, which {INDEX_FILE} maps to it")
                continue
            want = NUMPY_TO_SAFETENSORS[t.leaf.dtype]
            if info.dtype != want or tuple(info.shape) != t.shape:
                problems.append(f"{self.dir / f}: tensor {name} is {info.dtype} {list(info.shape)}, "
                                f"expected {want} {list(t.shape)}")
        for name, f in self.weight_map.items():
            if name in expected:
                continue
            if text_only and name.startswith(("vision_tower.", "mm_projector.")):
                continue
            scale = name.removesuffix("weight_packed") + "weight_scale"
            if name.endswith(".weight_packed") and scale not in self.weight_map:
                problems.append(f"{self.dir / f}: {name} has no {scale} (orphan weight_packed)")
            else:
                problems.append(f"{self.dir / f}: unexpected tensor {name} (not part of this config's layout)")
        for stray in sorted(set(p.name for p in self.dir.glob("*.safetensors")) - set(self.files)):
            problems.append(f"{self.dir / stray}: shard not named by {INDEX_FILE}")
        for f, header in headers.items():
            for name in header:
                if self.weight_map.get(name) != f:
                    problems.append(f"{self.dir / f}: holds {name}, which {INDEX_FILE} "
                                    f"{'maps to ' + self.weight_map[name] if name in self.weight_map else 'does not list'}")
        if not problems:
            actual = sum(info.end - info.begin for h in headers.values() for info in h.values())
            if self.total_size != actual:
                problems.append(f"{self.dir / INDEX_FILE}: metadata.total_size = {self.total_size}, "
                                f"but the shards hold {actual} tensor bytes")
        return problems

    def check(self, cfg: ModelConfig, text_only: bool = False) -> None:
        problems = self.problems(cfg, text_only)
        if problems:
            more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
            raise CheckpointError(f"{self.dir}: {len(problems)} problem(s) with the checkpoint:\n  "
                                  + "\n  ".join(problems[:MAX_LISTED]) + more)

    def _handle(self, f: str):
        if f not in self._handles:
            self._handles[f] = safe_open(str(self.dir / f), framework="numpy")
        return self._handles[f]

    def read(self, name: str, slices: tuple[slice, ...] = ()) -> np.ndarray:
        """One tensor, or a slice of it, straight from its memory-mapped shard."""
        f = self.weight_map[name]
        try:
            part = self._handle(f).get_slice(name)
            return part[slices] if slices else part[:]
        except Exception as e:  # a shard that changed under us, or an I/O error
            raise CheckpointError(f"{self.dir / f}: cannot read {name} ({e})") from None

    def read_block(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of a stacked leaf, reading only the tensors and slices it covers."""
        stack = leaf.stack_shape
        outer = [range(*s.indices(n)) for s, n in zip(index, stack)]
        inner = tuple(index[len(stack):])
        wanted = set(itertools.product(*outer))
        out = np.empty(tuple(len(r) for r in outer) + _sliced_shape(leaf.shape, inner), leaf.dtype)
        for pos, name, _, _ in leaf.tensors():
            if pos in wanted:
                at = tuple(p - r.start for p, r in zip(pos, outer))
                out[at] = _validated(leaf, name, self.read(name, inner), inner)
        return out

    def close(self) -> None:
        self._handles.clear()


def _sliced_shape(shape: tuple[int, ...], inner: tuple[slice, ...]) -> tuple[int, ...]:
    inner = inner + (slice(None),) * (len(shape) - len(inner))
    return tuple(len(range(*s.indices(n))) for s, n in zip(inner, shape))


def a_log_padding_problem(leaf: Leaf, name: str, a_log: np.ndarray) -> str | None:
    """What is wrong with the zero padding of a whole A_log tensor (entries past the heads), if anything.
    Bitwise: -0.0 counts as non-zero, since a converted checkpoint pads back with +0.0."""
    bad = np.flatnonzero(np.ascontiguousarray(a_log[leaf.init.lo:]).view(np.uint32))
    if not len(bad):
        return None
    return (f"tensor {name}: entries {leaf.init.lo}..{leaf.shape[-1] - 1} must be zero padding, found "
            f"{len(bad)} non-zero (first at {leaf.init.lo + int(bad[0])})")


def _validated(leaf: Leaf, name: str, data: np.ndarray, inner: tuple[slice, ...]) -> np.ndarray:
    """Checks that need the bytes: MXFP4 scale bytes and the A_log zero padding."""
    if leaf.mx == "scale":
        mxfp4.check_scales(name, data, offset=[s.indices(n)[0] for s, n in zip(inner, leaf.shape)])
    if leaf.init.kind == "alog" and data.shape[-1] == leaf.shape[-1]:
        problem = a_log_padding_problem(leaf, name, data)
        if problem:
            raise CheckpointError(problem)
    return data


def load_params(directory: str | Path, cfg: ModelConfig | None = None, *, text_only: bool = False,
                shardings: Any = None) -> Params:
    """The parameter tree of a checkpoint directory. `shardings` is a tree of `jax.sharding.Sharding`
    matching the parameter tree (or one sharding for every leaf); by default everything goes to the
    first device. Validates the whole layout first; raises `CheckpointError` naming what is wrong."""
    ckpt = Checkpoint(directory)
    cfg = ckpt.config() if cfg is None else cfg
    ckpt.check(cfg, text_only)
    spec = describe(cfg, text_only)
    try:
        shardings = leaf_shardings(spec, shardings)
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    try:
        return jax.tree_util.tree_map(
            lambda leaf, sharding: jax.make_array_from_callback(
                leaf.full_shape, sharding, lambda index, leaf=leaf: ckpt.read_block(leaf, index)),
            spec, shardings, is_leaf=lambda x: isinstance(x, Leaf))
    finally:
        ckpt.close()


def summarize(ckpt: Checkpoint, cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(kind, tensor count, bytes) by tensor kind, from the headers, for `kimik3 inspect`."""
    by_leaf = {t.name: t.path for t in inventory(cfg)}
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for header in ckpt.headers.values():
        for name, info in header.items():
            kind = _kind(by_leaf[name]) if name in by_leaf else "unexpected"
            counts[kind] += 1
            sizes[kind] += info.end - info.begin
    return [(k, counts[k], sizes[k]) for k in sorted(counts, key=lambda k: -sizes[k])]


def _kind(path: str) -> str:
    if path.startswith("vision"):
        return "vision tower + projector"
    if ".experts." in path:
        return "routed experts, MXFP4 " + ("scales" if path.endswith("_scale") else "packed")
    part = path.split(".")[1]
    return {"embed": "embedding + LM head", "lm_head": "embedding + LM head", "kda": "KDA attention",
            "mla": "MLA attention", "dense": "dense FFN", "moe": "MoE router, latent and shared experts",
            }.get(part, "norms and AttnRes")
