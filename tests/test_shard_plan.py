"""plan_shards: how tensors are grouped into shards (units whole, model order, balance) and shard names."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_helpers import L, VISION_PREFIXES
from kimik3_jax.checkpoint.generate import make_checkpoint
from kimik3_jax.checkpoint.layout import Tensor, _unit_of, inventory, plan_shards, shard_name
from kimik3_jax.errors import CheckpointError
from kimik3_jax.params import Init, Leaf
from kimik3_jax.presets import preset


def test_plan_shards(cfg):
    tensors = inventory(cfg)
    units = {}
    for t in tensors:
        units.setdefault(_unit_of(t), []).append(t.name)
    n_units = len(units)
    assert n_units == 20  # embed, 8 layers, 7 expert groups, globals, 3 vision units
    unit_order = [n for k in sorted(units) for n in units[k]]
    for n in range(1, n_units + 1):
        shards = plan_shards(tensors, n)
        assert len(shards) == n
        assert all(shards), n
        flat = [t.name for s in shards for t in s]
        assert flat == unit_order  # model order, every tensor exactly once
        where = {t.name: i for i, s in enumerate(shards) for t in s}
        for names in units.values():
            assert len({where[x] for x in names}) == 1, n  # units stay whole
        vis = [where[t.name] for t in tensors if t.name.startswith(VISION_PREFIXES)]
        txt = [where[t.name] for t in tensors if not t.name.startswith(VISION_PREFIXES)]
        assert max(txt) <= min(vis) and max(vis) == n - 1
    # balanced: with a handful of shards no shard is more than twice the mean
    for n in (2, 3, 4):
        sizes = [sum(t.nbytes for t in s) for s in plan_shards(tensors, n)]
        assert max(sizes) <= 2 * sum(sizes) / n, (n, sizes)
    assert len(plan_shards(tensors, None)) == 4


@pytest.mark.parametrize("num_layers", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("text_only", [False, True])
def test_plan_shards_other_depths(num_layers, text_only):
    tensors = inventory(preset("tiny", num_layers=num_layers), text_only)
    n_units = len({_unit_of(t) for t in tensors})
    for n in range(1, n_units + 1):
        shards = plan_shards(tensors, n)
        assert len(shards) == n and all(shards), (num_layers, n)
        assert [t.name for s in shards for t in s] == [t.name for t in sorted(tensors, key=_unit_of)]
    for bad in (0, -1, n_units + 1, 1000):
        with pytest.raises(CheckpointError, match=rf"--shards {bad}\b.*between 1 and {n_units}"):
            plan_shards(tensors, bad)


def _layer_units(sizes):
    """One single-tensor unit per layer, of the given byte sizes (synthetic, for plan_shards)."""
    out = []
    for i, size in enumerate(sizes):
        name = f"{L}{i}.x.weight"
        leaf = Leaf(name, (size,), np.dtype(np.uint8), (None,), Init("bits"))
        out.append(Tensor(name, leaf, f"x{i}", (), i, None))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.data())
def test_plan_shards_any_sizes(sizes, data):
    tensors = _layer_units(sizes)
    n = data.draw(st.integers(1, len(sizes)))
    shards = plan_shards(tensors, n)
    assert len(shards) == n and all(shards)
    assert [t.name for s in shards for t in s] == [t.name for t in tensors]


def test_plan_shards_small_units_at_the_end():
    # the last units are tiny: the plan must still open one shard per remaining unit
    shards = plan_shards(_layer_units([1, 1, 100]), 3)
    assert [[t.layer for t in s] for s in shards] == [[0], [1], [2]]
    shards = plan_shards(_layer_units([100, 1, 1, 1]), 4)
    assert [len(s) for s in shards] == [1, 1, 1, 1]


def test_make_checkpoint_too_many_shards(tmp_path, cfg_dict):
    with pytest.raises(CheckpointError, match="--shards 21"):
        make_checkpoint(cfg_dict, tmp_path / "ck", num_shards=21, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_shard_name():
    assert shard_name(3, 96) == "model-00003-of-000096.safetensors"
    assert shard_name(96, 96) == "model-00096-of-000096.safetensors"
