"""Tests for the streaming safetensors writer and the header reader (fast)."""
import json
import os
import subprocess
import sys
import textwrap
import weakref

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from kimik3_jax.checkpoint.safetensors_io import (
    NUMPY_TO_SAFETENSORS, SAFETENSORS_DTYPES, ShardWriter, TensorInfo, read_header,
    safetensors_dtype)
from kimik3_jax.errors import CheckpointError

BF16 = ml_dtypes.bfloat16


def _arr(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _mixed():
    """Insertion order deliberately differs from the library's (dtype desc, name) order."""
    d = {}
    for i, e in enumerate(["7", "2", "100", "0", "10", "1"]):  # name order 0,1,10,100,2,7
        d[f"model.layers.3.mlp.experts.{e}.w1.weight"] = _arr(np.uint8, (8, 6), i)
        d[f"model.layers.3.mlp.experts.{e}.w1.scale"] = _arr(BF16, (8, 2), 10 + i)
    d["model.norm.weight"] = _arr(np.float32, (16,), 20)
    d["a.bias"] = _arr(BF16, (5,), 21)
    d["z.mask"] = _arr(np.bool_, (3, 3), 22)
    d["b.ids"] = _arr(np.int64, (4,), 23)
    d["c.i8"] = _arr(np.int8, (7,), 24)
    d["d.f16"] = _arr(np.float16, (2, 3), 25)
    d["e.f64"] = _arr(np.float64, (3,), 26)
    d["f.i32"] = _arr(np.int32, (2,), 27)
    d["scalar"] = np.array(3.5, np.float32)          # 0-d
    d["empty"] = np.zeros((0, 4), BF16)             # zero bytes
    return d


def _write(path, tensors, metadata=None, order=None):
    decl = [(k, v.dtype, v.shape) for k, v in tensors.items()]
    with ShardWriter(path, decl, metadata=metadata) as w:
        for name in (order or w.order):
            w.write(name, tensors[name])
    return w


def _header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return n, f.read(n)


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}])
def test_byte_identical_to_save_file(tmp_path, metadata):
    d = _mixed()
    save_file(d, tmp_path / "ref.safetensors", metadata=metadata)
    w = _write(tmp_path / "out.safetensors", d, metadata)
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "out.safetensors").read_bytes() == ref
    n, raw = _header(tmp_path / "ref.safetensors")
    assert n % 8 == 0 and raw.decode().endswith(("}", " "))
    assert list(json.loads(raw)) == ([] if metadata is None else ["__metadata__"]) + w.order
    # F32 (and I64/F64) before BF16 before U8; names in byte order inside one dtype.
    assert w.order.index("model.norm.weight") < w.order.index("a.bias")
    assert [k for k in w.order if k.endswith("w1.weight")] == [
        f"model.layers.3.mlp.experts.{e}.w1.weight" for e in ["0", "1", "10", "100", "2", "7"]]
    assert not os.path.exists(str(tmp_path / "out.safetensors") + ".partial")


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_empty_shard_byte_identical(tmp_path, metadata):
    save_file({}, tmp_path / "ref.safetensors", metadata=metadata)
    _write(tmp_path / "out.safetensors", {}, metadata)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert read_header(tmp_path / "out.safetensors") == ({}, metadata)


def test_every_dtype_and_odd_names_byte_identical(tmp_path):
    d = {f"t.{code.lower()}": _arr(dt, (3, 2), i)
         for i, (code, dt) in enumerate(SAFETENSORS_DTYPES.items())}
    d.update({'q"uote': _arr(np.uint8, (2,), 1), "back\\slash": _arr(np.uint8, (2,), 2),
              "new\nline\t\x01\x7f": _arr(np.uint8, (1,), 3), "ünï/日本": _arr(BF16, (2,), 4),
              "": _arr(np.float32, (1,), 5)})
    d["big.endian"] = _arr(np.float32, (4,), 6).astype(">f4")
    save_file(d, tmp_path / "ref.safetensors", metadata={"k": 'v"\n\\ü'})
    _write(tmp_path / "out.safetensors", d, metadata={"k": 'v"\n\\ü'})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_random_dicts_byte_identical(tmp_path):
    rng = np.random.default_rng(0)
    codes = ["BF16", "U8", "F32", "I64", "BOOL", "F16", "I8"]
    for trial in range(20):
        d = {}
        for j in range(int(rng.integers(1, 12))):
            name = "w" + "".join(rng.choice(list("ab.19_"), int(rng.integers(0, 6))))
            shape = tuple(int(s) for s in rng.integers(0, 4, int(rng.integers(0, 3))))
            d[name] = _arr(SAFETENSORS_DTYPES[codes[rng.integers(len(codes))]], shape, j)
        save_file(d, tmp_path / "ref.safetensors")
        _write(tmp_path / "out.safetensors", d)
        assert ((tmp_path / "out.safetensors").read_bytes()
                == (tmp_path / "ref.safetensors").read_bytes()), (trial, list(d))


