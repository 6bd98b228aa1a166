"""A GGUF fuzzer for the loader, the tokenizer and one small evaluation (issue 18).

Seeds: three tiny valid llama files written here without torch (a SentencePiece vocabulary with F32 weights, a
byte-level BPE one with Q4_0/Q8_0 matrices, and an F16 one with an EAGLE head and an exit predictor). Inputs:
- boundary: every integer field of each seed (header counts, key lengths, value and element types, scalar values,
  string and array lengths, the first and last elements of arrays, tensor name lengths, dimension counts,
  dimensions, types and offsets) set to 0, +-1, its value +-1, the type's extremes and, for floats, NaN, +-inf;
- random: seeded mutations of the header, metadata and tensor infos (bit flips, bytes and words set to
  interesting values, fields set at random, truncation, spliced runs), now and then of the tensor data too.
Each input is loaded by a worker process through the Python bindings (load, tokenize, evaluate, generate a few
tokens; with an EAGLE head and exit predictors, early exit), many per process. The parent gives each input a
time limit: a worker killed by a signal is a crash, one past the limit a hang; both inputs are saved. Clean
errors (SpecEEError, ValueError, OSError) and successes are counted; any other Python exception is reported too.

    python tests/fuzz_gguf.py --mode both --random 5000 --out /tmp/fuzz     # the documented long run
    python tests/fuzz_gguf.py --mode random --random 200000 --seed 7        # longer still
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import resource
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
TEXT = "Hello world, the quick brown fox: 123 + 456 = 579!"

# ---- seeds


@dataclasses.dataclass
class Shape:
    n_embd: int = 32
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 64
    n_layer: int = 2
    n_ctx_train: int = 256


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for every byte (byte-level BPE vocabularies store tokens in them)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def spm_vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """<unk>, <s>, </s>, the 256 byte tokens, then letters and made-up pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581t", "he", "\u2581the", "wor"]
    pieces += [f"\u2581p{i}" for i in range(n_vocab - len(tokens) - len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens + pieces)
    w.add_token_scores([0.0] * len(tokens) + [-float(i) for i in range(len(pieces))])
    w.add_token_types([int(t) for t in types] + [int(gguf.TokenType.NORMAL)] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def bpe_vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """The 256 byte characters, a few merges, <|im_start|> / <|im_end|> / <|endoftext|>."""
    chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "l l", "o r", "Ġ w", "Ġw or"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    filler = [f"x{i}" for i in range(n_vocab - len(chars) - len(merged) - len(specials))]
    tokens = chars + merged + filler + specials
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)) + [gguf.TokenType.CONTROL] * len(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                        "<|im_end|>\n{% endfor %}")


