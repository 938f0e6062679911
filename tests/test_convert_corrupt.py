"""Every corrupted source is refused by `kimik3 convert` with a message naming the tensor or file, exits
non-zero and leaves nothing that looks like a complete output (structural problems: nothing at all).

The tampering functions are those of test_checkpoint_problems (shared, not duplicated)."""
import json

import numpy as np
import pytest
from checkpoint_helpers import A_LOG, SCALE, L, _poke
from test_checkpoint_problems import (
    t_extra_tensor,
    t_extra_tensor_not_indexed,
    t_index_names_absent_tensor,
    t_index_names_unknown_shard,
    t_missing,
    t_missing_from_index_only,
    t_orphan_packed,
    t_shard_missing,
    t_tensor_in_wrong_shard,
    t_total_size,
    t_truncated,
    t_truncated_to_header,
    t_wrong_dtype,
    t_wrong_dtype_u8_expert,
    t_wrong_shape,
)

from kimik3_jax.cli import main


def t_config_disagrees_with_shapes(d):
    config = json.loads((d / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 192  # the shards hold 256-wide experts
    (d / "config.json").write_text(json.dumps(config))
    return [(f"{d / 'config.json'}: 693 tensors have another shape or dtype than it implies "
             f"(first {L}1.block_sparse_moe.shared_experts.gate_proj.weight)")]


STRUCTURAL = [t_missing, t_missing_from_index_only, t_wrong_shape, t_wrong_dtype, t_wrong_dtype_u8_expert,
              t_truncated, t_truncated_to_header, t_shard_missing, t_index_names_absent_tensor,
              t_index_names_unknown_shard, t_tensor_in_wrong_shard, t_extra_tensor_not_indexed, t_total_size,
              t_orphan_packed, t_extra_tensor, t_config_disagrees_with_shapes]


def refused(src, out, capsys, *extra):
    capsys.readouterr()
    rc = main(["convert", "--quiet", "--src", str(src), "--dst", str(out), *extra])
    err = capsys.readouterr().err
    assert rc != 0, err
    assert not out.exists()
    assert not list(out.parent.rglob("kimik3_orbax.json"))  # nothing anywhere looks complete
    return err


@pytest.mark.parametrize("tamper", STRUCTURAL, ids=lambda f: f.__name__[2:])
def test_structural_corruption_refused_before_writing(ckpt_copy, tmp_path, capsys, tamper):
    expected = tamper(ckpt_copy)
    before = sorted(tmp_path.iterdir())
    out = tmp_path / "out"
    err = refused(ckpt_copy, out, capsys)
    for s in expected:
        assert s in err, (s, err)
    assert sorted(tmp_path.iterdir()) == before  # not even a work directory
    capsys.readouterr()
    assert main(["convert", "--src", str(ckpt_copy), "--dst", str(out), "--dry-run"]) != 0
    listed = capsys.readouterr()
    assert all(s in listed.out + listed.err for s in expected)
    assert sorted(tmp_path.iterdir()) == before


def test_allow_extra_does_not_excuse_an_orphan_packed(ckpt_copy, tmp_path, capsys):
    expected = t_orphan_packed(ckpt_copy)
    err = refused(ckpt_copy, tmp_path / "out", capsys, "--allow-extra")
    assert expected[0] in err


def test_scale_byte_255_refused_while_streaming(ckpt_copy, tmp_path, capsys, cfg):
    cols = cfg.moe.expert_width // 32
    _poke(ckpt_copy, SCALE, 5 * cols + 1, bytes([255]))  # row 5, group 1
    err = refused(ckpt_copy, tmp_path / "out", capsys)
    assert SCALE in err and "255" in err and "(5, 1)" in err, err
    assert not list(tmp_path.glob(".out*"))  # the work directory is gone too: nothing to resume
    err = refused(ckpt_copy, tmp_path / "out2", capsys, "--dequantize", "bf16")
    assert SCALE in err and "255" in err


def test_a_log_padding_refused_before_writing(ckpt_copy, tmp_path, capsys, cfg):
    h = cfg.kda.num_heads
    f = _poke(ckpt_copy, A_LOG, 4 * (h + 2), np.float32(-0.0).tobytes())  # -0.0 could not round-trip either
    before = sorted(tmp_path.iterdir())
    err = refused(ckpt_copy, tmp_path / "out", capsys)
    assert A_LOG in err and f in err and f"first at {h + 2}" in err, err
    assert sorted(tmp_path.iterdir()) == before


def test_missing_source_and_config(tmp_path, ckpt_copy, capsys):
    err = refused(tmp_path / "nope", tmp_path / "out", capsys)
    assert str(tmp_path / "nope") in err
    (ckpt_copy / "config.json").unlink()
    err = refused(ckpt_copy, tmp_path / "out", capsys)
    assert str(ckpt_copy / "config.json") in err
