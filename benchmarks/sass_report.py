"""A static report of our Pallas kernels (KDA prefill and decode, the MoE GEMMs) with no GPU: registers, spills,
and the SASS instruction mix, as Triton and ptxas would build them for sm_90. It runs in two steps, because
the project's venv (jax) and a Triton wheel do not share one environment:

    # 1. in the project's venv: lower the kernels for CUDA on the CPU and keep the Triton IR Pallas builds
    python benchmarks/sass_report.py dump /tmp/ttir --tunings '[{}, {"phase1_warps": 4}]' [--op decode|moe]
    # 2. in a venv with a Triton wheel (pip install triton; 3.9.0 was used): compile each kernel for sm_90a,
    #    run ptxas -v and cuobjdump (both ship in the wheel), print one row per kernel (with each loop's
    #    instruction count: a K loop's a step and a warp); beside each .ttir it
    #    writes the .ttgir (Triton's layouts), .ptx, .sass and .live.txt (nvdisasm's live-register count after
    #    each instruction: where the register peak is)
    TRITON_DEFAULT_FP_FUSION=1 /tmp/tvenv/bin/python benchmarks/sass_report.py compile /tmp/ttir

The wheel's Triton is not the one inside jaxlib's GPU plugin, so the numbers are a proxy. Step 2 first runs
Triton's TTIR passes on the dumped IR (canonicalize, combine ops, ...), as XLA's Triton pipeline does before
lowering to TTGIR (`MakeTTIR` in xla/backends/gpu/codegen/triton/compilation_pipeline_cuda.cc); compiling an
IR file directly would skip them (`--no-ttir-passes` does, for comparison). They matter: the combine pass
folds `dot + x` into the MMA's accumulator, which took the transposed prefill phase 2 from 232 to 166
registers (the H200 measured 165, 2026-12-03). "blocks/SM" is the register limit alone: 64 K registers over
(registers per thread, rounded up to 8) x 32 x warps, at most 64 warps per SM.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

SASS_OPS = ("HGMMA", "HMMA", "LDSM", "LDS", "STS", "BAR", "SHFL", "MUFU", "LDL", "STL")


def dump(out: Path, tunings: list[dict], op: str, shape: tuple[int, int, int], checkpoint: int) -> None:
    """Lower our kda_prefill (kda_decode, or routed_experts for "moe") for CUDA once per tuning; write each
    pallas_call's Triton IR as <tuning index>_<kernel name>.ttir, with its launch options (warps, stages)
    and the tuning beside it. For "moe" a tuning holds `decode` (a name of pallas_kernels.moe.decode's
    DECODERS) and `config` ({"bm": .., "gate_up": {Tiles fields}, "down": {..}}), and the token count is
    shape[0]."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep
    out.mkdir(parents=True, exist_ok=True)
    for i, tuning in enumerate(tunings):
        modules.clear()
        hlo = _lowered_text(op, shape, tuning, checkpoint, jax, jnp)
        launch = {name: (int(stages), int(warps)) for name, stages, warps in re.findall(
            r'name = "([\w.]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', hlo)}
        for text in modules:
            name = re.search(r"module @([\w.]+)", text).group(1)
            stages, warps = launch[name]
            stem = out / f"{i}_{name}"
            stem.with_suffix(".ttir").write_text(text)
            stem.with_suffix(".json").write_text(json.dumps(dict(tuning=tuning, num_warps=warps, num_stages=stages)))
            print(f"{stem}.ttir: {tuning} {warps} warps, {stages} stages")


