"""Reading a checkpoint: summarize, load_params into shardings, and Checkpoint.read_block slices."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from checkpoint_helpers import SCALE, SEED, _leaves, _poke
from kimik3_jax.checkpoint.layout import inventory
from kimik3_jax.checkpoint.load import Checkpoint, load_params, summarize
from kimik3_jax.errors import CheckpointError, MXFP4Error
from kimik3_jax.params import describe, map_leaves, named_leaves


def test_summarize(tiny_ckpt, cfg):
    ck = Checkpoint(tiny_ckpt)
    rows = summarize(ck, cfg)
    assert sum(n for _, n, _ in rows) == len(ck.weight_map) == len(inventory(cfg))
    assert sum(b for _, _, b in rows) == ck.total_size
    assert "unexpected" not in {k for k, _, _ in rows}
    assert set(ck.headers) == set(ck.weight_map.values())


def test_load_default_device(tiny_ckpt, cfg, host_params):
    dev = jax.devices()[0]
    want = _leaves(host_params(SEED))
    for shardings in (None, SingleDeviceSharding(dev)):
        p = load_params(tiny_ckpt, cfg, shardings=shardings)
        for path, x in jax.tree_util.tree_flatten_with_path(p)[0]:
            assert x.sharding.device_set == {dev}
            assert np.asarray(x).tobytes() == want[jax.tree_util.keystr(path, simple=True, separator=".")].tobytes()


def test_load_named_sharding_one_device_mesh(tiny_ckpt, cfg, host_params):
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec(None))
    tree = map_leaves(lambda leaf: replicated, describe(cfg))
    p = load_params(tiny_ckpt, cfg, shardings=tree)
    want = _leaves(host_params(SEED))
    got = jax.tree_util.tree_flatten_with_path(p)[0]
    assert len(got) == len(want)
    for path, x in got:
        assert x.sharding == replicated
        assert np.asarray(x).tobytes() == want[jax.tree_util.keystr(path, simple=True, separator=".")].tobytes()
    # one NamedSharding for every leaf works as well
    p2 = load_params(tiny_ckpt, cfg, shardings=replicated)
    assert all(x.sharding == replicated for x in jax.tree_util.tree_leaves(p2))


def test_read_block_slices(tiny_ckpt, cfg, host_params):
    """Blocks of stacked leaves (what each device reads under a sharding) are the right slices."""
    spec = dict(named_leaves(describe(cfg)))
    want = _leaves(host_params(SEED))
    ck = Checkpoint(tiny_ckpt)
    try:
        for path in ("text.moe.experts.w1_packed", "text.moe.experts.w2_scale", "text.kda.a_log",
                     "text.kda.q_proj", "text.embed", "vision.blocks.wqkv"):
            leaf, full = spec[path], want[path]
            nd = len(leaf.full_shape)
            for sl in [(slice(None),) * nd,
                       tuple(slice(1, n) if i == 0 else slice(None) for i, n in enumerate(leaf.full_shape)),
                       tuple(slice(0, max(1, n // 2)) for n in leaf.full_shape),
                       tuple(slice(n // 2, n) for n in leaf.full_shape)]:
                assert ck.read_block(leaf, sl).tobytes() == full[sl].tobytes(), (path, sl)
    finally:
        ck.close()


def test_scale_byte_255_position_in_a_sliced_read(ckpt_copy, cfg):
    cols = cfg.moe.expert_width // 32
    _poke(ckpt_copy, SCALE, 5 * cols + 1, bytes([255]))  # row 5, group 1
    leaf = next(t.leaf for t in inventory(cfg) if t.name == SCALE)
    ckpt = Checkpoint(ckpt_copy)
    stack = tuple(slice(0, n) for n in leaf.stack_shape)
    with pytest.raises(MXFP4Error, match=r"\(5, 1\)"):
        ckpt.read_block(leaf, stack + (slice(4, 8), slice(None)))  # rows 4..7 hold the bad byte


def test_a_shardings_tree_of_another_structure_is_refused(tiny_ckpt, cfg):
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(CheckpointError, match="shardings tree does not match the parameter tree"):
        load_params(tiny_ckpt, cfg, shardings={"text": one})
