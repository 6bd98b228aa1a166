"""A LoRA adapter fuzzer (issue 46): adapter files mutated as tests/fuzz_gguf.py mutates models, loaded against a
tiny base model through `Model(lora=[...])` (csrc/context/specee-lora.cpp's checks, then the graph that applies them).

Seeds, written here without torch, for fuzz_gguf's "spm-f32" base (2 layers, n_embd 32, n_ff 64, 320 tokens):
- lora-f32: every projection of both layers and the lm_head, rank 4, F32, alpha 8;
- lora-f16: the attention's q and v and the FFN's down projection of layer 1, rank 2, F16, no alpha;
- lora-q8_0: attn_q and attn_output of layer 0, rank 32 (a Q8_0 row is 32 values), Q8_0 lora_a, F16 lora_b.
Inputs: fuzz_gguf's boundary values of every field of each seed (header, metadata, tensor infos) and its seeded
random mutations (bytes, bits, splices, truncation; keys and tensors dropped, retyped, renamed, reshaped). Each input
is loaded by a worker process with the base model: the base and the adapter loaded, a prompt evaluated, the scale
changed to 0.5 and back, four tokens generated. A worker killed by a signal is a crash, one past the time limit a
hang (inputs saved); a SpecEEError / ValueError / OSError is a clean refusal, any other exception a finding.

    python tests/fuzz_lora.py --random 5000 --seed 46 --out /tmp/fuzz-lora     # the documented long run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np

from fuzz_gguf import Q, Shape, boundary_inputs, fuzz, random_inputs, report, write_seeds

BASE = "spm-f32"
PROMPT = "Hello world, the quick brown fox"
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def weight_shape(s: Shape, name: str) -> tuple[int, int]:
    """(n_in, n_out) of a base model matrix (fuzz_gguf's layout)."""
    head = s.n_embd // s.n_head
    q, kv = s.n_head * head, s.n_head_kv * head
    return {"attn_q": (s.n_embd, q), "attn_k": (s.n_embd, kv), "attn_v": (s.n_embd, kv), "attn_output": (q, s.n_embd),
            "ffn_gate": (s.n_embd, s.n_ff), "ffn_up": (s.n_embd, s.n_ff), "ffn_down": (s.n_ff, s.n_embd)}[name]


def write_adapter(path: Path, targets: list[tuple[int, str]], rank: int, types: tuple[Q, Q], alpha: float | None,
                  seed: int, lm_head: bool = False, shape: Shape | None = None) -> None:
    """An adapter GGUF: for each (layer, projection) lora_a [n_in, rank] and lora_b [rank, n_out] (ggml's order), of
    types (a's, b's); with lm_head the output matrix too; for a base of `shape` (default: the seeds')."""
    s, rng = shape or Shape(), np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)

    def add(name: str, n_in: int, n_out: int) -> None:
        for suffix, shape, qtype in ((".lora_a", (rank, n_in), types[0]), (".lora_b", (n_out, rank), types[1])):
            x = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name + suffix, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    for il, proj in targets:
        add(f"blk.{il}.{proj}.weight", *weight_shape(s, proj))
    if lm_head:
        add("output.weight", s.n_embd, 320)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_lora_seeds(folder: Path) -> tuple[Path, dict[str, Path]]:
    """The base model and the adapter seeds (written once per folder)."""
    base = write_seeds(folder)[BASE]
    specs = {
        "lora-f32": ([(il, p) for il in range(2) for p in PROJECTIONS], 4, (Q.F32, Q.F32), 8.0, True),
        "lora-f16": ([(1, "attn_q"), (1, "attn_v"), (1, "ffn_down")], 2, (Q.F16, Q.F16), None, False),
        "lora-q8_0": ([(0, "attn_q"), (0, "attn_output")], 32, (Q.Q8_0, Q.F16), 16.0, False),
    }
    seeds = {}
    for i, (name, (targets, rank, types, alpha, lm_head)) in enumerate(specs.items()):
        seeds[name] = folder / f"{name}.gguf"
        if not seeds[name].exists():
            write_adapter(seeds[name], targets, rank, types, alpha, seed=100 + i, lm_head=lm_head)
    return base, seeds


# ---- the worker

def run_one(base: str, path: str) -> str:
    import specee

    with specee.Model(base, lora=[path], n_ctx=64, n_batch=32, n_threads=1) as m:
        tokens = m.tokenize(PROMPT)[:12]
        logits = m.eval(tokens)
        m.set_lora([0.5])
        m.set_lora([1.0])
        m.kv_clear()
        out = m.generate_tokens(tokens[:6], 4, temp=0.0)
        m.detokenize(out)
        return f"ok ({len(m.lora_adapters)} adapter, finite logits: {bool(np.isfinite(logits).all())})"


def worker(base: str) -> None:
    """Reads adapter paths on stdin, answers one line each (ok / error / pyexc) on the original stdout; whatever the
    native code prints goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import specee

    for line in sys.stdin:
        path = line.strip()
        try:
            answer = run_one(base, path)
        except (specee.SpecEEError, ValueError, OSError) as e:
            answer = "error " + str(e).replace(path, "FILE").replace("\n", " ")[:300]
        except Exception as e:  # noqa: BLE001 - reported as a finding, not swallowed
            answer = f"pyexc {type(e).__name__}: {str(e).replace(path, 'FILE')[:300]}"
        answers.write(answer + "\n")
        answers.flush()


def inputs(seeds: dict[str, Path], n_random: int, seed: int, tmp: Path, boundary: bool = True
           ) -> Iterator[tuple[str, bytes]]:
    if boundary:
        yield from boundary_inputs(seeds)
    yield from random_inputs(seeds, n_random, seed, tmp)


def fuzz_lora(folder: Path, items: Iterator[tuple[str, bytes]], base: Path, timeout: float = 20.0,
              progress: bool = False):
    return fuzz(items, folder, timeout, 4096, progress=progress,
                command=[sys.executable, os.path.abspath(__file__), "--worker", str(base)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", type=int, default=5000, help="random inputs (default 5000)")
    ap.add_argument("--seed", type=int, default=46)
    ap.add_argument("--no-boundary", action="store_true", help="random inputs only")
    ap.add_argument("--out", type=Path, default=Path("fuzz-lora-out"))
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per input before it counts as a hang")
    ap.add_argument("--worker", metavar="BASE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    base, seeds = write_lora_seeds(args.out / "seeds")
    t0 = time.time()
    rep = fuzz_lora(args.out, inputs(seeds, args.random, args.seed, args.out / "structured.gguf", not args.no_boundary),
                    base, args.timeout, progress=True)
    report(rep, time.time() - t0)


if __name__ == "__main__":
    main()
