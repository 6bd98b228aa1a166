"""How the server turns chat messages into a prompt: the runtime's built-in templates (csrc/model/specee-chat.cpp, the
default) or Jinja text rendered by jinja2 as Hugging Face's `apply_chat_template` renders it (`--jinja`).

The choice is made once, at start (`chat_template_of`), and checked there by rendering a probe conversation: a
template that does not compile or render is an error naming the template before the server listens, never a crash
on the first request. Hugging Face's conventions: a sandboxed environment with `trim_blocks` and `lstrip_blocks`,
the loop-control extension and `{% generation %}` (rendered as its body),
`raise_exception(msg)`, `strftime_now(fmt)`, the `tojson` filter as transformers writes it (no ASCII escapes, keys
in their order), and the variables `messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`,
`eos_token`, llama.cpp's `date_string` (today, "27 Nov 2026"), `datetime` (today, "Nov 27 2026": FireFunction's) and
`enable_thinking` (server/reasoning.py decides it), then the server's `--chat-template-kwargs` and a request's
`chat_template_kwargs` over them. As llama.cpp's own Jinja engine does, `+` of a string and an undefined variable or
null is the string (FireFunction-v2's template adds `functions`, which nothing defines).

A template given by file is code from outside: a render is bounded (`RenderBudget`): at most MAX_RENDER_SECONDS
of the template's own code (a trace on its frames stops endless nested loops), at most MAX_RENDER_CHARS of output
and of any string or list it builds (`*`, `+`, `%`, a method's or a filter's result), numbers of at most
MAX_NUMBER_BITS bits from `*` and `**`, and no call or filter given an integer above MAX_CALL_INT (jinja2's sandbox
already caps `range` at 100,000 items). Past a bound the render is a TemplateError naming it: at start the server
refuses the template, on a request it is that request's 400.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import SandboxedEnvironment, SecurityError

from specee import _core
from specee.model import Model
from specee.server.reasoning import Reasoning, tags_in

PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
         {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
ASK = [{"role": "user", "content": "u"}]  # a one-question chat: the generation prompt with and without thinking


class TemplateError(ValueError):
    """A template that cannot render these messages (its own raise_exception included)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    def plain(v: Any) -> Any:  # what a filter chain leaves (`tools | map(...)`: a generator) as a list
        if isinstance(v, (str, bytes, int, float, bool, type(None), dict, list, tuple)):
            return v
        if isinstance(v, (jinja2.Undefined,)):
            return None
        try:
            return list(v)
        except TypeError:
            return str(v)

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=plain)


class GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training masks):
    here its body renders as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


# ---- the render's bounds ----------------------------------------------------------------------------------------

MAX_RENDER_SECONDS = 10.0  # of the template's own code, per render
MAX_RENDER_CHARS = 16 << 20  # characters of output, and of any one string or list a template builds (4x MAX_BODY)
MAX_NUMBER_BITS = 4096  # an integer a template makes with * or ** (10**1233)
MAX_CALL_INT = 100_000  # an integer given to a call or a filter (a width, a count): jinja2's MAX_RANGE
TEMPLATE_FILE = "<template>"  # the file name of code jinja2 compiled from a string
WIDE_FORMAT = re.compile(r"[%:{][^%{}]*?[0-9]{6,}|%[^a-zA-Z%]*\*")  # a field width or precision of 6+ digits, or *


def too_big(value: Any) -> bool:
    return isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDER_CHARS


def check_result(value: Any, what: str) -> Any:
    if too_big(value):
        raise SecurityError(f"{what} made a value of {len(value)} items, more than {MAX_RENDER_CHARS}")
    return value


def shown_int(v: int) -> str:
    return str(v) if v.bit_length() < 64 else f"an integer of {v.bit_length()} bits"


def check_args(args: tuple, kwargs: dict, what: str) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CALL_INT:
            raise SecurityError(f"{what} was given {shown_int(v)}, more than {MAX_CALL_INT}")
        if isinstance(v, str) and what in ("the filter format", "str.format") and WIDE_FORMAT.search(v):
            raise SecurityError(f"{what}: a field width or precision over 99999")


