"""What a generation takes and reports, and its text side.

The options and stats are the runtime's (csrc/include/specee.h: `specee_generator_params`, `specee_generator_stats`,
named once in csrc/decode/specee-options.cpp): `GenerateOptions` has a field for every option of the runtime's table,
under the same name ("temp", "eagle.topk" is `eagle.topk`, "exit.kv" is `exit.kv`), and the runtime checks every
value (a refused one raises ValueError with its message); `GenerationStats` has the runtime's stats under their
names. tests/test_options.py keeps both equal to the runtime's tables. `Model.generate`, `Model.stream` and
`Model.generate_tokens` take GenerateOptions' fields as keywords.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

from specee import _core

Message = dict  # {"role": one of specee.model.CHAT_ROLES ("system", "user", "assistant", ...), "content": str}
Prompt = Union[str, bytes, Sequence[Message]]


@dataclass(frozen=True)
class Mode:
    """A row of the runtime's mode table (csrc/include/specee.h, specee_mode_info): what a mode does. needs_head: it
    drafts with the EAGLE head; tree: a step verifies a drafted tree in one pass (stats: mean_accepted_tokens); exits: a
    pass may stop at a checked layer (exit_ratio, mean_layers_run); lossless: greedy output equals plain decoding's and
    sampling keeps its distribution (a mode that exits: with exit.check); shared_pass: in `Slots` its steps join the
    shared pass; greedy_only: why it refuses temp > 0, or None; reads: the settings it takes besides sampling
    ("eagle1_tree": eagle.choices, "eagle2_tree": eagle.total_tokens/depth/topk, "exit": exit.*, "ngram": ngram.*)."""

    name: str
    help: str
    needs_head: bool
    tree: bool
    exits: bool
    lossless: bool
    shared_pass: bool
    greedy_only: str | None
    reads: tuple[str, ...]


# the modes by name, in the runtime's order (auto first), and the exit KV policies, as the runtime defines them
MODES: dict[str, Mode] = {m["name"]: Mode(**{**m, "reads": tuple(m["reads"])}) for m in _core.modes()}
EXIT_KV: tuple[str, ...] = tuple(next(o["choices"] for o in _core.generator_options() if o["name"] == "exit.kv"))
# llama.cpp's speculation types (--spec-type) and the mode that serves each here, as the runtime's table says
SPEC_TYPES: dict[str, str] = _core.spec_types()
# GenerateOptions' fields of the frontends, not the runtime's: text (stop strings) and chat rendering
FRONTEND_OPTIONS = ("stop", "chat_template", "grammar", "json_schema")


def _checked(params: Any, group: str = "") -> None:
    """The runtime checks every value (ValueError with its message); then the numbers it took from text ("0.5") are
    stored as numbers, so a field holds the type it is annotated with."""
    _core.generate_options_values(params, group)
    for f in fields(params):
        value, kind = getattr(params, f.name), str(f.type).split(" ")[0]
        if isinstance(value, str) and kind in ("int", "float"):
            setattr(params, f.name, int(value) if kind == "int" else float(value))


@dataclass
class EagleParams:
    """EAGLE trees. eagle: `choices`, child-rank paths such as [[0], [1], [0, 0]] (or their text) or the preset
    "mc_sim_7b_63". eagle2: the best `total_tokens` of a tree grown `topk` by `topk`, `depth` deep. None: the
    runtime's defaults, from the cost of a verification pass on the model's layers: three draft tokens ([[0], [1],
    [0, 0]]; 3/2/2) where the CPU's layer matrices are repacked (e.g. Q4_0), else one (docs/speculative.md).
    replay: cost benchmarks: step i accepts replay[i % len(replay)] drafted tokens along the tree's best path whatever
    the target says (the output is meaningless)."""

    choices: str | Sequence[Sequence[int]] | None = None
    total_tokens: int | None = None
    depth: int | None = None
    topk: int | None = None
    replay: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.choices is not None and not isinstance(self.choices, str):
            self.choices = str([[int(r) for r in path] for path in self.choices])
        _checked(self, "eagle")


@dataclass
class ExitParams:
    """SpecEE early exit. threshold: a predictor fires above it; layers: the static schedule (block indices);
    None: the model file's (specee.exit.threshold / specee.exit.layers). dynamic: also check e-2, e, e+2 around the
    last 5 exit layers. kv: what the skipped layers' cache holds for an exited token, "mask" (nothing; SpecEE's) or
    "fill" (K/V from the exit layer's output). replay: benchmarks and tests: token i exits after block
    replay[i % len(replay)] whatever the predictors say. check: checked exits: an exited token's skipped layers run
    with the next token's pass, and a token the full model disagrees with is taken back (greedy output equals plain
    decoding; tokens come out once checked; kv does not apply)."""

    threshold: float | None = None
    layers: Sequence[int] | None = None
    dynamic: bool = True
    kv: str = "mask"
    replay: Sequence[int] | None = None
    check: bool = False

    def __post_init__(self) -> None:
        _checked(self, "exit")


@dataclass
class NgramParams:
    """n-gram lookup (mode "ngram"): drafts copied from where the sequence's last n tokens stood before, n from n_max
    down to n_min; at most draft_max tokens a step (how many adapts to their acceptance on the sequence and to this
    machine's cost of a pass; adaptive=False: draft_max wherever a match is found); branches: continuations verified as
    the root's children. None: the runtime's defaults (2, 4, 8, 1)."""

    n_min: int | None = None
    n_max: int | None = None
    draft_max: int | None = None
    branches: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        _checked(self, "ngram")


@dataclass
class DraftParams:
    """A draft model (mode "draft", Model(draft_model=...); llama.cpp's -md): a greedy chain of at most n_max tokens a
    step, drafting stopped where the draft model's top probability is below p_min, a chain shorter than n_min not
    verified. synth_rates: benchmarks only, drafted token i of a step accepted with probability synth_rates[i]
    whatever the target says (one per n_max, non-increasing; the output is not the model's). None: the runtime's
    defaults (3, 0, 0)."""

    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    synth_rates: Sequence[float] | None = None

    def __post_init__(self) -> None:
        _checked(self, "draft")


@dataclass
class GenerateOptions:
    """Everything a generation call takes besides the prompt and max_tokens.

    mode: "plain", "eagle", "eagle2", "early-exit", "tree-exit" (early exit inside the EAGLE tree's verification
    pass: eagle's tree settings and exit's, greedy) or "auto": early-exit with a draft head and exit predictors at
    temp 0 (SpecEE's behaviour), eagle2 with a draft head, else plain. Sampling: llama.cpp's chain and defaults
    (temp <= 0: greedy; seed None or -1: random); ignore_eos: end-of-generation tokens are never sampled; logit_bias:
    {token: bias} (or llama.cpp's text "15043+1,2-inf"; -inf bans a token) added to the model's logits. eagle and
    exit: the trees and the early-exit settings. stop: strings that end generation (not included). chat_template:
    for message prompts, a name instead of the model's own. Structured output (docs/structured-output.md): grammar,
    a GBNF grammar's text (or Lark, or a regular expression, with grammar_type "lark" / "regex"), or json_schema, a
    JSON Schema (a dict, JSON text or a pydantic model class); grammar_type follows from which is given; jump_forward:
    the tokens the grammar forces are verified together in one pass (plain decoding, and the drafters' modes where
    their drafts reach no further; the output is the same);
    grammar_overlap: the grammar's next mask is computed on a worker thread while the pass runs.

    grammar_spec (set here, not an argument): the runtime's (type, text) of the grammar, None without one, computed
    once as the options are made and carried to the runtime (the bindings read it)."""

    mode: str = "auto"
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    logit_bias: str | Mapping[int, float] = ""
    eagle: EagleParams = field(default_factory=EagleParams)
    exit: ExitParams = field(default_factory=ExitParams)
    ngram: NgramParams = field(default_factory=NgramParams)
    draft: DraftParams = field(default_factory=DraftParams)
    stop: Sequence[str] = ()
    chat_template: str | None = None
    grammar: str | None = None
    json_schema: Any = None
    grammar_type: str = "none"
    jump_forward: bool = True
    grammar_overlap: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping):  # {token: bias} as the runtime's text ("15043+1,2-inf")
            self.logit_bias = ",".join(f"{int(t)}{'+' if b >= 0 else '-'}{abs(float(b))}"
                                       for t, b in self.logit_bias.items())
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if isinstance(self.stop, (bytes, bytearray)) or not hasattr(self.stop, "__iter__"):
            raise TypeError(f"stop must be a string or a list of strings, not {type(self.stop).__name__}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty str (an empty one would end every generation before its "
                             f"first token), not {list(self.stop)!r:.60}")
        for name, kind in (("eagle", EagleParams), ("exit", ExitParams), ("ngram", NgramParams),
                           ("draft", DraftParams)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be {kind.__name__}(...), not {type(getattr(self, name)).__name__}")
        _checked(self)  # the table's checks first: an unknown grammar_type is named there
        from specee.grammar import GRAMMAR_TYPE_NAMES, grammar_spec
        # once, here: its ValueError where the options are made, not where the bindings read it
        self.grammar_spec: tuple[int, str] | None = grammar_spec(self.grammar, self.json_schema, self.grammar_type)
        if self.grammar_spec is not None:
            self.grammar_type = GRAMMAR_TYPE_NAMES[self.grammar_spec[0]]


@dataclass
class GenerationStats:
    """What the last generation call did: the runtime's counts and figures under the runtime's names (see
    `specee_generator_stats` in csrc/include/specee.h; the CLI's timing lines and the evaluations' columns use them
    too), then the call's own record."""

    n_prompt: int = 0  # prompt tokens evaluated (the reused prefix not counted)
    n_reused: int = 0  # prompt tokens found in the KV cache (kept from an earlier call)
    t_prompt_ms: float = 0.0
    n_tokens: int = 0  # tokens the runtime returned (an end-of-generation token included)
    n_decoded: int = 0  # of which from decoding steps (all but the first, which comes from the prompt's pass)
    n_steps: int = 0  # decoding steps: one per token (plain, early-exit) or per draft-and-verify step (eagle, eagle2,
    # tree-exit)
    t_decode_ms: float = 0.0
    t_sample_ms: float = 0.0
    n_drafted: int = 0  # eagle, eagle2, tree-exit: draft tokens verified
    n_accepted: int = 0  # of which accepted
    t_draft_ms: float = 0.0
    t_verify_ms: float = 0.0
    n_cache_drafted: int = 0  # ngram: of n_drafted, drafts copied from the context's cross-request cache
    n_cache_accepted: int = 0  # of which accepted
    n_exits: int = 0  # early-exit: decoded tokens that left before the last layer (tree-exit: steps whose pass did)
    n_layers_run: int = 0  # layers evaluated, summed over decoded tokens (tree-exit: over steps)
    n_checks: int = 0
    n_fired: int = 0
    n_rejected: int = 0
    t_layers_ms: float = 0.0
    t_check_ms: float = 0.0
    t_exit_ms: float = 0.0
    t_head_ms: float = 0.0
    t_fill_ms: float = 0.0
    n_verified: int = 0  # checked exits: exited tokens the full model agreed with
    n_rollbacks: int = 0  # exited tokens it disagreed with (the sequence went back to the full model's token)
    n_discarded: int = 0  # tokens emitted after a wrong exit, taken back by the rollbacks
    t_mask_ms: float = 0.0  # a grammar's masks on the decoding thread (computed, or waited for: grammar_overlap)
    n_grammar_dropped: int = 0  # drafted tokens the grammar refused, dropped before verification
    n_grammar_masked: int = 0  # the draft head's candidates the grammar refused, skipped before they entered the tree
    mean_accepted_tokens: float = 0.0  # eagle, eagle2, tree-exit: tokens per step (1.0: no draft token accepted)
    exit_ratio: float = 0.0  # early-exit: share of decoded tokens that exited (tree-exit: of steps)
    mean_layers_run: float = 0.0  # early-exit: layers per decoded token, SpecEE's "average exit layer" (tree-exit: per step)
    # this call's record
    mode: str = ""
    mode_why: str = ""  # mode "auto": what it chose and why (one line); a replayed acceptance says so; else ""
    stop_reason: str = ""  # "eog", "stop", "length", "context", "interrupted"; "" while running or abandoned
    tokens: list[int] = field(default_factory=list)  # generated ids (an end-of-generation token not included)
    n_layer: int = 0
    step_tokens: list[int] = field(default_factory=list)  # eagle, eagle2, tree-exit: tokens each decoding step returned
    layers_run: list[int] = field(default_factory=list)  # early-exit, tree-exit: layers each decoded token's pass ran

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def prompt_tokens_per_second(self) -> float:
        return 1e3 * self.n_prompt / self.t_prompt_ms if self.t_prompt_ms > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first generated token comes from the prompt's logits: decode time covers the rest
        n = self.n_generated - 1
        return 1e3 * n / self.t_decode_ms if n > 0 and self.t_decode_ms > 0 else 0.0

    def update(self, runtime: dict[str, float]) -> None:
        """Take the runtime's stats (`_core.Generator.stats()`)."""
        for name, value in runtime.items():
            setattr(self, name, value)


def chat_apply_template(template: str, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The text of chat messages rendered with a template, by name ("chatml", "llama2", ...; `Model.chat_template()`
    gives a model's), special tokens as their text (tokenize it with parse_special=True); add_generation_prompt: end
    with the assistant's prefix, ready for its reply. ValueError for an unknown template or a bad conversation."""
    try:
        return _core.chat_apply_template(template, list(messages), add_generation_prompt)
    except _core.SpecEEError as e:
        raise ValueError(str(e)) from None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of text that could be the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class StopText:
    """Generated tokens' bytes as text, given out as it completes: UTF-8 sequences split over tokens are kept until
    whole, and text that could begin a stop string until it cannot; a stop string ends the text (not included)."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = list(stop)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.sent = "", 0
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """The text that is ready after one more token's bytes ("" once a stop string was found)."""
        if self.stopped:
            return ""
        self.text += self.decoder.decode(piece)
        sent = self.sent
        hit = min((i for i in (self.text.find(s, max(0, sent - len(s))) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            self.sent = max(hit, sent)
            return self.text[sent:hit] if hit > sent else ""
        ready = len(self.text) - _held_back(self.text, self.stop)
        if ready > sent:
            self.sent = ready
            return self.text[sent:ready]
        return ""

    def finish(self) -> str:
        """What was held back, at the end of a generation that no stop string ended."""
        if self.stopped:
            return ""
        self.text += self.decoder.decode(b"", final=True)
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        return rest


def stream_text(piece_of: Callable[[int], bytes], ids: Iterator[int], stop: Sequence[str],
                stats: GenerationStats) -> Iterator[str]:
    """Generated token ids as text, yielded as it completes (piece_of: a token's bytes, `Model.token_to_piece`);
    `stop` strings end generation (not included)."""
    out = StopText(stop)
    try:
        for tok in ids:
            piece = out.push(piece_of(tok))
            if piece:
                yield piece
            if out.stopped:
                stats.stop_reason = "stop"
                break
    finally:
        close = getattr(ids, "close", None)
        if close is not None:
            close()
    if stats.stop_reason in ("length", "context", "eog"):
        rest = out.finish()
        if rest:
            yield rest
