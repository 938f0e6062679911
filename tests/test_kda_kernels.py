"""The Pallas KDA kernels (pallas_kernels/kda) in interpret mode on the CPU, against the float64 NumPy
reference: the chunked prefill (T not a multiple of the chunk, T = 1, the -5 gate bound, non-zero initial
states, per-row lengths, packed sequences of unequal lengths with their own states, chunk-boundary
checkpoints equal to the recurrence's states there) and the fused decode step on a slot pool, whole V
per program and split over value tiles (against the pure op kda_decode and the NumPy conv + recurrence);
the impl switch; the model with impl="pallas".

q, k, v are bf16 and the kernels' matmuls run on bf16 operands (fp32 accumulation, as on the GPU), so
outputs compare at bf16 level (BF16_RTOL = 1e-2) against float64 on the same bf16-rounded inputs.
Kept small (K = V = 32, two heads, a few chunks) so the whole file runs in well under a minute.

Every prefill test runs both variants: the two-phase default (tuning phases=2: a parallel per-chunk
kernel, then the serial state kernel) at chunk 16 (one sub-block), 32 (two) and 64 (four, at the -5
bound), once with its u0 workspace in bf16, and the one-phase kernel (phases=1, also the default's
fallback when its workspaces would be too large).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import k3_numpy as ref
from test_ops_basic import BF16_RTOL, F32_RTOL, assert_close

from kimik3_jax.ops import impl as impl_mod
from kimik3_jax.ops.kda import kda_decode as decode_op
from kimik3_jax.ops.kda import kda_prefill as prefill_op
from pallas_kernels.kda.decode import kda_decode
from pallas_kernels.kda.prefill import kda_prefill

LB = -5.0
H, D = 2, 32
SMALL = dict(phases=1, chunk=16, block_v=16)  # one phase, two value tiles, chunk 16
ONE = dict(phases=1, chunk=32, block_v=128, num_warps=8)  # one phase, chunk 32, whole V
TWO = dict(phases=2, chunk=32, block_v=128)  # two phases, chunk 32, whole V
TWO_SMALL = dict(SMALL, phases=2)
TWO_64 = dict(phases=2, chunk=64, block_v=16, phase1_inverse="substitution")  # four sub-blocks joined, two tiles
bf16_round = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def raw_inputs(rng, b, t, gates="random", n_states=None):
    """Kernel inputs before the fused prologue: q, k, v (bf16 values as float64), the gate
    pre-activation z, beta, s0 and a_log."""
    q, k, v = (bf16_round(rng.standard_normal((b, t, H, D))) for _ in range(3))
    z = rng.standard_normal((b, t, H, D)) * 3
    if gates == "bound":
        z = np.full_like(z, 200.0)  # sigmoid -> 1: g = -5 (to fp32 rounding)
    beta = ref.sigmoid(rng.standard_normal((b, t, H)) * 2)
    s0 = rng.standard_normal((n_states or b, H, D, D))
    a_log = rng.uniform(-1, 1, size=H)
    return q, k, v, z, beta, s0, a_log


def reference_seq(q, k, v, z, beta, s0, a_log, upto=None):
    """float64 recurrence for one sequence [T, H, ...] with the fused prologue; states after each token
    in `upto` too."""
    qn = ref.l2_normalize(q, ref.L2_EPS) * D ** -0.5
    kn = ref.l2_normalize(k, ref.L2_EPS)
    g = ref.kda_gate(z, a_log, LB)
    o, s = ref.kda_recurrent(qn, kn, v, g, beta, s0)
    states = [ref.kda_recurrent(qn[:n], kn[:n], v[:n], g[:n], beta[:n], s0)[1] for n in (upto or [])]
    return o, s, states


def run_prefill(x, **kw):
    q, k, v, z, beta, s0, a_log = x
    args = [jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
            jnp.asarray(z, jnp.float32), jnp.asarray(beta, jnp.float32), jnp.asarray(s0, jnp.float32)]
    return kda_prefill(*args, a_log=jnp.asarray(a_log, jnp.float32), lower_bound=LB, qk_norm=True,
                       interpret=True, **kw)


@pytest.mark.parametrize("t,gates,tuning", [(45, "random", None), (1, "random", ONE), (64, "bound", SMALL),
                                            (37, "bound", ONE), (50, "random", SMALL),
                                            (1, "random", TWO), (64, "bound", TWO_SMALL),
                                            (50, "random", dict(TWO_64, u0_bf16=False, phase1_inverse="series")),
                                            (50, "bound", dict(TWO_SMALL, phase1_chunks=3, phase1_stages=2)),
                                            (70, "bound", TWO_64),
                                            (45, "random", dict(TWO_SMALL, phase2_transposed=False)),
                                            (70, "bound", dict(TWO_64, phase2_transposed=False)),
                                            (37, "random", dict(TWO_SMALL, phase1_early_stores=True)),
                                            (70, "bound", dict(TWO_64, phase1_early_stores=True)),
                                            (45, "random", dict(TWO_SMALL, wq_interleaved=True)),
                                            (70, "bound", dict(TWO_64, wq_interleaved=True, phase1_early_stores=True)),
                                            (37, "bound", dict(TWO_SMALL, phase1_v_early=False)),
                                            (45, "random", dict(TWO_SMALL, phase2_prefetch=[])),
                                            (70, "random", dict(TWO_64, phase1_early_stores=False)),
                                            (37, "random", dict(TWO_SMALL, phase2_prefetch=["dec"])),  # u0 left to Triton
                                            (70, "bound", dict(TWO_64, phase2_prefetch=["u0", "dec", "m", "kt"])),
                                            (45, "bound", dict(TWO_SMALL, wq_interleaved=True,
                                                               phase2_prefetch=["wq", "u0", "kt", "m", "dec"])),
                                            (50, "random", dict(TWO_SMALL, phase2_transposed=False,
                                                                phase2_prefetch=["w", "u0", "qd"])),
                                            (45, "bound", dict(TWO_SMALL, phase1_products="tf32")),
                                            (37, "random", dict(TWO_SMALL, phase1_products="tf32",
                                                                phase1_early_stores=False)),
                                            (70, "bound", dict(TWO_64, phase1_products="tf32"))])
def test_prefill_kernel_matches_reference(t, gates, tuning):
    rng = np.random.default_rng([601, t])
    x = raw_inputs(rng, 2, t, gates)
    o, s = run_prefill(x, tuning=tuning)
    assert o.dtype == jnp.float32 and o.shape == (2, t, H, D) and s.shape == (2, H, D, D)
    for b in range(2):
        o_ref, s_ref, _ = reference_seq(*(a[b] for a in x[:6]), x[6])
        assert_close(o[b], o_ref, BF16_RTOL, axis=(0, 2), what=f"prefill T={t} {gates} outputs")
        assert_close(s[b], s_ref, BF16_RTOL, axis=(-2, -1), what=f"prefill T={t} {gates} state")


@pytest.mark.parametrize("tuning", [SMALL, TWO_SMALL], ids=["one-phase", "two-phase"])
def test_prefill_kernel_lengths_are_identity_tails_and_match_the_op(tuning):
    rng = np.random.default_rng(602)
    x = raw_inputs(rng, 2, 40)
    lengths = jnp.asarray([40, 23], jnp.int32)
    o, s = run_prefill(x, lengths=lengths, out_dtype=jnp.bfloat16, tuning=tuning)
    assert o.dtype == jnp.bfloat16
    _, s_ref, _ = reference_seq(*(a[1, :23] for a in x[:5]), x[5][1], x[6])
    assert_close(s[1], s_ref, BF16_RTOL, axis=(-2, -1), what="state after 23 real tokens")
    # the pure op (fp32) on the same call: outputs everywhere, identity tail included
    q, k, v, z, beta, s0, a_log = x
    args = [jnp.asarray(a, dt) for a, dt in zip(x[:6], [jnp.bfloat16] * 3 + [jnp.float32] * 3)]
    o_op, s_op = prefill_op(*args, a_log=jnp.asarray(a_log, jnp.float32), lower_bound=LB, qk_norm=True,
                            lengths=lengths)
    assert_close(o, o_op, BF16_RTOL, axis=(1, 3), what="kernel vs op outputs")
    assert_close(s, s_op, BF16_RTOL, axis=(-2, -1), what="kernel vs op states")


@pytest.mark.parametrize("tuning", [pytest.param(SMALL, marks=pytest.mark.slow), TWO_SMALL,
                                    dict(TWO_SMALL, phase1_chunks=4), dict(TWO_SMALL, wq_interleaved=True),
                                    dict(TWO_SMALL, phase2_prefetch=["u0", "dec", "w"]),
                                    dict(TWO_SMALL, phase1_v_early=False),
                                    dict(TWO_SMALL, chunk=32, phase1_products="tf32")],
                         ids=["one-phase", "two-phase", "two-phase-4-chunks-per-program", "two-phase-wq-interleaved",
                              "two-phase-prefetch", "two-phase-v-late", "two-phase-chunk-32-tf32-products"])
def test_packed_sequences_with_own_states_and_checkpoints(tuning):
    lens = [37, 1, 70, 16, 0, 33]  # unequal, one of a single token, one empty; partial last chunks
    cp = tuning["chunk"]
    cu = np.concatenate([[0], np.cumsum(lens)])
    rng = np.random.default_rng(603)
    x = raw_inputs(rng, 1, int(cu[-1]), "random", n_states=len(lens))
    o, s, c = run_prefill(x, cu_seqlens=jnp.asarray(cu, jnp.int32), checkpoint=cp, tuning=tuning)
    assert c.shape == (int(cu[-1]) // cp, H, D, D)
    row = 0
    for n, ln in enumerate(lens):
        seq = [a[0, cu[n]:cu[n + 1]] for a in x[:5]]
        marks = [cp * (j + 1) for j in range(ln // cp)]
        o_ref, s_ref, states = reference_seq(*seq, x[5][n], x[6], upto=marks)
        if ln:
            assert_close(o[0, cu[n]:cu[n + 1]], o_ref, BF16_RTOL, axis=(0, 2), what=f"packed seq {n} outputs")
        assert_close(s[n], s_ref, BF16_RTOL, axis=(-2, -1), what=f"packed seq {n} final state")
        for j, want in enumerate(states):
            assert_close(c[row + j], want, BF16_RTOL, axis=(-2, -1), what=f"seq {n} checkpoint {j}")
        row += len(states)
    np.testing.assert_array_equal(np.asarray(c[row:]), 0)
    # the pure op lays the checkpoints out the same way
    args = [jnp.asarray(a, dt) for a, dt in zip(x[:6], [jnp.bfloat16] * 3 + [jnp.float32] * 3)]
    _, _, c_op = prefill_op(*args, a_log=jnp.asarray(x[6], jnp.float32), lower_bound=LB, qk_norm=True,
                            cu_seqlens=jnp.asarray(cu, jnp.int32), checkpoint=cp)
    assert_close(c[:row], c_op[:row], BF16_RTOL, axis=(-2, -1), what="kernel vs op checkpoints")


@pytest.mark.parametrize("tuning", [ONE, TWO, dict(TWO, phase2_transposed=False)],
                         ids=["one-phase", "two-phase", "two-phase-untransposed"])
def test_batch_checkpoints_equal_recurrence_states(tuning):
    rng = np.random.default_rng(604)
    x = raw_inputs(rng, 2, 50, "bound")
    o, s, c = run_prefill(x, checkpoint=32, tuning=tuning)
    assert c.shape == (2, 1, H, D, D)
    for b in range(2):
        _, _, states = reference_seq(*(a[b] for a in x[:6]), x[6], upto=[32])
        assert_close(c[b, 0], states[0], BF16_RTOL, axis=(-2, -1), what="checkpoint at 32")


@pytest.mark.parametrize("tuning", [pytest.param(SMALL, marks=pytest.mark.slow), TWO_SMALL],
                         ids=["one-phase", "two-phase"])
def test_checkpoints_a_sequence_does_not_reach_are_defined(tuning):
    """Batch rows shorter than T: checkpoints past a row's length hold its final state (identity steps),
    as the op says; packed rows past the last sequence's are zero (here a whole unfilled row)."""
    rng = np.random.default_rng(609)
    x = raw_inputs(rng, 2, 48)
    lengths = jnp.asarray([48, 20], jnp.int32)
    _, s, c = run_prefill(x, lengths=lengths, checkpoint=16, tuning=tuning)
    args = [jnp.asarray(a, dt) for a, dt in zip(x[:6], [jnp.bfloat16] * 3 + [jnp.float32] * 3)]
    _, _, c_op = prefill_op(*args, a_log=jnp.asarray(x[6], jnp.float32), lower_bound=LB, qk_norm=True,
                            lengths=lengths, checkpoint=16)
    assert np.isfinite(np.asarray(c)).all()
    assert_close(c, c_op, BF16_RTOL, axis=(-2, -1), what="batch checkpoints vs op")
    np.testing.assert_array_equal(np.asarray(c[1, 1:]), np.broadcast_to(np.asarray(s[1]), c[1, 1:].shape))
    lens = [24, 24]  # 48 tokens give 3 checkpoint rows; each sequence reaches 1: row 2 is unfilled
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    x = raw_inputs(rng, 1, 48, n_states=2)
    _, _, c = run_prefill(x, cu_seqlens=cu, checkpoint=16, tuning=tuning)
    assert c.shape == (3, H, D, D)
    np.testing.assert_array_equal(np.asarray(c[2]), 0)
    assert np.isfinite(np.asarray(c)).all()


