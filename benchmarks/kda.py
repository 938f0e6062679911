"""KDA kernels side by side on one GPU, in one run: our Pallas prefill and fused decode, fla 0.6.0's
`chunk_kda` / `fused_recurrent_kda` (PyTorch + Triton) and jax-linear-attention 0.1.0's Mosaic GPU KDA
(both optional imports), and our plain-JAX chunked scan (`kda_chunked`, the reference).

Every implementation gets the same bf16 q/k/v, fp32 gate in (-5, 0) and beta, a non-zero fp32 initial
state, and does the q/k L2 norm in its kernel. Errors are max |x - ref| / max |ref| against the
plain-JAX chunked scan in fp32 (full-precision matmuls) on the same bf16-rounded inputs.

    PYTHONPATH=$PWD python3 benchmarks/kda.py [--sweep] [--quick] [--only decode] [--json out.json]

With --sweep the prefill part tries the best one-phase tuning and six of the two-phase kernels (the default;
tuning phases=2: the per-chunk work parallel over (chunk, head), then the serial state kernel) around the
default, varying phase 1's warps, chunks per program and stages, its inverse (substitution or matmul
series) and u0 in bf16, printing
each one's time and errors and reporting the best of each variant; the
decode part tries value tiles (block_v) of 16, 32, 64 and 128 (= V, the default whole-V kernel) with 1 to 4
warps, printing each one's time, bandwidth and errors. --prefill-shapes / --decode-ns / --decode-heads
shrink the shapes (on a CPU the kernels run interpreted: a smoke test, not a measurement), e.g.

    PYTHONPATH=$PWD python3 benchmarks/kda.py --sweep --no-peers --prefill-shapes 1x64x2 --decode-ns 2 --decode-heads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from kimik3_jax.ops.kda import kda_chunked, l2_normalize
from kimik3_jax.ops.kda import kda_decode as kda_decode_ref
from pallas_kernels.kda import decode as pdecode
from pallas_kernels.kda import prefill as pprefill
from pallas_kernels.kda import prefill_two_phase as two_phase
from timing import copy_tbps, device_seconds  # benchmarks/timing.py (this script's directory is on sys.path)

PREFILL_SHAPES = [(1, 8192, 96), (1, 32768, 96), (8, 2048, 12), (16, 4096, 12)]
DECODE_NS = [1, 32, 256]
# decode: value tile (block_v 128 = V: one program per (sequence, head), the default kernel) x warps; the
# value tiles are one launch since 2026-12-02 (their last tile per head norms the row), fla's shape is 32 x 4
DECODE_TUNINGS = [dict(block_v=bv, num_warps=w, num_stages=1)
                  for bv, w in [(128, 4), (64, 2), (64, 4), (32, 1), (32, 2), (32, 4), (16, 1), (16, 2)]]
DK = DV = 128
WIDTH = 4
TUNINGS = [dict(phases=1, chunk=32, block_v=128, num_warps=8, num_stages=2)]  # the best one-phase tuning so far
# two-phase, around the default (chunk 16, tile 64, phase 2 three stages deep; these entries take the
# default's other keys, early stores, v first, e^(G_C) ahead and the transposed phase 2 included): phase 1's
# warps (2 won on 2026-12-01 without early stores, 4 since 2026-12-03 with them), chunks per program and
# stages, its inverse, u0 in bf16 (the default since 2026-12-04) or fp32. Chunk 64
# (9-11 ms), chunk 32 (2.68-3.4 ms), value tiles of 32 or 128 (3.0-3.2 ms) and phase 1 at 1 warp lost in
# the earlier sweeps and are left out.
TWO_PHASE_TUNINGS = [dict(phases=2, chunk=16, block_v=64, num_warps=4, num_stages=3, phase1_warps=w1,
                          phase1_chunks=p1, phase1_stages=s1, u0_bf16=u, phase1_inverse=inv)
                     for w1, p1, s1, u, inv in [(2, 1, 1, False, "substitution"), (2, 1, 1, False, "series"),
                                                (4, 1, 1, False, "series"), (2, 1, 1, True, "substitution"),
                                                (2, 1, 1, True, "series"), (2, 2, 2, False, "substitution")]]


def prefill_bytes(b, t, h, tuning):
    """HBM bytes of one prefill call: bf16 q/k/v in and o out, fp32 gate and beta, fp32 states in and
    out; the two-phase variant adds its workspaces (written once, read once per value tile)."""
    base = b * t * h * (2 * DK * 2 + 4 * DK + 4 + 2 * DV + 2 * DV) + 2 * b * h * DK * DV * 4
    tn = dict(pprefill.TUNING, **tuning)
    if tn.get("phases", 1) != 2:
        return base
    c, tiles = tn["chunk"], DV // min(tn["block_v"], DV)
    n_chunks = b * -(-t // c)
    written = two_phase.workspace_bytes(n_chunks, h, c, DK, DV, tn["u0_bf16"])
    shared = two_phase.workspace_bytes(n_chunks, h, c, DK, 0, tn["u0_bf16"])  # all but u0: read once per tile
    return base + written + shared * tiles + (written - shared)


def bench_jax(f, *args, reps=20):
    """Median wall time (ms) of a jitted call, after a warm-up, blocking on each result."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def decode_step_ms(step, conv_pool, s_pool, steps, reps=10, unroll=10):
    """Back-to-back decode steps `step(cp, sp) -> (o, cp, sp)` in a loop unrolled by `unroll` (each trip of
    XLA's while loop adds its own overhead): (ms per step, ms per step in the `steps`-step call's average).
    The pools are not donated, so each call first copies them (the compiled HLO shows both copies): the
    step time is the difference between a 2 * steps and a steps loop, over steps."""
    t1, t2 = (bench_jax(steps_loop(step, k, unroll), conv_pool, s_pool, reps=reps) for k in (steps, 2 * steps))
    return (t2 - t1) / steps, t1 / steps


