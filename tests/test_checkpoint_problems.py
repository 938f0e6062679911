"""Refusal of tampered checkpoint directories: structural problems found before any tensor data is read,
problems() itself, and data-level checks on load (scale byte 255, non-zero A_log padding).

Every tampering test works on its own copy of the session's tiny checkpoint (the ckpt_copy fixture).
"""
import json
import re
import shutil

import ml_dtypes
import numpy as np
import pytest

from checkpoint_helpers import (
    A_LOG, FINAL_NORM, L, MISSING, Q_PROJ, SCALE, _add_tensor, _drop_tensor, _index, _no_reads, _poke,
    _replace_tensor, _write_index)
from kimik3_jax.checkpoint.layout import CONFIG_FILE, INDEX_FILE
from kimik3_jax.checkpoint.load import Checkpoint, load_params
from kimik3_jax.errors import CheckpointError, MXFP4Error
from kimik3_jax.presets import preset


def t_missing(d):
    _drop_tensor(d, MISSING)
    return [f"tensor {MISSING} is missing"]


def t_missing_from_index_only(d):
    f = _drop_tensor(d, MISSING, from_shard=False)
    return [f"tensor {MISSING} is missing", f"{f}: holds {MISSING}"]


def t_wrong_shape(d):
    f = _replace_tensor(d, Q_PROJ, lambda a: np.ascontiguousarray(a.T))
    return [f"{f}: tensor {Q_PROJ} is BF16 [192, 256], expected BF16 [256, 192]"]


def t_wrong_dtype(d):
    f = _replace_tensor(d, FINAL_NORM, lambda a: a.astype(np.float32))
    return [f"{f}: tensor {FINAL_NORM} is F32 [192], expected BF16 [192]"]


def t_wrong_dtype_u8_expert(d):  # an expert scale stored as BF16
    f = _replace_tensor(d, SCALE, lambda a: a.astype(ml_dtypes.bfloat16))
    return [f"tensor {SCALE} is BF16", "expected U8", f]


def t_shard_missing(d):
    f = _index(d)["weight_map"][MISSING]
    (d / f).unlink()
    return [f"{d / f}: shard missing"]


def t_index_names_absent_tensor(d):  # the index keeps a tensor its shard no longer holds
    f = _drop_tensor(d, MISSING, from_index=False)
    return [f"{d / f}: has no tensor {MISSING}"]


def t_index_names_unknown_tensor(d):  # the index names a tensor no shard has at all
    idx = _index(d)
    name = L + "0.self_attn.bogus.weight"
    idx["weight_map"][name] = sorted(set(idx["weight_map"].values()))[0]
    _write_index(d, idx)
    return [name]


def t_index_names_unknown_shard(d):
    idx = _index(d)
    idx["weight_map"][Q_PROJ] = "model-00009-of-000009.safetensors"
    _write_index(d, idx)
    return ["model-00009-of-000009.safetensors: shard missing", Q_PROJ]


def t_orphan_packed(d):
    e = preset("tiny").moe.num_experts  # one past the last expert
    name = f"{L}2.block_sparse_moe.experts.{e}.w1.weight_packed"
    scale = name.removesuffix("weight_packed") + "weight_scale"
    _add_tensor(d, name, np.zeros((96, 32), np.uint8), shard_no=1)
    return [f"{name} has no {scale} (orphan weight_packed)"]


def t_truncated(d):
    f = _index(d)["weight_map"][MISSING]
    path = d / f
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    return [str(path), "truncated"]


def t_truncated_to_header(d):
    f = _index(d)["weight_map"][Q_PROJ]
    with open(d / f, "r+b") as fh:
        fh.truncate(5)
    return [str(d / f)]


def t_extra_tensor(d):
    name = L + "0.self_attn.extra.weight"
    f = _add_tensor(d, name, np.ones((4, 4), np.float32))
    return [f"{d / f}: unexpected tensor {name}"]


def t_extra_tensor_not_indexed(d):
    name = L + "0.self_attn.extra.weight"
    f = _add_tensor(d, name, np.ones((4, 4), np.float32), in_index=False)
    return [f"{d / f}: holds {name}, which {INDEX_FILE} does not list"]


