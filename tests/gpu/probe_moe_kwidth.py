"""GPU probe (thirty-third session): does kWidth 2 pay for the MoE gate+up decode kernel?

Triton gives the decode kernels' MMA operands kWidth 8 (docs/benchmarks.md, thirty-second and thirty-third
sessions): its rule takes the narrowest load behind a dot operand (the uint8 weight bytes), halved by the
nibble interleave's join. With kWidth 8, every HMMA rebuilds x's A fragment with register moves (213 of the
loop's 1,061 instructions a K step and a warp, offline SASS). An impure op ends that search, so an identity
asm on the decoded tile gives kWidth 2: no moves (889 instructions offline), but the decoded tile then goes
through shared memory (64 KB written and read back a CTA K step). This times the model's gate_up
(asm1r-unchecked) against the same kernel with that identity ("asm1r-kw2", registered here only), alternated,
at K3's widths, with the copy bandwidth of the same run, and prints how far apart their h are (on the used
tiles' rows; bf16, so one-ulp flips from the other summation order show).

Pallas's `elementwise_inline_asm` always lowers as pure, so the probe patches the Triton dialect's builder to
lower an asm that carries IMPURE as impure (a private hook: a probe, not a kernel option).

    python3 tests/gpu/probe_moe_kwidth.py                 # MOE_TOKENS=16,512 (the default)
    # offline, on the CPU: both kernels' Triton IR for benchmarks/sass_report.py's compile step (889 against
    # 1,061 loop instructions for gate+up with Triton 3.9.0)
    python3 tests/gpu/probe_moe_kwidth.py --dump /tmp/ttir_kw2
"""
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.lib.triton import dialect as tt_dialect  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402
from moe import E, F, L, _random_experts, kernel_parts, routing  # noqa: E402
from timing import copy_tbps, device_seconds  # noqa: E402

from pallas_kernels.moe import decode as dec  # noqa: E402
from pallas_kernels.moe import routed as kern  # noqa: E402

IMPURE = "// impure"
_build = tt_dialect.elementwise_inline_asm


def _build_maybe_impure(result_types, asm, *args, **kwargs):
    if IMPURE in asm:
        kwargs["pure"] = False
    return _build(result_types, asm, *args, **kwargs)


tt_dialect.elementwise_inline_asm = _build_maybe_impure


def impure_identity(w: jax.Array) -> jax.Array:
    """w (bf16, even last dim) unchanged, through an asm Triton must treat as having side effects."""
    return pltriton.elementwise_inline_asm(f"mov.b32 $0, $1; {IMPURE}", args=[w], constraints="=r,r", pack=2,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, w.dtype)])[0]


dec.DECODERS["asm1r-kw2"] = dec.Decoder(lambda p, s: impure_identity(dec.decode_asm1r(p, s)), None,
                                        perm8=dec.R_PERM)


def main():
    ex = _random_experts(jax.random.key(0), E)
    cfg = kern.fit(kern.DECODE, L, F)
    parts = {d: kernel_parts(cfg, d) for d in ("asm1r-unchecked", "asm1r-kw2")}  # (layout, gate+up, ...)
    fns = {d: gu for d, (_, gu, *_) in parts.items()}
    print(f"copy {copy_tbps(2 ** 30):.3f} TB/s; gate_up tiles {cfg.gate_up}", flush=True)
    for n in [int(t) for t in os.environ.get("MOE_TOKENS", "16,512").split(",")]:
        xl, idx, w = routing(n, n)
        lo = parts["asm1r-unchecked"][0](idx, w)
        nbytes = kern.active_bytes(idx, L, F)["gate_up"]
        used = np.repeat(np.asarray(lo.tile_expert) < E, cfg.bm)  # the rows of skipped tiles are never written
        a, b = (np.asarray(f(xl, lo, ex).astype(jnp.float32))[used] for f in fns.values())
        print(f"{n} tokens: max |kw2 - default| / max |default| = {np.abs(a - b).max() / np.abs(a).max():.2e} "
              f"({int(used.sum())} rows; h is bf16)", flush=True)
        for _ in range(3):
            for d, f in fns.items():
                s = device_seconds(f, xl, lo, ex)
                print(f"  {d}: {s * 1e3:.4f} ms, {nbytes / s / 1e12:.3f} TB/s", flush=True)


def dump(out: str) -> None:
    """The Triton IR of the routed experts with each decode, as `sass_report.py dump --op moe --shape 16` writes
    it (the registration above is what that command lacks for asm1r-kw2)."""
    from pathlib import Path

    import sass_report
    sass_report.dump(Path(out), [{"decode": "asm1r-unchecked"}, {"decode": "asm1r-kw2"}], "moe", (16, 1, 1), 0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--dump":
        dump(sys.argv[2])
    else:
        main()
