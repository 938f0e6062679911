"""`kimik3 generate`: batched generation from a checkpoint directory, results as JSON lines.

Inputs come from `--prompt` (repeatable) or `--prompts-file` (JSON lines, each `{"prompt": ...}` or
`{"messages": [...]}` plus optional per-line settings). Each output line answers the input at the same
position. A bad input (malformed line, empty or over-long prompt) becomes an output line with an
`error` naming it, the others are still generated, and the exit code is 2. Without `--checkpoint`,
a generated `tiny` checkpoint is made once in the cache and reused.

This module imports JAX lazily, so building the command-line parser stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimik3_jax.atomic import atomic_file

DTYPES = ("bfloat16", "float32", "float64")
EFFORTS = ("low", "medium", "high", "max", "none")
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
CHAT_KEYS = ("tools", "thinking", "thinking_effort", "tool_choice", "response_format")
LINE_KEYS = ("prompt", "messages", "id", "max_new_tokens") + SAMPLING_KEYS + CHAT_KEYS
TINY_DIR_NAME = "tiny-seed0"


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for a batch of prompts (stops at <|end_of_msg|>)")
    p.add_argument("--checkpoint", help="checkpoint directory (default: a generated tiny checkpoint, made "
                                        "once in $KIMIK3_CACHE or ~/.cache/kimik3)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeat for several")
    src.add_argument("--prompts-file", metavar="IN.jsonl",
                     help='JSON lines: {"prompt": TEXT} or {"messages": [...]}, optionally with '
                          f"{', '.join(LINE_KEYS[2:])}")
    p.add_argument("--out", metavar="OUT.jsonl", help="write the results here (atomically); default: stdout")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="render --prompt / 'prompt' lines as a user message "
                                                       "and split replies into reasoning and answer")
    p.add_argument("--no-thinking", action="store_true", help="chat without the think channel")
    p.add_argument("--thinking-effort", choices=EFFORTS, default="max",
                   help="chat thinking effort (default max, as the release's chat template)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="compute dtype (default bfloat16)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per static batch (default 32)")
    p.add_argument("--steps-per-call", type=int, default=8, help="decode steps fused per device call")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from kimik3_jax.sharding.distributed import add_sharding_arguments
    add_sharding_arguments(p)
    p.set_defaults(func=run_generate)


@dataclass
class Item:
    """One input: where it came from, what it asks for, and what became of it."""
    name: str                   # "in.jsonl:3" or "--prompt 2", for messages
    record: dict[str, Any]      # echoed into the output line
    entry: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    thinking: bool = True
    ids: list[int] | None = None
    sampling: Any = None
    max_new: int = 0
    error: str | None = None


def model_functions():
    """(init_state, prefill, decode_step) of the model; tests replace this to run a stand-in."""
    from kimik3_jax import model
    return model.init_state, model.prefill_last, model.decode_step


def run_generate(args: argparse.Namespace) -> int:
    from kimik3_jax.generate.sampling import GenerationArgumentError, SamplingParams

    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1),
                             ("--steps-per-call", args.steps_per_call, 1), ("--seed", args.seed, 0)):
        if value < low:
            raise GenerationArgumentError(f"{flag} must be >= {low}, got {value}")
    default = SamplingParams(args.temperature, args.top_p, args.top_k)
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise GenerationArgumentError(f"--out {args.out}: its directory does not exist")
    items = _read_items(args)
    if not items:
        raise GenerationArgumentError(f"--prompts-file {args.prompts_file} holds no prompts")

    from kimik3_jax.config import ModelConfig
    from kimik3_jax.tokenizer import K3Tokenizer
    directory = Path(args.checkpoint) if args.checkpoint else default_checkpoint(progress=not args.quiet)
    tok = K3Tokenizer.from_dir(directory)
    cfg = ModelConfig.from_file(directory / "config.json")  # release and converted layouts both keep it
    for item in items:
        if item.error is None:
            _prepare(item, tok, cfg, args, default)

    todo = [(k, item) for k, item in enumerate(items) if item.error is None]
    totals = [0.0, 0.0, 0.0, 0]  # compile s, prefill s, decode s, decode tokens
    if todo:
        import jax

        from kimik3_jax.checkpoint.open import load_checkpoint
        from kimik3_jax.sharding.distributed import plan_from_args
        plan = plan_from_args(args)
        with jax.enable_x64(args.dtype == "float64"):  # scoped: float64 arrays only inside this command
            cfg, params = load_checkpoint(directory, text_only=True, dtype=args.dtype, shardings=plan)
            _run_batches(todo, params, cfg.with_runtime(sharding=plan), tok, args, totals)
    from kimik3_jax.sharding.distributed import is_writer
    if not is_writer():  # multi-host: every process generated the same tokens; process 0 reports them
        return 2 if any(item.error is not None for item in items) else 0
    _write([item.record if item.error is None else {**item.record, "error": item.error} for item in items],
           args.out)

    failed = [item for item in items if item.error is not None]
    for item in failed:
        print(f"kimik3 generate: error: {item.error}", file=sys.stderr)
    compile_s, prefill_s, decode_s, decoded = totals
    rate = decoded / decode_s if decode_s > 0 else 0.0
    print(f"{len(todo)} of {len(items)} prompts generated; decode {decoded} tokens at {rate:.1f} tokens/s, "
          f"prefill {prefill_s:.2f} s, compile {compile_s:.1f} s"
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return 2 if failed else 0


def _read_items(args) -> list[Item]:
    from kimik3_jax.generate.sampling import GenerationArgumentError

    if args.prompt is not None:
        return [Item(f"--prompt {k}", {"prompt": text}, {"prompt": text}, chat=args.chat)
                for k, text in enumerate(args.prompt, start=1)]
    path = Path(args.prompts_file)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationArgumentError(f"--prompts-file {path}: cannot read it ({e})") from None
    items = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines are not inputs
        item = Item(f"{path}:{n}", {"line": n})
        items.append(item)
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            item.error = f"{item.name}: not valid JSON ({e.msg} at column {e.colno})"
            continue
        if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
            item.error = f'{item.name}: expected an object with either "prompt" or "messages"'
            continue
        unknown = sorted(set(entry) - set(LINE_KEYS))
        if unknown:
            item.error = f"{item.name}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(LINE_KEYS)}"
            continue
        item.entry, item.chat = entry, "messages" in entry or args.chat
        item.record.update({k: entry[k] for k in ("id", "prompt", "messages") if k in entry})
    return items


def _prepare(item: Item, tok, cfg, args, default) -> None:
    """Token ids, sampling settings and budget of one input; on a problem, item.error names it."""
    from kimik3_jax.errors import K3Error
    from kimik3_jax.generate.loop import check_prompt
    from kimik3_jax.tokenizer.chat import encode_chat

    e = item.entry
    try:
        item.sampling = default.replace(**{k: e[k] for k in SAMPLING_KEYS if k in e})
        item.max_new = e.get("max_new_tokens", args.max_new_tokens)
        if isinstance(item.max_new, bool) or not isinstance(item.max_new, int) or item.max_new < 1:
            raise K3Error(f"max_new_tokens must be an integer >= 1, got {item.max_new!r}")
        if "prompt" in e and not isinstance(e["prompt"], str):
            raise K3Error(f'"prompt" must be a string, got {type(e["prompt"]).__name__}')
        if e.get("prompt") == "":
            raise K3Error("the prompt is empty")
        if not item.chat:
            item.ids = tok.encode(e["prompt"])
        else:
            messages = e["messages"] if "messages" in e else [{"role": "user", "content": e["prompt"]}]
            if isinstance(messages, list) and not messages:
                raise K3Error("messages is empty")
            item.thinking = bool(e.get("thinking", not args.no_thinking))
            effort = e.get("thinking_effort", args.thinking_effort)
            kw = {k: e[k] for k in ("tools", "tool_choice", "response_format") if k in e}
            item.ids = encode_chat(tok, messages, thinking=item.thinking,
                                   thinking_effort=None if effort == "none" else effort, **kw)
        check_prompt(item.ids, cfg.vocab_size, cfg.max_position_embeddings, "the prompt")
    except (K3Error, TypeError) as err:  # TypeError: a setting of the wrong type in the line
        item.error = f"{item.name}: {err}"


def _run_batches(todo: list[tuple[int, Item]], params, cfg, tok, args, totals: list) -> None:
    from kimik3_jax.generate.loop import generate
    from kimik3_jax.tokenizer.chat import split_reply

    init_state, prefill, decode_step = model_functions()
    plan = cfg.runtime.sharding
    rows = 1 if plan is None else plan.ways("batch")  # a batch splits over the data axis in equal parts
    for start in range(0, len(todo), args.batch_size):
        batch = todo[start:start + args.batch_size]
        fill = -len(batch) % rows  # stand-in rows (a copy of the first prompt, one token) fill the last part
        ids = [item.ids for _, item in batch] + [batch[0][1].ids] * fill
        out = generate(params, cfg, ids, [item.sampling for _, item in batch] + [batch[0][1].sampling] * fill,
                       [item.max_new for _, item in batch] + [1] * fill, tok.eos_id, args.seed, prefill,
                       decode_step, init_state, progress=not args.quiet, steps_per_call=args.steps_per_call,
                       pad_id=tok.pad_id, row_ids=[k for k, _ in batch] + [len(todo) + i for i in range(fill)])
        t = out.timing
        for i, v in enumerate((t.compile_s, t.prefill_s, t.decode_s, t.decode_tokens)):
            totals[i] += v
        for (_, item), c in zip(batch, out.completions):
            item.record.update(completion=tok.decode(c.tokens), token_ids=c.tokens, finish_reason=c.finish_reason)
            if item.chat:
                reasoning, answer, calls = split_reply(tok, c.tokens, thinking=item.thinking)
                item.record.update(reasoning=reasoning, answer=answer, tool_calls=calls)


def _write(records: list[dict], out: str | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(out)
    try:
        with atomic_file(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        from kimik3_jax.generate.sampling import GenerationArgumentError
        raise GenerationArgumentError(f"--out {path}: cannot write it ({e})") from None


def default_checkpoint(progress: bool = True) -> Path:
    """The built-in tiny checkpoint (seed 0), made once under $KIMIK3_CACHE or ~/.cache/kimik3."""
    from kimik3_jax.checkpoint.generate import make_checkpoint
    from kimik3_jax.presets import preset_dict

    root = Path(os.environ.get("KIMIK3_CACHE") or Path.home() / ".cache" / "kimik3")
    path = root / TINY_DIR_NAME
    config = preset_dict("tiny")
    if not _is_complete(path, config):
        print(f"kimik3 generate: making the built-in tiny checkpoint in {path} (once)", file=sys.stderr)
        root.mkdir(parents=True, exist_ok=True)
        make_checkpoint(config, path, seed=0, overwrite=path.exists(), progress=progress)
    return path


def _is_complete(path: Path, config: dict) -> bool:
    """True when `path` holds a problem-free checkpoint of exactly `config` with its tokenizer."""
    from kimik3_jax.checkpoint.load import Checkpoint
    from kimik3_jax.errors import K3Error
    from kimik3_jax.tokenizer import CONFIG_FILE, MODEL_FILE

    try:
        if json.loads((path / "config.json").read_text()) != config:
            return False
        ckpt = Checkpoint(path)
        ok = not ckpt.problems(ckpt.config())
        ckpt.close()
        return ok and (path / MODEL_FILE).is_file() and (path / CONFIG_FILE).is_file()
    except (OSError, ValueError, K3Error):
        return False
