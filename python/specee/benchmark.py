"""Side-by-side speed and memory of this runtime (specee-bench) and upstream llama.cpp (llama-bench).

Both tools run the same tests on the same GGUF files with the same threads, prompt/generation lengths
and repetitions, in one run. Every test (pp N, tg N) of every model runs in its own child process,
alternating between the tools, so that the peak RSS of each child (ru_maxrss from wait4) measures one
test and the two tools see the same machine state. Both tools print llama-bench's JSON, which is parsed
here into one markdown table of tokens/s and ratios (specee / llama.cpp).

    python -m specee.benchmark -m model-f16.gguf -m model-q4_0.gguf -t 2 -p 512 -n 128 -r 5 \\
        --llama-bench path/to/llama-bench --json result.json

Flash attention: this runtime always uses ggml_flash_attn_ext with an F16 KV cache. llama-bench's default
(-fa auto) resolves to on for a CPU-only build, but it is passed explicitly (-fa 1) so the comparison
stays like-for-like whatever the upstream default is.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = ("llama.cpp", "specee")


@dataclass
class TestRun:
    """The results of one tool on one test of one model, over all rounds."""

    tool: str
    model: str
    test: str  # "pp512" or "tg128"
    model_type: str = ""
    build: str = ""
    samples_ts: list[float] = field(default_factory=list)
    peak_rss_kib: list[int] = field(default_factory=list)  # one per child process

    @property
    def mean_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0


# ---- running the tools -------------------------------------------------------------------------


def run_child(argv: list[str]) -> tuple[str, int]:
    """Run one benchmark process; return its stdout and its peak RSS in KiB."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err)
        _, status, rusage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            tail = err.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"benchmark: {shlex.join(argv)} failed (exit {proc.returncode}):\n{tail}")
        return out.read().decode(), rusage.ru_maxrss  # KiB on Linux


def tool_argv(tool: str, exe: str, model: str, n_prompt: int, n_gen: int, args: argparse.Namespace) -> list[str]:
    argv = [exe, "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-t", str(args.threads),
            "-r", str(args.repetitions), "-b", str(args.batch_size), "-fa", "1", "-o", "json",
            "-ctv", args.cache_type_v]
    if tool == "llama.cpp":
        # one ubatch per batch, as this runtime evaluates a batch in one graph
        argv += ["-ub", str(args.batch_size), *shlex.split(args.llama_bench_args)]
    return argv


def run_test(tool: str, exe: str, model: str, n_prompt: int, n_gen: int, args: argparse.Namespace,
             run: TestRun) -> None:
    stdout, rss_kib = run_child(tool_argv(tool, exe, model, n_prompt, n_gen, args))
    try:
        (result,) = json.loads(stdout)
    except ValueError as e:
        raise SystemExit(f"benchmark: cannot parse the JSON output of {exe}: {e}\n{stdout[:2000]}")
    run.model_type = result["model_type"]
    run.build = str(result.get("build_commit", ""))
    run.samples_ts += [float(x) for x in result["samples_ts"]]
    run.peak_rss_kib.append(rss_kib)


def find_tools(args: argparse.Namespace) -> dict[str, str]:
    llama_bench = args.llama_bench or shutil.which("llama-bench")
    if not llama_bench or not os.access(llama_bench, os.X_OK):
        raise SystemExit("benchmark: upstream llama-bench not found; build llama.cpp and pass --llama-bench PATH "
                         "(or put llama-bench on PATH)")
    specee_bench = args.specee_bench
    if specee_bench is None:
        from specee._tools import tool_path

        specee_bench = str(tool_path("specee-bench"))
    if not os.access(specee_bench, os.X_OK):
        raise SystemExit(f"benchmark: specee-bench not found or not executable: {specee_bench}")
    return {"llama.cpp": llama_bench, "specee": specee_bench}


def run_all(args: argparse.Namespace, exes: dict[str, str]) -> list[TestRun]:
    tests = ([(f"pp{args.n_prompt}", args.n_prompt, 0)] if args.n_prompt > 0 else []) + \
            ([(f"tg{args.n_gen}", 0, args.n_gen)] if args.n_gen > 0 else [])
    runs: list[TestRun] = []
    flip = False
    for model in args.model:
        for name, n_prompt, n_gen in tests:
            pair = {tool: TestRun(tool, model, name) for tool in TOOLS}
            for _ in range(args.rounds):
                # alternate which tool goes first so that drift (heat, other load) hits both alike
                for tool in (TOOLS[::-1] if flip else TOOLS):
                    print(f"benchmark: {Path(model).name} {name} {tool}", file=sys.stderr, flush=True)
                    run_test(tool, exes[tool], model, n_prompt, n_gen, args, pair[tool])
                flip = not flip
            runs += pair.values()
    return runs


