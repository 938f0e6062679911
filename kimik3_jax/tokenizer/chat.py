"""Kimi K3 chat format (XTML, ../shared/k3/CHAT.md): render a conversation, parse a reply.

    segments = render_segments(messages, tools=None, thinking=True, ...)   # [(text, is_control)]
    ids = encode_chat(tokenizer, messages, **same_keywords)
    reasoning, answer, tool_calls = split_reply(tokenizer, generated_ids)

A rendering is a list of segments, each tokenized on its own: control segments with special tokens
allowed, everything else (tag names, attribute pieces, content) with none, so user text that spells
`<|open|>` stays ordinary text. `ReplyParser` is the streaming form of `split_reply`: it works on
token ids and holds back a control token and what follows it until it is known to be a marker or not.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kimik3_jax.errors import TokenizerArgumentError

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
ROLES = ("system", "user", "assistant", "tool")

TOOLS_TEXT = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
               "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={}`.")
TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
FORMAT_TEXT = ("The system is invoked with `response_format={}`.\nYour response must be raw JSON data without "
               "markdown code blocks (```json) or any additional formatting.")
SCHEMA_TEXT = "\nThe JSON data must match the following schema:\n```json\n{}\n```"

Segment = tuple[str, bool]


class ChatError(TokenizerArgumentError):
    """A conversation or chat option that cannot be rendered (the message names which one)."""


def _compact(obj: Any) -> str:
    """Keys sorted recursively, no spaces, non-ASCII kept: the form tools and schemas are shown in."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


class _Segments:
    def __init__(self, image_prompts: Sequence[str] | None):
        self.out: list[Segment] = []
        self._images: Iterator[str] = iter(image_prompts or ())

    def control(self, text: str) -> None:
        self.out.append((text, True))

    def text(self, text: str) -> None:
        if text:
            self.out.append((text, False))

    def open(self, tag: str, attrs: Iterable[tuple[str, str]] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            for piece in (f" {key}", '="', _escape(value), '"'):
                self.text(piece)
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def content(self, content: Any, where: str) -> None:
        """A message body: a string (image placeholders resolved in order) or a list of parts."""
        if content is None or isinstance(content, str):
            self._text_with_images(content or "")
            return
        if not isinstance(content, list):
            raise ChatError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                self._text_with_images(part["text"])
            elif kind in ("image_url", "image"):
                prompt = next(self._images, None)
                if prompt is None:
                    raise ChatError(f"{where}.content[{j}] is an image but image_prompts has none left for it")
                self.control(prompt)
            else:
                raise ChatError(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}} or an image part, "
                                f"got {part!r}")

    def _text_with_images(self, text: str) -> None:
        pending, *pieces = text.split(IMAGE_PLACEHOLDER)
        for piece in pieces:
            prompt = next(self._images, None)
            if prompt is None:  # unresolved placeholders stay plain text
                pending += IMAGE_PLACEHOLDER + piece
            else:
                self.text(pending)
                self.control(prompt)
                pending = piece
        self.text(pending)

    def message(self, attrs: list[tuple[str, str]], body: str) -> None:
        """A whole system-style message with a plain-text body."""
        self.open("message", attrs)
        self.text(body)
        self.end_message()

    def end_message(self) -> None:
        self.close("message")
        self.control(END_OF_MSG)


def _argument_type(value: Any, where: str) -> str:
    for kind, name in ((bool, "boolean"), (str, "string"), ((int, float), "number"), (dict, "object"),
                       ((list, tuple), "array"), (type(None), "null")):
        if isinstance(value, kind):
            return name
    raise ChatError(f"{where}: {type(value).__name__} is not a JSON value")


