"""The MXFP4 MoE kernels compiled for the GPU (not interpreted): the CPU suite's cases (tests/test_moe_kernels.py),
every decode bit for bit against the reference (every byte and scale; asm1's one-multiply decoder for
the scales it serves; asm1r's in its order), decode="fast", "asm" and "asm1" (the default) and the unchecked
quick decodes (asm1r-unchecked: the model's on scale bytes known to be <= 128) against decode="exact" on whole
paths, and the whole latent MoE through the switch. The benchmark shapes (K3 widths, 896 experts) are checked by
benchmarks/moe.py in the same run as the timings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_moe_kernels as cpu
from jax.experimental import pallas as pl

from kimik3_jax import mxfp4
from kimik3_jax.ops.moe import latent_moe
from pallas_kernels.moe import decode as dec
from pallas_kernels.moe import routed as kern
from pallas_kernels.moe.kernels import _CompilerParams


@pytest.mark.parametrize("config", [cpu.DECODE, cpu.PREFILL, None], ids=["decode", "prefill", "default"])
@pytest.mark.parametrize("n,k,kind", [(1, 4, "random"), (40, 4, "skewed"), (33, 1, "one_expert"),
                                      (150, 4, "random"), (600, 4, "random")])
def test_compiled_kernel_equals_pure_op(config, n, k, kind):
    rng = np.random.default_rng([n, k, len(kind)])
    experts = cpu._experts(rng)
    idx, w = cpu._routing(rng, n, k, kind)
    xl = jnp.asarray(rng.standard_normal((n, cpu.L)), jnp.bfloat16)
    cpu._check(xl, idx, w, experts, config, interpret=False)


@pytest.mark.parametrize("decode,top,perm8", [(dec.decode, 254, None), (dec.decode_fast, 254, None),
                                              (dec.decode_asm, 254, None), (dec.decode_asm1, dec.QUICK_MAX_SCALE, None),
                                              (dec.decode_asm1r, dec.QUICK_MAX_SCALE, dec.R_PERM)],
                         ids=["exact", "fast", "asm", "asm1", "asm1r"])
def test_compiled_decode_is_bit_exact_for_every_byte_and_scale(decode, top, perm8):
    """Compiled, so the GPU's own float semantics (subnormals, fp16 conversion) meet every code: every
    byte at every scale byte 1..top (asm1's one-multiply decoder serves scale bytes up to QUICK_MAX_SCALE;
    the kernels send programs with larger ones to "asm"; asm1r gives asm1's bits in its perm8 order)."""
    def kernel(p_ref, s_ref, o_ref):
        o_ref[...] = decode(p_ref[...], s_ref[...])
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scale = np.repeat((np.arange(256) % top + 1).astype(np.uint8)[:, None], 16, axis=1)  # 1..top, repeated
    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), interpret=False,
                         compiler_params=_CompilerParams(num_warps=4))(jnp.asarray(packed), jnp.asarray(scale))
    want = mxfp4.dequantize(packed, scale, jnp.bfloat16)
    want = want if perm8 is None else dec.permute8(want, perm8)
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("config", [cpu.DECODE, cpu.PREFILL, None], ids=["decode", "prefill", "default"])
@pytest.mark.parametrize("n,k,kind,wide", [(1, 4, "random", False), (40, 4, "skewed", True),
                                           (33, 1, "one_expert", False), (600, 4, "random", True)])