def test_two_phase_packed_chunks_and_limits():
    """Packed sequences whose lengths are not multiples of the chunk, one of 0 and one of 1, with
    non-zero states, at the -5 bound and chunk 32 (chunks never straddle sequences): the two-phase
    variant against the pure op (fp32) on outputs and final states, and checkpoints at every chunk
    boundary (checkpoint = chunk) against the op's. The two-phase limits: chunk 64 at the -5 bound is
    accepted (the one-phase kernel refuses it), a chunk that is not a power of two >= 16 and phases
    other than 1, 2 are refused."""
    lens = [45, 0, 1, 32, 19]
    cp = 32
    cu = np.concatenate([[0], np.cumsum(lens)])
    rng = np.random.default_rng(608)
    x = raw_inputs(rng, 1, int(cu[-1]), "bound", n_states=len(lens))
    cu_j = jnp.asarray(cu, jnp.int32)
    o, s, c = run_prefill(x, cu_seqlens=cu_j, checkpoint=cp, tuning=TWO)
    args = [jnp.asarray(a, dt) for a, dt in zip(x[:6], [jnp.bfloat16] * 3 + [jnp.float32] * 3)]
    o_op, s_op, c_op = jax.jit(lambda *a: prefill_op(*a, a_log=jnp.asarray(x[6], jnp.float32), lower_bound=LB,
                                                     qk_norm=True, cu_seqlens=cu_j, checkpoint=cp))(*args)
    assert o.shape == o_op.shape and s.shape == s_op.shape and c.shape == c_op.shape
    assert_close(o, o_op, BF16_RTOL, axis=(1, 3), what="two-phase packed outputs vs op")
    for n in range(len(lens)):
        assert_close(s[n], s_op[n], BF16_RTOL, axis=(-2, -1), what=f"two-phase packed state {n} vs op")
    n_cp = sum(n // cp for n in lens)
    assert_close(c[:n_cp], c_op[:n_cp], BF16_RTOL, axis=(-2, -1), what="two-phase checkpoints vs op")
    np.testing.assert_array_equal(np.asarray(c[n_cp:]), 0)
    k = impl_mod.kernel("kda_prefill")
    kw = dict(a_log=jnp.zeros((H,)), lower_bound=LB)
    k.supports(*args, tuning=dict(phases=2, chunk=64), **kw)
    with pytest.raises(impl_mod.Unsupported, match="overflow"):
        k.supports(*args, tuning=dict(phases=1, chunk=64), **kw)
    # two phases at chunk 16 anchor at the chunk start: e^(16 |bound|) must stay within e^80, so -5 is the
    # limit there, while chunk 32 anchors at its sub-blocks' middles (e^(8 |bound|))
    steep = dict(kw, lower_bound=-5.5)
    with pytest.raises(impl_mod.Unsupported, match="overflow"):
        k.supports(*args, tuning=dict(phases=2, chunk=16), **steep)
    k.supports(*args, tuning=dict(phases=2, chunk=32), **steep)
    with pytest.raises(impl_mod.Unsupported, match="power of two"):
        k.supports(*args, tuning=dict(phases=2, chunk=48), **kw)
    with pytest.raises(impl_mod.Unsupported, match="phases"):
        k.supports(*args, tuning=dict(phases=3), **kw)
    with pytest.raises(impl_mod.Unsupported, match="phase1_chunks"):
        k.supports(*args, tuning=dict(phases=2, phase1_chunks=0), **kw)
    with pytest.raises(impl_mod.Unsupported, match="phase1_inverse"):
        k.supports(*args, tuning=dict(phases=2, phase1_inverse="lu"), **kw)
    with pytest.raises(impl_mod.Unsupported, match="wq_interleaved needs phase2_transposed"):
        k.supports(*args, tuning=dict(phases=2, phase2_transposed=False, wq_interleaved=True), **kw)
    with pytest.raises(impl_mod.Unsupported, match="phase2_prefetch"):
        k.supports(*args, tuning=dict(phases=2, phase2_prefetch=["w", "q"]), **kw)
    with pytest.raises(impl_mod.Unsupported, match="phase2_prefetch"):  # w is one workspace with q_dec here
        k.supports(*args, tuning=dict(phases=2, wq_interleaved=True, phase2_prefetch=["w"]), **kw)
    with pytest.raises(impl_mod.Unsupported, match="phase2_prefetch"):  # a name, not a list of names
        k.supports(*args, tuning=dict(phases=2, phase2_prefetch="u0"), **kw)
    with pytest.raises(impl_mod.Unsupported, match="phase1_products"):
        k.supports(*args, tuning=dict(phases=2, phase1_products="fp8"), **kw)


def test_default_falls_back_to_one_phase_past_the_workspace_cap(monkeypatch):
    """The default runs two phases; when their workspaces would pass MAX_WORKSPACE_BYTES it runs the
    one-phase kernel with the same chunk and tiles (a caller's explicit `phases` is kept), and the results
    equal the explicit one-phase call."""
    from pallas_kernels.kda import prefill as pp
    x = raw_inputs(np.random.default_rng(611), 1, 40)
    q, v = jnp.zeros((1, 40, H, D), jnp.bfloat16), jnp.zeros((1, 40, H, D), jnp.bfloat16)
    assert pp._tuning(None, q, v)["phases"] == 2
    monkeypatch.setattr(pp, "MAX_WORKSPACE_BYTES", 1024)
    assert pp._tuning(None, q, v)["phases"] == 1
    assert pp._tuning(dict(phases=2), q, v)["phases"] == 2
    o, s = run_prefill(x)
    o1, s1 = run_prefill(x, tuning=dict(phases=1))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o1))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s1))


