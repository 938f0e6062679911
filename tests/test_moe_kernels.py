"""The MXFP4 grouped-GEMM kernels (pallas_kernels/moe) in Pallas interpret mode on the CPU, against the pure
op they replace (`kimik3_jax.ops.moe.routed_experts`: dequantise + einsum in fp32) and against
`mxfp4.dequantize` bit for bit. Shapes are small; both tile regimes (decode bm 16, prefill bm 128) run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from kimik3_jax import mxfp4
from kimik3_jax.checkpoint.open import expert_scale_max
from kimik3_jax.config import Runtime
from kimik3_jax.errors import ConfigError
from kimik3_jax.ops import impl
from kimik3_jax.ops.moe import latent_moe, routed_experts
from kimik3_jax.params import ExpertParams, init_params
from kimik3_jax.presets import preset
from pallas_kernels.moe import decode as dec
from pallas_kernels.moe import dispatch as dsp
from pallas_kernels.moe import routed as kern
from pallas_kernels.moe import kernels as kern_mod
from pallas_kernels.moe.kernels import TileConfig, Tiles, check_tiles, split_columns

E, F, L = 16, 128, 64  # experts, expert width, latent width
BETA, LINEAR_BETA = 4.0, 25.0
# bf16 activations: kernel and pure op round the same fp32 SiTU output to bf16, but their fp32 sums run in
# different orders, so an element of h can land one bf16 step (2^-8) apart; averaged over the down
# projection that stays far below 2^-8 of the row's scale.
RTOL = 2e-3
DECODE = TileConfig(16, Tiles(32, 32), Tiles(32, 64))
PREFILL = TileConfig(128, Tiles(64, 64), Tiles(32, 128))


def _decode_in_kernel(packed, scale, decode=dec.decode):
    def kernel(p_ref, s_ref, o_ref):
        o_ref[...] = decode(p_ref[...], s_ref[...])
    rows, half = packed.shape
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, 2 * half), jnp.bfloat16),
                          interpret=True)(packed, scale)


@pytest.mark.parametrize("decode", [dec.decode, dec.decode_fast], ids=["exact", "fast"])
def test_decode_is_bit_exact_for_every_byte_and_scale_1_to_254(decode):
    packed = np.tile(np.arange(256, dtype=np.uint8), (254, 1))  # every byte, i.e. every nibble pair
    scale = np.repeat(np.arange(1, 255, dtype=np.uint8)[:, None], 512 // 32, axis=1)  # row r: byte r + 1
    got = _decode_in_kernel(jnp.asarray(packed), jnp.asarray(scale), decode)
    want = mxfp4.dequantize(packed, scale, jnp.bfloat16)
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))
    np.testing.assert_array_equal(bits(got), bits(want))  # incl. -0.0, the subnormal 2^-127 and inf
    assert np.isinf(np.asarray(want, np.float32)).any()  # bytes 253/254 do overflow


def test_fast_decode_needs_no_subnormal_arithmetic():
    """Interpret mode runs on XLA CPU, which flushes subnormal inputs and results of float arithmetic
    (the premise of `decode_fast`'s design): so the test above also covers a flushing GPU."""
    tiny = jax.lax.bitcast_convert_type(jnp.uint32(0x00400000), jnp.float32)  # 2^-127
    one = jnp.float32(1.0)  # an argument, so that XLA cannot drop the multiply
    assert float(jax.jit(lambda a, b: a * b)(tiny, one)) == 0.0  # an input flushed
    half, normal = jnp.float32(0.5), jax.lax.bitcast_convert_type(jnp.uint32(0x00800000), jnp.float32)
    assert float(jax.jit(lambda a, b: a * b)(half, normal)) == 0.0  # 0.5 x 2^-126: the result flushed


@pytest.mark.parametrize("decode", [dec.decode, dec.decode_fast], ids=["exact", "fast"])
def test_decode_of_scale_byte_0_zero_groups(decode):
    packed = np.array([[0x00, 0x88, 0x80, 0x08] * 8], np.uint8)  # +-0 only, as an all-zero group stores
    got = _decode_in_kernel(jnp.asarray(packed), jnp.zeros((1, 2), jnp.uint8), decode)
    want = mxfp4.dequantize(packed, np.zeros((1, 2), np.uint8), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16)),
                                  np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint16)))


