"""The Pallas implementation of `kimik3_jax.ops.moe.routed_experts` (same signature), registered under
that name: block-aligned dropless dispatch, the fused gate+up kernel with the SiTU epilogue, the down
kernel applying the routing weights, and the combine by gather in top-k order."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kimik3_jax.ops.impl import Unsupported, register
from pallas_kernels.common import resolve_interpret
from pallas_kernels.moe import decode as dec
from pallas_kernels.moe import dispatch as dsp
from pallas_kernels.moe import routed_mgpu as mgpu
from pallas_kernels.moe.kernels import DEFAULT_DECODE, TileConfig, Tiles, check_tiles, down, gate_up

# From H200 sweeps at K3's widths (latent 3584, expert 3072; docs/benchmarks.md). Decode: with the asm decode,
# bk 256 and 3 stages beat bk 128 / 4 stages by 9% (gate+up) and 8% (down) at 16 tokens, 9% / 18% at 512
# (tests/gpu/probe_streaming.py part T, 2026-12-02). Prefill gate+up: bn 64 at 4 warps, 17.5 ms against
# 19.7 ms with bn 128 at 8 warps at 4096 tokens, the same bits (benchmarks/moe.py --candidates, 2026-12-03);
# offline both use 255 registers, 2 blocks of 4 warps per SM against 1 of 8.
DECODE = TileConfig(bm=16, gate_up=Tiles(bn=64, bk=256, num_warps=4, num_stages=3),
                    down=Tiles(bn=64, bk=256, num_warps=4, num_stages=3))
PREFILL = TileConfig(bm=128, gate_up=Tiles(bn=64, bk=64, num_warps=4, num_stages=3),
                     down=Tiles(bn=128, bk=64, num_warps=8, num_stages=3))
DECODE_MAX_ROWS = 32  # mean pairs per expert up to which weight streaming (bm 16) wins
# The prefill regime's kernels on the GPU: "triton" (gate_up / down above) or "mgpu" (`routed_mgpu`: Mosaic GPU,
# warp-specialised wgmma). The interpreter, and widths "mgpu" does not take (`routed_mgpu.fits`), run "triton".
# "mgpu" since 2026-12-06 (H100, jax 0.11.2, K3 widths, 16384 tokens): 51.6 ms against the Triton path's 67.4
# (1.30x), the same outputs to 2.1e-4, its compiled test through this switch passed (docs/benchmarks.md).
PREFILL_KERNELS = "mgpu"


def choose_config(pairs: int, num_experts: int) -> TileConfig:
    return DECODE if pairs <= DECODE_MAX_ROWS * num_experts else PREFILL


def fit(config: TileConfig, latent: int, width: int) -> TileConfig:
    """Shrink tiles (by halving) to divide smaller widths than K3's, e.g. the test presets'."""
    def shrink(t: Tiles, n: int, k: int) -> Tiles:
        bn, bk = t.bn, t.bk
        while bn > 16 and n % bn:
            bn //= 2
        while bk > t.min_bk and k % bk:
            bk //= 2
        return dataclasses.replace(t, bn=bn, bk=bk)
    return TileConfig(config.bm, shrink(config.gate_up, width, latent), shrink(config.down, latent, width))


def _packed(experts) -> bool:
    return all(hasattr(experts, a) for a in ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed",
                                             "w2_scale"))


def decoder_for(decode: str, scale_max: int | None, config: TileConfig | None = None) -> str:
    """The decode a call with tiles `config` (None: unsplit ones) runs: a decoder with a quick one (asm1, fast1)
    becomes an unchecked quick decoder (`decode.UNCHECKED`: no per-program check of the scale bytes) when the
    weights' largest scale byte is known to be within the quick decoder's range; one with halves
    (`decode.UNCHECKED_HALVES`) if either kernel's tiles are split (`Tiles.split`)."""
    if decode in dec.UNCHECKED and scale_max is not None and scale_max <= dec.DECODERS[decode].quick_max:
        name = dec.UNCHECKED[decode]
        split = config is not None and (config.gate_up.split or config.down.split)
        return dec.UNCHECKED_HALVES[decode] if split and dec.DECODERS[name].halves is None else name
    return decode