# ---------------------------------------------------------------------------------------------- decode

def decode_inputs(rng, n, pool, width=4, d=D):
    c = H * d
    return dict(
        qkv=jnp.asarray(rng.standard_normal((n, 3, c)), jnp.bfloat16),
        conv_w=jnp.asarray(rng.standard_normal((3, c, width)) / 2, jnp.float32),
        conv_pool=jnp.asarray(rng.standard_normal((pool, 3, width - 1, c)), jnp.bfloat16),
        s_pool=jnp.asarray(rng.standard_normal((pool, H, d, d)), jnp.float32),
        slots=jnp.asarray(rng.permutation(pool)[:n], jnp.int32),
        g=jnp.asarray(rng.standard_normal((n, H, d)) * 3, jnp.float32),
        beta=jnp.asarray(rng.random((n, H)), jnp.float32),
        gate=jnp.asarray(rng.standard_normal((n, H, d)), jnp.float32),
        norm_w=jnp.asarray(rng.random(d) + 0.5, jnp.float32))


# The whole-V default with the tails in place (at D = 32, and at K = V = 128 as in the model), the whole-V
# kernel with the tails scattered after it, and the value tiles (block_v 32 and 64 of V = 128: four and two
# tiles per head, whose last tile norms the row and writes the q/k tails, all in place); two of them launch
# the heads fastest; the split launches (prologue kernel, state kernel, XLA norm) whole-V and in tiles of 32.
STATE_RTOL = 1e-6  # kernel vs op, both fp32 on the same inputs: ~1e-7 measured in every case
DECODE_CASES = [(D, None), (128, None), (128, dict(tails_in_place=False, heads_fastest=True)), (128, dict(block_v=32)),
                (128, dict(block_v=64, num_warps=4, heads_fastest=True)), (128, dict(split=True)),
                (128, dict(split=True, block_v=32, heads_fastest=False))]


