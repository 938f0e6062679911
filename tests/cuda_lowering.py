"""`lower_for_cuda`: a jitted function's lowering for CUDA on a host with no GPU, as StableHLO text, with its
Pallas kernels inside (Triton IR or Mosaic GPU). jax 0.11.2 (the GPU machine's) asks for the target GPU's kind
when it lowers a Triton kernel; it is given as an abstract H200 (same compute capability as the H100: 9.0)."""
import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")


def lower_for_cuda(fn, *args) -> str:
    """fn traced on `args` (ShapeDtypeStructs) and lowered for CUDA, under a one-device abstract mesh on an H200
    (its axis Auto: sharding stays out of the types)."""
    with use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=H200)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
