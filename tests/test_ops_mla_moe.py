"""MLA and MoE ops (kimik3_jax/ops/mla.py, moe.py) against the float64 NumPy reference.

MLA: projections, prefill attention over a latent cache with queries continuing from earlier tokens, the
absorbed decode form, cache writes. MoE: the sigmoid router (bias only chooses, ties to the lower expert
index), dropless dispatch under any skew, the routed experts and the whole latent MoE with packed MXFP4
or dense experts. Sizes are the tiny preset's; tolerances and helpers come from test_ops_basic.py.
"""
import collections
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kimik3_jax.ops.mla import mla_attend, mla_attend_absorbed, mla_project, write_cache
from kimik3_jax.ops.moe import dispatch, latent_moe, route, routed_experts
from kimik3_jax.params import DenseExpertParams, ExpertParams, MLPParams, MoEParams
from kimik3_jax.presets import preset_dict
from reference import k3_numpy as ref
from test_ops_basic import (
    BF16, CFG, DTYPE_IDS, DTYPES, NO_DB, RTOL, acc_of, acc_rtol, assert_close, make, precision,
)

D = CFG.hidden_size
M = CFG.mla
H, N, P, R, DV, QR = M.num_heads, M.qk_nope_head_dim, M.qk_rope_head_dim, M.kv_lora_rank, M.v_head_dim, M.q_lora_rank
SCALE = (N + P) ** -0.5
MOE = CFG.moe
E, TOP_K, F, L = MOE.num_experts, MOE.top_k, MOE.expert_width, MOE.latent_width
REF_CFG = ref.parse_config(preset_dict("tiny"))


def randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


# --------------------------------------------------------------------------------------------------- MLA

def mla_weights(rng):
    return {
        "q_a": randn(rng, QR, D, scale=D ** -0.5), "q_a_norm": 1 + randn(rng, QR, scale=0.2),
        "q_b": randn(rng, H * (N + P), QR, scale=QR ** -0.5),
        "kv_a": randn(rng, R + P, D, scale=D ** -0.5), "kv_a_norm": 1 + randn(rng, R, scale=0.2),
        "kv_b": randn(rng, H * (N + DV), R, scale=R ** -0.5),
    }


def project_reference(x, w):
    """SPEC 6 projections, written out: -> q_nope, q_pe, cache entry (normed latent c, then raw k_pe)."""
    cq = ref.rms_norm(x @ w["q_a"].T, w["q_a_norm"], ref.MLA_NORM_EPS)
    q = (cq @ w["q_b"].T).reshape(*x.shape[:-1], H, N + P)
    ckv = x @ w["kv_a"].T
    c = ref.rms_norm(ckv[..., :R], w["kv_a_norm"], ref.MLA_NORM_EPS)
    return q[..., :N], q[..., N:], np.concatenate([c, ckv[..., R:]], axis=-1)