def _lowered_text(op, shape, tuning, checkpoint, jax, jnp):
    b, t, h = shape
    d = 128
    if op == "prefill":
        from pallas_kernels.kda.prefill import kda_prefill
        q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
        g = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
        args = (q, q, q, g, jax.ShapeDtypeStruct((b, t, h), jnp.float32),
                jax.ShapeDtypeStruct((b, h, d, d), jnp.float32))
        f = jax.jit(lambda *a: kda_prefill(*a, qk_norm=True, out_dtype=jnp.bfloat16, interpret=False,
                                           tuning=tuning, checkpoint=checkpoint, lower_bound=-5.0))
    elif op == "moe":  # K3's widths: 896 experts, latent 3584, expert width 3072, top 16
        from kimik3_jax.params import ExpertParams
        from pallas_kernels.moe.routed import routed_experts
        e, lat, wid, top = 896, 3584, 3072, 16
        u8 = lambda *s: jax.ShapeDtypeStruct(s, jnp.uint8)  # noqa: E731
        experts = ExpertParams(u8(e, wid, lat // 2), u8(e, wid, lat // 32), u8(e, wid, lat // 2),
                               u8(e, wid, lat // 32), u8(e, lat, wid // 2), u8(e, lat, wid // 32))
        args = (jax.ShapeDtypeStruct((b, lat), jnp.bfloat16), jax.ShapeDtypeStruct((b, top), jnp.int32),
                jax.ShapeDtypeStruct((b, top), jnp.float32), experts)
        kw = dict(tuning, prefill_kernels="triton")  # this report reads the Triton kernels' SASS
        if "config" in kw:  # {"bm": .., "gate_up": {Tiles fields}, "down": {..}}
            from pallas_kernels.moe.kernels import TileConfig
            kw["config"] = TileConfig.from_dict(kw["config"])
        f = jax.jit(lambda *a: routed_experts(*a, 4.0, 25.0, interpret=False, **kw))
    else:  # one decode step for b sequences (a pool of b slots), the benchmark's arguments
        from pallas_kernels.kda.decode import kda_decode
        n, c = b, h * d
        args = (jax.ShapeDtypeStruct((n, 3, c), jnp.bfloat16), jax.ShapeDtypeStruct((3, c, 4), jnp.float32),
                jax.ShapeDtypeStruct((n, 3, 3, c), jnp.bfloat16), jax.ShapeDtypeStruct((n, h, d, d), jnp.float32),
                jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n, h, d), jnp.float32),
                jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((n, h, d), jnp.float32),
                jax.ShapeDtypeStruct((d,), jnp.float32))
        a_log = jnp.zeros((h,), jnp.float32)
        f = jax.jit(lambda *a: kda_decode(*a, eps=1e-5, a_log=a_log, lower_bound=-5.0, interpret=False,
                                          tuning=tuning))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _ttir_passes(ttir: Path, target, warps: int) -> Path:
    """ttir after Triton's own TTIR passes (`make_ttir`), written beside it as .opt.ttir."""
    from triton._C.libtriton import ir
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(target)
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = ir.parse_mlir_module(str(ttir), ctx)
    module.context = ctx
    out = ttir.with_suffix(".opt.ttir")
    out.write_text(str(backend.make_ttir(module, {}, backend.parse_options(dict(num_warps=warps)),
                                         target.arch)))
    return out


def loop_sizes(sass: str) -> list[int]:
    """The instruction count of each loop in cuobjdump's SASS text: a branch back to an earlier address closes a
    loop whose body runs from that address to the branch (both counted), in the order the loops end. For a
    K loop, its instructions a step and a warp."""
    addrs = [int(a, 16) for a in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/", sass, re.M)]
    sizes = []
    for at, target in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+0x([0-9a-f]+)", sass,
                                 re.M):
        at, target = int(at, 16), int(target, 16)
        if target < at:
            sizes.append(sum(target <= a <= at for a in addrs))
    return sizes


def compile_all(src: Path, ttir_passes: bool = True) -> None:
    """Compile every .ttir under src for sm_90a with the installed Triton (after its TTIR passes unless
    ttir_passes is False); one row per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next(p for p in (tools / "ptxas-blackwell", tools / "ptxas") if p.exists())
    print(f"triton {triton.__version__}, {ptxas.name}")
    print("| kernel | tuning | warps | registers | spill bytes (st / ld) | blocks/SM by registers and shared memory | "
          "shared bytes | loop instructions | "
          + " | ".join(SASS_OPS) + " |")
    print("| --- " * (8 + len(SASS_OPS)) + "|")
    target = GPUTarget("cuda", 90, 32)
    for ttir in sorted(p for p in src.glob("*.ttir") if not p.name.endswith(".opt.ttir")):
        meta = json.loads(ttir.with_suffix(".json").read_text())
        warps = meta["num_warps"]
        kernel = triton.compile(str(_ttir_passes(ttir, target, warps) if ttir_passes else ttir), target=target,
                                options=dict(num_warps=warps, num_stages=meta["num_stages"]))
        ptx, cubin = ttir.with_suffix(".ptx"), ttir.with_suffix(".cubin")
        ptx.write_text(kernel.asm["ptx"])
        ttir.with_suffix(".ttgir").write_text(kernel.asm["ttgir"])  # the layouts Triton chose
        cubin.write_bytes(kernel.asm["cubin"])
        report = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", "/dev/null"],
                                capture_output=True, text=True).stderr
        regs = int(re.search(r"Used (\d+) registers", report).group(1))
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        ttir.with_suffix(".sass").write_text(sass)
        # the live registers after each instruction (the "#" column), to find where the register peak is
        live = subprocess.run([str(tools / "nvdisasm"), "-plr", "-lrm", "count", "-c", str(cubin)],
                              capture_output=True, text=True).stdout
        ttir.with_suffix(".live.txt").write_text(live)
        counts = [len(re.findall(r"\b" + op + r"[ .]", sass)) for op in SASS_OPS]
        smem = kernel.metadata.shared
        blocks = min(65536 // (-(-regs // 8) * 8 * 32 * warps), 64 // warps, (228 << 10) // max(smem + 1024, 1))
        print(f"| {ttir.stem} | {json.dumps(meta['tuning'])} | {warps} | {regs} | {spills[0]} / {spills[1]} | "
              f"{blocks} ({blocks * warps} warps) | {smem} | {', '.join(map(str, loop_sizes(sass))) or '-'} | "
              + " | ".join(map(str, counts)) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    d = sub.add_parser("dump", help="step 1, in the project's venv")
    d.add_argument("out", type=Path)
    d.add_argument("--tunings", type=json.loads, default=[{}], help="JSON list of tuning overrides")
    d.add_argument("--op", choices=("prefill", "decode", "moe"), default="prefill")
    d.add_argument("--shape", default="1x8192x96", help="prefill BxTxH; decode NxH, e.g. 32x96; moe N tokens")
    d.add_argument("--checkpoint", type=int, default=0, help="prefill: states every this many tokens")
    c = sub.add_parser("compile", help="step 2, in a venv with triton")
    c.add_argument("src", type=Path)
    c.add_argument("--no-ttir-passes", action="store_true", help="compile the dumped IR as it is")
    args = ap.parse_args(argv)
    if args.step == "dump":
        shape = tuple(int(x) for x in args.shape.split("x"))
        if args.op == "decode":
            shape = (shape[0], 1, shape[1])
        elif args.op == "moe":
            shape = (shape[0], 1, 1)
        dump(args.out, args.tunings, args.op, shape, args.checkpoint)
    else:
        compile_all(args.src, not args.no_ttir_passes)


if __name__ == "__main__":
    sys.exit(main())