@pytest.mark.parametrize("d,tuning", DECODE_CASES,
                         ids=["d32-whole", "d128-whole", "d128-tails-scattered", "d128-bv32", "d128-bv64",
                              "d128-split", "d128-split-bv32"])
def test_decode_kernel_matches_op_and_reference(d, tuning):
    check_decode(d, tuning)


def check_decode(d, tuning):
    """kda_decode with `tuning` against the pure op (inactive rows' and unnamed slots' states and tails bit for
    bit) and float64 NumPy, one step of four rows, one inactive."""
    rng = np.random.default_rng(605)
    n, pool = 4, 7
    x = decode_inputs(rng, n, pool, d=d)
    lengths = jnp.asarray([1, 0, 1, 1], jnp.int32)
    kw = dict(eps=1e-5, lengths=lengths, a_log=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32), lower_bound=LB)
    o, conv, s = kda_decode(*x.values(), interpret=True, tuning=tuning, **kw)
    o_op, conv_op, s_op = decode_op(*x.values(), **kw)
    assert o.dtype == jnp.bfloat16 and conv.shape == x["conv_pool"].shape and s.shape == x["s_pool"].shape
    assert_close(o, o_op, BF16_RTOL, axis=-1, what="decode output vs op")
    assert_close(s, s_op, STATE_RTOL, axis=(-2, -1), what="decode state vs op")
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_op, np.float32))
    untouched = np.setdiff1d(np.arange(pool), np.asarray(x["slots"])[np.asarray(lengths) > 0])
    np.testing.assert_array_equal(np.asarray(s)[untouched], np.asarray(x["s_pool"])[untouched])
    np.testing.assert_array_equal(np.asarray(conv, np.float32)[untouched],
                                  np.asarray(x["conv_pool"], np.float32)[untouched])
    # float64 NumPy: conv + SiLU (rounded to bf16 as the layer does), prologue, one recurrence step, gated norm
    for i in np.flatnonzero(np.asarray(lengths)):
        slot = int(x["slots"][i])
        ys = []
        for j in range(3):
            y, _ = ref.causal_conv(np.asarray(x["qkv"][i, j:j + 1], np.float64)[None][0],
                                   np.asarray(x["conv_w"][j], np.float64)[:, None, :],
                                   np.asarray(x["conv_pool"][slot, j], np.float64))
            ys.append(bf16_round(ref.silu(y))[0].reshape(H, d))
        g = ref.kda_gate(np.asarray(x["g"][i], np.float64), np.asarray(kw["a_log"], np.float64), LB)
        qn = ref.l2_normalize(ys[0], ref.L2_EPS) * d ** -0.5
        kn = ref.l2_normalize(ys[1], ref.L2_EPS)
        o_ref, s_ref = ref.kda_recurrent(qn[None], kn[None], ys[2][None], g[None],
                                         np.asarray(x["beta"][i], np.float64)[None],
                                         np.asarray(x["s_pool"][slot], np.float64))
        o_ref = ref.rms_norm(o_ref[0], np.asarray(x["norm_w"], np.float64), 1e-5) * \
            ref.sigmoid(np.asarray(x["gate"][i], np.float64))
        assert_close(o[i], o_ref, BF16_RTOL, axis=-1, what=f"decode output {i} vs NumPy")
        assert_close(s[slot], s_ref, F32_RTOL, axis=(-2, -1), what=f"decode state {i} vs NumPy")


