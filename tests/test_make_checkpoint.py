"""make_checkpoint: generate -> load round trip, release layout facts, realistic values, seeds,
traced init, and safety of the output directory (overwrite, failure midway).

The tiny checkpoint is generated once per session (conftest.py).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from checkpoint_helpers import L, SEED, SHARD_RE, VISION_PREFIXES, _dir_bytes, _index, _leaves
from kimik3_jax.checkpoint import generate
from kimik3_jax.checkpoint.generate import make_checkpoint
from kimik3_jax.checkpoint.layout import CONFIG_FILE, inventory, shard_name
from kimik3_jax.checkpoint.load import Checkpoint, load_params
from kimik3_jax.checkpoint.safetensors_io import read_header
from kimik3_jax.errors import CheckpointError
from kimik3_jax.params import describe, init_params_traced, named_leaves
from kimik3_jax.config import ModelConfig
from kimik3_jax.params import init_params
from kimik3_jax.presets import derive, preset, preset_dict


def _ulp_distance(a, b):
    """Distance in units in the last place of the arrays' own float dtype (bf16 or f32)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    width = a.dtype.itemsize * 8
    itype = {16: np.int16, 32: np.int32}[width]
    sign = np.int64(1) << (width - 1)

    def key(x):
        s = np.ascontiguousarray(x).view(itype).astype(np.int64)
        return np.where(s < 0, -(s & (sign - 1)), s)  # monotone in the float value, +0 == -0
    return np.abs(key(a) - key(b))


def _check_layout(d, cfg, num_shards):
    """Release layout facts of a generated directory (SPEC section 2)."""
    d = Path(d)
    index = _index(d)
    wm = index["weight_map"]
    files = sorted(p.name for p in d.glob("*.safetensors"))
    # shard names as released: 5-digit index, 6-digit total, 1..n, all present, all used
    assert files == [shard_name(i, num_shards) for i in range(1, num_shards + 1)]
    for f in files:
        m = SHARD_RE.match(f)
        assert m and int(m.group(2)) == num_shards
    assert sorted(set(wm.values())) == files
    # index <-> headers: every tensor exactly where the index says, nothing else
    headers = {f: read_header(d / f)[0] for f in files}
    held = {n: f for f, h in headers.items() for n in h}
    assert held == wm
    expected = {t.name: t for t in inventory(cfg)}
    assert set(wm) == set(expected)
    for name, t in expected.items():
        info = headers[wm[name]][name]
        assert tuple(info.shape) == t.shape
    # total_size is tensor bytes, not file bytes
    tensor_bytes = sum(i.end - i.begin for h in headers.values() for i in h.values())
    assert index["metadata"]["total_size"] == tensor_bytes == sum(t.nbytes for t in expected.values())
    assert tensor_bytes != sum((d / f).stat().st_size for f in files)
    # each MoE layer's expert tensors share one shard, data in lexicographic name order
    ne = cfg.moe.num_experts
    for layer in cfg.moe_layers:
        prefix = f"{L}{layer}.block_sparse_moe.experts."
        names = [n for n in wm if n.startswith(prefix)]
        assert len(names) == ne * 6
        shards = {wm[n] for n in names}
        assert len(shards) == 1, (layer, shards)
        h = headers[shards.pop()]
        by_offset = sorted(names, key=lambda n: h[n].begin)
        assert by_offset == sorted(names)
        # ... which is 0, 1, 10, 11, ..., 2, ... (not numeric order)
        ids = list(dict.fromkeys(int(n[len(prefix):].split(".")[0]) for n in by_offset))
        assert ids == sorted(range(ne), key=str) and ids != list(range(ne))
        # and contiguous: no other tensor's data sits between them
        begins = sorted(h[n].begin for n in names)
        ends = sorted(h[n].end for n in names)
        assert all(e == b for e, b in zip(ends[:-1], begins[1:]))
    # names: text under language_model., vision under vision_tower./mm_projector.
    vision = [n for n in wm if n.startswith(VISION_PREFIXES)]
    text = [n for n in wm if not n.startswith(VISION_PREFIXES)]
    assert vision and text
    assert all(n.startswith("language_model.") for n in text)
    assert "language_model.lm_head.weight" in text
    # vision tensors are in the last shard(s)
    shard_no = {f: i for i, f in enumerate(files)}
    vision_shards = sorted({shard_no[wm[n]] for n in vision})
    assert vision_shards == list(range(vision_shards[0], len(files)))  # a suffix of the shards
    assert max(shard_no[wm[n]] for n in text) <= vision_shards[0]
    # tokenizer and config beside the weights
    assert (d / "tiktoken.model").is_file() and (d / "tokenizer_config.json").is_file()
    assert (d / CONFIG_FILE).is_file()