def test_multi_key_metadata_sorted_and_equivalent(tmp_path):
    # The library writes __metadata__ from a Rust HashMap: with >= 2 keys its order is random
    # per call, so only structural identity is possible; we write the keys sorted.
    d, md = _mixed(), {"z": "1", "format": "pt", "a": "2"}
    save_file(d, tmp_path / "ref.safetensors", metadata=md)
    _write(tmp_path / "out.safetensors", d, md)
    (n0, h0), (n1, h1) = _header(tmp_path / "ref.safetensors"), _header(tmp_path / "out.safetensors")
    assert n0 == n1 and json.loads(h0) == json.loads(h1)
    assert list(json.loads(h1)["__metadata__"]) == ["a", "format", "z"]
    assert (tmp_path / "out.safetensors").read_bytes()[8 + n1:] == \
        (tmp_path / "ref.safetensors").read_bytes()[8 + n0:]


def test_safe_open_reads_back_and_read_header(tmp_path):
    d, p = _mixed(), tmp_path / "out.safetensors"
    w = _write(p, d, {"format": "pt"})
    with safe_open(p, framework="numpy") as f:
        assert set(f.keys()) == set(d) and f.metadata() == {"format": "pt"}
        for k, v in d.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.tobytes() == v.tobytes()
    infos, md = read_header(p)
    assert md == {"format": "pt"} and infos == w.infos and set(infos) == set(d)
    raw = p.read_bytes()
    assert max(i.end for i in infos.values()) == len(raw) == w.file_size
    for k, v in d.items():
        i = infos[k]
        assert i == TensorInfo(NUMPY_TO_SAFETENSORS[v.dtype], v.shape, i.begin, i.end)
        assert raw[i.begin:i.end] == v.tobytes()
    save_file({"x": np.zeros(2, np.float32)}, tmp_path / "nomd.safetensors")
    assert read_header(tmp_path / "nomd.safetensors")[1] is None


def test_dtype_table():
    assert SAFETENSORS_DTYPES["BF16"] == np.dtype(BF16) and SAFETENSORS_DTYPES["U8"] == np.uint8
    assert all(NUMPY_TO_SAFETENSORS[dt] == c for c, dt in SAFETENSORS_DTYPES.items())
    assert safetensors_dtype(BF16) == "BF16" and safetensors_dtype(">f4") == "F32"
    assert safetensors_dtype("U8") == "U8" and safetensors_dtype(bool) == "BOOL"
    with pytest.raises(CheckpointError, match="object"):
        safetensors_dtype(object)


def _bad_write(tmp_path, action, preexisting=False):
    d, p = _mixed(), tmp_path / "out.safetensors"
    if preexisting:
        p.write_bytes(b"old")
    decl = [(k, v.dtype, v.shape) for k, v in d.items()]
    with pytest.raises(CheckpointError) as ei:
        with ShardWriter(p, decl) as w:
            action(w, d)
    assert str(p) in str(ei.value)
    assert (p.read_bytes() == b"old") if preexisting else not p.exists()
    assert not os.path.exists(str(p) + ".partial")
    return str(ei.value), w


def test_out_of_order_raises(tmp_path):
    msg, w = _bad_write(tmp_path, lambda w, d: w.write(w.order[1], d[w.order[1]]))
    assert repr(w.order[1]) in msg and "out of order" in msg and repr(w.order[0]) in msg


def test_wrong_dtype_raises(tmp_path):
    name = "model.norm.weight"
    def act(w, d):
        for k in w.order:
            w.write(k, d[k].astype(BF16) if k == name else d[k])
    msg, _ = _bad_write(tmp_path, act, preexisting=True)
    assert repr(name) in msg and "dtype" in msg


def test_wrong_shape_raises(tmp_path):
    def act(w, d):
        w.write(w.order[0], d[w.order[0]][None])
    msg, w = _bad_write(tmp_path, act)
    assert repr(w.order[0]) in msg and "shape" in msg


def test_missing_tensor_raises(tmp_path):
    def act(w, d):
        for k in w.order[:-1]:
            w.write(k, d[k])
    msg, w = _bad_write(tmp_path, act, preexisting=True)
    assert repr(w.order[-1]) in msg and "never written" in msg


