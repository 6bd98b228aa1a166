"""Drafts that cost nothing: mode ngram (n-gram lookup) against plain decoding and upstream llama.cpp's n-gram
speculation, per category of SpecEE's six evaluation datasets and a code-editing set (bench/code_edit.py).

    python -m specee.bench.lookup --data-dir questions [--llama-server PATH] [--per-category 3]
                                  [-m FILE] [-n 64] [-t 2] [--rounds 2] [--upstream-types ngram-simple,...]

Every prompt's first turn in the model's chat template, given as text (each tool parses special tokens), greedy, the
same file, threads and context; each prompt's configurations in a rotating order, the fastest of the rounds kept.
Upstream runs through its llama-server (its --spec-type is a flag of llama-server and llama-cli, not of
llama-completion): a server on 127.0.0.1 per run (-np 1, -fa on, its n-gram types at their defaults), so no run
learns from an earlier one, one /completion request, its decode time and draft counts from the reply's timings.
Without --llama-server (or llama-server on PATH) only this runtime's configurations run. Prints, per category: this
runtime's tokens per step and drafts accepted in mode ngram, decode speed against its plain decoding and against
upstream's plain decoding and best n-gram type; mode auto (the default) against plain; and how many ngram and auto
replies are identical to plain ones (they must all be: exit status 1 otherwise). --hybrid adds the draft head's modes
eagle2 and ngram+eagle2 (hybrid trees: lookup's drafts grafted onto the head's tree) against plain, and the hybrid's
tokens per step and drafts accepted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from specee import chat_apply_template
from specee.bench.code_edit import code_edit_messages
from specee.bench.server import Server, post
from specee.bench.spec import Config, Run, find_specee, run_config, summary
from specee.generate import MODES, SPEC_TYPES
from specee.paths import default_draft_head_path, default_model_path

CATEGORIES = ("alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum")
# upstream's n-gram speculation types (the runtime's --spec-type table: those served by mode ngram), and the modes that
# draft with the head's EAGLE-2 tree (the mode table) to set beside them
UPSTREAM_TYPES = ",".join(t for t, mode in SPEC_TYPES.items() if mode == "ngram")
HEAD_MODES = tuple(name for name, m in MODES.items() if m.needs_head and not m.exits and "eagle2_tree" in m.reads)


def category_messages(data_dir: Path, name: str, n: int) -> list[list[dict[str, str]]]:
    """n first turns spread over the dataset's question file."""
    path = data_dir / name / "question.jsonl"
    if not path.is_file():
        raise SystemExit(f"bench.lookup: {path} not found (--data-dir: SpecEE's specee-bench folder)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    picked = [rows[i * len(rows) // n] for i in range(min(n, len(rows)))]
    return [[{"role": "user", "content": r["turns"][0]}] for r in picked]


def load_prompts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(category, prompt text rendered with the model's chat template), prompts too long for the context left out."""
    from specee.model import Model

    out = []
    with Model(args.model, n_ctx=64, n_threads=1) as m:
        sets = {name: category_messages(Path(args.data_dir), name, args.per_category) for name in CATEGORIES}
        sets["code-edit"] = code_edit_messages()[:max(args.per_category, 1) * 2]
        for name, chats in sets.items():
            for chat in chats:
                text = chat_apply_template(m.chat_template(), chat)
                if len(m.tokenize(text, parse_special=True)) + args.n_predict + 8 <= args.ctx_size:
                    out.append((name, text))
    return out


def configs(args: argparse.Namespace, upstream: bool) -> list[Config]:
    out = [Config("specee plain", "specee", ["--mode", "plain"]), Config("specee ngram", "specee", ["--mode", "ngram"]),
           Config("specee auto", "specee", [])]
    if args.hybrid:  # the draft head's modes: EAGLE-2 alone and with lookup's drafts grafted on (hybrid trees)
        head = ["--draft-head", args.draft_head]
        out += [Config(f"specee {mode}", "specee", head + ["--mode", mode]) for mode in HEAD_MODES]
    if upstream:
        out.append(Config("llama.cpp plain", "llama.cpp", ["-fa", "on"]))
        out += [Config(f"llama.cpp {t}", "llama.cpp", ["-fa", "on", "--spec-type", t])
                for t in args.upstream_types.split(",") if t]
    return out


def run_upstream(cfg: Config, exe: str, prompt_i: int, text: str, args: argparse.Namespace) -> Run:
    """One greedy completion by a fresh upstream llama-server with cfg's flags."""
    cmd = [exe, "-m", args.model, "-t", str(args.threads), "-c", str(args.ctx_size), "-np", "1", "--host",
           "127.0.0.1"] + cfg.argv
    srv = Server(cfg.name, cmd, "llamacpp:", "")
    srv.start()
    try:
        r = post(srv.port, "/completion", {"prompt": text, "n_predict": args.n_predict, "temperature": 0,
                                           "cache_prompt": False})
    finally:
        srv.stop()
    t = r["timings"]
    return Run(cfg.name, prompt_i, t["predicted_ms"], t["predicted_n"], n_drafted=t.get("draft_n", 0),
               n_accepted=t.get("draft_n_accepted", 0), text=r["content"])


def fastest(runs: list[Run]) -> dict[tuple[str, int], Run]:
    best: dict[tuple[str, int], Run] = {}
    for r in runs:
        if (r.config, r.prompt) not in best or r.eval_ms < best[(r.config, r.prompt)].eval_ms:
            best[(r.config, r.prompt)] = r
    return best


def table(best: dict[tuple[str, int], Run], cfgs: list[Config], prompts: list[tuple[str, str]]) -> str:
    cats = list(dict.fromkeys(c for c, _ in prompts))
    hybrid = any(c.name == "specee ngram+eagle2" for c in cfgs)
    extra = " eagle2 x plain | ngram+eagle2 x plain | ngram+eagle2 tokens/step | ngram+eagle2 drafts accepted |"
    rows = ["| category | prompts | ngram tokens/step | drafts accepted | ngram x plain | auto x plain "
            "| ngram x llama.cpp plain | ngram x llama.cpp best n-gram (type: drafts accepted) |"
            + (extra if hybrid else "") + " identical |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |" + (" ---: | ---: | ---: | ---: |" if hybrid else "")
            + " ---: |"]
    for cat in cats + ["all"]:
        ids = [i for i, (c, _) in enumerate(prompts) if cat in ("all", c)]

        def of(name: str) -> list[Run]:
            return [best[(name, i)] for i in ids if (name, i) in best]

        def accepted(runs: list[Run]) -> str:
            return f"{sum(r.n_accepted for r in runs)}/{sum(r.n_drafted for r in runs)}"

        ngram = of("specee ngram")
        ts, tps, _, _ = summary(ngram)
        same = sum(best[(n, i)].text == best[("specee plain", i)].text for i in ids for n in ("specee ngram", "specee auto"))
        plain_ts = summary(of("specee plain"))[0]
        cells = [f"{ts / plain_ts:.2f}", f"{summary(of('specee auto'))[0] / plain_ts:.2f}"]
        up_plain = of("llama.cpp plain")
        cells.append(f"{ts / summary(up_plain)[0]:.2f}" if up_plain else "")
        up = [(summary(of(c.name))[0], c.name) for c in cfgs
              if c.tool == "llama.cpp" and c.name != "llama.cpp plain" and of(c.name)]
        if up:
            up_ts, up_name = max(up)
            cells.append(f"{ts / up_ts:.2f} ({up_name[len('llama.cpp '):]}: {accepted(of(up_name))})")
        else:
            cells.append("")
        checked = ("specee ngram", "specee auto")
        if hybrid:
            hyb = of("specee ngram+eagle2")
            cells += [f"{summary(of('specee eagle2'))[0] / plain_ts:.2f}", f"{summary(hyb)[0] / plain_ts:.2f}",
                      f"{summary(hyb)[1]:.2f}", accepted(hyb)]
            checked += tuple(f"specee {mode}" for mode in HEAD_MODES)
            same = sum(best[(n, i)].text == best[("specee plain", i)].text for i in ids for n in checked)
        rows.append(f"| {cat} | {len(ids)} | {tps:.2f} | {accepted(ngram)} | " + " | ".join(cells) +
                    f" | {same}/{len(checked) * len(ids)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.lookup", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--data-dir", required=True, help="SpecEE's question folder (NAME/question.jsonl for the six datasets)")
    ap.add_argument("--per-category", type=int, default=3, help="prompts per dataset (3; code-edit: twice as many)")
    ap.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per reply (64)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the fastest of them is kept (2)")
    ap.add_argument("--llama-server",
                    help="upstream llama-server (default: from PATH; 'none', or none on PATH: this runtime only)")
    ap.add_argument("--specee-cli", help="this runtime's llama-cli (default: the installed one)")
    ap.add_argument("--upstream-types", default=UPSTREAM_TYPES, help=f"upstream --spec-type values ({UPSTREAM_TYPES})")
    ap.add_argument("--hybrid", action="store_true",
                    help="also the draft head's modes eagle2 and ngram+eagle2 (hybrid trees), with --draft-head")
    ap.add_argument("--draft-head", default=None, help="the draft head for --hybrid (default: the shipped one)")
    ap.add_argument("--json", help="write every run here")
    args = ap.parse_args(argv)
    args.model = args.model or default_model_path()
    args.draft_head = args.draft_head or default_draft_head_path()
    upstream = None if args.llama_server == "none" else args.llama_server or shutil.which("llama-server")
    prompts = load_prompts(args)
    cfgs = configs(args, bool(upstream))
    exes = {"specee": find_specee(args), "llama.cpp": upstream}
    runs: list[Run] = []
    for r in range(args.rounds):
        for i, (cat, text) in enumerate(prompts):
            shift = (i + r) % len(cfgs)
            for cfg in cfgs[shift:] + cfgs[:shift]:
                print(f"bench.lookup: round {r + 1}/{args.rounds} {cat} {i + 1}/{len(prompts)} {cfg.name}",
                      file=sys.stderr, flush=True)
                run = run_upstream if cfg.tool == "llama.cpp" else run_config
                runs.append(run(cfg, exes[cfg.tool], i, text, args))
    best = fastest(runs)
    print(f"model {Path(args.model).name}, -n {args.n_predict}, -t {args.threads}, -c {args.ctx_size}, --temp 0, "
          f"fastest of {args.rounds} round(s); {args.per_category} prompts per dataset"
          f"{'' if upstream else '; no upstream llama.cpp (--llama-server)'}")
    print(table(best, cfgs, prompts))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    same = all(best[(c.name, i)].text == best[("specee plain", i)].text for i in range(len(prompts))
               for c in cfgs if c.tool == "specee")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