@pytest.mark.parametrize("decode", ["fast", "asm", "asm1"])
def test_compiled_decode_equals_exact(config, n, k, kind, wide, decode):
    """The decodes give bit-identical weights (the test above, compiled), but compiled for the GPU the
    kernels are not bit-identical at bm 16 (measured for "fast"): on the H200 the whole path differed in the last bits
    (1.8e-7 relative at 1 token, 3.9e-6 at 16 tokens, K3 widths; tests/gpu/probe_session.py part C) while
    the prefill tiles agreed bit for bit. Identical operands summed in a different order by the code
    Triton generates around different producers; the bound is fp32 summation-order level."""
    rng = np.random.default_rng([n, k, 5])
    experts = cpu._wide_scale_experts(rng) if wide else cpu._experts(rng)
    idx, w = cpu._routing(rng, n, k, kind)
    xl = jnp.asarray(rng.standard_normal((n, cpu.L)) * (2.0 ** -12 if wide else 1.0), jnp.bfloat16)
    run = lambda d: np.asarray(kern.routed_experts(xl, idx, w, experts, 4.0, 25.0, config=config, decode=d))
    exact, got = run("exact"), run(decode)
    assert np.isfinite(exact).all() and np.abs(exact).max() > 0
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("decode", ["asm1-unchecked", "asm1r-unchecked"])
@pytest.mark.parametrize("config", [cpu.DECODE, cpu.PREFILL, None], ids=["decode", "prefill", "default"])
@pytest.mark.parametrize("n,k,kind", [(1, 4, "random"), (33, 1, "one_expert"), (600, 4, "random")])
def test_compiled_unchecked_quick_decode_equals_exact(config, n, k, kind, decode):
    """decode="asm1-unchecked" (asm1's quick decoder in every program, no per-program choice) and
    "asm1r-unchecked" (the same bits in R_PERM order, with x's columns and h's in that order: the model's
    decode when every scale byte is <= 128) on weights whose scale bytes all allow it (122..128), as the test
    above (the permuted sums run in another order)."""
    test_compiled_decode_equals_exact(config, n, k, kind, False, decode)


