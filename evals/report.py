"""Results: the per-sample JSONL (resumable), the summary (JSON), a markdown table and PNG plots.

A record is one sample in one mode: its turns (text, token ids, prompt/decode counts and seconds, speculative
step sizes, layers run), its task score and any error. The summary groups records by dataset and mode (and
over all datasets): prefill and decode tokens/s (total tokens / total seconds, and the mean of the per-sample
rates), decode speedup vs plain and vs llama.cpp, mean accepted tokens per speculative step, early-exit
statistics, agreement with plain greedy decoding, and the task score.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from specee.eval.metrics import agreement, exit_stats

ALL = "all"


# ---- the per-sample file -----------------------------------------------------------------------


def record_key(r: dict) -> tuple[str, str, str]:
    return r["dataset"], str(r["id"]), r["mode"]


def load_records(path: Path) -> dict[tuple[str, str, str], dict]:
    """Completed records by (dataset, id, mode); a line cut short by an interruption is ignored."""
    records: dict[tuple[str, str, str], dict] = {}
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
            records[record_key(r)] = r
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return records


def repair_records(path: Path, records: dict[tuple[str, str, str], dict]) -> bool:
    """Rewrite the file with only its complete records when an interruption left a cut line (or a sample was
    written twice); True when it did."""
    if not path.is_file() or sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip()) == len(records):
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records.values()), encoding="utf-8")
    tmp.replace(path)
    return True


def append_record(path: Path, record: dict) -> None:
    """Append one record as a line (after a newline if an interrupted write left the file without one)."""
    needs_newline = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with path.open("a", encoding="utf-8") as f:
        f.write(("\n" if needs_newline else "") + json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()


def sample_rates(turns: list[dict]) -> tuple[float, float]:
    """(prefill t/s, decode t/s) of one sample over its turns."""
    pt, ps = sum(t["n_prompt"] for t in turns), sum(t["prompt_seconds"] for t in turns)
    dt, ds = sum(t["n_decode"] for t in turns), sum(t["decode_seconds"] for t in turns)
    return (pt / ps if ps > 0 else math.nan), (dt / ds if ds > 0 else math.nan)


# ---- the summary -------------------------------------------------------------------------------


def same_as_plain(r: dict, plain: dict) -> tuple[bool, int]:
    """(identical, tokens until the first divergence) of a record against the plain record of its sample.
    Identical means the same text in every turn (llama.cpp's tokens are its text tokenized again)."""
    if [t["text"] for t in r["turns"]] == [t["text"] for t in plain["turns"]]:
        return True, sum(len(t["tokens"]) for t in plain["turns"])
    return False, agreement([t["tokens"] for t in r["turns"]], [t["tokens"] for t in plain["turns"]])[1]


def summarize_group(records: list[dict], plain: dict[tuple[str, str], dict], n_layer: int) -> dict:
    done = [r for r in records if not r.get("error")]
    turns = [t for r in done for t in r["turns"]]
    pt, ps = sum(t["n_prompt"] for t in turns), sum(t["prompt_seconds"] for t in turns)
    dt, ds = sum(t["n_decode"] for t in turns), sum(t["decode_seconds"] for t in turns)
    rates = [sample_rates(r["turns"])[1] for r in done]
    rates = [x for x in rates if not math.isnan(x)]
    steps = [k for t in turns for k in t.get("step_tokens", [])]
    row = {
        "samples": len(done),
        "errors": len(records) - len(done),
        "prompt_tokens": pt,
        "generated_tokens": sum(len(t["tokens"]) for t in turns),
        "prefill_tps": pt / ps if ps > 0 else None,
        "decode_tps": dt / ds if ds > 0 else None,
        "mean_sample_decode_tps": statistics.fmean(rates) if rates else None,
        "mean_accepted_tokens": sum(steps) / len(steps) if steps else None,
    }
    layers = [x for t in turns for x in t.get("layers_run", [])]
    if layers:
        correct = [x for t in turns for x in t.get("exit_correct", [])]
        ex = exit_stats(layers, n_layer, correct if len(correct) == len(layers) else None)
        row.update(mean_layers_run=ex.mean_layers_run, exit_ratio=ex.exit_ratio, exit_precision=ex.exit_precision)
    pairs = [same_as_plain(r, plain[(r["dataset"], str(r["id"]))]) for r in done
             if r["mode"] != "plain" and (r["dataset"], str(r["id"])) in plain]
    if pairs:
        row["identical_to_plain"] = sum(p[0] for p in pairs)
        row["compared_to_plain"] = len(pairs)
        row["mean_tokens_to_divergence"] = statistics.fmean(p[1] for p in pairs)
    scored = [r for r in done if r.get("score") is not None]
    scores = [r["score"] for r in scored]
    if scores and len({r["score_name"] for r in scored}) == 1:  # no mean over different metrics ("all" rows)
        row["score_name"] = scored[0]["score_name"]
        row["score"] = statistics.fmean(scores)
        row["scored"] = len(scores)
    return row


def summarize(records: list[dict], n_layer: int) -> dict:
    """{"rows": {dataset: {mode: row}}} with dataset "all" over every dataset, speedups filled in."""
    plain = {(r["dataset"], str(r["id"])): r for r in records if r["mode"] == "plain" and not r.get("error")}
    groups: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        groups[r["dataset"]][r["mode"]].append(r)
        groups[ALL][r["mode"]].append(r)
    rows = {ds: {mode: summarize_group(rs, plain, n_layer) for mode, rs in modes.items()}
            for ds, modes in groups.items()}
    for modes in rows.values():
        for row in modes.values():
            for base, key in (("plain", "speedup_vs_plain"), ("llama.cpp", "speedup_vs_llama_cpp")):
                ref = modes.get(base, {}).get("decode_tps")
                if ref and row["decode_tps"]:
                    row[key] = row["decode_tps"] / ref
    return {"rows": rows}


# ---- markdown ----------------------------------------------------------------------------------


def fmt(x, spec: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


COLUMNS = [  # header, cell
    ("samples", lambda r: str(r["samples"]) + (f" ({r['errors']} failed)" if r["errors"] else "")),
    ("prefill t/s", lambda r: fmt(r["prefill_tps"], ".1f")),
    ("decode t/s", lambda r: fmt(r["decode_tps"], ".1f")),
    ("x plain", lambda r: fmt(r.get("speedup_vs_plain"), ".2f")),
    ("x llama.cpp", lambda r: fmt(r.get("speedup_vs_llama_cpp"), ".2f")),
    ("accepted/step", lambda r: fmt(r["mean_accepted_tokens"], ".2f")),
    ("mean layers run", lambda r: fmt(r.get("mean_layers_run"), ".1f")),
    ("exit ratio", lambda r: fmt(r.get("exit_ratio"), ".2f")),
    ("exit precision", lambda r: fmt(r.get("exit_precision"), ".2f")),
    ("same as plain", lambda r: f"{r['identical_to_plain']}/{r['compared_to_plain']}" if "compared_to_plain" in r else ""),
    ("tokens to 1st divergence", lambda r: fmt(r.get("mean_tokens_to_divergence"), ".1f")),
    ("score", lambda r: f"{r['score_name']} {r['score']:.3f}" if "score" in r else ""),
]


def markdown_table(summary: dict, modes: list[str]) -> str:
    rows = summary["rows"]
    datasets = [d for d in rows if d != ALL] + ([ALL] if ALL in rows else [])
    lines = [(d, m, rows[d][m]) for d in datasets for m in modes if m in rows[d]]
    cols = [(h, f) for h, f in COLUMNS if any(f(r) for _, _, r in lines)]  # columns with something in them
    out = ["| dataset | mode | " + " | ".join(h for h, _ in cols) + " |",
           "| --- | --- |" + " ---: |" * len(cols)]
    for d, m, r in lines:
        name = f"**{d}**" if d == ALL else d
        out.append(f"| {name} | {m} | " + " | ".join(f(r) for _, f in cols) + " |")
    return "\n".join(out)


# ---- plots -------------------------------------------------------------------------------------


def turn_values(records: list[dict], modes: list[str], key: str) -> dict[str, list]:
    """Per mode, the values of a per-token list (`step_tokens`, `layers_run`) over every turn of its
    successful records; modes without any are left out."""
    values = {m: [x for r in records if r["mode"] == m and not r.get("error") for t in r["turns"]
                  for x in t.get(key, [])] for m in modes}
    return {m: v for m, v in values.items() if v}


def save(fig, written: list[Path], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)


def plot_all(summary: dict, records: list[dict], modes: list[str], n_layer: int, out: Path) -> list[Path]:
    """speedup.png (decode speedup by dataset and mode), accepted_length.png (tokens per speculative step),
    layers_run.png (layers evaluated per token, early exit); a plot without data is not written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = summary["rows"]
    datasets = [d for d in rows if d != ALL] + [ALL]
    panels = [(base, key) for base, key in (("plain", "speedup_vs_plain"), ("llama.cpp", "speedup_vs_llama_cpp"))
              if any(key in rows[d].get(m, {}) for d in datasets for m in modes if m != base)]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
        for ax, (base, key) in zip(axes[0], panels):
            shown = [m for m in modes if m != base and any(key in rows[d].get(m, {}) for d in datasets)]
            width = 0.8 / max(len(shown), 1)
            for j, m in enumerate(shown):
                ys = [rows[d].get(m, {}).get(key, 0.0) for d in datasets]
                ax.bar([i + (j - (len(shown) - 1) / 2) * width for i in range(len(datasets))], ys, width, label=m)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(datasets)), datasets, rotation=30, fontsize=8)
            ax.set_ylabel(f"decode speedup vs {base}")
            ax.set_title(f"decode tokens/s relative to {base}", fontsize=9)
            ax.legend(fontsize=7)
        save(fig, written, out / "speedup.png")

    steps = turn_values(records, modes, "step_tokens")
    if steps:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        top = max(max(s) for s in steps.values())
        width = 0.8 / len(steps)
        for j, (m, s) in enumerate(steps.items()):
            counts = [s.count(k) / len(s) for k in range(1, top + 1)]
            ax.bar([k + (j - (len(steps) - 1) / 2) * width for k in range(1, top + 1)], counts, width,
                   label=f"{m} (mean {sum(s) / len(s):.2f})")
        ax.set_xlabel("tokens per speculative step (accepted drafts + 1)")
        ax.set_ylabel("fraction of steps")
        ax.set_xticks(range(1, top + 1))
        ax.legend(fontsize=8)
        save(fig, written, out / "accepted_length.png")

    layers = turn_values(records, modes, "layers_run")
    if layers:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for m, v in layers.items():
            ax.hist(v, bins=range(1, n_layer + 2), alpha=0.6, label=m, align="left")
        ax.set_xlabel(f"layers evaluated per token ({n_layer}: no exit)")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=8)
        save(fig, written, out / "layers_run.png")
    return written
