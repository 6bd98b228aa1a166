"""The Python model API over the native runtime (specee._core).

`Model` owns one loaded GGUF and one context (KV cache). This module exposes the token-level
runtime: evaluation of token ids (all layers or a layer range), logits, hidden states, and the
KV-cache operations that speculative decoding and early exit build on. The text-level API
(tokenize, generate, stream) is added on top of the same class.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

from specee import _core
from specee.generate import (
    ExitParams,
    GenerationStats,
    Prompt,
    SamplingParams,
    SpeculativeParams,
    embed,
    generate_tokens,
    prompt_tokens,
    stream_tokens,
)
from specee.paths import default_draft_head_path, default_model_path


def _default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def _speculative(
    mode: str | None,
    choices: str | Sequence[Sequence[int]] | None,
    total_tokens: int | None,
    depth: int | None,
    top_k: int | None,
) -> SpeculativeParams | None:
    if mode is None:
        if any(v is not None for v in (choices, total_tokens, depth, top_k)):
            raise ValueError("the eagle_* tree settings need speculative='eagle' or 'eagle2'")
        return None
    if choices is not None and not isinstance(choices, str):
        choices = str([[int(r) for r in path] for path in choices])
    return SpeculativeParams(mode, choices, total_tokens, depth, top_k)


def _early_exit(on: bool, threshold: float | None, layers: Sequence[int] | None, kv: str) -> ExitParams | None:
    if not on:
        if threshold is not None or layers is not None or kv != "mask":
            raise ValueError("exit_threshold, exit_layers and exit_kv need early_exit=True")
        return None
    return ExitParams(threshold, [int(i) for i in layers] if layers is not None else None, kv=kv)


class Model:
    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        n_ctx: int = 0,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        use_mmap: bool = True,
        draft_head: str | os.PathLike | None = None,
        type_v: str | None = None,
    ) -> None:
        """draft_head: an EAGLE head in a GGUF of its own (replaces the model file's head, if any); "default":
        the shipped head and exit predictors trained for the embedded SmolLM2 (specee.paths).
        type_v: the V cache's type, "f16" or "f32" (attention then accumulates in F32 on one kernel path for
        every batch shape: a token's logits do not depend on the batch it is evaluated in, so speculative
        greedy output equals plain greedy output bit for bit). None: "f32" when the model has an EAGLE head
        (speculative decoding is then lossless by default), else "f16"."""
        if type_v not in (None, "f16", "f32"):
            raise ValueError(f"type_v must be 'f16' or 'f32', not {type_v!r}")
        self.path = str(path) if path is not None else default_model_path()
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"model file not found: {self.path}")
        threads = n_threads or _default_threads()
        self._model = _core.Model(self.path, use_mmap)
        if draft_head == "default":
            draft_head = default_draft_head_path()
        if draft_head is not None:
            self._model.load_eagle(str(draft_head))
        if type_v is None:
            type_v = "f32" if self._model.has_eagle else "f16"
        self.type_v = type_v
        self._ctx = _core.Context(self._model, n_ctx, n_batch, threads, n_threads_batch or threads,
                                  1 if type_v == "f32" else 0)
        self.last_stats = GenerationStats()

    # ---- model facts

    @property
    def n_layer(self) -> int:
        return self._model.n_layer

    @property
    def n_embd(self) -> int:
        return self._model.n_embd

    @property
    def n_ff(self) -> int:
        return self._model.n_ff

    @property
    def n_head(self) -> int:
        return self._model.n_head

    @property
    def n_head_kv(self) -> int:
        return self._model.n_head_kv

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def n_ctx_train(self) -> int:
        return self._model.n_ctx_train

    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def n_batch(self) -> int:
        """Most tokens evaluated in one graph (longer plain batches are split by eval)."""
        return self._ctx.n_batch

    @property
    def n_params(self) -> int:
        return self._model.n_params

    @property
    def size(self) -> int:
        """Bytes of weight data."""
        return self._model.size

    @property
    def desc(self) -> str:
        return self._model.desc

    @property
    def metadata(self) -> dict[str, str]:
        return self._model.metadata()

    @property
    def has_eagle(self) -> bool:
        """Whether an EAGLE draft head is loaded (merged into the file, or from `draft_head`)."""
        return self._model.has_eagle

    # ---- evaluation

    def eval(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        pos: Sequence[int] | np.ndarray | None = None,
        tree_mask: np.ndarray | None = None,
        output: str | Sequence[bool] | np.ndarray | None = None,
        layers: tuple[int, int] | None = None,
        hidden_all: bool = False,
        logits: bool = True,
    ) -> np.ndarray:
        """Evaluate a batch of token ids and return logits [n_outputs, n_vocab] (float32).

        pos: per-token positions (default: continue after the cache).
        tree_mask: [n, n] bool, tree_mask[i, j] when token i attends to batch token j (default causal).
        output: "last" (default), "all", or a per-token bool mask of the tokens that get logits.
        layers: (begin, end) to run only those layers; begin > 0 continues the previous batch.
        hidden_all: keep the hidden state after every evaluated layer (read with `hidden(il)`).
        logits: False stops at the final norm (no lm_head).
        """
        tok = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n = tok.shape[0]
        pos_arr = None if pos is None else np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)
        mask_arr = None if tree_mask is None else np.ascontiguousarray(tree_mask, dtype=np.uint8)
        if output is None or output == "last":
            out_arr = None
        elif isinstance(output, str):
            if output != "all":
                raise ValueError(f"output must be 'last', 'all' or a bool mask, not {output!r}")
            out_arr = np.ones(n, dtype=np.int8)
        else:
            out_arr = np.ascontiguousarray(output, dtype=np.int8).reshape(-1)
        begin, end = layers if layers is not None else (0, self.n_layer)
        flags = 0
        if hidden_all:
            flags |= _core.EVAL_HIDDEN_ALL
        if not logits:
            flags |= _core.EVAL_NO_LOGITS
        if flags == 0 and layers is None and tree_mask is None:
            return self._ctx.eval(tok, pos_arr, mask_arr, out_arr)
        return self._ctx.eval_layers(tok, pos_arr, mask_arr, out_arr, begin, end, flags)

    def hidden(self, layer: int = -1) -> np.ndarray:
        """Hidden state [n_tokens, n_embd] after `layer` for the last batch (-1: after the last evaluated)."""
        return self._ctx.hidden(layer)

    def norm(self) -> np.ndarray:
        """Final-norm output [n_tokens, n_embd] of the last batch (the lm_head input)."""
        return self._ctx.norm()

    # ---- KV cache

    def kv_clear(self) -> None:
        self._ctx.kv_clear()

    def kv_remove(self, p0: int, p1: int = -1) -> int:
        """Drop cached positions [p0, p1) (p1 < 0: to the end); returns the number of cells removed."""
        return self._ctx.kv_remove(p0, p1)

    def kv_remove_cells(self, cells: Sequence[int] | np.ndarray) -> int:
        return self._ctx.kv_remove_cells(np.ascontiguousarray(cells, dtype=np.int32).reshape(-1))

    def kv_batch_cells(self) -> np.ndarray:
        """KV cells given to the tokens of the last batch."""
        return self._ctx.kv_batch_cells()

    @property
    def kv_pos_max(self) -> int:
        return self._ctx.kv_pos_max()

    @property
    def kv_n_used(self) -> int:
        return self._ctx.kv_n_used()

    def kv_cell_pos(self, cell: int) -> int:
        return self._ctx.kv_cell_pos(cell)

    def kv_cell_valid(self, cell: int, layer: int) -> bool:
        return self._ctx.kv_cell_valid(cell, layer)

    # ---- text

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special: BOS/EOS as the vocabulary asks; parse_special: the text of
        special tokens ("<|im_start|>") becomes those tokens instead of plain text."""
        return self._model.tokenize(text, add_special, parse_special)

    def detokenize(
        self, tokens: Sequence[int] | np.ndarray, remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        """Text of token ids (invalid UTF-8 becomes U+FFFD). remove_special: drop the BOS/EOS the vocabulary
        adds; unparse_special: render control tokens as their text."""
        return self._model.detokenize([int(t) for t in tokens], remove_special, unparse_special)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (possibly part of a UTF-8 sequence); control tokens give b"" unless special."""
        return self._model.token_to_piece(token, special)

    @property
    def bos(self) -> int:
        """The BOS token id, -1 when the vocabulary has none."""
        return self._model.token_bos

    @property
    def eos(self) -> int:
        """The EOS token id, -1 when the vocabulary has none."""
        return self._model.token_eos

    def is_eog(self, token: int) -> bool:
        """Whether the token ends generation (eos, eot, <|im_end|>-like tokens)."""
        return self._model.token_is_eog(token)

    @property
    def eog_tokens(self) -> list[int]:
        """Every token id that ends generation."""
        return self._model.eog_tokens

    # ---- generation

    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        *,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        chat_template: str | None = None,
        speculative: str | None = None,
        eagle_choices: str | Sequence[Sequence[int]] | None = None,
        eagle_total_tokens: int | None = None,
        eagle_depth: int | None = None,
        eagle_topk: int | None = None,
        early_exit: bool = False,
        exit_threshold: float | None = None,
        exit_layers: Sequence[int] | None = None,
        exit_kv: str = "mask",
    ) -> Iterator[str]:
        """Generate from a prompt (str) or chat messages ([{"role", "content"}]), yielding text pieces.

        Starts from an empty cache. temperature <= 0 is greedy; `stop` strings end generation (not included);
        ignore_eos: end-of-generation tokens are never sampled (their logit is -inf), as llama.cpp's --ignore-eos.
        speculative: None (plain decoding), "eagle" (EAGLE-1 static tree: eagle_choices, a list of child-rank
        paths such as [[0], [1], [0, 0]] or the preset "mc_sim_7b_63") or "eagle2" (EAGLE-2 dynamic tree:
        eagle_total_tokens, eagle_depth, eagle_topk); needs an EAGLE head. Lossless: greedy output is the
        plain output, sampling keeps the distribution.
        early_exit: SpecEE early exit (greedy; needs an EAGLE head and exit predictors in the file): the layer
        predictors stop a token's pass early when the head's candidates agree; exit_threshold and exit_layers
        override the file's settings; exit_kv is what the skipped layers' cache holds for an exited token
        ("mask": nothing, later tokens do not see it there, SpecEE's way; "fill": K/V computed from the exit
        layer's output). Lossy by design (see the README's early-exit numbers); the layer each token left
        after is in last_stats.exit_layers.
        Statistics of the call are in `last_stats` once the iterator is exhausted.
        """
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed, ignore_eos=ignore_eos)
        spec = _speculative(speculative, eagle_choices, eagle_total_tokens, eagle_depth, eagle_topk)
        self.last_stats = GenerationStats()
        tokens = prompt_tokens(self, prompt, chat_template)
        ee = _early_exit(early_exit, exit_threshold, exit_layers, exit_kv)
        return stream_tokens(self, tokens, max_tokens, params, stop, self.last_stats, spec, ee)

    def generate_tokens(
        self,
        tokens: Sequence[int],
        max_tokens: int = 256,
        *,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        speculative: str | None = None,
        eagle_choices: str | Sequence[Sequence[int]] | None = None,
        eagle_total_tokens: int | None = None,
        eagle_depth: int | None = None,
        eagle_topk: int | None = None,
        early_exit: bool = False,
        exit_threshold: float | None = None,
        exit_layers: Sequence[int] | None = None,
        exit_kv: str = "mask",
    ) -> list[int]:
        """Token ids generated after the prompt's token ids (same settings as `stream`; no tokenizer needed)."""
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed, ignore_eos=ignore_eos)
        spec = _speculative(speculative, eagle_choices, eagle_total_tokens, eagle_depth, eagle_topk)
        self.last_stats = GenerationStats()
        ee = _early_exit(early_exit, exit_threshold, exit_layers, exit_kv)
        return list(generate_tokens(self, tokens, max_tokens, params, self.last_stats, spec, ee))

    def generate(self, prompt: Prompt, max_tokens: int = 256, **kwargs) -> str:
        """The whole text `stream` would yield (same arguments)."""
        return "".join(self.stream(prompt, max_tokens, **kwargs))

    def embed(self, text: str, normalize: bool = True) -> np.ndarray:
        """Pooled embedding [n_embd]: the mean final-norm hidden state over the text's tokens."""
        return embed(self, text, normalize)
