"""The two dropless expert strategies (sorted + ragged_dot, per-pair gather) are the same function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3_jax.ops.moe import routed_experts
from kimik3_jax.params import init_params
from kimik3_jax.presets import preset

F64_RTOL = 1e-13


@pytest.fixture(scope="module")
def experts():
    cfg = preset("tiny")
    return cfg, jax.tree_util.tree_map(lambda a: a[0], init_params(cfg, 5, text_only=True).text.moe.experts)


@pytest.mark.parametrize("n,skew", [pytest.param(1, False, marks=pytest.mark.slow), (3, False),
                                    pytest.param(40, False, marks=pytest.mark.slow), (40, True)])
def test_sorted_equals_gathered(experts, n, skew):
    cfg, ex = experts
    rng = np.random.default_rng(n)
    k, e = cfg.moe.top_k, cfg.moe.num_experts
    # top-k ids are distinct per token; with skew every token picks experts 0..k-1
    idx = np.tile(np.arange(k), (n, 1)) if skew else np.stack([rng.permutation(e)[:k] for _ in range(n)])
    with jax.enable_x64(True):
        xl = jnp.asarray(rng.normal(size=(n, cfg.moe.latent_width)))
        w = jnp.asarray(rng.uniform(size=(n, k)))
        idx = jnp.asarray(idx, jnp.int32)
        a = routed_experts(xl, idx, w, ex, cfg.situ_beta, cfg.situ_linear_beta, "sorted")
        b = routed_experts(xl, idx, w, ex, cfg.situ_beta, cfg.situ_linear_beta, "gathered")
        assert a.dtype == jnp.float64
        assert float(jnp.abs(a - b).max()) <= F64_RTOL * float(jnp.abs(a).max())


@pytest.mark.parametrize("strategy", ["sorted", pytest.param("gathered", marks=pytest.mark.slow)])
def test_pairs_with_an_out_of_range_id_and_weight_0_contribute_nothing(experts, strategy):
    """Expert parallelism passes the pairs another device owns as id E with weight 0."""
    cfg, ex = experts
    rng = np.random.default_rng(7)
    n, k, e = 6, cfg.moe.top_k, cfg.moe.num_experts
    idx = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    drop = rng.uniform(size=idx.shape) < 0.5
    with jax.enable_x64(True):
        xl = jnp.asarray(rng.normal(size=(n, cfg.moe.latent_width)))
        w = jnp.asarray(np.where(drop, 0.0, rng.uniform(size=(n, k))))
        kept = routed_experts(xl, jnp.asarray(np.where(drop, e, idx), jnp.int32), w, ex, cfg.situ_beta,
                              cfg.situ_linear_beta, strategy)
        want = sum(routed_experts(xl[t:t + 1], jnp.asarray(idx[t:t + 1, ~drop[t]], jnp.int32),
                                  w[t:t + 1, ~drop[t]], ex, cfg.situ_beta, cfg.situ_linear_beta, strategy)
                   * (jnp.arange(n) == t)[:, None] for t in range(n) if (~drop[t]).any())
        assert float(jnp.abs(kept - want).max()) <= F64_RTOL * float(jnp.abs(want).max())


def test_unknown_strategy_is_refused(experts):
    cfg, ex = experts
    with pytest.raises(ValueError, match="strategy must be"):
        routed_experts(jnp.zeros((1, cfg.moe.latent_width)), jnp.zeros((1, cfg.moe.top_k), jnp.int32),
                       jnp.ones((1, cfg.moe.top_k)), ex, 4.0, 25.0, "dense")