# --------------------------------------------------------------------- generate -> load round trip

@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("num_shards", [2, 5])
def test_roundtrip_bit_identical(tmp_path, cfg, cfg_dict, host_params, seed, num_shards):
    out = make_checkpoint(cfg_dict, tmp_path / "ck", seed=seed, num_shards=num_shards, progress=False)
    assert out == tmp_path / "ck"
    _check_layout(out, cfg, num_shards)
    loaded = _leaves(load_params(out, cfg))
    want = _leaves(host_params(seed))
    assert loaded.keys() == want.keys() and len(loaded) > 50
    for path, w in want.items():
        got = loaded[path]
        assert got.dtype == w.dtype and got.shape == w.shape, path
        assert got.tobytes() == w.tobytes(), path
    # without cfg: reads config.json, same tree
    again = _leaves(load_params(out))
    assert all(again[p].tobytes() == want[p].tobytes() for p in want)


def test_default_layout_and_config(tiny_ckpt, cfg, cfg_dict):
    _check_layout(tiny_ckpt, cfg, 4)  # None picks at least 4 shards (tiny has 20 units)
    written = json.loads((tiny_ckpt / CONFIG_FILE).read_text())
    assert written == cfg_dict
    assert written["model_type"] == "kimi_k3"
    assert written["text_config"]["model_type"] == "kimi_linear"
    # quantization_config at the top level AND inside text_config
    for qc in (written["quantization_config"], written["text_config"]["quantization_config"]):
        assert qc["quant_method"] == "compressed-tensors"
        assert qc["format"] == "mxfp4-pack-quantized"
        w = qc["config_groups"]["group_0"]["weights"]
        assert (w["num_bits"], w["type"], w["group_size"], w["scale_dtype"]) == (4, "float", 32, "torch.uint8")
    assert written["quantization_config"] == written["text_config"]["quantization_config"]


def test_seeds_differ_and_same_seed_is_byte_identical(tmp_path, tiny_ckpt, cfg, cfg_dict, host_params):
    again = make_checkpoint(cfg_dict, tmp_path / "again", seed=SEED, progress=False)
    a, b = _dir_bytes(tiny_ckpt), _dir_bytes(again)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name
    p0, p1 = _leaves(host_params(0)), _leaves(host_params(7))
    for path in p0:
        assert p0[path].tobytes() != p1[path].tobytes(), path
    other = make_checkpoint(cfg_dict, tmp_path / "other", seed=1, progress=False)
    c = _dir_bytes(other)
    for name in a:
        if name.endswith(".safetensors"):
            assert a[name] != c[name], name
        else:  # config and tokenizer do not depend on the seed
            assert a[name] == c[name], name


