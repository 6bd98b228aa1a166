"""python -m specee.autoee select-layers: the static exit layer set, derived from the held-out data.

The decoder checks the predictors of a static set S of layers, in order, for every decoded token: at a layer
of S it computes the 12 features (p_prev from the previous layer of S), runs the predictor, and when that
fires computes the full-vocabulary logits at the layer; the token exits there when their argmax is one of
the EAGLE candidates. The selection simulates exactly this on the validation prompts (features recomputed
from the stored candidate logits with the schedule's p_prev) under a cost model of one decoded token, in
units of one decoder layer, from the GGUF's tensor sizes (decoding on a CPU reads every weight once per
token, so time follows bytes):

    cost(token) = (exit layer + 1, or L without exit)            layers run
                + H                                               lm_head (at the exit layer or at the end)
                + check * (layers of S checked)                   features + predictor + graph split
                + H * (fires without exit)                        a fruitless full-vocabulary check
    H = bytes(lm_head) / bytes(mean layer);  check = --check-cost (default 0.05 layer)

The EAGLE head's cost per token (draft = its bytes / layer bytes) is the same for every S: it does not change
the choice but is in the reported speedup. Rule: greedy forward selection. Start from S = {}; add the layer
that lowers the mean cost most while the share of tokens that exit with a token other than the full model's
stays <= --max-error; stop when no layer lowers the cost by more than --min-gain of the plain cost.
SpecEE's run-time addition (layers e-2, e, e+2 around the last 5 exits) is not simulated.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from specee import constants as C
from specee.autoee.collect import add_common, head_gguf, open_store, work_dir
from specee.autoee import tree_passes
from specee.autoee.exit_features import ExitPredictor, exit_features
from specee.autoee.train import CHECKPOINT, Data, is_validation, load_checkpoint, load_data, predictors_of
from specee.paths import default_eagle_head_path

DESCRIPTION = "Choose the static exit layer set from the held-out data under a cost model (per-layer stats too)"
SELECTION = "selection.json"


@dataclass
class Costs:
    """Per-token costs in units of one decoder layer."""

    n_layer: int
    lm_head: float
    check: float = 0.05
    draft: float = 0.0

    @property
    def plain(self) -> float:
        return self.n_layer + self.lm_head


def tensor_bytes(path: str | Path) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}


def model_costs(model: str | Path, head: str | Path | None, check: float) -> Costs:
    sizes = tensor_bytes(model)
    n_layer = 1 + max(int(n.split(".")[1]) for n in sizes if n.startswith("blk."))
    layer = sum(v for n, v in sizes.items() if n.startswith("blk.") and ".pred." not in n) / n_layer
    lm_head = sizes.get(C.OUTPUT, sizes[C.TOKEN_EMBD])
    draft = 0.0
    if head is not None:
        hs = tensor_bytes(head)
        draft = sum(v for n, v in hs.items() if n.startswith("eagle.") and n != C.EAGLE_TOKEN_EMBD)
        draft += 0 if C.EAGLE_OUTPUT in hs else lm_head
    return Costs(n_layer, lm_head / layer, check, draft / layer)


@dataclass
class Outcome:
    cost: float  # mean per token, layer units, without the draft head
    exit_ratio: float
    mean_exit_layer: float  # mean over exited tokens (1-based layer count run, as SpecEE reports)
    mean_layers: float  # mean layers run per token
    error: float  # share of tokens that exit with another token than the full model's
    exit_precision: float | None
    checks: float  # predictor checks per token
    fruitless: float  # fires without exit per token


def simulate(layers: list[int], data: Data, preds: dict[int, ExitPredictor], costs: Costs, threshold: float,
             k: int = 4) -> Outcome:
    """The decoder's static schedule over the tokens of `data` (all of them: pass a split)."""
    n = len(data.labels)
    done = torch.zeros(n, dtype=torch.bool)
    exit_at = torch.full((n,), costs.n_layer - 1)
    correct = torch.zeros(n, dtype=torch.bool)
    checks = torch.zeros(n)
    fruitless = torch.zeros(n)
    p_prev = None
    for layer in sorted(layers):
        feats, p_prev = exit_features(data.features[:, layer, :k], p_prev)
        with torch.no_grad():
            fire = preds[layer](feats) > threshold
        live = ~done
        checks += live.float()
        ex = live & fire & data.in_cand[:, layer]
        fruitless += (live & fire & ~data.in_cand[:, layer]).float()
        exit_at[ex] = layer
        correct[ex] = data.labels[ex, layer]
        done |= ex
    layers_run = exit_at.float() + 1
    cost = layers_run + costs.lm_head + costs.check * checks + costs.lm_head * fruitless
    n_exit = int(done.sum())
    return Outcome(
        cost=cost.mean().item(), exit_ratio=n_exit / n,
        mean_exit_layer=layers_run[done].mean().item() if n_exit else float("nan"),
        mean_layers=layers_run.mean().item(), error=(done & ~correct).float().mean().item(),
        exit_precision=(correct & done).sum().item() / n_exit if n_exit else None,
        checks=checks.mean().item(), fruitless=fruitless.mean().item())


