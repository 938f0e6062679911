"""The generation loop and the sampler, against a fake model whose greedy output is known in advance.

The fake language: after token t < CHAIN_END comes t + 1, after CHAIN_END comes EOS, after anything
else comes 1; at position STOP_POS (0-based, of the token consumed) EOS comes regardless. Logits fall
off linearly with the distance to that target, so sampling has a spread to draw from. The prefill
logits at position j depend only on the token and position j, so reading a padded position shows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from kimik3_jax.config import Runtime
from kimik3_jax.generate import GenerationArgumentError, SamplingParams, generate, sample

CHAIN_END = 49
STOP_POS = 60
GREEDY = SamplingParams.greedy()


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = 64
    eos_token_id: int = 63
    max_position_embeddings: int = 256
    runtime: Runtime = Runtime()  # one device


@struct.dataclass
class FakeState:
    pos: jax.Array   # [B] tokens consumed so far
    seen: jax.Array  # [B, S] the token consumed at each position


@struct.dataclass
class _Text:
    embed: jax.Array


@struct.dataclass
class FakeParams:
    text: _Text


def fake_params(dtype=jnp.float32) -> FakeParams:
    return FakeParams(_Text(jnp.zeros((4, 2), dtype)))


def next_token(cfg, tok, pos):
    target = jnp.where(tok < CHAIN_END, tok + 1, 1)
    return jnp.where((tok == CHAIN_END) | (pos == STOP_POS), cfg.eos_token_id, target)


def _logits(cfg, tok, pos):
    target = next_token(cfg, tok, pos)
    v = jnp.arange(cfg.vocab_size)
    return -0.7 * jnp.abs(v - target[..., None]).astype(jnp.float32)


def fake_init_state(cfg, batch, max_len, dtype):
    assert max_len <= cfg.max_position_embeddings, (max_len, cfg.max_position_embeddings)
    return FakeState(jnp.zeros((batch,), jnp.int32), jnp.full((batch, max_len), -1, jnp.int32))


def fake_prefill(params, cfg, tokens, lengths, state):
    T = tokens.shape[1]
    assert T <= state.seen.shape[1]
    logits = _logits(cfg, tokens, jnp.arange(T)[None, :])
    seen = state.seen.at[:, :T].set(jnp.where(jnp.arange(T)[None] < lengths[:, None], tokens, -1))
    return logits, FakeState(lengths.astype(jnp.int32), seen)


def fake_decode_step(params, cfg, state, tokens):
    rows = jnp.arange(tokens.shape[0])
    seen = state.seen.at[rows, state.pos].set(tokens, mode="drop")
    return _logits(cfg, tokens, state.pos), FakeState(state.pos + 1, seen)


FAKE = dict(prefill_fn=fake_prefill, decode_fn=fake_decode_step, init_state_fn=fake_init_state)


def reference(prompt, max_new, cfg=FakeConfig()):
    """Greedy continuation of the fake language, and its finish reason."""
    seq, out = list(prompt), []
    while len(out) < max_new:
        t = int(next_token(cfg, jnp.int32(seq[-1]), jnp.int32(len(seq) - 1)))
        if t == cfg.eos_token_id:
            return out, "eos"
        out.append(t)
        seq.append(t)
    return out, "length"


def run(prompts, sampling=GREEDY, max_new=10, seed=0, cfg=FakeConfig(), **kw):
    return generate(fake_params(), cfg, prompts, sampling, max_new, cfg.eos_token_id, seed,
                    progress=False, **{**FAKE, **kw})


def tokens_of(out):
    return [c.tokens for c in out.completions]


def test_right_padding_and_per_row_eos():
    prompts = [[3, 4, 5], [10, 20, 30, 40, 44], [46], [7] * 20]
    out = run(prompts, max_new=12)
    for prompt, c in zip(prompts, out.completions):
        assert (c.tokens, c.finish_reason) == reference(prompt, 12)
    assert out.completions[1].tokens == [45, 46, 47, 48, 49] and out.completions[1].finish_reason == "eos"
    assert out.completions[2].tokens == [47, 48, 49] and out.completions[2].finish_reason == "eos"
    assert out.completions[0].finish_reason == "length" and len(out.completions[0].tokens) == 12


def test_stop_depends_on_each_rows_own_position():
    prompts = [[1] * 55, [1] * 50, [2]]  # STOP_POS reached after 5 and 10 new tokens
    out = run(prompts, max_new=30)
    for prompt, c in zip(prompts, out.completions):
        assert (c.tokens, c.finish_reason) == reference(prompt, 30)
    assert [len(c.tokens) for c in out.completions[:2]] == [6, 11]


def test_max_new_tokens_per_row_and_one_token():
    out = run([[1], [1], [1]], max_new=[1, 4, 9])
    assert tokens_of(out) == [[2], [2, 3, 4, 5], list(range(2, 11))]
    assert {c.finish_reason for c in out.completions} == {"length"}


def test_cache_capacity_caps_generation():
    cfg = FakeConfig(max_position_embeddings=40)
    out = run([[1] * 30, [1] * 5], max_new=100, cfg=cfg)
    assert [len(c.tokens) for c in out.completions] == [10, 35]
    assert all(c.finish_reason == "length" for c in out.completions)


def test_greedy_is_deterministic_and_ignores_seed():
    prompts = [[5, 6], [8]]
    a, b = run(prompts, seed=0), run(prompts, seed=123)
    assert tokens_of(a) == tokens_of(b) == [reference(p, 10)[0] for p in prompts]


def test_seeded_sampling_is_reproducible():
    hot = SamplingParams(temperature=1.5)
    prompts = [[5, 6], [8], [9, 9, 9]]
    a, b, c = run(prompts, hot, 20, seed=7), run(prompts, hot, 20, seed=7), run(prompts, hot, 20, seed=8)
    assert tokens_of(a) == tokens_of(b)
    assert tokens_of(a) != tokens_of(c)
    assert tokens_of(a) != [reference(p, 20)[0] for p in prompts]  # it did sample


def test_fused_decode_matches_one_step_at_a_time():
    prompts = [[5, 6], [8], [40], [2] * 9]
    hot = SamplingParams(temperature=1.2, top_p=0.9)
    one = run(prompts, hot, 25, seed=3, steps_per_call=1)
    for steps in (3, 8, 64):
        assert tokens_of(run(prompts, hot, 25, seed=3, steps_per_call=steps)) == tokens_of(one)
    assert [c.finish_reason for c in run(prompts, hot, 25, seed=3, steps_per_call=8).completions] == \
        [c.finish_reason for c in one.completions]


def test_rows_draw_independently_of_batch_position():
    hot = SamplingParams(temperature=1.0)
    alone = run([[8]], hot, 15, seed=4, row_ids=[2])
    together = run([[1, 2], [3], [8]], hot, 15, seed=4)
    assert together.completions[2].tokens == alone.completions[0].tokens


def test_top_k_one_and_tiny_top_p_are_greedy():
    prompts = [[5, 6], [8], [30]]
    greedy = tokens_of(run(prompts, GREEDY, 15))
    assert tokens_of(run(prompts, SamplingParams(temperature=2.0, top_k=1), 15, seed=1)) == greedy
    assert tokens_of(run(prompts, SamplingParams(temperature=2.0, top_p=1e-6), 15, seed=1)) == greedy


def test_mixed_batch_keeps_greedy_rows_exact():
    prompts = [[5, 6], [5, 6], [8]]
    mixed = [GREEDY, SamplingParams(temperature=3.0), GREEDY]
    out = run(prompts, mixed, 20, seed=2)
    assert out.completions[0].tokens == reference([5, 6], 20)[0]
    assert out.completions[2].tokens == reference([8], 20)[0]
    assert out.completions[1].tokens != out.completions[0].tokens


def test_timing_counts_decode_tokens():
    out = run([[1], [46]], max_new=8)
    t = out.timing
    assert t.prompt_tokens == 2 and t.decode_tokens == (8 - 1) + (4 - 1)  # the EOS counts as made
    assert t.prefill_s >= 0 and t.decode_s > 0 and t.decode_tokens_per_s > 0


@pytest.mark.parametrize("prompts,match", [
    ([[1], []], "prompt 1 is empty"),
    ([[1] * 256], "prompt 0 has 256 tokens"),
    ([[1, 64]], "prompt 0: token id 64 is outside the vocabulary 0..63"),
    ([], "prompts is empty"),
])
def test_bad_prompts_are_named(prompts, match):
    with pytest.raises(GenerationArgumentError, match=match):
        run(prompts)


def test_bad_settings_are_named():
    with pytest.raises(GenerationArgumentError, match="max_new_tokens of prompt 0"):
        run([[1]], max_new=0)
    with pytest.raises(GenerationArgumentError, match="sampling has 1 entries for 2 prompts"):
        run([[1], [2]], [GREEDY])
    for kw, field in ((dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"),
                      (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k")):
        with pytest.raises(GenerationArgumentError, match=field):
            SamplingParams(**kw)


# ----- the sampler on its own -------------------------------------------------------------------

LOGITS_V = jnp.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], jnp.float32)
N = 6000


def draws(temperature=1.0, top_p=1.0, top_k=0, seed=0):
    logits = jnp.tile(LOGITS_V, (N, 1))
    keys = jax.random.split(jax.random.PRNGKey(seed), N)
    full = lambda v, d: jnp.full((N,), v, d)  # noqa: E731
    fn = jax.jit(sample)
    toks = fn(logits, keys, full(temperature, jnp.float32), full(top_p, jnp.float32), full(top_k, jnp.int32))
    return np.bincount(np.asarray(toks), minlength=len(LOGITS_V)) / N


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_the_softmax(temperature):
    expected = np.asarray(jax.nn.softmax(LOGITS_V / temperature))
    assert np.abs(draws(temperature) - expected).sum() / 2 < 0.03  # total variation, ~4 sigma at N=6000


def test_higher_temperature_spreads_the_draws():
    def entropy(p):
        p = p[p > 0]
        return -(p * np.log(p)).sum()
    assert entropy(draws(0.3)) < entropy(draws(1.0)) < entropy(draws(3.0))


def test_top_k_and_top_p_cut_the_tail():
    assert np.all(draws(1.0, top_k=3)[3:] == 0)
    expected = np.asarray(jax.nn.softmax(LOGITS_V[:3]))
    assert np.abs(draws(1.0, top_k=3)[:3] - expected).sum() / 2 < 0.03
    probs = np.asarray(jax.nn.softmax(LOGITS_V))  # 0.40, 0.25, 0.15 ...: top_p 0.5 keeps two tokens
    got = draws(1.0, top_p=0.5)
    assert np.all(got[2:] == 0) and abs(got[0] - probs[0] / probs[:2].sum()) < 0.03
    assert np.all(draws(5.0, top_p=1.0) > 0)  # top_p = 1 keeps every token


def test_top_p_cuts_the_tempered_distribution():
    """Temperature first, then the cuts (vLLM's and Hugging Face's order): at temperature 0.3 the top
    token alone holds more than half the mass, so top_p 0.5 keeps only it (untempered it would keep two)."""
    tempered = np.asarray(jax.nn.softmax(LOGITS_V / 0.3))
    assert tempered[0] > 0.5
    assert np.all(draws(0.3, top_p=0.5)[1:] == 0)
    hot = np.asarray(jax.nn.softmax(LOGITS_V / 3.0))  # flatter: the cut keeps more tokens
    keep = int(np.searchsorted(np.cumsum(hot), 0.5) + 1)
    got = draws(3.0, top_p=0.5)
    assert np.all(got[:keep] > 0) and np.all(got[keep:] == 0)


def test_greedy_rows_are_the_exact_argmax_with_ties_to_the_lowest_id():
    logits = jnp.asarray([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 0.0]], jnp.float32)
    z = jnp.zeros((2,), jnp.float32)
    toks = jax.jit(sample)(logits, jax.random.PRNGKey(0), z, z + 1.0, jnp.zeros((2,), jnp.int32))
    assert toks.tolist() == [1, 0] and toks.dtype == jnp.int32


def test_one_key_for_the_batch_is_split_over_rows():
    logits = jnp.zeros((64, 50), jnp.float32)
    ones = jnp.ones((64,), jnp.float32)
    toks = jax.jit(sample)(logits, jax.random.PRNGKey(1), ones, ones, jnp.zeros((64,), jnp.int32))
    assert len(set(toks.tolist())) > 20