def test_decode_value_split_equals_whole_v_and_checks_block_v():
    """The value split against the whole-V kernel on the same call: the same per-column arithmetic, so
    states agree to fp32 rounding and outputs at bf16 level (the RMSNorm sums in another order); tails
    exactly. A block_v that is not a power of two dividing V is refused."""
    rng = np.random.default_rng(607)
    x = decode_inputs(rng, 3, 5, d=64)
    kw = dict(eps=1e-5, lengths=jnp.asarray([1, 1, 0], jnp.int32), lower_bound=LB,
              a_log=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32))
    o, conv, s = kda_decode(*x.values(), interpret=True, **kw)
    o2, conv2, s2 = kda_decode(*x.values(), interpret=True, tuning=dict(block_v=16), **kw)
    assert o2.dtype == o.dtype and s2.shape == s.shape
    assert_close(o2, o, BF16_RTOL, axis=-1, what="split vs whole-V output")
    assert_close(s2, s, STATE_RTOL, axis=(-2, -1), what="split vs whole-V state")
    np.testing.assert_array_equal(np.asarray(conv2, np.float32), np.asarray(conv, np.float32))
    for bad in (24, 128, 8):
        with pytest.raises(ValueError, match="block_v"):
            kda_decode(*x.values(), interpret=True, tuning=dict(block_v=bad), **kw)
    with pytest.raises(ValueError, match=r"value tiles \(block_v = 16\) always writes the tails in place"):
        kda_decode(*x.values(), interpret=True, tuning=dict(block_v=16, tails_in_place=False), **kw)
    with pytest.raises(ValueError, match="split=True always writes the tails in place"):
        kda_decode(*x.values(), interpret=True, tuning=dict(split=True, tails_in_place=False), **kw)


