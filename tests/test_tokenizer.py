"""Tokenizer: small generated vocabularies, the release's layout, long text, specials, errors."""

from __future__ import annotations

import base64
import json
import re

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from kimik3_jax.errors import TokenizerError
from kimik3_jax.tokenizer import (
    CONFIG_FILE,
    MAX_RUN_CHARS,
    MIN_SMALL_VOCAB_SIZE,
    MODEL_FILE,
    PAT_ALTERNATIVES,
    PAT_STR,
    REAL_NUM_BPE,
    REAL_VOCAB_SIZE,
    SPECIAL_TOKENS,
    K3Tokenizer,
    TokenizerArgumentError,
    remap_special_id,
    split_pieces,
    write_small_tokenizer,
)
from kimik3_jax.tokenizer.tokenizer import _chunks

VOCABS = (1024, 2048)
TEXTS = [
    "",
    "Hello world",
    "The quick brown fox: 3.14159, $19.99 & 100% sure!",
    "你好世界，今天天气很好。",
    "Café naïve résumé Zürich Ελληνικά Привет",
    "emoji 😀👍🏽🇫🇷 ❤️ done",
    "tabs\t\tand\n\n\nnewlines   \r\n  trailing   ",
    "def f(x):\n    return {'a': [1, 2, 3]}\n",
    " " * 300 + "x" + "\n" * 50,
    "a" * 30_000,
    " " * 25_001 + "y",
    "word " * 6000,
    "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>",
    "\x00\x01\x7f\u200b\ufeff unusual code points \U0010fffd",
]