class RenderBudget:
    """One render's time: a trace function on the template's own frames (the code jinja2 compiled) that raises
    past the deadline, checked every 256 lines. The thread's earlier trace function comes back after."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.lines = 0

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        self.lines += 1
        if self.lines % 256 == 0 and time.monotonic() > self.deadline:
            raise SecurityError(f"rendering took longer than {self.seconds:g} s")
        return self.local

    def call(self, frame: Any, event: str, arg: Any) -> Any:
        return self.local if frame.f_code.co_filename == TEMPLATE_FILE else None

    def __enter__(self) -> "RenderBudget":
        self.before = sys.gettrace()
        sys.settrace(self.call)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self.before)


def bounded_filter(name: str, fn: Any) -> Any:
    what = f"the filter {name}"

    @functools.wraps(fn)  # keeps jinja_pass_arg (pass_context, pass_environment, ...)
    def run(*args: Any, **kwargs: Any) -> Any:
        check_args(args, kwargs, what)
        return check_result(fn(*args, **kwargs), what)

    return run


class ChatEnvironment(SandboxedEnvironment):
    """Sandboxed (no attribute a template should not reach), not immutable: some templates build lists with .append
    (Kimi-K2's), as llama.cpp's own engine allows; the messages they see are the request's own copy. `+` of a string
    and an undefined or null value gives the string, as in llama.cpp's engine (jinja2 would raise). Operators and
    calls are held to the render's bounds (the module's docstring)."""

    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        def empty(v: Any) -> bool:
            return v is None or isinstance(v, jinja2.Undefined)

        if operator == "+" and (empty(left) and isinstance(right, str) or isinstance(left, str) and empty(right)):
            return left if isinstance(left, str) else right
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, (str, list, tuple)) and len(seq) * n > MAX_RENDER_CHARS:
                raise SecurityError(f"'*' would make {len(seq) * n} items, more than {MAX_RENDER_CHARS}")
            if ints and left.bit_length() + right.bit_length() > MAX_NUMBER_BITS:
                raise SecurityError(f"'*' would make an integer of more than {MAX_NUMBER_BITS} bits")
        if operator == "**" and ints and right > 0 and max(abs(left), 2).bit_length() * right > MAX_NUMBER_BITS:
            raise SecurityError(f"'**' would make an integer of more than {MAX_NUMBER_BITS} bits")
        if operator == "%" and isinstance(left, str) and WIDE_FORMAT.search(left):
            raise SecurityError("'%': a field width or precision over 99999")
        return check_result(super().call_binop(context, operator, left, right), f"'{operator}'")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        name = getattr(__obj, "__name__", "")
        what = f"the call {name or 'of a value'}"
        if name in ("format", "format_map"):  # the sandbox's wrapper of str.format: the text is the method's own
            what = "str.format"
            text = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            if isinstance(text, str) and WIDE_FORMAT.search(text):
                raise SecurityError(f"{what}: a field width or precision over 99999")
        check_args(args, kwargs, what)
        return check_result(super().call(__context, __obj, *args, **kwargs), what)


def jinja_environment() -> SandboxedEnvironment:
    env = ChatEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters = {name: bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.pop("lipsum", None)  # paragraphs of filler text: no chat template's business, and slow when large
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def special_text(model: Model, token: int) -> str:
    return "" if token < 0 else model.token_to_piece(token, True).decode("utf-8", errors="replace")


@dataclass
class ChatTemplate:
    """The server's chat template: a built-in one by name (`builtin`), or Jinja `source` compiled by jinja2."""

    builtin: str | None = None
    source: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # --chat-template-kwargs
    bos: str = ""
    eos: str = ""
    compiled: jinja2.Template | None = None
    system: bool = True  # it renders a system message (else one is put before the first user message's text)
    reasoning: Reasoning = field(default_factory=Reasoning)  # --reasoning, --reasoning-format, ...
    prefill: bool = True  # a chat's final assistant message is continued (--no-prefill-assistant: answered after)
    thinking: tuple[str, str] | None = None  # the markers of thoughts in its text (Jinja only)
    enable_thinking: bool = False  # the template variable's default: --reasoning, and whether the template thinks
    after_thinking: str = ""  # the text it puts between a thought's closing tag and the content ("\n\n": Qwen3's)

    @property
    def kind(self) -> str:
        return "jinja" if self.source is not None else "builtin"

    @property
    def supports_tools(self) -> bool:
        """Whether the template itself describes tools to the model (its text reads the `tools` variable)."""
        return self.source is not None and "tools" in self.source

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of messages (TemplateError when the template refuses them)."""
        if self.compiled is None:
            assert self.builtin is not None
            chat = []
            for i, m in enumerate(messages):
                if not isinstance(m.get("content"), str):
                    raise TemplateError(f"message {i}: the built-in template {self.builtin} needs text content")
                chat.append({"role": m["role"], "content": m["content"]})
            try:
                return _core.chat_apply_template(self.builtin, chat, add_generation_prompt)
            except _core.SpecEEError as e:
                raise TemplateError(str(e)) from None
        if not self.system and messages and messages[0]["role"] == "system":
            messages = without_system(messages)
        # llama.cpp's: the date (Llama-3.x templates print it; theirs default to a fixed date) and enable_thinking
        today = datetime.date.today()
        values = {"date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y"),
                  "enable_thinking": self.enable_thinking, **self.kwargs, **(kwargs or {}),
                  "messages": messages, "add_generation_prompt": add_generation_prompt,
                  "bos_token": self.bos, "eos_token": self.eos}
        if tools:
            values["tools"] = tools
        try:
            return bounded_render(self.compiled, values)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError,
                MemoryError) as e:
            raise TemplateError(f"chat template: {type(e).__name__}: {str(e)[:200]}") from None

    def tokens(self, model: Model, text: str) -> list[int]:
        """The rendered text's tokens: special-token text parsed, BOS as the vocabulary asks and not twice."""
        tokens = model.tokenize(text, add_special=True, parse_special=True)
        if len(tokens) >= 2 and tokens[0] == tokens[1] == model.bos:
            tokens = tokens[1:]
        return tokens


