"""The experimental Mosaic GPU MXFP4 GEMM (`pallas_kernels/moe/wgmma_mxfp4.py`) on the CPU: its warp-specialised
pipeline has no interpreter rule, so what runs here is its arithmetic as plain JAX (the e2m1 decode and the
E8M0 factor, exactly, for every nibble and scale byte; the even/odd K planes against the dequantised weights),
and its lowering for CUDA (layouts, transfer plans and shared memory are settled at lowering). The kernel
itself runs only on the GPU: tests/gpu/probe_mgpu_mxfp4.py."""
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from kimik3_jax.mxfp4 import E2M1_VALUES, dequantize_np
from kimik3_jax.ops.moe import routed_experts
from kimik3_jax.params import ExpertParams
from pallas_kernels.moe import routed_mgpu as rm
from pallas_kernels.moe import wgmma_mxfp4 as wg


def _bf16(bits):
    """int16 bit patterns -> their bf16 values as float64 (NumPy: no flushing of subnormals)."""
    return np.asarray(bits, np.int16).view(ml_dtypes.bfloat16).astype(np.float64)


def test_decode_bits_are_exact_for_every_nibble_and_scale_byte():
    """The integer half of the decode, run by XLA as the kernel's ops: every nibble's bits are its e2m1
    value times 2^-126 (+-0.5 a bf16 subnormal), every scale byte 0..254 gives 2^(s - 127) and 255 NaN, as
    `kimik3_jax.mxfp4.dequantize`; the kernel's two
    multiplies by powers of two are then exact (in float64 here: XLA's CPU backend flushes bf16
    subnormals, the GPU does not)."""
    nib = jnp.arange(16, dtype=jnp.int16)
    got = _bf16(jax.jit(wg.e2m1_bits)(nib)) * 2.0 ** 126
    np.testing.assert_array_equal(got, E2M1_VALUES.astype(np.float64))
    assert np.signbit(got[8]) and not np.signbit(got[0])  # -0 and +0 as the release's nibbles 8 and 0
    s = jnp.arange(0, 255, dtype=jnp.int16)
    np.testing.assert_array_equal(_bf16(jax.jit(wg.scale_bits)(s)), 2.0 ** (np.arange(0, 255) - 127.0))
    assert np.isnan(_bf16(wg.scale_bits(jnp.int16(255))))


def test_quick_decode_is_exact_up_to_its_largest_scale_byte():
    """The one-multiply decode: every nibble's bits times the quick factor of every scale byte 0..QUICK_MAX
    is the e2m1 value times 2^(s - 127) (each product a bf16, subnormals included: float64 here, as the
    GPU's bf16 multiply keeps them); the byte above QUICK_MAX leaves bf16's finite range."""
    values = _bf16(wg.e2m1_bits(jnp.arange(16, dtype=jnp.int16)))
    s = np.arange(0, wg.QUICK_MAX + 1)
    factor = _bf16(jax.jit(wg.quick_scale_bits)(jnp.asarray(s, jnp.int16)))
    got = values[None, :] * factor[:, None]
    np.testing.assert_array_equal(got, E2M1_VALUES[None, :].astype(np.float64) * 2.0 ** (s[:, None] - 127.0))
    bf16 = got.astype(ml_dtypes.bfloat16).astype(np.float64)  # each product is a bf16 value: no rounding
    np.testing.assert_array_equal(bf16, got)
    assert not np.isfinite(_bf16(wg.quick_scale_bits(jnp.int16(wg.QUICK_MAX + 1))))


def test_swar_planes_equal_the_per_lane_bits_for_every_byte_pair():
    """The kernel's two-values-per-word decode (`spread_pair`, `pair_planes`: the formulas `_swar_planes`
    emits for each register of two bytes) against `e2m1_bits` of each nibble, for all 65536 byte pairs: no
    bit crosses from one 16-bit half into the other."""
    b = np.arange(65536, dtype=np.uint32)
    lo, hi = wg.pair_planes(wg.spread_pair(b))  # b = b0 | b1 << 8, as the register's bytes in memory order
    lanes = lambda w: np.stack([w & 0xFFFF, w >> 16], axis=-1).astype(np.uint16)  # noqa: E731
    bytes_ = np.stack([b & 0xFF, b >> 8], axis=-1).astype(np.int16)
    want = [np.asarray(jax.jit(wg.e2m1_bits)(jnp.asarray(nib))).astype(np.uint16)
            for nib in (bytes_ & 0xF, (bytes_ >> 4) & 0xF)]
    np.testing.assert_array_equal(lanes(lo), want[0])
    np.testing.assert_array_equal(lanes(hi), want[1])


