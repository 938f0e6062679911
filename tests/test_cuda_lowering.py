"""The Pallas Triton kernels lower for CUDA on this CPU, at K3's widths: the KDA prefill, the decode's one-launch
and split forms, the MoE kernels at a decode and a prefill token count (the Triton IR the GPU's XLA compiles;
the Mosaic GPU kernels' lowering is tested in test_moe_wgmma.py). Under the GPU machine's jax,
`bash tests/lower_jax_gpu_version.sh` runs these too, so a kernel change is checked for 0.11.2 with no device."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from kimik3_jax.params import ExpertParams
from pallas_kernels.kda.decode import kda_decode
from pallas_kernels.kda.prefill import kda_prefill
from pallas_kernels.moe.routed import routed_experts

H, D = 96, 128
TRITON = "__gpu$xla.gpu.triton"
f32, bf16 = jnp.float32, jnp.bfloat16


def kernel_names(hlo: str) -> list[str]:
    """The Triton kernels' names in the lowered text, sorted, each once."""
    return sorted(set(re.findall(r'name = "([\w.]+)", num_stages', hlo)))


@pytest.mark.parametrize("tuning,kernels", [
    ({}, ["kda_decode"]),  # below SPLIT_FROM rows: one launch, whole V
    ({"block_v": 32}, ["kda_decode_tiles"]),
    ({"split": True}, ["kda_decode_prologue", "kda_decode_state"]),
    ({"split": True, "block_v": 32, "num_warps": 1}, ["kda_decode_prologue", "kda_decode_state"])])
def test_kda_decode_lowers_for_cuda(tuning, kernels):
    n, c = 4, H * D
    s = jax.ShapeDtypeStruct
    args = (s((n, 3, c), bf16), s((3, c, 4), f32), s((n, 3, 3, c), bf16), s((n, H, D, D), f32), s((n,), jnp.int32),
            s((n, H, D), f32), s((n, H), f32), s((n, H, D), f32), s((D,), f32))
    a_log = np.zeros((H,), np.float32)
    hlo = lower_for_cuda(lambda *a: kda_decode(*a, eps=1e-5, a_log=a_log, lower_bound=-5.0, interpret=False,
                                               tuning=tuning), *args)
    assert hlo.count(TRITON) == len(kernels)
    assert kernel_names(hlo) == kernels


def test_kda_prefill_lowers_for_cuda():
    b, t, h = 2, 200, 4  # T not a multiple of the chunk
    q = jax.ShapeDtypeStruct((b, t, h, D), bf16)
    g = jax.ShapeDtypeStruct((b, t, h, D), f32)
    args = (q, q, q, g, jax.ShapeDtypeStruct((b, t, h), f32), jax.ShapeDtypeStruct((b, h, D, D), f32))
    hlo = lower_for_cuda(lambda *a: kda_prefill(*a, qk_norm=True, out_dtype=bf16, interpret=False,
                                                lower_bound=-5.0), *args)
    assert hlo.count(TRITON) >= 1 and all(k.startswith("kda_prefill") for k in kernel_names(hlo))


@pytest.mark.parametrize("tokens", [16, 4096])
def test_moe_triton_kernels_lower_for_cuda(tokens):
    e, lat, wid, top = 896, 3584, 3072, 16
    u8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint8)  # noqa: E731
    experts = ExpertParams(u8(e, wid, lat // 2), u8(e, wid, lat // 32), u8(e, wid, lat // 2), u8(e, wid, lat // 32),
                           u8(e, lat, wid // 2), u8(e, lat, wid // 32))
    args = (jax.ShapeDtypeStruct((tokens, lat), bf16), jax.ShapeDtypeStruct((tokens, top), jnp.int32),
            jax.ShapeDtypeStruct((tokens, top), f32), experts)
    hlo = lower_for_cuda(lambda *a: routed_experts(*a, 4.0, 25.0, interpret=False, scale_max=120,
                                                   prefill_kernels="triton"), *args)
    assert kernel_names(hlo) == ["moe_down_mxfp4", "moe_gate_up_mxfp4"]