def t_tensor_in_wrong_shard(d):  # the index says shard A, the data is in shard B
    idx = _index(d)
    files = sorted(set(idx["weight_map"].values()))
    right = idx["weight_map"][Q_PROJ]
    wrong = next(f for f in files if f != right)
    idx["weight_map"][Q_PROJ] = wrong
    _write_index(d, idx)
    return [f"{d / wrong}: has no tensor {Q_PROJ}", f"{d / right}: holds {Q_PROJ}, which {INDEX_FILE} maps to {wrong}"]


def t_total_size(d):
    idx = _index(d)
    idx["metadata"]["total_size"] += 1
    _write_index(d, idx)
    return [f"{d / INDEX_FILE}: metadata.total_size = {idx['metadata']['total_size']}"]


def t_total_size_file_bytes(d):  # the classic mistake: file bytes instead of tensor bytes
    idx = _index(d)
    idx["metadata"]["total_size"] = sum((d / f).stat().st_size for f in set(idx["weight_map"].values()))
    _write_index(d, idx)
    return [INDEX_FILE, "total_size"]


def t_missing_index(d):
    (d / INDEX_FILE).unlink()
    return [f"{d / INDEX_FILE}: index file not found"]


def t_corrupt_index(d):
    (d / INDEX_FILE).write_text("{not json")
    return [f"{d / INDEX_FILE}: not a safetensors index"]


def t_index_without_weight_map(d):
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 1}}))
    return [f"{d / INDEX_FILE}: not a safetensors index"]


STRUCTURAL = [t_missing, t_missing_from_index_only, t_wrong_shape, t_wrong_dtype, t_wrong_dtype_u8_expert,
              t_shard_missing, t_index_names_absent_tensor, t_index_names_unknown_tensor,
              t_index_names_unknown_shard, t_orphan_packed, t_truncated, t_truncated_to_header,
              t_extra_tensor, t_extra_tensor_not_indexed, t_tensor_in_wrong_shard, t_total_size,
              t_total_size_file_bytes, t_missing_index, t_corrupt_index, t_index_without_weight_map]


@pytest.mark.parametrize("tamper", STRUCTURAL, ids=lambda f: f.__name__[2:])
def test_structural_problem_refused_before_reading(ckpt_copy, cfg, monkeypatch, tamper):
    expected = tamper(ckpt_copy)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ckpt_copy).check(cfg)
    msg = str(ei.value)
    for s in expected:
        assert s in msg, (s, msg)
    # load_params refuses it too, before reading any tensor data
    _no_reads(monkeypatch)
    with pytest.raises(CheckpointError) as ei:
        load_params(ckpt_copy, cfg)
    for s in expected:
        assert s in str(ei.value), (s, str(ei.value))
    with pytest.raises(CheckpointError):  # and without a cfg (config.json is intact)
        load_params(ckpt_copy)


def test_clean_checkpoint_has_no_problems(tiny_ckpt, cfg):
    ck = Checkpoint(tiny_ckpt)
    assert ck.problems(cfg) == []
    ck.check(cfg)
    ck.check(cfg, text_only=True)
    assert ck.config() == cfg


def test_problems_is_repeatable(ckpt_copy, tiny_ckpt, cfg):
    """problems() must not accumulate state: same answer twice, and a later check with the right
    config is not polluted by an earlier check with a wrong one."""
    _drop_tensor(ckpt_copy, FINAL_NORM, from_shard=False)
    ck = Checkpoint(ckpt_copy)
    first = list(ck.problems(cfg))  # a copy, in case problems() hands out shared state
    assert len(first) == 2
    assert ck.problems(cfg) == first
    assert ck.problems(cfg, text_only=True) == first
    ck = Checkpoint(tiny_ckpt)
    wrong = preset("tiny", num_layers=4)
    assert ck.problems(wrong)  # layers 4..7 are unexpected for a 4-layer config
    with pytest.raises(CheckpointError):
        ck.check(wrong)
    assert ck.problems(cfg) == []
    ck.check(cfg)


