"""Structured output's speed: what a JSON Schema costs a decoding step, and what jump-forward saves, in the library
and side by side with upstream llama.cpp's llama-server.

  python -m specee.bench.grammar [-m MODEL] [-t THREADS] [--rounds 3] [--max-tokens 160] [--cases order,config]
                                 [--modes auto,ngram,eagle2] [--llama-server PATH] [--json FILE]

(a) the library, plain mode, greedy, on the same chat prompts: decode tokens per second without a grammar (ignore-EOS,
    --max-tokens) and under each case's schema, (b) the masks' share of the decode time with the mask computed on the
    decoding thread after each pass (grammar_overlap off) and on a worker while the pass runs (on: what is left is the
    wait), (c) jump-forward: the share of tokens the grammar forced (drafted and accepted in a pass of another token)
    and the decode speedup over the same grammar without it (the greedy texts are checked equal). Runs alternate
    within a round; each figure is the median over rounds.
(e) with --modes: the speculative modes under each case's schema, greedy, with jump-forward (the forced tokens as a
    step's tree where the drafts reach no further) and without, against plain decoding under the same schema without
    it: decode t/s (fastest round), passes per token, the draft head's candidates the grammar skipped and the drafts it
    dropped; every text checked equal to plain's. The cross-request n-gram cache is cleared before each run (lookup
    would copy the previous run's reply). Needs the draft head for eagle2 and auto (--draft-head, default: shipped).
(d) with --llama-server: specee-server and llama-server started on 127.0.0.1 with the same file, -t and -c, the same
    prompt tokens to llama.cpp's /completion with its `json_schema` field (and without, ignore-EOS, --max-tokens), both
    servers' own decode speed (timings.predicted_per_second), median over rounds, and the ratio.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass

from specee.bench.server import Server, post
from specee.generate import MODES
from specee.model import Model

# (e)'s modes: the runtime's lossless modes that draft from something (reads), but not from a draft model alone (it
# needs -md, which this benchmark does not load)
SPECULATIVE = [m.name for m in MODES.values() if m.lossless and m.reads and m.reads != ("draft",)]

# schema-heavy outputs: many fixed keys, enums, nesting (the tokens a grammar forces are what jump-forward batches)
CASES: dict[str, tuple[str, dict]] = {
    "order": ("Describe a fictional order in a shop as JSON.", {
        "type": "object", "additionalProperties": False,
        "required": ["order_id", "customer", "status", "items", "express_delivery"],
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {"type": "object", "additionalProperties": False, "required": ["first_name", "last_name"],
                         "properties": {"first_name": {"type": "string", "maxLength": 12},
                                        "last_name": {"type": "string", "maxLength": 12}}},
            "status": {"enum": ["pending_payment", "shipped_to_customer", "delivered_to_customer"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "additionalProperties": False, "required": ["product_category", "quantity"],
                "properties": {"product_category": {"enum": ["kitchen_appliances", "garden_furniture",
                                                             "office_supplies"]},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9}}}},
            "express_delivery": {"type": "boolean"}}}),
    "config": ("Write the settings of a web server as JSON.", {
        "type": "object", "additionalProperties": False,
        "required": ["enable_request_logging", "enable_response_cache", "maximum_connections",
                     "request_timeout_seconds", "deployment_environment", "compression_algorithm"],
        "properties": {
            "enable_request_logging": {"type": "boolean"},
            "enable_response_cache": {"type": "boolean"},
            "maximum_connections": {"type": "integer", "minimum": 1, "maximum": 1000},
            "request_timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 60},
            "deployment_environment": {"enum": ["development_workstation", "staging_cluster", "production_cluster"]},
            "compression_algorithm": {"enum": ["gzip_compression", "brotli_compression", "no_compression"]}}}),
    "person": ("Describe a fictional person who lives in Paris, as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 16}}}),
}

# the library runs of a round: (name, options)
RUNS = [("unconstrained", {"ignore_eos": True}),
        ("schema, masks after the pass", {"grammar_overlap": False, "jump_forward": False}),
        ("schema, masks during the pass", {"jump_forward": False}),
        ("schema + jump-forward", {})]


@dataclass
class Sample:
    """One generation's figures (the runtime's stats names)."""

    run: str
    case: str
    text: str
    n_decoded: int
    n_steps: int
    n_accepted: int
    t_decode_ms: float
    t_mask_ms: float


def sample(model: Model, run: str, case: str, max_tokens: int, **options) -> Sample:
    prompt, schema = CASES[case]
    schema_opts = {} if run == RUNS[0][0] else {"json_schema": schema}
    text = model.generate([{"role": "user", "content": prompt}], max_tokens, temp=0, mode="plain", **schema_opts,
                          **options)
    st = model.last_stats
    return Sample(run, case, text, st.n_decoded, st.n_steps, st.n_accepted, st.t_decode_ms, st.t_mask_ms)


def summarize(samples: list[Sample], case: str) -> dict[str, float]:
    """A case's medians over rounds: decode t/s of every run, the masks' share of decode time without and with the
    overlap, the forced-token share and jump-forward's decode speedup (same tokens: time without over time with)."""

    def of(run: str) -> list[Sample]:
        xs = [s for s in samples if s.case == case and s.run == run]
        if not xs:
            raise ValueError(f"no samples of {run!r} for case {case!r}")
        return xs

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    def tps(run: str) -> float:
        return med([1e3 * s.n_decoded / s.t_decode_ms for s in of(run) if s.t_decode_ms > 0])

    sync, during, jump = (of(r) for r, _ in RUNS[1:])
    return {"unconstrained_tps": tps(RUNS[0][0]), "sync_tps": tps(RUNS[1][0]), "overlap_tps": tps(RUNS[2][0]),
            "jump_tps": tps(RUNS[3][0]),
            "mask_share_sync": med([s.t_mask_ms / s.t_decode_ms for s in sync]),
            "mask_share_overlap": med([s.t_mask_ms / s.t_decode_ms for s in during]),
            "mask_ms_per_token": med([s.t_mask_ms / s.n_decoded for s in sync]),
            "forced_share": med([s.n_accepted / s.n_decoded for s in jump]),
            "passes_per_token": med([s.n_steps / s.n_decoded for s in jump]),
            "jump_speedup": med([a.t_decode_ms for a in during]) / med([b.t_decode_ms for b in jump])}


