"""A converted checkpoint restores into any mesh: 8 host devices (a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8), shardings unlike the single-device layout the
conversion saw, the layer axis sharded for some leaves, experts and rows for others. Every leaf must
equal the release-layout load with the same shardings and carry exactly the asked-for sharding."""
import os
import subprocess
import sys

import pytest

from kimik3_jax.cli import main


@pytest.fixture(scope="module")
def converted(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "orbax"
    assert main(["convert", "--quiet", "--src", str(tiny_ckpt), "--dst", str(out)]) == 0
    return out


@pytest.mark.parametrize("dequantized", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["packed", "bf16"])
def test_restore_into_an_8_device_mesh(tiny_ckpt, converted, tmp_path, dequantized):
    out = converted
    if dequantized:
        out = tmp_path / "dense"
        assert main(["convert", "--quiet", "--src", str(tiny_ckpt), "--dst", str(out), "--dequantize", "bf16"]) == 0
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, __file__, str(tiny_ckpt), str(out)], env=env, capture_output=True,
                         text=True, check=False, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "8 devices, all leaves equal" in run.stdout, run.stdout


def _child(release: str, converted: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from convert.manifest import open_converted
    from convert.plan import output_spec
    from kimik3_jax.checkpoint.open import load_checkpoint
    from kimik3_jax.mxfp4 import dequantize_np
    from kimik3_jax.params import DenseExpertParams, Leaf, named_leaves

    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "model"))
    cfg, manifest, _ = open_converted(converted)
    spec = output_spec(cfg, False, manifest["experts"])

    def rule(path: str, leaf: Leaf) -> NamedSharding:
        shape = leaf.full_shape
        if ".experts." in path:  # [layers, experts, ...]: experts over "model", layers over "stage" when even
            lead = "stage" if shape[0] % 2 == 0 else None
            return NamedSharding(mesh, P(lead, "model"))
        if path.startswith("text.kda.") and shape[0] % 2 == 0 and len(shape) == 3 and shape[1] % 4 == 0:
            return NamedSharding(mesh, P("stage", "model"))  # layer axis sharded, rows too
        if path in ("text.embed", "text.lm_head"):
            return NamedSharding(mesh, P(("stage", "model")))  # vocab over all 8 devices
        if leaf.layers is not None and len(shape) == 3 and shape[2] % 4 == 0:
            return NamedSharding(mesh, P(None, None, "model"))
        return NamedSharding(mesh, P())

    shardings = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(spec, is_leaf=lambda x: isinstance(x, Leaf)),
        [rule(path, leaf) for path, leaf in named_leaves(spec)])
    _, got = load_checkpoint(converted, text_only=False, shardings=shardings)
    _, single = load_checkpoint(converted, text_only=False)  # the default: one device
    dense = isinstance(got.text.moe.experts, DenseExpertParams)
    if dense:
        release_spec = output_spec(cfg, False)
        release_shardings = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(release_spec, is_leaf=lambda x: isinstance(x, Leaf)),
            [rule(path, leaf) for path, leaf in named_leaves(release_spec)])
    else:
        release_shardings = shardings
    _, want = load_checkpoint(release, text_only=False, shardings=release_shardings)
    want_leaves = {p: np.asarray(x) for p, x in _named(want)}
    if dense:
        for w in ("w1", "w3", "w2"):
            want_leaves[f"text.moe.experts.{w}"] = dequantize_np(
                want_leaves.pop(f"text.moe.experts.{w}_packed"), want_leaves.pop(f"text.moe.experts.{w}_scale"),
                got.text.moe.experts.w1.dtype)
    got_leaves = dict(_named(got))
    single_leaves = dict(_named(single))
    assert set(got_leaves) == set(want_leaves), (set(got_leaves) ^ set(want_leaves))
    sharded = 0
    for path, x in got_leaves.items():
        target = _lookup(shardings, path)
        assert x.sharding.is_equivalent_to(target, x.ndim), (path, x.sharding, target)
        sharded += len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
        a, b, c = np.asarray(x), want_leaves[path], np.asarray(single_leaves[path])
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape, path
        assert a.tobytes() == b.tobytes() == c.tobytes(), path
        assert len(single_leaves[path].sharding.device_set) == 1
    assert sharded >= 10, sharded
    print(f"{jax.device_count()} devices, all leaves equal ({len(got_leaves)} leaves, {sharded} sharded)")


def _named(tree):
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p, simple=True, separator="."), x) for p, x in flat]


def _lookup(tree, path):
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return {jax.tree_util.keystr(p, simple=True, separator="."): s for p, s in flat}[path]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _child(sys.argv[1], sys.argv[2])