def test_realistic_values(tiny_ckpt, cfg):
    params = load_params(tiny_ckpt, cfg)
    spec = describe(cfg)
    leaves = dict(named_leaves(spec))
    values = _leaves(params)
    assert leaves.keys() == values.keys()
    kinds = set()
    for path, leaf in leaves.items():
        v = values[path]
        kinds.add(leaf.init.kind)
        if leaf.mx == "scale":
            assert not np.any(v == 255), path
            assert len(np.unique(v)) >= 4, (path, np.unique(v))
            assert 100 <= v.min() and v.max() <= 127, path  # around 2^(-log2(2.6 sqrt(fan_in)))
        elif leaf.mx == "packed":
            assert len(np.unique(v)) == 256, path
        elif leaf.init.kind == "near_one":
            f = v.astype(np.float32)
            assert abs(f.mean() - 1) < 0.1 and f.std() > 0.01, path
        elif leaf.init.kind != "alog":
            assert np.all(np.isfinite(v.astype(np.float32))) and v.astype(np.float32).std() > 0, path
    assert {"bits", "scale_bytes", "near_one", "alog", "fan_in", "normal"} <= kinds
    bias = values["text.moe.router_bias"]
    assert bias.dtype == np.float32 and np.all(bias != 0) and bias.std() > 0.01
    # A_log: real per-head values, then zero padding up to head_dim
    a_log = values["text.kda.a_log"]
    h = cfg.kda.num_heads
    assert a_log.shape == (len(cfg.kda_layers), cfg.kda.head_dim) and h < cfg.kda.head_dim
    assert np.all(a_log[:, h:] == 0)
    assert np.all(a_log[:, :h] > 0) and np.all(a_log[:, :h] < np.log(16))


def test_text_only(tmp_path, tiny_ckpt, cfg, cfg_dict, host_params):
    # text_only load of a full checkpoint: vision skipped, text identical
    p = load_params(tiny_ckpt, cfg, text_only=True)
    assert p.vision is None
    want = _leaves(host_params(SEED).text)
    got = _leaves(p.text)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    # a text-only checkpoint has no vision tensors and no vision_config
    out = make_checkpoint(cfg_dict, tmp_path / "t", seed=SEED, text_only=True, progress=False)
    wm = _index(out)["weight_map"]
    assert not any(n.startswith(VISION_PREFIXES) for n in wm)
    assert "vision_config" not in json.loads((out / CONFIG_FILE).read_text())
    assert load_params(out).vision is None
    # ... and a full config refuses it, naming the vision tensors as missing
    with pytest.raises(CheckpointError, match=r"vision_tower\.patch_embed\.proj\.weight is missing"):
        Checkpoint(out).check(cfg)


# ---------------------------------------------------------------------------------- traced init

def test_init_params_traced_matches_host(cfg, host_params):
    traced = jax.jit(init_params_traced, static_argnums=(0, 1, 2))(cfg, SEED, False)
    got, want = _leaves(traced), _leaves(host_params(SEED))
    assert got.keys() == want.keys()
    for path, w in want.items():
        g = got[path]
        assert g.dtype == w.dtype and g.shape == w.shape, path
        if w.dtype.kind in "iub":
            assert np.array_equal(g, w), path
        else:
            d = _ulp_distance(g, w)
            assert d.max() <= 1, (path, int(d.max()))


def test_ulp_helper():
    one = np.array([1.0], np.float32)
    assert _ulp_distance(one, np.nextafter(one, np.float32(2))).item() == 1
    assert _ulp_distance(np.array([0.0], np.float32), np.array([-0.0], np.float32)).item() == 0
    tiny = np.array([np.finfo(np.float32).smallest_subnormal], np.float32)
    assert _ulp_distance(tiny, -tiny).item() == 2
    b = np.array([1.0, -1.0], ml_dtypes.bfloat16)
    assert _ulp_distance(b, np.array([1.0078125, -1.0], ml_dtypes.bfloat16)).tolist() == [1, 0]


# ----------------------------------------------------------------------- make_checkpoint safety

