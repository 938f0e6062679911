"""The whole model against the independent float64 NumPy forward (tests/reference), through `kimik3 logits`.

float64: equal to about 1e-10 relative (the two differ only in summation order); float32: equal to fp32
rounding with the same argmax at every position. Checked on generated checkpoints of several depths,
AttnRes block sizes, expert counts and MoE switches.
"""

import dataclasses

import numpy as np
import pytest

from kimik3_jax.checkpoint.generate import make_checkpoint
from kimik3_jax.cli import main
from kimik3_jax.presets import derive, preset_dict
from reference import k3_numpy as ref

F64_RTOL = 1e-10  # relative to the largest |logit|
F32_RTOL = 2e-4  # fp32 rounding through 4-8 layers of a random model (observed ~3e-5)

VARIANTS = {
    # tiny itself: 8 layers (KDA 0-2, 4-6; MLA 3, 7), blocks of 3, 16 experts top-4, dense layer 0
    "tiny": {},
    # 5 layers, blocks of 2, two dense layers then MoE every other layer, 8 experts top-2, no latent norm
    "deep-dense": {"num_layers": 5, "text": {
        "attn_res_block_size": 2, "first_k_dense_replace": 2, "moe_layer_freq": 2, "num_experts": 8,
        "num_experts_per_token": 2, "latent_moe_use_norm": False, "routed_scaling_factor": 2.5}},
    # 4 layers in one AttnRes block, 32 experts top-8, no renormalisation, another gate bound and conv width
    "one-block": {"num_layers": 4, "text": {
        "attn_res_block_size": 4, "num_experts": 32, "num_experts_per_token": 8, "moe_renormalize": False,
        "rms_norm_eps": 1e-3}, "linear": {"gate_lower_bound": -3.0, "short_conv_kernel_size": 3}},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory, tiny_ckpt):
    if request.param == "tiny":
        return tiny_ckpt
    cfg_dict = derive(preset_dict("tiny"), **VARIANTS[request.param])
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    make_checkpoint(cfg_dict, out, seed=3, progress=False, text_only=True)
    return out


def _tokens(seed, n=13, vocab=1024):
    return np.random.default_rng(seed).integers(0, vocab, size=n)


def _cli_logits(ckpt, tokens, dtype, tmp_path):
    out = tmp_path / f"logits-{dtype}.npy"
    rc = main(["logits", "--checkpoint", str(ckpt), "--tokens", ",".join(map(str, tokens)), "--out", str(out),
               "--dtype", dtype])
    assert rc == 0
    return np.load(out)


def test_cli_logits_match_float64_reference(variant, tmp_path):
    tokens = _tokens(7)
    want = ref.forward(str(variant), tokens)
    got64 = _cli_logits(variant, tokens, "float64", tmp_path)
    assert got64.dtype == np.float64 and got64.shape == want.shape
    scale = np.abs(want).max()
    assert np.abs(got64 - want).max() <= F64_RTOL * scale
    got32 = _cli_logits(variant, tokens, "float32", tmp_path)
    assert got32.dtype == np.float32
    assert np.abs(got32 - want).max() <= F32_RTOL * scale
    np.testing.assert_array_equal(got32.argmax(-1), want.argmax(-1))


def test_reference_sees_a_wrong_epsilon(tiny_ckpt, tmp_path):
    """The float64 comparison is sharp enough to see an epsilon in the wrong place."""
    tokens = _tokens(8, n=6)
    got = _cli_logits(tiny_ckpt, tokens, "float64", tmp_path)
    model = ref.load_reference(str(tiny_ckpt))
    model.cfg = dataclasses.replace(model.cfg, mla_norm_eps=1e-5)  # a divergence some engines have (SPEC 6)
    wrong = ref.forward(model, tokens)
    assert np.abs(got - wrong).max() > 1e3 * F64_RTOL * np.abs(wrong).max()


def test_cli_logits_rejects_bad_tokens(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "x.npy"
    assert main(["logits", "--checkpoint", str(tiny_ckpt), "--tokens", "1,2,99999", "--out", str(out)]) == 2
    assert "99999 at position 2" in capsys.readouterr().err
    assert main(["logits", "--checkpoint", str(tiny_ckpt), "--tokens", "1,x", "--out", str(out)]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert not out.exists()


def test_cli_logits_tokens_file(tiny_ckpt, tmp_path):
    tokens = _tokens(9, n=5)
    f = tmp_path / "t.npy"
    np.save(f, tokens.astype(np.int64))
    out = tmp_path / "o.npy"
    assert main(["logits", "--checkpoint", str(tiny_ckpt), "--tokens-file", str(f), "--out", str(out),
                 "--dtype", "float32"]) == 0
    txt = tmp_path / "t.txt"
    txt.write_text(" ".join(map(str, tokens)) + "\n")
    out2 = tmp_path / "o2.npy"
    assert main(["logits", "--checkpoint", str(tiny_ckpt), "--tokens-file", str(txt), "--out", str(out2),
                 "--dtype", "float32"]) == 0
    np.testing.assert_array_equal(np.load(out), np.load(out2))