def _experts(rng, lo=122, hi=128, num=E):
    """Random packed nibbles, scale bytes uniform in [lo, hi] (w1/w3 [num, F, L], w2 [num, L, F])."""
    out = {}
    for name, (rows, cols) in (("w1", (F, L)), ("w3", (F, L)), ("w2", (L, F))):
        out[name + "_packed"] = jnp.asarray(rng.integers(0, 256, (num, rows, cols // 2)), jnp.uint8)
        out[name + "_scale"] = jnp.asarray(rng.integers(lo, hi + 1, (num, rows, cols // 32)), jnp.uint8)
    return ExpertParams(**out)


def _routing(rng, n, k, kind):
    if kind == "random":  # uneven groups, usually some experts empty
        idx = np.stack([rng.permutation(E)[:k] for _ in range(n)])
    elif kind == "one_expert":  # every token on the same k experts: the others are empty
        idx = np.tile(np.arange(3, 3 + k), (n, 1))
    elif kind == "skewed":  # half the tokens on experts 0..k-1, the rest random
        idx = np.stack([np.arange(k) if t % 2 else rng.permutation(E)[:k] for t in range(n)])
    return jnp.asarray(idx, jnp.int32), jnp.asarray(rng.uniform(0.05, 1.0, (n, k)), jnp.float32)


def _check(xl, idx, w, experts, config, interpret=True, decode=kern.DEFAULT_DECODE):
    got = kern.routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, config=config, interpret=interpret,
                              decode=decode)
    want = routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, "gathered")
    assert got.dtype == jnp.float32 and got.shape == want.shape
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(want).all()
    scale = np.abs(want).max(axis=-1, keepdims=True)
    err = float(np.max(np.abs(got - want) / np.where(scale > 0, scale, 1)))
    assert err <= RTOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("config", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("n,k,kind", [(1, 4, "random"), (40, 4, "skewed"), (33, 1, "one_expert"),
                                      (24, 4, "one_expert"), (150, 4, "random")])
def test_kernel_equals_pure_op(config, n, k, kind):
    rng = np.random.default_rng([n, k, len(kind)])
    experts = _experts(rng)
    idx, w = _routing(rng, n, k, kind)
    xl = jnp.asarray(rng.standard_normal((n, L)), jnp.bfloat16)
    _check(xl, idx, w, experts, config)


# The MMA shapings of `Tiles` (swap: weights as the left operand; split: even/odd halves, no interleave)
# and the tiles-first launch order (with the uneven routing only), each in both regimes: the same op, so
# the same tolerance against the pure op. None is a default: the default suite runs each with the uneven
# routing, and the other routings and tiles-first are marked slow.
VARIANTS = {f"{regime}-{name}": TileConfig(bm, *(Tiles(32, 64, swap=swap, split=split, n_first=n_first),) * 2)
            for regime, bm in (("decode", 16), ("prefill", 128))
            for name, swap, split, n_first in (("swap", True, False, True), ("split", False, True, True),
                                               ("swap-split", True, True, True), ("tiles-first", False, False, False))}
VARIANT_CASES = [pytest.param(c, n, k, kind, id=f"{n}-{k}-{kind}-{name}",
                              marks=[pytest.mark.slow] if name.endswith("tiles-first") or kind != "skewed" else [])
                 for name, c in VARIANTS.items()
                 for n, k, kind in [(40, 4, "skewed"), (33, 1, "one_expert"), (1, 4, "random")]
                 if not name.endswith("tiles-first") or kind == "skewed"]


@pytest.mark.parametrize("config,n,k,kind", VARIANT_CASES)
def test_mma_variants_equal_pure_op(config, n, k, kind):
    rng = np.random.default_rng([n, k, len(kind), 9])
    experts = _experts(rng)
    idx, w = _routing(rng, n, k, kind)
    xl = jnp.asarray(rng.standard_normal((n, L)), jnp.bfloat16)
    _check(xl, idx, w, experts, config)


def test_split_needs_whole_scale_groups_per_half():
    with pytest.raises(ValueError, match="bk=32 must be a multiple of 64 \\(split"):
        check_tiles("down", 64, 128, Tiles(32, 32, split=True))
    assert kern.fit(TileConfig(16, Tiles(32, 128, split=True), Tiles(32, 64, split=True)), 64, 128).gate_up.bk == 64


def test_unknown_decode_is_named():
    rng = np.random.default_rng(1)
    idx, w = _routing(rng, 2, 4, "random")
    with pytest.raises(ValueError, match="gate_up: decode='fastest' is not one of"):
        kern.routed_experts(jnp.zeros((2, L), jnp.bfloat16), idx, w, _experts(rng), BETA, LINEAR_BETA,
                            config=DECODE, interpret=True, decode="fastest")


def test_split_columns_puts_each_blocks_even_columns_first():
    a = jnp.arange(2 * 256).reshape(2, 256)
    got = np.asarray(split_columns(a, 128))
    want = np.concatenate([np.asarray(a)[:, b:b + 128][:, order] for b in (0, 128) for order in
                           (slice(0, None, 2), slice(1, None, 2))], axis=1)
    np.testing.assert_array_equal(got, want)


def test_scale_bytes_across_1_to_254():
    """w1/w3 scale bytes over all of 1..254 (groups with bytes >= 240 keep magnitudes <= 0.5 so that the
    weights stay finite) and tiny activations so fp32 sums cannot overflow; SiTU saturates the huge gate
    and up values, and w2 spans bytes 1..230."""
    rng = np.random.default_rng(7)
    ex = _experts(rng, 1, 254)
    fix = {}
    for name in ("w1", "w3"):
        p, s = np.asarray(getattr(ex, name + "_packed")), np.asarray(getattr(ex, name + "_scale"))
        big = np.repeat(s >= 240, 16, axis=-1)  # per packed byte
        fix[name + "_packed"] = jnp.asarray(np.where(big, p & 0x99, p), jnp.uint8)  # em in {0, 1}
    fix["w2_scale"] = jnp.asarray(rng.integers(1, 231, ex.w2_scale.shape), jnp.uint8)
    ex = ex.replace(**fix)
    idx, w = _routing(rng, 20, 4, "random")
    xl = jnp.asarray(rng.standard_normal((20, L)) * 2.0 ** -12, jnp.bfloat16)
    _check(xl, idx, w, ex, DECODE)


def _wide_scale_experts(rng):
    """Experts with scale bytes across 1..254 that keep every weight and fp32 sum finite (see below)."""
    ex = _experts(rng, 1, 254)
    fix = {}
    for name in ("w1", "w3"):
        p, s = np.asarray(getattr(ex, name + "_packed")), np.asarray(getattr(ex, name + "_scale"))
        fix[name + "_packed"] = jnp.asarray(np.where(np.repeat(s >= 240, 16, axis=-1), p & 0x99, p), jnp.uint8)
    fix["w2_scale"] = jnp.asarray(rng.integers(1, 231, ex.w2_scale.shape), jnp.uint8)
    return ex.replace(**fix)


def _mixed_scale_experts(rng):
    """The wide-scale experts with every even expert's scale bytes capped at the quick decoder's bound: the
    programs of even experts may take "asm1"'s quick path, those of odd experts must not."""
    ex = _wide_scale_experts(rng)
    even = (np.arange(E) % 2 == 0)[:, None, None]
    return ex.replace(**{name: jnp.asarray(np.where(even, np.minimum(np.asarray(getattr(ex, name)), dec.QUICK_MAX_SCALE),
                                                    np.asarray(getattr(ex, name))), jnp.uint8)
                         for name in ("w1_scale", "w3_scale", "w2_scale")})


@pytest.mark.parametrize("config,n,k,kind,scales,decode", [(DECODE, 40, 4, "skewed", "wide", "fast"),
                                                           (DECODE, 33, 1, "one_expert", "narrow", "fast"),
                                                           (PREFILL, 24, 4, "random", "wide", "fast"),
                                                           (DECODE, 40, 4, "skewed", "mixed", "fast1"),
                                                           (DECODE, 40, 4, "skewed", "narrow", "asm1-unchecked"),
                                                           (PREFILL, 24, 4, "random", "narrow", "asm1-unchecked")],
                         ids=["decode-uneven-wide", "decode-one-expert", "prefill-wide", "decode-mixed-fast1",
                              "decode-unchecked", "prefill-unchecked"])
def test_fast_decode_kernels_equal_exact_bitwise(config, n, k, kind, scales, decode):
    """decode="fast", and "fast1" (the interpreter's "asm1": its quick decoder, wrong past scale byte 128,
    serves only the programs whose scale bytes all allow it), against decode="exact": interpreted, the same
    weights reach the same dots, so every output bit agrees (uneven and empty groups, all tokens on one
    expert, scale bytes 1..254; "mixed": experts with and without a scale byte past 128). "asm1-unchecked" (the
    quick decoder in every program, interpreted as "fast1-unchecked") on scale bytes 122..128, where it is exact."""
    rng = np.random.default_rng([n, k, 3])
    experts = {"wide": _wide_scale_experts, "narrow": _experts, "mixed": _mixed_scale_experts}[scales](rng)
    idx, w = _routing(rng, n, k, kind)
    xl = jnp.asarray(rng.standard_normal((n, L)) * (1.0 if scales == "narrow" else 2.0 ** -12), jnp.bfloat16)
    run = lambda d: np.asarray(kern.routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, config=config,
                                                   interpret=True, decode=d))
    exact, fast = run("exact"), run(decode)
    assert np.isfinite(exact).all() and np.abs(exact).max() > 0
    np.testing.assert_array_equal(fast.view(np.uint32), exact.view(np.uint32))


def test_gpu_only_decode_has_a_bit_identical_stand_in():
    """decode="asm" and "asm1" (PTX, "asm1" the default) compile for the GPU only: the interpreter, and tiles
    whose threads would hold fewer than 4 packed bytes each, run "fast" and "fast1" (the same bits, including
    asm1's quick decoder's wrong values past its bound; the GPU tests check the asm)."""
    big, small = Tiles(64, 256), Tiles(16, 32)
    assert kern_mod._decoders("gate_up", "asm", big, interpret=False) == dec.DECODERS["asm"]
    assert kern_mod._decoders("gate_up", "asm", big, interpret=True) == dec.DECODERS["fast"]
    assert kern_mod._decoders("down", "asm", small, interpret=False) == dec.DECODERS["fast"]
    assert kern_mod._decoders("gate_up", "asm1", big, interpret=False) == dec.DECODERS["asm1"]
    assert kern_mod._decoders("gate_up", "asm1", big, interpret=True) == dec.DECODERS["fast1"]
    assert kern_mod._decoders("down", "exact", small, interpret=True) == dec.DECODERS["exact"]
    assert kern_mod._decoders("down", "asm1-unchecked", big, interpret=True) == dec.DECODERS["fast1-unchecked"]
    assert kern_mod._decoders("down", "asm1r-unchecked", big, interpret=True) == dec.DECODERS["fast1r-unchecked"]
    assert kern_mod._decoders("down", "asm1r-unchecked", big, interpret=False) == dec.DECODERS["asm1r-unchecked"]
    with pytest.raises(ValueError, match="down: decode='fast1r-unchecked' has no halves for split tiles"):
        kern_mod._decoders("down", "asm1r-unchecked", Tiles(64, 256, split=True), interpret=True)
    assert dec.DECODERS["fast1-unchecked"].full is dec.DECODERS["fast1"].quick.full
    assert kern_mod.DEFAULT_DECODE == "asm1"
    scale = jnp.asarray([[120, 128, 129, 254]], jnp.uint8)
    packed = jnp.full((1, 64), 0x77, jnp.uint8)  # +-6 everywhere: wrong past 128 in the quick stand-in only
    quick = np.asarray(dec.DECODERS["fast1"].quick.full(packed, scale), np.float32).reshape(4, 32)
    want = np.asarray(dec.decode(packed, scale), np.float32).reshape(4, 32)
    np.testing.assert_array_equal(quick[:2], want[:2])
    assert not (quick[2:] == want[2:]).any()


def test_out_of_range_expert_ids_are_skipped():
    """Expert parallelism passes pairs owned elsewhere as id E with weight 0: they contribute nothing."""
    rng = np.random.default_rng(11)
    experts = _experts(rng)
    idx, w = _routing(rng, 12, 4, "random")
    drop = rng.uniform(size=idx.shape) < 0.4
    idx2, w2 = jnp.where(drop, E, idx), jnp.where(drop, 0.0, w)
    xl = jnp.asarray(rng.standard_normal((12, L)), jnp.bfloat16)
    got = kern.routed_experts(xl, idx2, w2, experts, BETA, LINEAR_BETA, config=DECODE, interpret=True)
    want = kern.routed_experts(xl, jnp.where(drop, 0, idx), w2, experts, BETA, LINEAR_BETA, config=DECODE,
                               interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("n,k,kind,bm", [(1, 4, "random", 16), (40, 4, "skewed", 16), (37, 4, "one_expert", 8),
                                         (64, 4, "random", 128)])
def test_block_layout(n, k, kind, bm):
    rng = np.random.default_rng(n)
    idx, w = _routing(rng, n, k, kind)
    lay = dsp.block_layout(idx, w, E, bm)
    te, tok, sw, slot = (np.asarray(a) for a in lay[:4])
    assert len(te) == dsp.num_tiles(n * k, E, bm) and len(tok) == len(te) * bm
    flat = np.asarray(idx).reshape(-1)
    assert len(set(slot.tolist())) == n * k  # one slot per pair
    np.testing.assert_array_equal(te[slot // bm], flat)  # each pair sits in a tile of its expert
    np.testing.assert_array_equal(tok[slot], np.arange(n * k) // k)
    np.testing.assert_array_equal(sw[slot], np.asarray(w).reshape(-1))
    free = np.setdiff1d(np.arange(len(tok)), slot)
    assert (sw[free] == 0).all() and (tok[free] == 0).all()
    used = te < E
    assert used.sum() == sum(-(-np.sum(flat == e) // bm) for e in range(E))
    assert (np.diff(te) >= 0).all() and not used[used.sum():].any()  # sorted by expert, unused tiles last
    filled = np.bincount(slot // bm, minlength=len(te))  # each tile's pairs, which are its first slots
    np.testing.assert_array_equal(np.asarray(lay.tile_used), filled)
    assert (slot % bm < filled[slot // bm]).all()


def test_num_tiles_bound_is_tight_for_a_token_per_expert():
    # 16 pairs on 16 distinct experts need 16 tiles of 16 rows: the bound gives exactly that
    assert dsp.num_tiles(16, 896, 16) == 16
    assert dsp.num_tiles(16 * 16384, 896, 128) == (16 * 16384 + 896 * 127) // 128


def bf16_moe_layer(cfg=None, batch: int = 2, length: int = 9):
    """The first MoE layer of `cfg` (default the tiny preset) in the production dtypes (bf16 weights, fp32
    router bias) and a bf16 input [batch, length, D]: (cfg, layer, x)."""
    cfg = cfg or preset("tiny")
    layer = jax.tree_util.tree_map(lambda a: a[0], init_params(cfg, 3, text_only=True).text.moe)
    layer = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, layer)
    layer = layer.replace(router_bias=layer.router_bias.astype(jnp.float32))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((batch, length, cfg.hidden_size)), jnp.bfloat16)
    return cfg, layer, x


@pytest.mark.parametrize("scale_max", [None, "true"], ids=["unknown-scales", "known-scales"])
def test_latent_moe_through_the_switch(scale_max, monkeypatch):
    """cfg.runtime.impl="pallas" runs the kernel (interpret mode here) in the whole latent MoE layer, with
    the experts' largest scale byte unknown or known (`Runtime.expert_scale_max`: the kernels' decode
    choice, the same result)."""
    cfg, layer, x = bf16_moe_layer()
    if scale_max == "true":
        scale_max = expert_scale_max(layer.experts)
        assert scale_max <= dec.QUICK_MAX_SCALE  # so the kernels run asm1-unchecked's stand-in
    cfg = cfg.with_runtime(expert_scale_max=scale_max)
    asked = []  # the decoders the kernels ask for
    real = kern_mod._decoders
    monkeypatch.setattr(kern_mod, "_decoders", lambda what, name, *a, **kw: (asked.append(name), real(what, name, *a, **kw))[1])
    ref = latent_moe(x, layer, cfg.with_runtime(impl="xla"))
    got = latent_moe(x, layer, cfg.with_runtime(impl="pallas"))
    assert set(asked) == {"asm1" if scale_max is None else "asm1r-unchecked"}
    assert got.dtype == ref.dtype == jnp.bfloat16
    err = np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32)).max()
    assert err <= 1e-2 * np.abs(np.asarray(ref, np.float32)).max()


def test_known_scale_bytes_pick_the_unchecked_quick_decode():
    assert kern.decoder_for("asm1", 128) == "asm1r-unchecked"
    assert kern.decoder_for("asm1", 129) == "asm1"
    assert kern.decoder_for("asm1", None) == "asm1"
    assert kern.decoder_for("exact", 120) == "exact" and kern.decoder_for("asm", 120) == "asm"
    assert kern.decoder_for("fast1", 128) == "fast1-unchecked"
    assert kern.decoder_for("asm1", 128, VARIANTS["decode-split"]) == "asm1-unchecked"  # asm1r has no halves
    assert kern.decoder_for("asm1", 128, VARIANTS["decode-swap"]) == "asm1r-unchecked"
    assert kern.decoder_for("asm1", 129, VARIANTS["decode-split"]) == "asm1"
    assert dec.DECODERS["asm1-unchecked"] is dec.DECODERS["asm1"].quick
    with pytest.raises(ConfigError, match="expert_scale_max"):
        Runtime(expert_scale_max=256)
    with pytest.raises(ConfigError, match="expert_scale_max"):
        Runtime(expert_scale_max=True)


def test_unsupported_calls_are_refused():
    rng = np.random.default_rng(1)
    experts = _experts(rng)
    idx, w = _routing(rng, 2, 4, "random")
    xl = jnp.zeros((2, L), jnp.float32)
    with pytest.raises(impl.Unsupported, match="bfloat16"):
        kern.supports(xl, idx, w, experts, BETA, LINEAR_BETA)
    dense = type("Dense", (), {"w1": 0, "w3": 0, "w2": 0})()
    with pytest.raises(impl.Unsupported, match="packed MXFP4"):
        kern.supports(xl.astype(jnp.bfloat16), idx, w, dense, BETA, LINEAR_BETA)
    with pytest.raises(impl.Unsupported):
        impl.dispatch("routed_experts", "pallas", routed_experts, xl, idx, w, experts, BETA, LINEAR_BETA)


@pytest.mark.parametrize("config", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_permuted_decode_equals_pure_op(config):
    """asm1r-unchecked (the model's decode on weights whose scale bytes are all <= 128; interpreted as
    fast1r-unchecked, the same R_PERM order) decodes each 8 weights out of order: gate+up takes x's columns
    in that order and computes h's columns from its weight rows in that order, so down reads h as written and
    the op is unchanged."""
    rng = np.random.default_rng(11)
    experts = _experts(rng)
    idx, w = _routing(rng, 40, 4, "skewed")
    xl = jnp.asarray(rng.standard_normal((40, L)), jnp.bfloat16)
    _check(xl, idx, w, experts, config, decode="asm1r-unchecked")


def test_permuted_rows_follow_permute8():
    rows = np.asarray(kern_mod._permuted_rows(64, 32, dec.R_PERM))
    np.testing.assert_array_equal(rows, 64 + np.asarray(dec.permute8(jnp.arange(32), dec.R_PERM)))


def test_split_tiles_with_known_scale_bytes_take_a_decoder_with_halves():
    """Known scale bytes <= 128 pick asm1r-unchecked, which has no halves: split tiles take asm1-unchecked
    (interpreted as fast1-unchecked) instead, and the op is unchanged."""
    rng = np.random.default_rng(12)
    experts = _experts(rng)
    idx, w = _routing(rng, 20, 4, "skewed")
    xl = jnp.asarray(rng.standard_normal((20, L)), jnp.bfloat16)
    scale_max = int(expert_scale_max(experts))
    assert kern.decoder_for("asm1", scale_max) == "asm1r-unchecked"
    got = kern.routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, config=VARIANTS["decode-split"],
                              interpret=True, scale_max=scale_max)
    want = kern.routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, config=VARIANTS["decode-split"],
                               interpret=True, decode="fast1-unchecked")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
