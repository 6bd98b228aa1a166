"""Side-by-side speed and memory of this runtime (specee-bench) and upstream llama.cpp (llama-bench).

Both tools run the same tests on the same GGUF files with the same threads, prompt/generation lengths
and repetitions, in one run. Every test (pp N, tg N) of every model runs in its own child process,
alternating between the tools, so that the peak RSS of each child (ru_maxrss from wait4) measures one
test and the two tools see the same machine state. Both tools print llama-bench's JSON, which is parsed
here into one markdown table of tokens/s and ratios (specee / llama.cpp).

    python -m specee.bench.runtime -m model-f16.gguf -m model-q4_0.gguf -t 2 -p 512 -n 128 -r 5 \\
        --llama-bench path/to/llama-bench --json result.json

Two more tables from the same runs:

- `--pass-cost 1,2,4,...`: the time of one pass of N tokens (a pp N test) in units of a single-token pass,
  for both tools: what verifying an EAGLE tree of N - 1 draft tokens costs. The row of the default tree that
  this runtime picks for the file is marked.
- `-ngl 0,16 --rpc-local`: each tool offloads layers to a ggml RPC server of its own started here on
  127.0.0.1 (this runtime's specee-rpc-server, upstream's rpc-server found next to llama-bench) and stopped at
  the end; llama.cpp offloads the last layers, this runtime the ones `--offload-order` says (default last,
  like for like). -ngl 0 is the CPU-only baseline.

Flash attention: this runtime always uses ggml_flash_attn_ext. llama-bench's default (-fa auto) resolves to
on for a CPU-only build, but it is passed explicitly (-fa 1) so the comparison stays like-for-like whatever
the upstream default is.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specee._tools import free_port, stop_process

TOOLS = ("llama.cpp", "specee")


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}")


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
    def n_tokens_ms(self) -> float:
        """Milliseconds per run of the test (pp N: one pass of N tokens), from the mean rate."""
        n = int(self.test.split()[0][2:])
        return n / self.mean_ts * 1e3

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
            raise SystemExit(f"bench.runtime: {shlex.join(argv)} failed (exit {proc.returncode}):\n{tail}")
        return out.read().decode(), rusage.ru_maxrss  # KiB on Linux


def tool_argv(tool: str, exe: str, model: str, n_prompt: int, n_gen: int, ngl: int | None,
              args: argparse.Namespace) -> list[str]:
    argv = [exe, "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-t", str(args.threads),
            "-r", str(args.repetitions), "-b", str(args.batch_size), "-fa", "1", "-o", "json",
            "-ctv", args.cache_type_v]
    if ngl is not None:
        argv += ["-ngl", str(ngl)] + (["--rpc", args.rpc_endpoints[tool]] if args.rpc_endpoints else [])
        argv += ["--offload-order", args.offload_order] if tool == "specee" else []
    if tool == "llama.cpp":
        # one ubatch per batch, as this runtime evaluates a batch in one graph
        argv += ["-ub", str(args.batch_size), *shlex.split(args.llama_bench_args)]
    return argv


def run_test(tool: str, exe: str, model: str, n_prompt: int, n_gen: int, ngl: int | None,
             args: argparse.Namespace, run: TestRun) -> None:
    stdout, rss_kib = run_child(tool_argv(tool, exe, model, n_prompt, n_gen, ngl, args))
    try:
        (result,) = json.loads(stdout)
    except ValueError as e:
        raise SystemExit(f"bench.runtime: cannot parse the JSON output of {exe}: {e}\n{stdout[:2000]}")
    run.model_type = result["model_type"]
    run.build = str(result.get("build_commit", ""))
    run.samples_ts += [float(x) for x in result["samples_ts"]]
    run.peak_rss_kib.append(rss_kib)


def start_rpc_server(stack: ExitStack, exe: str, threads: int) -> str:
    """A ggml RPC server on 127.0.0.1 and a free port, stopped when the stack closes; returns HOST:PORT."""
    port = free_port()
    log = stack.enter_context(tempfile.TemporaryFile())
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    stack.callback(stop_process, proc, 10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"bench.runtime: {exe} exited ({proc.returncode}):\n{log.read().decode()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"bench.runtime: {exe} did not listen on 127.0.0.1:{port} within 30 s")


def find_tools(args: argparse.Namespace) -> dict[str, str]:
    llama_bench = args.llama_bench or shutil.which("llama-bench")
    if not llama_bench or not os.access(llama_bench, os.X_OK):
        raise SystemExit("bench.runtime: upstream llama-bench not found; build llama.cpp and pass --llama-bench PATH "
                         "(or put llama-bench on PATH)")
    specee_bench = args.specee_bench
    if specee_bench is None:
        from specee._tools import tool_path

        specee_bench = str(tool_path("specee-bench"))
    if not os.access(specee_bench, os.X_OK):
        raise SystemExit(f"bench.runtime: specee-bench not found or not executable: {specee_bench}")
    return {"llama.cpp": llama_bench, "specee": specee_bench}


def find_rpc_servers(args: argparse.Namespace, exes: dict[str, str]) -> dict[str, str]:
    """The RPC server of each tool: upstream's from --rpc-server or next to llama-bench, ours installed."""
    from specee._tools import tool_path

    bin_dir = Path(exes["llama.cpp"]).resolve().parent
    upstream = args.rpc_server or next((str(bin_dir / n) for n in ("rpc-server", "ggml-rpc-server")
                                        if os.access(bin_dir / n, os.X_OK)), None)
    if not upstream:
        raise SystemExit(f"bench.runtime: --rpc-local needs upstream's rpc-server (built with -DGGML_RPC=ON): none in "
                         f"{bin_dir}; pass --rpc-server PATH")
    return {"llama.cpp": upstream, "specee": str(tool_path("specee-rpc-server"))}