@pytest.mark.parametrize("block_v", [None, 16])
def test_decode_split_equals_fused_over_steps(block_v):
    check_over_steps(dict(split=True, block_v=block_v), np.random.default_rng(611))


def check_over_steps(tuning, rng):
    """kda_decode with `tuning` against the fused whole-V kernel (the one launch) over three steps on the same
    pools (each step's pools fed to the next, one row inactive in the second): states to fp32 rounding, tails
    exactly, outputs at bf16 level, and slots no row names untouched."""
    x = decode_inputs(rng, 3, 6, d=64)
    kw = dict(eps=1e-5, lower_bound=LB, a_log=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32))
    fused, other = dict(x), dict(x)
    for step, lens in enumerate(([1, 1, 1], [1, 0, 1], [1, 1, 1])):
        new = decode_inputs(rng, 3, 6, d=64)  # this step's token: fresh projections, gate, beta
        for name in ("qkv", "g", "beta", "gate"):
            fused[name] = other[name] = new[name]
        lengths = jnp.asarray(lens, jnp.int32)
        o, fused["conv_pool"], fused["s_pool"] = kda_decode(*fused.values(), interpret=True, lengths=lengths,
                                                            tuning=dict(split=False), **kw)
        o2, other["conv_pool"], other["s_pool"] = kda_decode(*other.values(), interpret=True, lengths=lengths,
                                                             tuning=tuning, **kw)
        assert_close(o2, o, BF16_RTOL, axis=-1, what=f"step {step} {tuning} vs fused output")
        assert_close(other["s_pool"], fused["s_pool"], STATE_RTOL, axis=(-2, -1), what=f"step {step} state")
        np.testing.assert_array_equal(np.asarray(other["conv_pool"], np.float32),
                                      np.asarray(fused["conv_pool"], np.float32))
    untouched = np.setdiff1d(np.arange(6), np.asarray(x["slots"]))
    np.testing.assert_array_equal(np.asarray(other["s_pool"])[untouched], np.asarray(x["s_pool"])[untouched])