def test_compiled_scale_bytes_and_skipped_pairs():
    rng = np.random.default_rng(7)
    ex = cpu._experts(rng, 1, 254)
    fix = {}
    for name in ("w1", "w3"):
        p, s = np.asarray(getattr(ex, name + "_packed")), np.asarray(getattr(ex, name + "_scale"))
        fix[name + "_packed"] = jnp.asarray(np.where(np.repeat(s >= 240, 16, axis=-1), p & 0x99, p), jnp.uint8)
    fix["w2_scale"] = jnp.asarray(rng.integers(1, 231, ex.w2_scale.shape), jnp.uint8)
    ex = ex.replace(**fix)
    idx, w = cpu._routing(rng, 20, 4, "random")
    xl = jnp.asarray(rng.standard_normal((20, cpu.L)) * 2.0 ** -12, jnp.bfloat16)
    cpu._check(xl, idx, w, ex, cpu.DECODE, interpret=False)
    drop = rng.uniform(size=idx.shape) < 0.4
    a = kern.routed_experts(xl, jnp.where(drop, cpu.E, idx), jnp.where(drop, 0.0, w), ex, 4.0, 25.0)
    b = kern.routed_experts(xl, jnp.where(drop, 0, idx), jnp.where(drop, 0.0, w), ex, 4.0, 25.0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("known", [False, True], ids=["unknown-scales", "known-scales"])
def test_compiled_latent_moe_through_the_switch(known):
    """The whole latent MoE with the kernels compiled, the experts' largest scale byte unknown (asm1) or known
    (`Runtime.expert_scale_max`, <= 128 here: asm1r-unchecked)."""
    cfg, layer, x = cpu.bf16_moe_layer()
    if known:
        cfg = cfg.with_runtime(expert_scale_max=cpu.expert_scale_max(layer.experts))
    ref = np.asarray(latent_moe(x, layer, cfg.with_runtime(impl="xla")), np.float32)
    for impl in ("pallas", "auto"):
        got = np.asarray(latent_moe(x, layer, cfg.with_runtime(impl=impl)), np.float32)
        assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max(), impl


def _spy_mosaic_gpu_path(monkeypatch) -> list:
    """Records the keyword arguments of each call the switch makes to the Mosaic GPU path (and runs it)."""
    from pallas_kernels.moe import routed_mgpu
    calls, path = [], routed_mgpu.routed_experts_mgpu
    monkeypatch.setattr(kern.mgpu, "routed_experts_mgpu", lambda *a, **kw: calls.append(kw) or path(*a, **kw))
    return calls


def test_compiled_latent_moe_prefill_takes_the_mosaic_gpu_path(monkeypatch):
    """The whole latent MoE layer, impl="pallas", at a latent width the Mosaic GPU kernels take (256; the
    tiny preset's expert width is 256) and 600 tokens (2400 pairs on 16 experts: the prefill regime): the
    default prefill path (`routed.PREFILL_KERNELS`, spied) against impl="xla", with the experts' largest
    scale byte known (the quick decode) and not."""
    import dataclasses

    from kimik3_jax.checkpoint.open import expert_scale_max
    from kimik3_jax.presets import preset
    base = preset("tiny")
    cfg, layer, x = cpu.bf16_moe_layer(dataclasses.replace(base, moe=dataclasses.replace(base.moe, latent_width=256)),
                                       batch=4, length=150)
    calls = _spy_mosaic_gpu_path(monkeypatch)
    ref = np.asarray(latent_moe(x, layer, cfg.with_runtime(impl="xla")), np.float32)
    for scale_max in (None, expert_scale_max(layer.experts)):
        got = np.asarray(latent_moe(x, layer, cfg.with_runtime(impl="pallas", expert_scale_max=scale_max)), np.float32)
        assert calls and calls[-1] == {"scale_max": scale_max}, "the prefill did not take the Mosaic GPU path"
        assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max(), scale_max


SWAR, WORDS = {"swar": True, "words": False}, {"swar": True, "words": True}
NO_SWAR = {"swar": False, "words": False}
NARROW, WORDS_NARROW = {**SWAR, "narrow": 16}, {**WORDS, "narrow": 16}


@pytest.mark.parametrize("n,k,kind,scale_max,tuning", [
    (600, 4, "random", None, NO_SWAR), (600, 4, "random", 126, NO_SWAR), (300, 4, "skewed", 126, NO_SWAR),
    (800, 1, "one_expert", None, NO_SWAR), (257, 4, "random", 126, NO_SWAR), (600, 4, "random", None, SWAR),
    (300, 4, "skewed", 126, SWAR), (600, 4, "random", 126, WORDS), (300, 4, "skewed", 126, WORDS),
    (800, 1, "one_expert", 126, WORDS), (257, 4, "random", None, WORDS), (600, 4, "random", 126, NARROW),
    (300, 4, "skewed", None, NARROW), (257, 4, "random", 126, WORDS_NARROW), (800, 1, "one_expert", 126, WORDS_NARROW)])
def test_compiled_mosaic_gpu_prefill_equals_pure_op(n, k, kind, scale_max, tuning, monkeypatch):
    """The prefill regime on Mosaic GPU (`routed_mgpu`, picked through routed_experts' switch: spied) against
    the pure op, at widths it takes (latent and expert width 256): uneven and empty experts, all pairs on one
    expert (7 tiles of one expert), a token count that leaves a partial tile; with the exact decode and, the
    scale bytes being 118..126, the quick one (scale_max 126); with the nibbles decoded two per 32-bit word
    (swar), and gate+up's words decode (taken with the quick decode only; set in TUNING for the test); with
    each tile's wgmmas narrowed to its used slots (narrow)."""
    import test_moe_wgmma as wg_cpu

    from kimik3_jax.ops.moe import routed_experts
    from pallas_kernels.moe import routed_mgpu
    rng = np.random.default_rng([n, k, len(kind), 3])
    xl, idx, w, experts = wg_cpu._routed_case(rng, n, k, kind, num=16, width=256, latent=256)
    for key, value in tuning.items():
        monkeypatch.setitem(routed_mgpu.TUNING, key, value)
    calls = _spy_mosaic_gpu_path(monkeypatch)
    got = kern.routed_experts(xl, idx, w, experts, cpu.BETA, cpu.LINEAR_BETA, prefill_kernels="mgpu", interpret=False,
                              scale_max=scale_max)
    assert calls, "the switch did not pick the Mosaic GPU path"
    want = routed_experts(xl, idx, w, experts, cpu.BETA, cpu.LINEAR_BETA, "gathered")
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max(axis=-1, keepdims=True)
    assert np.isfinite(want).all() and scale.min() > 0
    err = float(np.max(np.abs(got - want) / scale))
    assert err <= cpu.RTOL, f"relative error {err:.2e}"
