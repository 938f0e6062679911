"""GPU probe (2026-12-04, fourteenth session): the KDA prefill's precision, for the tunings given as JSON in
argv[1] (default: the default, bf16 products since 2026-12-05, and the tf32 form), on benchmarks/kda.py's inputs
(g = -5 sigmoid(2 N(0, 1))).

- Phase 1's workspaces against a float64 NumPy reference at (1, PROBE_T = 2048, PROBE_H = 16): per
  workspace, the largest error relative to its largest entry and the RMS error relative to its RMS.
- With PROBE_WHOLE=1, the whole prefill's output at (1, 8192, 96) against the benchmark's fp32 reference:
  the largest error, two high quantiles and the RMS (all relative to the largest output), and where the
  largest is. A change in the largest error alone, with the quantiles unchanged, is one element moving.

    PYTHONPATH=$PWD python3 tests/gpu/probe_phase1_precision.py '[{}, {"phase1_products": "tf32"}]'
On the CPU (interpreted) it runs the first part only, at small PROBE_T and PROBE_H.
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from kda import prefill_inputs  # noqa: E402
from pallas_kernels.kda import prefill as pp  # noqa: E402
from pallas_kernels.kda import prefill_two_phase as two  # noqa: E402


def reference(q, k, v, g, beta, chunk):
    """Workspaces [chunks, H, ...] in float64 for one sequence of T = chunks * chunk."""
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * q.shape[-1] ** -0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    t, h, dk = q.shape
    n = t // chunk
    sh = lambda x: x.reshape(n, chunk, h, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v, g = sh(q), sh(k), sh(v), sh(g)
    b = beta.reshape(n, chunk, h).transpose(0, 2, 1)[..., None]
    gc = np.cumsum(g, axis=2)
    ex = np.exp(gc[:, :, :, None, :] - gc[:, :, None, :, :])  # [n, h, t, i, K]
    kk = np.einsum("nhtc,nhic,nhtic->nhti", k, k, ex)
    qk = np.einsum("nhtc,nhic,nhtic->nhti", q, k, ex)
    low = np.tril(np.ones((chunk, chunk)), -1)
    a = kk * low * b
    x = np.linalg.inv(np.eye(chunk) + a)
    ws = dict(w=x @ (b * k * np.exp(gc)), u0=x @ (b * v), qd=q * np.exp(gc),
              kt=k * np.exp(gc[:, :, -1:] - gc), m=qk * (low + np.eye(chunk)), dec=np.exp(gc[:, :, -1:]))
    return ws


TUNINGS = json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}, {"phase1_products": "tf32"}]


def main(tunings=TUNINGS):
    b, t, h = 1, int(os.environ.get("PROBE_T", 2048)), int(os.environ.get("PROBE_H", 16))
    interpret = jax.default_backend() != "gpu"
    q, k, v, g, beta, _ = prefill_inputs(b, t, h, seed=3)
    for tuning in tunings:
        tu = dict(pp.TUNING, **tuning)
        chunk = tu["chunk"]
        ref = reference(*(np.asarray(a[0], np.float64) for a in (q, k, v, g, beta)), chunk)
        n = t // chunk
        cu = jnp.array([0, t], jnp.int32)
        choff, t0, eos, end = two.chunk_table(cu, cu[1:], chunk, n)
        flat = lambda x: x.reshape(b * t, *x.shape[2:])  # noqa: E731
        out = jax.jit(lambda *a: two.phase1(t0, eos, end, jnp.zeros((h,), jnp.float32), *a, heads=h, chunk=chunk,
                                            lower_bound=0.0, gate=False, qk_norm=True, n_chunks=n, interpret=interpret,
                                            tuning=tu))(flat(q), flat(k), flat(v), flat(g), flat(beta))
        row = []
        for name, val in zip(two.workspace_names(tu["wq_interleaved"]), out):
            got, want = np.asarray(val, np.float64), ref[name]
            got = got.reshape(want.shape)
            err = np.abs(got - want)
            row.append(f"{name} {err.max() / np.abs(want).max():.2e}/{np.sqrt((err ** 2).mean() / (want ** 2).mean()):.2e}")
        print(tuning, "max/rms rel:", "  ".join(row), flush=True)


def whole(shape=(1, 8192, 96), tunings=TUNINGS):
    """The whole prefill's output error against benchmarks/kda.py's fp32 reference: largest, quantiles, RMS,
    and where the largest error is (token, its row in a chunk of 16, head, channel)."""
    import kda
    x = prefill_inputs(*shape)
    ro = np.asarray(kda.reference_prefill(*x)[0], np.float32)
    scale = np.abs(ro).max()
    for tuning in tunings:
        o = np.asarray(kda.ours_prefill(dict(pp.TUNING, **tuning))(*x)[0], np.float32)
        err = np.abs(o - ro) / scale
        b, t, h, c = np.unravel_index(err.argmax(), err.shape)
        print(tuning, f"o max {err.max():.2e} q99.999 {np.quantile(err, 0.99999):.2e} q99.9 {np.quantile(err, 0.999):.2e}"
              f" rms {np.sqrt((err ** 2).mean()):.2e} at token {t} (row {t % 16}), head {h}, channel {c}", flush=True)


if __name__ == "__main__":
    whole() if os.environ.get("PROBE_WHOLE") else main()
