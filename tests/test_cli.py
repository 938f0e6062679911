"""The `kimik3` command: make-checkpoint and inspect, exit codes and messages."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from kimik3_jax.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--shards", "3", "--quiet"]) == 0
    return out


def test_make_checkpoint_then_inspect_is_clean(tiny_dir, capsys):
    assert sorted(p.name for p in tiny_dir.iterdir()) == [
        "config.json", "model-00001-of-000003.safetensors", "model-00002-of-000003.safetensors",
        "model-00003-of-000003.safetensors", "model.safetensors.index.json", "tiktoken.model",
        "tokenizer_config.json"]
    capsys.readouterr()
    assert main(["inspect", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    assert "no problems found" in out
    assert "3 shards, 902 tensors" in out
    assert "routed experts, MXFP4 packed" in out and "336 tensors" in out


def test_refuses_to_overwrite_without_flag(tiny_dir, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(tiny_dir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(tiny_dir) in err and "--overwrite" in err
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before


def test_inspect_lists_every_problem_and_fails(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (bad / "model-00002-of-000003.safetensors").unlink()
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.model.layers.0.mlp.extra.weight"] = "model-00001-of-000003.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    (bad / "tiktoken.model").unlink()
    capsys.readouterr()
    assert main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "model-00002-of-000003.safetensors: shard missing" in out
    assert "language_model.model.layers.0.mlp.extra.weight" in out
    assert "tiktoken.model" in out


def test_inspect_of_a_missing_directory_is_an_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_layers_override_and_text_only(tmp_path, capsys):
    out = tmp_path / "two"
    assert main(["make-checkpoint", "--preset", "tiny", "--layers", "2", "--text-only", "--out", str(out),
                 "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "vision_config" not in config
    lin = config["text_config"]["linear_attn_config"]
    assert (lin["kda_layers"], lin["full_attn_layers"]) == ([1], [2])
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0


def test_console_script_is_installed(tmp_path):
    exe = shutil.which("kimik3", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert exe, "the kimik3 console script is not installed next to this Python"
    run = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    assert "make-checkpoint" in run.stdout and "inspect" in run.stdout
