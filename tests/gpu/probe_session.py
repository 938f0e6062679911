"""GPU probe (2026-11-29 session): (A) the decode test's N = 32 failure: kernel vs the op on the GPU and
on the host CPU, active and inactive rows apart; (B) the two-phase prefill's phase-1 share of the time (the default,
and the default with phase 1 at 4 warps);
(C) MoE decode="fast" vs "exact" at K3 widths, 16 tokens: how far apart and where."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "tests/gpu")
from kimik3_jax.ops.kda import kda_decode as op  # noqa: E402
from pallas_kernels.kda import prefill as pp  # noqa: E402
from pallas_kernels.kda import prefill_two_phase as tp  # noqa: E402
from pallas_kernels.kda.decode import kda_decode  # noqa: E402

D = 128
rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()  # noqa: E731
                         / max(np.abs(np.asarray(b, np.float64)).max(), 1e-30))


def part_a():
    from test_kda_gpu import decode_case
    n = 32
    args, kw = decode_case(n)
    lengths, slots, pool = kw["lengths"], args[4], args[3].shape[0]
    g = jax.jit(lambda *a: op(*a, **kw))(*args)
    cpu = jax.devices("cpu")[0]
    host_kw = jax.device_put(kw, cpu)
    with jax.default_device(cpu):
        c = jax.jit(lambda *a: op(*a, **host_kw))(*jax.device_put(args, cpu))
    act = np.asarray(lengths) > 0
    sl = np.asarray(slots)
    for tuning in (None, dict(block_v=64, num_warps=4), dict(block_v=128, num_warps=4)):
        k = jax.jit(lambda *a: kda_decode(*a, tuning=tuning, **kw))(*args)
        print("A tuning", tuning, flush=True)
        for name, i in (("o", 0), ("conv", 1), ("state", 2)):
            kk, gg, cc = (np.asarray(x[i], np.float32) for x in (k, g, c))
            print(f"  {name}: kernel-gpuop {rel(kk, gg):.2e} kernel-cpuop {rel(kk, cc):.2e} gpuop-cpuop {rel(gg, cc):.2e}")
            if name == "o":
                print(f"    active rows kernel-cpuop {rel(kk[act], cc[act]):.2e}, inactive {rel(kk[~act], cc[~act]):.2e}")
            else:
                for lab, rows in (("active slots", sl[act]), ("inactive slots", sl[~act]),
                                  ("unused slots", np.setdiff1d(np.arange(pool), sl))):
                    print(f"    {lab} kernel-cpuop {rel(kk[rows], cc[rows]):.2e} gpuop-cpuop {rel(gg[rows], cc[rows]):.2e}")


def part_b():
    from kda import bench_jax as timed
    from kda import prefill_inputs
    shapes = ((1, 64, 2),) if os.environ.get("PROBE_SMALL") else ((1, 8192, 96), (16, 4096, 12))
    for shape in shapes:
        b, t, h = shape
        x = prefill_inputs(b, t, h)
        for tuning in (dict(phases=2), dict(phases=2, phase1_warps=4)):  # the default, and its 4-warp phase 1
            tn = pp._tuning(tuning)
            whole = jax.jit(lambda *a: pp.kda_prefill(*a, qk_norm=True, out_dtype=jnp.bfloat16, tuning=tuning,
                                                      lower_bound=-5.0))
            c = tn["chunk"]
            n_chunks = b * -(-t // c)
            cu = (jnp.arange(b + 1) * t).astype(jnp.int32)

            def p1(q, k, v, g, beta, s0, c=c, tn=tn, n_chunks=n_chunks, cu=cu):
                _, t0, eos, end = tp.chunk_table(cu, cu[1:], c, n_chunks)
                fl = lambda z: z.reshape(b * t, *z.shape[2:])  # noqa: E731
                return tp.phase1(t0, eos, end, jnp.zeros((h,), jnp.float32), fl(q), fl(k), fl(v), fl(g), fl(beta),
                                 heads=h, chunk=c, lower_bound=0.0, gate=False, qk_norm=True, n_chunks=n_chunks,
                                 interpret=jax.default_backend() != "gpu", tuning=tn)
            tw, t1 = timed(whole, *x), timed(jax.jit(p1), *x)
            print(f"B {shape} {tuning}: whole {tw:.3f} ms, phase 1 {t1:.3f} ms, phase 2 ~{tw - t1:.3f} ms "
                  f"= {1e3 * (tw - t1) / -(-t // c):.2f} us per chunk step", flush=True)


def part_c():
    import moe as bm
    ex = bm._random_experts(jax.random.PRNGKey(0), bm.E)
    for n in (16, 1):
        xl, idx, w = bm.routing(n, n)
        cfg = bm.kern.fit(bm.kern.choose_config(n * bm.K_TOP, bm.E), bm.L, bm.F)
        outs = {}
        for dec in ("exact", "fast"):
            lay, gu, dn, whole = bm.kernel_parts(cfg, dec)
            lo = lay(idx, w)
            hh = gu(xl, lo, ex)
            outs[dec] = (np.asarray(hh, np.float32), np.asarray(dn(hh, lo, ex), np.float32),
                         np.asarray(whole(xl, idx, w, ex), np.float32))
        # down on the same h (exact's), to split the two kernels
        lay, gu, dn, whole = bm.kernel_parts(cfg, "fast")
        lo = lay(idx, w)
        dn_fast_same_h = np.asarray(dn(jnp.asarray(outs["exact"][0], jnp.bfloat16), lo, ex), np.float32)
        for i, name in enumerate(("gate_up h", "down", "whole")):
            a, b_ = outs["exact"][i], outs["fast"][i]
            print(f"C n={n} {cfg} {name}: rel {rel(b_, a):.2e}, differing {np.sum(a != b_)} of {a.size}", flush=True)
        a = outs["exact"][1]
        print(f"C n={n} down(fast) on exact's h: rel {rel(dn_fast_same_h, a):.2e}, differing {np.sum(a != dn_fast_same_h)}")


for part in sys.argv[1:] or "abc":
    try:
        {"a": part_a, "b": part_b, "c": part_c}[part]()
    except Exception as e:  # noqa: BLE001
        print("part", part, "failed:", type(e).__name__, str(e)[:500], flush=True)