@pytest.fixture(autouse=True)
def _no_tiktoken_cache(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # keep test runs from filling the shared cache


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    return {v: write_small_tokenizer(tmp_path_factory.mktemp(f"tok{v}"), v) for v in VOCABS}


@pytest.fixture(scope="module", params=VOCABS)
def tok(request, small_dirs):
    return K3Tokenizer.from_dir(small_dirs[request.param])


def test_pattern_is_the_eight_alternatives():
    assert len(PAT_ALTERNATIVES) == 8 and PAT_STR == "|".join(PAT_ALTERNATIVES)
    assert PAT_ALTERNATIVES[0] == r"[\p{Han}]+"
    assert PAT_ALTERNATIVES[3:] == (r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+",
                                    r"\s+(?!\S)", r"\s+")


def test_pre_tokenizer_splits():
    assert split_pieces("Hello world") == ["Hello", " world"]
    assert split_pieces("你好世界") == ["你好世界"]
    assert split_pieces("你好世界 ok") == ["你好世界", " ok"]
    assert split_pieces("It's 12345") == ["It's", " ", "123", "45"]


@pytest.mark.parametrize("text", TEXTS[1:9])
def test_tiktoken_splits_like_the_python_pattern(text):
    # With every piece in the vocabulary tiktoken returns one token per piece it found, so equal
    # token lists mean the Rust and the Python pattern split alike.
    pieces = [p.encode() for p in split_pieces(text)]
    ranks = {bytes([b]): b for b in range(256)}
    for p in pieces:
        ranks.setdefault(p, len(ranks))
    enc = tiktoken.Encoding("split_check", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    assert enc.encode_ordinary(text) == [ranks[p] for p in pieces]


def test_hello_world_is_two_tokens(tok):
    ids = tok.encode("Hello world")
    assert [tok.token_bytes(i) for i in ids] == [b"Hello", b" world"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_bpe_tokens for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")


def test_long_runs_are_cut_like_the_release(tok):
    ordinary = tok._enc.encode_ordinary
    assert tok.encode("a" * 30_000) == ordinary("a" * MAX_RUN_CHARS) + ordinary("a" * 5_000)
    text = "b" * 60_001
    assert tok.encode(text) == ordinary("b" * 25_000) * 2 + ordinary("b" * 10_001)
    # The cut lands inside a word here, so it changes the tokens: the cut really happens.
    words = "x" + "Hello" * 6_000
    assert tok.encode(words) == ordinary(words[:25_000]) + ordinary(words[25_000:]) != ordinary(words)
    # A run of exactly the limit is not cut, and runs of the other kind are counted afresh.
    mixed = " " + "c" * MAX_RUN_CHARS + " " * 10 + "d"
    assert tok.encode(mixed) == ordinary(mixed)
    # Windows of 400,000 characters are encoded separately.
    long = "hello world. " * 40_000
    assert tok.encode(long) == ordinary(long[:400_000]) + ordinary(long[400_000:]) != ordinary(long)
    assert tok.decode(tok.encode(long)) == long


def _chunks_by_hand(text, limit):
    # The rule spelled out character by character: count the current run of same-kind characters
    # (str.isspace) and cut just before the one that would make it longer than `limit`.
    out, start, run, kind = [], 0, 0, None
    for i, ch in enumerate(text):
        run = run + 1 if ch.isspace() == kind else 1
        kind = ch.isspace()
        if run > limit:
            out.append(text[start:i])
            start, run = i, 1
    return out + [text[start:]]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=" \t\n\u3000ab\u00a0\x1c", max_size=60), st.integers(1, 6))
def test_chunk_rule(text, limit):
    assert list(_chunks(text, limit)) == _chunks_by_hand(text, limit)


def test_literal_special_text(tok):
    text = "before <|open|> after"
    plain = tok.encode(text)
    assert tok.token_id("<|open|>") not in plain
    assert not any(tok.is_special(i) for i in plain)
    assert tok.decode(plain) == text
    allowed = tok.encode(text, allow_special=True)
    assert allowed.count(tok.token_id("<|open|>")) == 1
    assert tok.decode(allowed) == text


def test_golden_special_layout(tok):
    # CHAT.md golden (release ids): [9663, 163586, 163587, 2778, 6244, 878, 14062, 1, 163589, 1031, 2025]
    # i.e. "hi", <|end_of_msg|>, <|open|>, 'message role="system"', <|sep|>, "obey".
    v = tok.vocab_size
    ids = tok.encode('hi<|end_of_msg|><|open|>message role="system"<|sep|>obey', allow_special=True)
    expected = (tok.encode("hi") + [remap_special_id(163586, v), remap_special_id(163587, v)]
                + tok.encode('message role="system"') + [remap_special_id(163589, v)]
                + tok.encode("obey"))
    assert ids == expected
    assert [tok.decode([i]) for i in ids if tok.is_special(i)] == ["<|end_of_msg|>", "<|open|>", "<|sep|>"]
    pieces = [tok.token_bytes(i) for i in tok.encode('message role="system"')]
    assert b"".join(pieces) == b'message role="system"' and b"message" in pieces


def test_special_ids_are_remapped(tok):
    v = tok.vocab_size
    assert tok.num_bpe_tokens == v - 256
    for name, real in SPECIAL_TOKENS.items():
        assert tok.token_id(name) == remap_special_id(real, v) == v - 256 + (real - REAL_NUM_BPE)
        assert tok.decode([tok.token_id(name)]) == name
    assert tok.bos_id == v - 256 and tok.eos_id == v - 254 and tok.pad_id == v - 1
    assert tok.media_placeholder_id == v - 256 + 21 and tok.unk_id == v - 2
    reserved = v - 256 + 8  # release id 163592 has no name
    assert tok.special_name(reserved) == f"<|reserved_token_{reserved}|>"
    assert tok.token_id(f"<|reserved_token_{reserved}|>") == reserved
    assert len(tok.special_tokens) == 256 and tok.special_name(5) is None
    assert tok.encode(f"<|reserved_token_{reserved}|>", allow_special=True) == [reserved]


def test_file_formats(small_dirs):
    for v, d in small_dirs.items():
        lines = (d / MODEL_FILE).read_bytes().split(b"\n")
        assert lines[-1] == b"" and len(lines) - 1 == v - 256
        seen = set()
        for rank, line in enumerate(lines[:-1]):
            assert re.fullmatch(rb"[A-Za-z0-9+/]+={0,2} \d+", line), line
            tok_b64, r = line.split(b" ")
            token = base64.b64decode(tok_b64, validate=True)
            assert int(r) == rank and token not in seen
            seen.add(token)
            if rank < 256:
                assert token == bytes([rank])
        config = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
        assert config["tokenizer_class"] == "TikTokenTokenizer"
        assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == (
            "[BOS]", "[EOS]", "[PAD]", "[UNK]")
        added = config["added_tokens_decoder"]
        assert {int(k): e["content"] for k, e in added.items()} == {
            remap_special_id(r, v): n for n, r in SPECIAL_TOKENS.items()}
        for e in added.values():
            assert set(e) == {"content", "lstrip", "normalized", "rstrip", "single_word", "special"}


def test_deterministic(tmp_path):
    a = write_small_tokenizer(tmp_path / "a", 1024)
    b = write_small_tokenizer(tmp_path / "b", 1024)
    for name in (MODEL_FILE, CONFIG_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    # The smaller vocabulary's merges are the first ones of the larger.
    c = write_small_tokenizer(tmp_path / "c", 1280)
    assert (c / MODEL_FILE).read_bytes().startswith((a / MODEL_FILE).read_bytes())
    big = K3Tokenizer.from_dir(write_small_tokenizer(tmp_path / "d", 4096))
    assert big.vocab_size == 4096


def test_real_layout(tmp_path):
    # A vocabulary of the release's size: specials must sit at 163584..163839 under their names.
    ranks = [bytes([b]) for b in range(256)] + [b"tok%06d" % i for i in range(REAL_NUM_BPE - 256)]
    (tmp_path / MODEL_FILE).write_bytes(
        b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
    added = {str(r): {"content": n, "special": True} for n, r in SPECIAL_TOKENS.items()}
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": added}))
    tok = K3Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == REAL_VOCAB_SIZE == 163840
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.media_placeholder_id) == (163584, 163586, 163839, 163605)
    assert tok.token_id("<|reserved_token_163600|>") == 163600
    assert tok.encode("<|sep|>x", allow_special=True) == [163589, ord("x")]
    assert remap_special_id(163605, REAL_VOCAB_SIZE) == 163605


def test_stale_tiktoken_cache_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "tok"
    assert K3Tokenizer.from_dir(write_small_tokenizer(d, 768)).vocab_size == 768
    assert K3Tokenizer.from_dir(write_small_tokenizer(d, 1024)).vocab_size == 1024


def _broken_copy(src, dst, name, content):
    for f in (MODEL_FILE, CONFIG_FILE):
        (dst / f).write_bytes((src / f).read_bytes())
    if content is None:
        (dst / name).unlink()
    else:
        (dst / name).write_bytes(content)
    return dst


@pytest.mark.parametrize("name,content", [
    (MODEL_FILE, None),
    (CONFIG_FILE, None),
    (MODEL_FILE, b"not base64!! 0\n"),
    (MODEL_FILE, b"YQ== 0\nYg== 2\n"),
    (MODEL_FILE, b"YQ== 0\nYQ== 1\n"),
    (CONFIG_FILE, b"{not json"),
    (CONFIG_FILE, b"[]"),
    (CONFIG_FILE, b'{"bos_token": "[BOS]"}'),
    (CONFIG_FILE, b'{"added_tokens_decoder": {"5": {"content": "[BOS]"}}}'),
    (CONFIG_FILE, b'{"added_tokens_decoder": {"800": {"lstrip": false}}}'),
    (CONFIG_FILE, b'{"added_tokens_decoder": {"800": {"content": "x"}, "801": {"content": "x"}}}'),
])
def test_bad_files_name_the_file(small_dirs, tmp_path, name, content):
    d = _broken_copy(small_dirs[1024], tmp_path, name, content)
    with pytest.raises(TokenizerError, match=re.escape(name)):
        K3Tokenizer.from_dir(d)


def test_bad_arguments(tok, tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        K3Tokenizer.from_dir(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match="vocab_size"):
        write_small_tokenizer(tmp_path, MIN_SMALL_VOCAB_SIZE - 1)
    with pytest.raises(ValueError, match="vocab_size"):
        write_small_tokenizer(tmp_path, 1024.0)
    with pytest.raises(TokenizerArgumentError, match="real_id"):
        remap_special_id(5, 1024)
    with pytest.raises(TokenizerArgumentError, match="vocab_size"):
        remap_special_id(163584, 300)
    with pytest.raises(TokenizerError, match="no special token named"):
        tok.token_id("<|nope|>")
    with pytest.raises(TokenizerArgumentError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerArgumentError, match="must be an integer"):
        tok.decode([1.0])
    assert tok.decode([tok.eos_id]) == "<|end_of_msg|>"
    with pytest.raises(TokenizerArgumentError, match="text must be a str"):
        tok.encode(b"bytes")


def test_generated_release_size_vocabulary(tmp_path):
    # make-checkpoint of `slice`/`k3` writes a tokenizer with the release's 163,584 BPE ranks: the
    # corpus merges, then filler tokens that UTF-8 text can never produce (they start with 0xFF).
    small = K3Tokenizer.from_dir(write_small_tokenizer(tmp_path / "small", 4096))
    tok = K3Tokenizer.from_dir(write_small_tokenizer(tmp_path / "real", REAL_VOCAB_SIZE))
    assert (tok.vocab_size, tok.num_bpe_tokens) == (REAL_VOCAB_SIZE, REAL_NUM_BPE)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.media_placeholder_id) == (163584, 163586, 163839, 163605)
    text = "Hello world, 你好世界 <|open|> ünïcödé 12345 \n\n  x"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < REAL_NUM_BPE
    filler = tok.token_bytes(REAL_NUM_BPE - 1)
    assert filler[0] == 0xFF and len(filler) == 4
    # The merges the corpus supports are the same as a smaller vocabulary's (a prefix of the ranks).
    assert [tok.token_bytes(i) for i in range(small.num_bpe_tokens)] == [
        small.token_bytes(i) for i in range(small.num_bpe_tokens)]
