"""Sharding: the rules table, the golden partition specs, and sharded == one device on 8 CPU devices.

Multi-device runs happen in a child process (tests/sharding_worker.py) because XLA_FLAGS must be set
before JAX starts; regenerate the golden table with KIMIK3_UPDATE_GOLDEN=1 after an intended change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from kimik3_jax.model.state import STATE_AXES, state_shapes
from kimik3_jax.params import describe, named_leaves
from kimik3_jax.presets import preset
from kimik3_jax.sharding import PRESETS, ShardingError, ShardingPlan, parse_mesh, partition_spec, preset_sizes

HERE = Path(__file__).parent
GOLDEN = HERE / "data" / "partition_specs.txt"
EIGHT = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


def golden_table() -> str:
    """Every parameter and decode-state leaf of K3 (8 sequences, 4096 positions) under each preset on 8
    devices: `preset  path  spec`, one line each."""
    cfg = preset("k3")
    params = named_leaves(describe(cfg, text_only=False))
    shapes = state_shapes(cfg, 8, 4096)
    state = [(jax.tree_util.keystr(p, simple=True, separator="."), a.shape)
             for p, a in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    state_axes = jax.tree_util.tree_leaves(STATE_AXES, is_leaf=lambda x: isinstance(x, tuple))
    lines = []
    for name in PRESETS:
        sizes = preset_sizes(name, 8)
        for path, leaf in params:
            spec = partition_spec(leaf.full_axes, leaf.full_shape, sizes, path)
            lines.append(f"{name:<6} params.{path:<40} {tuple(spec)}")
        for (path, shape), axes in zip(state, state_axes):
            lines.append(f"{name:<6} state.{path:<41} {tuple(partition_spec(axes, shape, sizes, path))}")
    return "\n".join(lines) + "\n"


def test_golden_partition_specs():
    table = golden_table()
    if os.environ.get("KIMIK3_UPDATE_GOLDEN"):
        GOLDEN.write_text(table)
    assert table == GOLDEN.read_text(), "partition specs changed: review, then KIMIK3_UPDATE_GOLDEN=1"


def test_golden_table_says_what_the_rules_say():
    rows = {tuple(line.split()[:2]): " ".join(line.split()[2:]) for line in GOLDEN.read_text().splitlines()}
    assert rows["ep_tp", "params.text.moe.experts.w1_packed"] == "(None, 'expert', 'tensor', None)"
    assert rows["ep_tp", "params.text.moe.experts.w2_scale"] == "(None, 'expert', None, 'tensor')"
    assert rows["tp", "params.text.kda.q_proj"] == "(None, 'tensor', None)"
    assert rows["tp", "state.kda.s"] == "(None, None, 'tensor', None, None)"
    assert rows["dp_ep", "state.mla.kv"] == "(None, 'data', None, None)"
    assert rows["single", "params.text.lm_head"] == "(None, None)"
    assert rows["ep", "params.text.embed"] == "(None, None)"  # vocab is split by tensor only


def test_mesh_axis_used_twice_is_an_error():
    rules = {"a": ("tensor",), "b": ("tensor",)}
    with pytest.raises(ShardingError, match=r"w: mesh axis 'tensor' would split both 'a' and 'b'"):
        partition_spec(("a", "b"), (8, 8), {"tensor": 2}, "w", rules)
    assert partition_spec(("a", "b"), (8, 8), {"tensor": 1}, "w", rules) == jax.sharding.PartitionSpec(None, None)


def test_indivisible_dimension_names_the_array():
    with pytest.raises(ShardingError, match=r"text.kda.q_proj: dimension 1 \('kda_heads', size 12\) does not divide "
                                            r"by tensor=8"):
        partition_spec(("layers", "kda_heads", "embed"), (2, 12, 16), {"tensor": 8}, "text.kda.q_proj")
    with pytest.raises(ShardingError, match="logical axis 'heads' has no rule"):
        partition_spec(("heads",), (8,), {"tensor": 2}, "x")


def test_single_device_plan_replicates_everything():
    cfg = preset("tiny")
    plan = ShardingPlan.create({}, jax.devices()[:1])
    assert all(s.spec == jax.sharding.PartitionSpec(*[None] * len(s.spec)) for s in
               jax.tree_util.tree_leaves(plan.params(describe(cfg, text_only=True))))


@pytest.mark.parametrize("text, want", [
    ("expert=8", {"expert": 8}), ("data=2, expert=2,tensor=2", {"data": 2, "expert": 2, "tensor": 2}),
])
def test_parse_mesh(text, want):
    assert parse_mesh(text) == want


@pytest.mark.parametrize("text, match", [
    ("experts=8", "'experts=8' is not AXIS=SIZE"), ("tensor=0", "must be a positive integer"),
    ("tensor=2,tensor=4", "given twice"), ("", "give at least one"), ("data", "is not AXIS=SIZE"),
])
def test_parse_mesh_errors(text, match):
    with pytest.raises(ShardingError, match=match):
        parse_mesh(text)


def test_mesh_size_must_match_the_devices():
    with pytest.raises(ShardingError, match=r"mesh data=1,expert=3,tensor=1 has 3 devices, but 1 are available"):
        ShardingPlan.create({"expert": 3}, jax.devices()[:1])


def _worker(*args) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "sharding_worker.py"), *args], env=EIGHT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 2 min each on 2 cores; the mesh CLI tests check meshes against one device by default
@pytest.mark.parametrize("dtype, skew, tol", [("float32", "skew", 1e-4), ("float64", "even", 1e-12)])
def test_every_preset_equals_one_device(dtype, skew, tol):
    """Prefill of 4 unequal sequences and 3 decode steps, on 8 devices under each preset, against one
    device: logits and the whole decode state. `skew` routes every token to the same experts (all pairs
    on one device under expert parallelism): nothing is dropped."""
    results = _worker(dtype, skew)
    assert set(results) == set(PRESETS) - {"single"}
    for name, r in results.items():
        assert r["err"] <= tol, (name, r)
        assert r["state_err"] <= 1e3 * tol, (name, r)
        assert r["argmax_equal"], (name, r)
    assert results["ep_tp"]["expert_spec"] == "P(None, 'expert', 'tensor', None)"
    assert results["tp"]["kda_state_spec"] == "P(None, None, 'tensor')"
    assert results["dp_ep"]["kda_state_spec"] == "P(None, 'data')"

