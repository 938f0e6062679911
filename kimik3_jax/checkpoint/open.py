"""Open any checkpoint directory the project reads (the release safetensors layout, for now)."""

from __future__ import annotations

from pathlib import Path

from kimik3_jax.checkpoint.load import Checkpoint, load_params


def load_checkpoint(directory: str | Path, *, text_only: bool = True, shardings=None):
    """(ModelConfig, Params) from a checkpoint directory."""
    cfg = Checkpoint(directory).config()
    return cfg, load_params(directory, cfg, text_only=text_only, shardings=shardings)
