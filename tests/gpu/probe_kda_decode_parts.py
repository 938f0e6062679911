"""GPU probe (written 2026-12-06): where the split KDA decode's time goes (`pallas_kernels/kda/decode_split.py`,
the default from 32 sequences) at H = 96, N = 32 and 256: each of its three launches timed alone, back to back
in a loop as `benchmarks/kda.py` times the whole step (`decode_step_ms`), and the state kernel's state traffic
in TB/s. The whole step is `benchmarks/kda.py --only decode`. (First run 2026-12-06, H100: docs/benchmarks.md,
twenty-first session; its norm line then came from one call at a time, which measured the host's dispatch.)

    PYTHONPATH=$PWD python3 tests/gpu/probe_kda_decode_parts.py          # N = 32, 256
    KDA_PARTS_N=32 KDA_PARTS_BV=128,32 python3 tests/gpu/probe_kda_decode_parts.py
    KDA_PARTS_STATE='[{"block_v": 32, "num_warps": 2}, {"block_v": 16, "num_warps": 1}]' python3 tests/gpu/...

The state kernel is timed at each of KDA_PARTS_STATE's tunings (a JSON list of overrides of the default: block_v,
num_warps, heads_fastest; default: block_v from KDA_PARTS_BV), its output and states checked against the first
tuning's, and its rate given as a share of the copy bandwidth measured in the same run (`timing.copy_tbps`).
With KDA_PARTS_CEILING=1 (the default), a kernel that only streams the pool on the same grid (`stream`), in place
or into a new array, with the slot read first or not, at block_v 128 and 32: how much of the state kernel's gap
to copy is its access pattern; and on jax 0.11 the same through shared memory by TMA (`stream_tma`), the ceiling
of the Mosaic GPU state kernel (tuning tma).
The question it is for (docs/benchmarks.md, "Still to run"): the state kernel moves its bytes at 93% of copy
on the H100 (twenty-second session) while the whole step reached about 77% on the H200 (eighteenth).
"""
import functools
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402

from kda import DK, DV, decode_inputs, decode_step_ms  # noqa: E402
from timing import copy_tbps  # noqa: E402

from kimik3_jax.ops.kda import gated_output_norm  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from pallas_kernels.kda import decode as pdecode  # noqa: E402
from pallas_kernels.kda.common import compiler_params  # noqa: E402
from pallas_kernels.kda.decode_tma import available as tma_available  # noqa: E402
from pallas_kernels.kda import decode_split as split  # noqa: E402

NS = [int(n) for n in os.environ.get("KDA_PARTS_N", "32,256").split(",")]
BVS = [int(b) for b in os.environ.get("KDA_PARTS_BV", "128,32").split(",")]
STATE_TUNINGS = json.loads(os.environ.get("KDA_PARTS_STATE", "null")) or [{"block_v": bv} for bv in BVS]
H, STEPS = 96, 100
CEILING = os.environ.get("KDA_PARTS_CEILING", "1") == "1"


def stream(slots, s_pool, *, bv, in_place, via_slot):
    """The state's traffic with no arithmetic: each [K, bv] tile read, scaled and written back, on the state
    kernel's grid (a program a head and value tile), in place (the pool aliased, as the decode writes it) or into
    a new array, its row's slot read first (the state's address waits on it, as the decode's does) or not: the
    ceiling of a kernel that streams the pool in these tiles, and what the slot and in place cost (2026-12-08)."""
    n, h, dk, dv = s_pool.shape

    def kernel(slots_ref, s_ref, o_ref):
        c, j, i = (pl.program_id(a) for a in range(3))  # the state kernel's order: tiles, then heads, fastest
        row = slots_ref[i] if via_slot else i
        o_ref[row, j, :, pl.ds(c * bv, bv)] = s_ref[row, j, :, pl.ds(c * bv, bv)] * 0.999

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(s_pool.shape, s_pool.dtype), grid=(dv // bv, h, n),
                          input_output_aliases={1: 0} if in_place else {}, name="kda_state_stream",
                          compiler_params=compiler_params(4, 1))(slots, s_pool)


