"""Text generation over the token-level runtime: prompts and chat messages in, text out, streamed.

Free functions on a `specee.Model`; the model's `generate`, `stream` and `embed` methods call these.
"""

from __future__ import annotations

import codecs
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence, Union

import numpy as np

from specee import _core

if TYPE_CHECKING:
    from specee.model import Model

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}
Prompt = Union[str, Sequence[Message]]


@dataclass
class SamplingParams:
    """llama.cpp's defaults; temperature <= 0 is greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    ignore_eos: bool = False  # end-of-generation tokens get a -inf logit: the run goes on to max_tokens


@dataclass
class SpeculativeParams:
    """EAGLE speculative decoding (lossless). mode "eagle": the static EAGLE-1 tree of `choices` (a list of
    child-rank paths, "[[0], [1], [0, 0]]", or the preset "mc_sim_7b_63"); "eagle2": the dynamic EAGLE-2
    tree (the best total_tokens of a tree grown top_k by top_k, depth deep). None: the runtime's defaults,
    sized for a CPU (one draft token: [[0]], and total_tokens = depth = top_k = 1; see the README)."""

    mode: str = "eagle2"
    choices: str | None = None
    total_tokens: int | None = None
    depth: int | None = None
    top_k: int | None = None

    def make(self, model: Model) -> _core.Spec:
        if self.mode not in ("eagle", "eagle2"):
            raise ValueError(f"speculative must be None, 'eagle' or 'eagle2', not {self.mode!r}")
        if self.mode == "eagle" and any(v is not None for v in (self.total_tokens, self.depth, self.top_k)):
            raise ValueError("eagle_total_tokens, eagle_depth and eagle_topk set the EAGLE-2 tree "
                             "(speculative='eagle2'); the EAGLE-1 tree comes from eagle_choices")
        if self.mode == "eagle2" and self.choices is not None:
            raise ValueError("eagle_choices sets the static EAGLE-1 tree (speculative='eagle'), not the dynamic one")
        d = _core.spec_default_params()
        tree = _core.SPEC_TREE_STATIC if self.mode == "eagle" else _core.SPEC_TREE_DYNAMIC
        return _core.Spec(
            model._ctx, tree, self.choices,
            d["total_tokens"] if self.total_tokens is None else self.total_tokens,
            d["depth"] if self.depth is None else self.depth,
            d["top_k"] if self.top_k is None else self.top_k,
        )


@dataclass
class ExitParams:
    """SpecEE early exit (greedy, lossy by design): the EAGLE head's candidates are checked by the per-layer
    predictors at the scheduled layers. None: the model file's settings (specee.exit.threshold/layers)."""

    threshold: float | None = None  # a predictor fires above this; >= 1 never exits
    layers: list[int] | None = None  # the static schedule
    dynamic: bool = True  # also check e-2, e, e+2 around each of the last 5 exit layers
    kv: str = "mask"  # the skipped layers' cache for an exited token: "mask" (SpecEE) or "fill" (K/V from the exit)