def library_table(summaries: dict[str, dict[str, float]]) -> str:
    lines = ["| case | unconstrained t/s | schema t/s (masks after / during the pass) | mask share after / during | "
             "mask ms/token | + jump-forward t/s | forced tokens | passes/token | jump-forward speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case, s in summaries.items():
        lines.append(f"| {case} | {s['unconstrained_tps']:.1f} | {s['sync_tps']:.1f} / {s['overlap_tps']:.1f} | "
                     f"{s['mask_share_sync']:.1%} / {s['mask_share_overlap']:.1%} | {s['mask_ms_per_token']:.3f} | "
                     f"{s['jump_tps']:.1f} | {s['forced_share']:.0%} | {s['passes_per_token']:.2f} | "
                     f"{s['jump_speedup']:.2f}x |")
    return "\n".join(lines)


def library(model: Model, cases: list[str], rounds: int, max_tokens: int) -> list[Sample]:
    samples: list[Sample] = []
    for r in range(rounds):
        for case in cases:
            runs = RUNS if r % 2 == 0 else RUNS[::-1]
            got = {name: sample(model, name, case, max_tokens, **opts) for name, opts in runs}
            texts = {got[name].text for name, _ in RUNS[1:]}
            if len(texts) != 1:
                raise SystemExit(f"{case}: the schema's greedy texts differ between runs: {texts}")
            samples += got.values()
        print(f"round {r + 1}: " + "; ".join(f"{c} {summarize(samples, c)['jump_speedup']:.2f}x" for c in cases),
              file=sys.stderr, flush=True)
    return samples


def modes_table(model: Model, cases: list[str], modes: list[str], rounds: int, max_tokens: int) -> str:
    """(e): per case, plain and each mode, with and without jump-forward; the fastest round of each."""
    lines = ["| case | mode | jump-forward | t/s | x plain + schema | passes/token | head candidates skipped | "
             "drafts dropped |", "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        prompt, schema = CASES[case]
        runs = [(mode, jump) for mode in ["plain", *modes] for jump in (False, True)]
        best: dict[tuple[str, bool], float] = {}
        stats: dict[tuple[str, bool], object] = {}
        want = None
        for r in range(rounds):
            for mode, jump in (runs if r % 2 == 0 else runs[::-1]):
                model.ngram_cache_clear()
                text = model.generate([{"role": "user", "content": prompt}], max_tokens, temp=0, mode=mode,
                                      json_schema=schema, jump_forward=jump)
                st = model.last_stats
                want = text if want is None else want
                if text != want:
                    raise SystemExit(f"{case}: {mode} (jump-forward {jump}) gave another text than plain decoding")
                ms = st.t_decode_ms / max(st.n_decoded, 1)
                if ms < best.get((mode, jump), float("inf")):
                    best[(mode, jump)], stats[(mode, jump)] = ms, st
        base = best[("plain", False)]
        for mode, jump in runs:
            st = stats[(mode, jump)]
            label = mode if mode != "auto" else f"auto ({st.mode})"
            lines.append(f"| {case} | {label} | {'on' if jump else 'off'} | {1e3 / best[(mode, jump)]:.1f} | "
                         f"{base / best[(mode, jump)]:.2f}x | {st.n_steps / max(st.n_decoded, 1):.2f} | "
                         f"{st.n_grammar_masked} | {st.n_grammar_dropped} |")
    return "\n".join(lines)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def server_speed(port: int, tokens: list[int], schema: dict | None, max_tokens: int) -> tuple[float, bool]:
    """(decode t/s as the server reports it, whether the text is JSON) of one /completion request."""
    body = {"prompt": tokens, "n_predict": max_tokens, "temperature": 0}
    body.update({"json_schema": schema} if schema is not None else {"ignore_eos": True})
    r = post(port, "/completion", body)
    return float(r["timings"]["predicted_per_second"]), is_json(r["content"])


def servers_table(rows: list[tuple[str, float, float, float, float, str]]) -> str:
    """rows: (case, specee constrained, llama constrained, specee unconstrained, llama unconstrained t/s, how many
    constrained texts of each server were JSON)."""
    lines = ["| case | specee-server t/s | llama-server t/s | specee / llama | specee unconstrained t/s | "
             "llama unconstrained t/s | specee / llama | JSON texts (specee, llama) |", "|---|---|---|---|---|---|---|---|"]
    for case, sc, lc, su, lu, valid in rows:
        lines.append(f"| {case} | {sc:.1f} | {lc:.1f} | {sc / lc:.2f}x | {su:.1f} | {lu:.1f} | {su / lu:.2f}x | "
                     f"{valid} |")
    return "\n".join(lines)


def servers(args: argparse.Namespace, model: Model, cases: list[str]) -> str:
    common = ["-m", model.path, "-np", "1", "-t", str(args.threads), "-c", "2048", "--host", "127.0.0.1"]
    both = [Server("specee-server", [sys.executable, "-m", "specee.server", *common, "--mode", "plain"], "", ""),
            Server("llama-server", [args.llama_server, *common, "--no-webui"], "", "")]
    prompts = {c: model.prompt_tokens([{"role": "user", "content": CASES[c][0]}]) for c in cases}
    speeds: dict[tuple[str, str, bool], list[float]] = {}
    valid: dict[tuple[str, str], list[bool]] = {}
    try:
        for s in both:
            s.start()
        for c in cases:  # warm-up: each schema compiled once, each prompt cached
            for s in both:
                server_speed(s.port, prompts[c], CASES[c][1], args.max_tokens)
        for r in range(args.rounds):
            for c in cases:
                for s in (both if r % 2 == 0 else both[::-1]):
                    for constrained in (True, False):
                        schema = CASES[c][1] if constrained else None
                        tps, ok = server_speed(s.port, prompts[c], schema, args.max_tokens)
                        speeds.setdefault((s.name, c, constrained), []).append(tps)
                        if constrained:
                            valid.setdefault((s.name, c), []).append(ok)
    finally:
        for s in both:
            s.stop()

    def med(name: str, c: str, constrained: bool) -> float:
        return statistics.median(speeds[(name, c, constrained)])

    def n_valid(c: str) -> str:
        return ", ".join(f"{sum(valid[(n, c)])}/{len(valid[(n, c)])}" for n in ("specee-server", "llama-server"))

    return servers_table([(c, med("specee-server", c, True), med("llama-server", c, True),
                           med("specee-server", c, False), med("llama-server", c, False), n_valid(c)) for c in cases])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--modes", default="", help=f"comma-separated modes for (e), of {', '.join(SPECULATIVE)} "
                                                "(default: none, (e) not run)")
    p.add_argument("--draft-head", default="default", help="draft head file for (e)'s head modes (default: shipped)")
    p.add_argument("--llama-server", default=None, help="upstream llama.cpp's llama-server binary: (d)")
    p.add_argument("--json", default=None, help="write every library sample here")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        p.error(f"--cases: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(CASES)}")
    if args.rounds < 1 or args.max_tokens < 1:
        p.error("--rounds and --max-tokens must be at least 1")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        p.error(f"--llama-server: {args.llama_server} is not an executable")
    args.cases = cases
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in SPECULATIVE]
    if bad:
        p.error(f"--modes: unknown {', '.join(bad)}; known: {', '.join(SPECULATIVE)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Model(args.model, n_ctx=2048, n_threads=args.threads,
                  draft_head=args.draft_head if args.modes else None)
    print(f"## {model.desc} ({os.path.basename(model.path)}), {args.threads} thread(s), greedy, plain mode, "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start\n")
    samples = library(model, args.cases, args.rounds, args.max_tokens)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(s) for s in samples], f, indent=1)
    print(library_table({c: summarize(samples, c) for c in args.cases}))
    if args.modes:
        print("\nthe speculative modes under the schema (fastest of the rounds; every text plain decoding's):\n")
        print(modes_table(model, args.cases, args.modes, args.rounds, args.max_tokens))
    if args.llama_server:
        print("\nside by side (/completion, the same prompt tokens, decode t/s as each server reports it):\n")
        print(servers(args, model, args.cases))
    model.close()
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
