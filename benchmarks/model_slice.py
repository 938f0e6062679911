"""The pure-JAX reference model at real widths: prefill and decode of the `slice` preset on one device.

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/model_slice.py [--batch B] [--prompt T]

A baseline, not a peer comparison: it shows that the real-width path (896 MXFP4 experts per MoE layer,
96-head KDA and MLA) compiles and runs through the same `prefill` / `decode_step` as the tests, and how
long the plain-XLA ops take before the Pallas kernels replace them. Parameters are random (drawn on the
device by `init_params_traced`); the decode state holds `--prompt + --steps` tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimik3_jax import params, presets
from kimik3_jax.model import decode_step, init_state, prefill, state_bytes


def timed(fn, *args, repeat: int = 1):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return out, float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="slice")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    cfg = presets.preset(args.preset)
    print(f"{cfg.summary()}\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    init = jax.jit(params.init_params_traced, static_argnums=(0, 1, 2))
    t0 = time.perf_counter()
    p = init(cfg, 0, True)
    jax.block_until_ready(p)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(p))
    print(f"parameters: {nbytes / 1e9:.2f} GB on device in {time.perf_counter() - t0:.1f} s (with compile)")
    b, t = args.batch, args.prompt
    state = init_state(cfg, b, t + args.steps + 1)
    sb = state_bytes(cfg)
    print(f"decode state per sequence: KDA {sb['kda_state'] / 2**20:.0f} MiB, MLA {sb['mla_per_token']} B/token")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(b, t)), jnp.int32)
    lengths = jnp.full((b,), t, jnp.int32)
    run_prefill = jax.jit(prefill, static_argnums=1)
    run_decode = jax.jit(decode_step, static_argnums=1)
    t0 = time.perf_counter()
    run_prefill.lower(p, cfg, tokens, lengths, state).compile()
    c_pre = time.perf_counter() - t0
    (logits, st), t_pre = timed(lambda s: run_prefill(p, cfg, tokens, lengths, s), state, repeat=3)
    nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    t0 = time.perf_counter()
    run_decode.lower(p, cfg, st, nxt).compile()
    c_dec = time.perf_counter() - t0
    _, t_dec = timed(lambda s: run_decode(p, cfg, s, nxt), st, repeat=args.steps)
    finite = bool(jnp.all(jnp.isfinite(logits)))
    print(f"| batch x prompt | prefill compile | prefill | decode compile | decode step | logits finite |\n"
          f"| --- | --- | --- | --- | --- | --- |\n"
          f"| {b} x {t} | {c_pre:.1f} s | {t_pre * 1e3:.1f} ms | {c_dec:.1f} s | {t_dec * 1e3:.2f} ms | {finite} |")


if __name__ == "__main__":
    main()
