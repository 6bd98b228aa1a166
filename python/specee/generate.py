"""Text generation: prompts and chat messages in, tokens and text out, streamed.

A thin layer over the runtime's generator (csrc/specee-generate.cpp), which holds the decoding policy for every
mode, the same one `specee-cli` runs: plain decoding, EAGLE-1 / EAGLE-2 speculative decoding (lossless) and SpecEE
early exit (greedy, lossy). The options of a call are one dataclass, `GenerateOptions`; `Model.generate`,
`Model.stream` and `Model.generate_tokens` take its fields as keywords.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence, Union

import numpy as np

from specee import _core

if TYPE_CHECKING:
    from specee.model import Model

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}
Prompt = Union[str, Sequence[Message]]
MODES = ("auto", "plain", "eagle", "eagle2", "early-exit")


@dataclass
class EagleParams:
    """EAGLE trees. eagle: `choices`, child-rank paths such as [[0], [1], [0, 0]] (or their text) or the preset
    "mc_sim_7b_63". eagle2: the best `total_tokens` of a tree grown `topk` by `topk`, `depth` deep. None: the
    runtime's defaults, from the cost of a verification pass on the model's layers: three draft tokens ([[0], [1],
    [0, 0]]; 3/2/2) where the CPU's layer matrices are repacked (e.g. Q4_0), else one (see the README)."""

    choices: str | Sequence[Sequence[int]] | None = None
    total_tokens: int | None = None
    depth: int | None = None
    topk: int | None = None

    def __post_init__(self) -> None:
        for name in ("total_tokens", "depth", "topk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"eagle {name} must be >= 1 (None: the runtime's default), not {getattr(self, name)}")
        if self.choices is not None and not isinstance(self.choices, str):
            self.choices = str([[int(r) for r in path] for path in self.choices])


@dataclass
class ExitParams:
    """SpecEE early exit. threshold: a predictor fires above it; layers: the static schedule (block indices);
    None: the model file's (specee.exit.threshold / specee.exit.layers). dynamic: also check e-2, e, e+2 around the
    last 5 exit layers. kv: what the skipped layers' cache holds for an exited token, "mask" (nothing; SpecEE's) or
    "fill" (K/V from the exit layer's output). replay: benchmarks and tests: token i exits after block
    replay[i % len(replay)] whatever the predictors say."""

    threshold: float | None = None
    layers: Sequence[int] | None = None
    dynamic: bool = True
    kv: str = "mask"
    replay: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.kv not in ("mask", "fill"):
            raise ValueError(f"exit kv must be 'mask' or 'fill', not {self.kv!r}")


@dataclass
class GenerateOptions:
    """Everything a generation call takes besides the prompt and max_tokens.

    mode: "plain", "eagle", "eagle2", "early-exit" or "auto": early-exit with a draft head and exit predictors at
    temp 0 (SpecEE's behaviour), eagle2 with a draft head, else plain. Sampling: llama.cpp's chain and defaults
    (temp <= 0: greedy; seed None or -1: random); ignore_eos: end-of-generation tokens are never sampled. eagle and
    exit: the trees and the early-exit settings. stop: strings that end generation (not included). chat_template:
    for message prompts, a name instead of the model's own."""

    mode: str = "auto"
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    eagle: EagleParams = field(default_factory=EagleParams)
    exit: ExitParams = field(default_factory=ExitParams)
    stop: Sequence[str] = ()
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.seed is not None and not -1 <= self.seed <= 2**32 - 1:
            raise ValueError(f"seed must be None or -1 (random) or in 0..2**32-1, not {self.seed}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)


@dataclass
class GenerationStats:
    """What the last generation call did."""

    mode: str = ""
    n_prompt_tokens: int = 0  # evaluated for the prompt
    n_reused: int = 0  # prompt tokens found in the KV cache (kept from an earlier call)
    n_generated: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""  # "eog", "stop", "length", "context", "interrupted"; "" while running or abandoned
    tokens: list[int] = field(default_factory=list)
    n_layer: int = 0
    # eagle, eagle2: draft-and-verify steps, the tokens each returned, draft tokens verified and accepted, and
    # where the time went
    n_steps: int = 0
    step_tokens: list[int] = field(default_factory=list)
    n_drafted: int = 0
    n_accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # early-exit: the layers each decoded token ran (n_layer: it did not exit; the first token comes from the
    # prompt's pass and is not counted)
    layers_run: list[int] = field(default_factory=list)

    @property
    def exit_ratio(self) -> float:
        """Share of decoded tokens that left before the last layer."""
        n = len(self.layers_run)
        return sum(r < self.n_layer for r in self.layers_run) / n if n else 0.0

    @property
    def mean_layers_run(self) -> float:
        """Mean layers a decoded token ran (SpecEE's "average exit layer"; n_layer when none exited)."""
        return sum(self.layers_run) / len(self.layers_run) if self.layers_run else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per speculative step, the accepted draft tokens plus the target's own (EAGLE's acceptance
        length; 1.0 means no draft token was accepted). 0 without speculative decoding."""
        return sum(self.step_tokens) / self.n_steps if self.n_steps else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.n_prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first generated token comes from the prompt's logits: decode time covers the rest
        n = self.n_generated - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def chat_template_name(model: Model, chat_template: str | None = None) -> str:
    """The template to render messages with: a name given by the caller, else the GGUF's own template."""
    try:
        return _core.chat_template_resolve(model._model, chat_template)
    except _core.SpecEEError as e:
        raise ValueError(str(e)) from None


def prompt_tokens(model: Model, prompt: Prompt, chat_template: str | None = None) -> list[int]:
    """Token ids of a plain prompt, or of chat messages rendered with the chat template."""
    if isinstance(prompt, str):
        return model.tokenize(prompt, add_special=True, parse_special=False)
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    try:
        return _core.chat_tokenize(model._model, chat_template, messages, True)
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


def generate_tokens(model: Model, tokens: Sequence[int], max_tokens: int, opts: GenerateOptions,
                    stats: GenerationStats) -> Iterator[int]:
    """Token ids generated after the prompt's `tokens`: up to max_tokens (an end-of-generation token ends the run
    and is not yielded). The KV cache keeps what it holds of `tokens` from the model's earlier calls. A newer
    generation on the same model makes this iterator stale: resuming it raises RuntimeError."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("empty prompt")
    gen, me = model._start_generation(opts)
    stats.n_layer = model.n_layer
    stats.mode = gen.mode

    def step(fn, *args):
        if model._generation != me:
            raise RuntimeError("this generation was superseded by a later call on the same Model; its state is gone")
        with model._lock:
            return fn(*args)

    gen.reset_stats()
    step(gen.start, np.asarray(tokens, dtype=np.int32))
    first = True  # the first token comes from the prompt's pass
    try:
        while stats.n_generated < max_tokens:
            toks, runs = step(gen.next, max_tokens - stats.n_generated)
            if not toks:
                stats.stop_reason = "context"
                return
            if not first and stats.mode in ("eagle", "eagle2"):
                stats.step_tokens.append(len(toks))
            if not first and stats.mode == "early-exit":
                stats.layers_run += runs
            first = False
            for tok in toks:
                if model.is_eog(tok):
                    stats.stop_reason = "eog"
                    return
                stats.n_generated += 1
                stats.tokens.append(tok)
                yield tok
        stats.stop_reason = "length"
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
        raise
    finally:
        st = gen.stats()
        stats.n_prompt_tokens, stats.n_reused = st["n_prompt"], st["n_reused"]
        stats.prompt_seconds, stats.decode_seconds = st["t_prompt_ms"] / 1e3, st["t_decode_ms"] / 1e3
        if stats.mode in ("eagle", "eagle2"):
            stats.n_steps, stats.n_drafted, stats.n_accepted = st["n_passes"], st["n_drafted"], st["n_accepted"]
            stats.draft_seconds, stats.verify_seconds = st["t_draft_ms"] / 1e3, st["t_verify_ms"] / 1e3


def stream_text(model: Model, tokens: list[int], max_tokens: int, opts: GenerateOptions,
                stats: GenerationStats) -> Iterator[str]:
    """generate_tokens as text, yielded as it completes; opts.stop strings end generation (not included)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, sent = "", 0
    ids = generate_tokens(model, tokens, max_tokens, opts, stats)
    try:
        for tok in ids:
            text += decoder.decode(model.token_to_piece(tok))
            hit = min((i for i in (text.find(s, max(0, sent - len(s))) for s in opts.stop) if i >= 0), default=-1)
            if hit >= 0:
                if hit > sent:
                    yield text[sent:hit]
                stats.stop_reason = "stop"
                break
            ready = len(text) - _held_back(text, opts.stop)
            if ready > sent:
                yield text[sent:ready]
                sent = ready
    finally:
        ids.close()
    if stats.stop_reason in ("length", "context", "eog"):
        text += decoder.decode(b"", final=True)
        if len(text) > sent:
            yield text[sent:]


def embed(model: Model, text: str, normalize: bool = True) -> np.ndarray:
    """Mean of the final-norm hidden states over the text's tokens (unit length when normalize)."""
    tokens = model.tokenize(text, add_special=True)
    if not tokens:
        raise ValueError("cannot embed empty text")
    model.kv_clear()
    states = []
    for i in range(0, len(tokens), model.n_batch):
        model.eval(tokens[i : i + model.n_batch], logits=False)
        states.append(model.norm())
    model.kv_clear()
    vec = np.concatenate(states).mean(axis=0)
    if normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec.astype(np.float32)