def steps_loop(step, k, unroll=1):
    """k decode steps in one jitted loop, -> (the last output, conv_pool, s_pool). The output is carried so
    that no part of a step is dead code: a step whose output XLA computes (the split decode's norm) would
    otherwise be dropped from the loop and go untimed (it was, before 2026-12-06)."""
    def run(cp, sp):
        o = jax.eval_shape(step, cp, sp)[0]
        return jax.lax.fori_loop(0, k, lambda i, c: step(*c[1:]), (jnp.zeros(o.shape, o.dtype), cp, sp),
                                 unroll=min(k, unroll))
    return jax.jit(run)


def rel(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(x - ref).max() / np.abs(ref).max())


G_BOUND = -5.0  # K3's gate bound: the inputs' log decays lie in (G_BOUND, 0), and our kernel is told so


def prefill_inputs(b, t, h, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (b, t, h, DK), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, h, DK), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, h, DV), jnp.bfloat16)
    g = G_BOUND * jax.nn.sigmoid(2.0 * jax.random.normal(keys[3], (b, t, h, DK), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h), jnp.float32))
    s0 = 0.1 * jax.random.normal(keys[5], (b, h, DK, DV), jnp.float32)
    return q, k, v, g, beta, s0


@jax.jit
def reference_prefill(q, k, v, g, beta, s0):
    qn = l2_normalize(q) * DK ** -0.5
    kn = l2_normalize(k)
    return kda_chunked(qn, kn, v.astype(jnp.float32), g, beta, s0)


def ours_prefill(tuning, checkpoint=0):
    """Our prefill, jitted; with `checkpoint` it also returns the states every `checkpoint` tokens."""
    return jax.jit(lambda q, k, v, g, beta, s0: pprefill.kda_prefill(
        q, k, v, g, beta, s0, qk_norm=True, out_dtype=jnp.bfloat16, tuning=tuning, checkpoint=checkpoint,
        lower_bound=G_BOUND))


