"""GPU probe (thirty-fourth session): the MoE gate+up decode on Mosaic GPU with the words decode.

The Triton gate+up decode kernel (asm1r-unchecked, the model's) runs at 77.6% of the H100's copy bandwidth at 16
tokens; 213 of its 1,061 loop instructions a K step and a warp are operand moves that Triton's kWidth rule
keeps (docs/benchmarks.md, thirty-second and thirty-third sessions). Mosaic GPU gives wgmma its A operand
from registers in a layout we choose: `wgmma_mxfp4.word_steps` decodes a 32-bit word of a scale block's
bytes per row with the same asm1r PTX, and its eight elements are exactly the thread's registers of four
wgmmas, the activations taken in `word_order`. This times, on the same dispatch (tiles of `MGPU_TILE` slots)
and pre-transposed scales, the grouped gate+up kernel with the words decode at several tunings against the
same kernel with the planes decode (swar, quick: the prefill's) and against the Triton gate+up kernel, with
the copy bandwidth of the same run; outputs compared on the used tiles' columns (h is bf16: the words decode
sums k in another order, so one-ulp flips show).

    python3 tests/gpu/probe_mgpu_words.py                      # MOE_TOKENS=16,512
    MGPU_WORDS='[{"plane_cols": 128}]' python3 tests/gpu/probe_mgpu_words.py
    MGPU_DUMP=DIR python3 tests/gpu/probe_mgpu_words.py        # also each Mosaic GPU kernel's PTX and ptxas log

First runs (H100, 2026-12-07, docs/benchmarks.md, thirty-fourth session): at 16 tokens Triton 1.05-1.12 ms, the
words kernels 1.41-1.55 (3 compute warpgroups and plane_cols 128 the best), the planes kernel 1.54-1.57.
"""
import json
import os
import sys

DUMP = os.environ.get("MGPU_DUMP")
if DUMP:  # Mosaic GPU reads these when it compiles
    os.makedirs(DUMP, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1",
                      MOSAIC_GPU_DUMP_TO=DUMP)

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from moe import BETA, LINEAR_BETA, E, F, L, _random_experts, kernel_parts, routing  # noqa: E402
from timing import copy_tbps, device_seconds  # noqa: E402

from kimik3_jax.ops.common import situ  # noqa: E402
from pallas_kernels.moe import dispatch as dsp  # noqa: E402
from pallas_kernels.moe import routed as kern  # noqa: E402
from pallas_kernels.moe import wgmma_mxfp4 as wg  # noqa: E402

TOKENS = [int(t) for t in os.environ.get("MOE_TOKENS", "16,512").split(",")]
TILE = int(os.environ.get("MGPU_TILE", "16"))
BASE = dict(tile_t=TILE, plane_cols=64, stages=3, delay=1, persistent=True, quick=True)
PLANES = json.loads(os.environ.get("MGPU_PLANES", '[{"swar": true}]'))
WORDS = json.loads(os.environ.get("MGPU_WORDS", '[{}, {"plane_cols": 128}, {"wgs": 3}, {"wgs": 3, "plane_cols": 128}]'))


def gate_up(tuning, words):
    """The grouped gate+up kernel (w1 and w3, SiTU epilogue, rows in plane order as the prefill path writes h)
    on pre-transposed scales; x: the slots' token planes, or their `token_words` with `words`."""
    t = dict(BASE, **tuning)

    def f(tile_expert, x, ex, s1, s3):
        return wg.grouped_mxfp4_matmul_t(tile_expert, (ex.w1_packed, ex.w3_packed), (s1, s3), x,
                                         epilogue=lambda a1, a3: situ(a1, a3, BETA, LINEAR_BETA),
                                         out_dtype=jnp.bfloat16, x_tk=True, plane_rows=True, words=words, **t)
    return jax.jit(f)


def main():
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    ex = _random_experts(jax.random.key(0), E)
    scales = [jax.block_until_ready(wg.transpose_scales(s, plane_rows=True)) for s in (ex.w1_scale, ex.w3_scale)]
    cfg = kern.fit(kern.DECODE, L, F)
    tri_layout, tri_gu, *_ = kernel_parts(cfg, "asm1r-unchecked")
    print(f"copy {copy_tbps(2 ** 30):.3f} TB/s; triton gate_up tiles {cfg.gate_up}; mosaic tiles of {TILE}", flush=True)
    for n in TOKENS:
        xl, idx, w = routing(n, n)
        nbytes = kern.active_bytes(idx, L, F)["gate_up"]
        lo = dsp.block_layout(idx, w, E, TILE)
        used = np.repeat(np.asarray(lo.tile_expert) < E, TILE)
        x_planes = wg.token_planes(xl)[:, lo.slot_token]  # [2, S, L/2]
        x_words = wg.token_words(xl)[:, lo.slot_token]  # [1, S, L]
        tri_lo = tri_layout(idx, w)
        runs = {"triton asm1r": (tri_gu, (xl, tri_lo, ex))}
        runs.update({f"mgpu planes {t}": (gate_up(t, False), (lo.tile_expert, x_planes, ex, *scales)) for t in PLANES})
        runs.update({f"mgpu words {t}": (gate_up(t, True), (lo.tile_expert, x_words, ex, *scales)) for t in WORDS})
        ref = None
        print(f"{n} tokens: {int(used.sum())} used slots of {used.size}; gate+up bytes {nbytes / 1e9:.3f} GB",
              flush=True)
        for name, (f, args) in list(runs.items()):
            try:
                out = np.asarray(f(*args).astype(jnp.float32))
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:400]}", flush=True)
                del runs[name]
                continue
            if name.startswith("mgpu"):
                out = out[:, used]
                if ref is None:
                    ref = out
                print(f"  {name}: max |h - planes' h| / max |h| = {np.abs(out - ref).max() / np.abs(ref).max():.2e}",
                      flush=True)
        for rep in range(2):
            for name, (f, args) in runs.items():
                s = device_seconds(f, *args, calls=5)
                print(f"  [{rep}] {name}: {s * 1e3:.4f} ms, {nbytes / s / 1e12:.3f} TB/s", flush=True)


if __name__ == "__main__":
    main()
