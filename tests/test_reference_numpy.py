"""Self-checks of the float64 NumPy reference (tests/reference/k3_numpy.py).

The reference is the ground truth for the JAX model, so its own pieces are checked here against
hand computations, SPEC worked examples and structural properties (causality, AttnRes banking).
"""
import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest

from reference import k3_numpy as ref

RNG_SEED = 1234


def rng():
    return np.random.default_rng(RNG_SEED)


# ------------------------------------------------------------------------------------ independence

def test_reference_does_not_import_the_package():
    src = Path(ref.__file__).read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            assert all(not a.name.startswith("kimik3_jax") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("kimik3_jax")


# ------------------------------------------------------------------------------------------ MXFP4

def _pack_row(first_bytes, n_in=32):
    row = np.zeros(n_in // 2, np.uint8)
    row[:len(first_bytes)] = first_bytes
    return row[None, :]


def test_mxfp4_worked_bytes():
    packed = _pack_row([0x10, 0x32, 0xFE])
    out = ref.mxfp4_dequantize(packed, np.array([[127]], np.uint8))
    assert out.dtype == np.float64 and out.shape == (1, 32)
    np.testing.assert_array_equal(out[0, :6], [0.0, 0.5, 1.0, 1.5, -4.0, -6.0])
    np.testing.assert_array_equal(out[0, 6:], 0.0)
    scaled = ref.mxfp4_dequantize(packed, np.array([[124]], np.uint8))
    np.testing.assert_array_equal(scaled[0, :6], np.array([0.0, 0.5, 1.0, 1.5, -4.0, -6.0]) * 2.0 ** -3)


def _e2m1_from_bits(n):
    """E2M1 decoded from its bit fields (sign, 2-bit exponent bias 1, 1-bit mantissa)."""
    sign = -1.0 if n & 8 else 1.0
    e, m = (n >> 1) & 3, n & 1
    mag = 0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + 0.5 * m)
    return sign * mag


def test_mxfp4_matches_bitwise_decode_with_groups_and_leading_axes():
    r = rng()
    packed = r.integers(0, 256, size=(2, 3, 32), dtype=np.uint8)      # [E, out, in/2], in = 64
    scale = r.integers(0, 255, size=(2, 3, 2), dtype=np.uint8)        # two groups per row, never 255
    scale[0, 0, 0] = 0                                                 # the tiniest factor, 2^-127
    out = ref.mxfp4_dequantize(packed, scale)
    assert out.shape == (2, 3, 64)
    for e in range(2):
        for o in range(3):
            for j in range(64):
                byte = int(packed[e, o, j // 2])
                nib = byte & 0xF if j % 2 == 0 else byte >> 4
                want = _e2m1_from_bits(nib) * math.ldexp(1.0, int(scale[e, o, j // 32]) - 127)
                assert out[e, o, j] == want


def test_mxfp4_rejects_scale_255_and_bad_shapes():
    packed = _pack_row([0x10])
    with pytest.raises(ValueError):
        ref.mxfp4_dequantize(packed, np.array([[255]], np.uint8))
    with pytest.raises(ValueError):
        ref.mxfp4_dequantize(packed, np.array([[127, 127]], np.uint8))
    with pytest.raises(ValueError):
        ref.mxfp4_dequantize(packed.astype(np.int8), np.array([[127]], np.uint8))


# -------------------------------------------------------------------------------------- elementwise

def test_situ_and_rms_norm_by_hand():
    g, u = 1.3, -7.0
    want = 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)
    assert ref.situ(np.array(g), np.array(u), 4.0, 25.0) == pytest.approx(want, rel=1e-15)
    x = np.array([1.0, -2.0, 3.0])
    w = np.array([0.5, 1.0, 2.0])
    scale = 1 / math.sqrt((1 + 4 + 9) / 3 + 1e-5)
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-5), x * scale * w, rtol=1e-15)
    np.testing.assert_allclose(ref.rms_norm(x, None, 1e-5), x * scale, rtol=1e-15)
    np.testing.assert_allclose(ref.l2_normalize(x), x / math.sqrt(14 + 1e-6), rtol=1e-15)
    big = np.array([-800.0, 800.0])
    np.testing.assert_array_equal(ref.sigmoid(big), [0.0, 1.0])


# -------------------------------------------------------------------------------------------- AttnRes

def test_attn_res_mix_of_identical_candidates_is_that_candidate():
    r = rng()
    v = r.normal(size=(5, 8))
    cands = np.stack([v, v, v])
    out = ref.attn_res_mix(cands, r.normal(size=8), r.normal(size=(1, 8)), 1e-5)
    np.testing.assert_allclose(out, v, rtol=1e-14, atol=0)


def test_attn_res_mix_by_hand():
    r = rng()
    n, D = 3, 6
    cands = r.normal(size=(n, D)) * np.array([[1.0], [5.0], [0.2]])
    norm_w, proj_w = r.normal(size=D), r.normal(size=(1, D))
    w = [norm_w[d] * proj_w[0, d] for d in range(D)]
    logits = []
    for j in range(n):
        rms = math.sqrt(sum(c * c for c in cands[j]) / D + 1e-5)
        logits.append(sum(cands[j, d] / rms * w[d] for d in range(D)))
    z = [math.exp(s) for s in logits]
    want = [sum(z[j] / sum(z) * cands[j, d] for j in range(n)) for d in range(D)]
    np.testing.assert_allclose(ref.attn_res_mix(cands, norm_w, proj_w, 1e-5), want, rtol=1e-13)


# ------------------------------------------------------------------------------------------------ KDA

def test_kda_gate_by_hand():
    z = np.array([[[0.3, -1.2]], [[2.0, 0.0]]])                        # [T=2, H=1, K=2]
    a_log = np.array([0.7])
    want = -5.0 / (1 + np.exp(-math.exp(0.7) * z))
    np.testing.assert_allclose(ref.kda_gate(z, a_log, -5.0), want, rtol=1e-15)


def test_causal_conv_by_hand_and_with_tail():
    r = rng()
    T, C, Kc = 7, 3, 4
    x, w = r.normal(size=(T, C)), r.normal(size=(C, 1, Kc))
    y, tail = ref.causal_conv(x, w)
    for t in range(T):
        for c in range(C):
            want = sum(w[c, 0, j] * x[t - (Kc - 1) + j, c] for j in range(Kc) if t - (Kc - 1) + j >= 0)
            assert y[t, c] == pytest.approx(want, rel=1e-14, abs=1e-15)
    np.testing.assert_array_equal(tail, x[-(Kc - 1):])
    y1, t1 = ref.causal_conv(x[:2], w)                                  # shorter than the kernel
    np.testing.assert_array_equal(t1, np.concatenate([np.zeros((1, C)), x[:2]]))
    y2, t2 = ref.causal_conv(x[2:], w, t1)
    np.testing.assert_allclose(np.concatenate([y1, y2]), y, rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(t2, tail)


def _kda_inputs(T, H, K, V, r):
    q = ref.l2_normalize(r.normal(size=(T, H, K))) * K ** -0.5
    k = ref.l2_normalize(r.normal(size=(T, H, K)))
    v = r.normal(size=(T, H, V))
    g = -5.0 * ref.sigmoid(r.normal(size=(T, H, K)))
    beta = ref.sigmoid(r.normal(size=(T, H)))
    return q, k, v, g, beta


def test_kda_recurrent_beta0_g0_keeps_state():
    r = rng()
    T, H, K, V = 5, 2, 4, 3
    q, k, v, _, _ = _kda_inputs(T, H, K, V, r)
    s0 = r.normal(size=(H, K, V))
    o, s = ref.kda_recurrent(q, k, v, np.zeros((T, H, K)), np.zeros((T, H)), s0)
    np.testing.assert_array_equal(s, s0)
    np.testing.assert_allclose(o, np.einsum("hkv,thk->thv", s0, q), rtol=1e-14)


def test_kda_one_step_by_hand():
    r = rng()
    H, K, V = 2, 3, 2
    q, k, v, g, beta = _kda_inputs(1, H, K, V, r)
    s0 = r.normal(size=(H, K, V))
    o, s = ref.kda_recurrent(q, k, v, g, beta, s0)
    for h in range(H):
        dec = [[math.exp(g[0, h, a]) * s0[h, a, b] for b in range(V)] for a in range(K)]
        pred = [sum(dec[a][b] * k[0, h, a] for a in range(K)) for b in range(V)]
        new = [[dec[a][b] + k[0, h, a] * beta[0, h] * (v[0, h, b] - pred[b]) for b in range(V)] for a in range(K)]
        out = [sum(new[a][b] * q[0, h, a] for a in range(K)) for b in range(V)]
        np.testing.assert_allclose(s[h], new, rtol=1e-14)
        np.testing.assert_allclose(o[0, h], out, rtol=1e-14)


def test_kda_recurrent_split_equals_whole():
    r = rng()
    q, k, v, g, beta = _kda_inputs(9, 2, 4, 3, r)
    o, s = ref.kda_recurrent(q, k, v, g, beta)
    o1, s1 = ref.kda_recurrent(q[:4], k[:4], v[:4], g[:4], beta[:4])
    o2, s2 = ref.kda_recurrent(q[4:], k[4:], v[4:], g[4:], beta[4:], s1)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o, rtol=1e-14)
    np.testing.assert_allclose(s2, s, rtol=1e-14)


# ------------------------------------------------------------------------------------------------ MLA

def test_mla_single_query_by_hand():
    r = rng()
    S, H, Dn, Dr, Dv = 4, 2, 3, 2, 5
    q_nope, q_pe = r.normal(size=(1, H, Dn)), r.normal(size=(1, H, Dr))
    k_nope, k_pe, v = r.normal(size=(S, H, Dn)), r.normal(size=(S, Dr)), r.normal(size=(S, H, Dv))
    scale = (Dn + Dr) ** -0.5
    out = ref.mla_attention(q_nope, q_pe, k_nope, k_pe, v, scale, causal=True, q_offset=S - 1)
    assert out.shape == (1, H, Dv)
    for h in range(H):
        s = [scale * (sum(q_nope[0, h, d] * k_nope[j, h, d] for d in range(Dn))
                      + sum(q_pe[0, h, d] * k_pe[j, d] for d in range(Dr))) for j in range(S)]
        z = [math.exp(x) for x in s]
        want = [sum(z[j] / sum(z) * v[j, h, c] for j in range(S)) for c in range(Dv)]
        np.testing.assert_allclose(out[0, h], want, rtol=1e-13)
    # at position 0 only key 0 is visible
    first = ref.mla_attention(q_nope, q_pe, k_nope, k_pe, v, scale, causal=True, q_offset=0)
    np.testing.assert_allclose(first[0], v[0], rtol=1e-15)


def test_mla_causal_rows_equal_prefix_attention():
    r = rng()
    T, H, Dn, Dr, Dv = 6, 2, 3, 2, 4
    q_nope, q_pe = r.normal(size=(T, H, Dn)), r.normal(size=(T, H, Dr))
    k_nope, k_pe, v = r.normal(size=(T, H, Dn)), r.normal(size=(T, Dr)), r.normal(size=(T, H, Dv))
    full = ref.mla_attention(q_nope, q_pe, k_nope, k_pe, v, 0.3)
    for t in range(T):
        row = ref.mla_attention(q_nope[t:t + 1], q_pe[t:t + 1], k_nope[:t + 1], k_pe[:t + 1], v[:t + 1], 0.3,
                                causal=False)
        np.testing.assert_allclose(full[t], row[0], rtol=1e-13)


# ------------------------------------------------------------------------------------------------ MoE

def test_router_ties_go_to_the_lower_index():
    E, D = 8, 4
    x = np.zeros((1, D))                        # every score sigmoid(0) = 0.5
    idx, w = ref.router(x, np.ones((E, D)), np.zeros(E), 3, True, 1.0)
    np.testing.assert_array_equal(idx, [[0, 1, 2]])
    np.testing.assert_allclose(w, [[1 / 3] * 3], rtol=1e-15)
    bias = np.zeros(E)
    bias[[6, 2, 5]] = [0.25, 0.25, 0.1]         # 2 and 6 tie at the top, then 5, then 0 before 1
    idx, w = ref.router(x, np.ones((E, D)), bias, 4, False, 2.5)
    np.testing.assert_array_equal(idx, [[2, 6, 5, 0]])
    np.testing.assert_allclose(w, [[1.25] * 4], rtol=1e-15)   # bias only chooses; scaling applied


def test_router_weights_use_scores_not_bias():
    r = rng()
    T, E, D = 5, 12, 6
    x, wr, bias = r.normal(size=(T, D)), r.normal(size=(E, D)), r.normal(size=E)
    idx, w = ref.router(x, wr, bias, 4, True, 1.7)
    s = 1 / (1 + np.exp(-(x @ wr.T)))
    for t in range(T):
        want = sorted(range(E), key=lambda e: (-(s[t, e] + bias[e]), e))[:4]
        np.testing.assert_array_equal(idx[t], want)
        np.testing.assert_allclose(w[t], s[t, want] / (s[t, want].sum() + 1e-20) * 1.7, rtol=1e-14)


# ---------------------------------------------------------------------------------- layers, forward

@pytest.fixture(scope="module")
def tiny_ref(tiny_ckpt):
    return ref.load_reference(tiny_ckpt)


def _tokens(T, vocab, seed=7):
    return np.random.default_rng(seed).integers(0, vocab, size=T)


def test_config_follows_config_json(tiny_ref, tiny_ckpt):
    tc = json.loads((Path(tiny_ckpt) / "config.json").read_text())["text_config"]
    cfg = tiny_ref.cfg
    assert sorted(cfg.mla_layers) == [i - 1 for i in tc["linear_attn_config"]["full_attn_layers"]] == [3, 7]
    assert cfg.rms_norm_eps == tc["rms_norm_eps"] and cfg.attn_res_block_size == 3
    assert [cfg.is_moe(i) for i in range(8)] == [False] + [True] * 7


def test_quantized_expert_weight_view(tiny_ref):
    p = tiny_ref.layer(2)
    name = "block_sparse_moe.experts.5.w2."
    assert name + "weight" in p and name + "weight_packed" in p
    want = ref.mxfp4_dequantize(tiny_ref.raw(ref.PREFIX + "layers.2." + name + "weight_packed"),
                                tiny_ref.raw(ref.PREFIX + "layers.2." + name + "weight_scale"))
    np.testing.assert_array_equal(p[name + "weight"], want)
    assert p[name + "weight"].shape == (64, 256)                        # [latent, expert width]


def test_latent_moe_from_packed_dict_equals_view(tiny_ref):
    p = tiny_ref.layer(1)
    routed = "block_sparse_moe.experts."
    packed_only = {k: (tiny_ref.raw(ref.PREFIX + "layers.1." + k) if k.startswith(routed) else p[k])
                   for k in p if not (k.startswith(routed) and k.endswith(".weight"))}
    assert not any(k.startswith(routed) and k.endswith(".weight") for k in packed_only)
    assert "block_sparse_moe.shared_experts.gate_proj.weight" in packed_only
    x = np.random.default_rng(3).normal(size=(3, tiny_ref.cfg.hidden_size))
    np.testing.assert_array_equal(ref.latent_moe(x, packed_only, tiny_ref.cfg), ref.latent_moe(x, p, tiny_ref.cfg))


def test_kda_and_mla_layers_continue_from_state(tiny_ref):
    cfg = tiny_ref.cfg
    x = np.random.default_rng(5).normal(size=(7, cfg.hidden_size))
    p = tiny_ref.layer(0)
    whole = ref.kda_layer(x, p, cfg)
    a, st = ref.kda_layer(x[:3], p, cfg, return_state=True)
    b = ref.kda_layer(x[3:], p, cfg, state=st)
    np.testing.assert_allclose(np.concatenate([a, b]), whole, rtol=1e-12, atol=1e-14)
    p = tiny_ref.layer(3)
    whole = ref.mla_layer(x, p, cfg)
    a, cache = ref.mla_layer(x[:4], p, cfg, return_cache=True)
    b = ref.mla_layer(x[4:], p, cfg, past=cache)
    np.testing.assert_allclose(np.concatenate([a, b]), whole, rtol=1e-12, atol=1e-14)


def test_forward_finite_and_causal(tiny_ref):
    cfg = tiny_ref.cfg
    T = 16
    toks = _tokens(T, cfg.vocab_size)
    logits = ref.forward(tiny_ref, toks)
    assert logits.shape == (T, cfg.vocab_size) and logits.dtype == np.float64
    assert np.all(np.isfinite(logits))
    assert logits.std() > 0.1                                             # not a degenerate output
    cut = 9
    changed = toks.copy()
    changed[cut:] = (changed[cut:] + 1 + np.arange(T - cut)) % cfg.vocab_size
    other = ref.forward(tiny_ref, changed)
    np.testing.assert_allclose(other[:cut], logits[:cut], rtol=1e-12, atol=1e-12)
    assert np.abs(other[cut:] - logits[cut:]).max() > 1e-3               # later positions do change
    prefix = ref.forward(tiny_ref, toks[:cut])
    np.testing.assert_allclose(prefix, logits[:cut], rtol=1e-12, atol=1e-12)


def test_forward_accepts_a_directory(tiny_ckpt, tiny_ref):
    toks = _tokens(3, tiny_ref.cfg.vocab_size, seed=11)
    np.testing.assert_array_equal(ref.forward(tiny_ckpt, toks), ref.forward(tiny_ref, toks))
    with pytest.raises(ValueError):
        ref.forward(tiny_ref, np.array([0, tiny_ref.cfg.vocab_size]))


def _expected_trace(cfg):
    """The SPEC 4 loop's events written out independently of `forward`."""
    ev, n_blocks = [], 0
    for i in range(cfg.num_layers):
        if n_blocks:
            ev.append(("mix", "self_attention_res", i, n_blocks + 1))
        if i % cfg.attn_res_block_size == 0:
            n_blocks += 1
            ev.append(("bank", i, n_blocks))
        ev.append(("attn", i, "kda" if i in cfg.kda_layers else "mla"))
        ev.append(("mix", "mlp_res", i, n_blocks + 1))
        moe = i >= cfg.first_k_dense_replace and i % cfg.moe_layer_freq == 0
        ev.append(("ffn", i, "moe" if moe else "dense"))
    ev.append(("mix", "output_attn_res", None, n_blocks + 1))
    return ev


def test_forward_attn_res_banking(tiny_ref):
    trace = []
    ref.forward(tiny_ref, _tokens(4, tiny_ref.cfg.vocab_size), trace=trace)
    assert trace == _expected_trace(tiny_ref.cfg)
    mixes = [e for e in trace if e[0] == "mix"]
    banks = [e[1] for e in trace if e[0] == "bank"]
    assert banks == [0, 3, 6]                                            # block size 3, 8 layers
    assert len(mixes) == 2 * 8                                           # 7 + 8 + 1
    assert mixes[-1] == ("mix", "output_attn_res", None, 4)              # 3 blocks + live P
    assert [e[2] for e in trace if e[0] == "attn" and e[2] == "mla"] == ["mla", "mla"]


def test_forward_banks_the_raw_layer_input(tiny_ref, monkeypatch):
    """At layer 3 the bank is P (the sum of layers 0..2's outputs), not the mixed h: the candidates
    of layer 3's mlp mix must repeat those of its attention mix exactly."""
    toks = _tokens(5, tiny_ref.cfg.vocab_size, seed=2)
    seen = []
    orig = ref.attn_res_mix

    def spy(cands, nw, pw, eps):
        seen.append(np.array(cands))
        return orig(cands, nw, pw, eps)

    monkeypatch.setattr(ref, "attn_res_mix", spy)
    ref.forward(tiny_ref, toks)
    assert len(seen) == 16
    # mix order: L0 mlp, L1 attn, L1 mlp, L2 attn, L2 mlp, L3 attn, L3 mlp, ...
    l3_attn, l3_mlp = seen[5], seen[6]
    assert len(l3_attn) == 2 and len(l3_mlp) == 3
    np.testing.assert_array_equal(l3_mlp[:2], l3_attn)
    emb = tiny_ref.tensor(ref.PREFIX + "embed_tokens.weight")[toks]
    np.testing.assert_array_equal(l3_attn[0], emb)
    np.testing.assert_array_equal(seen[0][0], emb)


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    """A different structure: dense layers 0-1, MoE every 2nd layer after, block size 2, no latent norm."""
    from kimik3_jax.checkpoint.generate import make_checkpoint
    from kimik3_jax.presets import derive, preset_dict
    conf = derive(preset_dict("tiny"), num_layers=6,
                  text={"first_k_dense_replace": 2, "moe_layer_freq": 2, "attn_res_block_size": 2,
                        "latent_moe_use_norm": False, "routed_scaling_factor": 2.5, "num_experts_per_token": 3})
    out = tmp_path_factory.mktemp("refother") / "ck"
    make_checkpoint(conf, out, seed=3, text_only=True, progress=False)
    return out


def test_forward_other_structure(other_ckpt):
    r = ref.load_reference(other_ckpt)
    cfg = r.cfg
    assert [cfg.is_moe(i) for i in range(6)] == [False, False, True, False, True, False]
    assert not cfg.latent_moe_use_norm and cfg.routed_scaling_factor == 2.5 and cfg.top_k == 3
    trace = []
    logits = ref.forward(r, _tokens(6, cfg.vocab_size), trace=trace)
    assert logits.shape == (6, cfg.vocab_size) and np.all(np.isfinite(logits))
    assert trace == _expected_trace(cfg)
    assert [e[1] for e in trace if e[0] == "bank"] == [0, 2, 4]


def test_parse_config_refuses_unsupported():
    from kimik3_jax.presets import release_dict
    base = release_dict()
    cfg = ref.parse_config(base)
    assert cfg.num_layers == 93 and len(cfg.mla_layers) == 24 and sorted(cfg.mla_layers)[-2:] == [91, 92]
    assert cfg.kda_head_dim == 128 and cfg.gate_lower_bound == -5.0 and cfg.top_k == 16
    for field, value in [("hidden_act", "silu"), ("num_expert_group", 4), ("mla_use_nope", False),
                         ("moe_router_activation_func", "softmax")]:
        bad = json.loads(json.dumps(base))
        bad["text_config"][field] = value
        with pytest.raises(ValueError):
            ref.parse_config(bad)
