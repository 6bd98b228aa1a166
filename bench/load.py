"""Plain decoding on a busy machine: this runtime's llama-cli and upstream llama.cpp's, side by side in one run,
on an idle machine and beside a competing CPU-bound load that the benchmark starts and stops itself.

    python -m specee.bench.load [--llama-cli PATH] [-m FILE] [-n 16] [--threads 1,2,4] [--load 2] [--rounds 3]

The load: --load processes, each a busy loop that ends by itself after --load-limit seconds (and is killed when the
benchmark ends); it runs only during the "loaded" half of every round. Per condition (idle, loaded) and -t, both
CLIs decode the same prompts greedily (bench.cli's runner: same file, prompt, -n, threads), in an alternating order;
the median of the rounds is kept; this runtime with --mode plain. Prints decode tokens/s (eval runs / eval time of
each CLI's timing lines) and the whole run's wall time (a run past --timeout: 0 tokens/s and the limit), the ratio
specee / llama.cpp, and each tool's speed against its own -t = usable CPUs under the same condition (what
oversubscribing costs). Without --llama-cli (or llama-completion on PATH) only this
runtime runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specee.bench.cli import cli_argv
from specee.bench.perf import parse_perf

PROMPTS = ["Once upon a time, in a small village by the sea, there lived",
           "The main differences between Python lists and tuples are"]
BUSY = "import time\nend = time.monotonic() + {limit}\nx = 0\nwhile time.monotonic() < end:\n    x += 1\n"


@dataclass
class Row:
    condition: str
    threads: int
    tool: str
    decode_ts: float
    wall_s: float


class Load:
    """n busy-loop processes, each bounded by its own deadline; stopped on exit."""

    def __init__(self, n: int, limit_s: float):
        self.n, self.limit_s, self.procs = n, limit_s, []

    def __enter__(self) -> "Load":
        code = BUSY.format(limit=self.limit_s)
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.n)]
        time.sleep(0.5)  # let the scheduler see them
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def run_one(tool: str, exe: str, prompt: str, args: argparse.Namespace) -> tuple[float, float]:
    """(decode tokens/s, wall s) of one run; a run past --timeout counts as 0 tokens/s and the limit."""
    t0 = time.perf_counter()
    try:
        argv = cli_argv(tool, exe, prompt, args) + (["--mode", "plain"] if tool == "specee" else [])
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                              stdin=subprocess.DEVNULL, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return 0.0, args.timeout
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench.load: {exe} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    _, _, eval_ms, eval_runs = parse_perf(proc.stderr)
    return eval_runs / eval_ms * 1e3, wall


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def measure(exes: dict[str, str], args: argparse.Namespace, condition: str, flip: bool) -> list[Row]:
    rows = []
    for t in args.thread_list:
        args.threads = t
        tools = sorted(exes, reverse=flip)
        for i, prompt in enumerate(PROMPTS):
            for tool in tools:
                print(f"bench.load: {condition} -t {t} prompt {i + 1} {tool}", file=sys.stderr, flush=True)
                rows.append(Row(condition, t, tool, *run_one(tool, exes[tool], prompt, args)))
            tools = tools[::-1]
    return rows


def table(rows: list[Row], exes: dict[str, str], cores: int) -> str:
    def ratio(a: float, b: float) -> str:
        return "-" if b != b else f"{a / b:.2f}" if b > 0 else "inf" if a > 0 else "-"  # b: NaN where not measured

    def med(cond: str, t: int, tool: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in rows if (r.condition, r.threads, r.tool) == (cond, t, tool))

    up = "llama.cpp" in exes
    head = "| condition | -t | specee t/s | specee wall s | specee x its -t " + str(cores)
    head += " | llama.cpp t/s | llama.cpp wall s | llama.cpp x its -t " + str(cores) + " | specee / llama.cpp |" if up else " |"
    out = [head, "| --- |" + " ---: |" * (head.count("|") - 2)]
    ts = sorted({r.threads for r in rows})
    for cond in dict.fromkeys(r.condition for r in rows):
        for t in ts:
            cells = []
            for tool in ("specee", "llama.cpp") if up else ("specee",):
                d = med(cond, t, tool, "decode_ts")
                base = med(cond, cores, tool, "decode_ts") if cores in ts else float("nan")
                cells += [f"{d:.1f}", f"{med(cond, t, tool, 'wall_s'):.2f}", ratio(d, base)]
            if up:
                cells.append(f"**{ratio(med(cond, t, 'specee', 'decode_ts'), med(cond, t, 'llama.cpp', 'decode_ts'))}**")
            out.append(f"| {cond} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--llama-cli", help="upstream llama-completion (default: from PATH; none: this runtime only)")
    ap.add_argument("--specee-cli", help="this runtime's llama-cli (default: the installed one)")
    ap.add_argument("-n", "--n-predict", type=int, default=16, help="tokens per run (16)")
    ap.add_argument("--threads", default="1,2,4", help="-t values (1,2,4)")
    ap.add_argument("--load", type=int, default=usable_cpus(), help="competing busy processes (the usable CPUs)")
    ap.add_argument("--load-limit", type=float, default=900, help="seconds after which a load process ends itself")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both conditions; the median is kept (3)")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=60, help="seconds a run may take: 0 tokens/s past it (60)")
    args = ap.parse_args(argv)
    try:
        args.thread_list = [int(x) for x in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: a comma list of integers, not {args.threads!r}")
    if args.load < 1 or args.rounds < 1 or min(args.thread_list) < 1 or args.n_predict < 2:
        ap.error("--load, --rounds and -t must be >= 1, -n >= 2")
    if args.model is None:
        from specee.paths import default_model_path

        args.model = str(default_model_path())
    args.cache_type_v, args.llama_cli_args = "f16", "-fa on"
    from specee._tools import tool_path

    exes = {"specee": args.specee_cli or str(tool_path("llama-cli"))}
    up = args.llama_cli or shutil.which("llama-completion")
    if up:
        if not Path(up).is_file():
            ap.error(f"not found: {up}")
        exes["llama.cpp"] = up
    rows: list[Row] = []
    for r in range(args.rounds):
        rows += measure(exes, args, "idle", r % 2 == 1)
        with Load(args.load, args.load_limit):
            rows += measure(exes, args, f"load {args.load}", r % 2 == 1)
    cores = usable_cpus()
    print(f"model {Path(args.model).name}, -n {args.n_predict}, --temp 0, {len(PROMPTS)} prompts, median of "
          f"{args.rounds} round(s); {cores} usable CPUs; load: {args.load} busy-loop processes"
          f"{'' if up else '; no upstream llama.cpp (--llama-cli)'}")
    print(table(rows, exes, cores))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