@dataclass
class GenerationStats:
    """What the last generate/stream call did."""

    n_prompt_tokens: int = 0
    n_generated: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""  # "eog", "stop", "length", "context"
    tokens: list[int] = field(default_factory=list)
    # speculative decoding: draft-and-verify steps, draft tokens verified and accepted, the tokens the steps
    # returned, and where their time went (draft head, verification passes)
    n_steps: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_step_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_tokens: list[int] = field(default_factory=list)  # tokens each speculative step returned
    # early exit: the layer each decoded token left the model after (n_layer - 1: it ran all layers); the
    # first generated token comes from the prompt pass and has none
    exit_layers: list[int] = field(default_factory=list)
    n_layer: int = 0

    @property
    def exit_ratio(self) -> float:
        """Share of early-exit decode steps that left before the last layer."""
        n = len(self.exit_layers)
        return sum(e < self.n_layer - 1 for e in self.exit_layers) / n if n else 0.0

    @property
    def mean_exit_layer(self) -> float:
        """Mean over early-exit decode steps of the layer they left after, counted from 1 (SpecEE's figure;
        n_layer when every token ran every layer)."""
        return sum(e + 1 for e in self.exit_layers) / len(self.exit_layers) if self.exit_layers else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per speculative step, the accepted draft tokens plus the target's own (EAGLE's acceptance
        length; 1.0 means no draft token was accepted). 0 without speculative decoding."""
        return self.n_step_tokens / self.n_steps if self.n_steps else 0.0

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
    if chat_template:
        name = _core.chat_template_detect(chat_template)
        if name is None:
            raise ValueError(f"unknown chat template {chat_template!r} (known: chatml, llama2, vicuna, llama3, zephyr)")
        return name
    text = model.metadata.get("tokenizer.chat_template", "")
    name = _core.chat_template_detect(text) if text else None
    if name is None:
        raise ValueError("the model has no recognised chat template; pass chat_template= (e.g. 'chatml')")
    return name


def prompt_tokens(model: Model, prompt: Prompt, chat_template: str | None = None) -> list[int]:
    """Token ids of a plain prompt, or of chat messages rendered with the chat template."""
    if isinstance(prompt, str):
        return model.tokenize(prompt, add_special=True, parse_special=False)
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    text = _core.chat_apply_template(chat_template_name(model, chat_template), messages, True)
    return model.tokenize(text, add_special=True, parse_special=True)


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of text that could be the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def generate_tokens(
    model: Model,
    tokens: Sequence[int],
    max_tokens: int,
    params: SamplingParams,
    stats: GenerationStats | None = None,
    speculative: SpeculativeParams | None = None,
    early_exit: ExitParams | None = None,
) -> Iterator[int]:
    """Prefill `tokens` into an empty cache, then yield up to max_tokens sampled token ids (an end-of-generation
    token ends the run and is not yielded). With `speculative`, the EAGLE head drafts and the model verifies
    several tokens per step: the same tokens when greedy, the same distribution when sampling."""
    stats = stats if stats is not None else GenerationStats()
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("empty prompt")
    if len(tokens) >= model.n_ctx:
        raise ValueError(f"the prompt has {len(tokens)} tokens, which does not fit the context of {model.n_ctx}")
    if early_exit is not None:
        if early_exit.kv not in ("mask", "fill"):
            raise ValueError(f"exit_kv must be 'mask' or 'fill', not {early_exit.kv!r}")
        if speculative is not None:
            raise ValueError("early exit and speculative decoding are separate modes: choose one")
        if params.temperature > 0:
            raise ValueError("early exit decodes greedily: use temperature=0")
        if not model.has_eagle:
            raise ValueError("early exit needs an EAGLE head for its candidates (merge one, or draft_head=)")
        speculative = SpeculativeParams("eagle2")
    spec = speculative.make(model) if speculative is not None else None
    stats.n_layer = model.n_layer
    sampler = _core.Sampler(
        params.temperature, params.top_k, params.top_p, params.min_p, params.repeat_penalty, params.repeat_last_n,
        params.seed,
    )
    if params.ignore_eos:
        for t in model.eog_tokens:
            sampler.set_logit_bias(t, -math.inf)
    for t in tokens:
        sampler.accept(t)
    model.kv_clear()
    stats.n_prompt_tokens = len(tokens)

    t0 = time.perf_counter()
    if spec is None:
        logits = model.eval(tokens)[-1]
        queue: list[int] = []
    else:
        queue = [spec.prefill(sampler, tokens)]  # the runtime adds the tokens it returns to the sampler's history
    stats.prompt_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    stats.stop_reason = "length"
    try:
        while stats.n_generated < max_tokens:
            if not queue:
                if spec is None:
                    queue = [sampler.sample(logits)]
                    sampler.accept(queue[0])
                elif early_exit is not None:
                    tok, layer = spec.step_exit(
                        sampler, -1.0 if early_exit.threshold is None else early_exit.threshold, early_exit.layers,
                        early_exit.dynamic, -1, _core.EXIT_KV_FILL if early_exit.kv == "fill" else _core.EXIT_KV_MASK)
                    queue = [tok]
                    stats.exit_layers.append(layer)
                else:
                    queue = spec.step(sampler, max_tokens - stats.n_generated)
                    stats.step_tokens.append(len(queue))
            tok = queue.pop(0)
            if model.is_eog(tok):
                stats.stop_reason = "eog"
                break
            stats.n_generated += 1
            stats.tokens.append(tok)
            yield tok
            if stats.n_generated >= max_tokens:
                break
            if queue:
                continue
            if model.kv_n_used >= model.n_ctx:
                stats.stop_reason = "context"
                break
            if spec is None:
                logits = model.eval([tok])[-1]
    finally:
        stats.decode_seconds = time.perf_counter() - t1
        if spec is not None and early_exit is None:
            st = spec.stats()
            stats.n_steps, stats.n_drafted, stats.n_accepted = st["n_steps"], st["n_drafted"], st["n_accepted"]
            stats.n_step_tokens = st["n_tokens"]
            stats.draft_seconds, stats.verify_seconds = st["t_draft_ms"] / 1e3, st["t_verify_ms"] / 1e3


def stream_tokens(
    model: Model,
    tokens: list[int],
    max_tokens: int,
    params: SamplingParams,
    stop: Sequence[str] = (),
    stats: GenerationStats | None = None,
    speculative: SpeculativeParams | None = None,
    early_exit: ExitParams | None = None,
) -> Iterator[str]:
    """generate_tokens as text, yielded as it completes; `stop` strings end generation (not included)."""
    stats = stats if stats is not None else GenerationStats()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, sent = "", 0
    ids = generate_tokens(model, tokens, max_tokens, params, stats, speculative, early_exit)
    try:
        for tok in ids:
            text += decoder.decode(model.token_to_piece(tok))
            hit = min((i for i in (text.find(s, max(0, sent - len(s))) for s in stop) if i >= 0), default=-1)
            if hit >= 0:
                if hit > sent:
                    yield text[sent:hit]
                stats.stop_reason = "stop"
                break
            ready = len(text) - _held_back(text, stop)
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
