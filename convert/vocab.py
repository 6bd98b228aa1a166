"""Tokenizer metadata of a Hugging Face folder, in the tokenizer.ggml.* keys llama.cpp reads.

Two kinds, chosen as llama.cpp's converter chooses them:
- `tokenizer.model` (SentencePiece) -> tokenizer.ggml.model "llama": every piece with its score and
  type (normal, unknown, control, unused, byte), added tokens from added_tokens.json and
  tokenizer_config.json as user-defined or control tokens, ids past the model's vocabulary padded
  with "[PADn]" entries.
- `tokenizer.json` with a byte-level BPE model -> "gpt2": tokens, token types and merges. llama.cpp
  names the pre-tokenizer (tokenizer.ggml.pre) by hashing the token ids of a test string; here the
  name is read off the pre_tokenizer configuration instead, for the configurations whose llama.cpp
  equivalent is known (`gpt-2`, `llama-bpe`, `smollm`, `qwen2`); any other needs --vocab-pre, which takes
  the names the runtime tokenizes by (specee._core.vocab_pre_names(): a file naming another one would not load).
Special token ids, add_bos/add_eos, merges and the chat template come from gguf.SpecialVocab, which
reads tokenizer_config.json, tokenizer.json and config.json the way llama.cpp's converter does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf

T = gguf.TokenType
SPACE_MARK = "\u2581"  # SentencePiece's visible space

# The pre-tokenizer regex of Llama 3's tokenizer.json (llama.cpp's "llama-bpe")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen 2's: Llama 3's with every digit alone (llama.cpp's "qwen2"); its tokenizer.json also has an NFC normalizer,
# which llama.cpp does not apply either
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass
class Vocab:
    model: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str  # tokenizer.ggml.pre
    tokens: list[bytes]
    types: list[int]
    scores: list[float] | None = None  # SentencePiece only


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def looks_special(text: str) -> bool:
    """Added tokens that some models forget to mark special, as llama.cpp's converter judges them."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


# ---- SentencePiece


def sentencepiece_vocab(model_dir: Path, n_vocab: int) -> Vocab:
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(model_dir / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [int(T.UNUSED)] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        kind = T.NORMAL
        if sp.IsUnknown(i):
            kind = T.UNKNOWN
        elif sp.IsControl(i):
            kind = T.CONTROL
        elif sp.IsUnused(i):
            kind = T.UNUSED
        elif sp.IsByte(i):
            kind = T.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), int(kind)
    for text, i in read_json(model_dir / "added_tokens.json").items():
        if i < n_vocab:
            tokens[i], scores[i], types[i] = text.encode("utf-8"), -1000.0, int(T.USER_DEFINED)
    added = read_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder", {})
    for key, tok in added.items():
        i, text = int(key), tok["content"]
        if i >= n_vocab:
            continue
        if tok.get("special") or looks_special(text):
            types[i] = int(T.CONTROL)
        else:
            text, types[i] = text.replace(SPACE_MARK, " "), int(T.USER_DEFINED)
        tokens[i], scores[i] = text.encode("utf-8"), -1000.0
    return Vocab("llama", "default", tokens, types, scores)


# ---- byte-level BPE (tokenizer.json)


def bpe_pre_name(tokenizer_json: dict) -> str:
    """llama.cpp's tokenizer.ggml.pre name for a tokenizer.json pre-tokenizer configuration."""
    pt = tokenizer_json.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", []) if pt.get("type") == "Sequence" else [pt]
    kinds = [s.get("type") for s in steps]
    last = steps[-1] if steps else {}
    byte_level = kinds[-1:] == ["ByteLevel"] and not last.get("add_prefix_space", False)
    split = steps[0].get("pattern", {}).get("Regex") if kinds == ["Split", "ByteLevel"] else None
    normalizer = (tokenizer_json.get("normalizer") or {}).get("type")
    if split == QWEN2_SPLIT and byte_level and not last.get("use_regex", True) and normalizer in (None, "NFC"):
        return "qwen2"
    if tokenizer_json.get("normalizer") is None and byte_level:
        if kinds == ["ByteLevel"] and last.get("use_regex", True):
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
            return "smollm"
        if split == LLAMA3_SPLIT and not last.get("use_regex", True):
            return "llama-bpe"
    raise ValueError(
        f"tokenizer.json: pre-tokenizer {json.dumps(pt)[:200]} is not one whose llama.cpp name is known "
        "(gpt-2, llama-bpe, smollm, qwen2); pass --vocab-pre NAME with the tokenizer.ggml.pre name llama.cpp uses for it"
    )


def check_pre_name(pre: str) -> None:
    """A tokenizer.ggml.pre name the runtime has (a file with another one would be refused at load)."""
    from specee import _core

    if pre not in _core.vocab_pre_names():
        raise ValueError(f"--vocab-pre {pre!r}: not a pre-tokenizer this runtime has; known: "
                         + ", ".join(_core.vocab_pre_names()))


def bpe_vocab(model_dir: Path, n_vocab: int, pre: str | None) -> Vocab:
    from tokenizers import Tokenizer

    tj = read_json(model_dir / "tokenizer.json")
    if tj.get("model", {}).get("type") != "BPE" or tj["model"].get("byte_fallback"):
        raise ValueError(
            f"{model_dir / 'tokenizer.json'}: only byte-level BPE tokenizers are read from tokenizer.json; "
            "a SentencePiece model needs its tokenizer.model"
        )
    pre = pre or bpe_pre_name(tj)
    check_pre_name(pre)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    by_id = {i: text for text, i in tok.get_vocab(with_added_tokens=True).items()}
    if by_id and max(by_id) >= n_vocab:
        raise ValueError(f"tokenizer.json has token id {max(by_id)} but the model's vocab_size is {n_vocab}")
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]".encode())
            types.append(int(T.UNUSED))
            continue
        kind = T.NORMAL
        if i in added:
            if not added[i].normalized:  # llama.cpp expects added tokens in their normalized form
                text = tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            if added[i].special or looks_special(text):
                kind = T.CONTROL
            else:
                text, kind = text.replace(SPACE_MARK, " "), T.USER_DEFINED
        tokens.append(text.encode("utf-8"))
        types.append(int(kind))
    return Vocab("gpt2", pre, tokens, types)


# ---- both


def load_vocab(model_dir: str | os.PathLike, n_vocab: int, pre: str | None = None) -> Vocab | None:
    """The folder's tokenizer (tokenizer.model first, as llama.cpp), or None when it has none."""
    folder = Path(model_dir)
    if (folder / "tokenizer.model").is_file():
        return sentencepiece_vocab(folder, n_vocab)
    if (folder / "tokenizer.json").is_file():
        return bpe_vocab(folder, n_vocab, pre)
    return None


def add_vocab(writer: gguf.GGUFWriter, vocab: Vocab, model_dir: str | os.PathLike,
              space_prefix: bool | None = None) -> None:
    """tokenizer.ggml.* keys and the chat template; space_prefix: tokenizer.ggml.add_space_prefix whatever the
    folder says (Gemma's SentencePiece adds no space in front, which llama.cpp's converter writes as False)."""
    folder = Path(model_dir)
    add_prefix = read_json(folder / "tokenizer_config.json").get("add_prefix_space")
    add_prefix = add_prefix if space_prefix is None else space_prefix
    if add_prefix is not None:
        writer.add_add_space_prefix(bool(add_prefix))
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if vocab.model == "gpt2":
        special = gguf.SpecialVocab(folder, load_merges=True)
    else:
        special = gguf.SpecialVocab(folder, n_vocab=len(vocab.tokens))
    special.add_to_gguf(writer, quiet=True)
