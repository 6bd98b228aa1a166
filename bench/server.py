"""Batching: what N sequences decoded together cost against each alone, in the library and through specee-server.

  python -m specee.bench.server [-m MODEL] [-t THREADS] [--clients 1,2,4,8] [--max-tokens 64] [--draft-head PATH]

(a) the library: `Model.generate_batch` of N prompts against the same N prompts one after the other with
    `Model.generate_tokens` (greedy, ignore-EOS; the token lists are checked equal), decode tokens per second;
(b) specee-server on 127.0.0.1 with -np the largest client count: C clients each sending requests one after another
    (greedy, ignore-EOS, max tokens fixed), aggregate completion tokens per second and the p50 / p99 latency of a
    request, after a warm-up round; the single-sequence API's decode speed on the same file beside it;
(c) with --draft-head: one client, per-request mode eagle2 against plain (the same greedy text is checked).
Prints Markdown tables."""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import socket
import statistics
import subprocess
import sys
import time

from specee.model import Model

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
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def serve(args: argparse.Namespace, n_parallel: int) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specee.server", "--port", str(port), "-np", str(n_parallel), "-t", str(args.threads),
           "-c", str(1024 * n_parallel), "--mode", "plain"]
    cmd += ["-m", args.model] if args.model else []
    cmd += ["--draft-head", args.draft_head] if args.draft_head else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the server did not start")


def load(port: int, clients: int, per_client: int, max_tokens: int) -> tuple[float, float, float]:
    """(aggregate tokens/s, p50 s, p99 s) of `clients` clients sending per_client requests each."""

    def client(c: int) -> list[tuple[float, int]]:
        out = []
        for k in range(per_client):
            t0 = time.perf_counter()
            r = post(port, "/v1/completions", {"prompt": PROMPTS[(c + k) % len(PROMPTS)], "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True})
            out.append((time.perf_counter() - t0, r["usage"]["completion_tokens"]))
        return out

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [x for xs in pool.map(client, range(clients)) for x in xs]
    wall = time.perf_counter() - t0
    lat = sorted(x[0] for x in results)
    return sum(x[1] for x in results) / wall, statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-client", type=int, default=4)
    p.add_argument("--draft-head", default=None)
    args = p.parse_args()
    counts = [int(x) for x in args.clients.split(",")]

    model = Model(args.model, n_ctx=4096, n_threads=args.threads)
    print(f"## {model.desc}, {args.threads} thread(s), {args.max_tokens} tokens per request\n")
    print("| sequences | alone t/s | batched t/s | ratio |\n|---|---|---|---|")
    single = 0.0
    for n in counts:
        a, b = library(model, n, args.max_tokens)
        single = single or a
        print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |", flush=True)
    model.close()

    proc, port = serve(args, max(counts))
    try:
        load(port, 1, 1, 8)  # warm-up
        print(f"\n| clients (-np {max(counts)}) | aggregate t/s | vs 1 client | p50 s | p99 s |\n|---|---|---|---|---|")
        base = 0.0
        for c in counts:
            tps, p50, p99 = load(port, c, args.per_client, args.max_tokens)
            base = base or tps
            print(f"| {c} | {tps:.1f} | {tps / base:.2f}x | {p50:.2f} | {p99:.2f} |", flush=True)
        print(f"\nthe single-sequence API (Model.generate_tokens) on the same file: {single:.1f} t/s")
        if args.draft_head:
            print("\n| mode, 1 client | t/s | same text as plain |\n|---|---|---|")
            texts = {}
            for mode in ("plain", "eagle2"):
                t0, n = time.perf_counter(), 0
                texts[mode] = []
                for prompt in PROMPTS[:4]:
                    r = post(port, "/completion", {"prompt": prompt, "n_predict": args.max_tokens, "temperature": 0,
                                                   "mode": mode})
                    n += r["tokens_predicted"]
                    texts[mode].append(r["content"])
                same = [a == b for a, b in zip(texts[mode], texts["plain"])]
                print(f"| {mode} | {n / (time.perf_counter() - t0):.1f} | {sum(same)} of {len(same)} prompts |")
            for a, b in zip(texts["plain"], texts["eagle2"]):
                if a != b:
                    print(f"differs: {a!r}\n    vs: {b!r}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
