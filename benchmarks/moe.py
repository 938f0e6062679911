"""Routed-expert GEMMs at K3's widths on one GPU: the MXFP4 Pallas kernels against their peers, one table.

    PYTHONPATH=$PWD python3 benchmarks/moe.py [--tokens 1,16,64,512,4096,16384] [--out DIR] [--budget-s 300]

Per token count (uniform top-16 of 896 routing): our kernels (gate+up with SiTU, down with routing weights,
and the whole `routed_experts` incl. dispatch and combine; with the decode the model runs on these experts,
`routed.decoder_for` with their largest scale byte: asm1r-unchecked; --decode overrides it) as TB/s of the
active experts' MXFP4 bytes and TFLOP/s of dequantised bf16 math; at prefill token counts on the GPU also the
Mosaic GPU prefill path (`routed_mgpu`: its two kernels alone and the whole path, against the Triton whole
path and checked against the capacity einsum; --no-mgpu leaves it out); a diagnostic run of the same kernels
with the decode replaced by a bare reinterpretation of the bytes (wrong values, same reads: the gap is the
decode's ALU cost) and with decode="exact" (the longer decode of the same bits), both at 16, 512 and 16384
tokens; peers in the same process: `torch._grouped_mm` on bf16 weights (gate+up fused N = 6144, and down),
`lax.ragged_dot` on dequantised bf16 weights, and a dense batched einsum with a dropless capacity (the largest
group) on dequantised bf16 weights; the copy bandwidth (XLA elementwise, 4 GiB fp32 read + write). Correctness
at these shapes: the kernel against the capacity einsum (both dequantise + fp32 sums) at every token count,
and against the pure op (`routed_experts`, "gathered") at 1 and 16 tokens. Results go to DIR/moe.json. Every
JAX call is timed as device time per call (benchmarks/timing.py, since 2026-12-03; before, calls over 2 ms
were timed one by one from the host), as do_bench times the torch peer. Set
XLA_PYTHON_CLIENT_PREALLOCATE=false (PyTorch shares the GPU); the PyTorch part runs first and frees its
memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from functools import cache, partial

# JAX's allocator stops at 75% of the GPU's memory by default, also without preallocation. The peers hold
# the bf16 experts (59 GB) beside the MXFP4 ones (16 GB), and XLA's GEMM autotuner copies an 18.4 GiB
# operand: at 75% that ran out of memory on the H200 (2026-11-29).
if not (os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")):
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.95"

import jax
import jax.numpy as jnp
import numpy as np

from kimik3_jax.checkpoint.open import expert_scale_max
from kimik3_jax.mxfp4 import dequantize
from kimik3_jax.ops.common import situ
from kimik3_jax.ops.moe import routed_experts
from kimik3_jax.params import ExpertParams
from pallas_kernels.moe import dispatch as dsp
from pallas_kernels.moe import routed as kern
from pallas_kernels.moe import routed_mgpu as rm
from pallas_kernels.moe.kernels import TileConfig, down, gate_up
from timing import copy_tbps, device_seconds  # benchmarks/timing.py (this script's directory is on sys.path)

E, K_TOP, L, F = 896, 16, 3584, 3072
BETA, LINEAR_BETA = 4.0, 25.0
T0 = time.perf_counter()
MGPU_MATMUL = None  # the Mosaic GPU path's grouped GEMM: None, the kernel; --small on the CPU: its reference
RESULTS: dict = {"rows": [], "errors": [], "sweep": [], "checks": []}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def save(out):
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "moe.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=float)


def timeit(fn, *args, reps=None):
    """Device seconds per call (`timing.device_seconds`: back-to-back batches, the host's costs cancelling;
    3 pairs of batches by default, as the time budgets of the sweeps were set for about 7 calls per timing)."""
    return device_seconds(fn, *args, reps=reps or 3)


@partial(jax.jit, static_argnums=(1,))
def _random_experts(key, num):
    ks = jax.random.split(key, 6)
    packed = lambda k, r, c: jax.random.bits(k, (num, r, c // 2), jnp.uint8)
    # scale bytes 119..120: weights of RMS ~ 1/sqrt(fan_in) for uniform random nibbles
    scale = lambda k, r, c: jax.random.randint(k, (num, r, c // 32), 119, 121).astype(jnp.uint8)
    return ExpertParams(packed(ks[0], F, L), scale(ks[1], F, L), packed(ks[2], F, L), scale(ks[3], F, L),
                        packed(ks[4], L, F), scale(ks[5], L, F))


def routing(n, seed):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    idx = jax.lax.top_k(jax.random.uniform(k1, (n, E)), K_TOP)[1].astype(jnp.int32)
    w = jax.random.uniform(k2, (n, K_TOP), jnp.float32, 0.02, 0.1)
    xl = jax.random.normal(k3, (n, L), jnp.float32).astype(jnp.bfloat16)
    return xl, idx, w


def dense_bf16(ex):
    """Dequantised bf16 copies of all experts (w1, w3 [E, F, L], w2 [E, L, F]), 64 experts at a time."""
    out = []
    upd = jax.jit(lambda buf, p, s, i: jax.lax.dynamic_update_slice(buf, dequantize(p, s), (i, 0, 0)),
                  donate_argnums=0)
    for p, s in ((ex.w1_packed, ex.w1_scale), (ex.w3_packed, ex.w3_scale), (ex.w2_packed, ex.w2_scale)):
        buf = jnp.zeros(p.shape[:-1] + (2 * p.shape[-1],), jnp.bfloat16)
        for i in range(0, E, 64):
            buf = upd(buf, p[i:i + 64], s[i:i + 64], i)
        out.append(buf)
    return out


def make_capacity_einsum(cap):
    @jax.jit
    def f(xl, idx, w, w1, w3, w2):
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=E)
        start = jnp.cumsum(sizes) - sizes
        rank = jnp.argsort(order) - start[flat]  # position of each pair inside its expert's group
        slot = flat * cap + rank
        tok = jnp.zeros((E * cap,), jnp.int32).at[slot].set(jnp.arange(n * k) // k)
        xs = xl[tok].reshape(E, cap, L)
        mm = lambda a, b: jnp.einsum("ecl,efl->ecf", a, b, preferred_element_type=jnp.float32)
        h = situ(mm(xs, w1), mm(xs, w3), BETA, LINEAR_BETA).astype(jnp.bfloat16)
        y = mm(h, w2).reshape(E * cap, L)[slot]  # [n*k, L]
        return jnp.einsum("nk,nkl->nl", w, y.reshape(n, k, L))
    return f


def ragged(xl, idx, w, w1, w3, w2):
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w1.shape[0]).astype(jnp.int32)
    xs = xl[order // k]
    rd = lambda a, b: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), sizes,
                                         preferred_element_type=jnp.float32)
    h = situ(rd(xs, w1), rd(xs, w3), BETA, LINEAR_BETA).astype(jnp.bfloat16)
    y = rd(h, w2)[jnp.argsort(order)]
    return jnp.einsum("nk,nkl->nl", w, y.reshape(n, k, L))


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max(axis=-1, keepdims=True)
    finite = bool(np.isfinite(got).all())
    return float(np.max(np.abs(got - want) / np.where(scale > 0, scale, 1))), finite


def torch_peer(tokens):
    """torch._grouped_mm on bf16 weights, experts sorted outside the timing: gate+up fused and down."""
    import torch
    from triton.testing import do_bench
    dev = "cuda"
    out = {}
    try:
        w13 = torch.randn(E, 2 * F, L, dtype=torch.bfloat16, device=dev).transpose(1, 2)  # [E, L, 2F]
        w2 = torch.randn(E, L, F, dtype=torch.bfloat16, device=dev).transpose(1, 2)  # [E, F, L]
        for n in tokens:
            g = torch.Generator(device=dev).manual_seed(n)
            idx = torch.rand(n, E, device=dev, generator=g).topk(K_TOP, dim=-1).indices.reshape(-1)
            sizes = torch.bincount(idx, minlength=E)
            offs = torch.cumsum(sizes, 0).to(torch.int32)
            a = torch.randn(n * K_TOP, L, dtype=torch.bfloat16, device=dev)
            h = torch.randn(n * K_TOP, F, dtype=torch.bfloat16, device=dev)
            row = {}
            try:
                row["gate_up_ms"] = do_bench(partial(torch._grouped_mm, a, w13, offs=offs), warmup=5, rep=40)
                row["down_ms"] = do_bench(partial(torch._grouped_mm, h, w2, offs=offs), warmup=5, rep=40)
            except Exception as ex:  # noqa: BLE001
                row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            out[n] = row
            log("torch", n, row)
        w13 = w2 = None  # free before JAX allocates
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return out


def sweep_configs(base, extra=()):
    """The default tiles, each MMA shaping of `Tiles` (swap, split, both) on them, and the `extra` changes
    (dicts of Tiles fields) with both shapings on."""
    both = lambda **kw: TileConfig(base.bm, replace(base.gate_up, **kw), replace(base.down, **kw))  # noqa: E731
    out = [base, both(swap=True), both(split=True), both(swap=True, split=True)]
    return out + [both(swap=True, split=True, **kw) for kw in extra]


def kernel_parts(cfg, decode=kern.DEFAULT_DECODE):
    """Jitted (layout, gate_up, down, whole) for timing each part. The experts are arguments, never
    closed over: jit would embed closed-over arrays in the program as constants (gigabytes here)."""
    lay = jax.jit(lambda i, ww: dsp.block_layout(i, ww, E, cfg.bm))
    gu = jax.jit(lambda x, lo, ex: gate_up(x, lo.tile_expert, lo.slot_token, ex.w1_packed, ex.w1_scale,
                                           ex.w3_packed, ex.w3_scale, BETA, LINEAR_BETA, cfg.bm, cfg.gate_up,
                                           None, decode))
    dn = jax.jit(lambda h, lo, ex: down(h, lo.tile_expert, lo.slot_weight, ex.w2_packed, ex.w2_scale, cfg.bm,
                                        cfg.down, None, decode))
    return lay, gu, dn, kernel_fn(cfg, decode)


@cache
def kernel_fn(cfg=None, decode=kern.DEFAULT_DECODE):
    """The whole kernel path, jitted: (xl, idx, w, experts) -> [N, L]. Cached, so that the checks reuse the
    programs compiled for the timings."""
    return jax.jit(lambda x, i, ww, ex: kern.routed_experts(x, i, ww, ex, BETA, LINEAR_BETA, config=cfg,
                                                            interpret=None, decode=decode))


def measure_kernels(ex, n, cfg, decode=kern.DEFAULT_DECODE):
    cfg = kern.fit(cfg, L, F)
    xl, idx, w = routing(n, n)
    lay, gu, dn, whole = kernel_parts(cfg, decode)
    lo = lay(idx, w)
    h = gu(xl, lo, ex)
    return {"gate_up_s": timeit(gu, xl, lo, ex), "down_s": timeit(dn, h, lo, ex),
            "whole_s": timeit(whole, xl, idx, w, ex)}


@cache
def mgpu_fn(scale_max):
    """The Mosaic GPU prefill path, whole and jitted, as the model runs it (`Runtime.expert_scale_max` given)."""
    return jax.jit(lambda x, i, ww, ex: rm.routed_experts_mgpu(x, i, ww, ex, BETA, LINEAR_BETA, scale_max=scale_max,
                                                                matmul_t=MGPU_MATMUL))


def measure_mgpu(ex, n, scale_max):
    """The Mosaic GPU prefill path (`routed_mgpu`, TUNING) at n tokens: its two kernels alone on one dispatch,
    and the whole path (dispatch, planes, kernels, combine)."""
    xl, idx, w = routing(n, n)
    path = rm.stages(pairs=idx.size, num_experts=E, scale_max=scale_max, matmul_t=MGPU_MATMUL)
    lo = jax.jit(lambda i, ww: dsp.block_layout(i, ww, E, path.tile_t))(idx, w)
    planes = jax.jit(path.planes, static_argnums=2)(xl, lo, E)
    gu = jax.jit(lambda lo, p, e: path.gate_up(lo, p, e, BETA, LINEAR_BETA))
    h_t = gu(lo, planes, ex)
    return {"gate_up_s": timeit(gu, lo, planes, ex), "down_s": timeit(jax.jit(path.down), lo,
                                                                                   h_t, ex),
            "whole_s": timeit(mgpu_fn(scale_max), xl, idx, w, ex)}


def record_check(tokens, vs, got, want):
    err, finite = rel_err(got, want)
    RESULTS["checks"].append({"tokens": tokens, "vs": vs, "max_rel_err": err, "finite": finite})
    log("check vs", vs, tokens, err, finite)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,512,4096,16384")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="stop after the tile sweep (an exploration run)")
    ap.add_argument("--decode", default=None,
                    help="the rows' decode (a DECODERS name); default: the one the model runs on these experts "
                         "(`routed.decoder_for` with their largest scale byte, as the loader sets "
                         "Runtime.expert_scale_max: asm1r-unchecked for the generated ones, bytes 119..120)")
    ap.add_argument("--candidates", type=json.loads, default=None,
                    help='the sweep\'s candidates in place of the built-in ones, each after its regime\'s default: '
                         'a JSON list of {"regime": "decode" or "prefill", "config": {"bm": .., "gate_up": {Tiles '
                         'fields}, "down": {..}} (default: the regime\'s tiles), "decode": a DECODERS name, by '
                         'default the rows\' decode for those tiles}')
    ap.add_argument("--sweep-tokens", type=int, default=512,
                    help="the token count at which the sweep times the decode regime's candidates")
    ap.add_argument("--ragged-full", action="store_true",
                    help="also try lax.ragged_dot with all 896 experts (ANCHORS: it does not compile there)")
    ap.add_argument("--no-mgpu", action="store_true",
                    help="leave out the Mosaic GPU prefill path's rows (timed by default at prefill token counts on "
                         "the GPU, when its kernels take the widths)")
    ap.add_argument("--small", action="store_true",
                    help="tiny widths: a dry run of the script on the CPU (the Mosaic GPU rows with the kernel's "
                         "pure-JAX reference in its place)")
    args = ap.parse_args()
    if args.small:
        global E, K_TOP, L, F, MGPU_MATMUL
        E, K_TOP, L, F = 16, 4, 256, 256  # the smallest widths the Mosaic GPU path takes
        if jax.devices()[0].platform != "gpu":
            MGPU_MATMUL = rm.reference_matmul_t
    tokens = [int(t) for t in args.tokens.split(",")]
    late = lambda frac=1.0: time.perf_counter() - T0 > frac * args.budget_s
    RESULTS["meta"] = {"jax": jax.__version__, "device": str(jax.devices()[0]), "date": time.strftime("%F")}

    if not args.no_torch:
        try:
            RESULTS["torch"] = torch_peer(tokens)
        except Exception as ex:  # noqa: BLE001
            RESULTS["errors"].append(f"torch peer: {type(ex).__name__}: {str(ex)[:300]}")
            log("torch peer failed", ex)
        save(args.out)

    RESULTS["copy_tb_s"] = copy_tbps(2 ** 20 if args.small else 2 ** 30)
    log("copy bandwidth TB/s", RESULTS["copy_tb_s"])
    ex = jax.block_until_ready(_random_experts(jax.random.PRNGKey(0), E))
    scale_max = expert_scale_max(ex)  # as the loader sets Runtime.expert_scale_max
    RESULTS["meta"]["expert_scale_max"] = scale_max
    def rows_decode(cfg):  # --decode, or the decode the model runs on these experts with tiles cfg
        return args.decode or kern.decoder_for(kern.DEFAULT_DECODE, scale_max, cfg)
    RESULTS["meta"]["decode"] = rows_decode(None)
    mgpu = not args.no_mgpu and (jax.devices()[0].platform == "gpu" or MGPU_MATMUL is not None) and rm.fits(L, F)
    log("experts generated; largest scale byte", scale_max, "; Mosaic GPU prefill rows:", mgpu)

    # Tile sweep: a few candidates per regime, at a representative token count each.
    best = {"decode": kern.DECODE, "prefill": kern.PREFILL}
    if not args.no_sweep:
        # (tiles, decode named by the candidate or None: the rows' decode on those tiles)
        cands = {"decode": (args.sweep_tokens, [(c, None) for c in sweep_configs(kern.DECODE, [dict(bk=256)])]),
                 "prefill": (4096, [(c, None) for c in sweep_configs(kern.PREFILL, [dict(bk=128, num_stages=3)])])}
        if args.candidates is not None:
            cands = {r: (n, cs[:1] + [(TileConfig.from_dict(c["config"]) if "config" in c else cs[0][0],
                                       c.get("decode")) for c in args.candidates if c["regime"] == r])
                     for r, (n, cs) in cands.items() if any(c["regime"] == r for c in args.candidates)}
        for regime, (n, cs) in cands.items():
            scores, default_out = [], None  # the default tiles' output (cs[0]), once it ran
            xl, idx, w = routing(n, n)
            for i, (c, named) in enumerate(cs):
                if late(0.9 if args.sweep_only else 0.45):
                    break
                decode = named or rows_decode(c)
                try:
                    r = measure_kernels(ex, n, c, decode)
                    if named is None:  # the best tiles are chosen for the rows' decode
                        scores.append((r["gate_up_s"] + r["down_s"], c))
                    RESULTS["sweep"].append({"regime": regime, "tokens": n, "config": repr(c), "decode": decode, **r})
                    log("sweep", regime, n, c, decode, r)
                    got = kernel_fn(kern.fit(c, L, F), decode)(xl, idx, w, ex)  # the program just timed
                    if i == 0:
                        default_out = got
                    elif default_out is not None:  # the same op: against the default tiles' output
                        record_check(n, f"sweep {regime} {c} {decode} vs default", got, default_out)
                except Exception as exc:  # noqa: BLE001
                    RESULTS["errors"].append(f"sweep {regime} {c} {decode}: {type(exc).__name__}: {str(exc)[:400]}")
                    log("sweep failed", regime, c, decode, str(exc)[:400])
            if scores:
                best[regime] = min(scores, key=lambda s: s[0])[1]
            save(args.out)
    RESULTS["best"] = {k: repr(v) for k, v in best.items()}
    if args.sweep_only:
        save(args.out)
        for r in RESULTS["sweep"]:
            print(f"sweep {r['regime']} {r['tokens']} gate_up {r['gate_up_s'] * 1e3:.3f} ms down "
                  f"{r['down_s'] * 1e3:.3f} ms whole {r['whole_s'] * 1e3:.3f} ms  {r['decode']} {r['config']}")
        for c in RESULTS["checks"]:
            print("check", c)
        return 0

    dense = None
    row_cfg = {}  # tokens -> the fitted config timed (the checks run the same compiled program)
    for n in tokens:
        row = {"tokens": n}
        RESULTS["rows"].append(row)
        xl, idx, w = routing(n, n)
        nb = kern.active_bytes(idx, L, F)
        fl = kern.flops(n * K_TOP, L, F)
        row["active_experts"], row["bytes"], row["flops"] = nb["experts"], nb, fl
        cfg = best["decode"] if n * K_TOP <= kern.DECODE_MAX_ROWS * E else best["prefill"]
        row["config"], row["decode"] = repr(cfg), rows_decode(cfg)
        row_cfg[n] = kern.fit(cfg, L, F)
        try:
            r = measure_kernels(ex, n, cfg, row["decode"])
            row.update(r)
            row["gate_up_tb_s"] = nb["gate_up"] / r["gate_up_s"] / 1e12
            row["down_tb_s"] = nb["down"] / r["down_s"] / 1e12
            row["whole_tb_s"] = (nb["gate_up"] + nb["down"]) / r["whole_s"] / 1e12
            row["gate_up_tflops"] = fl["gate_up"] / r["gate_up_s"] / 1e12
            row["down_tflops"] = fl["down"] / r["down_s"] / 1e12
            row["whole_tflops"] = (fl["gate_up"] + fl["down"]) / r["whole_s"] / 1e12
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            traceback.print_exc()
        if mgpu and cfg is best["prefill"] and not late(0.6):
            try:
                r = measure_mgpu(ex, n, scale_max)
                r.update({f"{part}_tflops": fl[part] / r[f"{part}_s"] / 1e12 for part in ("gate_up", "down")})
                r["whole_tflops"] = (fl["gate_up"] + fl["down"]) / r["whole_s"] / 1e12
                if "whole_s" in row:
                    r["speedup_vs_triton"] = row["whole_s"] / r["whole_s"]
                row["mgpu"] = r
            except Exception as exc:  # noqa: BLE001
                row["mgpu_error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
                traceback.print_exc()
        for variant in ("exact", "reinterpret"):  # the longer decode of the same bits, the decode-free diagnostic
            if late(0.6) or n not in (16, 512, 16384):
                break
            try:
                r = measure_kernels(ex, n, cfg, decode=variant)
                row[variant] = r
                row[variant + "_gate_up_tb_s"] = nb["gate_up"] / r["gate_up_s"] / 1e12
                if "whole_s" in row:
                    row[variant + "_speedup"] = {k: row[k] / r[k] for k in ("gate_up_s", "down_s", "whole_s")}
                if variant == "exact":  # same weights, summed in the order the compiled kernels choose
                    record_check(n, "decode exact (whole path)", kernel_fn(row_cfg[n], row["decode"])(xl, idx, w, ex),
                                 kernel_fn(row_cfg[n], "exact")(xl, idx, w, ex))
            except Exception as exc:  # noqa: BLE001
                row[variant + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log("kernel", {k: v for k, v in row.items() if k not in ("bytes", "flops")})
        save(args.out)

    # Peers on dequantised bf16 weights, and the correctness checks.
    if not late(0.75):
        dense = dense_bf16(ex)
        log("dequantised bf16 experts ready")
    ragged_failed = None
    for row in RESULTS["rows"]:
        n = row["tokens"]
        if dense is None or late(0.9):
            break
        xl, idx, w = routing(n, n)
        cap = int(np.bincount(np.asarray(idx).reshape(-1), minlength=E).max())
        cap = -(-cap // 8) * 8
        ein = make_capacity_einsum(cap)
        got = None
        try:
            got = kernel_fn(row_cfg[n], row["decode"])(xl, idx, w, ex)
            if n <= 16:  # needs no dense weights: runs even when the einsum does not
                want = jax.jit(lambda a, b, c, e: routed_experts(a, b, c, e, BETA, LINEAR_BETA, "gathered"))(
                    xl, idx, w, ex)
                record_check(n, "routed_experts gathered", got, want)
                del want
        except Exception as exc:  # noqa: BLE001
            row["check_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            row["einsum_capacity"] = cap
            row["einsum_s"] = timeit(ein, xl, idx, w, *dense)
            want = ein(xl, idx, w, *dense)
            if got is not None:
                record_check(n, "capacity einsum", got, want)
            if "mgpu" in row:
                record_check(n, "capacity einsum (Mosaic GPU path)", mgpu_fn(scale_max)(xl, idx, w, ex), want)
            del want
        except Exception as exc:  # noqa: BLE001
            row["einsum_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        del got
        if ragged_failed is None and args.ragged_full and n in (16, 4096):
            try:
                row["ragged_s"] = timeit(jax.jit(ragged), xl, idx, w, *dense)
            except Exception as exc:  # noqa: BLE001
                ragged_failed = f"{type(exc).__name__}: {str(exc)[:300]}"
                row["ragged_error"] = ragged_failed
        log("peers", n, {k: row.get(k) for k in ("einsum_s", "ragged_s", "ragged_error", "einsum_error")})
        save(args.out)
    if dense is not None and not late(0.8):
        # lax.ragged_dot where it compiles: ANCHORS' shape, 64 experts x 256 tokens, against our kernel.
        try:
            sub = [d[:64] for d in dense]
            sub_ex = jax.tree_util.tree_map(lambda a: a[:64], ex)
            k1, k2 = jax.random.split(jax.random.PRNGKey(64))
            n = 64 * 256 // K_TOP
            idx = jnp.stack([jax.random.permutation(jax.random.fold_in(k1, t), 64)[:K_TOP] for t in range(n)])
            w = jnp.full((n, K_TOP), 0.05, jnp.float32)
            xl = jax.random.normal(k2, (n, L), jnp.float32).astype(jnp.bfloat16)
            rs = timeit(jax.jit(ragged), xl, idx, w, *sub)
            ks = timeit(kernel_fn(None, rows_decode(None)), xl, idx, w, sub_ex)
            fl = sum(kern.flops(n * K_TOP, L, F).values())
            RESULTS["ragged_64x256"] = {"ragged_s": rs, "kernel_s": ks, "ragged_tflops": fl / rs / 1e12,
                                        "kernel_tflops": fl / ks / 1e12}
            log("ragged 64x256", RESULTS["ragged_64x256"])
        except Exception as exc:  # noqa: BLE001
            RESULTS["errors"].append(f"ragged 64x256: {type(exc).__name__}: {str(exc)[:300]}")
    save(args.out)
    table()


def table():
    tq = RESULTS.get("torch", {})
    print(f"\ncopy bandwidth {RESULTS.get('copy_tb_s', 0):.2f} TB/s; decode {RESULTS['meta'].get('decode')}; "
          f"best tiles {RESULTS.get('best')}")
    print("tokens | experts | gate_up ms (TB/s, TFLOP/s) | down ms (TB/s, TFLOP/s) | whole ms | exact gate_up / down /"
          " whole ms | exact gate_up TB/s | reinterp gate_up TB/s | torch gate_up ms / down ms | einsum ms | ragged ms")
    exact = lambda r: " / ".join(f"{r['exact'][k] * 1e3:.3f}" for k in ("gate_up_s", "down_s", "whole_s")) \
        if "exact" in r else "-"
    for r in RESULTS["rows"]:
        t = tq.get(r["tokens"], tq.get(str(r["tokens"]), {}))
        f = lambda k, s=1e3, r=r: f"{r[k] * s:.3f}" if k in r else "-"
        print(f"{r['tokens']} | {r.get('active_experts')} | {f('gate_up_s')} ({r.get('gate_up_tb_s', 0):.2f}, "
              f"{r.get('gate_up_tflops', 0):.0f}) | {f('down_s')} ({r.get('down_tb_s', 0):.2f}, "
              f"{r.get('down_tflops', 0):.0f}) | {f('whole_s')} | {exact(r)} | {r.get('exact_gate_up_tb_s', 0):.2f} | "
              f"{r.get('reinterpret_gate_up_tb_s', 0):.2f} | "
              f"{t.get('gate_up_ms', float('nan')):.3f} / {t.get('down_ms', float('nan')):.3f} | {f('einsum_s')} | "
              f"{f('ragged_s') if 'ragged_s' in r else r.get('ragged_error', '-')[:60]}")
    mg = [r for r in RESULTS["rows"] if "mgpu" in r or "mgpu_error" in r]
    if mg:
        print("\nMosaic GPU prefill path: tokens | gate_up ms (TFLOP/s) | down ms (TFLOP/s) | whole ms (TFLOP/s) | vs"
              " the Triton whole path")
    for r in mg:
        m = r.get("mgpu")
        print(f"{r['tokens']} | " + (" | ".join(f"{m[p + '_s'] * 1e3:.3f} ({m[p + '_tflops']:.0f})"
                                                for p in ("gate_up", "down", "whole"))
                                     + f" | {m.get('speedup_vs_triton', float('nan')):.2f}x" if m else r["mgpu_error"][:200]))
    for c in RESULTS["checks"]:
        print("check", c)
    for e in RESULTS["errors"]:
        print("error", e)


if __name__ == "__main__":
    sys.exit(main())
