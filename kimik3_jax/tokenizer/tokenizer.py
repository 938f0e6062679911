"""K3Tokenizer: the release's tiktoken BPE plus its 256 special ids, loaded from a checkpoint dir."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from kimik3_jax.errors import TokenizerArgumentError, TokenizerError
from kimik3_jax.tokenizer.special import (
    BOS_TOKEN,
    EOS_TOKEN,
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    MEDIA_PLACEHOLDER_TOKEN,
    NUM_SPECIAL_TOKENS,
    PAD_TOKEN,
    PAT_STR,
    UNK_TOKEN,
    _require_int,
    reserved_token_name,
)

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# Python's `re` \s on str uses the same test as str.isspace(), which is what the run limit counts.
_RUNS = re.compile(r"\s+|\S+")


def _chunks(text: str, limit: int) -> Iterator[str]:
    """Cut `text` so that no chunk holds more than `limit` consecutive whitespace characters or
    consecutive non-whitespace characters. Only over-long runs are cut (at every `limit`-th
    character of the run); everything else stays together, mixed runs included."""
    start = 0
    for run in _RUNS.finditer(text):
        cut = run.start() + limit
        while cut < run.end():
            yield text[start:cut]
            start = cut
            cut += limit
    yield text[start:]


def _load_ranks(path: Path) -> dict[bytes, int]:
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer vocabulary file is missing")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read the tokenizer vocabulary: {e}") from e
    # tiktoken caches every file it reads under a key made from the path alone; passing the hash of
    # what is on disk now keeps a stale cached copy of an older file at the same path from being used.
    try:
        ranks = load_tiktoken_bpe(str(path), expected_hash=hashlib.sha256(data).hexdigest())
    except (ValueError, OSError) as e:
        raise TokenizerError(f"{path}: malformed tiktoken vocabulary ({e})") from e
    if not ranks:
        raise TokenizerError(f"{path}: the tiktoken vocabulary is empty")
    n_lines = sum(1 for line in data.splitlines() if line)
    if n_lines != len(ranks):
        raise TokenizerError(
            f"{path}: {n_lines} lines but {len(ranks)} distinct tokens: some token appears twice"
        )
    if sorted(ranks.values()) != list(range(len(ranks))):
        seen = set(ranks.values())
        bad = next((r for r in range(len(ranks)) if r not in seen), None)
        raise TokenizerError(
            f"{path}: ranks must be 0..{len(ranks) - 1}, each once"
            + (f"; rank {bad} is missing" if bad is not None else "")
        )
    return ranks


def _load_special_names(path: Path, n_bpe: int) -> dict[int, str]:
    """id -> name for the special block n_bpe .. n_bpe+255, from `added_tokens_decoder`."""
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer config file is missing")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: the top level must be a JSON object")
    added = config.get("added_tokens_decoder")
    if not isinstance(added, dict):
        raise TokenizerError(f"{path}: 'added_tokens_decoder' is missing or not an object")
    names: dict[int, str] = {}
    for key, entry in added.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise TokenizerError(f"{path}: added_tokens_decoder key {key!r} is not a token id")
        token_id = int(key)
        if not n_bpe <= token_id < n_bpe + NUM_SPECIAL_TOKENS:
            raise TokenizerError(
                f"{path}: added_tokens_decoder id {token_id} is outside the special block "
                f"{n_bpe}..{n_bpe + NUM_SPECIAL_TOKENS - 1} that follows the {n_bpe} BPE ranks"
            )
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"{path}: added_tokens_decoder[{key!r}] has no 'content' string")
        names[token_id] = content
    block = {i: names.get(i, reserved_token_name(i)) for i in range(n_bpe, n_bpe + NUM_SPECIAL_TOKENS)}
    if len(set(block.values())) != NUM_SPECIAL_TOKENS:
        seen: dict[str, int] = {}
        for i, name in block.items():
            if name in seen:
                raise TokenizerError(f"{path}: special token {name!r} names both {seen[name]} and {i}")
            seen[name] = i
    return block


class K3Tokenizer:
    """Kimi K3 tokenizer: byte-level BPE (tiktoken) with the K2-family pre-tokenizer and a block of
    256 special ids right after the last BPE rank."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_names: dict[int, str],
                 *, source: str = "<in memory>") -> None:
        self._source = source
        self._n_bpe = len(mergeable_ranks)
        expected = list(range(self._n_bpe, self._n_bpe + NUM_SPECIAL_TOKENS))
        if sorted(special_names) != expected:
            raise TokenizerArgumentError(
                f"K3Tokenizer: special_names must cover exactly ids {expected[0]}..{expected[-1]}"
            )
        self._special_ids = {name: i for i, name in special_names.items()}
        if len(self._special_ids) != NUM_SPECIAL_TOKENS:
            raise TokenizerArgumentError("K3Tokenizer: special_names holds a name twice")
        self._special_names = dict(sorted(special_names.items()))
        self._enc = tiktoken.Encoding(
            name=f"kimi_k3_{self._n_bpe + NUM_SPECIAL_TOKENS}",
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self._special_ids,
            explicit_n_vocab=self._n_bpe + NUM_SPECIAL_TOKENS,
        )
        self._special_set = frozenset(self._special_ids)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> K3Tokenizer:
        """Load `tiktoken.model` and `tokenizer_config.json` from a checkpoint directory."""
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(f"{root}: tokenizer directory does not exist")
        ranks = _load_ranks(root / MODEL_FILE)
        names = _load_special_names(root / CONFIG_FILE, len(ranks))
        return cls(ranks, names, source=str(root))

    # ----- sizes and ids -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """BPE ranks plus the 256 special ids."""
        return self._n_bpe + NUM_SPECIAL_TOKENS

    @property
    def num_bpe_tokens(self) -> int:
        return self._n_bpe

    @property
    def special_tokens(self) -> dict[str, int]:
        """All 256 special tokens, name -> id (reserved ones included)."""
        return dict(self._special_ids)

    def token_id(self, name: str) -> int:
        """The id of a special token, e.g. token_id("<|end_of_msg|>")."""
        try:
            return self._special_ids[name]
        except KeyError:
            raise TokenizerError(
                f"{self._source}: no special token named {name!r} (see {CONFIG_FILE})"
            ) from None

    def special_name(self, token_id: int) -> str | None:
        """The name of a special id, or None for a BPE id."""
        return self._special_names.get(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_names

    @property
    def bos_id(self) -> int:
        return self.token_id(BOS_TOKEN)

    @property
    def eos_id(self) -> int:
        """<|end_of_msg|>: where generation stops (the [EOS] token is not used for that)."""
        return self.token_id(EOS_TOKEN)

    @property
    def pad_id(self) -> int:
        return self.token_id(PAD_TOKEN)

    @property
    def unk_id(self) -> int:
        return self.token_id(UNK_TOKEN)

    @property
    def media_placeholder_id(self) -> int:
        """<|media_pad|>: the position an image's features fill."""
        return self.token_id(MEDIA_PLACEHOLDER_TOKEN)

    # ----- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. With allow_special, spelled special tokens (`<|open|>`) become their
        ids; without, they are ordinary text. Long text is cut as the release's tokenizer cuts it."""
        if not isinstance(text, str):
            raise TokenizerArgumentError(f"encode: text must be a str, got {type(text).__name__}")
        ids: list[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for chunk in _chunks(text[start:start + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                if allow_special:
                    ids.extend(self._enc.encode(chunk, allowed_special=self._special_set,
                                                disallowed_special=()))
                else:
                    ids.extend(self._enc.encode_ordinary(chunk))
        return ids

    def _checked(self, ids: Iterable[int]) -> list[int]:
        out = []
        for i in ids:
            v = _require_int(i, "decode: each id")
            if not 0 <= v < self.vocab_size:
                raise TokenizerArgumentError(
                    f"decode: id {v} is outside the vocabulary 0..{self.vocab_size - 1} "
                    f"of {self._source}"
                )
            out.append(v)
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of `ids` (special ids give their names); may end inside a UTF-8 character."""
        return self._enc.decode_bytes(self._checked(ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special ids give their names; invalid UTF-8 becomes U+FFFD."""
        return self._enc.decode(self._checked(ids), errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token."""
        (v,) = self._checked([token_id])
        return self._enc.decode_single_token_bytes(v)

    def __repr__(self) -> str:
        return f"K3Tokenizer(vocab_size={self.vocab_size}, source={self._source!r})"
