"""Open any checkpoint directory this project reads: the release (safetensors) layout or a converted one.

    cfg, params = load_checkpoint(directory, text_only=True, shardings=None, dtype=None)

A directory with the converted manifest (`kimik3 convert`, see docs/convert.md) is restored by Orbax
straight into `shardings`; anything else is read as the release layout by `load_params`.
Both give the same tree, bit for bit (A_log zero-padded to head_dim, experts packed as released, or
`DenseExpertParams` for a checkpoint converted with `--dequantize bf16`).

The returned config's `runtime.expert_scale_max` holds the largest scale byte of the packed experts (one
reduction per scale array, where the arrays live), which lets the MoE kernels pick their decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import CheckpointError
from kimik3_jax.params import ExpertParams, Params, cast_params


def is_orbax_checkpoint(directory: str | Path) -> bool:
    """True for a complete converted (Orbax) directory."""
    from convert.manifest import is_orbax_checkpoint as _is_orbax

    return _is_orbax(directory)


def load_checkpoint(directory: str | Path, *, text_only: bool = True, shardings: Any = None,
                    dtype: Any = None) -> tuple[ModelConfig, Params]:
    """(config, parameters) of a release-layout or converted directory. `shardings`: None (the first
    device), one `jax.sharding.Sharding` for every leaf, or a tree of them matching the parameters.
    `dtype`: the compute dtype (`cast_params`; None or bfloat16 keep the stored dtypes)."""
    cfg, params = _load(Path(directory), text_only, shardings)
    cfg = cfg.with_runtime(expert_scale_max=expert_scale_max(params.text.moe.experts))
    return cfg, params if dtype is None else cast_params(params, dtype)


def expert_scale_max(ex) -> int | None:
    """The largest E8M0 scale byte of packed routed experts (one layer's, or stacked over the MoE layers:
    three reductions), or None where there are none (dequantised or empty experts)."""
    import jax.numpy as jnp

    if not isinstance(ex, ExpertParams) or not ex.w1_scale.size:
        return None
    return max(int(jnp.max(a)) for a in (ex.w1_scale, ex.w3_scale, ex.w2_scale))


def _load(directory: Path, text_only: bool, shardings: Any) -> tuple[ModelConfig, Params]:
    if is_orbax_checkpoint(directory):
        from convert.restore import load_orbax

        return load_orbax(directory, text_only=text_only, shardings=shardings)
    from kimik3_jax.checkpoint.load import Checkpoint, load_params

    try:
        cfg = Checkpoint(directory).config()
    except CheckpointError as e:
        partial = directory.parent / f".{directory.name}.partial"
        if partial.exists():
            raise CheckpointError(f"{e} (an unfinished conversion to {directory} waits at {partial}: "
                                  "finish it with `kimik3 convert --resume`)") from None
        raise
    return cfg, load_params(directory, cfg, text_only=text_only, shardings=shardings)
