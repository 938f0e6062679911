"""GPU-only checks: run on the device machine with `python -m pytest -q tests/gpu` (not part of the CPU
suite). The fixtures of tests/conftest.py apply here too."""
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: reference, fixtures' helpers

if jax.default_backend() != "gpu":
    raise RuntimeError(f"tests/gpu needs a GPU backend; this process has {jax.default_backend()!r}")
