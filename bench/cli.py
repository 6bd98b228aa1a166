"""End-to-end decode speed of this runtime's llama-cli and upstream llama.cpp's, side by side in one run.

Both CLIs get the same GGUF, prompt, -n, threads and greedy sampling (--temp 0, no conversation mode); the
timing lines each prints at the end (llama_perf_context_print / common_perf_print: "prompt eval time" and
"eval time") are parsed, and a markdown table gives decode and prompt tokens/s per prompt and overall, with
ratios (specee / llama.cpp) and whether the two continuations were identical.

    python -m specee.bench.cli -m model.gguf --llama-cli path/to/llama-completion -n 128 -t 2 --rounds 3

Upstream's non-interactive completion tool is `llama-completion` in recent llama.cpp (`llama-cli` there is
conversation-only and needs the server build); either works here. Flash attention is passed to upstream
explicitly (-fa on, the default of --llama-cli-args), as this runtime always uses it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specee.bench.perf import parse_perf

TOOLS = ("llama.cpp", "specee")

# completion-style openings (no chat template in -no-cnv mode), which an instruct model continues for a while
DEFAULT_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The main differences between Python lists and tuples are",
    "Here is a step-by-step explanation of how a hash table works. First,",
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three most important things to know about photosynthesis are",
]

@dataclass
class Sample:
    tool: str
    prompt: int
    prompt_ms: float
    prompt_tokens: int
    eval_ms: float
    eval_runs: int
    text: str

    @property
    def decode_ts(self) -> float:
        return self.eval_runs / self.eval_ms * 1e3 if self.eval_ms > 0 else float("nan")


@dataclass
class Result:
    samples: list[Sample] = field(default_factory=list)

    def of(self, tool: str, prompt: int | None = None) -> list[Sample]:
        return [s for s in self.samples if s.tool == tool and (prompt is None or s.prompt == prompt)]


def read_prompts(path: str, limit: int) -> list[str]:
    """Prompts from a file: JSONL in the MT-Bench question format (first turn of each) or one prompt per line."""
    if not Path(path).is_file():
        raise SystemExit(f"bench.cli: prompts file not found: {path}")
    text = Path(path).read_text(encoding="utf-8")
    prompts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.endswith((".jsonl", ".json")):
            try:
                prompts.append(json.loads(line)["turns"][0])
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise SystemExit(f"bench.cli: {path}:{i}: not an MT-Bench question line ({e})")
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise SystemExit(f"bench.cli: no prompts in {path}")
    return prompts[:limit] if limit > 0 else prompts


def chat_prompts(model_path: str, prompts: list[str]) -> list[str]:
    """Each prompt as the text of a one-turn chat in the model's own template (special tokens as text)."""
    from specee import Model, chat_apply_template

    name = Model(model_path, n_ctx=64, n_threads=1).chat_template()
    return [chat_apply_template(name, [{"role": "user", "content": p}]) for p in prompts]


def explain(model_path: str, prompt: str, up_text: str, n_predict: int, n_threads: int) -> tuple[int, str, float]:
    """Greedy decode with this runtime until its text leaves upstream's: (token index, our piece there, our
    top-1 minus top-2 logit at that step). A small margin says the two differ by a floating-point near-tie."""
    import numpy as np

    from specee import Model

    m = Model(model_path, n_ctx=2048, n_threads=n_threads)
    logits = m.eval(m.tokenize(prompt, add_special=True, parse_special=True))
    text = b""
    for i in range(n_predict):
        row = logits[-1]
        top2 = np.argpartition(row, -2)[-2:]
        tok = int(top2[np.argmax(row[top2])])
        margin = float(abs(row[top2[0]] - row[top2[1]]))
        piece = m.token_to_piece(tok)
        text += piece
        if m.is_eog(tok) or not up_text.encode().startswith(text):
            return i, piece.decode(errors="replace"), margin
        logits = m.eval([tok])
    return -1, "", 0.0


def cli_argv(tool: str, exe: str, prompt: str, args: argparse.Namespace) -> list[str]:
    argv = [exe, "-m", args.model, "-p", prompt, "-n", str(args.n_predict), "-t", str(args.threads),
            "-c", str(args.ctx_size), "--temp", "0", "-no-cnv", "--no-display-prompt", "-ctv", args.cache_type_v]
    if tool == "llama.cpp":
        argv += shlex.split(args.llama_cli_args)
    return argv


def run_one(tool: str, exe: str, prompt_i: int, prompt: str, args: argparse.Namespace) -> Sample:
    argv = cli_argv(tool, exe, prompt, args)
    proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"bench.cli: {shlex.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    try:
        p_ms, p_n, e_ms, e_n = parse_perf(proc.stderr)
    except ValueError as e:
        raise SystemExit(f"bench.cli: {exe}: {e}\n{proc.stderr[-2000:]}")
    return Sample(tool, prompt_i, p_ms, p_n, e_ms, e_n, proc.stdout)


def find_tools(args: argparse.Namespace) -> dict[str, str]:
    up = args.llama_cli or shutil.which("llama-completion") or shutil.which("llama-cli")
    if not up:
        raise SystemExit("bench.cli: upstream llama-completion/llama-cli not found; pass --llama-cli PATH")
    ours = args.specee_cli
    if ours is None:
        from specee._tools import tool_path

        ours = str(tool_path("llama-cli"))
    for exe in (up, ours):
        if not Path(exe).is_file():
            raise SystemExit(f"bench.cli: not found: {exe}")
    return {"llama.cpp": up, "specee": ours}