def _calls(message: dict, where: str) -> list[tuple[str | None, str, dict]]:
    """(id, name, arguments) of an assistant message's tool calls, in order."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ChatError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatError(f"{at} must hold a function with a 'name' string")
        args = fn.get("arguments") or {}  # None and "" are no arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ChatError(f"{at}.arguments is not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise ChatError(f"{at}.arguments must be a JSON object, got {type(args).__name__}")
        out.append((call.get("id"), fn["name"], args))
    return out


def _call_order(messages: list[dict]) -> list[int]:
    """Message indices in rendering order: each run of tool results follows its assistant message's
    call order when every result names a distinct call of that message."""
    order, ids, i = list(range(len(messages))), [], 0
    while i < len(messages):
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        keys = [messages[k].get("tool_call_id") for k in range(i, j)]
        if keys and all(k in ids for k in keys) and len(set(keys)) == len(keys):
            order[i:j] = sorted(range(i, j), key=lambda k: ids.index(messages[k]["tool_call_id"]))
        if j == i and messages[i]["role"] == "assistant":
            ids = [c.get("id") for c in messages[i].get("tool_calls") or [] if isinstance(c, dict)]
        i = max(j, i + 1)
    return order


def render_segments(messages: list[dict], tools: list | None = None, thinking: bool = True,
                    thinking_effort: str | None = None, tool_choice: str | None = None,
                    response_format: dict | None = None, add_generation_prompt: bool = True,
                    image_prompts: Sequence[str] | None = None) -> list[Segment]:
    """The XTML rendering of a conversation as [(text, is_control)] (CHAT.md "Order of a conversation").

    `image_prompts` are the control strings of the conversation's images, in order
    (`<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`); they replace image parts and
    `<|kimi_image_placeholder|>` in text. Raises ChatError naming the message or option at fault."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatError("messages must be a list of objects ({'role': ..., 'content': ...})")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}].role is {m.get('role')!r}; expected one of {', '.join(ROLES)}")
    s = _Segments(image_prompts)
    if tools:
        if not isinstance(tools, list):
            raise ChatError("tools must be a list of OpenAI tool objects")
        s.message([("role", "system"), ("type", "tool-declare")], TOOLS_TEXT.format(_compact(tools)))
    if thinking and thinking_effort is not None:
        if not isinstance(thinking_effort, str) or not thinking_effort:
            raise ChatError(f"thinking_effort must be a non-empty string such as 'max', got {thinking_effort!r}")
        s.message([("role", "system"), ("type", "thinking-effort")], EFFORT_TEXT.format(thinking_effort))

    calls: list[tuple[str | None, str, dict]] = []
    results = 0  # tool results since the last assistant message
    for i in _call_order(messages):
        m, where = messages[i], f"messages[{i}]"
        role, name = m["role"], m.get("name")
        if name is not None and not isinstance(name, str):
            raise ChatError(f"{where}.name must be a string")
        if role == "tool":
            results += 1
            s.open("message", [("role", "tool"), ("tool", _tool_name(m, calls, results, where)),
                               ("index", str(results))])
        else:
            s.open("message", [("role", role)] + ([("name", name)] if name is not None else []))
        if role == "assistant":
            calls, results = _calls(m, where), 0
            _render_assistant(s, m, calls, thinking, where)
        else:
            s.content(m.get("content"), where)
        s.end_message()

    if tool_choice not in (None, "auto"):
        if tool_choice not in TOOL_CHOICE_TEXT:
            raise ChatError(f"tool_choice must be 'auto', 'required' or 'none', got {tool_choice!r}")
        s.message([("role", "system"), ("type", "tool-choice")], TOOL_CHOICE_TEXT[tool_choice])
    if response_format is not None:
        text = _format_text(response_format)
        if text:
            s.message([("role", "system"), ("type", "response-format")], text)
    if add_generation_prompt:
        s.open("message", [("role", "assistant")])
        s.open("think" if thinking else "response")
    return s.out