def test_decode_default_splits_from_split_from(monkeypatch):
    """The default (split=None) takes the split launches from SPLIT_FROM sequences on, with the tails in
    place, and the one launch below that, when the tails are scattered or for an explicit block_v (the
    one-launch value tiles); explicit split wins either way."""
    from pallas_kernels.kda import decode as decode_mod
    calls = []
    real = decode_mod.decode_split
    monkeypatch.setattr(decode_mod, "decode_split", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(decode_mod, "SPLIT_FROM", 3)
    rng = np.random.default_rng(613)
    kw = dict(eps=1e-5, lower_bound=LB, a_log=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32))
    for n, tuning, want in ((2, None, []), (3, None, [3]), (3, dict(tails_in_place=False), []),
                            (2, dict(split=True), [2]), (3, dict(split=False), []), (3, dict(block_v=16), [])):
        calls.clear()
        x = decode_inputs(rng, n, 5, d=32)
        o, _, s = kda_decode(*x.values(), interpret=True, tuning=tuning, **kw)
        o_ref, _, s_ref = decode_op(*x.values(), **kw)
        assert calls == want, (n, tuning, calls)
        assert_close(o, o_ref, BF16_RTOL, axis=-1, what=f"N = {n}, {tuning}: output")
        assert_close(s, s_ref, STATE_RTOL, axis=(-2, -1), what=f"N = {n}, {tuning}: state")


# ------------------------------------------------------------------------------------------- the switch

def test_switch_falls_back_and_refuses():
    k = impl_mod.kernel("kda_prefill")
    assert k is not None and impl_mod.kernel("kda_decode") is not None
    with jax.enable_x64(True):
        x = [jnp.zeros((1, 3, H, D), jnp.float64)] * 4 + [jnp.zeros((1, 3, H), jnp.float64),
                                                          jnp.zeros((1, H, D, D), jnp.float64)]
        with pytest.raises(impl_mod.Unsupported, match="float64"):
            impl_mod.dispatch("kda_prefill", "pallas", prefill_op, *x)
        o, s = impl_mod.dispatch("kda_prefill", "auto", prefill_op, *x)  # CPU, float64: the pure op
        assert o.dtype == jnp.float64
    x = [jnp.zeros((1, 3, H, 24), jnp.bfloat16)] * 3 + [jnp.zeros((1, 3, H, 24)), jnp.zeros((1, 3, H)),
                                                        jnp.zeros((1, H, 24, 24))]
    with pytest.raises(impl_mod.Unsupported, match="power of two"):
        k.supports(*x)
    # a float32 model keeps fp32 math: the prefill kernel's matmuls take bf16 operands, so it refuses
    x = [jnp.zeros((1, 3, H, D), jnp.float32)] * 4 + [jnp.zeros((1, 3, H)), jnp.zeros((1, H, D, D))]
    with pytest.raises(impl_mod.Unsupported, match="q is float32; its matmuls take bfloat16"):
        k.supports(*x)
    # raw log decays with no declared bound: the kernel's exponents could overflow, so it refuses
    x = [jnp.zeros((1, 3, H, D), jnp.bfloat16)] * 3 + [jnp.zeros((1, 3, H, D)), jnp.zeros((1, 3, H)),
                                                       jnp.zeros((1, H, D, D))]
    with pytest.raises(impl_mod.Unsupported, match="needs lower_bound"):
        k.supports(*x)
    k.supports(*x, lower_bound=LB)