def supports(xl, idx, weights, experts, beta, linear_beta, strategy="auto", *, config=None, interpret=None,
             decode=DEFAULT_DECODE, scale_max=None, prefill_kernels=None):
    if not _packed(experts):
        raise Unsupported("routed_experts kernel: needs packed MXFP4 experts (w1_packed, ...), got "
                          f"{type(experts).__name__}")
    if jnp.dtype(xl.dtype) != jnp.bfloat16:
        raise Unsupported(f"routed_experts kernel: activations must be bfloat16, got {jnp.dtype(xl.dtype)}")
    for name in ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale"):
        a = getattr(experts, name)
        if a.ndim != 3 or jnp.dtype(a.dtype) != jnp.uint8:
            raise Unsupported(f"routed_experts kernel: experts.{name} must be uint8 [E, out, in/..] "
                              f"(one layer), got {jnp.dtype(a.dtype)} {tuple(a.shape)}")
    num_experts, width, half = experts.w1_packed.shape
    if xl.ndim != 2 or xl.shape[1] != 2 * half or idx.shape != weights.shape or idx.shape[0] != xl.shape[0]:
        raise Unsupported(f"routed_experts kernel: expected xl [N, {2 * half}] and idx/weights [N, k], got "
                          f"{tuple(xl.shape)}, {tuple(idx.shape)}, {tuple(weights.shape)}")
    cfg = fit(config or choose_config(idx.size, num_experts), 2 * half, width)
    try:
        check_tiles("gate_up", width, 2 * half, cfg.gate_up)
        check_tiles("down", 2 * half, width, cfg.down)
    except ValueError as err:
        raise Unsupported(f"routed_experts kernel: {err}") from None


@register("routed_experts", supports)
def routed_experts(xl, idx, weights, experts, beta, linear_beta, strategy="auto", *, config=None,
                   interpret=None, decode=DEFAULT_DECODE, scale_max=None, prefill_kernels=None):
    """Same contract as `kimik3_jax.ops.moe.routed_experts` (bf16 xl [N, L], packed experts of one layer)
    -> [N, L] float32. `strategy` is the pure op's and is ignored: the tiles follow the number of pairs per
    expert (`choose_config`) unless `config` is given. `decode` picks the in-register MXFP4 decode
    (`decode.DECODERS`): "asm1" (the default: PTX, GPU only, one multiply per pair where every scale byte of
    the program's weight rows allows it, else "asm"; "fast1" in the interpreter), "asm" (PTX, "fast" in the
    interpreter), "fast" and "exact" give the same bits with fewer or more integer operations; "reinterpret"
    is a benchmark diagnostic (wrong values). `scale_max`, the experts' largest scale byte when known
    (`Runtime.expert_scale_max`): at most 128 turns "asm1" into "asm1r-unchecked" (`decoder_for`), which
    skips asm1's per-program check (on the H200, 2026-12-03: decode gate+up 12% and prefill down 26-35%
    faster at K3 widths, the same bits) and its prmt (the same bits in an order the kernels follow; on the
    H100, 2026-12-07, Nsight Compute at 16 tokens: gate+up 2% and down 8% faster); split tiles keep
    "asm1-unchecked". `prefill_kernels` (default PREFILL_KERNELS): "triton" or "mgpu" for the prefill regime
    when `config` is not given."""
    del strategy
    n, k = idx.shape
    num_experts, width, half = experts.w1_packed.shape
    chosen = config or choose_config(n * k, num_experts)
    decode = decoder_for(decode, scale_max, chosen)
    prefill_kernels = prefill_kernels or PREFILL_KERNELS
    if prefill_kernels not in ("triton", "mgpu"):
        raise ValueError(f"routed_experts kernel: prefill_kernels must be 'triton' or 'mgpu', got {prefill_kernels!r}")
    if (config is None and chosen is PREFILL and prefill_kernels == "mgpu" and not resolve_interpret(interpret)
            and mgpu.fits(2 * half, width)):
        return mgpu.routed_experts_mgpu(xl, idx, weights, experts, beta, linear_beta, scale_max=scale_max)
    cfg = fit(chosen, 2 * half, width)
    layout = dsp.block_layout(idx, weights, num_experts, cfg.bm)
    h = gate_up(xl, layout.tile_expert, layout.slot_token, experts.w1_packed, experts.w1_scale,
                experts.w3_packed, experts.w3_scale, beta, linear_beta, cfg.bm, cfg.gate_up, interpret, decode)
    y = down(h, layout.tile_expert, layout.slot_weight, experts.w2_packed, experts.w2_scale, cfg.bm, cfg.down,
             interpret, decode)
    return dsp.combine(y, layout, n, k)


def flops(pairs: int, latent: int, width: int) -> dict[str, float]:
    """Dequantised bf16 math of the two kernels (2 per multiply-add)."""
    return {"gate_up": 4.0 * pairs * latent * width, "down": 2.0 * pairs * latent * width}


def active_bytes(idx, latent: int, width: int) -> dict[str, float]:
    """MXFP4 bytes (nibbles + scales) of the experts `idx` chooses: what weight streaming must read."""
    active = len(np.unique(np.asarray(idx)))
    per = width * latent // 2 + width * latent // 32
    return {"gate_up": 2.0 * active * per, "down": 1.0 * active * per, "experts": active}
