"""Kimi K3 tokenizer: tiktoken BPE with the K2-family pre-tokenizer and 256 special ids.

`K3Tokenizer.from_dir(path)` loads a checkpoint's `tiktoken.model` and `tokenizer_config.json`;
`write_small_tokenizer(out_dir, vocab_size)` writes a small vocabulary in the same formats.
"""

from kimik3_jax.errors import TokenizerArgumentError
from kimik3_jax.tokenizer.small import MIN_SMALL_VOCAB_SIZE, train_bpe, write_small_tokenizer
from kimik3_jax.tokenizer.special import (
    BOS_TOKEN,
    EOS_TOKEN,
    FIRST_SPECIAL_ID,
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    MEDIA_PLACEHOLDER_TOKEN,
    NUM_SPECIAL_TOKENS,
    PAD_TOKEN,
    PAT_ALTERNATIVES,
    PAT_STR,
    REAL_NUM_BPE,
    REAL_VOCAB_SIZE,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    remap_special_id,
    reserved_token_name,
    split_pieces,
)
from kimik3_jax.tokenizer.tokenizer import CONFIG_FILE, MODEL_FILE, K3Tokenizer

__all__ = [
    "BOS_TOKEN",
    "CONFIG_FILE",
    "EOS_TOKEN",
    "FIRST_SPECIAL_ID",
    "K3Tokenizer",
    "MAX_ENCODE_CHARS",
    "MAX_RUN_CHARS",
    "MEDIA_PLACEHOLDER_TOKEN",
    "MIN_SMALL_VOCAB_SIZE",
    "MODEL_FILE",
    "NUM_SPECIAL_TOKENS",
    "PAD_TOKEN",
    "PAT_ALTERNATIVES",
    "PAT_STR",
    "REAL_NUM_BPE",
    "REAL_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "TokenizerArgumentError",
    "UNK_TOKEN",
    "remap_special_id",
    "reserved_token_name",
    "split_pieces",
    "train_bpe",
    "write_small_tokenizer",
]
