"""GPU probe (2026-12-02): where the bandwidth-bound kernels (MoE weight streaming, KDA decode) lose bandwidth.

(S) Pure streaming kernels, no decode and no MMA: one program per (tile, N block) walks its expert's rows
    over K as the gate+up kernel does, reading the packed weights either as uint8 blocks [bn, bk/2] (as
    the kernels do now) or the same bytes as uint32 blocks [bn, bk/8]; TB/s on the bytes read.
(B) Whether XLA's uint8 -> uint32 bitcast of a weight array is free (no copy) under jit.
(T) The decode-regime tiles (bn, bk, warps, stages) of gate+up and down at K3 widths (T_TOKENS, default 16),
    with the fast and the asm decodes (T_DECODES; "reinterpret" adds the no-decode diagnostic), each
    checked against the default tiles' exact-decode output: larger blocks per K step, as (S) suggests.
(D) KDA decode at N = 32 and 256 (D_N), H = 96: the step time by difference of a 200- and a 100-step loop
    (without the per-call copy of the un-donated pools), for the D_TUNINGS (block_v x warps, "h" for heads
    fastest), and the ops one step's compiled HLO launches besides the kernel.
(G) The MoE kernels at K3 widths (G_TOKENS, default 16,512,4096), each regime's default tiles, in the
    G_VARIANTS: launch order (a tile's N blocks first, or the tiles first), decoder and MMA shaping (swap),
    outputs compared bit for bit with the first variant's.

    python3 tests/gpu/probe_streaming.py [SBTDG]
"""
import os
import re
import sys
from functools import partial

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from moe import E, F, K_TOP, L, _random_experts, copy_bandwidth, kernel_parts, routing, timeit  # noqa: E402
from pallas_kernels.moe import dispatch as dsp  # noqa: E402
from pallas_kernels.moe import routed as kern  # noqa: E402
from pallas_kernels.moe.kernels import _CompilerParams  # noqa: E402

SMALL = bool(os.environ.get("PROBE_SMALL"))
NE = 16 if SMALL else E
LL, FF = (256, 128) if SMALL else (L, F)
TILES = 8 if SMALL else 222  # active experts at 16 tokens, top-16 of 896


def _stream_kernel(te_ref, w_ref, o_ref, *, bn, bw, num_k, wide):
    t, j = pl.program_id(0), pl.program_id(1)
    e = te_ref[t]
    n = pl.ds(j * bn, bn)

    def step(kb, acc):
        w = w_ref[e, n, pl.ds(kb * bw, bw)]
        return acc + (jax.lax.bitcast_convert_type(w, jnp.int32) if wide else w.astype(jnp.int32))

    acc = jax.lax.fori_loop(0, num_k, step, jnp.zeros((bn, bw), jnp.int32))
    o_ref[t, n] = jnp.sum(acc, axis=1)


