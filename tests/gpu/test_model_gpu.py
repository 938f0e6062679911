"""The whole model on the GPU against the float64 NumPy reference, at every short length (XLA picks
different fusions per shape, and float64 fusions are the least exercised)."""

import numpy as np
import pytest

from kimik3_jax.model.logits import sequence_logits
from reference import k3_numpy as ref

F64_RTOL = 1e-10
F32_RTOL = 2e-4


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 130])
def test_logits_float64_and_float32(tiny_ckpt, n):
    tokens = [int(t) for t in np.random.default_rng(n).integers(0, 1024, size=n)]
    want = ref.forward(str(tiny_ckpt), np.asarray(tokens))
    scale = np.abs(want).max()
    got = sequence_logits(tiny_ckpt, tokens, "float64")
    assert np.abs(got - want).max() <= F64_RTOL * scale
    got = sequence_logits(tiny_ckpt, tokens, "float32")
    assert np.abs(got - want).max() <= F32_RTOL * scale
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
