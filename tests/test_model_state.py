"""prefill / decode_step over the decode state: splitting a sequence anywhere gives the same logits and
state as one pass, padding never leaks, and the real model's state has the SPEC section 9 sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3_jax.checkpoint.open import load_checkpoint
from kimik3_jax.model import cast_params, decode_step, init_state, prefill, prefill_last, state_bytes, state_shapes
from kimik3_jax.params import abstract
from kimik3_jax.presets import preset

T, CAP, B = 16, 32, 3  # one padded prefill shape and one cache size: each jit compiles once
# Relative to the largest |logit|. In fp32 each path (chunked prefill, step-by-step decode) is within ~3e-5
# of float64 on this random model (tests/test_model_vs_reference.py); two paths differ by up to twice that.
# Exactness itself is checked in float64 below.
F32_RTOL = 1e-4
F64_RTOL = 1e-12

run_prefill = jax.jit(prefill, static_argnums=1)
run_decode = jax.jit(decode_step, static_argnums=1)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    cfg, params = load_checkpoint(tiny_ckpt)
    return cfg, params


def _rows(seed, vocab, n=T):
    return np.random.default_rng(seed).integers(0, vocab, size=(B, n)).astype(np.int32)


def _split_run(cfg, params, full, n_first, m, dtype):
    """Prefill the first n_first[b] tokens of each row, then m decode steps; returns the logits of
    every real position [B, n+m, V] (rows aligned at their own positions) and the state."""
    tokens = np.where(np.arange(T)[None, :] < n_first[:, None], full, 7)  # 7: arbitrary padding id
    state = init_state(cfg, B, CAP, dtype)
    logits, state = run_prefill(params, cfg, tokens, n_first, state)
    out = np.zeros((B, T, cfg.vocab_size), np.float64)
    for b in range(B):
        out[b, :n_first[b]] = logits[b, :n_first[b]]
    for j in range(m):
        step_tokens = full[np.arange(B), n_first + j]
        lg, state = run_decode(params, cfg, state, step_tokens)
        out[np.arange(B), n_first + j] = np.asarray(lg)
    return out, state


def _states_close(a, b, lengths, rtol):
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    for x, y in ((a.kda.s, b.kda.s), (a.kda.conv, b.kda.conv)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.abs(x - y).max() <= rtol * np.abs(y).max()
    for bi, n in enumerate(np.asarray(lengths)):  # cache slots beyond a row's length are unused
        x = np.asarray(a.mla.kv[:, bi, :n], np.float64)
        y = np.asarray(b.mla.kv[:, bi, :n], np.float64)
        assert np.abs(x - y).max() <= rtol * np.abs(y).max()


@pytest.mark.parametrize("n_first,m", [((1, 6, 11), 5), ((8, 2, 5), 8), ((15, 1, 3), 1)])
def test_prefill_then_decode_equals_one_prefill(model, n_first, m):
    cfg, params = model
    params = cast_params(params, jnp.float32)
    n_first = np.array(n_first, np.int32)
    full = _rows(1, cfg.vocab_size)
    total = n_first + m
    want, want_state = run_prefill(params, cfg, full, total, init_state(cfg, B, CAP, jnp.float32))
    got, state = _split_run(cfg, params, full, n_first, m, jnp.float32)
    want = np.asarray(want, np.float64)
    scale = np.abs(want).max()
    for b in range(B):
        np.testing.assert_allclose(got[b, :total[b]], want[b, :total[b]], rtol=0, atol=F32_RTOL * scale)
        np.testing.assert_array_equal(got[b, :total[b]].argmax(-1), want[b, :total[b]].argmax(-1))
    _states_close(state, want_state, total, F32_RTOL)


def test_prefill_then_decode_float64(model):
    cfg, params = model
    with jax.enable_x64(True):
        p64 = cast_params(params, jnp.float64)
        n_first, m = np.array([4, 10, 1], np.int32), 6
        full = _rows(2, cfg.vocab_size)
        want, want_state = run_prefill(p64, cfg, full, n_first + m, init_state(cfg, B, CAP, jnp.float64))
        got, state = _split_run(cfg, p64, full, n_first, m, jnp.float64)
        want = np.asarray(want)
        for b in range(B):
            n = n_first[b] + m
            assert np.abs(got[b, :n] - want[b, :n]).max() <= F64_RTOL * np.abs(want).max()
        _states_close(state, want_state, n_first + m, F64_RTOL)


def test_continuing_a_prefill_equals_one_prefill(model):
    """Chunked prefill and prefix caching rely on this: prefill(A) then prefill(B) == prefill(A + B)."""
    cfg, params = model
    params = cast_params(params, jnp.float32)
    first, second = np.array([5, 16, 0], np.int32), np.array([9, 0, 13], np.int32)
    a, c = _rows(3, cfg.vocab_size), _rows(4, cfg.vocab_size)
    full = np.zeros((B, T), np.int32)
    for b in range(B):
        seq = np.concatenate([a[b, :first[b]], c[b, :second[b]]])
        full[b, :len(seq)] = seq
    state = init_state(cfg, B, CAP, jnp.float32)
    la, state = run_prefill(params, cfg, a, first, state)
    lc, state = run_prefill(params, cfg, c, second, state)
    want, want_state = run_prefill(params, cfg, full, first + second, init_state(cfg, B, CAP, jnp.float32))
    want = np.asarray(want, np.float64)
    scale = np.abs(want).max()
    for b in range(B):
        got = np.concatenate([np.asarray(la[b, :first[b]]), np.asarray(lc[b, :second[b]])])
        assert np.abs(got - want[b, :first[b] + second[b]]).max() <= F32_RTOL * scale
    _states_close(state, want_state, first + second, F32_RTOL)


def test_padding_never_leaks(model):
    """Right padding: whatever the padded ids are, real logits and the state are bitwise the same; a row
    with length 0 keeps its state bitwise."""
    cfg, params = model
    params = cast_params(params, jnp.float32)
    lengths = np.array([3, 16, 0], np.int32)
    real = _rows(5, cfg.vocab_size)
    outs = []
    start = init_state(cfg, B, CAP, jnp.float32)
    start = start.replace(kda=start.kda.replace(s=start.kda.s + 0.5))  # a non-empty state to keep
    for pad_seed in (6, 7):
        junk = _rows(pad_seed, cfg.vocab_size)
        tokens = np.where(np.arange(T)[None, :] < lengths[:, None], real, junk)
        outs.append(run_prefill(params, cfg, tokens, lengths, start))
    (l1, s1), (l2, s2) = outs
    for b in range(B):
        np.testing.assert_array_equal(np.asarray(l1[b, :lengths[b]]), np.asarray(l2[b, :lengths[b]]))
    for x, y in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    row2 = lambda st: (st.kda.s[:, 2], st.kda.conv[:, 2], st.mla.kv[:, 2], st.lengths[2])  # noqa: E731
    for x, y in zip(row2(s1), row2(start)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_prefill_last_is_prefill_at_each_last_position(model):
    """The same state, and the logits of each row's last real token (float64: equal to rounding)."""
    cfg, params = model
    lengths = np.array([1, 16, 7], np.int32)
    tokens = _rows(8, cfg.vocab_size)
    with jax.enable_x64(True):
        p64 = cast_params(params, jnp.float64)
        full, s_full = prefill(p64, cfg, tokens, lengths, init_state(cfg, B, CAP, jnp.float64))
        last, s_last = jax.jit(prefill_last, static_argnums=1)(p64, cfg, tokens, lengths,
                                                               init_state(cfg, B, CAP, jnp.float64))
        assert last.shape == (B, cfg.vocab_size)
        want = np.asarray(full)[np.arange(B), lengths - 1]
        assert np.abs(np.asarray(last) - want).max() <= F64_RTOL * np.abs(want).max()
        for x, y in zip(jax.tree_util.tree_leaves(s_full), jax.tree_util.tree_leaves(s_last)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_capacity_and_shape_errors(model):
    cfg, params = model
    state = init_state(cfg, 2, 8)
    with pytest.raises(ValueError, match="sequence 1: 0 cached \\+ 9 new tokens exceed .* capacity of 8"):
        prefill(params, cfg, np.zeros((2, 9), np.int32), np.array([2, 9], np.int32), state)
    with pytest.raises(ValueError, match="tokens must be \\[batch\\]"):
        decode_step(params, cfg, state, np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        init_state(cfg, 1, cfg.max_position_embeddings + 1)


def test_k3_abstract_prefill_and_decode():
    """eval_shape of the real model: nothing allocated; the state has the SPEC section 9 sizes."""
    cfg = preset("k3")
    params = abstract(cfg, text_only=True)
    sizes = state_bytes(cfg, max_len=1000)
    assert sizes["kda_state"] == 414 * 2 ** 20 == 69 * 96 * 128 * 128 * 4
    assert sizes["mla_per_token"] == 27_648 == 24 * 576 * 2
    assert sizes["kda_conv"] == 69 * 3 * 3 * 12288 * 2
    state = state_shapes(cfg, 2, 64)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    logits, new = jax.eval_shape(functools.partial(prefill, cfg=cfg), params, tokens=tokens, lengths=lengths,
                                 state=state)
    assert logits.shape == (2, 16, 163840) and logits.dtype == jnp.float32
    assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), new) == \
        jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), state)
    step, _ = jax.eval_shape(functools.partial(decode_step, cfg=cfg), params, state=state,
                             tokens=jax.ShapeDtypeStruct((2,), jnp.int32))
    assert step.shape == (2, 163840)
