"""Tree exit's verification passes replayed on tree data (collect --tree-depth): what a schedule of predictors
would do to them, and what the data allows at best.

The tree is a chain of n_draft tokens (EAGLE-2's with one token per level, the default model's tree is one
token), each the head's top candidate at its node. A pass from root r verifies r .. r + n_draft at once; the full
model accepts the drafts while each equals its node's greedy token, so the pass puts out the rows r .. r + a
(a accepted) and the next root is r + a + 1. Its rows are stored ones: the node at depth d is the position r + d
with the candidates the head drafted there (its row at depth d), and the labels of the sequence.

With predictors, at a scheduled layer s (features with p_prev from the previous scheduled layer, per row):
the path is the root, then the child while the node's best candidate at s (largest candidate logit) is the
drafted one; the pass fires when every path row's predictor does; it exits when the walk at s (the layer's
argmax at each row, on to the child when it is the drafted token) puts out candidates only; the exit is right
when every walked row's argmax is the full model's token. A path or walk that reaches a drafted child the full
model rejected (not in the data: its hidden states are not the sequence's) counts as not exiting, so the
figures are a lower bound on exits (those exits would be wrong ones: the drafted token is not the model's).
The oracle bound: every pass exits at the first layer where every row it puts out has the model's token as
its argmax and among its candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specee.autoee.exit_features import ExitPredictor, exit_features


@dataclass
class TreeOutcome:
    n_passes: int
    tokens_per_pass: float
    exit_ratio: float  # passes that exit
    exit_precision: float | None  # of those, the share whose tokens are all the model's
    mean_layers: float  # layers run per pass
    oracle_exit_ratio: float
    oracle_mean_layers: float


def passes(arrays: dict[str, np.ndarray], n_draft: int) -> list[list[int]]:
    """The rows of every pass (root first, then the accepted nodes) along each stored sequence."""
    index = {(int(p), int(q), int(d)): i for i, (p, q, d) in
             enumerate(zip(arrays["prompt"], arrays["pos"], arrays["depth"]))}
    top, final = arrays["cand"][:, 0], arrays["final"]
    out = []
    for prompt in np.unique(arrays["prompt"]):
        root = int(arrays["pos"][arrays["prompt"] == prompt].min())
        while (int(prompt), root, 0) in index:
            rows = [index[int(prompt), root, 0]]
            while len(rows) <= n_draft and top[rows[-1]] == final[rows[-1]]:
                child = index.get((int(prompt), root + len(rows), len(rows)))
                if child is None:
                    break
                rows.append(child)
            out.append(rows)
            root += len(rows)
    return out


def replay(arrays: dict[str, np.ndarray], n_draft: int, layers: list[int],
           preds: dict[int, ExitPredictor] | None, threshold: float = 0.5, k: int = 4) -> TreeOutcome:
    """The passes under the schedule `layers` of `preds` (None: no predictors, the oracle figures only)."""
    feats = torch.from_numpy(arrays["features"])
    L = feats.shape[1]
    label = arrays["argmax"] == arrays["final"][:, None]  # [n, L]
    in_cand = (arrays["argmax"][:, :, None] == arrays["cand"][:, None, :]).any(-1)
    drafted = arrays["argmax"] == arrays["cand"][:, :1]  # the layer's argmax is the node's drafted child
    fire, best_drafted, p_prev = {}, {}, None
    for s in sorted(layers) if preds is not None else []:
        f, p_prev = exit_features(feats[:, s, :k], p_prev)
        with torch.no_grad():
            fire[s] = (preds[s](f) > threshold).numpy()
        best_drafted[s] = (feats[:, s, :k].argmax(-1) == 0).numpy()
    all_passes = passes(arrays, n_draft)
    n_exit = n_right = 0
    layers_run, oracle_layers, oracle_exits = [], [], 0
    for rows in all_passes:
        ok = (label[rows] & in_cand[rows]).all(0)[:L - 1]
        oracle_exits += int(ok.any())
        oracle_layers.append(int(ok.argmax()) + 1 if ok.any() else L)
        run = L
        for s in sorted(fire):
            path = walk(rows, n_draft, lambda r: best_drafted[s][r])
            if path is None or not fire[s][path].all():
                continue
            out = walk(rows, n_draft, lambda r: drafted[r, s])
            if out is None or not in_cand[out, s].all():
                continue
            n_exit += 1
            n_right += int(label[out, s].all())
            run = s + 1
            break
        layers_run.append(run)
    n = len(all_passes)
    return TreeOutcome(n, sum(map(len, all_passes)) / n, n_exit / n, n_right / n_exit if n_exit else None,
                       float(np.mean(layers_run)), oracle_exits / n, float(np.mean(oracle_layers)))


def walk(rows: list[int], n_draft: int, to_child) -> list[int] | None:
    """The rows a walk from the root visits, going on to the drafted child while to_child(row) holds and the row
    has one (the chain's last node, at depth n_draft, has none); None when it goes on to a drafted child the full
    model rejected (not stored)."""
    path = [rows[0]]
    while len(path) <= n_draft and to_child(path[-1]):
        if len(path) == len(rows):
            return None
        path.append(rows[len(path)])
    return path