def _tool_name(m: dict, calls: list, index: int, where: str) -> str:
    if isinstance(m.get("tool"), str):
        return m["tool"]
    by_id = {cid: name for cid, name, _ in calls if cid is not None}
    if m.get("tool_call_id") in by_id:
        return by_id[m["tool_call_id"]]
    if index <= len(calls):  # no (matching) id: the call at the same position
        return calls[index - 1][1]
    if isinstance(m.get("name"), str):
        return m["name"]
    raise ChatError(f"{where} is a tool result with no 'tool' name and no call it answers")


def _render_assistant(s: _Segments, m: dict, calls: list, thinking: bool, where: str) -> None:
    """The channels of an assistant message: think (with thinking), response, then its tool calls."""
    if thinking:
        s.open("think")
        s.content(m.get("reasoning_content"), where)
        s.close("think")
    s.open("response")
    s.content(m.get("content"), where)
    s.close("response")
    if not calls:
        return
    s.open("tools")
    for j, (_, name, args) in enumerate(calls, start=1):
        s.open("call", [("tool", name), ("index", str(j))])
        for key, value in args.items():
            kind = _argument_type(value, f"{where}.tool_calls[{j - 1}].arguments[{key!r}]")
            s.open("argument", [("key", str(key)), ("type", kind)])
            s.text(value if kind == "string" else json.dumps(value, ensure_ascii=False))
            s.close("argument")
        s.close("call")
    s.close("tools")