def test_undeclared_and_swallowed_error_raise(tmp_path):
    msg, _ = _bad_write(tmp_path, lambda w, d: w.write("nope", d["scalar"]))
    assert "'nope'" in msg and "not declared" in msg

    def swallow(w, d):  # a caught write error must still poison the shard
        with pytest.raises(CheckpointError):
            w.write(w.order[0], np.zeros(1, np.float32))
        for k in w.order:
            w.write(k, d[k])
    msg, _ = _bad_write(tmp_path, swallow)
    assert "earlier write() failed" in msg


def test_exception_in_body_removes_partial(tmp_path):
    d, p = _mixed(), tmp_path / "out.safetensors"
    with pytest.raises(RuntimeError):
        with ShardWriter(p, [(k, v.dtype, v.shape) for k, v in d.items()]) as w:
            w.write(w.order[0], d[w.order[0]])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_bad_declarations(tmp_path):
    p = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match="'a'.*object"):
        ShardWriter(p, [("a", object, (1,))])
    with pytest.raises(CheckpointError, match="duplicate"):
        ShardWriter(p, [("a", np.uint8, (1,)), ("a", np.uint8, (1,))])
    with pytest.raises(CheckpointError, match="shape"):
        ShardWriter(p, [("a", np.uint8, (-1,))])
    with pytest.raises(CheckpointError, match="metadata"):
        ShardWriter(p, [("a", np.uint8, (1,))], metadata={"n": 1})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["cut_data", "cut_header", "cut_length", "empty",
                                    "extra_bytes", "text_file", "missing", "bad_json"])
def test_read_header_detects_damage(tmp_path, damage):
    src, p = tmp_path / "good.safetensors", tmp_path / "damaged.safetensors"
    _write(src, _mixed(), {"format": "pt"})
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    data = {"cut_data": raw[:-7], "cut_header": raw[:8 + n // 2], "cut_length": raw[:5],
            "empty": b"", "extra_bytes": raw + b"\0" * 8,
            "text_file": b"this is a README, not a safetensors shard\n" * 4,
            "bad_json": raw[:9] + b"!" + raw[10:]}.get(damage)
    if data is not None:
        p.write_bytes(data)
    with pytest.raises(CheckpointError) as ei:
        read_header(p)
    assert str(p) in str(ei.value)


def test_read_header_does_not_read_data(tmp_path):
    # A 16 GiB sparse shard: reading its header must be instant and touch no data pages.
    p, nbytes = tmp_path / "huge.safetensors", 16 << 30
    hdr = json.dumps({"__metadata__": {"format": "pt"},
                      "w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}},
                     separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)
    with open(p, "wb") as f:
        f.write(len(hdr).to_bytes(8, "little") + hdr)
        f.truncate(8 + len(hdr) + nbytes)
    infos, md = read_header(p)
    assert infos["w"] == TensorInfo("U8", (nbytes,), 8 + len(hdr), 8 + len(hdr) + nbytes)


def test_writer_keeps_no_references(tmp_path):
    d = _mixed()
    refs = []
    with ShardWriter(tmp_path / "o.st", [(k, v.dtype, v.shape) for k, v in d.items()]) as w:
        for k in w.order:
            a = d.pop(k).copy()
            refs.append(weakref.ref(a))
            w.write(k, a)
            del a
    assert all(r() is None for r in refs)


def test_streaming_200mb_bounded_memory(tmp_path):
    script = textwrap.dedent(f"""
        import resource, numpy as np
        from kimik3_jax.checkpoint.safetensors_io import ShardWriter
        n, shape = 100, (1024, 2048)          # 100 x 2 MiB uint8 = 200 MiB
        decl = [(f"experts.{{i}}.w", np.uint8, shape) for i in range(n)]
        w = ShardWriter({str(tmp_path / 'big.safetensors')!r}, decl, fsync=False)
        np.full(shape, 1, np.uint8)           # warm up the allocator
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with w:
            for name in w.order:
                w.write(name, np.full(shape, int(name.split(".")[1]) % 251, np.uint8))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    grew_mib = int(out.stdout.strip())
    assert grew_mib < 24, f"peak RSS grew {grew_mib} MiB while streaming 200 MiB"
    p = tmp_path / "big.safetensors"
    infos, _ = read_header(p)
    assert len(infos) == 100 and os.path.getsize(p) == max(i.end for i in infos.values())
    with safe_open(p, framework="numpy") as f:
        assert int(f.get_slice("experts.57.w")[3:4, :5].max()) == 57
