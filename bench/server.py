"""Batching: what N sequences decoded together cost against each alone, in the library and through specee-server,
side by side with upstream llama.cpp's llama-server.

  python -m specee.bench.server [-m MODEL] [-t THREADS] [-np 4] [-c 4096] [--clients 1,2,4,8] [--max-tokens 64]
                                [--rounds 2] [--llama-server PATH] [--draft-head PATH] [--library]

(a) with --library: `Model.generate_batch` of N prompts against the same N prompts one after the other with
    `Model.generate_tokens` (greedy, ignore-EOS; the token lists are checked equal), decode tokens per second;
(b) specee-server on 127.0.0.1 (and, with --llama-server, upstream's llama-server beside it: the same file, -np,
    -t and -c, both running at once): C clients each sending --per-client requests one after another to
    /v1/completions (greedy, ignore-EOS, max tokens fixed, the same prompts), aggregate completion tokens per
    second and the p50 / p99 latency of a request, after a warm-up; rounds alternate which server goes first, so
    both share the machine's noise; each figure is the median over rounds, latencies pooled. Per client count,
    where the time goes: passes of the model (both servers' /metrics), milliseconds of wall time per pass and, for
    specee-server, the share of it inside the pass;
(c) one client against specee-cli on the same file, threads and tokens (its timing lines' decode speed, and its
    whole generation with the prompt), run between the servers' rounds;
(d) with --draft-head: one client, per-request mode eagle2 against plain (the same greedy text is checked).
Prints Markdown tables."""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from specee._tools import free_port, stop_process
from specee.model import Model

CHATS: list[str] = []  # --category's user messages (empty: PROMPTS)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors and explain", "The best way to learn a language is", "import numpy as np\n",
           "Dear hiring manager,", "In 1969, the first humans"]


def library(model: Model, n_seq: int, max_tokens: int) -> tuple[float, float]:
    """(tokens/s alone, tokens/s batched) for n_seq prompts."""
    prompts = [model.tokenize(PROMPTS[i % len(PROMPTS)]) for i in range(n_seq)]
    t0 = time.perf_counter()
    alone = []
    for p in prompts:
        model.kv_clear()
        alone.append(model.generate_tokens(p, max_tokens, temp=0, mode="plain", ignore_eos=True))
    t_alone = time.perf_counter() - t0
    model.kv_clear()
    t0 = time.perf_counter()
    batched = model.generate_batch(prompts, max_tokens, temp=0, mode="plain", ignore_eos=True)
    t_batched = time.perf_counter() - t0
    model.kv_clear()
    if batched != alone:
        raise SystemExit("batched tokens differ from alone")
    n = sum(len(x) for x in alone)
    return n / t_alone, n / t_batched


def post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise SystemExit(f"{path} on port {port}: {resp.status} {data}")
        return data
    finally:
        conn.close()


