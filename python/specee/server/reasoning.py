"""Reasoning ("thinking") in chat, as llama-server does it: whether a template is asked to think, and the thoughts a
reply opens with split out of its content into `reasoning_content`.

The rules, one table each:
- `THINKING_TAGS`: the markers that open and close a model's thoughts, found in its Jinja chat template;
- `REASONING_SWITCH`: `--reasoning on|off|auto` (and llama.cpp's other spellings of them): the template variable
  `enable_thinking` is true (on), false (off), or true exactly where the template reacts to it or has thinking tags
  (auto, the default); a request's `chat_template_kwargs: {"enable_thinking": bool}` and `reasoning_effort: "none"`
  decide for it alone;
- `REASONING_FORMATS`: `--reasoning-format` and a request's `reasoning_format`: whether a reply's thoughts are split
  out of its content.

Where the thoughts are: a prompt that ends inside an open thinking block (`<think>\\n`, DeepSeek-R1's and QwQ's
generation prompt) makes the whole reply thoughts up to the closing tag; otherwise a reply that starts with the
opening tag has its thoughts there. A reply held to a grammar (tool calls in the generic form, `response_format`)
starts with its JSON and is never split. Thoughts and content are trimmed of the whitespace around the tags;
thoughts of whitespace only are none.
`--reasoning-budget N` (and a request's `reasoning_budget_tokens` or `thinking_budget_tokens`, -1 there: the server's):
-1 unlimited, 0 no thoughts at all (the template is asked not to think, as with `--reasoning off`), N > 0: after N
tokens of thought the server forces the closing tag (`--reasoning-budget-message`'s text before it, the template's
text after it) and the answer follows (`ThoughtBudget`, counted by the batching thread, server/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (opening, closing) markers of thoughts, in the order they are looked for in a template's text
THINKING_TAGS: list[tuple[str, str]] = [
    ("<think>", "</think>"),  # DeepSeek-R1, QwQ, Qwen3, SmolLM3, GLM, MiniMax, ...
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command-R7B, Command-A
    ("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ("[THINK]", "[/THINK]"),  # Mistral's Magistral, Ministral reasoning
]

# --reasoning's values, as llama.cpp spells them: True (on), False (off), None (auto)
REASONING_SWITCH: dict[str, bool | None] = {
    "on": True, "enabled": True, "true": True, "1": True,
    "off": False, "disabled": False, "false": False, "0": False,
    "auto": None, "-1": None,
}


@dataclass(frozen=True)
class ReasoningFormat:
    split: bool  # thoughts go to reasoning_content
    in_content: bool  # and stay in the content too (with their tags)
    why: str


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "auto": ReasoningFormat(True, False, "as deepseek (the default)"),
    "deepseek": ReasoningFormat(True, False, "thoughts in message.reasoning_content, not in content"),
    "deepseek-legacy": ReasoningFormat(True, True, "thoughts in reasoning_content and, with their tags, in content "
                                                   "(a stream sends them as content)"),
    "none": ReasoningFormat(False, False, "thoughts left in content, unparsed"),
}


class ReasoningError(ValueError):
    """A reasoning setting or request field that is not one of the table's."""


def switch_of(value: str) -> bool | None:
    """--reasoning's value (ReasoningError naming the known ones)."""
    if value.lower() not in REASONING_SWITCH:
        raise ReasoningError(f"--reasoning: {value!r} is not one of on, off, auto")
    return REASONING_SWITCH[value.lower()]


def format_of(value: Any, what: str = "--reasoning-format") -> str:
    if not isinstance(value, str) or value not in REASONING_FORMATS:
        raise ReasoningError(f"{what} must be one of {', '.join(REASONING_FORMATS)}, not {value!r}"[:200])
    return value


def budget_of(value: Any, what: str = "--reasoning-budget") -> int:
    """A thinking budget: -1 (none), 0 (no thoughts) or N > 0 tokens of thought."""
    try:
        n = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    except ValueError:
        n = None
    if n is None or n < -1 or n >= 2**31:
        raise ReasoningError(f"{what} must be -1 (unlimited), 0 (no thinking) or N > 0 tokens, not {value!r}"[:200])
    return n


def tags_in(source: str | None) -> tuple[str, str] | None:
    """The thinking markers a template's text uses, None when it has none of the table's."""
    if not source:
        return None
    for start, end in THINKING_TAGS:
        if start in source and end in source:
            return start, end
    return None


@dataclass(frozen=True)
class Reasoning:
    """The server's reasoning settings: --reasoning (True, False, None: auto), --reasoning-format, --reasoning-budget,
    --reasoning-effort (None: the template's default), --reasoning-budget-message."""

    switch: bool | None = None
    format: str = "auto"
    budget: int = -1
    effort: str | None = None
    budget_message: str = ""