def run_prefill(args, torch_mods, jla):
    rows = []
    for b, t, h in args.prefill_shapes:
        if args.quick and t * b * h > 8192 * 96:
            continue
        x = prefill_inputs(b, t, h)
        row = dict(shape=(b, t, h))
        ref_o, ref_s = reference_prefill(*x)
        if t * b * h <= 8192 * 96:
            row["xla_ms"] = bench_jax(reference_prefill, *x, reps=5)
        # ours: the default tuning, plus a sweep on request
        best = None
        best_by_phases = {}
        compiled = {}  # one jitted function per tuning, so that --rounds does not compile again
        for tuning in (TUNINGS + TWO_PHASE_TUNINGS if args.sweep else
                       [dict(pprefill.TUNING, **t) for t in args.tunings] * args.rounds if args.tunings
                       else [pprefill.TUNING]):
            try:
                key = json.dumps(tuning, sort_keys=True)
                f = compiled[key] = compiled.get(key) or ours_prefill(tuning, args.checkpoint)
                ms, wall = 1e3 * device_seconds(f, *x, calls=10), bench_jax(f, *x, reps=args.reps)
                o, s = f(*x)[:2]
                errs = (rel(o, ref_o), rel(s, ref_s))
            except Exception as e:  # noqa: BLE001  a tuning that does not compile is skipped, and reported
                print(f"  tuning {tuning} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tbps = prefill_bytes(b, t, h, tuning) / ms / 1e9
            print(f"  ours {(b, t, h)} {tuning}: {ms:.3f} ms (device; {wall:.3f} wall per call), {tbps:.2f} TB/s, "
                  f"err o / state {errs[0]:.1e} / {errs[1]:.1e}")
            if best is None or ms < best[0]:
                best = (ms, tuning, errs)
                row["ours_wall_ms"] = wall
            phases = tuning.get("phases", 1)
            if phases not in best_by_phases or ms < best_by_phases[phases][0]:
                best_by_phases[phases] = (ms, tuning, errs)
        ms, tuning, errs = best
        row.update(ours_ms=ms, ours_tuning=tuning, ours_err_o=errs[0], ours_err_s=errs[1])
        for phases, (p_ms, p_tuning, p_errs) in sorted(best_by_phases.items()):
            row.update({f"ours_{phases}phase_ms": p_ms, f"ours_{phases}phase_tuning": p_tuning,
                        f"ours_{phases}phase_err_o": p_errs[0], f"ours_{phases}phase_err_s": p_errs[1]})
        if jla is not None:
            try:
                fj = jax.jit(lambda q, k, v, g, beta, s0: jla.linear_attention(
                    "kda", q, k, v, impl="mosaic_gpu", g=g, beta=beta, initial_state=s0,
                    output_final_state=True, use_qk_l2norm=True))
                row["jla_ms"], row["jla_wall_ms"] = 1e3 * device_seconds(fj, *x, calls=10), bench_jax(fj, *x)
                o, s = fj(*x)
                row.update(jla_err_o=rel(o, ref_o), jla_err_s=rel(s, ref_s))
            except Exception as e:  # noqa: BLE001
                print(f"  jla failed: {type(e).__name__}: {str(e)[:300]}")
        if torch_mods is not None:
            torch, chunk_kda, _, do_bench = torch_mods
            tx = [torch.from_dlpack(a) for a in x]
            fn = lambda: chunk_kda(*tx[:5], initial_state=tx[5], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
            try:
                o, s = fn()
                row["fla_ms"] = float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
                row.update(fla_err_o=rel(o.float().cpu().numpy(), ref_o), fla_err_s=rel(s.float().cpu().numpy(), ref_s))
            except Exception as e:  # noqa: BLE001
                print(f"  fla failed: {type(e).__name__}: {str(e)[:300]}")
            del tx
        peers = [row[k] for k in ("fla_ms", "jla_ms") if k in row]
        if peers:
            row["speedup_vs_best_peer"] = min(peers) / row["ours_ms"]
        # tensor-core work of the chunked form (per token and head: 2*(C K + C K + C K + C V + 3 K V + C V))
        c = dict(pprefill.TUNING, **row["ours_tuning"])["chunk"]
        flops = 2 * b * t * h * (3 * c * DK + 2 * c * DV + 3 * DK * DV)
        bytes_ = prefill_bytes(b, t, h, row["ours_tuning"])
        row["ours_tflops"] = flops / row["ours_ms"] / 1e9
        row["ours_tbps"] = bytes_ / row["ours_ms"] / 1e9
        print(json.dumps(row))
        rows.append(row)
        del x, ref_o, ref_s
    return rows


def decode_inputs(n, h, seed=1):
    keys = jax.random.split(jax.random.key(seed), 9)
    c = h * DK
    qkv = jax.random.normal(keys[0], (n, 3, c), jnp.bfloat16)
    conv_w = 0.5 * jax.random.normal(keys[1], (3, c, WIDTH), jnp.float32)
    conv_pool = jax.random.normal(keys[2], (n, 3, WIDTH - 1, c), jnp.bfloat16)
    s_pool = 0.1 * jax.random.normal(keys[3], (n, h, DK, DV), jnp.float32)
    slots = jax.random.permutation(keys[4], n).astype(jnp.int32)
    z = 3 * jax.random.normal(keys[5], (n, h, DK), jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[6], (n, h), jnp.float32))
    gate = jax.random.normal(keys[7], (n, h, DV), jnp.float32)
    norm_w = 1 + 0.1 * jax.random.normal(keys[8], (DV,), jnp.float32)
    a_log = jnp.linspace(-1, 1, h, dtype=jnp.float32)
    return qkv, conv_w, conv_pool, s_pool, slots, z, beta, gate, norm_w, a_log


def decode_step_bytes(qkv, conv_pool, s_pool, z, beta, gate) -> int:
    """The bytes a decode step of these N rows must move: each row's state read and written, its conv tails
    read and written, its inputs (q/k/v projections, gate and beta pre-activations, the output gate) read and
    its output (qkv's dtype) written; the split's intermediate rows are not counted."""
    n, h = beta.shape
    per_slot = lambda pool: pool.nbytes // pool.shape[0]
    out = n * h * DV * qkv.dtype.itemsize
    return n * 2 * (per_slot(s_pool) + per_slot(conv_pool)) + qkv.nbytes + z.nbytes + beta.nbytes + gate.nbytes + out


def run_decode(args, torch_mods):
    rows = []
    h = args.decode_heads
    steps = 100
    for n in args.decode_ns:
        qkv, conv_w, conv_pool, s_pool, slots, z, beta, gate, norm_w, a_log = decode_inputs(n, h)
        kw = dict(eps=1e-5, a_log=a_log, lower_bound=-5.0)
        o_ref, c_ref, s_ref = jax.jit(lambda *a: kda_decode_ref(*a, **kw))(
            qkv, conv_w, conv_pool, s_pool, slots, z, beta, gate, norm_w)
        row = dict(n=n, h=h)
        best = None
        tunings = args.decode_tunings or (DECODE_TUNINGS if args.sweep else [{}])
        for tuning in tunings:
            step = lambda cp, sp, t=tuning: pdecode.kda_decode(
                qkv, conv_w, cp, sp, slots, z, beta, gate, norm_w, tuning=t, **kw)

            # back-to-back steps on the GPU: the kernel time, not dispatch (a step inside a model has kernels
            # beside it, not a loop trip); the rolled loop is reported beside it
            rolled_loop = steps_loop(step, steps)
            try:
                o, c2, s2 = jax.jit(step)(conv_pool, s_pool)
                errs = (rel(o, o_ref), rel(s2, s_ref), rel(c2, c_ref))
                ms, per_call = decode_step_ms(step, conv_pool, s_pool, steps)
                rolled = bench_jax(rolled_loop, conv_pool, s_pool, reps=10) / steps
                one = bench_jax(jax.jit(step), conv_pool, s_pool, reps=50)
            except Exception as e:  # noqa: BLE001  a tuning that does not compile is skipped, and reported
                print(f"  decode N={n} tuning {tuning} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tbps = 2 * n * h * DK * DV * 4 / ms / 1e9
            print(f"  decode N={n} {tuning}: {1e3 * ms:.1f} us/step ({tbps:.2f} TB/s) by difference, "
                  f"{1e3 * per_call:.1f} us in the {steps}-step unrolled loop's average, {1e3 * rolled:.1f} rolled, "
                  f"{1e3 * one:.1f} us per call, err o / state / conv {errs[0]:.1e} / {errs[1]:.1e} / {errs[2]:.1e}")
            if best is None or ms < best[0]:
                best = (ms, one, tuning, errs, rolled, per_call)
        ms, one, tuning, errs, rolled, per_call = best
        state_bytes = 2 * n * h * DK * DV * 4
        step_bytes = decode_step_bytes(qkv, conv_pool, s_pool, z, beta, gate)
        row.update(ours_us=1e3 * ms, ours_loop_us=1e3 * per_call, ours_rolled_us=1e3 * rolled, ours_call_us=1e3 * one,
                   step_bytes=step_bytes, ours_all_tbps=step_bytes / ms / 1e9, ours_tuning=tuning,
                   ours_err_o=errs[0], ours_err_s=errs[1], ours_err_conv=errs[2],
                   ours_tbps=state_bytes / ms / 1e9)
        if torch_mods is not None:
            torch, _, fused_recurrent_kda, do_bench = torch_mods
            dev = "cuda"
            tq, tk = (torch.randn(n, 1, h, DK, device=dev, dtype=torch.bfloat16) for _ in range(2))
            tv = torch.randn(n, 1, h, DV, device=dev, dtype=torch.bfloat16)
            tg = -5 * torch.sigmoid(torch.randn(n, 1, h, DK, device=dev))
            tb = torch.sigmoid(torch.randn(n, 1, h, device=dev))
            ts = 0.1 * torch.randn(n, h, DK, DV, device=dev)
            fn = lambda: fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=ts,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
            try:
                us = 1e3 * float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
                row.update(fla_us=us, fla_tbps=state_bytes / us / 1e6)
                # CUDA-graph replay: fla's kernels without PyTorch's per-call dispatch (the peer of our
                # unrolled loop)
                from triton.testing import do_bench_cudagraph
                us = 1e3 * float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
                row.update(fla_graph_us=us, fla_graph_tbps=state_bytes / us / 1e6)
            except Exception as e:  # noqa: BLE001
                print(f"  fla decode failed: {type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(row))
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", action="store_true", help="try several kernel tunings, report the best")
    ap.add_argument("--quick", action="store_true", help="skip the largest prefill shapes")
    ap.add_argument("--tunings", type=json.loads, default=None,
                    help='prefill: a JSON list of overrides of the default tuning to time in its place, e.g. '
                         '\'[{}, {"phase2_transposed": true}]\'')
    ap.add_argument("--decode-tunings", type=json.loads, default=None,
                    help='decode: a JSON list of overrides of the default tuning, each timed, e.g. \'[{}, {"block_v": 32}]\'')
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the --tunings this many times in turn (A B A B ...: same-run comparisons)")
    ap.add_argument("--checkpoint", type=int, default=0,
                    help="prefill: ours also returns the state every this many tokens (prefix caching)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", choices=("prefill", "decode"), default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefill-shapes", type=lambda a: [tuple(int(y) for y in x.split("x")) for x in a.split(",")],
                    default=PREFILL_SHAPES, help="prefill (B, T, H) shapes as BxTxH, comma-separated")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per prefill tuning (median)")
    ap.add_argument("--decode-ns", type=lambda a: [int(x) for x in a.split(",")], default=DECODE_NS,
                    help="decode batch sizes, comma-separated (default 1,32,256)")
    ap.add_argument("--decode-heads", type=int, default=96, help="decode heads (default 96, K3's)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    torch_mods = jla = None
    if not args.no_peers:
        try:
            import torch
            from fla.ops.kda import chunk_kda, fused_recurrent_kda
            from triton.testing import do_bench
            torch_mods = (torch, chunk_kda, fused_recurrent_kda, do_bench)
        except Exception as e:  # noqa: BLE001
            print(f"fla not available: {e}")
        try:
            import jla.ops as jla
        except Exception as e:  # noqa: BLE001
            print(f"jax-linear-attention not available: {e}")
    result = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, device=jax.devices()[0].device_kind,
                  prefill=run_prefill(args, torch_mods, jla) if args.only != "decode" else [],
                  decode=run_decode(args, torch_mods) if args.only != "prefill" else [])
    if result["decode"]:  # the ceiling the decode's rates are read against, measured in the same run
        result["copy_tbps"] = copy_tbps(2 ** 30 if jax.devices()[0].platform == "gpu" else 2 ** 20)
        print(f"copy bandwidth {result['copy_tbps']:.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("\nDevice time per call (ours, jla: timing.device_seconds; fla: do_bench), and the per-call wall time:")
    print("\n| (B, T, H) | ours ms | one-phase ms | two-phase ms | fla ms | jla ms | xla ms (wall) "
          "| speedup vs best peer | ours / jla wall ms | err ours / fla / jla |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in result["prefill"]:
        fmt = lambda k: f"{r[k]:.3f}" if k in r else "-"
        errs = " / ".join(f"{r[k]:.1e}" if k in r else "-" for k in ("ours_err_o", "fla_err_o", "jla_err_o"))
        sp = f"{r['speedup_vs_best_peer']:.2f}x" if "speedup_vs_best_peer" in r else "-"
        print(f"| {r['shape']} | {fmt('ours_ms')} | {fmt('ours_1phase_ms')} | {fmt('ours_2phase_ms')} "
              f"| {fmt('fla_ms')} | {fmt('jla_ms')} | {fmt('xla_ms')} | {sp} "
              f"| {fmt('ours_wall_ms')} / {fmt('jla_wall_ms')} | {errs} |")
    print(f"\n| decode N (H={args.decode_heads}) | ours us/step (by difference / 100-step loop average / rolled) "
          "| ours us/call | ours TB/s of state (of copy) | ours TB/s of all the step's bytes (of copy) "
          "| ours block_v, warps (split: three launches) | fla us (do_bench / graph) | fla TB/s of state (graph; of copy) "
          "| err o / state |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    copy = result.get("copy_tbps", float("nan"))
    for r in result["decode"]:
        fla = (f"{r['fla_us']:.1f} / {r.get('fla_graph_us', float('nan')):.1f} | "
               f"{r.get('fla_graph_tbps', float('nan')):.2f} ({r.get('fla_graph_tbps', float('nan')) / copy:.0%})") \
            if "fla_us" in r else "- | -"
        t = dict(pdecode.TUNING, **r["ours_tuning"])
        print(f"| {r['n']} | {r['ours_us']:.1f} / {r['ours_loop_us']:.1f} / {r['ours_rolled_us']:.1f} | "
              f"{r['ours_call_us']:.1f} | "
              f"{r['ours_tbps']:.2f} ({r['ours_tbps'] / copy:.0%}) | "
              f"{r['ours_all_tbps']:.2f} ({r['ours_all_tbps'] / copy:.0%}) | "
              f"{t['block_v'] or DV}, {t['num_warps']}{', split' * pdecode.splits(t, r['n'])} | "
              f"{fla} | "
              f"{r['ours_err_o']:.1e} / {r['ours_err_s']:.1e} |")


if __name__ == "__main__":
    main()