def write_seed(path: Path, vocab: str, matrix: Q, parts: bool, seed: int) -> None:
    """A tiny llama GGUF with random weights (matrices in `matrix`), `vocab` "spm" or "bpe", and with `parts` an
    EAGLE-1 head and the exit predictor of layer 0 (the file early exit runs on)."""
    s, rng = Shape(), np.random.default_rng(seed)
    n_vocab = 320
    head = s.n_embd // s.n_head
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"fuzz seed {path.stem}")
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_block_count(s.n_layer)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head)
    w.add_vocab_size(n_vocab)
    (spm_vocab if vocab == "spm" else bpe_vocab)(w, n_vocab)

    def add(name: str, shape: tuple[int, ...], qtype: Q = Q.F32, mean: float = 0.0) -> None:
        x = (mean + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        qtype = qtype if len(shape) == 2 else Q.F32
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    q, kv = s.n_head * head, s.n_head_kv * head
    add("token_embd.weight", (n_vocab, s.n_embd), matrix)
    for il in range(s.n_layer):
        add(f"blk.{il}.attn_norm.weight", (s.n_embd,), mean=1.0)
        add(f"blk.{il}.attn_q.weight", (q, s.n_embd), matrix)
        add(f"blk.{il}.attn_k.weight", (kv, s.n_embd), matrix)
        add(f"blk.{il}.attn_v.weight", (kv, s.n_embd), matrix)
        add(f"blk.{il}.attn_output.weight", (s.n_embd, q), matrix)
        add(f"blk.{il}.ffn_norm.weight", (s.n_embd,), mean=1.0)
        add(f"blk.{il}.ffn_gate.weight", (s.n_ff, s.n_embd), matrix)
        add(f"blk.{il}.ffn_up.weight", (s.n_ff, s.n_embd), matrix)
        add(f"blk.{il}.ffn_down.weight", (s.n_embd, s.n_ff), matrix)
    add("output_norm.weight", (s.n_embd,), mean=1.0)
    add("output.weight", (n_vocab, s.n_embd), Q.Q8_0 if matrix != Q.F32 else Q.F32)
    if parts:
        n_draft, n_cand, hidden = 64, 4, 16
        w.add_uint32("specee.eagle.version", 1)
        w.add_uint32("specee.eagle.feed_forward_length", s.n_ff)
        w.add_array("specee.eagle.draft_vocab", list(range(n_draft)))
        w.add_array("specee.exit.layers", [0])
        w.add_float32("specee.exit.threshold", 0.5)
        w.add_uint32("specee.exit.n_candidates", n_cand)
        add("eagle.fc.weight", (s.n_embd, 2 * s.n_embd), matrix)
        add("eagle.fc.bias", (s.n_embd,))
        add("eagle.attn_q.weight", (q, s.n_embd), matrix)
        add("eagle.attn_k.weight", (kv, s.n_embd), matrix)
        add("eagle.attn_v.weight", (kv, s.n_embd), matrix)
        add("eagle.attn_output.weight", (s.n_embd, q), matrix)
        add("eagle.ffn_norm.weight", (s.n_embd,), mean=1.0)
        add("eagle.ffn_gate.weight", (s.n_ff, s.n_embd), matrix)
        add("eagle.ffn_up.weight", (s.n_ff, s.n_embd), matrix)
        add("eagle.ffn_down.weight", (s.n_embd, s.n_ff), matrix)
        add("eagle.output.weight", (n_draft, s.n_embd), matrix)
        add("blk.0.pred.up.weight", (hidden, 3 * n_cand))
        add("blk.0.pred.up.bias", (hidden,))
        add("blk.0.pred.down.weight", (1, hidden))
        add("blk.0.pred.down.bias", (1,), mean=3.0)  # fires: tokens exit at layer 0 when the head agrees
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SEEDS = {  # name -> (vocabulary, matrix type, with draft head and predictor)
    "spm-f32": ("spm", Q.F32, False),
    "bpe-q4_0": ("bpe", Q.Q4_0, False),
    "spm-f16-parts": ("spm", Q.F16, True),
}


def write_seeds(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, (name, (vocab, matrix, parts)) in enumerate(SEEDS.items()):
        paths[name] = folder / f"{name}.gguf"
        if not paths[name].exists():
            write_seed(paths[name], vocab, matrix, parts, seed=i)
    return paths


# ---- the integer fields of a file

@dataclasses.dataclass
class Slot:
    offset: int
    fmt: str  # struct format of the field ("<I", "<q", "<f", ...)
    what: str  # for reports: "llama.block_count value", "output.weight dim 1", ...
    role: str = "value"  # "gguf_type", "ggml_type", "length" or "value": which special values to try


DTYPE_FMT = {np.dtype(t): f for t, f in [(np.uint8, "<B"), (np.int8, "<b"), (np.uint16, "<H"), (np.int16, "<h"),
                                          (np.uint32, "<I"), (np.int32, "<i"), (np.uint64, "<Q"), (np.int64, "<q"),
                                          (np.float32, "<f"), (np.float64, "<d"), (np.bool_, "<B")]}


def slots_of(path: Path) -> tuple[list[Slot], int]:
    """Every fixed-size field of the header, the metadata and the tensor infos (arrays: their first two and last
    elements), and where the tensor data starts."""
    r = gguf.GGUFReader(str(path))
    slots = []
    for f in r.fields.values():
        off = f.offset
        offsets = []
        for p in f.parts:
            offsets.append(off)
            off += p.nbytes
        if f.name.startswith("GGUF."):
            slots.append(Slot(offsets[0], DTYPE_FMT[f.parts[0].dtype], f.name))
            continue
        slots.append(Slot(offsets[0], "<Q", f"{f.name} key length", "length"))
        slots.append(Slot(offsets[2], "<I", f"{f.name} value type", "gguf_type"))
        if f.types[0] == V.ARRAY:
            slots.append(Slot(offsets[3], "<I", f"{f.name} element type", "gguf_type"))
            slots.append(Slot(offsets[4], "<Q", f"{f.name} count", "length"))
        n = len(f.data)
        for k in sorted({0, 1, n - 1} & set(range(n))):
            i = f.data[k]
            if f.types[-1] == V.STRING:
                slots.append(Slot(offsets[i - 1], "<Q", f"{f.name}[{k}] string length", "length"))
            else:
                slots.append(Slot(offsets[i], DTYPE_FMT[f.parts[i].dtype], f"{f.name}[{k}]"))
    for t in r.tensors:
        off = t.field.offset
        parts = t.field.parts  # name length, name, n_dims, dims, type, offset
        offsets = []
        for p in parts:
            offsets.append(off)
            off += p.nbytes
        slots.append(Slot(offsets[0], "<Q", f"{t.name} name length", "length"))
        slots.append(Slot(offsets[2], "<I", f"{t.name} n_dims", "length"))
        for d in range(len(parts[3])):
            slots.append(Slot(offsets[3] + 8 * d, "<q", f"{t.name} dim {d}", "length"))
        slots.append(Slot(offsets[4], "<I", f"{t.name} type", "ggml_type"))
        slots.append(Slot(offsets[5], "<Q", f"{t.name} offset", "length"))
    return slots, r.data_offset


def boundary_values(fmt: str, current: int | float, role: str) -> list:
    """0, +-1, the value +-1, the type's extremes; NaN and infinities for floats; every type id for type fields."""
    if fmt in ("<f", "<d"):
        big = 3.4028235e38 if fmt == "<f" else 1.7976931348623157e308
        return [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), big, -big, 1e-38, -1e-30]
    size = struct.calcsize(fmt)
    signed = fmt[1].islower()
    lo, hi = (-(1 << (8 * size - 1)), (1 << (8 * size - 1)) - 1) if signed else (0, (1 << (8 * size)) - 1)
    vals = {0, 1, lo, hi, current - 1, current + 1, current * 2}
    vals |= {-1} if signed else {hi - 1}
    if size >= 4:
        vals |= {0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 16, 1 << 24}
    if size == 8:
        vals |= {1 << 32, 1 << 40, 1 << 62, 1 << 63}
    if role == "gguf_type":
        vals |= set(range(0, 16))
    elif role == "ggml_type":
        vals |= set(range(0, 42))
    out = []
    for v in sorted(vals):
        if not signed and v < 0:
            v &= (1 << (8 * size)) - 1
        if lo <= v <= hi and v != current:
            out.append(v)
    return sorted(set(out))


def set_slot(data: bytearray, slot: Slot, value) -> None:
    struct.pack_into(slot.fmt, data, slot.offset, value)


def boundary_inputs(seeds: dict[str, Path]) -> Iterator[tuple[str, bytes]]:
    for name, path in seeds.items():
        base = path.read_bytes()
        slots, _ = slots_of(path)
        for slot in slots:
            current = struct.unpack_from(slot.fmt, base, slot.offset)[0]
            for v in boundary_values(slot.fmt, current, slot.role):
                data = bytearray(base)
                set_slot(data, slot, v)
                yield f"{name}: {slot.what} = {v}", bytes(data)


# ---- random mutations

INTERESTING = [0, 1, 2, 7, 8, 16, 31, 32, 63, 64, 127, 128, 255, 256, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000,
               0xFFFFFFFF, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def mutate(rng: random.Random, base: bytes, slots: list[Slot], data_offset: int) -> tuple[str, bytes]:
    data = bytearray(base)
    done = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["bits", "bytes", "word", "slot", "slot", "splice", "truncate", "data"])
        head = max(data_offset, 8)
        if kind == "bits":
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(min(head, len(data)))
                data[i] ^= 1 << rng.randrange(8)
            done.append("bits")
        elif kind == "bytes":
            i = rng.randrange(min(head, len(data)))
            for k in range(rng.randint(1, 4)):
                if i + k < len(data):
                    data[i + k] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
            done.append(f"bytes@{i}")
        elif kind == "word":
            size = rng.choice([4, 8])
            i = rng.randrange(max(1, min(head, len(data)) - size))
            v = rng.choice(INTERESTING) & ((1 << (8 * size)) - 1)
            data[i:i + size] = v.to_bytes(size, "little")
            done.append(f"word@{i}={v}")
        elif kind == "slot":
            slot = rng.choice(slots)
            current = struct.unpack_from(slot.fmt, data, slot.offset)[0]
            choices = boundary_values(slot.fmt, current, slot.role)
            if slot.fmt in ("<f", "<d"):
                choices.append(rng.uniform(-1e6, 1e6))
            else:
                size = struct.calcsize(slot.fmt)
                signed = slot.fmt[1].islower()
                choices.append(rng.randrange(-(1 << (8 * size - 1)), 1 << (8 * size - 1)) if signed
                               else rng.randrange(1 << (8 * size)))
            v = rng.choice(choices)
            set_slot(data, slot, v)
            done.append(f"{slot.what}={v}")
        elif kind == "splice":
            n = rng.randint(1, 64)
            src, dst = rng.randrange(head), rng.randrange(head)
            chunk = data[src:src + n]
            if rng.random() < 0.5:
                data[dst:dst + len(chunk)] = chunk  # overwrite
            else:
                data[dst:dst] = chunk  # insert (shifts everything after)
            done.append(f"splice {src}->{dst} x{n}")
        elif kind == "truncate":
            i = rng.randrange(len(data))
            del data[i:]
            done.append(f"truncate@{i}")
            break
        else:  # tensor data: NaN, inf or random bytes in the weights
            if len(data) > head + 4:
                i = rng.randrange(head, len(data) - 4)
                data[i:i + 4] = rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", rng.randbytes(4)])
                done.append(f"data@{i}")
    return ", ".join(done), bytes(data)


# ---- structured mutations: the file written again, consistent, with keys and tensors changed


@dataclasses.dataclass
class Parsed:
    fields: list  # (key, value, type, element type or None)
    tensors: list  # (name, raw data, ne, type)


def parse(path: Path) -> Parsed:
    r = gguf.GGUFReader(str(path))
    fields = [(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == V.ARRAY else None)
              for f in r.fields.values() if not f.name.startswith("GGUF.")]
    tensors = [(t.name, np.array(t.data), [int(n) for n in t.shape], Q(t.tensor_type)) for t in r.tensors]
    return Parsed(fields, tensors)


def serialize(p: Parsed, tmp: Path) -> bytes:
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.kv_data[0].clear()  # general.architecture comes from the fields (it may be mutated too)
    for key, value, vtype, sub in p.fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, data, ne, qtype in p.tensors:
        w.add_tensor_info(name, list(reversed(ne)), np.dtype(np.float32), data.nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data, _, _ in p.tensors:
        w.write_tensor_data(data)
    w.close()
    return tmp.read_bytes()


def random_value(rng: random.Random) -> tuple:
    """(value, type, element type) of a random kind."""
    kind = rng.choice(["int", "float", "str", "bool", "ints", "strs", "floats"])
    if kind == "int":
        t = rng.choice([V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64])
        size = {V.UINT8: 1, V.INT8: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4}.get(t, 8)
        signed = t in (V.INT8, V.INT16, V.INT32, V.INT64)
        lo, hi = (-(1 << (8 * size - 1)), (1 << (8 * size - 1)) - 1) if signed else (0, (1 << (8 * size)) - 1)
        return rng.choice([0, 1, lo, hi, rng.randint(lo, hi), min(hi, 4), min(hi, 320), -1 if signed else hi]), t, None
    if kind == "float":
        return rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e-30, 1e30, rng.uniform(-10, 10)]), \
            rng.choice([V.FLOAT32, V.FLOAT64]), None
    if kind == "str":
        return rng.choice(["", "llama", "gpt2", "none", "yarn", "linear", "\xff\xfe", "x" * 1000, "<s>", "\u2581"]), \
            V.STRING, None
    if kind == "bool":
        return rng.random() < 0.5, V.BOOL, None
    if kind == "ints":
        n = rng.choice([0, 1, 2, 5, 64])
        return [rng.choice([0, 1, -1, 2**31 - 1, rng.randint(-5, 400)]) for _ in range(n)], V.ARRAY, V.INT32
    if kind == "floats":
        return [rng.choice([0.0, float("nan"), rng.uniform(-5, 5)]) for _ in range(rng.choice([0, 1, 8]))], \
            V.ARRAY, V.FLOAT32
    return [rng.choice(["", "a", "<s>", "</s>", "Ġ t", "x y z"]) for _ in range(rng.choice([0, 1, 3]))], V.ARRAY, V.STRING


