"""The prefill regime of the routed experts on Mosaic GPU (issue 7): the same contract as
`kimik3_jax.ops.moe.routed_experts`, with the grouped warp-specialised MXFP4 GEMM of `wgmma_mxfp4.py` in the
transposed orientation end to end (the weights are wgmma's M, because only its A operand may come from
registers, where the nibbles are decoded):

1. block-aligned dispatch (`dispatch.block_layout`, tiles of `tile_t` slots, one expert each);
2. the tokens' activations as even/odd K planes, token-major [2, N, L/2] (`token_planes`, one XLA pass over the
   tokens), and the slots' planes [2, S, L/2] a row gather of them that writes only the used tiles
   (`gather.slot_planes`, a Triton kernel: 1.3 ms against XLA's 2.4 at 16384 tokens on the H100);
3. gate+up: h^T [F, S] = SiTU(W1[e] x^T, W3[e] x^T) in one kernel (two accumulators per warpgroup, the SiTU
   epilogue in registers), in the activation dtype as the reference rounds it, its rows in plane order
   (`plane_rows`), so that h^T is down's planes [2, F/2, S] as it is;
4. down: y [S, L] = (W2[e] h^T)^T in fp32, two 128-row blocks per tile, each stored transposed from registers;
5. the combine: each token gathers its k slots' rows of y, times the routing weights, summed in top-k order.

The token planes and the combine are XLA passes, and the E8M0 scales are transposed per call ([E, N, K/32] ->
[E, K/32, N], 3% of the packed bytes). Columns of unused tiles are never written nor read back. GPU only: the
warp-specialised pipeline has no interpreter rule (tests/test_moe_wgmma.py checks this glue on the CPU with the
kernel's pure-JAX reference, `reference_matmul_t`, in its place; tests/gpu/test_moe_gpu.py the compiled path).

On the H100 (2026-12-06, docs/benchmarks.md; 896 experts, top-16, K3 widths, jax 0.11.2) it equals the Triton
path to 2.1e-4 and runs 1.64x its speed at 16384 tokens (41.0 against 67.2 ms, 422 TFLOP/s; the kernels 453)
with the quick decode, swar, tiles sized to the groups (`tile_slots`: 160 slots there) and the used-tile
planes gather; 1.31x with tiles of 128. It is the prefill regime's default (`routed.PREFILL_KERNELS`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kimik3_jax.mxfp4 import dequantize
from kimik3_jax.ops.common import situ
from pallas_kernels.moe import dispatch as dsp
from pallas_kernels.moe.gather import slot_planes
from pallas_kernels.moe.wgmma_mxfp4 import (QUICK_MAX, grouped_mxfp4_matmul_t, token_planes, token_words,
                                            transpose_scales, word_order)

# tile_t: slots per tile (the dispatch's bm, wgmma's N), None: by the mean group size (`tile_slots`); row_blocks:
# (gate+up's, down's) 128-row blocks per tile. The best on the H200 at K3's widths and 16384 tokens
# (tests/gpu/probe_mgpu_routed.py, eighteenth session): delay 1, persistent, 3 stages; tile_t 256 runs out of
# shared memory at 3 stages and spills at 2 (gate+up 332 ms). Down with 2 row blocks (H100, nineteenth):
# 16.8-17.1 ms against 23.8-24.0 with 1; gate+up keeps 1 (2 matrices are already 2 accumulators a warpgroup);
# 4 row blocks exceed TMA's 256-row box. swar (the nibbles' bits two per 32-bit word, H100 2026-12-06): gate+up
# 35.3 -> 32.4 ms, down 16.2 -> 15.9 with the quick decode. The quick decode itself is not a tuning: `stages`
# takes it when the scale bytes allow. words (gate+up's words decode, with the quick decode only: `wgmma_mxfp4.
# word_steps`) is off: its kernel is 1-2% faster at 16384 tokens, the whole path with `token_words` as a gather
# 40.79 against 40.85 ms (H100, 2026-12-07: no gain). narrow (each tile's products over its used slots rounded up
# to `narrow`, a pipeline per width) is off: in expert order, gate+up took 30.0 against 26.0 ms at 16384 tokens
# with narrow 16 (H100), and on the H200 about 0.35 ms more per width (28.1 / 27.1 / 25.1 ms for 16 / 32 / 80,
# 25.2 without; 2026-12-07). Run widest first, that cost is gone but nothing is saved: 26.2 / 25.7 ms for 16 / 32
# against 25.6-25.8 without (H100, thirty-seventh session).
TUNING = dict(tile_t=None, plane_cols=64, stages=3, delay=1, persistent=True, row_blocks=(1, 2), swar=True, narrow=0)
# Bounds of `tile_slots`: 160 slots is the largest tile measured best (176 ran 3% slower at 16384 tokens, 256
# runs out of shared memory, above), and small tiles repeat the decode (64 at 7168 tokens: 1.43x the time of 144).
TILE_T_MAX, TILE_T_MIN, TILE_T_STEP = 160, 64, 16


def tile_slots(pairs: int, num_experts: int) -> int:
    """The tile size for `pairs` token/expert pairs over `num_experts` experts (static: the call's shapes):
    each program decodes its expert's weights once for its tile, so an expert's group should take as few
    tiles as TILE_T_MAX allows, each as small as covers it. The group is taken as its mean size plus one
    standard deviation of a uniform routing's (sqrt of the mean), split into the fewest tiles of at most
    TILE_T_MAX, rounded up to a multiple of 16. K3 widths on the H100 (2026-12-06, jax 0.11.2, top-16 of
    896, quick + swar): 16384 tokens (mean 292.6) -> 160: 42.3 ms against 51.4 with 128 (409 TFLOP/s, 1.22x);
    4096 tokens (mean 73.1) -> 96: 16.0 ms against 18.1 (1.13x); 7168 tokens (mean 128) -> 144: 21.4 ms."""
    mean = pairs / num_experts
    need = mean + math.sqrt(mean)
    tiles = math.ceil(need / TILE_T_MAX)
    size = TILE_T_STEP * math.ceil(need / tiles / TILE_T_STEP)
    return min(TILE_T_MAX, max(TILE_T_MIN, size))


def fits(latent: int, width: int, tuning=None) -> bool:
    """Whether both grouped GEMMs take these widths: the output rows in blocks of 128 (width for gate+up, in
    both planes: 256; latent for down) and each reduction's planes (latent / 2, width / 2) in blocks of
    plane_cols."""
    t = dict(TUNING, **(tuning or {}))
    gate_up_rb, down_rb = t["row_blocks"]
    return all(n % rows == 0 and (k // 2) % t["plane_cols"] == 0 and k % 2 == 0
               for n, k, rows in ((width, latent, 256 * gate_up_rb), (latent, width, 128 * down_rb)))


def reference_matmul_t(tile_expert, packed, scales_t, planes, *, epilogue=None, out_dtype=jnp.float32,
                       tile_t: int = 128, x_tk: bool = False, plane_rows: bool = False, transpose_out: bool = False,
                       words: bool = False, tile_used=None, narrow: int = 0, **_):
    """`grouped_mxfp4_matmul_t` in plain JAX (dequantise each tile's expert, fp32 products): the CPU's stand-in
    for the kernel, and the GPU tests' reference. Unused tiles give zeros, and so, with `narrow`, do the
    columns of a tile past its used slots rounded up to `narrow` (both left unwritten by the kernel)."""
    num_experts = packed[0].shape[0]
    tiles = tile_expert.shape[0]
    e = jnp.minimum(tile_expert, num_experts - 1)
    if x_tk:
        planes = jnp.swapaxes(planes, 1, 2)
    if words:  # [1, K, S] in word_order -> x's even and odd columns, [2, K/2, S]
        x = planes[0, np.argsort(word_order(planes.shape[1]))]
        planes = jnp.stack([x[0::2], x[1::2]])
    if plane_rows:  # the weight rows in the output's order, as the kernel reads them
        packed = [jnp.swapaxes(p.reshape(num_experts, -1, 2, p.shape[-1]), 1, 2).reshape(p.shape) for p in packed]
    x = jnp.moveaxis(planes.reshape(2, planes.shape[1], tiles, tile_t), 2, 0).astype(jnp.float32)  # [tiles, 2, K/2, tile_t]
    accs = []
    for p, sc in zip(packed, scales_t, strict=True):
        w = dequantize(p[e], jnp.swapaxes(sc[e], -1, -2), jnp.float32)  # [tiles, N, K]
        w = jnp.stack([w[..., 0::2], w[..., 1::2]], axis=1)  # [tiles, 2, N, K/2]
        accs.append(jnp.einsum("tpnk,tpks->tns", w, x, precision=jax.lax.Precision.HIGHEST))
    if narrow:
        width = jnp.minimum(-(-tile_used // narrow) * narrow, tile_t)
        accs = [jnp.where(jnp.arange(tile_t) < width[:, None, None], a, 0.0) for a in accs]
    out = (epilogue or (lambda a: a))(*accs).astype(out_dtype)
    out = jnp.where((tile_expert < num_experts)[:, None, None], out, 0)  # [tiles, N, tile_t]
    out = jnp.moveaxis(out, 0, 1).reshape(out.shape[1], tiles * tile_t)
    return out.T if transpose_out else out


class Stages(NamedTuple):
    """The path's steps with one tuning, each a function of arrays (jit them alone to time them alone):
    tile_t: the dispatch's slots per tile; planes(xl, layout, num_experts) -> [2, S, L/2] ([1, S, L] in
    `word_order` with words; the rows of unused tiles undefined: `gather.slot_planes`); gate_up(layout, planes,
    experts, beta, linear_beta) -> h^T [F, S] in bf16, rows in plane order; down(layout, h^T, experts) -> y
    [S, L] fp32 (layout: the dispatch's `BlockLayout`, its tiles' experts and used slots)."""
    tile_t: int
    planes: Callable
    gate_up: Callable
    down: Callable


def stages(tuning=None, *, pairs=None, num_experts=None, scale_max=None, matmul_t=None) -> Stages:
    """The Mosaic GPU path's steps. `tuning`: overrides of TUNING; `pairs` and `num_experts`: the call's
    token/expert pairs and experts, which set tile_t when the tuning leaves it None (`tile_slots`);
    `scale_max`: the experts' largest scale byte when known (`Runtime.expert_scale_max`): up to QUICK_MAX the
    kernels take the one-multiply decode; `matmul_t`: the grouped GEMM (default the Mosaic GPU kernel; tests
    pass `reference_matmul_t`)."""
    t = {**TUNING, "quick": scale_max is not None and scale_max <= QUICK_MAX, **(tuning or {})}
    words = bool(t.pop("words", False)) and t["quick"]  # gate+up's words decode takes the quick decode only
    if t["tile_t"] is None:
        if pairs is None or num_experts is None:
            raise ValueError("routed_mgpu.stages: tile_t None (by the group sizes) needs pairs and num_experts")
        t["tile_t"] = tile_slots(pairs, num_experts)
    gate_up_rb, down_rb = t.pop("row_blocks")
    matmul_t = functools.partial(matmul_t or grouped_mxfp4_matmul_t, **t)

    def gate_up(layout, planes, experts, beta, linear_beta):
        return matmul_t(layout.tile_expert, (experts.w1_packed, experts.w3_packed),
                        tuple(transpose_scales(s, plane_rows=True) for s in (experts.w1_scale, experts.w3_scale)),
                        planes, epilogue=lambda a1, a3: situ(a1, a3, beta, linear_beta), out_dtype=planes.dtype,
                        x_tk=True, plane_rows=True, row_blocks=gate_up_rb, words=words, tile_used=layout.tile_used)

    def down(layout, h_t, experts):
        width, slots = h_t.shape
        return matmul_t(layout.tile_expert, (experts.w2_packed,), (transpose_scales(experts.w2_scale),),
                        h_t.reshape(2, width // 2, slots), transpose_out=True, row_blocks=down_rb,
                        tile_used=layout.tile_used)

    def planes(xl, layout, num_experts):
        return slot_planes((token_words if words else token_planes)(xl), layout.tile_expert, layout.slot_token,
                           t["tile_t"], num_experts)

    return Stages(t["tile_t"], planes, gate_up, down)


def routed_experts_mgpu(xl, idx, weights, experts, beta, linear_beta, *, tuning=None, matmul_t=None,
                        scale_max=None):
    """Same contract as `kimik3_jax.ops.moe.routed_experts` for bf16 xl [N, L] and packed experts of one
    layer -> [N, L] float32; `tuning`, `scale_max` and `matmul_t` as `stages` takes them."""
    if jnp.dtype(xl.dtype) != jnp.bfloat16:  # the kernel's shapes are checked by the kernel, by name
        raise ValueError(f"routed_experts_mgpu: activations must be bfloat16, got {jnp.dtype(xl.dtype)}")
    n, k = idx.shape
    num_experts = experts.w1_packed.shape[0]
    path = stages(tuning, pairs=n * k, num_experts=num_experts, scale_max=scale_max, matmul_t=matmul_t)
    layout = dsp.block_layout(idx, weights, num_experts, path.tile_t)
    planes = path.planes(xl, layout, num_experts)  # [2, S, L/2] (words: [1, S, L]): a row gather of the used tiles
    h_t = path.gate_up(layout, planes, experts, beta, linear_beta)  # [F, S] = down's planes [2, F/2, S]
    y = path.down(layout, h_t, experts)  # [S, L] fp32
    return dsp.combine(y, layout, n, k, weighted=False)