def reasoning_of(settings: dict[str, Any]) -> Reasoning:
    """The server's reasoning from its flags (flags.py's rows, by dest: reasoning, reasoning_format,
    reasoning_budget, reasoning_effort, reasoning_budget_message); ReasoningError on a bad value."""
    effort = settings.get("reasoning_effort")
    return Reasoning(switch_of(settings["reasoning"]) if "reasoning" in settings else None,
                     format_of(settings.get("reasoning_format", "auto")),
                     budget_of(settings.get("reasoning_budget", -1)),
                     None if effort in (None, "default") else effort,
                     settings.get("reasoning_budget_message") or "")


@dataclass(frozen=True)
class ReplyThoughts:
    """How one reply's thoughts are split out: the template's markers, whether the prompt left a thought open (the
    reply begins inside it), and whether they stay in the content too (deepseek-legacy)."""

    tags: tuple[str, str]
    open: bool
    in_content: bool = False

    def split(self, text: str) -> tuple[str | None, str]:
        """(thoughts or None, content) of a whole reply."""
        thoughts, content = split(text, self.tags, self.open)
        return thoughts or None, (self.start_text() + text if self.in_content else content)

    def start_text(self) -> str:
        return self.tags[0] if self.open else ""

    def stream(self) -> ReplySplitter:
        return ReplySplitter(self.tags, self.open)


def thinks_open(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether a rendered prompt ends inside an open thinking block: the reply begins with thoughts."""
    start, end = tags
    return prompt.rfind(start) > prompt.rfind(end)


def split(text: str, tags: tuple[str, str], open_: bool, final: bool = True) -> tuple[str, str]:
    """(thoughts, content) of a reply. Not final (a stream so far): what may still be part of a tag, and trailing
    whitespace, is held back, so that each later split only adds to both."""
    start, end = tags
    if open_:
        body = text
    else:
        head = text.lstrip()
        if head.startswith(start):
            body = head[len(start):]
        elif not final and start.startswith(head):  # empty, whitespace, or the opening tag's first characters
            return "", ""
        else:
            return "", text
    at = body.find(end)
    if at >= 0:
        thoughts, content = body[:at].strip(), body[at + len(end):].lstrip()
        if not final:
            content = held(content, "")
        return thoughts, content
    if final:
        return body.strip(), ""
    return held(body, end).lstrip(), ""


def held(text: str, tag: str) -> str:
    """text without what a stream holds back: a tail that may begin `tag`, then trailing whitespace."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            text = text[:-k]
            break
    return text.rstrip()


class ReplySplitter:
    """A reply's thoughts and content as it is generated: `push(text so far)` gives the new part of each."""

    def __init__(self, tags: tuple[str, str], open_: bool) -> None:
        self.tags, self.open, self.sent = tags, open_, (0, 0)

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        thoughts, content = split(text, self.tags, self.open, final)
        (nt, nc), self.sent = self.sent, (max(self.sent[0], len(thoughts)), max(self.sent[1], len(content)))
        return thoughts[nt:], content[nc:]


@dataclass
class ThoughtBudget:
    """A reply's thinking budget of n > 0 tokens, as llama.cpp counts it: the tokens inside a thought, after its
    opening tag (its own tokens not counted) whether the prompt's generation prompt or the reply wrote it, the
    prompt's tokens after it included (`prefill`). Once n are in, the thought is cut and `forced` (the budget's
    message, the closing tag, the template's text after it) goes into the reply in place of the next token; a thought
    closed by the model itself ends the count, a later opening tag starts a new one. `cut` is fed the reply's token
    pieces as they are generated."""

    n: int
    tags: tuple[str, str]
    forced: list[int]  # the tokens put in at the cut
    counting: bool = False  # inside a thought
    used: int = 0  # its tokens so far
    seen: bytes = b""  # the text since the thought opened (before: since the last one closed)

    def prefill(self, pieces: list[bytes]) -> None:
        """The prompt's tokens (their pieces): a thought its generation prompt opens counts from there."""
        for piece in pieces:
            self.accept(piece)

    def accept(self, piece: bytes) -> None:
        start, end = (t.encode() for t in self.tags)
        self.seen += piece
        if not self.counting:
            at = self.seen.find(start)
            if at >= 0:
                self.counting, self.used, self.seen = True, 0, self.seen[at + len(start):]
        elif end in self.seen:  # closed by the model
            self.counting, self.seen = False, self.seen[self.seen.find(end) + len(end):]
        else:
            self.used += 1

    def spent(self) -> bool:
        if self.counting and self.used >= self.n:
            self.counting, self.seen = False, b""
            return True
        return False

    def cut(self, pieces: list[bytes]) -> int | None:
        """How many of these tokens (their pieces) to keep: None all of them, k where the budget is spent after the
        first k (0: before them); `forced` follows them."""
        for i, piece in enumerate(pieces):
            if self.spent():
                return i
            self.accept(piece)
        return len(pieces) if self.spent() else None
