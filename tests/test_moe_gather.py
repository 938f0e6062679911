"""The used-tile row gather of the slots' activation planes (`pallas_kernels/moe/gather.py`, interpreted):
equal to XLA's gather on every row of a used tile, for uneven, empty and one-expert routing and tiles of
several sizes (multiples of 16 as the path takes them, and others), of the token planes and of the token words
(one plane of whole rows); its shape errors name the argument."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import dispatch as dsp
from pallas_kernels.moe.gather import slot_planes
from pallas_kernels.moe.wgmma_mxfp4 import token_planes, token_words


@pytest.mark.parametrize("routing,tile_t,half,planes_of", [
    ("uneven", 16, 48, token_planes), ("one expert", 32, 64, token_planes), ("uneven", 48, 512, token_planes),
    ("uneven", 24, 32, token_planes), ("one expert", 7, 16, token_planes), ("uneven", 16, 64, token_words)])
def test_slot_planes_equal_the_gather_on_used_tiles(routing, tile_t, half, planes_of):
    rng = np.random.default_rng(tile_t)
    n, k, experts = 37, 4, 9
    if routing == "one expert":
        idx = np.tile(np.array([5, -1, 9, 5]), (n, 1))  # ids outside [0, E) are skipped pairs
    else:  # experts 0 and 1 empty, the rest uneven
        idx = rng.choice(np.arange(2, experts), (n, k), p=np.arange(1, experts - 1) / np.arange(1, experts - 1).sum())
    layout = dsp.block_layout(jnp.asarray(idx, jnp.int32), jnp.ones((n, k)), experts, tile_t)
    planes = planes_of(jnp.asarray(rng.standard_normal((n, 2 * half)), jnp.bfloat16))
    got = np.asarray(slot_planes(planes, layout.tile_expert, layout.slot_token, tile_t, experts, interpret=True))
    used = np.repeat(np.asarray(layout.tile_expert) < experts, tile_t)
    assert 0 < used.sum() < used.size
    want = np.asarray(planes)[:, np.asarray(layout.slot_token)]
    np.testing.assert_array_equal(got[:, used], want[:, used])


def test_slot_planes_refuses_bad_shapes():
    planes = jnp.zeros((2, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="slot_token"):
        slot_planes(planes, jnp.zeros((2,), jnp.int32), jnp.zeros((48,), jnp.int32), 16, 3)
    with pytest.raises(ValueError, match="power-of-two divisor"):
        slot_planes(jnp.zeros((2, 4, 24), jnp.bfloat16), jnp.zeros((1,), jnp.int32), jnp.zeros((16,), jnp.int32), 16, 3)
