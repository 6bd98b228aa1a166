"""The Python model API over the native runtime (specee._core).

`Model` owns one loaded GGUF and one context (KV cache). This module exposes the token-level
runtime: evaluation of token ids (all layers or a layer range), logits, hidden states, and the
KV-cache operations that speculative decoding and early exit build on. The text-level API
(tokenize, generate, stream) is added on top of the same class.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import Iterator, Sequence

import numpy as np

from specee import _core
from specee.context_options import CONTEXT_OPTIONS, context_options
from specee.generate import MODES, GenerateOptions, GenerationStats, Prompt, stream_text
from specee.paths import default_draft_head_path, default_model_path
from specee.pooling import pooling_id, pooling_name
from specee.slots import INT32_MAX, Closed, Slots, token_limit

EMBED_MAX_TEXTS = 4096  # texts in one Model.embed call (each is a pass of the model: minutes on a CPU)
EMBED_CHUNK = 32  # texts per call of the runtime: the model's lock is let go between chunks


def devices() -> list[tuple[str, str, int, int]]:
    """The devices this runtime sees, the CPU and the GPUs and RPC servers layers can go to: (name, description, free
    bytes, total bytes), named as `Model(devices=...)` takes them ("CUDA0", "RPC0")."""
    return [(name, desc, free, total) for name, desc, free, total in _core.devices()]


# what a closed Model holds instead of its native model and context: any use says so
_CLOSED = Closed("Model is closed")

# the roles a chat message may have (OpenAI's chat roles); others are refused with ValueError naming these
CHAT_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")


def _prompt_text(text: str | bytes | bytearray, what: str = "prompt") -> str:
    """`text` as a str the runtime can take: bytes decoded as UTF-8 (UnicodeDecodeError, with the position, when they
    are not), and no lone surrogates (UnicodeEncodeError naming the first one's position); TypeError otherwise."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    if not isinstance(text, str):
        raise TypeError(f"the {what} must be str, bytes or chat messages, not {type(text).__name__}")
    text.encode("utf-8")  # raises UnicodeEncodeError at the first lone surrogate, with its position
    return text


class Model:
    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        n_ctx: int | None = None,
        n_batch: int | None = None,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        use_mmap: bool | None = None,
        draft_head: str | os.PathLike | None = None,
        type_v: str | None = None,
        n_gpu_layers: int | None = None,
        offload_order: str | None = None,
        devices: Sequence[str] | None = None,
        rpc_servers: Sequence[str] | None = None,
        tensor_split: Sequence[float] | None = None,
        ngram_cache: int | None = None,
        draft_model: str | os.PathLike | None = None,
        n_gpu_layers_draft: int | None = None,
        lora: Sequence[str | os.PathLike] | None = None,
        lora_scaled: Sequence[tuple[str | os.PathLike, float] | str] | None = None,
        lora_init_without_apply: bool | None = None,
        kernels: str | None = None,
    ) -> None:
        """The keywords are the runtime's context options (specee.context_options.CONTEXT_OPTIONS, the CLI's
        -c -b -ub -t -tb --no-mmap --draft-head -ctv -ngl --offload-order -dev --rpc -ts); None: the table's default.
        The runtime checks each value (ValueError with its message).
        draft_head: a draft head file (an EAGLE head and optionally exit predictors; they replace the model file's
        own, and `placement` notes what was replaced); "default": the shipped draft head file trained for the
        embedded SmolLM2 (specee.paths).
        type_v: the V cache's type, "f32" (default: attention accumulates in F32 on one kernel path for every batch
        shape, so a token's logits do not depend on the batch it is evaluated in and speculative greedy output
        equals plain greedy output bit for bit) or "f16" (half the memory).
        Placement: n_gpu_layers layers (counting the output as one; -1: all) go to the devices other than the CPU,
        in offload_order "first" (SpecEE's: the first layers, the output and the draft head), "last" (llama.cpp's)
        or "auto" (first when there are exit predictors); devices: their names (default: every GPU and RPC server);
        rpc_servers: "HOST:PORT" of ggml RPC servers (specee-rpc-server), added as devices once each answers a check
        within 5 s (SpecEEError naming the server otherwise; a server's token comes from the environment variable
        SPECEE_RPC_TOKEN); tensor_split: each device's share of the offloaded layers. Where everything went:
        `placement`.
        n_ctx: KV cache cells; 0 (default): the file's training context, at most 4096 (ask for more explicitly). A
        context whose KV cache and compute buffers would not fit in the available memory is refused (SpecEEError
        with the sizes). n_batch, n_ubatch: llama.cpp's logical and physical batches (2048, 512): a graph holds at
        most the smaller. n_threads, n_threads_batch: None or <= 0: the CPUs this process may use; at most
        `_core.max_threads()` (the CPUs this process may use: more threads than CPUs wait on each other at every
        step), more are clamped with a warning.
        ngram_cache: tokens of earlier calls (their prompts and outputs, whatever their mode) kept for n-gram lookup's
        drafts, the oldest calls evicted (default 65536; 0: off): the same prompt asked again drafts what was
        answered before; `last_stats.n_cache_drafted` / `n_cache_accepted` count those drafts.
        draft_model: a draft model with the model's vocabulary (llama.cpp's -md), loaded beside it with a context of
        its own: mode "draft" (auto's choice then) drafts with it (GenerateOptions.draft); n_gpu_layers_draft: its
        n_gpu_layers.
        lora: LoRA adapter files (GGUF, `python -m specee.convert lora`) applied at scale 1; lora_scaled: (file,
        scale) pairs or "FILE:SCALE" texts, after them (llama.cpp's --lora / --lora-scaled); lora_init_without_apply:
        loaded at scale 0. `lora_adapters` lists them, `set_lora` changes the scales (csrc/context/specee-lora.h).
        kernels: the matmul kernels for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights on the CPU, "auto" (default),
        "portable" or "off" (ggml's mul_mat); the logits are the same bit for bit whichever (docs/kernels.md)."""
        self.path = str(path) if path is not None else default_model_path()
        self.draft_model = os.fspath(draft_model) if draft_model else None  # the draft model's file, or None
        if draft_head == "default":
            draft_head = default_draft_head_path()
        options = context_options(dict(
            model=self.path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
            n_threads_batch=n_threads_batch, use_mmap=use_mmap, draft_head=os.fspath(draft_head) if draft_head else None,
            type_v=type_v, n_gpu_layers=n_gpu_layers, offload_order=offload_order, devices=devices,
            rpc_servers=rpc_servers, tensor_split=tensor_split, ngram_cache=ngram_cache,
            draft_model=os.fspath(draft_model) if draft_model else None, n_gpu_layers_draft=n_gpu_layers_draft,
            lora=[os.fspath(p) for p in lora] if lora else None,
            lora_scaled=[x if isinstance(x, str) else f"{os.fspath(x[0])}:{float(x[1])!r}" for x in lora_scaled]
            if lora_scaled else None,
            lora_init_without_apply=lora_init_without_apply, kernels=kernels))
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"{self.path} is a directory, not a GGUF model file")
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"model file not found: {self.path}")
        for value in (n_threads, n_threads_batch):
            if value is not None and value > _core.max_threads():
                warnings.warn(f"{value} threads are more than the {_core.max_threads()} CPU(s) this process may use: "
                              f"using {_core.max_threads()}", stacklevel=2)
        self._model = _core.Model(options)
        self.type_v = type_v or CONTEXT_OPTIONS["type_v"]["default"]
        self._ctx = _core.Context(self._model, options)
        self._gen: _core.Generator | None = None
        self._generation = 0  # bumped by every generation call; older iterators are stale
        self._lock = threading.RLock()  # one generation step, or one whole generate(), at a time
        self._slots: weakref.WeakSet[Slots] = weakref.WeakSet()  # closed with the model
        self.last_stats = GenerationStats()
        self.captured: dict[str, np.ndarray] = {}

    def close(self) -> None:
        """Free the native model, context and generator now (their devices' memory too; an RPC server's included)
        instead of when the object is collected; the model cannot be used afterwards, nor its slots."""
        with self._lock:
            # a closed Model holds _CLOSED: any later use raises ValueError("Model is closed"); streams and slots too
            for slots in list(self._slots):
                slots.close("Model is closed")
            self._gen = None
            self._ctx = _CLOSED  # type: ignore[assignment]
            self._model = _CLOSED  # type: ignore[assignment]

    @property
    def closed(self) -> bool:
        return self._model is _CLOSED

    def _check_open(self) -> None:
        if self._model is _CLOSED:
            raise ValueError("Model is closed")

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
    def n_threads(self) -> int:
        """Threads for single-token decoding (after the clamp to `_core.max_threads()`)."""
        return self._ctx.n_threads

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV cache (every layer)."""
        return self._ctx.kv_nbytes

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
    def placement(self) -> str:
        """Where the weights went: one line per device (layers, output, draft head, MiB)."""
        return self._model.placement

    @property
    def lora_adapters(self) -> list[dict]:
        """The LoRA adapters, in order: {id, path, alpha, n_weights, scale} (scale: the one applied now)."""
        with self._lock:
            self._check_open()
            scales = self._ctx.lora_scales()
            return [dict(id=i, **a, scale=scales[i]) for i, a in enumerate(self._model.lora_adapters())]

    def set_lora(self, scales: Sequence[float]) -> None:
        """Apply the LoRA adapters at these scales, one per adapter in order (0: not applied). New scales clear the
        KV cache (its K/V were computed under the old ones)."""
        with self._lock:
            self._check_open()
            self._ctx.set_lora([float(s) for s in scales])

    @property
    def has_eagle(self) -> bool:
        """Whether an EAGLE draft head is loaded (merged into the file, or from `draft_head`)."""
        return self._model.has_eagle

    @property
    def draft_vocab(self) -> list[int] | None:
        """Target token ids of the draft head's output rows where it has a reduced draft vocabulary, else None
        (its logits are over the whole vocabulary)."""
        return self._model.eagle_draft_vocab

    @property
    def eagle_feature_layers(self) -> list[int]:
        """EAGLE-3: the target layers whose outputs make its draft head's feature, low to high (`features()` gives
        them); [] for an EAGLE-1 head or none."""
        return self._model.eagle_feature_layers

    @property
    def has_exit_predictors(self) -> bool:
        """Whether SpecEE's exit predictors are loaded (merged into the file, or from `draft_head`)."""
        return self._model.exit_n_pred > 0

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
        capture: Sequence[str] = (),
        seq_id: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Evaluate a batch of token ids and return logits [n_outputs, n_vocab] (float32).

        pos: per-token positions (default: continue after the cache).
        tree_mask: [n, n] bool, tree_mask[i, j] when token i attends to batch token j (default causal).
        output: "last" (default), "all", or a per-token bool mask of the tokens that get logits.
        layers: (begin, end) to run only those layers; begin > 0 continues the previous batch.
        hidden_all: keep the hidden state after every evaluated layer (read with `hidden(il)`).
        logits: False stops at the final norm (no lm_head).
        seq_id: per-token sequence ids, 0..63 (default: all 0): a token attends only to its own sequence's cells
        and batch tokens, and pos=None continues each sequence after its own last position.
        capture: names of graph nodes to keep ("l_out-12", "attn_norm-3", "result_norm"; every intermediate is
        named, see csrc/model/specee-graph.cpp): their values land in `self.captured` [rows, ne0]. Capturing costs time.
        """
        tok = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n = tok.shape[0]
        pos_arr = None if pos is None else np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)
        mask_arr = None if tree_mask is None else np.ascontiguousarray(tree_mask, dtype=np.uint8)
        seq_arr = None if seq_id is None else np.ascontiguousarray(seq_id, dtype=np.int32).reshape(-1)
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
        with self._lock:
            self._ctx.set_capture(list(capture))
            try:
                if flags == 0 and layers is None and tree_mask is None:
                    out = self._ctx.eval(tok, pos_arr, mask_arr, out_arr, seq_arr)
                else:
                    out = self._ctx.eval_layers(tok, pos_arr, mask_arr, out_arr, begin, end, flags, seq_id=seq_arr)
                self.captured = {name: self._ctx.get_capture(name) for name in capture}
            finally:
                if capture:
                    self._ctx.set_capture([])
        return out

    def hidden(self, layer: int = -1) -> np.ndarray:
        """Hidden state [n_tokens, n_embd] after `layer` for the last batch (-1: after the last evaluated; other
        layers than that one need hidden_all=True). SpecEEError when nothing was evaluated yet, when `layer` is not
        -1 or 0..n_layer-1 (no other negative index), or when that layer's state was not kept."""
        return self._ctx.hidden(layer)

    def norm(self) -> np.ndarray:
        """Final-norm output [n_tokens, n_embd] of the last batch (the lm_head input); SpecEEError when nothing was
        evaluated yet or the last batch did not run the last layer."""
        return self._ctx.norm()

    # ---- KV cache

    def kv_clear(self) -> None:
        self._ctx.kv_clear()

    def kv_remove(self, p0: int, p1: int = -1) -> int:
        """Drop cached positions [p0, p1) (p1 < 0: to the end); returns the number of cells removed."""
        return self._ctx.kv_remove(p0, p1)

    @property
    def kv_pos_max(self) -> int:
        return self._ctx.kv_pos_max()

    @property
    def kv_n_used(self) -> int:
        return self._ctx.kv_n_used()

    def ngram_cache_info(self) -> dict[str, int]:
        """The cross-request n-gram cache (option ngram_cache): capacity, n_tokens kept, n_entries of its index,
        n_docs (calls) kept, n_added since the model was made."""
        return self._ctx.ngram_cache_info()

    def ngram_cache_clear(self) -> None:
        """Forget the earlier calls' tokens (the next call drafts from its own sequence only)."""
        self._ctx.ngram_cache_clear()

    def grammar_check(self, grammar_type: int, text: str) -> None:
        """Compiles a grammar (enum specee_grammar_type, its text) for this model's vocabulary through the runtime's
        front door (specee.grammar.check says what it checks); SpecEEError when it does not compile or passes a limit.
        Releases the GIL while it compiles."""
        _core.grammar_check(self._model, grammar_type, text)

    # ---- text

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special: BOS/EOS as the vocabulary asks; parse_special: the text of
        special tokens ("<|im_start|>") becomes those tokens instead of plain text. bytes are decoded as UTF-8;
        text with a lone surrogate raises UnicodeEncodeError naming its position."""
        return self._model.tokenize(_prompt_text(text, "text"), add_special, parse_special)

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

    @property
    def fim_tokens(self) -> dict[str, int]:
        """The fill-in-the-middle tokens (csrc/include/specee.h): {"pre", "suf", "mid", "pad", "rep", "sep": token id},
        -1 where the vocabulary has none. Named by the file's tokenizer.ggml.fim_*_token_id keys, else found by their
        text (<|fim_prefix|>, <PRE>, ...) as llama.cpp finds them."""
        return self._model.fim_tokens

    # ---- chat

    def chat_template(self, name: str | None = None) -> str:
        """The template messages are rendered with: `name` when given (a template name, or a Jinja text with a known
        template's markers), else the GGUF's own. ValueError when it is not known."""
        self._check_open()
        try:
            return _core.chat_template_resolve(self._model, None if name is None else _prompt_text(name, "template"))
        except _core.SpecEEError as e:
            raise ValueError(str(e)) from None

    def prompt_tokens(self, prompt: Prompt, chat_template: str | None = None) -> list[int]:
        """Token ids of a plain prompt (BOS as the vocabulary asks), or of chat messages rendered with the chat
        template (`chat_template`, or the model's own) and ready for the assistant's reply. A message is a mapping
        with a "role" (one of CHAT_ROLES) and a "content" (str or UTF-8 bytes): ValueError or TypeError otherwise."""
        self._check_open()
        if isinstance(prompt, (str, bytes, bytearray)):
            return self.tokenize(prompt, add_special=True, parse_special=False)
        if isinstance(prompt, dict) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"the prompt must be str, bytes or a list of chat messages, not {type(prompt).__name__}")
        messages = []
        for i, m in enumerate(prompt):
            if not hasattr(m, "get") or "role" not in m or "content" not in m:
                raise TypeError(f"message {i} must be a mapping with a 'role' and a 'content'")
            role, content = m["role"], m["content"]
            if isinstance(role, (bytes, bytearray)):
                role = _prompt_text(role, "role")
            if not isinstance(role, str) or role not in CHAT_ROLES:
                raise ValueError(f"message {i}: the role must be one of {', '.join(CHAT_ROLES)}, not {role!r}")
            if not isinstance(content, (str, bytes, bytearray)):
                raise TypeError(f"message {i}: the content must be str or bytes, not {type(content).__name__}")
            messages.append({"role": role, "content": _prompt_text(content, "content")})
        try:
            # rendered, then tokenized as specee_chat_tokenize does (special tokens parsed), by the call that lets
            # other Python threads run while it works: a server's event loop, while a long chat is tokenized
            name = _core.chat_template_resolve(self._model, None if chat_template is None else
                                               _prompt_text(chat_template, "template"))
            text = _core.chat_apply_template(name, messages, True)
        except _core.SpecEEError as e:
            raise ValueError(str(e)) from None
        return self._model.tokenize(text, True, True)

    # ---- generation

    def _start_generation(self, opts: GenerateOptions) -> tuple[_core.Generator, int]:
        """The model's generator with these options (one per model, so that its draft head's cache and the KV cache
        stay in step for prompt-prefix reuse) and the number of this generation."""
        with self._lock:
            self._check_open()
            if self._gen is None:
                self._gen = _core.Generator(self._ctx, opts)
            else:
                self._gen.set_params(opts)
            self._generation += 1
            return self._gen, self._generation

    def _token_stream(self, tokens: Sequence[int], max_tokens: int, opts: GenerateOptions,
                      stats: GenerationStats) -> Iterator[int]:
        """Token ids generated after the prompt's `tokens`: up to max_tokens (-1: no limit but the context; an
        end-of-generation token ends the run and is not yielded). The KV cache keeps what it holds of `tokens` from the
        model's earlier calls. A newer generation on the same model makes this iterator stale: resuming it raises
        RuntimeError."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("empty prompt")
        limit = token_limit(max_tokens)
        gen, me = self._start_generation(opts)
        stats.n_layer, stats.mode, stats.mode_why = self.n_layer, gen.mode, gen.why

        def step(fn, *args):
            self._check_open()
            if self._generation != me:
                raise RuntimeError("this generation was superseded by a later call on the same Model; its state is gone")
            with self._lock:
                return fn(*args)

        gen.reset_stats()
        step(gen.start, np.asarray(tokens, dtype=np.int32))
        first = True  # the first token comes from the prompt's pass
        try:
            while limit < 0 or len(stats.tokens) < limit:
                toks, runs = step(gen.next, INT32_MAX if limit < 0 else min(limit - len(stats.tokens), INT32_MAX))
                if not toks:
                    stats.stop_reason = "context"
                    return
                if not first and MODES[stats.mode].tree:
                    stats.step_tokens.append(len(toks))
                if not first and MODES[stats.mode].exits:
                    stats.layers_run += runs
                first = False
                for tok in toks:
                    if self.is_eog(tok):
                        stats.stop_reason = "eog"
                        return
                    stats.tokens.append(tok)
                    yield tok
            stats.stop_reason = "length"
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
            raise
        finally:
            stats.update(gen.stats())

    def stream(self, prompt: Prompt, max_tokens: int = 256, **options) -> Iterator[str]:
        """Generate from a prompt (str, or UTF-8 bytes) or chat messages ([{"role", "content"}]), yielding text pieces:
        at most max_tokens tokens (-1: until the end of text or a full context; `specee.slots.token_limit`).

        options: the fields of specee.generate.GenerateOptions as keywords: mode ("auto", "plain", "eagle",
        "eagle2", "early-exit", "tree-exit"), temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, ignore_eos,
        eagle=EagleParams(...), exit=ExitParams(...), stop, chat_template. The KV cache keeps the longest prefix
        of the prompt it already holds (an earlier turn of the conversation), so only the rest is evaluated.
        Statistics are in `last_stats` once the iterator is exhausted; a later generation call makes this
        iterator stale (resuming it raises RuntimeError)."""
        token_limit(max_tokens)  # refused before anything runs
        opts = GenerateOptions(**options)
        self.last_stats = GenerationStats()
        tokens = self.prompt_tokens(prompt, opts.chat_template)
        ids = self._token_stream(tokens, max_tokens, opts, self.last_stats)
        return stream_text(self.token_to_piece, ids, opts.stop, self.last_stats)

    def generate_tokens(self, tokens: Sequence[int], max_tokens: int = 256, **options) -> list[int]:
        """Token ids generated after the prompt's token ids (options as for `stream`; no tokenizer needed)."""
        opts = GenerateOptions(**options)
        self.last_stats = GenerationStats()
        with self._lock:
            return list(self._token_stream(tokens, max_tokens, opts, self.last_stats))

    def generate(self, prompt: Prompt, max_tokens: int = 256, **options) -> str:
        """The whole text `stream` would yield (same arguments)."""
        with self._lock:
            return "".join(self.stream(prompt, max_tokens, **options))

    # ---- several sequences

    def slots(self, n_slots: int, n_chunk: int = 0) -> Slots:
        """n_slots parallel slots on this model's context, decoded together (continuous batching; see
        specee.slots.Slots). n_chunk: most prompt tokens prefilled in one pass (0: n_batch). They refuse every use
        once the model is closed."""
        with self._lock:
            self._check_open()
            slots = Slots(self._ctx, n_slots, n_chunk)
            self._slots.add(slots)
            return slots

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int = 256, **options) -> list[list[int]]:
        """Token ids generated after each prompt's token ids, every prompt on a slot of its own and decoded together
        in one batch per pass (options as for `stream`); each list is what `generate_tokens` gives for that prompt
        alone (max_tokens: as for `stream`)."""
        limit = token_limit(max_tokens)
        if not prompts:
            return []
        with self.slots(len(prompts)) as slots:
            ids = []
            for tokens in prompts:
                slot = slots.submit(tokens, limit, **options)
                assert slot is not None  # one slot per prompt
                ids.append(slot)
            # every pass emits a token for each running request or prefills a chunk: bounded by the prompts and the
            # tokens each may make (max_tokens, or the slot's context)
            per_prompt = slots.n_ctx_slot if limit < 0 else min(limit, slots.n_ctx_slot)
            passes = sum(len(p) for p in prompts) + len(prompts) * (per_prompt + 2) + 8
            running = len(prompts)
            for _ in range(passes):
                if running == 0:
                    break
                running = slots.step()
            out = []
            for slot in ids:
                res = slots.read(slot)
                if res.finish == "error":
                    raise RuntimeError(res.error)
                out.append(res.tokens)
            return out

    def kv_seq_remove(self, seq: int, p0: int = 0, p1: int = -1) -> int:
        """Take sequence `seq` out of its cells with positions in [p0, p1) (p1 < 0: to the end; seq < 0: every
        sequence), freeing cells no other sequence shares; returns the cells it left."""
        return self._ctx.kv_seq_remove(seq, p0, p1)

    def kv_seq_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> int:
        """Sequence dst shares sequence src's cells with positions in [p0, p1) (a common prefix, stored once)."""
        return self._ctx.kv_seq_copy(src, dst, p0, p1)

    def kv_seq_pos_max(self, seq: int) -> int:
        return self._ctx.kv_seq_pos_max(seq)

    def kv_seq_n_cells(self, seq: int) -> int:
        return self._ctx.kv_seq_n_cells(seq)

    def draft_head_eval(self, tokens: Sequence[int] | np.ndarray, features: np.ndarray,
                        draft_tokens: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The draft head alone over the pairs (tokens[i], features[i]) at positions 0..n-1, causal (features: the
        target's, [n, n_embd] for EAGLE-1, [n, 3 n_embd] for EAGLE-3), then, with draft_tokens, a chain of draft
        steps at positions n.. each fed the previous row's own output feature: its logits [n + n_draft,
        n_draft_vocab] and output features [n + n_draft, n_embd] (training's acceptance estimates; the model's own
        KV cache is untouched)."""
        tok = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        feats = np.ascontiguousarray(features, dtype=np.float32)
        drafts = np.ascontiguousarray(draft_tokens if draft_tokens is not None else [], dtype=np.int32).reshape(-1)
        with self._lock:
            return _core.draft_head_eval(self._ctx, tok, feats, drafts)

    def draft_head_chains(self, tokens: Sequence[int] | np.ndarray, features: np.ndarray,
                          roots: Sequence[int] | np.ndarray, depth: int) -> np.ndarray:
        """The drafts a tree decoder makes along a known sequence (tree exit's training data): the pairs as in
        draft_head_eval, then from each root q (increasing) a chain of `depth` draft steps taking tokens[q + 1..q +
        depth], each fed the previous step's own output and seeing pairs 0..q only, as a tree drafted from there:
        logits [n_roots, depth + 1, n_draft_vocab], step 0 the root pair's own row."""
        tok = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        feats = np.ascontiguousarray(features, dtype=np.float32)
        root = np.ascontiguousarray(roots, dtype=np.int32).reshape(-1)
        with self._lock:
            return _core.draft_head_eval_chains(self._ctx, tok, feats, root, depth)

    def features(self) -> np.ndarray:
        """EAGLE-3: the outputs of the draft head's feature layers for every token of the last batch
        [n_tokens, 3 n_embd] (what its committed pairs take); SpecEEError without an EAGLE-3 head."""
        return self._ctx.features()

    @property
    def pooling(self) -> str:
        """The model's own pooling of embeddings: its file's {arch}.pooling_type, else "mean" (specee.pooling)."""
        return pooling_name(self._model.pooling)

    def embed(self, text: str | bytes | Sequence[str | bytes], normalize: bool = True,
              pooling: str | None = None) -> np.ndarray | list[np.ndarray]:
        """Embeddings of a text's final-norm hidden states (BOS as the vocabulary asks), pooled (specee.pooling): "mean"
        over the tokens, "cls" the first token's, "last" the last token's ([n_embd] each, unit length when
        normalize), "none" every token's row ([n_tokens, n_embd], as they are), "rank" relevance scores (the last
        row through the file's classifier head, [labels]; without one the row's first element, [1]); None: the
        model's own (`pooling`). A list of texts gives [n_texts, ...] (for
        "none", a list of arrays). One call of the runtime (`specee_embed`): each text is evaluated alone on a KV
        sequence of its own, removed afterwards, so the cache keeps what it held (a conversation's prefix) unless those
        cells must make room. At most EMBED_MAX_TEXTS texts a call, run EMBED_CHUNK at a time (the model's lock let go
        between: other threads' calls go on). ValueError for an empty text or an unknown pooling; SpecEEError for a
        text longer than the context or a list longer than EMBED_MAX_TEXTS."""
        pid = pooling_id(pooling)
        one = isinstance(text, (str, bytes, bytearray))
        texts = [text] if isinstance(text, (str, bytes, bytearray)) else list(text)
        if len(texts) > EMBED_MAX_TEXTS:
            raise _core.SpecEEError(f"embed: {len(texts)} texts, more than the {EMBED_MAX_TEXTS} one call takes "
                                    f"(EMBED_MAX_TEXTS): split the list")
        seqs = [self.tokenize(t, add_special=True) for t in texts]
        for i, toks in enumerate(seqs):
            if not toks:
                raise ValueError("cannot embed empty text" + ("" if one else f" (text {i})"))
        outs = []
        for k in range(0, len(seqs), EMBED_CHUNK):  # the model's lock taken per chunk: other calls go on between
            chunk = seqs[k:k + EMBED_CHUNK]
            tokens = np.asarray([t for toks in chunk for t in toks], dtype=np.int32)
            n_tokens = np.asarray([len(toks) for toks in chunk], dtype=np.int32)
            with self._lock:
                outs.append(self._ctx.embed(tokens, n_tokens, pid, normalize))
        out = outs[0] if len(outs) == 1 else np.concatenate(outs)
        if (pooling_name(self._model.pooling) if pid < 0 else pooling) == "none":  # rows: split per text
            parts = np.split(out, np.cumsum([len(toks) for toks in seqs])[:-1])
            return parts[0] if one else parts
        return out[0] if one else out
