"""`kimik3 logits`: the logits of one token sequence from a checkpoint directory, in a chosen precision."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kimik3_jax.atomic import atomic_file
from kimik3_jax.errors import K3Error

DTYPES = ("bfloat16", "float32", "float64")


def parse_tokens(text: str, origin: str) -> list[int]:
    """Token ids written as `1,2,3`, whitespace-separated, or a JSON list; `origin` names the source."""
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise K3Error(f"{origin}: token ids must be integers separated by commas or spaces ({e})") from None
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise K3Error(f"{origin}: expected a list of integer token ids")
    if not values:
        raise K3Error(f"{origin}: no token ids")
    return values


def read_tokens_file(path: str | Path) -> list[int]:
    path = Path(path)
    if path.suffix == ".npy":
        try:
            arr = np.load(path)
        except (OSError, ValueError) as e:
            raise K3Error(f"{path}: cannot read token ids ({e})") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise K3Error(f"{path}: expected a 1-D integer array of token ids, got {arr.dtype} {arr.shape}")
        return [int(v) for v in arr]
    try:
        return parse_tokens(path.read_text(), str(path))
    except OSError as e:
        raise K3Error(f"{path}: cannot read token ids ({e.strerror})") from None


def check_tokens(tokens: list[int], vocab_size: int, max_len: int, origin: str) -> None:
    bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise K3Error(f"{origin}: token {t} at position {i} is outside the vocabulary [0, {vocab_size})"
                      + (f" ({len(bad)} such tokens)" if len(bad) > 1 else ""))
    if len(tokens) > max_len:
        raise K3Error(f"{origin}: {len(tokens)} tokens exceed max_position_embeddings = {max_len}")


def sequence_logits(directory: str | Path, tokens: list[int], dtype: str = "bfloat16", origin: str = "--tokens",
                    plan=None):
    """Logits [T, vocab] of one sequence (float32, or float64 with dtype float64), on one device or
    sharded by `plan` (a `kimik3_jax.sharding.ShardingPlan`; every process gets the whole result)."""
    if dtype not in DTYPES:
        raise K3Error(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    import jax

    with jax.enable_x64(dtype == "float64"):  # scoped: float64 arrays only inside this call
        return _logits(directory, tokens, dtype, origin, plan)


def _logits(directory, tokens, dtype, origin, plan):
    import jax
    import jax.numpy as jnp

    from kimik3_jax.checkpoint.open import load_checkpoint
    from kimik3_jax.config import ModelConfig
    from kimik3_jax.model import init_state, prefill

    cfg = ModelConfig.from_file(directory)  # both layouts carry config.json: check before loading weights
    check_tokens(tokens, cfg.vocab_size, cfg.max_position_embeddings, origin)
    cfg, params = load_checkpoint(directory, text_only=True, dtype=jnp.dtype(dtype), shardings=plan)
    cfg = cfg.with_runtime(sharding=plan)
    rows = 1 if plan is None else plan.ways("batch")  # the one sequence repeated over the data axis
    state = init_state(cfg, rows, len(tokens), jnp.dtype(dtype))

    def first_row(params, tokens, lengths, state):
        return prefill(params, cfg, tokens, lengths, state)[0][0]

    out = None if plan is None else plan.replicated()  # a whole copy on every device: any process reads it
    run = jax.jit(first_row, out_shardings=out)
    return np.asarray(run(params, jnp.asarray([tokens] * rows, jnp.int32), jnp.full((rows,), len(tokens), jnp.int32),
                          state))


def save_npy(path: str | Path, array: np.ndarray) -> None:
    """Write atomically: a reader never sees a partial file at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:
        np.save(f, array)
