"""`--mesh`, the multi-host flags and `kimik3 plan`, through the command line. Sharded runs are child
processes with 8 host CPU devices (or 2 processes x 4 devices joined by jax.distributed)."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from kimik3_jax.cli import main
from kimik3_jax.params import describe, named_leaves
from kimik3_jax.presets import preset


def _env(devices: int) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}


def kimik3(*argv, devices: int = 8, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kimik3_jax.cli", *map(str, argv)], env=_env(devices),
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


TOKENS = "5,17,900,3,44,1000,2,8,61"


@pytest.fixture(scope="module")
def one_device_logits(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("logits") / "one.npy"
    kimik3("logits", "--checkpoint", tiny_ckpt, "--tokens", TOKENS, "--dtype", "float32", "--out", out)
    return np.load(out)


@pytest.mark.parametrize("mesh", ["expert=4,tensor=2", "data=2,expert=4"])
def test_logits_on_a_mesh_equal_one_device(tiny_ckpt, tmp_path, one_device_logits, mesh):
    out = tmp_path / "mesh.npy"
    kimik3("logits", "--checkpoint", tiny_ckpt, "--tokens", TOKENS, "--dtype", "float32", "--out", out,
           "--mesh", mesh)
    got = np.load(out)
    assert got.shape == one_device_logits.shape
    np.testing.assert_allclose(got, one_device_logits, rtol=0, atol=1e-4 * np.abs(one_device_logits).max())
    assert np.array_equal(got.argmax(-1), one_device_logits.argmax(-1))


def test_a_mesh_that_does_not_match_the_devices_is_refused(tiny_ckpt, tmp_path):
    out = tmp_path / "x.npy"
    proc = kimik3("logits", "--checkpoint", tiny_ckpt, "--tokens", TOKENS, "--out", out, "--mesh", "expert=3",
                  check=False)
    assert proc.returncode == 2
    assert "mesh data=1,expert=3,tensor=1 has 3 devices, but 8 are available" in proc.stderr
    assert not out.exists()


def test_a_mesh_the_model_cannot_split_names_the_tensor(tiny_ckpt, tmp_path):
    proc = kimik3("logits", "--checkpoint", tiny_ckpt, "--tokens", TOKENS, "--out", tmp_path / "x.npy",
                  "--mesh", "expert=8", devices=8, check=False)
    assert proc.returncode == 0, proc.stderr  # 16 experts over 8: fine
    proc = kimik3("logits", "--checkpoint", tiny_ckpt, "--tokens", TOKENS, "--out", tmp_path / "y.npy",
                  "--mesh", "expert=3", devices=3, check=False)
    assert proc.returncode == 2
    assert re.search(r"experts\.w1_packed.*dimension 1 \('experts', size 16\) does not divide by expert=3",
                     proc.stderr), proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def two_processes(*argv) -> None:
    """The same command as 2 processes x 4 CPU devices joined into one 8-device mesh (gloo collectives);
    `{pid}` in an argument becomes the process id."""
    port = _free_port()
    procs = []
    for pid in (0, 1):
        args = [str(a).replace("{pid}", str(pid)) for a in argv]
        args += ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(pid)]
        procs.append(subprocess.Popen([sys.executable, "-m", "kimik3_jax.cli", *args], env=_env(4),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]


def test_two_processes_give_the_same_logits_and_only_process_0_writes(tiny_ckpt, tmp_path, one_device_logits):
    """Multi-host on one machine: each process loads only its own shards; process 0 writes."""
    two_processes("logits", "--checkpoint", tiny_ckpt, "--tokens", TOKENS, "--dtype", "float32",
                  "--out", tmp_path / "p{pid}.npy", "--mesh", "expert=4,tensor=2")
    assert not (tmp_path / "p1.npy").exists()
    got = np.load(tmp_path / "p0.npy")
    np.testing.assert_allclose(got, one_device_logits, rtol=0, atol=1e-4 * np.abs(one_device_logits).max())


def test_multihost_flags_come_together(tiny_ckpt, tmp_path, capsys):
    code = main(["logits", "--checkpoint", str(tiny_ckpt), "--tokens", TOKENS, "--out", str(tmp_path / "x.npy"),
                 "--coordinator", "localhost:1234"])
    assert code == 2
    assert "missing --num-processes, --process-id" in capsys.readouterr().err


@pytest.mark.slow  # 46 s; meshes against one device are checked by default by the logits test
def test_generate_on_a_mesh_equals_one_device(tiny_ckpt, tmp_path):
    """Greedy float32 generation; 3 prompts over data=2 (a stand-in row fills the second half)."""
    common = ["generate", "--checkpoint", tiny_ckpt, "--prompt", "Hello, K3", "--prompt", "What is 15% of 240?",
              "--prompt", "x", "--max-new-tokens", 6, "--temperature", 0, "--dtype", "float32", "--quiet"]
    one = kimik3(*common, "--out", tmp_path / "one.jsonl")
    sharded = kimik3(*common, "--out", tmp_path / "mesh.jsonl", "--mesh", "data=2,expert=2,tensor=2")
    assert "3 of 3 prompts generated" in one.stderr and "3 of 3 prompts generated" in sharded.stderr
    rows = [[json.loads(line)["token_ids"] for line in (tmp_path / f).read_text().splitlines()]
            for f in ("one.jsonl", "mesh.jsonl")]
    assert len(rows[0]) == 3 and rows[0] == rows[1]


@pytest.mark.slow  # 55 s; two processes are checked by default by the logits test above
def test_two_processes_generate_with_the_batch_split_across_them(tiny_ckpt, tmp_path):
    """data=2 over 2 processes: each holds half of the batch's state; the tokens equal one device's."""
    common = ["generate", "--checkpoint", tiny_ckpt, "--prompt", "Hello", "--prompt", "What is", "--prompt", "x",
              "--max-new-tokens", 5, "--temperature", 0, "--dtype", "float32", "--quiet"]
    kimik3(*common, "--out", tmp_path / "one.jsonl")
    two_processes(*common, "--out", tmp_path / "g{pid}.jsonl", "--mesh", "data=2,expert=2,tensor=2")
    assert not (tmp_path / "g1.jsonl").exists()
    rows = [[json.loads(line)["token_ids"] for line in (tmp_path / f).read_text().splitlines()]
            for f in ("one.jsonl", "g0.jsonl")]
    assert len(rows[0]) == 3 and rows[0] == rows[1]


def test_convert_restores_into_the_mesh(tiny_ckpt, tmp_path):
    out = tmp_path / "orbax"
    proc = kimik3("convert", "--src", tiny_ckpt, "--dst", out, "--quiet", "--mesh", "expert=4,tensor=2")
    assert re.search(r"restored .* over mesh data=1,expert=4,tensor=2: \d+ arrays in their planned shardings",
                     proc.stdout), proc.stdout


def test_plan_k3_on_8_expert_devices(capsys):
    cfg = preset("k3")
    leaves = named_leaves(describe(cfg, text_only=True))
    nbytes = {path: math.prod(leaf.full_shape) * leaf.dtype.itemsize for path, leaf in leaves}
    experts = sum(b for p, b in nbytes.items() if ".experts." in p)
    rest = sum(nbytes.values()) - experts
    assert 1.44e12 < experts < 1.47e12  # the release's 1.46 TB of MXFP4 experts
    assert main(["plan", "--preset", "k3", "--mesh", "expert=8", "--device-memory", "400GB"]) == 0
    out = capsys.readouterr().out
    assert f"routed experts {experts / 8 / 1e9:,.2f} GB, the rest {rest / 1e9:,.2f} GB" in out  # rest replicated
    assert f"parameters per device: {(experts / 8 + rest) / 1e9:,.2f} GB" in out
    assert "MLA 27,648 B per token" in out
    assert "fits" in out and "largest batch at context 131,072" in out


def test_plan_says_when_it_does_not_fit(capsys):
    assert main(["plan", "--mesh", "expert=8"]) == 0  # 8 H200s (141 GB): 294 GB per device
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "the parameters alone do not fit" in out


@pytest.mark.parametrize("argv, match", [
    (["--mesh", "tensor=7"], "text.embed: dimension 0 ('vocab', size 163840) does not divide by tensor=7"),
    (["--device-memory", "lots"], "--device-memory 'lots'"),
    (["--batch", "0"], "--batch must be >= 1"),
])
def test_plan_errors(argv, match, capsys):
    assert main(["plan", *argv]) == 2
    assert match in capsys.readouterr().err