def test_planes_times_decoded_nibbles_equal_the_dequantised_product():
    """The kernel's algebra: low nibbles against x's even columns, high against the odd ones, scale block b
    covering plane columns 16b..16b+15; against the dequantised weights times x."""
    rng = np.random.default_rng(5)
    n, k, t = 48, 256, 24
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.integers(1, 200, (n, k // 32), dtype=np.uint8)
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    planes = wg.x_planes(x)
    assert planes.shape == (2, k // 2, t)
    np.testing.assert_array_equal(np.asarray(planes[1]), np.asarray(x)[:, 1::2].T)
    p16 = jnp.asarray(packed, jnp.int16)
    factor = np.repeat(_bf16(wg.scale_bits(jnp.asarray(scales, jnp.int16))), wg.PLANE_STEP, axis=1)  # [n, k/2]
    lo, hi = (_bf16(wg.e2m1_bits(p)) * 2.0 ** 126 * factor for p in (p16 & 0xF, (p16 >> 4) & 0xF))
    got = lo @ np.asarray(planes[0], np.float64) + hi @ np.asarray(planes[1], np.float64)
    want = dequantize_np(packed, scales, np.float64) @ np.asarray(x, np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("tuning", [{}, {"tile_t": 256, "stages": 2}, {"plane_cols": 32, "stages": 6},
                                    {"tile_t": 256, "stages": 3, "delay": 1},
                                    {"delay": 1, "persistent": True, "sms": 132},
                                    {"x_tk": True, "plane_rows": True}, {"transpose_out": True, "row_blocks": 2},
                                    {"x_tk": True, "plane_rows": True, "transpose_out": True, "row_blocks": 2,
                                     "delay": 1, "persistent": True, "sms": 132, "stages": 3},
                                    {"quick": True, "row_blocks": 2}, {"swar": True},
                                    {"swar": True, "quick": True, "x_tk": True, "plane_rows": True, "row_blocks": 2},
                                    {"words": True, "quick": True, "x_tk": True, "plane_rows": True, "delay": 1,
                                     "persistent": True, "sms": 132, "stages": 3},
                                    {"words": True, "quick": True, "plane_cols": 128, "tile_t": 16},
                                    {"words": True, "quick": True, "tile_t": 16, "wgs": 3, "x_tk": True,
                                     "plane_rows": True},
                                    # narrow (off by default, routed_mgpu.TUNING): 67 s of lowering, in the slow pass
                                    *(pytest.param(t, marks=pytest.mark.slow) for t in (
                                        {"narrow": 16, "tile_t": 160, "x_tk": True, "plane_rows": True,
                                         "quick": True, "swar": True, "delay": 1, "persistent": True, "sms": 132,
                                         "stages": 3},
                                        {"narrow": 16, "tile_t": 160, "words": True, "quick": True, "x_tk": True,
                                         "plane_rows": True, "delay": 1, "persistent": True, "sms": 132,
                                         "stages": 3},
                                        {"narrow": 16, "tile_t": 64, "transpose_out": True, "row_blocks": 2}))])
def test_kernel_lowers_for_cuda(tuning):
    """Each layout option (token-major planes, plane-ordered rows, transposed output, 2 row blocks a tile, the
    words decode, 3 compute warpgroups, tiles narrowed to their used slots) and tuning lowers for CUDA."""
    n, k, t = 768 if tuning.get("wgs") == 3 else 512, 512, 2 * tuning.get("tile_t", 128)
    if tuning.get("narrow"):  # a full tile and one of 37 used slots
        tuning = dict(tuning, tile_used=jnp.asarray([tuning["tile_t"], 37], jnp.int32))
    x = (1, k) if tuning.get("words") else (2, k // 2)
    planes = (x[0], t, x[1]) if tuning.get("x_tk") else (*x, t)
    args = (jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((k // 32, n), jnp.uint8),
            jax.ShapeDtypeStruct(planes, jnp.bfloat16))
    hlo = lower_for_cuda(functools.partial(wg.mxfp4_matmul, **tuning), *args)
    assert "mosaic_gpu" in hlo


def test_token_words_are_the_columns_in_word_order():
    """`token_words` (a gather by a constant index) puts x's columns in `word_order`, a permutation of each 64."""
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    order = wg.word_order(256)
    assert sorted(order) == list(range(256)) and all(sorted(order[i:i + 64] - i) == list(range(64))
                                                      for i in range(0, 256, 64))
    np.testing.assert_array_equal(np.asarray(wg.token_words(jnp.asarray(x)))[0], x[:, order])


def test_bad_shapes_are_refused_by_name():
    packed = jnp.zeros((256, 256), jnp.uint8)
    with pytest.raises(ValueError, match="N = 200"):
        wg.mxfp4_matmul(jnp.zeros((200, 256), jnp.uint8), jnp.zeros((16, 200), jnp.uint8),
                        jnp.zeros((2, 256, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="scales_t"):
        wg.mxfp4_matmul(packed, jnp.zeros((256, 16), jnp.uint8), jnp.zeros((2, 256, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="delay = 1 must be 0 or 1 and below stages = 1"):
        wg.mxfp4_matmul(packed, jnp.zeros((16, 256), jnp.uint8), jnp.zeros((2, 256, 128), jnp.bfloat16), stages=1,
                        delay=1)
    with pytest.raises(ValueError, match="tile_t"):
        wg.mxfp4_matmul(packed, jnp.zeros((16, 256), jnp.uint8), jnp.zeros((2, 256, 100), jnp.bfloat16))
    with pytest.raises(ValueError, match="N = 256 \\(multiple of 512\\)"):  # 2 row blocks of plane-ordered rows
        wg.mxfp4_matmul(packed, jnp.zeros((16, 256), jnp.uint8), jnp.zeros((2, 128, 256), jnp.bfloat16), x_tk=True,
                        plane_rows=True, row_blocks=2)
    with pytest.raises(ValueError, match="wgs = 4 compute warpgroups"):
        wg.mxfp4_matmul(jnp.zeros((512, 256), jnp.uint8), jnp.zeros((16, 512), jnp.uint8),
                        jnp.zeros((2, 256, 256), jnp.bfloat16), wgs=4)
    with pytest.raises(ValueError, match="words needs quick"):
        wg.mxfp4_matmul(packed, jnp.zeros((16, 256), jnp.uint8), jnp.zeros((1, 512, 256), jnp.bfloat16), words=True)
    with pytest.raises(ValueError, match="do not match \\(1, 512, 256\\)"):  # planes given to the words decode
        wg.mxfp4_matmul(packed, jnp.zeros((16, 256), jnp.uint8), jnp.zeros((2, 256, 256), jnp.bfloat16), words=True,
                        quick=True)
    for narrow, used in ((8, (128, 5)), (16, None), (16, (128,))):  # not a multiple of 16; no or short tile_used
        with pytest.raises(ValueError, match=f"narrow = {narrow} must be a multiple of 16 dividing tile_t = 128"):
            wg.mxfp4_matmul(packed, jnp.zeros((16, 256), jnp.uint8), jnp.zeros((2, 256, 256), jnp.bfloat16),
                            narrow=narrow, tile_used=None if used is None else jnp.asarray(used, jnp.int32))


# ------------------------------------------------------------------- the routed experts on Mosaic GPU

def _expert_shapes(num, width, latent):
    """Each ExpertParams field's shape: w1/w3 [num, width, latent], w2 [num, latent, width], packed and scales."""
    mats = (("w1", (width, latent)), ("w3", (width, latent)), ("w2", (latent, width)))
    return {f"{m}_{part}": (num, rows, cols // per) for m, (rows, cols) in mats
            for part, per in (("packed", 2), ("scale", 32))}


def _routed_case(rng, n, k, kind, num=16, width=128, latent=64):
    from test_moe_kernels import _routing
    bounds = {"packed": (0, 256), "scale": (118, 126)}  # scale bytes near the release's
    experts = {name: jnp.asarray(rng.integers(*bounds[name.split("_")[1]], shape), jnp.uint8)
               for name, shape in _expert_shapes(num, width, latent).items()}
    idx, w = _routing(rng, n, k, kind)
    return jnp.asarray(rng.standard_normal((n, latent)), jnp.bfloat16), idx, w, ExpertParams(**experts)


@pytest.mark.parametrize("n,k,kind,tuning", [(40, 4, "skewed", dict(tile_t=16)), (33, 1, "one_expert", dict(tile_t=16)),
                                             (150, 4, "random", dict(tile_t=16)), (150, 4, "random", None),
                                             (40, 4, "skewed", dict(tile_t=16, words=True)),
                                             (40, 4, "skewed", dict(tile_t=32, narrow=16)),
                                             (150, 4, "random", dict(narrow=16, words=True))])
def test_routed_glue_equals_pure_op(n, k, kind, tuning):
    """The Mosaic GPU path's glue (dispatch, planes, h^T to down's planes, y^T to the weighted combine) with
    the kernel's pure-JAX reference in its place, against the pure op; fails if any plane or transpose is
    off (checked by swapping h's planes). Tuning None: the tiles sized by `tile_slots`; words: gate+up's
    activations as token words (with the scale bytes' bound given: the words decode is a quick one); narrow:
    each tile's products only over its used slots rounded up (the reference zeroes the rest, so a tile_used
    short of a tile's pairs fails)."""
    from test_moe_kernels import BETA, LINEAR_BETA, RTOL
    rng = np.random.default_rng([n, k, 7])
    xl, idx, w, experts = _routed_case(rng, n, k, kind)
    words = bool(tuning and tuning.get("words"))
    planes_seen = []  # gate+up's, then down's

    def matmul_t(*args, **kwargs):
        planes_seen.append(args[3].shape[0])
        return rm.reference_matmul_t(*args, **kwargs)
    got = rm.routed_experts_mgpu(xl, idx, w, experts, BETA, LINEAR_BETA, tuning=tuning, matmul_t=matmul_t,
                                 scale_max=126 if words else None)
    assert planes_seen == [1 if words else 2, 2]
    want = routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, "gathered")
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max(axis=-1, keepdims=True)
    assert np.isfinite(want).all() and scale.min() > 0
    err = float(np.max(np.abs(got - want) / scale))
    assert err <= RTOL, f"relative error {err:.2e}"


def test_tile_slots_takes_the_fewest_tiles_that_cover_a_group():
    # the sizes timed on the H100 at K3's 896 experts, top-16 (docs/benchmarks.md, twenty-third session)
    assert [rm.tile_slots(tokens * 16, 896) for tokens in (4096, 7168, 16384)] == [96, 144, 160]
    for mean in np.linspace(1, 2000, 997):
        pairs = int(round(mean * 896))
        size = rm.tile_slots(pairs, 896)
        assert size % 16 == 0 and rm.TILE_T_MIN <= size <= rm.TILE_T_MAX
        need = pairs / 896 + np.sqrt(pairs / 896)
        if size > rm.TILE_T_MIN:  # not raised to the floor: no fewer tiles of at most the largest size would do
            assert np.ceil(need / size) == np.ceil(need / rm.TILE_T_MAX)
            assert size - 16 < need / np.ceil(need / size)  # and no smaller multiple of 16 covers it in as many
    with pytest.raises(ValueError, match="needs pairs and num_experts"):
        rm.stages()
    assert rm.stages(pairs=16384 * 16, num_experts=896).tile_t == 160
    assert rm.stages({"tile_t": 128}).tile_t == 128


def test_tile_widths_cover_each_tiles_used_slots_and_run_widest_first():
    """`tile_widths`: each tile's width is the fewest multiples of `narrow` covering its used slots (an unused
    tile the narrowest), and the order of work is a permutation running the widths down, in tile order within
    a width; without narrow, one width and the tiles in order."""
    used = np.random.default_rng(7).integers(0, 161, 40)
    used[:3] = (0, 160, 1)
    widths, idx, order = wg.tile_widths(jnp.asarray(used, jnp.int32), 32, 160, 40)
    w = np.asarray(widths)[np.asarray(idx)]
    assert widths == (32, 64, 96, 128, 160)
    assert (w >= used).all() and (w - 32 < np.maximum(used, 1)).all()
    order = np.asarray(order)
    assert sorted(order.tolist()) == list(range(40))
    assert (np.diff(w[order]) <= 0).all()
    for width in widths:  # stable: by position within a width
        assert (np.diff(order[w[order] == width]) > 0).all()
    widths, idx, order = wg.tile_widths(None, 0, 160, 5)
    assert widths == (160,) and not np.asarray(idx).any() and np.asarray(order).tolist() == list(range(5))


def test_reference_matmul_t_equals_dequantised_product_and_skips_unused_tiles():
    rng = np.random.default_rng(11)
    e, n, k, tile = 3, 32, 64, 8
    packed = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    scales = rng.integers(110, 130, (e, n, k // 32), dtype=np.uint8)
    tiles = np.array([2, 0, 3, 1])  # the last-but-one unused (E = 3)
    x = rng.standard_normal((tiles.size * tile, k)).astype(np.float32)
    got = rm.reference_matmul_t(jnp.asarray(tiles), (jnp.asarray(packed),),
                                (wg.transpose_scales(jnp.asarray(scales)),), wg.x_planes(jnp.asarray(x, jnp.bfloat16)),
                                tile_t=tile)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    for i, ex in enumerate(tiles):
        cols = slice(i * tile, (i + 1) * tile)
        want = (dequantize_np(packed[ex], scales[ex], np.float64) @ xb[cols].T if ex < e
                else np.zeros((n, tile)))
        np.testing.assert_allclose(np.asarray(got[:, cols], np.float64), want, rtol=1e-5,
                                   atol=1e-5 * max(1.0, np.abs(want).max()))
    # narrowed in steps of 4 to 3, 8, 0 and 5 used slots: tile 0 keeps its first 4 columns, the others all 8
    # (tile 2, unused, is zeros either way)
    cut = np.asarray(rm.reference_matmul_t(jnp.asarray(tiles), (jnp.asarray(packed),),
                                           (wg.transpose_scales(jnp.asarray(scales)),),
                                           wg.x_planes(jnp.asarray(x, jnp.bfloat16)), tile_t=tile, narrow=4,
                                           tile_used=jnp.asarray([3, 8, 0, 5])))
    np.testing.assert_array_equal(cut[:, :4], np.asarray(got)[:, :4])
    np.testing.assert_array_equal(cut[:, tile:], np.asarray(got)[:, tile:])
    assert not cut[:, 4:tile].any() and np.asarray(got)[:, 4:tile].any()


def test_routed_mgpu_lowers_for_cuda():
    """Both grouped kernels (gate+up with two accumulators and the SiTU epilogue, down) lower for CUDA with
    the tile's expert read from the schedule table."""
    from test_moe_kernels import BETA, LINEAR_BETA
    width, latent, num, n, k = 256, 256, 4, 64, 2
    experts = ExpertParams(**{k: jax.ShapeDtypeStruct(v, jnp.uint8)
                              for k, v in _expert_shapes(num, width, latent).items()})
    args = (jax.ShapeDtypeStruct((n, latent), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int32),
            jax.ShapeDtypeStruct((n, k), jnp.float32), experts)
    for scale_max in (None, 120):  # the exact decode and the quick one
        hlo = lower_for_cuda(lambda x, i, w, ex: rm.routed_experts_mgpu(x, i, w, ex, BETA, LINEAR_BETA,
                                                                         tuning={"sms": 132}, scale_max=scale_max),
                             *args)
        assert hlo.count("mosaic_gpu") >= 2
    route = (jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), jnp.float32))
    with pytest.raises(ValueError, match="N = 64 \\(multiple of 256\\)"):
        small = ExpertParams(**{k: jnp.zeros(v, jnp.uint8) for k, v in _expert_shapes(1, 64, 64).items()})
        rm.routed_experts_mgpu(jnp.zeros((2, 64), jnp.bfloat16), *route, small, BETA, LINEAR_BETA)
    with pytest.raises(ValueError, match="activations must be bfloat16"):
        rm.routed_experts_mgpu(jnp.zeros((2, latent), jnp.float32), *route, experts, BETA, LINEAR_BETA)


def test_prefill_kernels_switch_picks_mosaic_gpu_only_for_the_prefill_regime_on_the_gpu(monkeypatch):
    """`routed.routed_experts(prefill_kernels="mgpu")`, as by default, hands the prefill regime to
    `routed_experts_mgpu` when not interpreting and the widths fit (a spy in its place); interpreted, the
    same call keeps the Triton kernels (their result equals the pure op's); a bad name is refused. (The decode regime and an explicit
    config are not reached here: off the interpreter they would run Triton, which the CPU cannot.)"""
    from test_moe_kernels import BETA, LINEAR_BETA, RTOL
    from pallas_kernels.moe import routed
    calls = []
    monkeypatch.setattr(rm, "routed_experts_mgpu", lambda *a, **kw: calls.append(kw) or "mgpu")
    spec = lambda n, latent=256, width=256: (  # noqa: E731
        jnp.zeros((n, latent), jnp.bfloat16), jnp.zeros((n, 4), jnp.int32), jnp.ones((n, 4), jnp.float32),
        ExpertParams(**{k: jnp.zeros(v, jnp.uint8) for k, v in _expert_shapes(4, width, latent).items()}))
    prefill_n = routed.DECODE_MAX_ROWS * 4 // 4 + 1  # pairs above the decode regime's for 4 experts
    assert routed.routed_experts(*spec(prefill_n), BETA, LINEAR_BETA, interpret=False,
                                 prefill_kernels="mgpu", scale_max=120) == "mgpu"
    assert calls == [{"scale_max": 120}]  # the experts' largest scale byte reaches the kernels' decode choice
    assert routed.PREFILL_KERNELS == "mgpu"  # the default on the GPU since 2026-12-06 (docs/benchmarks.md)
    assert routed.routed_experts(*spec(prefill_n), BETA, LINEAR_BETA, interpret=False) == "mgpu"
    assert calls[1:] == [{"scale_max": None}]
    assert not rm.fits(192, 256) and rm.fits(256, 256)
    with pytest.raises(ValueError, match="prefill_kernels must be"):
        routed.routed_experts(*spec(prefill_n), BETA, LINEAR_BETA, prefill_kernels="cutlass")
    rng = np.random.default_rng(3)
    xl, idx, w, experts = _routed_case(rng, 150, 4, "random", width=256, latent=256)  # 600 pairs on 16 experts
    assert routed.choose_config(idx.size, 16) is routed.PREFILL and rm.fits(256, 256)  # only the interpreter stops it
    got = routed.routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, interpret=True, prefill_kernels="mgpu")
    want = routed_experts(xl, idx, w, experts, BETA, LINEAR_BETA, "gathered")
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.max(np.abs(got - want) / np.abs(want).max(axis=-1, keepdims=True)) <= RTOL
    assert len(calls) == 2  # the interpreted call did not reach the spy


@pytest.mark.slow
def test_moe_benchmark_dry_run_checks_both_prefill_paths(tmp_path):
    """benchmarks/moe.py --small on the CPU (the script the GPU session runs, about 40 s here): the Triton path
    interpreted, the Mosaic GPU path with its kernel's reference in place, each checked against the capacity
    einsum at a prefill token count; fails if the script breaks or either check is off."""
    import json
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "moe.py", "--small", "--no-torch", "--no-sweep", "--tokens", "16,256",
                    "--budget-s", "900", "--out", str(tmp_path)], cwd=root / "benchmarks", check=True,
                   env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True)
    res = json.loads((tmp_path / "moe.json").read_text())
    assert not res["errors"] and [r["tokens"] for r in res["rows"] if "mgpu" in r] == [256]
    checks = {(c["tokens"], c["vs"]): c for c in res["checks"]}
    for key in ((256, "capacity einsum"), (256, "capacity einsum (Mosaic GPU path)"), (16, "routed_experts gathered")):
        assert checks[key]["finite"] and checks[key]["max_rel_err"] <= 1e-5, checks[key]
