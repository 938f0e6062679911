"""A small tokenizer in the release's file formats, for tests and tiny model presets.

Ranks 0..255 are the single bytes; then BPE merges learned on the built-in corpus (pre-split with
the release's pattern) until there are vocab_size - 256 ranks; then the 256 special ids with the
release's names at the release's offsets within the block.
"""

from __future__ import annotations

import base64
import heapq
import json
import os
from collections import Counter
from pathlib import Path

from kimik3_jax.tokenizer.corpus import BASE_TEXT, synthetic_text
from kimik3_jax.errors import TokenizerArgumentError
from kimik3_jax.tokenizer.special import (
    NUM_SPECIAL_TOKENS,
    SPECIAL_TOKENS,
    _require_int,
    remap_special_id,
    split_pieces,
)
from kimik3_jax.tokenizer.tokenizer import CONFIG_FILE, MODEL_FILE

# 256 byte ranks + at least 128 learned merges + the 256 special ids.
MIN_SMALL_VOCAB_SIZE = 256 + 128 + NUM_SPECIAL_TOKENS
# The hand-written text counts this many times as much as the synthetic words, so that the chat
# markup words and common English are merged first.
_BASE_WEIGHT = 8

# In the K2-family files the chat markers that parsers must see in decoded text are marked
# "special": false; a public K3 port's fixtures mark <|open|>, <|close|>, <|sep|> that way.
_NOT_SPECIAL = frozenset({"<|open|>", "<|close|>", "<|sep|>"})


def _corpus_counts() -> dict[bytes, int]:
    counts: Counter[bytes] = Counter()
    for piece in split_pieces(BASE_TEXT):
        counts[piece.encode("utf-8")] += _BASE_WEIGHT
    for piece in split_pieces(synthetic_text()):
        counts[piece.encode("utf-8")] += 1
    return counts


def _merge_word(word: list[int], a: int, b: int, new: int) -> list[int]:
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(counts: dict[bytes, int], n_merges: int) -> list[bytes]:
    """Byte-level BPE: starting from the 256 bytes, repeatedly merge the most frequent adjacent
    pair (ties: the pair of lowest ids) until `n_merges` new tokens exist. Returns all tokens in
    rank order. A merge whose bytes already form a token reuses it and adds no rank. Stops early
    when no pair is left."""
    tokens = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(tokens)}
    words = [list(w) for w in sorted(counts)]
    freqs = [counts[w] for w in sorted(counts)]
    pair_count: dict[tuple[int, int], int] = {}
    pair_words: dict[tuple[int, int], set[int]] = {}
    for w, (word, f) in enumerate(zip(words, freqs)):
        for p in zip(word, word[1:]):
            pair_count[p] = pair_count.get(p, 0) + f
            pair_words.setdefault(p, set()).add(w)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    target = 256 + n_merges
    while len(tokens) < target:
        if not heap:
            break  # the corpus has no pair left to merge; the caller fills the remaining ranks
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry; the current count has its own entry
        a, b = pair
        merged = tokens[a] + tokens[b]
        new = index.get(merged)
        if new is None:
            new = len(tokens)
            tokens.append(merged)
            index[merged] = new
        touched: set[tuple[int, int]] = set()
        for w in pair_words.pop(pair, ()):
            old = words[w]
            word = _merge_word(old, a, b, new)
            if len(word) == len(old):
                continue
            f = freqs[w]
            for p in zip(old, old[1:]):
                pair_count[p] -= f
                touched.add(p)
            for p in zip(word, word[1:]):
                pair_count[p] = pair_count.get(p, 0) + f
                pair_words.setdefault(p, set()).add(w)
                touched.add(p)
            words[w] = word
        for p in touched:
            c = pair_count[p]
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                del pair_count[p]
    return tokens


def _config(vocab_size: int) -> dict:
    ids = {name: remap_special_id(real, vocab_size) for name, real in SPECIAL_TOKENS.items()}
    added = {
        str(i): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": name not in _NOT_SPECIAL,
        }
        for name, i in sorted(ids.items(), key=lambda kv: kv[1])
    }
    return {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def write_small_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int) -> Path:
    """Write `tiktoken.model` and `tokenizer_config.json` for a `vocab_size`-id vocabulary into
    `out_dir` (created if needed) and return its path. The same arguments give the same bytes."""
    vocab_size = _require_int(vocab_size, "write_small_tokenizer: vocab_size")
    if vocab_size < MIN_SMALL_VOCAB_SIZE:
        raise TokenizerArgumentError(
            f"write_small_tokenizer: vocab_size={vocab_size} is too small; it needs at least "
            f"{MIN_SMALL_VOCAB_SIZE} (256 byte tokens, 128 merges, {NUM_SPECIAL_TOKENS} special ids)"
        )
    n_bpe = vocab_size - NUM_SPECIAL_TOKENS
    tokens = train_bpe(_corpus_counts(), n_bpe - 256)
    # Past the merges the corpus supports (large vocabularies such as the release's 163,584 ranks),
    # fill with 4-byte tokens starting with 0xFF: no UTF-8 text contains that byte, so BPE never
    # produces them and encoding is unchanged; they only make the vocabulary the size the config says.
    tokens += [b"\xff" + i.to_bytes(3, "big") for i in range(n_bpe - len(tokens))]
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    lines = b"".join(
        base64.b64encode(tok) + b" " + str(rank).encode("ascii") + b"\n"
        for rank, tok in enumerate(tokens)
    )
    (root / MODEL_FILE).write_bytes(lines)
    text = json.dumps(_config(vocab_size), indent=2, ensure_ascii=False) + "\n"
    (root / CONFIG_FILE).write_bytes(text.encode("utf-8"))
    return root
