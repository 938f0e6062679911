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


@pytest.mark.parametrize("n,skew", [(1, False), (3, False), (40, False), (40, True)])
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


def test_unknown_strategy_is_refused(experts):
    cfg, ex = experts
    with pytest.raises(ValueError, match="strategy must be"):
        routed_experts(jnp.zeros((1, cfg.moe.latent_width)), jnp.zeros((1, cfg.moe.top_k), jnp.int32),
                       jnp.ones((1, cfg.moe.top_k)), ex, 4.0, 25.0, "dense")