def metrics(port: int, prefix: str) -> dict[str, float]:
    """A server's Prometheus counters, without their prefix."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line[len(prefix):].split()[:2]
            out[name] = float(value)
    return out


@dataclass
class Server:
    name: str
    cmd: list[str]
    metrics_prefix: str  # its /metrics' names begin so
    pass_counter: str  # the counter of its passes
    port: int = 0
    proc: subprocess.Popen | None = None
    tps: dict[int, list[float]] = field(default_factory=dict)  # clients -> aggregate t/s per round
    lat: dict[int, list[float]] = field(default_factory=dict)  # clients -> every request's latency
    passes: dict[int, list[float]] = field(default_factory=dict)  # clients -> passes per round
    pass_s: dict[int, list[float]] = field(default_factory=dict)  # clients -> seconds inside passes per round
    wall: dict[int, list[float]] = field(default_factory=dict)  # clients -> wall seconds per round

    def start(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(600):
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} ended with status {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"{self.name} did not start: {' '.join(self.cmd)}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 30)
            self.proc = None

    def measure(self, clients: int, per_client: int, max_tokens: int) -> None:
        before = metrics(self.port, self.metrics_prefix)
        t0 = time.perf_counter()
        tps, lat = load(self.port, clients, per_client, max_tokens)
        wall = time.perf_counter() - t0
        after = metrics(self.port, self.metrics_prefix)
        self.tps.setdefault(clients, []).append(tps)
        self.lat.setdefault(clients, []).extend(lat)
        self.passes.setdefault(clients, []).append(after[self.pass_counter] - before[self.pass_counter])
        self.wall.setdefault(clients, []).append(wall)
        if "pass_seconds_total" in after:
            self.pass_s.setdefault(clients, []).append(after["pass_seconds_total"] - before["pass_seconds_total"])


def load(port: int, clients: int, per_client: int, max_tokens: int) -> tuple[float, list[float]]:
    """(aggregate completion tokens/s, each request's latency) of `clients` clients sending per_client requests
    each to /v1/completions."""

    def client(c: int) -> list[tuple[float, int]]:
        out = []
        for k in range(per_client):
            t0 = time.perf_counter()
            if CHATS:  # --category: a user message of an evaluation dataset, in the model's chat template
                r = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": CHATS[(c + k) % len(CHATS)]}],
                                                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            else:
                r = post(port, "/v1/completions", {"prompt": PROMPTS[(c + k) % len(PROMPTS)],
                                                   "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            out.append((time.perf_counter() - t0, r["usage"]["completion_tokens"]))
        return out

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [x for xs in pool.map(client, range(clients)) for x in xs]
    wall = time.perf_counter() - t0
    return sum(x[1] for x in results) / wall, [x[0] for x in results]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


CLI_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms.*\n.*?eval time =\s*([\d.]+) ms /\s*(\d+) runs")


def cli_run(args: argparse.Namespace, path: str, prompt: str) -> tuple[float, float]:
    """specee-cli on one prompt: (decode t/s of its eval line, generated tokens per second of prompt + eval)."""
    cli = shutil.which("specee-cli") or os.path.join(os.path.dirname(sys.executable), "specee-cli")
    cmd = [cli, "-m", path, "-p", prompt, "-n", str(args.max_tokens), "--temp", "0", "--ignore-eos", "-t",
           str(args.threads), "-no-cnv", "--mode", "plain", "--no-display-prompt"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    m = CLI_EVAL.search(run.stderr)
    if not m:
        raise SystemExit(f"no timing lines from {' '.join(cmd)}:\n{run.stderr[-2000:]}")
    prompt_ms, eval_ms, runs = float(m[1]), float(m[2]), int(m[3])
    return 1e3 * runs / eval_ms, 1e3 * (runs + 1) / (prompt_ms + eval_ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots of both servers (4)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context of both servers, shared by the slots")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-client", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="rounds over the client counts, alternating the servers")
    p.add_argument("--llama-server", default=None, help="upstream llama.cpp's llama-server binary")
    p.add_argument("--draft-head", default=None)
    p.add_argument("--library", action="store_true", help="also (a), the library without HTTP")
    p.add_argument("--mode", default="plain", help="specee-server's --mode (plain)")
    p.add_argument("--category", default=None,
                   help="the clients send chats: the first turns of this evaluation dataset (alpaca, gsm8k, humaneval, "
                        "mt_bench, qa, sum: --data-dir/NAME/question.jsonl) instead of the fixed prompts")
    p.add_argument("--data-dir", default=None, help="SpecEE's question folder, for --category")
    args = p.parse_args()
    if args.category:
        if not args.data_dir:
            raise SystemExit("--category needs --data-dir (the folder of NAME/question.jsonl)")
        path_q = os.path.join(args.data_dir, args.category, "question.jsonl")
        with open(path_q, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        CHATS[:] = [r["turns"][0] for r in rows]
    counts = [int(x) for x in args.clients.split(",")]

    model = Model(args.model, n_ctx=4096, n_threads=args.threads)
    path = model.path
    print(f"## {model.desc} ({os.path.basename(path)}), {args.threads} thread(s), {args.max_tokens} tokens per "
          f"request, specee-server --mode {args.mode}, prompts: {args.category or 'fixed'}, -np {args.parallel} -c {args.ctx_size}, {args.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start\n")
    if args.library:
        print("| sequences | alone t/s | batched t/s | ratio |\n|---|---|---|---|")
        for n in counts:
            a, b = library(model, n, args.max_tokens)
            print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |", flush=True)
        print()
    model.close()

    common = ["-m", path, "-np", str(args.parallel), "-t", str(args.threads), "-c", str(args.ctx_size),
              "--host", "127.0.0.1", "--metrics"]
    specee_cmd = [sys.executable, "-m", "specee.server", *common, "--mode", args.mode]
    specee_cmd += ["--draft-head", args.draft_head] if args.draft_head else []
    servers = [Server("specee-server", specee_cmd, "specee:", "passes_total")]
    if args.llama_server:
        servers.append(Server("llama-server", [args.llama_server, *common, "--no-webui"], "llamacpp:",
                              "n_decode_total"))
    cli: list[tuple[float, float]] = []
    try:
        for s in servers:
            s.start()
        for s in servers:  # warm-up: every client count once, not counted
            for c in sorted(set([1, max(counts)])):
                load(s.port, c, 1, args.max_tokens)
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for c in counts:
                for s in order:
                    s.measure(c, args.per_client, args.max_tokens)
            for k in range(args.per_client):
                cli.append(cli_run(args, path, PROMPTS[(r + k) % len(PROMPTS)]))
            print(f"round {r + 1}: " + "; ".join(f"{s.name} " + " ".join(f"{c}:{s.tps[c][-1]:.1f}" for c in counts)
                                                 for s in servers) + " t/s", flush=True)
        sp, up = servers[0], servers[1] if len(servers) > 1 else None

        def med(s: Server, c: int) -> float:
            return statistics.median(s.tps[c])

        print(f"\n| clients | specee-server t/s | vs its 1 client |"
              + (" llama-server t/s | vs its 1 client | specee / llama |" if up else "")
              + " specee p50 / p99 s |" + (" llama p50 / p99 s |" if up else ""))
        print("|---" * (8 if up else 4) + "|")
        for c in counts:
            row = f"| {c} | {med(sp, c):.1f} | {med(sp, c) / med(sp, counts[0]):.2f}x |"
            if up:
                row += f" {med(up, c):.1f} | {med(up, c) / med(up, counts[0]):.2f}x | {med(sp, c) / med(up, c):.2f}x |"
            row += f" {pct(sp.lat[c], 0.5):.2f} / {pct(sp.lat[c], 0.99):.2f} |"
            if up:
                row += f" {pct(up.lat[c], 0.5):.2f} / {pct(up.lat[c], 0.99):.2f} |"
            print(row)
        print("\nWhere the time goes (sums over rounds): passes of the model, tokens generated per pass, wall "
              "milliseconds per pass; specee-server's share of the wall inside its passes:\n")
        print("| clients |" + "".join(f" {s.name} passes | tokens / pass | ms / pass |" for s in servers)
              + " specee in passes |")
        print("|---" * (2 + 3 * len(servers)) + "|")
        for c in counts:
            row = f"| {c} |"
            for s in servers:
                n_pass, wall = sum(s.passes[c]), sum(s.wall[c])
                toks = c * args.per_client * args.max_tokens * len(s.passes[c])
                row += f" {n_pass:.0f} | {toks / max(n_pass, 1):.2f} | {1e3 * wall / max(n_pass, 1):.1f} |"
            print(row + f" {sum(sp.pass_s[c]) / sum(sp.wall[c]):.0%} |")
        cli_decode = statistics.median(x[0] for x in cli)
        cli_whole = statistics.median(x[1] for x in cli)
        one = med(sp, counts[0])
        print(f"\nspecee-cli, same file, -t {args.threads}, {args.max_tokens} tokens, {len(cli)} runs (median): "
              f"decode {cli_decode:.1f} t/s (its eval line), with the prompt {cli_whole:.1f} t/s; specee-server at "
              f"{counts[0]} client: {one:.1f} t/s = {one / cli_decode:.2f}x the CLI's decode, "
              f"{one / cli_whole:.2f}x its whole generation")

        if args.draft_head:
            print("\n| mode, 1 client | t/s | same text as plain |\n|---|---|---|")
            texts: dict[str, list[str]] = {}
            for mode in ("plain", "eagle2"):
                t0, n = time.perf_counter(), 0
                texts[mode] = []
                for prompt in PROMPTS[:4]:
                    r = post(sp.port, "/completion", {"prompt": prompt, "n_predict": args.max_tokens,
                                                      "temperature": 0, "mode": mode})
                    n += r["tokens_predicted"]
                    texts[mode].append(r["content"])
                same = [a == b for a, b in zip(texts[mode], texts["plain"])]
                print(f"| {mode} | {n / (time.perf_counter() - t0):.1f} | {sum(same)} of {len(same)} prompts |")
            for a, b in zip(texts["plain"], texts["eagle2"]):
                if a != b:
                    print(f"differs: {a!r}\n    vs: {b!r}")
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