def select_layers(data: Data, preds: dict[int, ExitPredictor], costs: Costs, threshold: float, max_error: float,
                  min_gain: float, k: int = 4) -> tuple[list[int], list[dict]]:
    """Greedy forward selection (see the module doc); returns the set and the steps taken."""
    chosen: list[int] = []
    best = simulate(chosen, data, preds, costs, threshold, k)
    steps = [{"layers": [], **asdict(best)}]
    while True:
        trials = []
        for layer in sorted(set(preds) - set(chosen)):
            out = simulate(chosen + [layer], data, preds, costs, threshold, k)
            if out.error <= max_error:
                trials.append((out.cost, layer, out))
        if not trials:
            break
        cost, layer, out = min(trials)
        if best.cost - cost <= min_gain * costs.plain:
            break
        chosen, best = sorted(chosen + [layer]), out
        steps.append({"layers": chosen, **asdict(out)})
    return chosen, steps


def oracle_bounds(data: Data, costs: Costs) -> list[dict]:
    """Upper bounds on early exit's speed from the data alone: every token exits, with its own token (precision
    100 %), at the first layer whose full-vocabulary argmax already is the full model's token, with no check
    cost. Three rows: only where that argmax is one of this head's candidates (perfect predictors); at that
    layer whatever the candidates (a perfect head too); and with lm_head and head free (layers alone)."""
    L = data.n_layer
    rows = []
    for name, can_exit, lm_head, draft in [
            ("perfect predictors", data.labels & data.in_cand, costs.lm_head, costs.draft),
            ("perfect predictors and candidates", data.labels, costs.lm_head, costs.draft),
            ("layers only (lm_head and head free)", data.labels, 0.0, 0.0)]:
        exits = can_exit[:, :L - 1].any(1)
        layers_run = torch.where(can_exit.any(1), can_exit.float().argmax(1) + 1, torch.tensor(L)).float()
        plain = L + lm_head
        rows.append({"bound": name, "exit_ratio": round(exits.float().mean().item(), 4),
                     "mean_layers": round(layers_run.mean().item(), 2),
                     "speedup": round(plain / (layers_run.mean().item() + lm_head + draft), 4)})
    return rows


def summary(out: Outcome, costs: Costs) -> dict:
    return {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(out).items()},
            "speedup_no_draft": round(costs.plain / out.cost, 4),
            "speedup_with_draft": round(costs.plain / (out.cost + costs.draft), 4)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_common(ap)
    ap.add_argument("--head", help="draft head whose size is the draft cost, as collect --head (default: the shipped "
                    "head)")
    ap.add_argument("--threshold", type=float, help="predictor threshold (default: the training's, 0.5)")
    ap.add_argument("--max-error", type=float, default=0.02,
                    help="most tokens (share) that may exit with another token than the full model's (0.02)")
    ap.add_argument("--min-gain", type=float, default=0.002,
                    help="stop when a layer lowers the cost by no more than this share of the plain cost (0.002)")
    ap.add_argument("--check-cost", type=float, default=0.05, help="cost of one predictor check, in layers (0.05)")
    ap.add_argument("--layers", help="evaluate this comma-separated set instead of selecting one")
    ap.add_argument("--tree-draft", type=int, default=0, metavar="N",
                    help="tree data (collect --tree-depth >= N): also replay tree exit's passes over a chain tree of "
                    "N draft tokens with the set's predictors, and the bound the data allows (tree_passes.py)")
    ap.add_argument("--oracle", action="store_true",
                    help="print only the upper bounds on the speedup that the data allows (perfect predictors; "
                    "all positions; no trained predictors needed)")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    work = work_dir(args)
    if args.oracle:
        return print_oracle(work, args)
    ckpt = load_checkpoint(work / CHECKPOINT)
    threshold = args.threshold if args.threshold is not None else ckpt["threshold"]
    store = open_store(work / "data")
    arrays = store.load()
    data = load_data(single_token(arrays), ckpt["config"]["val_percent"])
    val = Data(data.features[data.val], data.labels[data.val], data.in_cand[data.val], data.val[data.val])
    if not len(val.labels):
        raise ValueError(f"{work / 'data'}: none of its {store.n_prompts} prompt(s) is held out for validation "
                         "(collect more: `collect --minutes N` continues the store)")
    preds = predictors_of(ckpt)
    k = store.config["n_candidates"]
    costs = model_costs(args.model, head_gguf(args.head or default_eagle_head_path()), args.check_cost)
    print(f"costs per token in layers: lm_head {costs.lm_head:.2f}, draft head {costs.draft:.2f}, check "
          f"{costs.check}; plain decoding {costs.plain:.2f}; {len(val.labels)} held-out positions")
    if args.layers:
        layers, steps = sorted(int(x) for x in args.layers.split(",")), []
    else:
        layers, steps = select_layers(val, preds, costs, threshold, args.max_error, args.min_gain, k)
    out = summary(simulate(layers, val, preds, costs, threshold, k), costs)
    for s in steps:
        print(f"  {s['layers']}: cost {s['cost']:.2f}, exit ratio {s['exit_ratio']:.3f}, error {s['error']:.4f}")
    print(f"exit layers {layers}: {json.dumps(out)}")
    tree = print_tree(arrays, args.tree_draft, layers, preds, threshold, k, ckpt["config"]["val_percent"]) \
        if args.tree_draft else None
    if not args.layers:
        sel = {"exit_layers": layers, "threshold": threshold, "rule": {
            "max_error": args.max_error, "min_gain": args.min_gain, "check_cost": args.check_cost},
            "costs": asdict(costs), "validation": out, "steps": steps}
        if tree is not None:
            sel["tree"] = {"n_draft": args.tree_draft, **asdict(tree)}
        (work / SELECTION).write_text(json.dumps(sel, indent=1) + "\n")
        print(f"wrote {work / SELECTION}")


