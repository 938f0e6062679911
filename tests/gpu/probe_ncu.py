"""GPU probe (2026-12-02, fifth session): one launch of each bandwidth-bound kernel, for Nsight Compute.

Runs, at K3's widths, each once after a warm-up call: the MoE gate+up and down kernels at 16 tokens (decode
tiles or NCU_CONFIG's; the decode the model runs on these experts, asm1r-unchecked, or NCU_DECODE) and the
gate+up kernel at 4096 tokens (prefill tiles; NCU_TOKENS changes the token counts); the KDA decode step at N =
32, H = 96 (the default, and with the tails scattered after the kernel, or the tunings NCU_KDA names, e.g.
"32x4,128x4" for value tiles x warps); the KDA prefill (P) at (1, 8192, 96) or NCU_PREFILL_SHAPE ("BxTxH"),
with the default tuning (its two phases) or the tunings NCU_PREFILL lists as JSON (e.g.
'[{"phase2_transposed": false}, {}]'); fla's `fused_recurrent_kda` (F) at the decode shape, the peer's kernel
for the same counters. Under `ncu -k regex:"moe|kda|fused_recurrent"` the report says where each kernel's time
goes (DRAM and shared-memory throughput, warp stalls, the SASS of its inner loop). Without ncu it is a smoke
run; PROBE_SMALL=1 shrinks the KDA parts (K, P) for the CPU interpreter (the MoE part is GPU-sized).

    ncu --clock-control none -k regex:"moe|kda|fused_recurrent" --set full -o $OUT/probe \
        python3 tests/gpu/probe_ncu.py [MKPF]
"""
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402

from kda import decode_inputs  # noqa: E402
from moe import E, _random_experts, kernel_parts, routing  # noqa: E402
from kimik3_jax.checkpoint.open import expert_scale_max  # noqa: E402
from pallas_kernels.kda.decode import kda_decode  # noqa: E402
from pallas_kernels.moe import routed as kern  # noqa: E402
from pallas_kernels.moe.kernels import TileConfig  # noqa: E402

SMALL = bool(os.environ.get("PROBE_SMALL"))


def moe():
    ex = _random_experts(jax.random.PRNGKey(2), E)
    scale_max = expert_scale_max(ex)
    spec = os.environ.get("NCU_CONFIG")  # a TileConfig as JSON (`TileConfig.from_dict`) in place of the default
    for tokens in [int(t) for t in os.environ.get("NCU_TOKENS", "16,4096").split(",")]:
        xl, idx, w = routing(tokens, tokens)
        cfg = kern.fit(TileConfig.from_dict(json.loads(spec)) if spec else kern.choose_config(idx.size, E),
                       xl.shape[1], ex.w1_packed.shape[1])
        decode = os.environ.get("NCU_DECODE") or kern.decoder_for(kern.DEFAULT_DECODE, scale_max, cfg)
        lay, gu, dn, _ = kernel_parts(cfg, decode)
        lo = lay(idx, w)
        h = jax.block_until_ready(gu(xl, lo, ex))  # warm-up (compiles), then the profiled launches
        jax.block_until_ready(gu(xl, lo, ex))
        if tokens == 16:
            jax.block_until_ready(dn(h, lo, ex))
            jax.block_until_ready(dn(h, lo, ex))
        print(f"moe {tokens} tokens: {cfg}, decode {decode}", flush=True)


def kda():
    n, h = (2, 2) if SMALL else (32, 96)
    qkv, conv_w, conv_pool, s_pool, slots, z, beta, gate, norm_w, a_log = decode_inputs(n, h)
    kw = dict(eps=1e-5, a_log=a_log, lower_bound=-5.0)
    spec = os.environ.get("NCU_KDA")
    tunings = ([dict(block_v=int(b), num_warps=int(w)) for b, w in (x.split("x") for x in spec.split(","))]
               if spec else (None, dict(tails_in_place=False)))
    for tuning in tunings:
        f = jax.jit(lambda cp, sp, t=tuning: kda_decode(qkv, conv_w, cp, sp, slots, z, beta, gate, norm_w,
                                                        tuning=t, **kw))
        jax.block_until_ready(f(conv_pool, s_pool))
        jax.block_until_ready(f(conv_pool, s_pool))
        print(f"kda decode N={n} {tuning}", flush=True)


def prefill():
    from kda import ours_prefill, prefill_inputs
    shape = os.environ.get("NCU_PREFILL_SHAPE", "1x8192x96")
    b, t, h = (1, 64, 2) if SMALL else tuple(int(x) for x in shape.split("x"))
    q, k, v, g, beta, s0 = prefill_inputs(b, t, h)
    for tuning in json.loads(os.environ.get("NCU_PREFILL", "[null]")):
        f = ours_prefill(tuning)
        jax.block_until_ready(f(q, k, v, g, beta, s0))  # as benchmarks/kda.py
        jax.block_until_ready(f(q, k, v, g, beta, s0))
        print(f"kda prefill {(b, t, h)} {tuning}", flush=True)


def fla():
    import torch
    from fla.ops.kda import fused_recurrent_kda
    n, h, d = 32, 96, 128
    q, k = (torch.randn(n, 1, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(n, 1, h, d, device="cuda", dtype=torch.bfloat16)
    g = -5 * torch.sigmoid(torch.randn(n, 1, h, d, device="cuda"))
    beta = torch.sigmoid(torch.randn(n, 1, h, device="cuda"))
    s = 0.1 * torch.randn(n, h, d, d, device="cuda")
    for _ in range(2):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    print(f"fla fused_recurrent_kda N={n}", flush=True)


if __name__ == "__main__":
    parts = sys.argv[1] if len(sys.argv) > 1 else "MK"
    if "M" in parts:
        moe()
    if "K" in parts:
        kda()
    if "P" in parts:
        prefill()
    if "F" in parts:
        fla()
