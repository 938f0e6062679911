"""Built-in training text for the small test tokenizer (written for this project).

BASE_TEXT is a few KB of mixed prose, chat markup words, code, numbers and whitespace, with a
little non-ASCII. `synthetic_text()` adds deterministic made-up words so that larger test
vocabularies (a few thousand ids) still have pairs left to merge.
"""

from __future__ import annotations

BASE_TEXT = r"""Hello world! Hello world. Hello, world? "Hello world," she said, and the world said hello back.
The assistant reads the message, checks the role, and writes a response for the user.
A message has a role: user, assistant, system or tool. The system message comes first.
The user asks; the assistant may think before the response, and may call tools.
Each tool call has a name, an index and one argument or more; every argument has a type.
When the tools return, a tool message carries the result back to the assistant.
think, response, tools, call, argument, tool, message, role, user, assistant, system.
message role="user" message role="assistant" message role="system" message role="tool"
call tool="search" index="0" argument key="query" type="string" argument key="limit" type="number"
<think> First, think about the question. Then write the response. </think>
message role="user" name="ada"
message role="assistant"
think
response
tools
call tool="get_weather" index="0"
argument key="city" type="string"
tool
message role="system" type="tool-declare"
message role="tool" tool="get_weather" index="1"
response
think
The quick brown fox jumps over the lazy dog; the lazy dog does not mind at all.
It's a small test, isn't it? We'll see. They've said they'd come, and I'm sure you're right.
Numbers: 0, 1, 2, 3, 10, 42, 100, 256, 1024, 2048, 4096, 65536, 163840, 3.14159, -7, +12.5%.
Dates and times: 2025-01-31, 12:30:45, 1999/12/31; prices: $19.99, EUR 7.50, 1,000,000 units.
Version 1.2.3 fixed bug #4567 (see issue 89); phone +1 (555) 010-9999; ratio 3:2; score 98/100.

def tokenize(text: str, max_len: int = 128) -> list[int]:
    '''Split text into pieces and map each piece to an id.'''
    ids = []
    for i, piece in enumerate(text.split()):
        if i >= max_len:
            break
        ids.append(hash(piece) % 1000)
    return ids


class Message:
    def __init__(self, role, content):
        self.role = role
        self.content = content

    def __repr__(self):
        return f"Message(role={self.role!r}, content={self.content!r})"

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
if (x != y && y >= 0 || z == NULL) return -1;
{"role": "user", "content": "What is 15% of 240?", "tools": [], "index": 0, "ok": true}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "call_01"}
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;
$ pip install numpy && python -m pytest -q tests/ --maxfail=1
	tab	separated	values	here
    four spaces, then eight:        and a trailing space 
line one
line two

line four after a blank line
   

# Heading
## Subheading
- item one
- item two
* bold **text** and _italic_ and `code` and [a link](https://example.com/path?q=1&r=2).
> A quoted line, with an em dash - and an ellipsis...

Weather today: sunny in the morning, cloudy in the afternoon, and rain at night.
The meeting starts at nine; please bring the report, the slides and your questions.
Reading, writing and arithmetic are the three skills every school teaches first.
Machine learning models learn patterns from data; tokenizers turn text into numbers.
A tokenizer splits text into pieces, and byte pair encoding merges frequent pairs.
The model predicts the next token, one token at a time, until the end of the message.
Tokens, tokens, tokens: the more often a pair appears, the sooner it is merged.
What is the capital of France? Paris is the capital of France.
How many days are in a week? There are seven days in a week.
Please answer in one short sentence. Thank you for your help!
I think, therefore I am. To be, or not to be: that is the question.
She sells sea shells by the sea shore, and the shells she sells are sea shells.

Non-English text: 你好世界。你好，世界！中文分词测试，今天天气很好。
日本語のテキストも少しあります。こんにちは世界。
Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Kraków, smörgåsbord, Ærø.
Ελληνικά: Γειά σου κόσμε. Русский: Привет, мир! Español: ¿Dónde está la biblioteca?
Français: où est la gare ? Deutsch: Grüße aus Köln, über die Straße.
Emoji: 😀 👍 🎉 ❤️ 🚀 and symbols: © ® ™ € £ ¥ ° ± × ÷ → ← ✓ ∑ ∞.

Hello world, again: the world is big, and the assistant helps the user with the world.
The user says hello; the assistant says hello; the system says nothing at all.
A response without thinking is still a response. A tool without a call is still a tool.
End of the built-in text. Hello world!
"""

_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "x")
_PUNCT = (".", ",", ";", ":", "!", "?")


def _lcg(seed: int):
    """A fixed linear congruential generator (Numerical Recipes constants), 32-bit."""
    state = seed & 0xFFFFFFFF
    while True:
        state = (1664525 * state + 1013904223) & 0xFFFFFFFF
        yield state >> 8


def synthetic_text(n_words: int = 6000, seed: int = 20260101) -> str:
    """Deterministic made-up words with spaces, capitals, numbers and punctuation."""
    rnd = _lcg(seed)
    parts: list[str] = []
    for k in range(n_words):
        word = "".join(
            _ONSETS[next(rnd) % len(_ONSETS)] + _VOWELS[next(rnd) % len(_VOWELS)]
            + _CODAS[next(rnd) % len(_CODAS)]
            for _ in range(1 + next(rnd) % 3)
        )
        roll = next(rnd) % 16
        if roll == 0:
            word = word.capitalize()
        elif roll == 1:
            word = str(next(rnd) % 10_000)
        parts.append(" " + word)
        if roll == 2:
            parts.append(_PUNCT[next(rnd) % len(_PUNCT)])
        if k % 12 == 11:
            parts.append("\n")
    return "".join(parts)