def test_many_problems_are_all_counted(ckpt_copy, cfg):
    idx = _index(ckpt_copy)
    gone = [n for n in idx["weight_map"] if ".experts." in n][:30]
    for n in gone:
        del idx["weight_map"][n]
    _write_index(ckpt_copy, idx)
    problems = Checkpoint(ckpt_copy).problems(cfg)
    assert len(problems) == 60  # each: missing from the index, and held by a shard the index does not list it for
    with pytest.raises(CheckpointError, match=r"(?s)60 problem\(s\).*\.\.\. and 40 more$"):
        Checkpoint(ckpt_copy).check(cfg)


def test_missing_config(ckpt_copy, cfg):
    (ckpt_copy / CONFIG_FILE).unlink()
    path = str(ckpt_copy / CONFIG_FILE)
    with pytest.raises(CheckpointError, match=re.escape(path)):
        Checkpoint(ckpt_copy).config()
    with pytest.raises(CheckpointError, match=re.escape(path)):
        load_params(ckpt_copy)
    Checkpoint(ckpt_copy).check(cfg)  # the tensors themselves are fine
    assert load_params(ckpt_copy, cfg) is not None


def test_missing_directory(tmp_path, cfg):
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "nope"))):
        load_params(tmp_path / "nope", cfg)


def test_scale_byte_255_named_on_load(ckpt_copy, cfg):
    cols = cfg.moe.expert_width // 32
    f = _poke(ckpt_copy, SCALE, 5 * cols + 1, bytes([255]))  # row 5, group 1
    Checkpoint(ckpt_copy).check(cfg)  # a data-level problem: headers are fine
    with pytest.raises(MXFP4Error) as ei:
        load_params(ckpt_copy, cfg)
    assert isinstance(ei.value, CheckpointError)
    msg = str(ei.value)
    assert SCALE in msg and "255" in msg and "(5, 1)" in msg, msg
    # text_only load still reads (and rejects) the experts
    with pytest.raises(MXFP4Error, match=re.escape(SCALE)):
        load_params(ckpt_copy, cfg, text_only=True)
    assert f


def test_scale_byte_254_is_accepted(ckpt_copy, cfg):
    _poke(ckpt_copy, SCALE, 0, bytes([254]))
    p = load_params(ckpt_copy, cfg)
    li = cfg.moe_layers.index(2)
    assert np.asarray(p.text.moe.experts.w2_scale)[li, 7, 0, 0] == 254


def test_a_log_padding_non_zero_named_on_load(ckpt_copy, cfg):
    h = cfg.kda.num_heads
    _poke(ckpt_copy, A_LOG, 4 * h, np.float32(0.5).tobytes())  # first padding entry
    Checkpoint(ckpt_copy).check(cfg)
    with pytest.raises(CheckpointError) as ei:
        load_params(ckpt_copy, cfg)
    msg = str(ei.value)
    assert A_LOG in msg and f"{h}..{cfg.kda.head_dim - 1}" in msg, msg


def test_a_log_last_padding_entry(ckpt_copy, cfg):
    _poke(ckpt_copy, A_LOG, 4 * (cfg.kda.head_dim - 1), np.float32(-1e-30).tobytes())
    with pytest.raises(CheckpointError, match=re.escape(A_LOG)):
        load_params(ckpt_copy, cfg)


def test_a_log_negative_zero_padding_is_refused(ckpt_copy, cfg):
    """Padding is checked bitwise (a converted checkpoint pads back with +0.0, so -0.0 would not survive)."""
    _poke(ckpt_copy, A_LOG, 4 * cfg.kda.num_heads, np.float32(-0.0).tobytes())
    with pytest.raises(CheckpointError, match="1 non-zero"):
        load_params(ckpt_copy, cfg)


def test_a_log_real_heads_may_change(ckpt_copy, cfg):
    _poke(ckpt_copy, A_LOG, 0, np.float32(2.0).tobytes())  # a real head: any value is allowed
    p = load_params(ckpt_copy, cfg)
    assert np.asarray(p.text.kda.a_log)[0, 0] == 2.0


def test_stray_shard_is_a_problem(ckpt_copy, cfg):
    shutil.copy(next(ckpt_copy.glob("model-*.safetensors")), ckpt_copy / "model-00009-of-000009.safetensors")
    problems = Checkpoint(ckpt_copy).problems(cfg)
    assert any("model-00009-of-000009.safetensors: shard not named by" in p for p in problems), problems
