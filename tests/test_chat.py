"""XTML chat rendering (the release encoder's 30 goldens), encode_chat, and the reply parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimik3_jax.tokenizer import K3Tokenizer
from kimik3_jax.tokenizer.chat import ChatError, ReplyParser, encode_chat, render_segments, split_reply

# The release encoder's 30 renderings, as shipped beside the model specification (shared/k3/xtml_golden.json).
GOLDEN = json.loads((Path(__file__).parent / "data" / "xtml_golden.json").read_text())["cases"]


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_golden_rendering(case):
    got = render_segments(**GOLDEN[case]["input"])
    assert [list(seg) for seg in got] == GOLDEN[case]["segments"]


def test_goldens_are_all_here():
    assert len(GOLDEN) == 30


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return K3Tokenizer.from_dir(tiny_ckpt)


def ids_of(tok, *names):
    return [tok.token_id(n) for n in names]


# ----- encode_chat -----------------------------------------------------------------------------------

def test_encode_chat_tokenizes_each_segment_on_its_own(tok):
    case = GOLDEN["kitchen_sink"]["input"]
    expected = []
    for text, control in render_segments(**case):
        expected += tok.encode(text, allow_special=control)
    assert encode_chat(tok, **case) == expected
    assert tok.decode(expected) == "".join(text for text, _ in render_segments(**case))


def test_encode_chat_controls_are_single_ids_and_content_never_is(tok):
    messages = GOLDEN["content_carries_markup"]["input"]["messages"]
    ids = encode_chat(tok, messages)
    open_, sep, close, eom = ids_of(tok, "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>")
    content = tok.encode(messages[0]["content"])
    assert not any(tok.is_special(i) for i in content)  # the spelled <|open|> stays ordinary text
    head = [open_] + tok.encode("message") + tok.encode(" role") + tok.encode('="') + tok.encode("user") \
        + tok.encode('"') + [sep]
    assert ids[:len(head) + len(content)] == head + content
    assert ids[len(head) + len(content):][:3 + len(tok.encode("message"))] == \
        [close] + tok.encode("message") + [sep, eom]
    assert ids[-(2 + len(tok.encode("think"))):] == [open_] + tok.encode("think") + [sep]
    assert tok.bos_id not in ids  # the chat encoder emits no BOS


def test_encode_chat_image_prompt_is_one_control_segment(tok):
    case = GOLDEN["image_part"]["input"]
    ids = encode_chat(tok, **case)
    begin, content, pad, end = ids_of(tok, "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
    i = ids.index(begin)
    assert ids[i:i + len(tok.encode("image 640x480")) + 4] == \
        [begin] + tok.encode("image 640x480") + [content, pad, end]


def test_attribute_values_are_escaped():
    segs = render_segments([{"role": "user", "content": "x", "name": 'a "b" & c'}], add_generation_prompt=False)
    assert ("a &quot;b&quot; &amp; c", False) in segs


@pytest.mark.parametrize("kw,match", [
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]), r"messages\[1\]\.role"),
    (dict(messages=[{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]), r"messages\[0\]\.tool_calls\[0\]\.arguments"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
     r"messages\[0\]\.tool_calls\[0\] must hold a function"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
     r"messages\[0\]\.content\[0\] is an image"),
    (dict(messages=[{"role": "user", "content": [{"type": "audio"}]}]), r"messages\[0\]\.content\[0\]"),
    (dict(messages=[{"role": "tool", "content": "18C"}]), r"messages\[0\] is a tool result"),
    (dict(messages=[{"role": "user", "content": "a"}], tool_choice="sometimes"), "tool_choice"),
    (dict(messages=[{"role": "user", "content": "a"}], response_format={"type": "yaml"}), "response_format"),
    (dict(messages=[{"role": "user", "content": "a"}], response_format={"type": "json_schema"}),
     r"response_format\.json_schema\.schema"),
    (dict(messages="hello"), "messages must be a list"),
])
def test_unrenderable_input_is_named(kw, match):
    with pytest.raises(ChatError, match=match):
        render_segments(**kw)


# ----- split_reply -----------------------------------------------------------------------------------

def reply_ids(tok, assistant: dict, thinking: bool = True) -> list[int]:
    """What the model generates for `assistant`: its rendering after the generation prompt, with EOS."""
    user = [{"role": "user", "content": "q"}]
    prompt = encode_chat(tok, user, thinking=thinking)
    full = encode_chat(tok, user + [assistant], thinking=thinking, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    return full[len(prompt):]


def test_split_reply_recovers_reasoning_answer_and_typed_tool_calls(tok):
    args = {"s": "text", "n": 42, "f": 1.5, "b": True, "nul": None, "obj": {"k": "v"}, "arr": [1, "two", None]}
    assistant = {"role": "assistant", "reasoning_content": "Need the tool.", "content": "Checking.",
                 "tool_calls": [{"id": "a", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                {"id": "b", "function": {"name": 'odd "name"', "arguments": args}}]}
    ids = reply_ids(tok, assistant)
    assert ids[-1] == tok.eos_id
    reasoning, answer, calls = split_reply(tok, ids)
    assert (reasoning, answer) == ("Need the tool.", "Checking.")
    assert calls == [{"name": "get_weather", "index": 1, "arguments": {"city": "Paris"}},
                     {"name": 'odd "name"', "index": 2, "arguments": args}]


def test_split_reply_without_thinking(tok):
    ids = reply_ids(tok, {"role": "assistant", "content": "Just the answer."}, thinking=False)
    assert split_reply(tok, ids, thinking=False) == ("", "Just the answer.", [])


def test_full_model_golden_shape(tok):
    ids = tok.encode("15% of 240 = 0.15 × 240 = 36.") + encode_chat_tail(tok) + tok.encode("15% of 240 is 36.")
    reasoning, answer, calls = split_reply(tok, ids)  # cut off before <|close|>response: still split
    assert (reasoning, answer, calls) == ("15% of 240 = 0.15 × 240 = 36.", "15% of 240 is 36.", [])


def encode_chat_tail(tok):
    return [tok.token_id("<|close|>")] + tok.encode("think") + [tok.token_id("<|sep|>"), tok.token_id("<|open|>")] \
        + tok.encode("response") + [tok.token_id("<|sep|>")]


def test_stream_holds_back_a_marker_until_it_is_decided(tok):
    parser = ReplyParser(tok)
    assert parser.feed(tok.encode("abc")) == [("reasoning", "abc")]
    close, sep = ids_of(tok, "<|close|>", "<|sep|>")
    assert parser.feed([close]) == []
    assert parser.feed(tok.encode("think")) == []  # could still be <|close|>think<|sep|>
    assert parser.feed([sep]) == [] and parser.channel == "answer"
    assert parser.feed([close]) == []
    assert parser.feed(tok.encode("banana")) == [("answer", "<|close|>banana")]  # not a marker after all
    assert parser.feed([close] + tok.encode("mess")) == []
    assert parser.finish() == [("answer", "<|close|>mess")]  # cut off mid-marker: it stays text
    assert parser.answer == "<|close|>banana<|close|>mess"


def test_stream_deltas_add_up_and_never_split_a_character(tok):
    assistant = {"role": "assistant", "reasoning_content": "思考 — ok", "content": "你好世界 ✓"}
    ids = reply_ids(tok, assistant)
    parser, got = ReplyParser(tok), {"reasoning": "", "answer": ""}
    for i in ids:
        for channel, text in parser.feed([i]):
            assert "\ufffd" not in text
            got[channel] += text
    for channel, text in parser.finish():
        got[channel] += text
    assert got == {"reasoning": "思考 — ok", "answer": "你好世界 ✓"}
    assert parser.done


def test_everything_after_the_end_of_message_is_ignored(tok):
    ids = tok.encode("r") + encode_chat_tail(tok) + tok.encode("a") + [tok.eos_id] + tok.encode("junk")
    assert split_reply(tok, ids) == ("r", "a", [])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reasoning=st.text(max_size=40), answer=st.text(max_size=40))
def test_any_text_round_trips(tok, reasoning, answer):
    assistant = {"role": "assistant", "reasoning_content": reasoning, "content": answer}
    assert split_reply(tok, reply_ids(tok, assistant)) == (reasoning, answer, [])