def tests_of(args: argparse.Namespace) -> list[tuple[str, int, int, int | None]]:
    """(name, n_prompt, n_gen, ngl) of every test, per model."""
    tests = [(f"pp{n}", n, 0) for n in args.pass_cost] + \
            ([(f"pp{args.n_prompt}", args.n_prompt, 0)] if args.n_prompt > 0 and not args.pass_cost else []) + \
            ([(f"tg{args.n_gen}", 0, args.n_gen)] if args.n_gen > 0 else [])
    if not args.n_gpu_layers:
        return [(name, p, n, None) for name, p, n in tests]
    return [(f"{name} ngl{ngl}", p, n, ngl) for ngl in args.n_gpu_layers for name, p, n in tests]


def run_all(args: argparse.Namespace, exes: dict[str, str]) -> list[TestRun]:
    runs: list[TestRun] = []
    flip = False
    for model in args.model:
        for name, n_prompt, n_gen, ngl in tests_of(args):
            pair = {tool: TestRun(tool, model, name) for tool in TOOLS}
            for _ in range(args.rounds):
                # alternate which tool goes first so that drift (heat, other load) hits both alike
                for tool in (TOOLS[::-1] if flip else TOOLS):
                    print(f"bench.runtime: {Path(model).name} {name} {tool}", file=sys.stderr, flush=True)
                    run_test(tool, exes[tool], model, n_prompt, n_gen, ngl, args, pair[tool])
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


def default_tree_pass(model: str) -> int:
    """Tokens in a verification pass of this runtime's default EAGLE tree for the file (root included)."""
    from specee.model import Model

    with Model(model, n_ctx=64, n_threads=1) as m:
        return 4 if "default EAGLE tree: three draft tokens" in m.placement else 2  # the loader's own words