def test_model_selects_the_kernels_with_the_ops_arguments(tiny_ckpt, monkeypatch):
    """The tiny model (bfloat16, as released) run with its KDA ops through the kernels (interpret mode):
    every call the layer makes, prefill with right padding and decode steps, gives the kernel's result and the pure
    op's at bf16 level on outputs and states (conv tails exactly). Whole-model logits are not compared:
    bf16-level differences flip the tiny model's MoE routing. Only the KDA ops are switched (other ops'
    kernels have their own dtype rules): in the run with impl="auto" (CPU: every op falls back) the
    layer's KDA dispatch calls both."""
    from kimik3_jax.checkpoint.open import load_checkpoint
    from kimik3_jax.model import decode_step, init_state, layers, prefill

    errors = []

    def both(name, impl, reference, *args, **kwargs):
        want = impl_mod.dispatch(name, "xla", reference, *args, **kwargs)
        got = impl_mod.dispatch(name, "pallas", reference, *args, **kwargs)
        rel = [jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max() / jnp.abs(w.astype(jnp.float32)).max()
               for g, w in zip(got, want)]
        jax.debug.callback(lambda *e: errors.append((name, [float(x) for x in e])), *rel)
        return got
    monkeypatch.setattr(layers, "dispatch", both)
    cfg, params = load_checkpoint(tiny_ckpt)
    cfg = cfg.with_runtime(impl="auto")
    b, t = 2, 20
    tokens = np.random.default_rng(606).integers(0, cfg.vocab_size, size=(b, t)).astype(np.int32)
    state = init_state(cfg, b, 32, jnp.bfloat16)
    _, state = jax.jit(prefill, static_argnums=1)(params, cfg, tokens, np.array([20, 13], np.int32), state)
    for j in range(2):
        _, state = jax.jit(decode_step, static_argnums=1)(params, cfg, state, tokens[:, j])
    jax.effects_barrier()
    names = {n for n, _ in errors}
    assert names == {"kda_prefill", "kda_decode"}, names
    for name, errs in errors:
        assert max(errs) <= BF16_RTOL, (name, errs)
        if name == "kda_decode":
            assert errs[1] == 0.0, "conv tails must be copied exactly"


@pytest.mark.parametrize("search", ["compare_all", "scan"])
def test_chunk_table_maps_each_chunk_to_its_sequence(search):
    """The two-phase prefill's chunk table (its default search and jnp's loop, which the GPU probe times
    against it) against a NumPy walk over packed sequences of random lengths, empty ones included: each
    sequence's first chunk, and each chunk's first token, sequence end and tail start; the spare chunks
    past the last sequence start at or past its end (every row masked)."""
    from pallas_kernels.kda.prefill_two_phase import chunk_table
    rng = np.random.default_rng(17)
    chunk = 16
    for _ in range(5):
        lengths = rng.integers(0, 70, rng.integers(1, 7))
        lengths[rng.integers(0, lengths.size)] = 0
        cu = np.concatenate([[0], np.cumsum(lengths)])
        ends = cu[1:] - rng.integers(0, 5, lengths.size)
        nch = -(-lengths // chunk)
        n_chunks = int(nch.sum()) + 3
        choff, t0, eos, end = (np.asarray(a) for a in chunk_table(jnp.asarray(cu, jnp.int32),
                                                                  jnp.asarray(ends, jnp.int32), chunk, n_chunks,
                                                                  search=search))
        np.testing.assert_array_equal(choff, np.concatenate([[0], np.cumsum(nch)[:-1]]))
        want = [(cu[s] + c * chunk, cu[s + 1], ends[s]) for s in range(lengths.size) for c in range(nch[s])]
        np.testing.assert_array_equal(np.stack([t0, eos, end], 1)[:len(want)], np.asarray(want).reshape(-1, 3))
        assert (t0[len(want):] >= eos[len(want):]).all()