def run_all(args: argparse.Namespace, exes: dict[str, str], prompts: list[str]) -> Result:
    res = Result()
    flip = False
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for tool in (TOOLS[::-1] if flip else TOOLS):  # alternate who goes first
                print(f"bench.cli: round {r + 1}/{args.rounds} prompt {i + 1}/{len(prompts)} {tool}",
                      file=sys.stderr, flush=True)
                res.samples.append(run_one(tool, exes[tool], i, prompt, args))
            flip = not flip
    return res


def overall_ts(samples: list[Sample], prompt: bool) -> float:
    if prompt:
        return sum(s.prompt_tokens for s in samples) / sum(s.prompt_ms for s in samples) * 1e3
    return sum(s.eval_runs for s in samples) / sum(s.eval_ms for s in samples) * 1e3


def format_table(res: Result, prompts: list[str], names: list[str] | None = None) -> str:
    rows = ["| prompt | tokens | llama.cpp decode t/s | specee decode t/s | ratio | same text |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    for i, prompt in enumerate(prompts):
        up, ours = res.of("llama.cpp", i), res.of("specee", i)
        tu = [s.decode_ts for s in up]
        to = [s.decode_ts for s in ours]
        same = "yes" if up[0].text == ours[0].text else "no"
        name = (names or prompts)[i].replace("\n", "\\n").replace("|", "\\|")
        name = name if len(name) <= 40 else name[:37] + "..."
        rows.append(f"| {name} | {ours[0].eval_runs} | {statistics.fmean(tu):.2f} ± {pstd(tu):.2f} | "
                    f"{statistics.fmean(to):.2f} ± {pstd(to):.2f} | {statistics.fmean(to) / statistics.fmean(tu):.3f} "
                    f"| {same} |")
    up, ours = res.of("llama.cpp"), res.of("specee")
    dec = overall_ts(ours, False) / overall_ts(up, False)
    rows.append(f"| **all (decode)** | {sum(s.eval_runs for s in ours)} | {overall_ts(up, False):.2f} | "
                f"{overall_ts(ours, False):.2f} | **{dec:.3f}** | |")
    pre = overall_ts(ours, True) / overall_ts(up, True)
    rows.append(f"| all (prompt eval) | {sum(s.prompt_tokens for s in ours)} | {overall_ts(up, True):.2f} | "
                f"{overall_ts(ours, True):.2f} | {pre:.3f} | |")
    return "\n".join(rows)


def pstd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 and all(x == x for x in xs) else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.cli", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--llama-cli", help="upstream llama-completion or llama-cli (default: from PATH)")
    ap.add_argument("--specee-cli", help="this runtime's llama-cli (default: the one installed with specee)")
    ap.add_argument("-p", "--prompt", action="append", help="prompt, repeatable (default: four built-in ones)")
    ap.add_argument("-f", "--prompts-file", help="prompts: MT-Bench question JSONL (first turns) or one per line")
    ap.add_argument("--chat", action="store_true",
                    help="wrap every prompt in the model's chat template (one user turn, assistant prompt), so "
                         "instruct models answer instead of ending at once; both CLIs get the same text")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of --prompts-file (default: all)")
    ap.add_argument("--explain", action="store_true",
                    help="for every prompt whose texts differ, find the first differing token and this runtime's "
                         "top-2 logit margin there")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default: 128)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads for both (default: 2)")
    ap.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size for both (default: 2048)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every prompt per tool (default: 3)")
    ap.add_argument("-ctv", "--cache-type-v", choices=("f16", "f32"), default="f16",
                    help="V cache type for both (default: f16, upstream's default; this runtime's is f32)")
    ap.add_argument("--llama-cli-args", default="-fa on",
                    help="extra arguments for upstream only (default: '-fa on', as this runtime always uses flash "
                         "attention)")
    ap.add_argument("--json", metavar="OUT", help="also save every sample as JSON")
    args = ap.parse_args(argv)
    if args.n_predict < 2 or args.rounds < 1 or args.threads < 1:
        ap.error("-n must be >= 2, --rounds and -t >= 1")
    if args.model is None:
        from specee.paths import default_model_path

        args.model = str(default_model_path())
    if not Path(args.model).is_file():
        ap.error(f"model file not found: {args.model}")
    prompts = args.prompt or (read_prompts(args.prompts_file, args.limit) if args.prompts_file else DEFAULT_PROMPTS)
    names = list(prompts)
    if args.chat:
        prompts = chat_prompts(args.model, prompts)
    exes = find_tools(args)
    res = run_all(args, exes, prompts)
    print(f"llama.cpp: {exes['llama.cpp']}\nspecee:    {exes['specee']}")
    print(f"model {Path(args.model).name}, -n {args.n_predict}, -t {args.threads}, --temp 0, {args.rounds} round(s); "
          f"decode t/s = eval runs / eval time from each CLI's timing lines; ratio = specee / llama.cpp\n")
    print(format_table(res, prompts, names))
    if args.explain:
        print("\n| prompt | first differing token | specee token there | specee top-2 margin |\n| --- | ---: | --- | ---: |")
        for i, prompt in enumerate(prompts):
            up, ours = res.of("llama.cpp", i)[0], res.of("specee", i)[0]
            if up.text != ours.text:
                k, piece, margin = explain(args.model, prompt, up.text, args.n_predict, args.threads)
                name = names[i].replace("\n", "\\n").replace("|", "\\|")[:40]
                print(f"| {name} | {k} | {piece!r} | {margin:.4f} |")
        n_same = sum(res.of("llama.cpp", i)[0].text == res.of("specee", i)[0].text for i in range(len(prompts)))
        print(f"\n{n_same} of {len(prompts)} continuations identical")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in res.samples], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