def stream(w, te, bn, bk, warps, stages, wide):
    """w uint8 [E, F, L/2] (or its uint32 view [E, F, L/8] when wide) -> [T, F] int32 row sums."""
    per = 8 if wide else 2  # elements per stored word
    bw = bk // per
    kernel = partial(_stream_kernel, bn=bn, bw=bw, num_k=w.shape[2] // bw, wide=wide)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((te.shape[0], w.shape[1]), jnp.int32),
                          grid=(te.shape[0], w.shape[1] // bn), interpret=SMALL,
                          compiler_params=_CompilerParams(num_warps=warps, num_stages=stages))(te, w)


def part_s():
    bw = copy_bandwidth(2 ** 24 if SMALL else 2 ** 30)
    print(f"S copy bandwidth {bw:.2f} TB/s", flush=True)
    w8 = jax.random.bits(jax.random.PRNGKey(0), (NE, FF, LL // 2), jnp.uint8)
    w32 = jax.jit(lambda a: jax.lax.bitcast_convert_type(a.reshape(NE, FF, LL // 8, 4), jnp.uint32))(w8)
    te = jnp.sort(jax.random.choice(jax.random.PRNGKey(1), NE, (TILES,), replace=False)).astype(jnp.int32)
    nbytes = TILES * FF * LL // 2
    ref = None
    for bn, bk, warps, stages in ((64, 128, 4, 4), (64, 256, 4, 4), (64, 512, 4, 3), (128, 256, 4, 4),
                                  (32, 512, 4, 4), (64, 256, 8, 4), (64, 1024, 4, 2)):
        for wide in (False, True):
            if bk > LL:
                continue
            f = jax.jit(partial(stream, bn=bn, bk=bk, warps=warps, stages=stages, wide=wide))
            try:
                out = f(w32 if wide else w8, te)
                s = timeit(f, w32 if wide else w8, te)
            except Exception as err:  # noqa: BLE001 (a probe: report and go on)
                print(f"S bn{bn} bk{bk} {warps}w {stages}st {'u32' if wide else 'u8'}: {type(err).__name__} "
                      f"{str(err)[:200]}", flush=True)
                continue
            # same bytes, same sums mod 2^32 only for u8 (u32 adds words): check u8 vs numpy once
            if ref is None and not wide:
                want = np.asarray(w8)[np.asarray(te)].astype(np.int64).sum(-1)
                ok = np.array_equal(np.asarray(out).astype(np.int64), want)
                print(f"S check u8 sums equal numpy: {ok}", flush=True)
                ref = True
            print(f"S bn{bn} bk{bk} {warps}w {stages}st {'u32' if wide else 'u8 '}: {s * 1e6:8.1f} us "
                  f"{nbytes / s / 1e12:.2f} TB/s", flush=True)


T_TILES = [(64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 8, 3), (64, 512, 8, 3), (32, 256, 4, 3), (32, 512, 4, 3),
           (32, 512, 8, 3), (16, 512, 4, 3), (128, 256, 8, 3)]


def _case(tokens, bm):
    """Routing of `tokens` tokens over the probe's experts: (xl, block layout, active bytes, used-slot mask)."""
    xl, idx, w = routing(tokens, tokens)
    if SMALL:
        xl = xl[:, :LL]
    idx = idx % NE
    lo = dsp.block_layout(idx, w, NE, bm)
    return xl, lo, kern.active_bytes(idx, LL, FF), np.asarray(lo.slot_weight) != 0  # unused rows: never written


def _run(cfg, decode, xl, lo, ex, used):
    """The benchmark's jitted kernels (interpreted on the CPU) on one case: gate+up and down seconds, and
    their outputs on the used slots."""
    _, gu, dn, _ = kernel_parts(cfg, decode)
    h = gu(xl, lo, ex)
    y = dn(h, lo, ex)
    tg, td = timeit(gu, xl, lo, ex), timeit(dn, h, lo, ex)
    return tg, td, np.asarray(h, np.float32)[used], np.asarray(y, np.float32)[used]


def _rates(nb, tg, td):
    return (f"gate_up {tg * 1e6:8.1f} us {nb['gate_up'] / tg / 1e12:.2f} TB/s, "
            f"down {td * 1e6:8.1f} us {nb['down'] / td / 1e12:.2f} TB/s")


def part_t():
    from dataclasses import replace
    ex = _random_experts(jax.random.PRNGKey(2), NE)
    base = kern.fit(kern.DECODE, LL, FF)
    decodes = os.environ.get("T_DECODES", "fast,asm").split(",")
    tiles = T_TILES[:2] if SMALL else T_TILES
    for tokens in [int(t) for t in os.environ.get("T_TOKENS", "16").split(",")]:
        xl, lo, nb, used = _case(tokens, base.bm)
        ref_h = ref_y = None
        # the default tiles with the exact decode first: every row is checked against its output
        for (bn, bk, warps, stages), decode in [(tiles[0], "exact")] + [(t, d) for t in tiles for d in decodes]:
            t = kern.Tiles(bn=bn, bk=bk, num_warps=warps, num_stages=stages)
            cfg = kern.fit(replace(base, gate_up=t, down=t), LL, FF)
            try:
                tg, td, hh, yy = _run(cfg, decode, xl, lo, ex, used)
            except Exception as err:  # noqa: BLE001
                print(f"T {tokens} {cfg.gate_up}: {type(err).__name__} {str(err)[:200]}", flush=True)
                continue
            if ref_h is None:
                ref_h, ref_y = hh, yy
            eh = float(np.abs(hh - ref_h).max() / np.abs(ref_h).max())
            ey = float(np.abs(yy - ref_y).max() / np.abs(ref_y).max())
            print(f"T {tokens} tok {decode:4s} bn{cfg.gate_up.bn} bk{cfg.gate_up.bk} / down bn{cfg.down.bn} "
                  f"bk{cfg.down.bk}, {warps}w {stages}st: {_rates(nb, tg, td)}; vs default exact {eh:.1e} / "
                  f"{ey:.1e}", flush=True)


G_VARIANTS = {"tiles-first": (False, "asm", False), "n-first": (True, "asm", False),
              "n-first/swap": (True, "asm", True), "n-first/asm1": (True, "asm1", False)}


def part_g():
    from dataclasses import replace
    ex = _random_experts(jax.random.PRNGKey(2), NE)
    names = os.environ.get("G_VARIANTS", ",".join(G_VARIANTS)).split(",")
    for tokens in [int(t) for t in os.environ.get("G_TOKENS", "2" if SMALL else "16,512,4096").split(",")]:
        base = kern.fit(kern.choose_config(tokens * K_TOP, NE), LL, FF)
        xl, lo, nb, used = _case(tokens, base.bm)
        first = None
        for name in names:
            n_first, decode, swap = G_VARIANTS[name]
            cfg = replace(base, gate_up=replace(base.gate_up, n_first=n_first, swap=swap),
                          down=replace(base.down, n_first=n_first, swap=swap))
            tg, td, *out = _run(cfg, decode, xl, lo, ex, used)
            first = first or out
            same = all(np.array_equal(a, b) for a, b in zip(out, first))
            print(f"G {tokens} tok {name}: {_rates(nb, tg, td)}; same bits as the first: {same}", flush=True)


def part_b():
    w8 = jnp.zeros((64, FF, LL // 2), jnp.uint8)
    f = jax.jit(lambda a: jax.lax.bitcast_convert_type(a.reshape(64, FF, LL // 8, 4), jnp.uint32))
    hlo = f.lower(w8).compile().as_text()
    ops = sorted(set(re.findall(r"= \S+ (\w[\w-]*)\(", hlo)))
    print(f"B compiled ops of the uint8->uint32 view: {ops}", flush=True)
    print(f"B time for {w8.nbytes / 1e9:.2f} GB: {timeit(f, w8) * 1e6:.1f} us", flush=True)


def part_d():
    from kda import decode_inputs, decode_step_ms
    from pallas_kernels.kda.decode import kda_decode
    ns = [2] if SMALL else [int(x) for x in os.environ.get("D_N", "32,256").split(",")]
    spec = os.environ.get("D_TUNINGS", "128x4,128x4h,32x4,32x4h,64x2h")  # block_v x warps, h: heads fastest
    tunings = [dict(block_v=int(b), num_warps=int(w.rstrip("h")), heads_fastest=w.endswith("h"))
               for b, w in (x.split("x") for x in spec.split(","))]
    for n in ns:
        h = 2 if SMALL else 96
        qkv, conv_w, conv_pool, s_pool, slots, z, beta, gate, norm_w, a_log = decode_inputs(n, h)
        kw = dict(eps=1e-5, a_log=a_log, lower_bound=-5.0, interpret=SMALL or None)
        nbytes = 2 * s_pool.size * 4
        for tuning in tunings:
            if SMALL:
                tuning = dict(tuning, block_v=min(tuning["block_v"], 16))
            step = lambda cp, sp, t=tuning: kda_decode(qkv, conv_w, cp, sp, slots, z, beta, gate, norm_w, tuning=t,
                                                      **kw)
            steps = 2 if SMALL else 100
            try:
                per, avg = decode_step_ms(step, conv_pool, s_pool, steps, reps=5)
            except Exception as err:  # noqa: BLE001
                print(f"D N={n} {tuning}: {type(err).__name__} {str(err)[:200]}", flush=True)
                continue
            print(f"D N={n} {tuning}: {1e3 * per:.1f} us/step ({nbytes / per / 1e9:.2f} TB/s) by difference; "
                  f"{1e3 * avg:.1f} us/step in the {steps}-step call", flush=True)
            if tuning is tunings[0] and not SMALL:  # what one step launches besides the kernel
                hlo = jax.jit(step).lower(conv_pool, s_pool).compile().as_text()
                ops = re.findall(r"= \S+ (copy|fusion|custom-call|broadcast|scatter|dynamic-update-slice)\(", hlo)
                print(f"D one step's HLO: {len(hlo)} chars, ops {sorted(set(ops))} x {len(ops)}", flush=True)
                print("\n".join(line.strip()[:160] for line in hlo.splitlines() if re.search(
                    r"= \S+ (copy|fusion|custom-call|scatter)\(", line)), flush=True)


if __name__ == "__main__":
    parts = sys.argv[1] if len(sys.argv) > 1 else "SBTD"
    for p in parts:
        globals()[f"part_{p.lower()}"]()