def bounded_render(compiled: jinja2.Template, values: dict[str, Any]) -> str:
    """The template's text for these values, within the render's bounds (SecurityError past one)."""
    pieces, n = [], 0
    with RenderBudget(MAX_RENDER_SECONDS):
        for piece in compiled.generate(**values):
            n += len(piece)
            if n > MAX_RENDER_CHARS:
                raise SecurityError(f"the rendered text passed {MAX_RENDER_CHARS} characters")
            pieces.append(piece)
    return "".join(pieces)


def chat_template_of(model: Model, jinja: bool, template: str | None, template_file: str | None,
                     kwargs: dict[str, Any] | None = None, reasoning: Reasoning | None = None) -> ChatTemplate:
    """The template the server renders with (ValueError naming what is wrong, at start):
    - without --jinja: a built-in template, by --chat-template NAME (or Jinja text with a known template's markers),
      by the file's text, or the model's own recognised by its markers; a model whose own template the built-in
      renderer does not know is rendered by jinja2 instead (said on stderr by the caller);
    - with --jinja: jinja2 renders --chat-template TEXT, the file's text, or the model's tokenizer.chat_template
      (--chat-template NAME still names a built-in template, as llama.cpp takes it).
    `reasoning` decides `enable_thinking` (server/reasoning.py); a built-in template never thinks."""
    reasoning = reasoning or Reasoning()
    if template is not None and template_file is not None:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    if template_file is not None:
        try:
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template-file {template_file}: {e}") from None
    own = model.metadata.get("tokenizer.chat_template")
    bos, eos = special_text(model, model.bos), special_text(model, model.eos)
    if not jinja:
        try:
            return checked(ChatTemplate(builtin=model.chat_template(template), reasoning=reasoning))
        except ValueError as e:
            if template is not None or not own:
                raise ValueError(f"{e} (--jinja renders any Jinja template)") from None
    source = template if template is not None else own
    if not source:
        raise ValueError("the model has no tokenizer.chat_template: give --chat-template or --chat-template-file")
    if template is not None and _core.chat_template_detect(template) == template:
        return checked(ChatTemplate(builtin=template, reasoning=reasoning))  # a built-in name
    try:
        compiled = jinja_environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template: line {e.lineno}: {e.message}") from None
    kwargs = dict(kwargs or {})
    if reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning.effort)
    t = checked(ChatTemplate(source=source, kwargs=kwargs, bos=bos, eos=eos, compiled=compiled, reasoning=reasoning))
    thinks = thinking_of(t)
    t.thinking = tags_in(source)
    t.after_thinking = after_thinking_of(t)
    # llama.cpp's: on or off as asked (--reasoning, a budget of 0: off), else where the template thinks
    t.enable_thinking = (False if reasoning.budget == 0 else reasoning.switch if reasoning.switch is not None
                         else thinks)
    return t


def thinking_of(t: ChatTemplate) -> bool:
    """Whether a Jinja template thinks: its generation prompt changes with enable_thinking, or it has the markers of
    thoughts."""
    try:
        on, off = (t.render(ASK, kwargs={"enable_thinking": v}) for v in (True, False))
    except TemplateError:
        return False
    return on != off or tags_in(t.source) is not None


def after_thinking_of(t: ChatTemplate) -> str:
    """The text a Jinja template puts after an assistant message's closing thinking tag, before its content ("" where
    it renders no thoughts, or none of its own)."""
    if t.thinking is None:
        return ""
    said = [*ASK, {"role": "assistant", "content": "ANSWER", "reasoning_content": "THOUGHT"}]
    try:
        text = t.render(said, add_generation_prompt=False)
    except TemplateError:
        return ""
    end = t.thinking[1]
    at, answer = text.find(end, text.find("THOUGHT")), text.rfind("ANSWER")
    return text[at + len(end):answer] if "THOUGHT" in text and 0 <= at < answer else ""


def without_system(messages: list[dict]) -> list[dict]:
    """A chat's leading system message put before the text of the first user message (llama.cpp does the same for
    templates without a system role, Gemma's)."""
    system, rest = messages[0], list(messages[1:])
    for i, m in enumerate(rest):
        if m["role"] == "user" and isinstance(m.get("content"), str):
            rest[i] = {**m, "content": system["content"] + "\n\n" + m["content"]}
            return rest
    return [{"role": "user", "content": system["content"]}, *rest]


def checked(t: ChatTemplate) -> ChatTemplate:
    """The template, once it has rendered a probe conversation (system, user, assistant, user), or, for a Jinja
    template that refuses a system message, the same with the system text put into the first user message."""
    try:
        t.render(PROBE)
    except TemplateError as first:
        if t.compiled is None:
            raise ValueError(f"the chat template cannot render a conversation: {first}") from None
        t.system = False
        try:
            t.render(PROBE)
        except TemplateError as e:
            raise ValueError(f"the chat template cannot render a conversation: {e}") from None
    return t
