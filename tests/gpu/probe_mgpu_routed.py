"""GPU probe (first run 2026-12-05 on the H200: docs/benchmarks.md, eighteenth session): the routed experts on Mosaic GPU (`pallas_kernels/moe/routed_mgpu.py`)
at K3's widths (latent 3584, expert width 3072, 896 experts, top-16), against the Triton kernels' whole path
(`pallas_kernels/moe/routed.py`, its tiles for the token count, the decode for scale bytes <= 128: GPU-checked
against the pure op before) on the same inputs: relative max error per token row, device time, TFLOP/s of the
dequantised math, TB/s of the chosen experts' MXFP4 bytes, and the XLA glue's share (the whole path's time less
the two grouped kernels timed alone on the same dispatch).

    python3 tests/gpu/probe_mgpu_routed.py                  # 4096 and 16384 tokens
    MGPU_TOKENS=4096 MGPU_TUNINGS='[{}, {"tile_t": 256, "stages": 2}]' python3 tests/gpu/probe_mgpu_routed.py
    MGPU_TOKENS=16,512 MGPU_TUNINGS='[{"quick": true, "tile_t": 16}]' ...  # at decode token counts (step d)
    # the gate+up kernel alone per tuning, with its used tiles (a tile sweep: time = a x tiles + b x columns?)
    MGPU_GATE_UP_ONLY=1 MGPU_TOKENS=16384 MGPU_TUNINGS='[{"tile_t": 96}, {"tile_t": 128}, {"tile_t": 160}]' ...

The default tunings: TUNING without swar (the nibbles decoded one per 16-bit lane), TUNING, and TUNING with the
quick one-multiply decode (the experts' scale bytes are 119-121, as the release's: the model runs this one).
"""
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import numpy as np  # noqa: E402

from moe import BETA, LINEAR_BETA, _random_experts, routing  # noqa: E402
from timing import device_seconds  # noqa: E402

from pallas_kernels.moe import dispatch as dsp  # noqa: E402
from pallas_kernels.moe import routed as kern  # noqa: E402
from pallas_kernels.moe import routed_mgpu as rm  # noqa: E402
from pallas_kernels.moe.wgmma_mxfp4 import transpose_scales  # noqa: E402

TOKENS = [int(t) for t in os.environ.get("MGPU_TOKENS", "4096,16384").split(",")]
TUNINGS = json.loads(os.environ.get("MGPU_TUNINGS", '[{"swar": false}, {}, {"quick": true}]'))
GATE_UP_ONLY = os.environ.get("MGPU_GATE_UP_ONLY") == "1"


def gate_up_stage(tuning, xl, idx, w):
    """The Mosaic GPU path for `tuning`, its dispatch, the slots' planes and its gate+up kernel, jitted."""
    path = rm.stages(tuning, pairs=idx.size, num_experts=896)
    lo = dsp.block_layout(idx, w, 896, path.tile_t)
    planes = jax.jit(path.planes, static_argnums=2)(xl, lo, 896)
    return path, lo, planes, jax.jit(lambda lo, p, e: path.gate_up(lo, p, e, BETA, LINEAR_BETA))


def gate_up_alone(xl, idx, w, ex, flops):
    """Per tuning, the gate+up kernel alone on its dispatch: device time, and the tiles it runs (its used
    tiles: the others return at once) with their columns (tiles x tile_t, padding included)."""
    for tuning in TUNINGS:
        path, lo, planes, gu = gate_up_stage(tuning, xl, idx, w)
        times = [device_seconds(gu, lo, planes, ex, calls=3) for _ in range(2)]
        used = int((np.asarray(lo.tile_expert) < 896).sum())
        print(f"  mgpu {tuning}: gate+up kernel {' / '.join(f'{t * 1e3:.3f}' for t in times)} ms "
              f"({flops * 2 / 3 / min(times) / 1e12:.0f} TFLOP/s useful); {used} tiles of {path.tile_t} used "
              f"({used * path.tile_t} columns for {idx.size} pairs)", flush=True)


