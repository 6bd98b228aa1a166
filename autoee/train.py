"""python -m specee.autoee train: one exit predictor per layer on the collected data (collect.py).

Each layer's MLP (exit_features.ExitPredictor) learns P(argmax at this layer == the full model's token) from
the layer's 12 features: BCE, Adam (lr 1e-3), batches of 1024, a fixed number of epochs. The third feature
group depends on which layer was checked before (p_prev): SpecEE trains with the previous layer's and runs
with the previous *scheduled* layer's (none at the first: the gap is p itself), and measured here that shift
turns a predictor that is precise on its training features into a poor one at the first scheduled layer.
--gap mixed (default) builds each batch's features with p_prev from no layer (1/3) or 1..4 layers back;
--gap previous is SpecEE's. The inputs are
standardized with the training split's mean and std while training, and the standardization is folded into
the first layer afterwards, so the exported MLP takes the raw features. Prompts are split into training and
validation by a hash of their source index. Layer l's initial weights and batch order depend only on
(seed, l): the result does not depend on which layers were trained in an earlier, interrupted run. The
checkpoint (predictors.pt under the work dir) is written after every layer; a new run continues it.
Per-layer validation numbers at the threshold: label rate, precision, recall, fire rate, and the exit rate
and exit precision alone (fires and the layer's argmax is an EAGLE candidate), with p_prev from the previous
layer and without one (the first checked layer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specee.autoee.collect import add_common, open_store, work_dir
from specee.autoee.exit_features import HIDDEN, THRESHOLD, ExitPredictor

DESCRIPTION = "Train one exit predictor per layer (BCE, Adam) on the collected data; per-layer precision/recall"
CHECKPOINT = "predictors.pt"


@dataclass
class TrainConfig:
    epochs: int = 40
    lr: float = 1e-3
    batch: int = 1024
    hidden: int = HIDDEN
    val_percent: float = 15.0
    gap: str = "mixed"  # p_prev of the training features: "previous" layer (SpecEE) or "mixed" (see sample_prev)
    seed: int = 0


@dataclass
class Data:
    """The collected data as tensors: features [n, L, 3k], labels / in_cand [n, L] bool, val [n] bool."""

    features: torch.Tensor
    labels: torch.Tensor
    in_cand: torch.Tensor
    val: torch.Tensor

    @property
    def n_layer(self) -> int:
        return self.features.shape[1]


def is_validation(prompt: np.ndarray, percent: float) -> np.ndarray:
    """Held-out prompts, by a hash of their index in the source (stable across runs)."""
    keys = [int.from_bytes(hashlib.blake2b(int(p).to_bytes(8, "little"), digest_size=8).digest(), "little")
            for p in prompt]
    return np.asarray(keys, dtype=np.uint64) % 10000 < int(percent * 100)


def load_data(arrays: dict[str, np.ndarray], val_percent: float) -> Data:
    argmax, final, cand = arrays["argmax"], arrays["final"], arrays["cand"]
    in_cand = (argmax[:, :, None] == cand[:, None, :]).any(-1)
    return Data(torch.from_numpy(arrays["features"]).float(), torch.from_numpy(argmax == final[:, None]),
                torch.from_numpy(in_cand), torch.from_numpy(is_validation(arrays["prompt"], val_percent)))


def fold_standardization(pred: ExitPredictor, mean: torch.Tensor, std: torch.Tensor) -> None:
    """up((x - mean) / std) == up'(x): W' = W / std, b' = b - W' mean."""
    with torch.no_grad():
        pred.up.weight.div_(std)
        pred.up.bias.sub_(pred.up.weight @ mean)


def gap_features(c: torch.Tensor, layer: int, prev: torch.Tensor) -> torch.Tensor:
    """Features of `layer` from candidate logits c [n, L, k] with p_prev from layer prev[i] (-1: none, the
    first checked layer: the gap is p)."""
    rows = torch.arange(len(c))
    p = torch.softmax(c[:, layer], -1)
    p_prev = torch.softmax(c[rows, prev.clamp_min(0)], -1) * (prev >= 0).unsqueeze(-1)
    return torch.cat([c[:, layer], p, p - p_prev], -1)


def sample_prev(n: int, layer: int, gap: str, gen: torch.Generator) -> torch.Tensor:
    """The layer p_prev comes from, per sample: "previous" is layer - 1 (SpecEE's training data; none at
    layer 0); "mixed" is none (the first checked layer) with probability 1/3, else layer - d, d uniform in
    1..4 (none below layer 0), as a schedule checks layers."""
    if gap == "previous":
        return torch.full((n,), layer - 1)
    d = torch.randint(1, 5, (n,), generator=gen)
    first = torch.randint(0, 3, (n,), generator=gen) == 0
    prev = layer - d
    prev[first | (prev < 0)] = -1
    return prev


def train_layer(c: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, layer: int) -> ExitPredictor:
    """One predictor from candidate logits c [n, L, k] (features built per batch, see sample_prev) and
    labels y [n]; raw features in, standardization folded."""
    torch.manual_seed(cfg.seed * 1000 + layer)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + layer)
    x0 = gap_features(c, layer, sample_prev(len(c), layer, cfg.gap, gen))
    mean, std = x0.mean(0), x0.std(0).clamp_min(1e-4)
    ys = y.float()
    pred = ExitPredictor(x0.shape[1], cfg.hidden)
    opt = torch.optim.Adam(pred.parameters(), lr=cfg.lr)
    for _ in range(cfg.epochs):
        perm = torch.randperm(len(c), generator=gen)
        for i in range(0, len(c), cfg.batch):
            idx = perm[i:i + cfg.batch]
            x = gap_features(c[idx], layer, sample_prev(len(idx), layer, cfg.gap, gen))
            loss = F.binary_cross_entropy_with_logits(pred.logit((x - mean) / std), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    fold_standardization(pred, mean, std)
    return pred.eval()


def layer_stats(prob: torch.Tensor, label: torch.Tensor, in_cand: torch.Tensor, threshold: float) -> dict:
    """Validation numbers of one layer's predictor alone."""
    fire = prob > threshold
    exit_ = fire & in_cand

    def ratio(a: torch.Tensor, b: torch.Tensor) -> float | None:
        return round(a.sum().item() / b.sum().item(), 4) if b.sum() > 0 else None

    n = len(label)
    return {
        "n": n, "label_rate": round(label.float().mean().item(), 4), "fire_rate": round(fire.float().mean().item(), 4),
        "precision": ratio(fire & label, fire), "recall": ratio(fire & label, label),
        "exit_rate": round(exit_.float().mean().item(), 4), "exit_precision": ratio(exit_ & label, exit_),
        "bce": round(F.binary_cross_entropy(prob.clamp(1e-7, 1 - 1e-7), label.float()).item(), 4),
    }