def test_refuses_non_empty_out(tmp_path, cfg_dict):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match=re.escape(str(out))):
        make_checkpoint(cfg_dict, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dir left
    # an existing plain file is refused too
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError):
        make_checkpoint(cfg_dict, f, progress=False)
    assert f.read_text() == "x"
    # overwrite=True replaces it with a complete checkpoint
    make_checkpoint(cfg_dict, out, seed=SEED, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists()
    Checkpoint(out).check(preset("tiny"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "file"]


def test_empty_existing_dir_is_fine(tmp_path, cfg_dict, tiny_ckpt):
    out = tmp_path / "ck"
    out.mkdir()
    make_checkpoint(cfg_dict, out, seed=SEED, progress=False)
    assert _dir_bytes(out) == _dir_bytes(tiny_ckpt)


class _Boom(Exception):
    pass


def _fail_after(monkeypatch, n):
    real = generate.draw_tensor
    calls = []

    def draw(*a, **k):
        calls.append(1)
        if len(calls) > n:
            raise _Boom(f"draw_tensor call {len(calls)}")
        return real(*a, **k)
    monkeypatch.setattr(generate, "draw_tensor", draw)
    return calls


@pytest.mark.parametrize("after", [0, 1, 300, 901])  # 902 tensors in tiny: the last one fails too
def test_failure_midway_leaves_nothing(tmp_path, cfg_dict, monkeypatch, after):
    calls = _fail_after(monkeypatch, after)
    out = tmp_path / "ck"
    with pytest.raises(_Boom):
        make_checkpoint(cfg_dict, out, seed=SEED, progress=False)
    assert len(calls) == after + 1
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temp dir (or partial shard) beside it


def test_failure_midway_keeps_old_checkpoint(ckpt_copy, cfg_dict, monkeypatch):
    before = _dir_bytes(ckpt_copy)
    _fail_after(monkeypatch, 500)
    with pytest.raises(_Boom):
        make_checkpoint(cfg_dict, ckpt_copy, seed=3, overwrite=True, progress=False)
    assert _dir_bytes(ckpt_copy) == before
    assert sorted(p.name for p in ckpt_copy.parent.iterdir()) == ["ckpt"]


def test_killed_run_leftovers_are_removed_by_the_next_run(tmp_path, cfg_dict):
    # A run killed with SIGKILL cannot clean up: its temp dir names a process that no longer exists.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "ck"
    abandoned = tmp_path / f".ck.partial-{dead.pid}"
    (abandoned / "sub").mkdir(parents=True)
    (abandoned / "model-00001-of-000004.safetensors.partial").write_bytes(b"half")
    alive = tmp_path / f".ck.partial-{os.getpid()}x"  # not a pid: left alone
    alive.mkdir()
    make_checkpoint(cfg_dict, out, seed=SEED, progress=False)
    assert not abandoned.exists()
    assert alive.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", alive.name])


@pytest.mark.parametrize("layers, text", [
    (1, {"attn_res_block_size": 1}),
    (5, {"num_experts": 8, "num_experts_per_token": 8, "first_k_dense_replace": 2, "moe_layer_freq": 2}),
    (13, {"attn_res_block_size": 5, "first_k_dense_replace": 0, "latent_moe_use_norm": False}),
])
def test_round_trip_at_other_sizes(tmp_path, layers, text):
    config = derive(preset_dict("tiny"), num_layers=layers, text=text)
    out = make_checkpoint(config, tmp_path / "ck", seed=3, text_only=True, progress=False)
    cfg = Checkpoint(out).config()
    assert cfg.vision is None and cfg == ModelConfig.from_dict({k: v for k, v in config.items() if k != "vision_config"})
    assert Checkpoint(out).problems(cfg) == []
    got, want = _leaves(load_params(out)), _leaves(init_params(cfg, 3, text_only=True))
    assert got.keys() == want.keys()
    for path in want:
        assert got[path].shape == want[path].shape, path
        assert np.asarray(got[path]).tobytes() == np.asarray(want[path]).tobytes(), path


def test_refuses_when_the_disk_is_too_small(tmp_path, cfg_dict, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(generate.shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "deep" / "ck"  # a parent that does not exist yet is probed through its ancestors
    with pytest.raises(CheckpointError, match=re.escape(str(out)) + r".*only 0\.00 GB is free"):
        make_checkpoint(cfg_dict, out, seed=SEED, progress=False)
    assert list(tmp_path.iterdir()) == []