def main():
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    ex = _random_experts(jax.random.key(0), 896)
    _, width, half = ex.w1_packed.shape
    for n in TOKENS:
        xl, idx, w = routing(n, n)
        flops = 6.0 * n * idx.shape[1] * 2 * half * width
        if GATE_UP_ONLY:
            print(f"tokens {n}:", flush=True)
            gate_up_alone(xl, idx, w, ex, flops)
            continue
        active = kern.active_bytes(idx, 2 * half, width)
        mxfp4 = active["gate_up"] + active["down"]  # the chosen experts' bytes: what weight streaming reads
        tri = jax.jit(lambda x, i, w, e: kern.routed_experts(x, i, w, e, BETA, LINEAR_BETA, scale_max=120,
                                                             prefill_kernels="triton"))
        want = np.asarray(tri(xl, idx, w, ex), np.float64)
        s_tri = device_seconds(tri, xl, idx, w, ex, calls=3)
        print(f"tokens {n}: triton whole {s_tri * 1e3:.3f} ms ({flops / s_tri / 1e12:.0f} TFLOP/s, "
              f"{mxfp4 / s_tri / 1e12:.2f} TB/s of MXFP4 bytes)", flush=True)
        for tuning in TUNINGS:
            try:
                f = jax.jit(lambda x, i, w, e, t=tuning: rm.routed_experts_mgpu(x, i, w, e, BETA, LINEAR_BETA, tuning=t))
                got = np.asarray(f(xl, idx, w, ex), np.float64)
                scale = np.abs(want).max(axis=-1, keepdims=True)
                err = float(np.max(np.abs(got - want) / np.where(scale > 0, scale, 1)))
                s = device_seconds(f, xl, idx, w, ex, calls=3)
                groups = dict(pairs=idx.size, num_experts=896)
                path, lo, planes, gu = gate_up_stage(tuning, xl, idx, w)
                rb = dict(rm.TUNING, **tuning)["row_blocks"]
                # down with fewer row blocks
                fewer = rm.stages({**tuning, "row_blocks": (rb[0], max(1, rb[1] // 2))}, **groups)
                s_gu = device_seconds(gu, lo, planes, ex, calls=3)
                h_t = gu(lo, planes, ex)
                dn = [jax.jit(stage.down) for stage in (path, fewer)]
                s_dn, s_dn_t = (device_seconds(d, lo, h_t, ex, calls=3) for d in dn)
                print(f"  mgpu {tuning}: whole {s * 1e3:.3f} ms ({flops / s / 1e12:.0f} TFLOP/s, "
                      f"{mxfp4 / s / 1e12:.2f} TB/s, "
                      f"{s_tri / s:.2f}x triton), rel. max error vs triton {err:.1e}; gate+up kernel "
                      f"{s_gu * 1e3:.3f} ms ({flops * 2 / 3 / s_gu / 1e12:.0f} TFLOP/s), down kernel {s_dn * 1e3:.3f} ms "
                      f"({flops / 3 / s_dn / 1e12:.0f} TFLOP/s; {s_dn_t * 1e3:.3f} ms with {max(1, rb[1] // 2)} row "
                      f"blocks), glue {(s - s_gu - s_dn) * 1e3:.3f} ms; slots {planes.shape[1]} in tiles of "
                      f"{path.tile_t}", flush=True)
                y = dn[0](lo, h_t, ex)
                parts = {
                    "dispatch": (jax.jit(lambda i, w: dsp.block_layout(i, w, 896, path.tile_t)), idx, w),
                    "planes gather": (jax.jit(lambda x, lo: path.planes(x, lo, 896)), xl, lo),
                    "scales": (jax.jit(lambda e: (transpose_scales(e.w1_scale, plane_rows=True),
                                                  transpose_scales(e.w3_scale, plane_rows=True),
                                                  transpose_scales(e.w2_scale))), ex),
                    "combine": (jax.jit(lambda y, lo: dsp.combine(y, lo, n, idx.shape[1], weighted=False)), y, lo)}
                def upto(stage):  # the path's first stages in one jit: their marginal costs in place
                    def f(x, i, w, e):
                        layout = dsp.block_layout(i, w, 896, path.tile_t)
                        p = path.planes(x, layout, 896)
                        if stage == 0:
                            return p
                        h = path.gate_up(layout, p, e, BETA, LINEAR_BETA)
                        if stage == 1:
                            return h
                        return path.down(layout, h, e)
                    return jax.jit(f)
                print("  in place: " + ", ".join(f"{name} {device_seconds(upto(i), xl, idx, w, ex, calls=3) * 1e3:.3f} ms"
                                                 for i, name in enumerate(("dispatch+planes", "+gate+up", "+down"))),
                      flush=True)
                print("  glue parts: " + ", ".join(f"{name} {device_seconds(f, *a, calls=3) * 1e3:.3f} ms"
                                                   for name, (f, *a) in parts.items()), flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  mgpu {tuning}: {type(e).__name__}: {str(e).splitlines()[0][:400]}", flush=True)


if __name__ == "__main__":
    main()
