"""`kimik3 convert` / `kimik3 export` on the tiny checkpoint: equal trees from both layouts, the report,
dry runs, refusals, --verify, export round trips, --text-only, --dequantize bf16 and --allow-extra."""
import hashlib
import json
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from checkpoint_helpers import L, _add_tensor, _dir_bytes, _index, _write_index
from safetensors.numpy import load_file

from kimik3_jax.checkpoint.layout import INDEX_FILE, inventory
from kimik3_jax.checkpoint.open import is_orbax_checkpoint, load_checkpoint
from kimik3_jax.cli import main
from kimik3_jax.errors import CheckpointError
from kimik3_jax.mxfp4 import dequantize_np
from kimik3_jax.params import DenseExpertParams
from kimik3_jax.tokenizer import K3Tokenizer

EXPERT_SCALE = L + "2.block_sparse_moe.experts.7.w2.weight_scale"


def leaves(tree):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return treedef, {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x) for p, x in flat}


def assert_same_tree(a, b):
    ta, la = leaves(a)
    tb, lb = leaves(b)
    assert ta == tb
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        assert np.array_equal(la[k].view(np.uint8), lb[k].view(np.uint8)), k


def tree_bytes(d):
    """{relative path: bytes} of every file under d (recursive)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def convert(*args):
    return main(["convert", "--quiet", *map(str, args)])


@pytest.fixture(scope="module")
def converted(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "orbax"
    assert convert("--src", tiny_ckpt, "--dst", out) == 0
    return out


@pytest.mark.parametrize("text_only", [True, False])
def test_orbax_tree_equals_release_tree(tiny_ckpt, converted, text_only):
    assert is_orbax_checkpoint(converted) and not is_orbax_checkpoint(tiny_ckpt)
    cfg_hf, hf = load_checkpoint(tiny_ckpt, text_only=text_only)
    cfg_ob, ob = load_checkpoint(converted, text_only=text_only)
    assert cfg_hf == cfg_ob
    assert_same_tree(hf, ob)
    assert (ob.vision is None) == text_only
    ex = hf.text.moe.experts  # both loaders give the experts' largest scale byte to the kernels' decode choice
    want = max(int(np.asarray(a).max()) for a in (ex.w1_scale, ex.w3_scale, ex.w2_scale))
    assert cfg_ob.runtime.expert_scale_max == want and 100 < want <= 255


def test_output_layout_and_tokenizer(tiny_ckpt, converted):
    names = sorted(p.name for p in converted.iterdir())
    assert names == sorted(["config.json", "convert_report.json", "kimik3_orbax.json", "source.safetensors.index.json",
                            "tiktoken.model", "tokenizer_config.json", "units"])
    units = sorted(p.name for p in (converted / "units").iterdir())
    assert units == ["globals"] + [f"layer_{i:03d}" for i in range(8)] + ["vision"]
    assert (converted / "config.json").read_bytes() == (tiny_ckpt / "config.json").read_bytes()
    assert K3Tokenizer.from_dir(converted).vocab_size == K3Tokenizer.from_dir(tiny_ckpt).vocab_size
    assert not list(converted.parent.glob(".*"))  # no work directory left behind


def test_report_has_a_checksum_of_every_source_tensor(tiny_ckpt, converted, cfg):
    report = json.loads((converted / "convert_report.json").read_text())
    sums = report["checksums"]["tensors"]
    want = {}
    for f in sorted(set(_index(tiny_ckpt)["weight_map"].values())):
        for name, arr in load_file(tiny_ckpt / f).items():
            want[name] = hashlib.sha256(arr.tobytes()).hexdigest()
    assert sums == want
    assert report["converted"]["tensors"] == len(inventory(cfg)) == 902
    assert report["converted"]["source_bytes"] == _index(tiny_ckpt)["metadata"]["total_size"]
    assert report["source"]["path"] == str(tiny_ckpt.resolve())
    assert report["elapsed_s"] > 0 and report["runs"] == 1
    a_log_bytes = 4 * (cfg.kda.head_dim - cfg.kda.num_heads) * len(cfg.kda_layers)
    assert report["converted"]["output_bytes"] == report["converted"]["source_bytes"] - a_log_bytes


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_ckpt, tmp_path, capsys):
    before = sorted(tmp_path.iterdir())
    assert convert("--src", tiny_ckpt, "--dst", tmp_path / "out", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "902 tensors" in out and "10 units" in out and "no problems found" in out
    assert sorted(tmp_path.iterdir()) == before


def test_dry_run_lists_every_problem(ckpt_copy, tmp_path, capsys):
    idx = _index(ckpt_copy)
    gone = [n for n in idx["weight_map"] if ".experts." in n][:30]
    for n in gone:
        del idx["weight_map"][n]
    (ckpt_copy / INDEX_FILE).write_text(json.dumps(idx))
    assert convert("--src", ckpt_copy, "--dst", tmp_path / "out", "--dry-run") == 1
    out = capsys.readouterr().out
    assert "60 problem(s)" in out and all(n in out for n in gone)
    assert not (tmp_path / "out").exists()


def test_second_run_refuses_without_overwrite(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert("--src", tiny_ckpt, "--dst", out) == 0
    before = tree_bytes(out)
    capsys.readouterr()
    assert convert("--src", tiny_ckpt, "--dst", out) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--overwrite" in err
    assert tree_bytes(out) == before
    assert convert("--src", tiny_ckpt, "--dst", out, "--overwrite") == 0
    assert is_orbax_checkpoint(out)


def test_verify_passes_then_catches_a_tampered_tensor(tiny_ckpt, converted, tmp_path, capsys, cfg):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    assert convert("--src", tiny_ckpt, "--dst", out, "--verify") == 0
    assert "every tensor equals its source" in capsys.readouterr().err
    unit = next(u for u in json.loads((out / "kimik3_orbax.json").read_text())["units"] if u["name"] == "layer_002")
    part = unit["arrays"]["text.moe.experts.w2_scale"]["part"]
    array = out / "units" / "layer_002" / part / "text.moe.experts.w2_scale"  # zarr: [experts, rows, groups]
    per_chunk = json.loads((array / ".zarray").read_text())["chunks"][0]
    chunk = array / f"{7 // per_chunk}.0.0"  # the chunk holding expert 7
    data = bytearray(chunk.read_bytes())
    data[(7 % per_chunk) * cfg.moe.latent_width * (cfg.moe.expert_width // 32) + 3] ^= 1
    chunk.write_bytes(bytes(data))
    assert convert("--src", tiny_ckpt, "--dst", out, "--verify") == 2
    err = capsys.readouterr().err
    assert "text.moe.experts.w2_scale" in err and EXPERT_SCALE in err, err


def test_export_reproduces_the_release_bytes_and_converts_back(tiny_ckpt, converted, tmp_path, capsys):
    exported = tmp_path / "hf"
    assert main(["export", "--quiet", "--src", str(converted), "--dst", str(exported)]) == 0
    assert _dir_bytes(exported) == _dir_bytes(tiny_ckpt)
    again = tmp_path / "again"
    assert convert("--src", exported, "--dst", again) == 0
    assert_same_tree(load_checkpoint(converted, text_only=False)[1], load_checkpoint(again, text_only=False)[1])
    sums = [json.loads((d / "convert_report.json").read_text())["checksums"] for d in (converted, again)]
    assert sums[0] == sums[1]
    capsys.readouterr()
    assert main(["export", "--src", str(converted), "--dst", str(exported)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_text_only(tiny_ckpt, tmp_path, cfg):
    out = tmp_path / "text"
    assert convert("--src", tiny_ckpt, "--dst", out, "--text-only") == 0
    assert not (out / "units" / "vision").exists()
    assert_same_tree(load_checkpoint(tiny_ckpt)[1], load_checkpoint(out)[1])
    with pytest.raises(CheckpointError, match="--text-only"):
        load_checkpoint(out, text_only=False)
    exported = tmp_path / "hf"
    assert main(["export", "--quiet", "--src", str(out), "--dst", str(exported)]) == 0
    assert "vision_config" not in json.loads((exported / "config.json").read_text())
    names = set(_index(exported)["weight_map"])
    assert names == {t.name for t in inventory(cfg, text_only=True)}
    again = tmp_path / "again"
    assert convert("--src", exported, "--dst", again) == 0
    assert_same_tree(load_checkpoint(out)[1], load_checkpoint(again)[1])


def test_dequantize_bf16(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "dense"
    assert convert("--src", tiny_ckpt, "--dst", out, "--dequantize", "bf16", "--verify") == 0
    _, packed = load_checkpoint(tiny_ckpt, text_only=False)
    _, dense = load_checkpoint(out, text_only=False)
    assert isinstance(dense.text.moe.experts, DenseExpertParams)
    assert load_checkpoint(out)[0].runtime.expert_scale_max is None  # no scale bytes: the kernels keep asm1
    ex, dx = packed.text.moe.experts, dense.text.moe.experts
    for w in ("w1", "w3", "w2"):
        want = dequantize_np(np.asarray(getattr(ex, f"{w}_packed")), np.asarray(getattr(ex, f"{w}_scale")),
                             ml_dtypes.bfloat16)
        got = np.asarray(getattr(dx, w))
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint16), want.view(np.uint16)), w
    assert_same_tree(packed.replace(text=packed.text.replace(moe=packed.text.moe.replace(experts=None))),
                     dense.replace(text=dense.text.replace(moe=dense.text.moe.replace(experts=None))))
    capsys.readouterr()
    assert main(["export", "--src", str(out), "--dst", str(tmp_path / "hf")]) == 2
    assert "--dequantize" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_allow_extra_skips_unknown_tensors(ckpt_copy, tmp_path, capsys):
    name = L + "0.self_attn.extra.weight"
    _add_tensor(ckpt_copy, name, np.ones((4, 4), np.float32))
    idx = _index(ckpt_copy)
    idx["metadata"]["total_size"] += 64  # a well-formed index counts the extra tensor's bytes
    _write_index(ckpt_copy, idx)
    assert convert("--src", ckpt_copy, "--dst", tmp_path / "a") == 2
    assert f"unexpected tensor {name}" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert convert("--src", ckpt_copy, "--dst", tmp_path / "b", "--allow-extra") == 0
    report = json.loads((tmp_path / "b" / "convert_report.json").read_text())
    assert report["converted"]["skipped_extra"] == [name] and name not in report["checksums"]["tensors"]


def test_python_dash_m_convert(tiny_ckpt, tmp_path):
    run = subprocess.run([sys.executable, "-m", "convert", "--src", str(tiny_ckpt), "--dst", str(tmp_path / "o"),
                          "--dry-run"], capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0 and "no problems found" in run.stdout, run.stderr
    run = subprocess.run([sys.executable, "-m", "convert", "--src", str(tmp_path / "nope"), "--dst",
                          str(tmp_path / "o")], capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 2 and str(tmp_path / "nope") in run.stderr


def test_logits_from_the_orbax_directory_equal_the_release_directory(tiny_ckpt, converted, tmp_path):
    tokens = "5,17,300,2,911,64,64,1000"
    for name, d in (("hf", tiny_ckpt), ("orbax", converted)):
        assert main(["logits", "--checkpoint", str(d), "--tokens", tokens, "--out", str(tmp_path / f"{name}.npy")]) == 0
    hf, ob = np.load(tmp_path / "hf.npy"), np.load(tmp_path / "orbax.npy")
    assert hf.shape == (8, 1024) and np.all(np.isfinite(hf))
    assert hf.dtype == ob.dtype and hf.tobytes() == ob.tobytes()


@pytest.mark.slow  # many parts per unit are also converted by default in test_convert_resume
def test_many_small_parts(tiny_ckpt, converted, tmp_path):
    """Units split into many Orbax checkpoints (as a real MoE layer is, 1 GiB each) load, verify and export
    the same; the part size is recorded in the manifest, so the loader follows whatever was written."""
    out = tmp_path / "parts"
    assert convert("--src", tiny_ckpt, "--dst", out, "--part-bytes", "65536", "--verify") == 0
    manifest = json.loads((out / "kimik3_orbax.json").read_text())
    assert manifest["part_bytes"] == 65536
    parts = {a["part"] for u in manifest["units"] for a in u["arrays"].values()}
    assert len(parts) > 5 and len(list((out / "units" / "layer_001").iterdir())) > 5
    assert_same_tree(load_checkpoint(converted, text_only=False)[1], load_checkpoint(out, text_only=False)[1])
    assert main(["export", "--quiet", "--src", str(out), "--dst", str(tmp_path / "hf")]) == 0
    assert tree_bytes(tmp_path / "hf") == tree_bytes(tiny_ckpt)
