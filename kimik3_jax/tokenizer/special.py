"""Facts of the Kimi K3 tokenizer that do not depend on a vocabulary file.

The release's vocabulary has 163,584 BPE ranks followed by 256 special ids (163,584..163,839).
A small test vocabulary keeps the same layout: its 256 special ids are the last 256 ids, at the
same offsets, under the same names; `remap_special_id` moves a release id there.
"""

from __future__ import annotations

import operator

import regex

from kimik3_jax.errors import TokenizerArgumentError


NUM_SPECIAL_TOKENS = 256
REAL_NUM_BPE = 163_584
FIRST_SPECIAL_ID = REAL_NUM_BPE
REAL_VOCAB_SIZE = REAL_NUM_BPE + NUM_SPECIAL_TOKENS  # 163,840

# Named special tokens of the release, name -> release id (CHAT.md). Every other id in
# 163584..163839 is `<|reserved_token_{id}|>` unless tokenizer_config.json names it.
SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "[start_header_id]": 163590,
    "[end_header_id]": 163591,
    "[EOT]": 163593,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<osagent_mode>": 163649,
    "[UNK]": 163838,
    "[PAD]": 163839,
}

BOS_TOKEN = "[BOS]"
# Generation stops on <|end_of_msg|>, not on [EOS]; the chat encoder emits no BOS.
EOS_TOKEN = "<|end_of_msg|>"
PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
MEDIA_PLACEHOLDER_TOKEN = "<|media_pad|>"

# The K2 family's pre-tokenizer: eight alternatives, tried in this order. `&&` is character-class
# intersection (accepted by tiktoken's Rust engine, and by the `regex` module in V1 mode).
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_LEAD = r"[^\r\n\p{L}\p{N}]?"
PAT_ALTERNATIVES: tuple[str, ...] = (
    r"[\p{Han}]+",
    _LEAD + _NOT_HAN_UPPER + "*" + _NOT_HAN_LOWER + "+" + _CONTRACTION,
    _LEAD + _NOT_HAN_UPPER + "+" + _NOT_HAN_LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
)
PAT_STR = "|".join(PAT_ALTERNATIVES)

# Long text: windows of at most this many characters, each cut into chunks so that no chunk holds
# more than MAX_RUN_CHARS consecutive whitespace (or consecutive non-whitespace) characters.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

_PIECES = regex.compile(PAT_STR, regex.V1)


def split_pieces(text: str) -> list[str]:
    """Pre-tokenize `text` with the K2-family pattern (Python side; tiktoken does the same in Rust)."""
    return _PIECES.findall(text)


def reserved_token_name(token_id: int) -> str:
    """The name of an unnamed special id."""
    return f"<|reserved_token_{token_id}|>"


def _require_int(value: object, what: str) -> int:
    """`value` as a Python int; accepts numpy integers, refuses bools, floats and strings."""
    if isinstance(value, bool):
        raise TokenizerArgumentError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TokenizerArgumentError(f"{what} must be an integer, got {value!r}") from None


def remap_special_id(real_id: int, vocab_size: int) -> int:
    """Where the release's special id `real_id` sits in a vocabulary of `vocab_size` ids.

    The special block is always the last 256 ids, so release id r maps to
    vocab_size - 256 + (r - 163584); for vocab_size 163840 this is r itself.
    """
    real_id = _require_int(real_id, "remap_special_id: real_id")
    vocab_size = _require_int(vocab_size, "remap_special_id: vocab_size")
    if not FIRST_SPECIAL_ID <= real_id < REAL_VOCAB_SIZE:
        raise TokenizerArgumentError(
            f"remap_special_id: real_id={real_id} is not a special id of the release "
            f"({FIRST_SPECIAL_ID}..{REAL_VOCAB_SIZE - 1})"
        )
    if vocab_size < 256 + NUM_SPECIAL_TOKENS:
        raise TokenizerArgumentError(
            f"remap_special_id: vocab_size={vocab_size} is too small: it must hold the 256 byte "
            f"tokens and the {NUM_SPECIAL_TOKENS} special ids ({256 + NUM_SPECIAL_TOKENS} or more)"
        )
    return vocab_size - NUM_SPECIAL_TOKENS + (real_id - FIRST_SPECIAL_ID)