# ---- report ------------------------------------------------------------------------------------


def format_table(runs: list[TestRun]) -> str:
    rows = ["| model | test | llama.cpp t/s | specee t/s | ratio |", "| --- | --- | ---: | ---: | ---: |"]
    models = list(dict.fromkeys(r.model for r in runs))
    for model in models:
        by_test: dict[str, dict[str, TestRun]] = {}
        for r in runs:
            if r.model == model:
                by_test.setdefault(r.test, {})[r.tool] = r
        name = Path(model).name
        for test, pair in by_test.items():
            up, ours = pair["llama.cpp"], pair["specee"]
            rows.append(f"| {name} | {test} | {up.mean_ts:.2f} ± {up.stddev_ts:.2f} | "
                        f"{ours.mean_ts:.2f} ± {ours.stddev_ts:.2f} | {ours.mean_ts / up.mean_ts:.3f} |")
        peak = {tool: max(max(p[tool].peak_rss_kib) for p in by_test.values()) / 1024 for tool in TOOLS}
        rows.append(f"| {name} | peak RSS MiB | {peak['llama.cpp']:.1f} | {peak['specee']:.1f} | "
                    f"{peak['specee'] / peak['llama.cpp']:.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m specee.benchmark",
        description="Run specee-bench and upstream llama-bench side by side on the same GGUF files and "
                    "compare tokens/s (prompt processing and generation) and peak RSS.")
    ap.add_argument("-m", "--model", action="append", help="GGUF file, repeatable (default: the embedded SmolLM2)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens of the pp test, 0 skips it")
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens of the tg test, 0 skips it")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="timed repetitions in each child run")
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for both")
    ap.add_argument("-b", "--batch-size", type=int, default=2048,
                    help="batch size for both (llama-bench also gets it as -ub)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="child runs per tool and test, alternating which tool goes first (default: 1)")
    ap.add_argument("-ctv", "--cache-type-v", choices=("f16", "f32"), default="f16",
                    help="V cache type in both (default: f16, llama-bench's default; this runtime's is f32)")
    ap.add_argument("--llama-bench", help="upstream llama-bench executable (default: from PATH)")
    ap.add_argument("--specee-bench", help="specee-bench executable (default: the one installed with specee)")
    ap.add_argument("--llama-bench-args", default="",
                    help="extra arguments for llama-bench only, e.g. '--repack 0' (breaks like-for-like)")
    ap.add_argument("--json", metavar="OUT", help="also save every sample and RSS as JSON")
    args = ap.parse_args(argv)
    if min(args.repetitions, args.threads, args.rounds, args.batch_size) < 1 or min(args.n_prompt, args.n_gen) < 0:
        ap.error("-r, -t, -b and --rounds must be positive, -p and -n not negative")
    if args.n_prompt == 0 and args.n_gen == 0:
        ap.error("nothing to measure: -p and -n are both 0")
    if not args.model:
        from specee.paths import default_model_path

        args.model = [default_model_path()]
    for model in args.model:
        if not os.path.isfile(model):
            ap.error(f"model file not found: {model}")

    exes = find_tools(args)
    runs = run_all(args, exes)

    up_build = next(r.build for r in runs if r.tool == "llama.cpp")
    print(f"llama.cpp: {exes['llama.cpp']} (build {up_build})")
    print(f"specee:    {exes['specee']}")
    print(f"threads {args.threads}, -p {args.n_prompt}, -n {args.n_gen}, -r {args.repetitions} x {args.rounds} "
          f"round(s), batch {args.batch_size} (llama.cpp -ub {args.batch_size}); flash attention on in both "
          f"(llama-bench -fa 1; specee always uses ggml_flash_attn_ext), {args.cache_type_v.upper()} V cache in both"
          + (f"; llama-bench extra args: {args.llama_bench_args}" if args.llama_bench_args else ""))
    print("ratio = specee / llama.cpp (t/s: higher is better for specee; RSS: lower is better)\n")
    print(format_table(runs))
    if args.json:
        report = {"llama_bench": exes["llama.cpp"], "specee_bench": exes["specee"], "llama_cpp_build": up_build,
                  "args": {k: v for k, v in vars(args).items() if k != "json"},
                  "runs": [dict(asdict(r), mean_ts=r.mean_ts, stddev_ts=r.stddev_ts) for r in runs]}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
