"""Several requests decoded together on one model's context: the runtime's parallel slots (csrc/serve/specee-slots.cpp).

Each slot is a sequence of the KV cache. One `step()` is one pass of the model over the next token of every plain
request that is decoding, the draft tree of every EAGLE request (eagle, eagle2) and a chunk of the prompts waiting to
be prefilled; requests join (`submit`) and leave (`release`) between passes. Early-exit and tree-exit requests run
their sequence alone after the shared pass. Every request's output is what it gives alone. `step()` releases the GIL:
a server thread can step while others submit and read. Slots made by a Model refuse every use once the Model is
closed (ValueError "Model is closed"), as the Model does; `close()` ends them sooner.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specee import _core
from specee.generate import GenerateOptions
from specee.pooling import pooling_id

# why a request finished, by the runtime's enum specee_finish
FINISH_REASONS = {
    _core.FINISH_NONE: None,
    _core.FINISH_STOP: "stop",
    _core.FINISH_LENGTH: "length",
    _core.FINISH_CONTEXT: "context",
    _core.FINISH_ERROR: "error",
}


INT32_MAX = 2**31 - 1


def token_limit(max_tokens: int) -> int:
    """The one rule for how many tokens a generation may make (`Model.generate`, `stream`, `generate_tokens`,
    `generate_batch`, `Slots.submit`; the server's max_tokens and n_predict read the same way): an integer >= 0 is the
    most, -1 is no limit of its own (OpenAI's and llama.cpp's: until an end-of-generation token or a full context).
    Another negative is a ValueError, a value that is not an integer (bool included) a TypeError."""
    if isinstance(max_tokens, bool):
        raise TypeError("max_tokens must be an integer, not bool")
    n = operator.index(max_tokens)  # TypeError for what is not an integer
    if n < -1:
        raise ValueError(f"max_tokens must be -1 (until the end of text or a full context) or >= 0, not {n}")
    return n


class Closed:
    """What a closed handle holds instead of its native object: any use raises ValueError(why)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __getattr__(self, name: str):
        raise ValueError(self.why)


@dataclass
class SlotOutput:
    """What `Slots.read` returns: the tokens generated since the last read, the layers each one's pass ran, and,
    once every token is read, why the request finished ("stop": an end-of-generation token, not included;
    "length": max_tokens; "context": the slot's share of the context is full; "error": see `error`). With a
    request's n_probs >= 0, `logprobs` holds per token a list of (token, log-probability) under the model's
    distribution at its step (log-softmax of the logits): the token itself first, then the n_probs most likely."""

    tokens: list[int] = field(default_factory=list)
    layers_run: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str = ""
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class Slots:
    """n_slots parallel slots on a model's context (make them with `Model.slots`). Slot i decodes KV sequence i + 1;
    the model's own single-sequence calls use sequence 0, and `Model.kv_clear` clears every sequence. Each slot may
    use n_ctx // n_slots cells. Once closed (`close()`, or the Model's close) every use raises ValueError."""

    def __init__(self, ctx: _core.Context, n_slots: int, n_chunk: int = 0) -> None:
        self._slots: _core.Slots | Closed = _core.Slots(ctx, n_slots, n_chunk)

    def close(self, why: str = "Slots are closed") -> None:
        """Free the native slots now (their sequences' cache cells with them); any later use raises ValueError(why).
        The Model's close() closes its slots with "Model is closed"."""
        if not isinstance(self._slots, Closed):
            self._slots = Closed(why)

    @property
    def closed(self) -> bool:
        return isinstance(self._slots, Closed)

    def __enter__(self) -> Slots:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def n_slots(self) -> int:
        return self._slots.n_slots

    @property
    def n_ctx_slot(self) -> int:
        """Cells a slot may use; a prompt must be shorter."""
        return self._slots.n_ctx_slot

    @property
    def n_busy(self) -> int:
        """Slots holding a request (running, or finished and not released)."""
        return self._slots.n_busy

    def submit(self, tokens: Sequence[int], max_tokens: int = -1, n_probs: int = -1, slot: int | None = None,
               **options) -> int | None:
        """Start a request: generate up to max_tokens (-1: until an end-of-generation token or the slot's context is
        full; `token_limit`) after the prompt's
        token ids, with the options of `Model.stream` (stop strings and chat templates are the caller's); n_probs
        >= 0 (mode plain, at most `_core.MAX_PROBS`): each token's log-probability and the n_probs most likely
        tokens' (`SlotOutput.logprobs`); slot: on that slot (see `submit_options`). Returns its slot, or None when
        every slot (or the slot asked for) holds a request. SpecEEError on a bad prompt (one of n_ctx_slot tokens or
        more) or options."""
        return self.submit_options(tokens, GenerateOptions(**options), max_tokens, n_probs, slot)

    def submit_options(self, tokens: Sequence[int], options: GenerateOptions, max_tokens: int = -1,
                       n_probs: int = -1, slot: int | None = None) -> int | None:
        """`submit` with the options made already (and so checked): they go to the runtime as they are. slot: on
        that slot (llama.cpp's id_slot; None when it holds a request) instead of the free slot whose cache holds the
        longest prefix of the prompt."""
        n = min(token_limit(max_tokens), INT32_MAX)
        got = self._slots.submit(np.asarray(tokens, dtype=np.int32), options, n, n_probs, -1 if slot is None else slot)
        return None if got == _core.SLOTS_BUSY else got

    def set_unified(self, unified: bool = True) -> None:
        """llama.cpp's --kv-unified: every slot may use the whole context (n_ctx_slot becomes n_ctx), a request's
        submit drops the idle slots' caches, and a pass that the running requests together overflow fails
        (SpecEEError "context overflow"). Before the first request."""
        self._slots.set_unified(unified)

    def n_past(self, slot: int) -> int:
        """Prompt tokens of the slot's request in its cache: the prefix reused, then after each prefilled chunk."""
        return self._slots.n_past(slot)

    def save(self, slot: int, path: str) -> int:
        """Write a free slot's cache (its tokens and their K/V) to the file `path`; returns how many tokens. SpecEEError
        when the slot holds a request or the file cannot be written."""
        return self._slots.cache("save", slot, path)

    def restore(self, slot: int, path: str) -> int:
        """Replace a free slot's cache with what `save` wrote to `path` (the same model and cache types); returns how
        many tokens. Its next request reuses them as a cached prefix. SpecEEError on a bad or foreign file."""
        return self._slots.cache("restore", slot, path)

    def erase(self, slot: int) -> int:
        """Drop a free slot's cache; returns how many tokens it held."""
        return self._slots.cache("erase", slot)

    def save_mem(self, slot: int) -> bytes:
        """A free slot's cache as bytes in memory (the file `save` writes): what the server's prompt cache keeps."""
        return self._slots.save_mem(slot)

    def restore_mem(self, slot: int, data: bytes) -> int:
        """Replace a free slot's cache with bytes `save_mem` returned; returns how many tokens."""
        return self._slots.restore_mem(slot, data)

    def cache_tokens(self, slot: int) -> list[int]:
        """The tokens a slot's cache holds, in position order."""
        return self._slots.cache_tokens(slot)

    def choose(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(the slot `submit` would give this prompt now, the prefix its cache holds); None when every slot is busy."""
        return self._slots.choose(np.asarray(tokens, dtype=np.int32))

    def step(self) -> int:
        """One pass; returns how many slots are still running."""
        return self._slots.step()

    def read(self, slot: int) -> SlotOutput:
        toks, layers, finish, error, logprobs = self._slots.read(slot)
        return SlotOutput(toks, layers, FINISH_REASONS[finish], error, logprobs)

    def set_post_sampling_probs(self, slot: int, on: bool = True) -> None:
        """llama.cpp's post_sampling_probs for the slot's request (after its submit, with n_probs >= 0): each token's
        probabilities are those of the distribution it was drawn from, after top-k / top-p / min-p and temperature
        (certain for a greedy draw), with fewer alternatives where fewer were kept; its grammar's forced tokens are then
        sampled one by one. Off: the model's (log-softmax of the logits)."""
        self._slots.set_post_sampling_probs(slot, on)

    def release(self, slot: int) -> None:
        """End the slot's request, finished or not: the slot is free at once (its cache is kept for a prompt that
        begins the same way)."""
        self._slots.release(slot)

    def set_context_shift(self, enable: bool, n_keep: int = 0) -> None:
        """llama.cpp's context shift from now on: a request (mode plain, ngram or draft) whose generation fills its
        slot goes on, its first n_keep tokens kept (< 0: the whole prompt) and half of the rest dropped, the cached K
        after them turned to their new positions; off (the default): it ends ("context")."""
        self._slots.set_context_shift(enable, n_keep)

    def n_shifted(self, slot: int) -> int:
        """How often the slot's request was shifted (llama.cpp's `truncated`)."""
        return self._slots.n_shifted(slot)

    def mode(self, slot: int) -> str:
        """The decoding mode of the slot's request (auto resolved)."""
        return self._slots.mode(slot)

    def stats(self, slot: int) -> dict[str, float]:
        """The runtime's stats of the slot's request (the fields of `specee_generator_stats`)."""
        return self._slots.stats(slot)

    def totals(self) -> dict[str, float]:
        """Requests, tokens and passes since the slots were made (`specee_slots_totals`)."""
        return self._slots.totals()

    def embed(self, tokens: Sequence[int], pooling: str | None = None) -> np.ndarray:
        """The tokens' final-norm rows pooled (specee.pooling; None: the model's own), not normalised: [n_embd];
        [labels] for "rank" ([1] without a classifier head); [n_tokens, n_embd] for "none". Evaluated between passes
        on a sequence of its own."""
        return self._slots.embed(np.asarray(tokens, dtype=np.int32), pooling_id(pooling))

