"""Run by tests/test_sharding.py in a child process with 8 host CPU devices (XLA_FLAGS must be set
before JAX starts). For each mesh preset: prefill + decode steps of the tiny model, sharded, against the
same on one device; prints one JSON line {preset: {"mesh": ..., "err": max relative error, ...}}."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kimik3_jax.model import decode_step, init_state, prefill
from kimik3_jax.params import cast_params, describe, init_params
from kimik3_jax.presets import preset
from kimik3_jax.sharding import PRESETS, ShardingPlan


def run(params, cfg, state, tokens, lengths, steps):
    """Prefill, then `steps` greedy decode steps; returns every logits array (numpy)."""
    logits, state = jax.jit(prefill, static_argnums=1)(params, cfg, tokens, lengths, state)
    outs = [logits]
    nxt = jnp.argmax(logits[jnp.arange(tokens.shape[0]), lengths - 1], -1)
    step = jax.jit(decode_step, static_argnums=1)
    for _ in range(steps):
        logits, state = step(params, cfg, state, nxt)
        outs.append(logits)
        nxt = jnp.argmax(logits, -1)
    return [np.asarray(o) for o in outs], state


def main(dtype: str, skew: bool, presets: list[str]) -> dict:
    dt = jnp.dtype(dtype)
    cfg = preset("tiny")
    spec = describe(cfg, text_only=True)
    params = cast_params(init_params(cfg, 0, text_only=True), dt)
    if skew:  # the selection bias makes every token pick experts 0..k-1: all pairs land on one device
        k = cfg.moe.top_k
        bias = params.text.moe.router_bias.at[:, :k].add(100.0)
        params = params.replace(text=params.text.replace(moe=params.text.moe.replace(router_bias=bias)))
    rng = np.random.default_rng(1)
    b, t = 4, 13
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.asarray([t, 9, 1, 6], jnp.int32)
    ref, ref_state = run(params, cfg, init_state(cfg, b, 24, dt), tokens, lengths, 3)
    out = {}
    for name in presets:
        plan = ShardingPlan.preset(name)
        sharded = jax.device_put(params, plan.params(spec))
        sharded_cfg = cfg.with_runtime(sharding=plan)
        got, state = run(sharded, sharded_cfg, init_state(sharded_cfg, b, 24, dt), tokens, lengths, 3)
        err = max(float(np.max(np.abs(g - r)) / np.max(np.abs(r))) for g, r in zip(got, ref))
        state_err = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64))))
                        for g, r in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ref_state)))
        argmax = all(bool(np.array_equal(g.argmax(-1), r.argmax(-1))) for g, r in zip(got, ref))
        out[name] = {"mesh": plan.describe(), "err": err, "state_err": state_err, "argmax_equal": argmax,
                     "kda_state_spec": str(state.kda.s.sharding.spec),
                     "expert_spec": str(sharded.text.moe.experts.w1_packed.sharding.spec)}
    return out


if __name__ == "__main__":
    dtype, skew = sys.argv[1], sys.argv[2] == "skew"
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else [p for p in PRESETS if p != "single"]
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    print(json.dumps(main(dtype, skew, names)))