EXTRA_KEYS = ["llama.attention.key_length", "llama.attention.value_length", "llama.rope.scaling.type",
              "llama.rope.scaling.factor", "llama.rope.scale_linear", "llama.rope.scaling.original_context_length",
              "tokenizer.ggml.eot_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_eos_token",
              "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.pre", "tokenizer.chat_template",
              "specee.eagle.version", "specee.eagle.draft_vocab", "specee.exit.layers", "specee.exit.threshold",
              "specee.exit.n_candidates", "general.alignment"]


def structured(rng: random.Random, base: Parsed, tmp: Path) -> tuple[str, bytes]:
    p = Parsed(list(base.fields), list(base.tensors))
    done = []
    for _ in range(rng.randint(1, 2)):
        kind = rng.choice(["drop_key", "retype_key", "add_key", "array_len", "drop_tensor", "rename_tensor",
                           "reshape_tensor", "add_tensor"])
        if kind in ("drop_key", "retype_key", "array_len") and p.fields:
            i = rng.randrange(len(p.fields))
            key, value, vtype, sub = p.fields[i]
            if kind == "drop_key":
                del p.fields[i]
            elif kind == "retype_key":
                p.fields[i] = (key, *random_value(rng))
            elif vtype == V.ARRAY and value:
                k = rng.choice([-len(value), -1, 1, 7])
                p.fields[i] = (key, value[:k] if k < 0 else value + value[:k], vtype, sub)
            done.append(f"{kind} {key}")
        elif kind == "add_key":
            key = rng.choice(EXTRA_KEYS)
            p.fields = [f for f in p.fields if f[0] != key] + [(key, *random_value(rng))]
            done.append(f"add_key {key}")
        elif kind == "drop_tensor" and p.tensors:
            done.append(f"drop_tensor {p.tensors.pop(rng.randrange(len(p.tensors)))[0]}")
        elif kind == "rename_tensor" and p.tensors:
            i = rng.randrange(len(p.tensors))
            name = rng.choice(["blk.2.attn_q.weight", "blk.-1.ffn_up.weight", "blk.99999999999.x", "blk.1",
                               "blk.0.pred.up.weight", "blk.1.pred.up.weight", "eagle.fc.weight", "rope_freqs.weight",
                               "output.weight", f"blk.{rng.randint(0, 5)}.attn_norm.weight", "x" * 63])
            if all(t[0] != name for t in p.tensors):
                done.append(f"rename_tensor {p.tensors[i][0]} -> {name}")
                p.tensors[i] = (name, *p.tensors[i][1:])
        elif kind == "reshape_tensor" and p.tensors:
            i = rng.randrange(len(p.tensors))
            name, data, ne, qtype = p.tensors[i]
            if qtype in (Q.F32, Q.F16):
                n = int(np.prod(ne))
                shape = rng.choice([[n], [1, n], [n, 1], list(reversed(ne)), [2, n // 2] if n % 2 == 0 else [n]])
                p.tensors[i] = (name, data, shape, qtype)
                done.append(f"reshape_tensor {name} {ne} -> {shape}")
        elif kind == "add_tensor":
            name = rng.choice(["rope_freqs.weight", "eagle.token_embd.weight", "blk.1.pred.up.weight",
                               "blk.1.pred.up.bias", "eagle.output.weight", "blk.0.extra.weight"])
            if all(t[0] != name for t in p.tensors):
                ne = rng.choice([[4], [8], [32], [12, 16], [32, 320], [32, 64]])
                data = np.float32(rng.choice([1.0, 0.0, float("nan")])) * np.ones(int(np.prod(ne)), np.float32)
                p.tensors.append((name, data, ne, Q.F32))
                done.append(f"add_tensor {name} {ne}")
    try:
        return ", ".join(done), serialize(p, tmp)
    except (ValueError, TypeError, OverflowError, struct.error) as e:  # the writer refused the mutation
        return f"unwritable ({type(e).__name__}), the seed", serialize(base, tmp)


def random_inputs(seeds: dict[str, Path], n: int, seed: int, tmp: Path) -> Iterator[tuple[str, bytes]]:
    """Byte-level mutations, and one input in three a structured one."""
    rng = random.Random(seed)
    loaded = {name: (path.read_bytes(), *slots_of(path), parse(path)) for name, path in seeds.items()}
    names = sorted(loaded)
    for i in range(n):
        name = rng.choice(names)
        base, slots, data_offset, parsed = loaded[name]
        if rng.random() < 1 / 3:
            what, data = structured(rng, parsed, tmp)
        else:
            what, data = mutate(rng, base, slots, data_offset)
        yield f"{name} #{i}: {what}", data


# ---- the worker: load, tokenize, evaluate, generate


def run_one(path: str) -> str:
    import specee

    with specee.Model(path, n_ctx=64, n_batch=32, n_threads=1) as m:
        tokens = m.tokenize(TEXT, parse_special=True)[:16]
        if not tokens:
            return "ok (no tokens)"
        logits = m.eval(tokens)
        m.kv_clear()
        opts = dict(temp=0.0, mode="early-exit") if m.has_eagle and m._model.exit_n_pred > 0 else dict(temp=0.0)
        out = m.generate_tokens(tokens[:8], 4, **opts)
        m.detokenize(out)
        return f"ok ({len(tokens)} tokens, finite logits: {bool(np.isfinite(logits).all())})"


def one_line(msg: str, path: str) -> str:
    return msg.replace(path, "FILE").replace("\n", " ")[:300]


def worker() -> None:
    """Reads input paths on stdin, answers one line each on the original stdout: ok / error / pyexc (an unexpected
    Python exception); whatever the native code prints goes to stderr instead."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import specee

    for line in sys.stdin:
        path = line.strip()
        try:
            answer = run_one(path)
        except (specee.SpecEEError, ValueError, OSError) as e:
            answer = "error " + one_line(str(e), path)
        except Exception as e:  # noqa: BLE001 - reported as a finding, not swallowed
            answer = f"pyexc {type(e).__name__}: {one_line(str(e), path)}"
        answers.write(answer + "\n")
        answers.flush()


# ---- the parent: one worker at a time, restarted after a crash or a hang


@dataclasses.dataclass
class Report:
    ok: int = 0
    errors: int = 0
    crashes: list = dataclasses.field(default_factory=list)
    hangs: list = dataclasses.field(default_factory=list)
    pyexc: list = dataclasses.field(default_factory=list)
    messages: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return self.ok + self.errors + len(self.crashes) + len(self.hangs) + len(self.pyexc)

    def summary(self) -> dict:
        return dict(inputs=self.total, ok=self.ok, clean_errors=self.errors, crashes=len(self.crashes),
                    hangs=len(self.hangs), python_exceptions=len(self.pyexc))


class Worker:
    def __init__(self, folder: Path, limit_mb: int, command: list[str] | None = None) -> None:
        """command: the worker process (default: this file's --worker); it reads paths, answers a line each."""
        self.folder, self.limit_mb = folder, limit_mb
        self.command = command or [sys.executable, os.path.abspath(__file__), "--worker"]
        self.input = folder / "input.gguf"
        self.log = folder / "worker-stderr.txt"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # AddressSanitizer maps terabytes of shadow at start: under scripts/sanitize.sh no address-space cap (its
        # allocator returns NULL for a huge request instead, allocator_may_return_null=1)
        sanitized = "libasan" in os.environ.get("LD_PRELOAD", "")

        def limits() -> None:
            if self.limit_mb > 0 and not sanitized:
                resource.setrlimit(resource.RLIMIT_AS, (self.limit_mb << 20, self.limit_mb << 20))

        env = dict(os.environ, GGML_NO_BACKTRACE="1")  # ggml's abort would run gdb
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         preexec_fn=limits)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait()
        self.proc = None

    def ask(self, data: bytes, timeout: float) -> tuple[str, str]:
        """("ok" | "error" | "pyexc", line) or ("crash", signal) or ("hang", "")."""
        if self.proc is None:
            self.start()
        self.input.write_bytes(data)
        try:
            self.proc.stdin.write(f"{self.input}\n".encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died on the previous input after answering: read below finds EOF
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.stop()
            return "hang", f"no answer in {timeout:.0f} s"
        line = self.proc.stdout.readline().decode(errors="replace").strip()
        if not line:
            rc = self.proc.wait()
            self.proc = None
            name = signal.Signals(-rc).name if rc < 0 else f"exit {rc}"
            tail = self.log.read_text(errors="replace")[-400:].strip().replace("\n", " | ")
            return "crash", f"{name}: {tail}"
        kind = line.split(" ", 1)[0]
        return kind, line


def fuzz(inputs: Iterator[tuple[str, bytes]], out: Path, timeout: float, limit_mb: int,
         progress: bool = True, command: list[str] | None = None) -> Report:
    out.mkdir(parents=True, exist_ok=True)
    w = Worker(out, limit_mb, command)
    rep = Report()
    t0 = time.time()
    try:
        for what, data in inputs:
            kind, line = w.ask(data, timeout)
            if kind == "ok":
                rep.ok += 1
            elif kind == "error":
                rep.errors += 1
                rep.messages[line[6:70]] += 1
            else:
                n = len(rep.crashes) + len(rep.hangs) + len(rep.pyexc)
                (out / f"{kind}-{n}.gguf").write_bytes(data)
                (out / f"{kind}-{n}.txt").write_text(f"{what}\n{line}\n")
                {"crash": rep.crashes, "hang": rep.hangs}.get(kind, rep.pyexc).append((what, line))
                if progress:
                    print(f"{kind}: {what}: {line}", flush=True)
            if progress and rep.total % 1000 == 0:
                print(f"{rep.total} inputs, {time.time() - t0:.0f} s: {rep.summary()}", flush=True)
    finally:
        w.stop()
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["boundary", "random", "both"], default="both")
    ap.add_argument("--random", type=int, default=5000, help="random inputs (default 5000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random mutations (default 0)")
    ap.add_argument("--out", type=Path, default=Path("fuzz-out"), help="seeds, the worker's files, saved crashes")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per input before it counts as a hang")
    ap.add_argument("--limit-mb", type=int, default=4096,
                    help="the worker's address-space limit (0: none; needed 0 under AddressSanitizer)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    seeds = write_seeds(args.out / "seeds")
    inputs: list[Iterator[tuple[str, bytes]]] = []
    if args.mode in ("boundary", "both"):
        inputs.append(boundary_inputs(seeds))
    if args.mode in ("random", "both"):
        inputs.append(random_inputs(seeds, args.random, args.seed, args.out / "structured.gguf"))
    t0 = time.time()
    rep = fuzz((x for it in inputs for x in it), args.out, args.timeout, args.limit_mb)
    report(rep, time.time() - t0)


def report(rep, seconds: float) -> None:
    """A fuzzing run's summary, its most frequent errors and its findings; exit status 1 where there are findings."""
    print(json.dumps(dict(rep.summary(), seconds=round(seconds, 1)), indent=1))
    print("most frequent errors:")
    for msg, n in rep.messages.most_common(15):
        print(f"  {n:6d}  {msg}")
    for kind, items in (("crash", rep.crashes), ("hang", rep.hangs), ("python exception", rep.pyexc)):
        for what, line in items[:20]:
            print(f"{kind}: {what}: {line}")
    if rep.crashes or rep.hangs or rep.pyexc:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
