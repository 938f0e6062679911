"""Static-batch generation: one prefill, then decode steps fused on the device in chunks.

The model is passed in (`init_state_fn`, `prefill_fn`, `decode_fn`, the signatures of
`kimik3_jax.model`), so the loop runs the same against the real model and a test double. `prefill_fn`
may return logits [B, T, V] (`prefill`) or only each row's last ones [B, V] (`prefill_last`, what the
CLI uses: the full [B, T, V] would not fit at K3's vocabulary for long batches).

    out = generate(params, cfg, prompts, SamplingParams(), max_new_tokens=64, eos_id=tok.eos_id, seed=0,
                   prefill_fn=prefill, decode_fn=decode_step, init_state_fn=init_state)
    out.completions[i].tokens, out.completions[i].finish_reason, out.timing.decode_tokens_per_s

Prompts are right-padded to one length T (rounded up to a multiple of PAD_MULTIPLE, so nearby prompt
lengths share a compiled program); each row's first token comes from the prefill logits at its last
real position. `steps_per_call` decode steps then run in one `lax.while_loop` per host round trip,
which stops early once every row is finished. Finished rows keep decoding padding, which is dropped.
Row i draws its t-th token with key fold_in(fold_in(PRNGKey(seed), row_ids[i]), t): the draws do not
depend on the batch a prompt lands in nor on `steps_per_call`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kimik3_jax.generate.sampling import GenerationArgumentError, SamplingParams, sample, stack_params
from kimik3_jax.sharding.plan import constrain

PAD_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class Completion:
    tokens: list[int]   # generated ids, the stop token left out
    finish_reason: str  # "eos" | "length"


@dataclasses.dataclass(frozen=True)
class Timing:
    compile_s: float         # tracing and compiling, 0 when the programs were already built
    prefill_s: float         # the prefill call and the first token
    decode_s: float          # every decode call
    prompt_tokens: int
    decode_tokens: int       # tokens made by decode steps (the first token of each row is prefill's)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    completions: list[Completion]  # one per prompt, in prompt order
    timing: Timing


def check_prompt(prompt: Sequence[int], vocab_size: int, max_positions: int, name: str) -> None:
    """Raise GenerationArgumentError naming `name` unless the prompt can be generated from."""
    if len(prompt) == 0:
        raise GenerationArgumentError(f"{name} is empty: there is no token to continue from")
    if len(prompt) >= max_positions:
        raise GenerationArgumentError(f"{name} has {len(prompt)} tokens; max_position_embeddings = "
                                      f"{max_positions} leaves no room to generate")
    ids = np.asarray(prompt)
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise GenerationArgumentError(f"{name} must be a list of integer token ids")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise GenerationArgumentError(f"{name}: token id {int(bad[0])} is outside the vocabulary 0..{vocab_size - 1}")


def generate(params, cfg, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
             max_new_tokens: int | Sequence[int], eos_id: int | Sequence[int], seed: int,
             prefill_fn: Callable, decode_fn: Callable, init_state_fn: Callable, progress: bool = True, *,
             steps_per_call: int = 8, pad_id: int = 0, row_ids: Sequence[int] | None = None) -> GenerateOutput:
    """Generate for every prompt at once (a static batch); see the module docstring.

    `sampling` and `max_new_tokens` are one value for all prompts or one per prompt; `eos_id` is one
    stop id or several; `row_ids` (default 0..B-1) pick each row's random stream."""
    B = len(prompts)
    if B == 0:
        raise GenerationArgumentError("prompts is empty: nothing to generate")
    sampling = _per_row(sampling, B, "sampling")
    budgets = [int(n) for n in _per_row(max_new_tokens, B, "max_new_tokens")]
    row_ids = list(range(B)) if row_ids is None else [int(r) for r in row_ids]
    if len(row_ids) != B:
        raise GenerationArgumentError(f"row_ids has {len(row_ids)} entries for {B} prompts")
    if steps_per_call < 1:
        raise GenerationArgumentError(f"steps_per_call must be >= 1, got {steps_per_call}")
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        if n < 1:
            raise GenerationArgumentError(f"max_new_tokens of prompt {row_ids[i]} must be >= 1, got {n}")
        check_prompt(p, cfg.vocab_size, cfg.max_position_embeddings, f"prompt {row_ids[i]}")
    eos = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(int(e) for e in eos_id)

    lengths = [len(p) for p in prompts]
    max_pos = cfg.max_position_embeddings
    T = min(-(-max(lengths) // PAD_MULTIPLE) * PAD_MULTIPLE, max_pos)
    capacity = min(T + max(budgets), max_pos)
    budgets = [min(n, capacity - length) for n, length in zip(budgets, lengths)]  # each >= 1
    tokens_BT = np.full((B, T), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens_BT[i, :lengths[i]] = p

    first, chunk = _programs(prefill_fn, decode_fn, cfg, steps_per_call, pad_id, eos)
    state = init_state_fn(cfg, B, capacity, _activation_dtype(params))
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(seed), jnp.asarray(row_ids, jnp.uint32))
    knobs = (row_keys, *stack_params(sampling), jnp.asarray(budgets, jnp.int32))

    t0 = time.perf_counter()
    first_args = (params, jnp.asarray(tokens_BT), jnp.asarray(lengths, jnp.int32), state, *knobs)
    run_first = first.compiled(first_args)
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    carry = run_first(*first_args)  # (state, token, count, done)
    tok_B, done_B = np.asarray(carry[1]), np.asarray(carry[3])
    prefill_s = time.perf_counter() - t0
    out = [[int(t)] for t in tok_B]

    decode_s, decode_tokens = 0.0, 0
    if not done_B.all():
        t0 = time.perf_counter()
        run_chunk = chunk.compiled((params, *carry, *knobs))
        compile_s += time.perf_counter() - t0
    with tqdm(total=max(budgets), unit="tok", desc="generating", file=sys.stderr, disable=not progress) as bar:
        bar.update(1)
        while not done_B.all():
            t0 = time.perf_counter()
            *carry, new_SB, live_SB, steps = run_chunk(params, *carry, *knobs)
            new_SB, live_SB, done_B, steps = map(np.asarray, (new_SB, live_SB, carry[3], steps))
            decode_s += time.perf_counter() - t0
            for b in np.flatnonzero(live_SB.any(axis=0)):
                out[b].extend(int(t) for t in new_SB[live_SB[:, b], b])
            decode_tokens += int(live_SB.sum())
            bar.update(int(steps))
            bar.set_postfix_str(f"{decode_tokens / max(decode_s, 1e-9):.1f} tok/s")

    completions = []
    for toks in out:
        stopped = toks[-1] in eos
        completions.append(Completion(toks[:-1] if stopped else toks, "eos" if stopped else "length"))
    return GenerateOutput(completions, Timing(compile_s, prefill_s, decode_s, sum(lengths), decode_tokens))


def _per_row(value, B: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise GenerationArgumentError(f"{name} has {len(value)} entries for {B} prompts")
        return list(value)
    return [value] * B


def _activation_dtype(params):
    try:
        return params.text.embed.dtype
    except AttributeError:
        raise GenerationArgumentError("params must be the model's parameter tree (params.text.embed)") from None


class _Program:
    """A jitted function compiled ahead of time once per argument signature, so that compiling is timed
    apart from running."""

    def __init__(self, fn: Callable, donate: tuple[int, ...]):
        self._jit = jax.jit(fn, donate_argnums=donate)
        self._built: dict = {}

    def compiled(self, args: tuple):
        leaves, tree = jax.tree_util.tree_flatten(args)
        sig = (tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        if sig not in self._built:
            self._built[sig] = self._jit.lower(*args).compile()
        return self._built[sig]


def _whole(cfg, *xs):
    """The small per-row results the host reads, replicated under a sharding plan (every process of a
    multi-host run can read them)."""
    return tuple(constrain(x, cfg, (None,) * x.ndim, "generation output") for x in xs)


@functools.lru_cache(maxsize=8)
def _programs(prefill_fn: Callable, decode_fn: Callable, cfg, steps: int, pad_id: int, eos: tuple[int, ...]):
    eos_E = np.asarray(eos, np.int32)

    def stopped(tok_B, count_B, budget_B):
        return jnp.any(tok_B[:, None] == eos_E[None, :], axis=1) | (count_B >= budget_B)

    def first(params, tokens_BT, lengths_B, state, row_keys, temperature_B, top_p_B, top_k_B, budget_B):
        logits, state = prefill_fn(params, cfg, tokens_BT, lengths_B, state)
        if logits.ndim == 3:  # [B, T, V]: read each row's last real position ([B, V] is that already)
            logits = jnp.take_along_axis(logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        last_BV = logits
        keys = jax.vmap(jax.random.fold_in)(row_keys, jnp.zeros_like(lengths_B))
        tok_B = sample(last_BV, keys, temperature_B, top_p_B, top_k_B)
        count_B = jnp.ones_like(lengths_B)
        return state, *_whole(cfg, tok_B, count_B, stopped(tok_B, count_B, budget_B))

    def chunk(params, state, tok_B, count_B, done_B, row_keys, temperature_B, top_p_B, top_k_B, budget_B):
        B = tok_B.shape[0]

        def body(c):
            i, state, tok_B, count_B, done_B, new_SB, live_SB = c
            logits_BV, state = decode_fn(params, cfg, state, tok_B)
            keys = jax.vmap(jax.random.fold_in)(row_keys, count_B)
            live_B = ~done_B
            tok_B = jnp.where(live_B, sample(logits_BV, keys, temperature_B, top_p_B, top_k_B), pad_id)
            count_B = count_B + live_B
            done_B = done_B | stopped(tok_B, count_B, budget_B)
            return i + 1, state, tok_B, count_B, done_B, new_SB.at[i].set(tok_B), live_SB.at[i].set(live_B)

        init = (jnp.int32(0), state, tok_B, count_B, done_B,
                jnp.full((steps, B), pad_id, jnp.int32), jnp.zeros((steps, B), bool))
        i, state, tok_B, count_B, done_B, new_SB, live_SB = jax.lax.while_loop(
            lambda c: (c[0] < steps) & ~jnp.all(c[4]), body, init)
        return state, *_whole(cfg, tok_B, count_B, done_B, new_SB, live_SB, i)

    return _Program(first, donate=(3,)), _Program(chunk, donate=(1,))