def predict(pred: ExitPredictor, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return pred(x)


def save_checkpoint(path: Path, ckpt: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ckpt, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def predictors_of(ckpt: dict) -> dict[int, ExitPredictor]:
    out = {}
    for layer, state in ckpt["layers"].items():
        pred = ExitPredictor(state["up.weight"].shape[1], state["up.weight"].shape[0])
        pred.load_state_dict(state)
        out[int(layer)] = pred.eval()
    return out


def train(data: Data, cfg: TrainConfig, ckpt: dict, path: Path | None, threshold: float = THRESHOLD,
          progress: bool = True) -> dict:
    """Train the layers the checkpoint lacks (0 .. L-2: exiting after the last layer saves nothing)."""
    tr, va = ~data.val, data.val
    k = data.features.shape[2] // 3
    c = data.features[:, :, :k]
    todo = [l for l in range(data.n_layer - 1) if str(l) not in ckpt["layers"]]
    for layer in tqdm(todo, desc="predictors", unit="layer", disable=not progress):
        y = data.labels[:, layer]
        pred = train_layer(c[tr], y[tr], cfg, layer)
        ckpt["layers"][str(layer)] = {key: v.clone() for key, v in pred.state_dict().items()}
        stats = {}
        for split, rows in (("train", tr), ("val", va)):
            for name, prev in (("", layer - 1), ("_first", -1)):
                x = gap_features(c[rows], layer, torch.full((int(rows.sum()),), prev))
                stats[split + name] = layer_stats(predict(pred, x), y[rows], data.in_cand[rows, layer], threshold)
        ckpt["stats"][str(layer)] = stats
        if path is not None:
            save_checkpoint(path, ckpt)
    return ckpt


def format_table(stats: dict, split: str = "val") -> str:
    """Per-layer markdown table of the validation numbers (p_prev from the previous layer, and none: the first
    checked layer)."""
    cols = [("", "label_rate"), ("", "precision"), ("", "recall"), ("", "fire_rate"), ("", "exit_rate"),
            ("", "exit_precision"), ("_first", "precision"), ("_first", "recall"), ("_first", "exit_rate")]
    head = [c.replace("_", " ") + (" (first)" if f else "") for f, c in cols]
    lines = ["| layer | " + " | ".join(head) + " |", "|---:|" + "---:|" * len(cols)]
    for layer in sorted(stats, key=int):
        vals = [stats[layer][split + f][c] for f, c in cols]
        lines.append(f"| {layer} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + " |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_common(ap)
    d = TrainConfig()
    ap.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over each layer's data ({d.epochs})")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--val-percent", type=float, default=d.val_percent, help="held-out prompts, percent")
    ap.add_argument("--gap", choices=["mixed", "previous"], default=d.gap,
                    help="p_prev of the training features: from the previous layer (SpecEE) or mixed: none (first "
                    "checked layer) or 1..4 layers back, as a schedule sees them (default mixed)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--threshold", type=float, default=THRESHOLD, help="for the reported numbers (0.5)")
    ap.add_argument("--restart", action="store_true", help="discard the checkpoint and train every layer again")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    work = work_dir(args)
    store = open_store(work / "data")
    if store.config.get("questions"):
        raise ValueError(f"{work}: collected on evaluation prompts ({store.config['questions']}) "
                         "for analysis; train on ShareGPT data (another --work-dir)")
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, batch=args.batch, val_percent=args.val_percent, gap=args.gap,
                      seed=args.seed)
    data_info = {**store.config, "n_tokens": store.n_tokens, "n_prompts": store.n_prompts, "n_done": store.n_done}
    path = work / CHECKPOINT
    ckpt = {"config": asdict(cfg), "data": data_info, "threshold": args.threshold, "layers": {}, "stats": {}}
    if path.is_file() and not args.restart:
        old = load_checkpoint(path)
        if (old["config"], old["data"], old["threshold"]) != (ckpt["config"], ckpt["data"], ckpt["threshold"]):
            raise ValueError(f"{path} was trained with other settings or data: {old['config']} on "
                             f"{old['data']['n_tokens']} positions; pass --restart to train again")
        ckpt = old
        if ckpt["layers"]:
            print(f"continuing {path}: {len(ckpt['layers'])} layers done")
    data = load_data(store.load(), cfg.val_percent)
    print(f"data: {len(data.val)} decode positions, {int(data.val.sum())} held out; {data.n_layer} layers")
    ckpt = train(data, cfg, ckpt, path, args.threshold)
    print(format_table(ckpt["stats"]))
    (work / "train-stats.json").write_text(json.dumps({"config": ckpt["config"], "data": ckpt["data"],
                                                       "stats": ckpt["stats"]}, indent=1) + "\n")
    print(f"wrote {path} and {work / 'train-stats.json'}")