def attend_reference(q_nope, q_pe, cache, kv_b, offset):
    """One sequence: queries at positions offset.., keys/values expanded from cache slots [0, offset + T)
    with kv_b (SPEC 6), full causal softmax."""
    s = offset + q_nope.shape[0]
    c, k_pe = cache[:s, :R], cache[:s, R:]
    kv = (c @ kv_b.T).reshape(s, H, N + DV)
    return ref.mla_attention(q_nope, q_pe, kv[..., :N], k_pe, kv[..., N:], SCALE, causal=True, q_offset=offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mla_project(dtype):
    rng = np.random.default_rng(301)
    w0 = mla_weights(rng)
    x0 = randn(rng, 2, 5, D)
    with precision(dtype):
        x, x64 = make(x0, dtype)
        w = {name: make(a, dtype) for name, a in w0.items()}
        q_nope, q_pe, entry = mla_project(x, w["q_a"][0], w["q_a_norm"][0], w["q_b"][0], w["kv_a"][0],
                                          w["kv_a_norm"][0], M)
    want = project_reference(x64, {name: a[1] for name, a in w.items()})
    for got, exp, name in zip((q_nope, q_pe, entry), want, ("q_nope", "q_pe", "cache entry")):
        assert got.dtype == x.dtype and got.shape == exp.shape
        assert_close(got, exp, RTOL[np.dtype(dtype)], axis=-1, what=f"mla_project {name} {np.dtype(dtype)}")


CACHE_S, MLA_T, OFFSETS = 24, 5, (3, 12)  # capacity, new queries, tokens already in each sequence's cache


def mla_attend_case(rng):
    """q [B, T, H, .], a cache [B, S, R+P] holding OFFSETS[b] + T real entries (earlier tokens, then the
    new ones) and large garbage in every later slot, kv_b, and the queries' absolute positions."""
    b = len(OFFSETS)
    q_nope, q_pe = randn(rng, b, MLA_T, H, N), randn(rng, b, MLA_T, H, P)
    cache = randn(rng, b, CACHE_S, R + P, scale=50.0)  # garbage: any leak into the softmax is visible
    for i, off in enumerate(OFFSETS):
        n = off + MLA_T
        cache[i, :n, :R] = ref.rms_norm(randn(rng, n, R), 1 + randn(rng, R, scale=0.2), ref.MLA_NORM_EPS)
        cache[i, :n, R:] = randn(rng, n, P)
    kv_b = randn(rng, H * (N + DV), R, scale=R ** -0.5)
    q_pos = np.asarray(OFFSETS)[:, None] + np.arange(MLA_T)[None, :]
    return q_nope, q_pe, cache, kv_b, q_pos


_attend = jax.jit(mla_attend, static_argnums=5)
_absorbed = jax.jit(mla_attend_absorbed, static_argnums=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mla_attend_and_absorbed_decode(dtype):
    rng = np.random.default_rng(302)
    qn0, qp0, cache0, kv_b0, q_pos = mla_attend_case(rng)
    b = len(OFFSETS)
    with precision(dtype):
        q_nope, qn64 = make(qn0, dtype)
        q_pe, qp64 = make(qp0, dtype)
        cache, cache64 = make(cache0, dtype)
        kv_b, kv_b64 = make(kv_b0, dtype)
        pos = jnp.asarray(q_pos, jnp.int32)
        o = _attend(q_nope, q_pe, cache, kv_b, pos, M)
        # the decode form, one query per row: every (sequence, position) pair as its own batch row
        o_abs = _absorbed(q_nope.reshape(b * MLA_T, H, N), q_pe.reshape(b * MLA_T, H, P),
                          jnp.repeat(cache, MLA_T, axis=0), kv_b, pos.reshape(-1), M)
    assert o.dtype == o_abs.dtype == cache.dtype
    o_abs = np.asarray(o_abs, dtype=np.float64).reshape(b, MLA_T, H, DV)
    want = np.stack([attend_reference(qn64[i], qp64[i], cache64[i], kv_b64, off) for i, off in enumerate(OFFSETS)])
    rtol = RTOL[np.dtype(dtype)]
    assert_close(o, want, rtol, axis=-1, what=f"mla_attend {np.dtype(dtype)}")
    assert_close(o_abs, want, rtol, axis=-1, what=f"mla_attend_absorbed {np.dtype(dtype)}")
    if dtype is not BF16:
        assert_close(o_abs, o, rtol, axis=-1, what=f"absorbed vs prefill form {np.dtype(dtype)}")


WB, WT, WS, WE = 3, 6, 10, 5
_write = jax.jit(write_cache)


def write_reference(cache, entries, start, lengths):
    out = cache.copy()
    for b in range(cache.shape[0]):
        for t in range(lengths[b]):
            if start[b] + t < cache.shape[1]:
                out[b, start[b] + t] = entries[b, t]
    return out


@NO_DB
@given(start=st.lists(st.integers(0, WS + 2), min_size=WB, max_size=WB),
       lengths=st.lists(st.integers(0, WT), min_size=WB, max_size=WB), seed=st.integers(0, 2 ** 16))
def test_write_cache_skips_padding_and_slots_past_the_capacity(start, lengths, seed):
    rng = np.random.default_rng([303, seed])
    cache0 = randn(rng, WB, WS, WE).astype(np.float32)
    entries0 = randn(rng, WB, WT, WE).astype(np.float32)
    with precision(np.float32):
        got = _write(jnp.asarray(cache0), jnp.asarray(entries0), jnp.asarray(start, jnp.int32),
                     jnp.asarray(lengths, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), write_reference(cache0, entries0, start, lengths))


def test_write_cache_casts_entries_to_the_cache_dtype():
    rng = np.random.default_rng(304)
    cache0 = randn(rng, WB, WS, WE).astype(BF16)
    entries0 = randn(rng, WB, WT, WE).astype(np.float32)
    start, lengths = [0, 7, 4], [6, 6, 2]
    got = _write(jnp.asarray(cache0), jnp.asarray(entries0), jnp.asarray(start, jnp.int32),
                 jnp.asarray(lengths, jnp.int32))
    assert got.dtype == BF16
    want = write_reference(cache0, entries0.astype(BF16), start, lengths)
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want.astype(np.float32))


# ------------------------------------------------------------------------------------------------ router

def sorted_choice(idx, w):
    """Each token's chosen experts in ascending id order, with their weights (the order within a token's
    top-k is not part of the contract; the pairing is)."""
    idx = np.asarray(idx)
    order = np.argsort(idx, axis=-1, kind="stable")
    return np.take_along_axis(idx, order, axis=-1), np.take_along_axis(np.asarray(w, dtype=np.float64), order, -1)


def test_route_matches_reference():
    rng = np.random.default_rng(305)
    n = 64
    x0 = randn(rng, n, D)
    w0 = randn(rng, E, D, scale=2 * D ** -0.5)
    bias0 = randn(rng, E, scale=0.3)
    # the bias does change the choice of many tokens (so choosing by s + bias and weighting by s is observable)
    assert (np.sort(ref.router(x0, w0, bias0, TOP_K, True, 1.0)[0], -1)
            != np.sort(ref.router(x0, w0, None, TOP_K, True, 1.0)[0], -1)).any(-1).mean() > 0.25
    for dtype in DTYPES:
        with precision(dtype):
            x, x64 = make(x0, dtype)
            w_router, w64 = make(w0, dtype)
            bias, bias64 = make(bias0, acc_of(dtype))  # e_score_correction_bias is an F32 tensor
            for top_k in (1, TOP_K, E):
                for renormalize in (True, False):
                    for scaling in (1.0, 2.5):
                        idx, w = route(x, w_router, bias, top_k, renormalize, scaling)
                        assert idx.dtype == jnp.int32 and idx.shape == (n, top_k)
                        assert w.dtype == acc_of(dtype)  # the router runs in fp32 even for bf16 activations
                        idx_ref, w_ref = ref.router(x64, w64, bias64, top_k, renormalize, scaling)
                        got_idx, got_w = sorted_choice(idx, w)
                        want_idx, want_w = sorted_choice(idx_ref, w_ref)
                        what = f"route {np.dtype(dtype)} k={top_k} renorm={renormalize} scaling={scaling}"
                        np.testing.assert_array_equal(got_idx, want_idx, err_msg=what)
                        assert_close(got_w, want_w, acc_rtol(dtype), axis=-1, what=what)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_route_exact_ties_go_to_the_lower_expert_index(dtype):
    """Experts with all-zero router rows score exactly sigmoid(0) = 1/2 for every token; equal biases then
    make exact ties in s + bias. Case 1: six tied experts compete for 4 slots. Case 2: two experts win
    outright, three tied experts compete for the other 2 slots."""
    rng = np.random.default_rng(306)
    x0 = randn(rng, 8, D)
    cases = [({1: 1.0, 3: 1.0, 7: 1.0, 11: 1.0, 12: 1.0, 14: 1.0}, [1, 3, 7, 11]),
             ({5: 2.0, 9: 2.0, 2: 1.0, 4: 1.0, 6: 1.0}, [2, 4, 5, 9])]
    for boosted, expected in cases:
        w0 = randn(rng, E, D, scale=D ** -0.5)  # other experts: s in (0, 1), bias 0: never above 1.5
        bias0 = np.zeros(E)
        for e, b in boosted.items():
            w0[e] = 0.0
            bias0[e] = b
        for renormalize in (True, False):
            with precision(dtype):
                idx, w = route(jnp.asarray(x0, dtype), jnp.asarray(w0, dtype), jnp.asarray(bias0, dtype), TOP_K,
                               renormalize, 1.0)
            got_idx, got_w = sorted_choice(idx, w)
            np.testing.assert_array_equal(got_idx, np.tile(expected, (8, 1)))
            # every chosen score is exactly 1/2: weights 1/2, or 1/2 / (4 * 1/2 + 1e-20) = 1/4 renormalised
            np.testing.assert_array_equal(got_w, np.full((8, TOP_K), 0.25 if renormalize else 0.5))
            idx_ref, w_ref = ref.router(x0.astype(dtype), w0, bias0, TOP_K, renormalize, 1.0)
            np.testing.assert_array_equal(got_idx, sorted_choice(idx_ref, w_ref)[0])


# ---------------------------------------------------------------------------------------------- dispatch

DN = 24
_dispatch = jax.jit(dispatch, static_argnums=1)


def skewed_choices(rng, pattern):
    if pattern == "one expert":  # every pair to expert 6 (dispatch must keep even repeated pairs)
        return np.full((DN, TOP_K), 6)
    if pattern == "same experts":  # every token picks the same 4; 12 experts empty
        return np.tile([3, 15, 0, 9], (DN, 1))
    if pattern == "few experts":
        pool = rng.choice(E, size=5, replace=False)
        return np.stack([rng.choice(pool, size=TOP_K, replace=False) for _ in range(DN)])
    return np.stack([rng.choice(E, size=TOP_K, replace=False) for _ in range(DN)])


@NO_DB
@given(pattern=st.sampled_from(["one expert", "same experts", "few experts", "uniform"]),
       seed=st.integers(0, 2 ** 16))
def test_dispatch_is_dropless_for_any_skew(pattern, seed):
    idx = skewed_choices(np.random.default_rng([307, seed]), pattern)
    order, tokens, sizes = (np.asarray(a) for a in _dispatch(jnp.asarray(idx, jnp.int32), E))
    flat = idx.reshape(-1)
    np.testing.assert_array_equal(np.sort(order), np.arange(DN * TOP_K))  # each pair exactly once
    experts = flat[order]
    np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=E))
    np.testing.assert_array_equal(experts, np.repeat(np.arange(E), sizes))  # grouped as `sizes` says
    np.testing.assert_array_equal(tokens, order // TOP_K)
    assert collections.Counter(zip(tokens.tolist(), experts.tolist())) == \
        collections.Counter((t, int(e)) for t in range(DN) for e in idx[t])


# --------------------------------------------------------------------------------------------------- MoE

def scale_bytes(rng, shape, fan_in):
    """E8M0 bytes around the scale that gives weights of std ~ 1/sqrt(fan_in): uniform random nibbles have
    RMS sqrt(mean(E2M1 magnitudes^2)) = 2.93."""
    rms = np.sqrt(np.mean(ref.E2M1_MAGNITUDES ** 2))
    centre = round(127 - np.log2(rms * np.sqrt(fan_in)))
    return rng.integers(centre - 1, centre + 2, size=shape).astype(np.uint8)


def packed_experts(rng):
    """Random packed bytes and realistic scale bytes: w1/w3 [E, F, L], w2 [E, L, F] as released."""
    g = ref.MXFP4_GROUP
    out = {}
    for name, (rows, cols) in (("w1", (F, L)), ("w3", (F, L)), ("w2", (L, F))):
        out[name + "_packed"] = rng.integers(0, 256, size=(E, rows, cols // 2)).astype(np.uint8)
        out[name + "_scale"] = scale_bytes(rng, (E, rows, cols // g), cols)
    return out


def dense_expert_arrays(rng):
    return {"w1": randn(rng, E, F, L, scale=L ** -0.5), "w3": randn(rng, E, F, L, scale=L ** -0.5),
            "w2": randn(rng, E, L, F, scale=F ** -0.5)}


def expert_params(arrays, dtype):
    """(ExpertParams or DenseExpertParams for the op, float64 [E, out, in] w1, w3, w2 for the reference)."""
    if "w1_packed" in arrays:
        params = ExpertParams(**{k: jnp.asarray(a) for k, a in arrays.items()})
        dense = [np.stack([ref.mxfp4_dequantize(arrays[f"{n}_packed"][e], arrays[f"{n}_scale"][e])
                           for e in range(E)]) for n in ("w1", "w3", "w2")]
        return params, dense
    made = {k: make(a, dtype) for k, a in arrays.items()}
    return DenseExpertParams(**{k: m[0] for k, m in made.items()}), [made[n][1] for n in ("w1", "w3", "w2")]


def routed_reference(xl, idx, weights, w1, w3, w2, beta, linear_beta):
    y = np.zeros_like(xl)
    for t in range(xl.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = ref.situ(xl[t] @ w1[e].T, xl[t] @ w3[e].T, beta, linear_beta)
            y[t] += weights[t, j] * (h @ w2[e].T)
    return y


_routed = jax.jit(routed_experts, static_argnums=(4, 5, 6))


@pytest.mark.parametrize("strategy", ["sorted", "gathered"])
@pytest.mark.parametrize("dtype,kind", [(np.float64, "packed"), (np.float32, "packed"), (BF16, "packed"),
                                        (np.float32, "dense")], ids=["f64-packed", "f32-packed", "bf16-packed",
                                                                     "f32-dense"])
def test_routed_experts_with_skewed_routing(dtype, kind, strategy):
    """Half the tokens pick experts (2, 5, 7, 11), the other half (2, 0, 1, 3): expert 2 gets every token and
    eight experts get none. Both strategies (experts sorted + ragged_dot, or gathered per pair)."""
    rng = np.random.default_rng(308)
    n = 12
    arrays = packed_experts(rng) if kind == "packed" else dense_expert_arrays(rng)
    idx0 = np.concatenate([np.tile([2, 5, 7, 11], (n // 2, 1)), np.tile([2, 0, 1, 3], (n // 2, 1))])
    weights0 = rng.uniform(0.05, 1.0, size=(n, TOP_K))
    xl0 = randn(rng, n, L)
    with precision(dtype):
        xl, xl64 = make(xl0, dtype)
        weights, weights64 = make(weights0, acc_of(dtype))
        experts, (w1, w3, w2) = expert_params(arrays, dtype)
        y = _routed(xl, jnp.asarray(idx0, jnp.int32), weights, experts, CFG.situ_beta, CFG.situ_linear_beta,
                    strategy)
    assert y.dtype == acc_of(dtype)  # the combine stays in fp32
    want = routed_reference(xl64, idx0, weights64, w1, w3, w2, CFG.situ_beta, CFG.situ_linear_beta)
    assert_close(y, want, RTOL[np.dtype(dtype)], axis=-1, what=f"routed_experts {np.dtype(dtype)} {kind} {strategy}")


def moe_case(rng, experts):
    """One layer's MoE weights as float64 arrays (experts: packed bytes or dense arrays)."""
    sw = MOE.shared_width
    return {
        "router": randn(rng, E, D, scale=2 * D ** -0.5), "router_bias": randn(rng, E, scale=0.3),
        "latent_down": randn(rng, L, D, scale=D ** -0.5), "latent_norm": 1 + randn(rng, L, scale=0.2),
        "latent_up": randn(rng, D, L, scale=L ** -0.5),
        "gate": randn(rng, sw, D, scale=2 * D ** -0.5), "up": randn(rng, sw, D, scale=2 * D ** -0.5),
        "down": randn(rng, D, sw, scale=sw ** -0.5),
        "experts": packed_experts(rng) if experts == "packed" else dense_expert_arrays(rng),
    }


def moe_params(case, dtype):
    """(MoEParams for the op, the reference's layer dict `block_sparse_moe.*` of float64 / uint8 arrays)."""
    m = {k: make(a, acc_of(dtype) if k == "router_bias" else dtype) for k, a in case.items() if k != "experts"}
    experts, dense = expert_params(case["experts"], dtype)
    params = MoEParams(router=m["router"][0], router_bias=m["router_bias"][0], latent_down=m["latent_down"][0],
                       latent_norm=m["latent_norm"][0], latent_up=m["latent_up"][0],
                       shared=MLPParams(gate=m["gate"][0], up=m["up"][0], down=m["down"][0]), experts=experts)
    pre = "block_sparse_moe."
    p = {pre + "gate.weight": m["router"][1], pre + "gate.e_score_correction_bias": m["router_bias"][1],
         pre + "routed_expert_down_proj.weight": m["latent_down"][1],
         pre + "routed_expert_norm.weight": m["latent_norm"][1],
         pre + "routed_expert_up_proj.weight": m["latent_up"][1],
         pre + "shared_experts.gate_proj.weight": m["gate"][1], pre + "shared_experts.up_proj.weight": m["up"][1],
         pre + "shared_experts.down_proj.weight": m["down"][1]}
    for e in range(E):
        for n, w in zip(("w1", "w3", "w2"), dense):
            if isinstance(experts, ExpertParams):  # the reference dequantises the released bytes itself
                p[f"{pre}experts.{e}.{n}.weight_packed"] = case["experts"][f"{n}_packed"][e]
                p[f"{pre}experts.{e}.{n}.weight_scale"] = case["experts"][f"{n}_scale"][e]
            else:
                p[f"{pre}experts.{e}.{n}.weight"] = w[e]
    return params, p


_moe = jax.jit(latent_moe, static_argnums=2)

MOE_CASES = [  # dtype, experts, latent_use_norm, top_k, renormalize, routed_scaling_factor, tokens [B, T]
    (np.float64, "packed", True, TOP_K, True, 1.0, (2, 6)),
    (np.float64, "packed", False, TOP_K, True, 1.0, (2, 6)),
    (np.float64, "dense", True, 2, False, 2.5, (2, 6)),
    (np.float64, "packed", True, TOP_K, True, 1.0, (3, 1)),  # 12 pairs < 16 experts: the gathered strategy
    (np.float32, "packed", True, TOP_K, True, 1.0, (2, 6)),
    (np.float32, "dense", False, TOP_K, True, 1.0, (1, 2)),
    (BF16, "packed", True, TOP_K, True, 1.0, (2, 6)),
]


@pytest.mark.parametrize("dtype,experts,use_norm,top_k,renormalize,scaling,tokens", MOE_CASES,
                         ids=[f"{np.dtype(c[0]).name}-{c[1]}-norm{int(c[2])}-k{c[3]}-{c[6][0] * c[6][1]}tok"
                              for c in MOE_CASES])
def test_latent_moe_matches_reference(dtype, experts, use_norm, top_k, renormalize, scaling, tokens):
    rng = np.random.default_rng([309, MOE_CASES.index((dtype, experts, use_norm, top_k, renormalize, scaling,
                                                       tokens))])
    case = moe_case(rng, experts)
    moe = replace(CFG.moe, latent_use_norm=use_norm, top_k=top_k, renormalize=renormalize,
                  routed_scaling_factor=scaling)
    cfg = replace(CFG, moe=moe)
    ref_cfg = replace(REF_CFG, latent_moe_use_norm=use_norm, top_k=top_k, moe_renormalize=renormalize,
                      routed_scaling_factor=scaling)
    x0 = randn(rng, *tokens, D)
    with precision(dtype):
        x, x64 = make(x0, dtype)
        params, p = moe_params(case, dtype)
        y = _moe(x, params, cfg)
    assert y.dtype == x.dtype and y.shape == x.shape
    want = ref.latent_moe(x64.reshape(-1, D), p, ref_cfg).reshape(x.shape)
    what = f"latent_moe {np.dtype(dtype)} {experts} norm={use_norm} k={top_k}"
    assert_close(y, want, RTOL[np.dtype(dtype)], axis=-1, what=what)