def format_pass_cost(runs: list[TestRun], sizes: list[int]) -> str:
    """ms per pass of N tokens, and the same in units of each tool's own single-token pass."""
    rows = ["| model | N | llama.cpp ms/pass | specee ms/pass | llama.cpp cost (passes of 1) | "
            "specee cost (passes of 1) | default tree |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for model in dict.fromkeys(r.model for r in runs):
        ms = {(r.tool, r.test): r.n_tokens_ms for r in runs if r.model == model and r.test.startswith("pp")}
        tree = default_tree_pass(model)
        for n in sizes:
            up, ours = ms[("llama.cpp", f"pp{n}")], ms[("specee", f"pp{n}")]
            mark = f"<- {tree - 1} draft token{'s' if tree > 2 else ''} + root" if n == tree else ""
            rows.append(f"| {Path(model).name} | {n} | {up:.1f} | {ours:.1f} | {up / ms[('llama.cpp', 'pp1')]:.2f} | "
                        f"{ours / ms[('specee', 'pp1')]:.2f} | {mark} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m specee.bench.runtime",
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
    ap.add_argument("--pass-cost", metavar="N,N,...", type=int_list, default=[],
                    help="also time one pass of N tokens for each N (pp N, replacing the -p test) and print its cost "
                         "in single-token passes (1 is added): what verifying an EAGLE tree costs")
    ap.add_argument("-ngl", "--n-gpu-layers", metavar="N,N,...", type=int_list, default=[],
                    help="layers offloaded by both tools, one set of tests per value (with --rpc-local: to a local RPC "
                         "server; 0: the CPU-only baseline)")
    ap.add_argument("--offload-order", choices=("first", "last"), default="last",
                    help="which layers this runtime offloads (llama.cpp: always the last; default: last)")
    ap.add_argument("--rpc-local", action="store_true",
                    help="start a ggml RPC server for each tool on 127.0.0.1 (-t threads each) and offload -ngl "
                         "layers to it; stopped at the end")
    ap.add_argument("--rpc-server", help="upstream's rpc-server (default: next to llama-bench)")
    ap.add_argument("--json", metavar="OUT", help="also save every sample and RSS as JSON")
    args = ap.parse_args(argv)
    if min(args.repetitions, args.threads, args.rounds, args.batch_size) < 1 or min(args.n_prompt, args.n_gen) < 0:
        ap.error("-r, -t, -b and --rounds must be positive, -p and -n not negative")
    if args.pass_cost:
        if min(args.pass_cost) < 1:
            ap.error("--pass-cost sizes must be >= 1")
        args.pass_cost = sorted({1, *args.pass_cost})
    if args.n_prompt == 0 and args.n_gen == 0 and not args.pass_cost:
        ap.error("nothing to measure: -p and -n are both 0")
    if min(args.n_gpu_layers, default=0) < 0:
        ap.error("-ngl values must be >= 0")
    if args.rpc_local and not args.n_gpu_layers:
        ap.error("--rpc-local offloads -ngl layers: give -ngl")
    if not args.model:
        from specee.paths import default_model_path

        args.model = [default_model_path()]
    for model in args.model:
        if not os.path.isfile(model):
            ap.error(f"model file not found: {model}")

    exes = find_tools(args)
    with ExitStack() as stack:
        args.rpc_endpoints = {}
        if args.rpc_local:
            servers = find_rpc_servers(args, exes)
            args.rpc_endpoints = {tool: start_rpc_server(stack, servers[tool], args.threads) for tool in TOOLS}
        runs = run_all(args, exes)

    up_build = next(r.build for r in runs if r.tool == "llama.cpp")
    print(f"llama.cpp: {exes['llama.cpp']} (build {up_build})")
    print(f"specee:    {exes['specee']}")
    prompt = f"-p {','.join(map(str, args.pass_cost))}" if args.pass_cost else f"-p {args.n_prompt}"
    print(f"threads {args.threads}, {prompt}, -n {args.n_gen}, -r {args.repetitions} x {args.rounds} "
          f"round(s), batch {args.batch_size} (llama.cpp -ub {args.batch_size}); flash attention on in both "
          f"(llama-bench -fa 1; specee always uses ggml_flash_attn_ext), {args.cache_type_v.upper()} V cache in both"
          + (f"; llama-bench extra args: {args.llama_bench_args}" if args.llama_bench_args else ""))
    if args.n_gpu_layers:
        print(f"-ngl {','.join(map(str, args.n_gpu_layers))}: llama.cpp offloads the last layers, specee the "
              f"{args.offload_order}" + (f"; each tool to its own RPC server on 127.0.0.1 (-t {args.threads})"
                                         if args.rpc_local else "; no RPC server given: CPU only"))
    print("ratio = specee / llama.cpp (t/s: higher is better for specee; RSS: lower is better)\n")
    print(format_table(runs))
    for ngl in (args.n_gpu_layers or [None]) if args.pass_cost else []:
        print("\nCost of one pass of N tokens (pp N) in single-token passes of the same tool"
              + (f", -ngl {ngl}" if ngl is not None else ""))
        picked = [r for r in runs if " " not in r.test] if ngl is None else \
            [replace(r, test=r.test.split(" ")[0]) for r in runs if r.test.endswith(f" ngl{ngl}")]
        print(format_pass_cost(picked, args.pass_cost))
    if args.json:
        report = {"llama_bench": exes["llama.cpp"], "specee_bench": exes["specee"], "llama_cpp_build": up_build,
                  "args": {k: v for k, v in vars(args).items() if k not in ("json", "rpc_endpoints")},
                  "runs": [dict(asdict(r), mean_ts=r.mean_ts, stddev_ts=r.stddev_ts) for r in runs]}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
