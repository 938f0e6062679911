"""Text generation: sampling settings and the jittable sampler, the static-batch loop, `kimik3 generate`.

    from kimik3_jax.generate import SamplingParams, generate, sample

Attributes load on first use, so that building the command-line parser does not import JAX.
"""

import importlib

_EXPORTS = {
    "SamplingParams": "sampling", "GenerationArgumentError": "sampling", "sample": "sampling",
    "stack_params": "sampling",
    "generate": "loop", "check_prompt": "loop", "Completion": "loop", "Timing": "loop", "GenerateOutput": "loop",
}

__all__ = ["Completion", "GenerateOutput", "GenerationArgumentError", "SamplingParams", "Timing", "check_prompt",
           "generate", "sample", "stack_params"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kimik3_jax.generate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kimik3_jax.generate.{_EXPORTS[name]}"), name)