def single_token(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Early exit's data: tree data's rows at depth 0 (a tree's root is a token decoded on its own)."""
    top = arrays["depth"] == 0
    return arrays if top.all() else {k: v[top] for k, v in arrays.items()}


def print_tree(arrays: dict[str, np.ndarray], n_draft: int, layers: list[int], preds: dict[int, ExitPredictor] | None,
               threshold: float, k: int, val_percent: float) -> tree_passes.TreeOutcome | None:
    if arrays["depth"].max() < n_draft:
        raise ValueError(f"--tree-draft {n_draft} needs data collected with --tree-depth >= {n_draft} "
                         f"(this store's deepest node: {arrays['depth'].max()})")
    if val_percent > 0:
        val = is_validation(arrays["prompt"], val_percent)
        arrays = {key: v[val] for key, v in arrays.items()}
    if not len(arrays["final"]):
        print("tree exit: no held-out positions in this data (collect more)")
        return None
    out = tree_passes.replay(arrays, n_draft, layers, preds, threshold, k)
    L = arrays["features"].shape[1]
    print(f"tree exit, a chain of {n_draft} draft token(s), {out.n_passes} passes"
          f"{' (held-out prompts)' if val_percent > 0 else ''}, {out.tokens_per_pass:.2f} tokens a pass:")
    if preds is not None:
        precision = "-" if out.exit_precision is None else f"{out.exit_precision:.2f}"
        print(f"  layers {layers}: exit ratio {out.exit_ratio:.3f}, exit precision {precision}, mean layers run "
              f"{out.mean_layers:.2f} of {L}")
    print(f"  bound (every pass exits at its first right layer): exit ratio {out.oracle_exit_ratio:.3f}, "
          f"mean layers run {out.oracle_mean_layers:.2f} of {L}")
    return out


def print_oracle(work: Path, args: argparse.Namespace) -> None:
    store = open_store(work / "data")
    tree_arrays = store.load()
    arrays = single_token(tree_arrays)
    data = load_data(arrays, 0)
    costs = model_costs(args.model, head_gguf(args.head or default_eagle_head_path()), args.check_cost)
    L = data.n_layer
    print(f"{len(data.labels)} decode positions of {store.n_prompts} prompts ({work}); per token in layers: "
          f"lm_head {costs.lm_head:.2f}, draft head {costs.draft:.2f}, plain {costs.plain:.2f}")
    print(f"the layer's argmax is the model's token from layer: "
          + ", ".join(f"<= {l}: {data.labels[:, :l + 1].any(1).float().mean().item():.2f}" for l in range(3, L, 4)))
    print(f"the candidates hold the model's token: "
          f"{(arrays['cand'] == arrays['final'][:, None]).any(1).mean():.3f}")
    print("| bound | exit ratio | mean layers run | speedup |\n| --- | ---: | ---: | ---: |")
    for r in oracle_bounds(data, costs):
        print(f"| {r['bound']} | {r['exit_ratio']:.3f} | {r['mean_layers']:.2f} / {L} | {r['speedup']:.3f}x |")
    if args.tree_draft:
        print_tree(tree_arrays, args.tree_draft, [], None, 0.5, store.config["n_candidates"], 0)
