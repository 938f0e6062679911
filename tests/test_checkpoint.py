"""Release-layout checkpoints: generation, layout facts, loading, and refusal of tampered directories.

The tiny checkpoint is generated once per session; every tampering test works on its own copy.
"""
import json
import re
import shutil
from pathlib import Path

import jax
import ml_dtypes  # noqa: F401  (safetensors' numpy backend needs it to read/write BF16)
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from safetensors.numpy import load_file, save_file

from kimik3_jax.checkpoint import generate
from kimik3_jax.checkpoint.generate import make_checkpoint
from kimik3_jax.checkpoint.layout import (
    CONFIG_FILE, INDEX_FILE, Tensor, _unit_of, inventory, plan_shards, shard_name)
from kimik3_jax.checkpoint.load import Checkpoint, load_params, summarize
from kimik3_jax.checkpoint.safetensors_io import read_header
from kimik3_jax.errors import CheckpointError, MXFP4Error
from kimik3_jax.params import Init, Leaf, describe, init_params, init_params_traced, map_leaves, named_leaves
from kimik3_jax.presets import preset, preset_dict

SEED = 0
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{6})\.safetensors$")

# Tensors the tampering tests pick on (all exist in the tiny preset).
L = "language_model.model.layers."
MISSING = L + "1.block_sparse_moe.gate.weight"
Q_PROJ = L + "0.self_attn.q_proj.weight"  # KDA layer 0, [128, 192] BF16
FINAL_NORM = "language_model.model.norm.weight"  # BF16 [192]
A_LOG = L + "0.self_attn.A_log"
SCALE = L + "2.block_sparse_moe.experts.7.w2.weight_scale"


# ----------------------------------------------------------------------------------------- helpers

@pytest.fixture(scope="session")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def cfg_dict():
    return preset_dict("tiny")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, cfg_dict):
    """The seed-0 tiny checkpoint, default shard count. Read-only: copy it before tampering."""
    out = tmp_path_factory.mktemp("base") / "tiny"
    make_checkpoint(cfg_dict, out, seed=SEED, progress=False)
    return out


@pytest.fixture(scope="session")
def host_params(cfg):
    """init_params per seed, computed once each."""
    cache = {}

    def get(seed):
        if seed not in cache:
            cache[seed] = init_params(cfg, seed)
        return cache[seed]
    return get


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    return d


def _leaves(tree):
    return dict(named_leaves_any(tree))


def named_leaves_any(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p, simple=True, separator="."), np.asarray(x)) for p, x in flat]


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


def _no_reads(monkeypatch):
    """Make any tensor data read an obvious non-CheckpointError failure."""
    def boom(*a, **k):
        raise RuntimeError("tensor data was read before the layout was validated")
    monkeypatch.setattr(Checkpoint, "read", boom)
    monkeypatch.setattr(Checkpoint, "read_block", boom)


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


def test_summarize(tiny_ckpt, cfg):
    ck = Checkpoint(tiny_ckpt)
    rows = summarize(ck, cfg)
    assert sum(n for _, n, _ in rows) == len(ck.weight_map) == len(inventory(cfg))
    assert sum(b for _, _, b in rows) == ck.total_size
    assert "unexpected" not in {k for k, _, _ in rows}
    assert set(ck.headers) == set(ck.weight_map.values())


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


# --------------------------------------------------------------------------------- plan_shards

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


# --------------------------------------------------------------------------- tampered directories

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


def t_missing(d):
    _drop_tensor(d, MISSING)
    return [f"tensor {MISSING} is missing"]


def t_missing_from_index_only(d):
    f = _drop_tensor(d, MISSING, from_shard=False)
    return [f"tensor {MISSING} is missing", f"{f}: holds {MISSING}"]


def t_wrong_shape(d):
    f = _replace_tensor(d, Q_PROJ, lambda a: np.ascontiguousarray(a.T))
    return [f"{f}: tensor {Q_PROJ} is BF16 [192, 128], expected BF16 [128, 192]"]


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


def test_a_log_real_heads_may_change(ckpt_copy, cfg):
    _poke(ckpt_copy, A_LOG, 0, np.float32(2.0).tobytes())  # a real head: any value is allowed
    p = load_params(ckpt_copy, cfg)
    assert np.asarray(p.text.kda.a_log)[0, 0] == 2.0


# ------------------------------------------------------------------------------------ shardings

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


def test_stray_shard_is_a_problem(ckpt_copy, cfg):
    shutil.copy(next(ckpt_copy.glob("model-*.safetensors")), ckpt_copy / "model-00009-of-000009.safetensors")
    problems = Checkpoint(ckpt_copy).problems(cfg)
    assert any("model-00009-of-000009.safetensors: shard not named by" in p for p in problems), problems
