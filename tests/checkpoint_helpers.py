"""Shared constants and helpers for the release-layout checkpoint tests.

The fixtures (the session-scoped tiny checkpoint and friends) live in conftest.py; this module holds
plain functions and names the test files import.
"""
import json
import re
from pathlib import Path

import ml_dtypes  # noqa: F401  (safetensors' numpy backend needs it to read/write BF16)
import numpy as np
from safetensors.numpy import load_file, save_file

from kimik3_jax.checkpoint.layout import INDEX_FILE
from kimik3_jax.checkpoint.load import Checkpoint
from kimik3_jax.checkpoint.safetensors_io import read_header
from kimik3_jax.params import named_leaves

SEED = 0
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{6})\.safetensors$")

# Tensors the tampering tests pick on (all exist in the tiny preset).
L = "language_model.model.layers."
MISSING = L + "1.block_sparse_moe.gate.weight"
Q_PROJ = L + "0.self_attn.q_proj.weight"  # KDA layer 0, [256, 192] BF16
FINAL_NORM = "language_model.model.norm.weight"  # BF16 [192]
A_LOG = L + "0.self_attn.A_log"
SCALE = L + "2.block_sparse_moe.experts.7.w2.weight_scale"


# ----------------------------------------------------------------------------------------- helpers

def _leaves(tree):
    return {key: np.asarray(x) for key, x in named_leaves(tree)}


def _dir_bytes(d):
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


def _index(d):
    return json.loads((Path(d) / INDEX_FILE).read_text())


def _write_index(d, index):
    (Path(d) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _rewrite_shard(d, fname, mutate):
    """Rewrite one shard with safetensors' own writer after `mutate(dict_of_arrays)`."""
    path = Path(d) / fname
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path)


def _poke(d, name, byte_offset, raw: bytes):
    """Overwrite bytes inside tensor `name`'s data in its shard file (header untouched)."""
    f = _index(d)["weight_map"][name]
    info = read_header(Path(d) / f)[0][name]
    assert info.begin + byte_offset + len(raw) <= info.end
    with open(Path(d) / f, "r+b") as fh:
        fh.seek(info.begin + byte_offset)
        fh.write(raw)
    return f


def _no_reads(monkeypatch):
    """Make any tensor data read an obvious non-CheckpointError failure."""
    def boom(*a, **k):
        raise RuntimeError("tensor data was read before the layout was validated")
    monkeypatch.setattr(Checkpoint, "read", boom)
    monkeypatch.setattr(Checkpoint, "read_block", boom)


def _drop_tensor(d, name, from_shard=True, from_index=True):
    f = _index(d)["weight_map"][name]
    if from_shard:
        _rewrite_shard(d, f, lambda t: t.pop(name))
    if from_index:
        idx = _index(d)
        del idx["weight_map"][name]
        _write_index(d, idx)
    return f


def _replace_tensor(d, name, fn):
    f = _index(d)["weight_map"][name]

    def mutate(t):
        t[name] = fn(t[name])
    _rewrite_shard(d, f, mutate)
    return f


def _add_tensor(d, name, array, shard_no=0, in_index=True):
    f = sorted(set(_index(d)["weight_map"].values()))[shard_no]

    def mutate(t):
        t[name] = array
    _rewrite_shard(d, f, mutate)
    if in_index:
        idx = _index(d)
        idx["weight_map"][name] = f
        _write_index(d, idx)
    return f
