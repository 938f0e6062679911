"""GPU probe (thirty-first session): does asm1r's column permutation of x (`decode.permute8`) cost a launch of
its own when x comes from its producer in the same jit, as in the model (xl = x @ latent_down)? Times the
latent projection plus the whole routed-experts call with asm1r-unchecked (permuted x) and asm1-unchecked (x as
it is), alternated, at 1 and 16 tokens, and counts the launches in each compiled program's entry computation.

    python3 tests/gpu/probe_moe_permute.py        # MOE_TOKENS=1,16 (the default)
"""
import os
import re
import sys

sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from moe import BETA, LINEAR_BETA, L, _random_experts, routing  # noqa: E402
from timing import device_seconds  # noqa: E402

from pallas_kernels.moe import routed as kern  # noqa: E402

D = 7168  # K3's hidden size


def launches(compiled_text: str) -> list[str]:
    """The names of the entry computation's ops that launch work (fusions, custom calls, GEMMs)."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    return re.findall(r"%(\S+) = \S+ (?:fusion|custom-call|convolution|dot|gather|scatter|sort)\(", entry)


def main():
    ex = _random_experts(jax.random.key(0), 896)
    w_in = (jax.random.normal(jax.random.key(1), (D, L), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    fns = {d: jax.jit(lambda h, wi, i, w, e, d=d: kern.routed_experts(h @ wi, i, w, e, BETA, LINEAR_BETA, decode=d))
           for d in ("asm1r-unchecked", "asm1-unchecked")}
    for n in [int(t) for t in os.environ.get("MOE_TOKENS", "1,16").split(",")]:
        _, idx, w = routing(n, n)
        h = jax.random.normal(jax.random.key(n), (n, D), jnp.float32).astype(jnp.bfloat16)
        args = (h, w_in, idx, w, ex)
        outs = {d: np.asarray(f(*args)) for d, f in fns.items()}
        a, b = outs.values()
        print(f"{n} tokens: max |asm1r - asm1| / max |asm1| = {np.abs(a - b).max() / np.abs(b).max():.2e}")
        for d, f in fns.items():
            ops = launches(f.lower(*args).compile().as_text())
            print(f"  {d}: {len(ops)} launches in the entry computation: {ops}")
        for _ in range(2):
            for d, f in fns.items():
                print(f"  {d}: {device_seconds(f, *args) * 1e3:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