def stream_tma(slots, s_pool, *, bv):
    """`stream` through shared memory by TMA (the Mosaic GPU state kernel's path, `decode_tma.py`): each
    program reads its row's slot, copies its [K, bv] tile in and straight back out, in place; no register holds
    it. jax 0.11 (2026-12-08)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    n, h, dk, dv = s_pool.shape

    def body(slots_ref, s_ref, tile, bar):
        t, j, i = (jax.lax.axis_index(a) for a in ("t", "h", "n"))
        src = s_ref.at[slots_ref[i], j, :, pl.ds(t * bv, bv)]
        plgpu.copy_gmem_to_smem(src, tile, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(tile, src)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # as decode_tma's kernels exit

    kernel = plgpu.kernel(body, out_type=(), grid=(n, h, dv // bv), grid_names=("n", "h", "t"),  # last fastest
                          scratch_types=[plgpu.SMEM((dk, bv), s_pool.dtype), plgpu.Barrier(num_arrivals=1)])
    pool = jax.new_ref(s_pool)
    kernel(slots, pool)
    return jax.freeze(pool)


def main():
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    copy = copy_tbps()
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    t = dict(pdecode.TUNING)
    for n in NS:
        qkv, conv_w, conv_pool, s_pool, slots, z, beta, gate, norm_w, a_log = decode_inputs(n, H)
        lens = jax.numpy.ones((n,), jax.numpy.int32)
        kw = dict(tuning=t, interpret=False, lower_bound=-5.0, gate_on=True, qk_norm=True)
        pro = lambda cp, sp: (*split.prologue(qkv, conv_w, cp, slots, z, beta, lens, a_log, dk=DK, **kw), sp)
        pre, _, _ = jax.jit(pro)(conv_pool, s_pool)
        us = 1e3 * decode_step_ms(pro, conv_pool, s_pool, STEPS)[0]
        print(f"N = {n}: prologue {us:.1f} us", flush=True)
        first = None
        for over in STATE_TUNINGS:
            ts = dict(t, **over)
            bv = pdecode.block_v_of(ts, DV)
            st = lambda cp, sp, ts=ts, bv=bv: (lambda o, s: (o, cp, s))(
                *split.state(slots, lens, pre, sp, bv=bv, tuning=ts, interpret=False))
            o_raw, _, s_new = jax.jit(st)(conv_pool, s_pool)
            first = first or (o_raw, s_new)
            diff = max(float(jax.numpy.max(abs(a - b))) for a, b in zip((o_raw, s_new), first))
            us = 1e3 * decode_step_ms(st, conv_pool, s_pool, STEPS)[0]
            tbps = 2 * n * H * DK * DV * 4 / us / 1e6
            print(f"N = {n}: state, {over}: {us:.1f} us, {tbps:.2f} TB/s ({tbps / copy:.0%} of copy; "
                  f"output and states vs the first: {diff:.1e})", flush=True)
        ceilings = [(f"block_v {bv}, {'in place' if ip else 'new array'}, {'slot read first' if vs else 'no slot'}",
                     functools.partial(stream, bv=bv, in_place=ip, via_slot=vs))
                    for bv, ip, vs in [(DV, True, True), (DV, True, False), (DV, False, False), (32, True, True),
                                       (32, False, False)]]
        ceilings += [(f"by TMA, block_v {bv}, in place, slot read first", functools.partial(stream_tma, bv=bv))
                     for bv in ((DV, 64, 32) if tma_available() else ())]
        for label, fn in ceilings if CEILING else ():
            us = 1e3 * decode_step_ms(lambda cp, sp, fn=fn: (sp[0, 0, 0], cp, fn(slots, sp)), conv_pool, s_pool,
                                      STEPS)[0]
            tbps = 2 * n * H * DK * DV * 4 / us / 1e6
            print(f"N = {n}: stream ceiling, {label}: {us:.1f} us, {tbps:.2f} TB/s ({tbps / copy:.0%} of copy)",
                  flush=True)
        # the norm of a fixed output, made to depend on the loop's state so that XLA cannot hoist it out
        nm = lambda cp, sp, o_raw=o_raw: (gated_output_norm(o_raw + 0.0 * sp[0, 0, 0, 0], norm_w, gate, 1e-5,
                                                            qkv.dtype), cp, sp)
        print(f"N = {n}: norm (XLA) {1e3 * decode_step_ms(nm, conv_pool, s_pool, STEPS)[0]:.1f} us", flush=True)


if __name__ == "__main__":
    main()