def _format_text(fmt: Any) -> str | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return FORMAT_TEXT.format(kind)
    if kind == "json_schema":
        schema = fmt.get("json_schema", {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise ChatError("response_format.json_schema.schema must be a JSON schema object")
        return FORMAT_TEXT.format(kind) + SCHEMA_TEXT.format(_compact(schema))
    raise ChatError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {fmt!r}")


def encode_chat(tokenizer, messages: list[dict], **kw) -> list[int]:
    """Token ids of `render_segments(messages, **kw)`: control segments with specials allowed, the rest
    with none."""
    return [i for text, control in render_segments(messages, **kw)
            for i in tokenizer.encode(text, allow_special=control)]


# ----- the reply --------------------------------------------------------------------------------------

_CLOSE_TAGS = ("think", "response", "tools", "message", "call", "argument")
_OPEN_TAGS = ("think", "response", "tools")
_ATTR = re.compile(r'\s([A-Za-z_][\w-]*)="([^"]*)"')


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


class ReplyParser:
    """Splits generated ids into reasoning, answer and tool calls, as they stream in.

    With `thinking` the ids start inside the think channel (the generation prompt opened it);
    without, inside the response channel. `feed(ids)` returns the new text as [(channel, text)] with
    channel "reasoning" or "answer"; a control token and what follows it is held back until it is a
    known marker (consumed) or cannot be one (released as text); `finish()` releases what is left.
    Tool calls collect in `tool_calls`; ids after `<|close|>message<|sep|>` or `<|end_of_msg|>` are ignored.
    """

    def __init__(self, tokenizer, thinking: bool = True):
        self._tok = tokenizer
        self._open, self._close, self._sep, self._eom = (tokenizer.token_id(n) for n in (OPEN, CLOSE, SEP, END_OF_MSG))
        self.channel = "reasoning" if thinking else "answer"
        self.done = False
        self.tool_calls: list[dict] = []
        self._held: list[int] = []  # a control token and the ids after it, while they may be a marker
        self._bytes = {"reasoning": bytearray(), "answer": bytearray()}
        self._utf8 = {ch: codecs.getincrementaldecoder("utf-8")("replace") for ch in self._bytes}
        self._arg: tuple[str, str, bytearray] | None = None  # key, type and value of the argument being read
        self._out: list[tuple[str, str]] = []

    reasoning = property(lambda self: self._bytes["reasoning"].decode("utf-8", "replace"))
    answer = property(lambda self: self._bytes["answer"].decode("utf-8", "replace"))

    def feed(self, ids: Iterable[int]) -> list[tuple[str, str]]:
        for i in ids:
            if self.done:
                break
            self._step(int(i))
        return self._take()

    def finish(self) -> list[tuple[str, str]]:
        """Release what is held back: a marker cut off by the end of generation stays text."""
        self._release()
        self._end_argument()
        for ch, decoder in self._utf8.items():
            self._say(ch, decoder.decode(b"", final=True))
        return self._take()

    def _step(self, i: int) -> None:
        if self._held and i == self._sep:
            held, self._held = self._held, []
            if not self._apply(held[0] == self._open, self._tok.decode(held[1:])):
                self._emit(held + [i])
        elif self._held and i not in (self._open, self._close, self._eom):
            self._held.append(i)
            if not self._may_be_tag(self._held[0] == self._open, self._tok.decode(self._held[1:])):
                self._release()
        else:
            self._release()
            if i == self._eom:
                self.done = True
            elif i in (self._open, self._close):
                self._held = [i]
            else:
                self._emit([i])

    def _may_be_tag(self, is_open: bool, text: str) -> bool:
        names = _OPEN_TAGS if is_open else _CLOSE_TAGS
        if is_open and self.channel == "tools":
            if text.startswith(("call ", "argument ")):
                return True
            names += ("call", "argument")
        return any(name.startswith(text) for name in names)

    def _apply(self, is_open: bool, tag: str) -> bool:
        """Act on a complete marker; False when it is not one (it then stays text)."""
        if not is_open and tag in _CLOSE_TAGS:
            if tag == "message":
                self.done = True
            elif tag == "argument":
                self._end_argument()
            elif tag in ("think", "tools"):
                self.channel = "answer"
            return True
        if is_open and tag in _OPEN_TAGS:
            self.channel = {"think": "reasoning", "response": "answer", "tools": "tools"}[tag]
            return True
        name, _, rest = tag.partition(" ")
        if not (is_open and self.channel == "tools" and name in ("call", "argument")):
            return False
        attrs = {k: _unescape(v) for k, v in _ATTR.findall(" " + rest)}
        self._end_argument()
        if name == "call":
            index = attrs.get("index", "")
            self.tool_calls.append({"name": attrs.get("tool"), "index": int(index) if index.isdigit() else None,
                                    "arguments": {}})
        else:
            self._arg = (attrs.get("key", ""), attrs.get("type", "string"), bytearray())
        return True

    def _end_argument(self) -> None:
        if self._arg is None:
            return
        (key, kind, raw), self._arg = self._arg, None
        value: Any = raw.decode("utf-8", "replace")
        if kind != "string":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # a malformed value stays the text the model wrote
        if not self.tool_calls:
            self.tool_calls.append({"name": None, "index": None, "arguments": {}})
        self.tool_calls[-1]["arguments"][key] = value

    def _release(self) -> None:
        held, self._held = self._held, []
        if held:
            self._emit(held)

    def _emit(self, ids: list[int]) -> None:
        data = self._tok.decode_bytes(ids)  # special ids give their names: a non-marker stays visible
        if self.channel == "tools":  # only argument values are content there; the rest is layout
            if self._arg is not None:
                self._arg[2].extend(data)
            return
        self._bytes[self.channel].extend(data)
        self._say(self.channel, self._utf8[self.channel].decode(data))

    def _say(self, channel: str, text: str) -> None:
        if text and self._out and self._out[-1][0] == channel:
            self._out[-1] = (channel, self._out[-1][1] + text)
        elif text:
            self._out.append((channel, text))

    def _take(self) -> list[tuple[str, str]]:
        out, self._out = self._out, []
        return out


def split_reply(tokenizer, ids: Iterable[int], thinking: bool = True) -> tuple[str, str, list[dict]]:
    """(reasoning, answer, tool_calls) of a generated reply; tool calls as
    {"name": str, "index": int, "arguments": {key: value}} with values typed as their `type` attribute."""
    parser = ReplyParser(tokenizer, thinking=thinking)
    parser.feed(ids)
    parser.finish()
    return parser.reasoning, parser.answer, parser.tool_calls
