"""Training and validation of the EAGLE-1 head on stored features (see eagle_features.py).

Each training pair at position i of a conversation: input (token t_{i+1}, feature f_i), output the
predicted f_{i+1}. Loss = SmoothL1(pred, f_{i+1}) + ce_weight * CE(logits(pred), softmax(lm_head(f_{i+1})))
as EAGLE-1 does (the target's distribution as soft labels), over assistant tokens by default, with uniform
noise on the input features. Conversations are packed into rows of seq_len pairs with a block-causal mask.
The batch sequence and the noise are functions of (seed, step), so a resumed run continues exactly.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specee.autoee.eagle_features import FeatureStore
from specee.autoee.eagle_head import BaseWeights, EagleHead, HeadConfig, causal_mask


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 3e-4
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    seq_len: int = 512  # pairs per packed row
    rows: int = 4  # packed rows per step
    noise: float = 0.2  # width of the uniform noise added to input features
    ce_weight: float = 0.1
    loss_on: str = "assistant"  # or "all"
    draft_vocab: int = 0  # 0: full vocabulary through the frozen lm_head; N: own lm_head over the N most frequent
    train_draft_lm_head: bool = False  # train that own lm_head (EAGLE-3); frozen, it is the base lm_head's rows
    val_percent: float = 2.0
    seed: int = 0


# ---- data


def is_validation(store: FeatureStore, start: int, percent: float) -> bool:
    """A conversation is held out by a hash of its first 64 tokens (stable across runs and resumes)."""
    key = hashlib.blake2b(store.tokens[start:start + 64].tobytes(), digest_size=8).digest()
    return int.from_bytes(key, "little") % 10000 < percent * 100


def split_spans(store: FeatureStore, percent: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    train, val = [], []
    for s, e in store.spans():
        if e - s >= 2:
            (val if is_validation(store, s, percent) else train).append((s, e))
    return train, val


def pack(spans: list[tuple[int, int]], seq_len: int) -> list[list[tuple[int, int]]]:
    """Greedy packing of conversations (each gives e - s - 1 pairs, cut at seq_len) into rows."""
    rows, row, used = [], [], 0
    for s, e in spans:
        e = min(e, s + seq_len + 1)
        n = e - s - 1
        if used + n > seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append((s, e))
        used += n
    if row:
        rows.append(row)
    return rows


def epoch_rows(spans: list[tuple[int, int]], cfg: TrainConfig, epoch: int) -> list[list[tuple[int, int]]]:
    order = np.random.default_rng([cfg.seed, epoch]).permutation(len(spans))
    return pack([spans[i] for i in order], cfg.seq_len)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] next token t_{i+1} (input)
    feat: torch.Tensor  # [B, T, H] f_i (input)
    target_feat: torch.Tensor  # [B, T, H] f_{i+1}
    target_id: torch.Tensor  # [B, T] the target's argmax after f_{i+1}
    weight: torch.Tensor  # [B, T] 1 where the loss counts
    pos: torch.Tensor  # [B, T]
    segment: torch.Tensor  # [B, T] conversation index within the row (-1: padding)
    mask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.mask = causal_mask(self.segment)


def make_batch(store: FeatureStore, rows: list[list[tuple[int, int]]], seq_len: int, loss_on: str) -> Batch:
    b, h = len(rows), store.n_embd
    tokens = np.zeros((b, seq_len), np.int64)
    feat = np.zeros((b, seq_len, h), np.float32)
    target_feat = np.zeros((b, seq_len, h), np.float32)
    target_id = np.zeros((b, seq_len), np.int64)
    weight = np.zeros((b, seq_len), np.float32)
    pos = np.zeros((b, seq_len), np.int64)
    segment = np.full((b, seq_len), -1, np.int64)
    for r, row in enumerate(rows):
        at = 0
        for k, (s, e) in enumerate(row):
            n = e - s - 1
            sl = slice(at, at + n)
            tokens[r, sl] = store.tokens[s + 1:e]
            f = store.features[s:e]
            feat[r, sl] = f[:-1]
            target_feat[r, sl] = f[1:]
            target_id[r, sl] = store.targets[s + 1:e]
            weight[r, sl] = store.assistant[s + 1:e] if loss_on == "assistant" else 1.0
            pos[r, sl] = np.arange(n)
            segment[r, sl] = k
            at += n
    t = torch.from_numpy
    return Batch(t(tokens), t(feat), t(target_feat), t(target_id), t(weight), t(pos), t(segment))


def draft_vocabulary(store: FeatureStore, spans: list[tuple[int, int]], n: int) -> list[int]:
    """The n target tokens most often predicted by the target (its argmax) over the training spans."""
    counts = np.zeros(int(store.targets[: store.n_tokens].max()) + 1, np.int64)
    for s, e in spans:
        counts += np.bincount(store.targets[s:e], minlength=counts.shape[0])[: counts.shape[0]]
    order = np.argsort(-counts, kind="stable")[:n]
    return sorted(int(i) for i in order)


# ---- loss


@dataclass
class Losses:
    total: torch.Tensor
    regression: float
    ce: float
    accuracy: float  # teacher-forced top-1: draft argmax == target argmax
    n: int


def target_logits(head: EagleHead, base: BaseWeights, feat: torch.Tensor) -> torch.Tensor:
    """The target's logits from its features, over the draft vocabulary when the head has one."""
    if head.draft_vocab is not None:
        return feat @ base.lm_head[head.draft_vocab_ids].T
    return feat @ base.lm_head.T


def to_target_ids(head: EagleHead, draft_argmax: torch.Tensor, full_vocab: bool = False) -> torch.Tensor:
    return head.draft_vocab_ids[draft_argmax] if head.draft_vocab is not None and not full_vocab else draft_argmax


def draft_tokens(head: EagleHead, base: BaseWeights, pred: torch.Tensor, full_vocab: bool = False) -> torch.Tensor:
    """The draft's argmax as target token ids."""
    return to_target_ids(head, head.logits(pred, base, full_vocab).argmax(-1), full_vocab)


def compute_loss(head: EagleHead, base: BaseWeights, batch: Batch, cfg: TrainConfig, noise: bool) -> Losses:
    emb = base.embd[batch.tokens]
    feat = batch.feat
    if noise and cfg.noise > 0:
        feat = feat + (torch.rand_like(feat) - 0.5) * cfg.noise
    pred = head(emb, feat, batch.pos, batch.mask)
    sel = batch.weight > 0
    w = batch.weight[sel]
    n = max(float(w.sum()), 1.0)
    p, t = pred[sel], batch.target_feat[sel]  # [N, H]
    regression = (F.smooth_l1_loss(p, t, reduction="none").mean(-1) * w).sum() / n
    logits = head.logits(p, base)
    with torch.no_grad():
        soft = torch.softmax(target_logits(head, base, t), -1)
    ce = -(soft * torch.log_softmax(logits, -1)).sum(-1).mul(w).sum() / n
    with torch.no_grad():
        acc = float(((to_target_ids(head, logits.argmax(-1)) == batch.target_id[sel]).float() * w).sum() / n)
    total = regression + cfg.ce_weight * ce
    return Losses(total, regression.item(), ce.item(), acc, int(sel.sum()))


# ---- optimisation and checkpoints


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(head: EagleHead, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in head.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def train_step(head: EagleHead, opt: torch.optim.Optimizer, base: BaseWeights, batch: Batch, cfg: TrainConfig,
               step: int) -> Losses:
    torch.manual_seed(cfg.seed * 1_000_003 + step)  # the noise of this step
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    head.train()
    losses = compute_loss(head, base, batch, cfg, noise=True)
    opt.zero_grad(set_to_none=True)
    losses.total.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    opt.step()
    return losses


def save_checkpoint(path: Path, head: EagleHead, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                    history: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "config": asdict(cfg),
                "head_config": asdict(head.cfg), "draft_vocab": head.draft_vocab, "history": history}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def batch_for_step(store: FeatureStore, spans: list[tuple[int, int]], cfg: TrainConfig, step: int,
                   cache: dict) -> Batch:
    """The batch of a step: epoch e's packed rows are a function of (seed, e); steps walk through them."""
    n_rows = len(pack(spans, cfg.seq_len))
    per_epoch = max(1, n_rows // cfg.rows)
    epoch, k = divmod(step, per_epoch)
    if cache.get("epoch") != epoch:
        cache["epoch"], cache["rows"] = epoch, epoch_rows(spans, cfg, epoch)
    return make_batch(store, cache["rows"][k * cfg.rows:(k + 1) * cfg.rows], cfg.seq_len, cfg.loss_on)


def train(head: EagleHead, opt: torch.optim.Optimizer, base: BaseWeights, store: FeatureStore,
          spans: list[tuple[int, int]], cfg: TrainConfig, *, start_step: int = 0, checkpoint: Path | None = None,
          save_every: int = 100, history: list[dict] | None = None, deadline: float | None = None,
          progress: bool = True) -> list[dict]:
    """Run steps [start_step, cfg.steps), or until time.time() passes `deadline` (then a checkpoint is saved
    and a later call resumes); returns the per-step log (appended to `history`)."""
    history = history if history is not None else []
    cache: dict = {}
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, desc="train", unit="step",
               disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        batch = batch_for_step(store, spans, cfg, step, cache)
        losses = train_step(head, opt, base, batch, cfg, step)
        history.append({"step": step, "loss": losses.total.item(), "regression": losses.regression,
                        "ce": losses.ce, "accuracy": losses.accuracy, "n": losses.n,
                        "seconds": time.perf_counter() - t0})
        recent = history[-50:]
        bar.set_postfix(loss=f"{np.mean([h['loss'] for h in recent]):.3f}",
                        acc=f"{np.mean([h['accuracy'] for h in recent]):.3f}", lr=f"{lr_at(step, cfg):.1e}")
        late = deadline is not None and time.time() > deadline
        if checkpoint is not None and ((step + 1) % save_every == 0 or step + 1 == cfg.steps or late):
            save_checkpoint(checkpoint, head, opt, step + 1, cfg, history)
        if late:
            break
    return history


# ---- validation


@dataclass
class Validation:
    regression: float
    ce: float
    accuracy: float  # 1-step acceptance estimate (teacher-forced top-1 against the target's argmax)
    chain: list[float]  # P(first k drafted tokens all accepted), k = 1..steps, feeding predicted features
    n: int
    chain_full_vocab: list[float] | None = None  # the same through the base lm_head, for a draft-vocabulary head

    @property
    def expected_accepted(self) -> float:
        """Tokens per target pass for a single draft chain of len(chain) tokens: 1 (the target's own) + sum."""
        return 1.0 + sum(self.chain)


@torch.no_grad()
def chain_accuracy(head: EagleHead, base: BaseWeights, batch: Batch, steps: int, full_vocab: bool = False,
                   preds: list[torch.Tensor] | None = None) -> tuple[np.ndarray, int]:
    """Counts of positions whose first k drafted tokens all match the target's argmax, k = 1..steps.

    Step s at position j drafts from (t_{j+s}, predicted f_{j+s-1}) at position j+s-1 and attends to the
    true-feature inputs up to j plus its own chain (exactly the draft's KV cache when drafting a chain).
    Counted only where the data's tokens along the chain equal the target's argmax (so the context is the
    one greedy decoding would have). `preds`, when given, receives each step's predicted features."""
    head.eval()
    emb = base.embd[batch.tokens]
    x1 = head.fc(torch.cat([emb, batch.feat], -1))
    q, k1, v1 = head.qkv(x1, batch.pos)
    pred = head.finish(x1, q, k1, v1, batch.mask)
    if preds is not None:
        preds.append(pred)
    b, t = batch.tokens.shape
    valid = batch.weight > 0
    ok = valid & (draft_tokens(head, base, pred, full_vocab) == batch.target_id)
    counts = [int(ok.sum())]
    ks, vs = [k1], [v1]
    eye = torch.eye(t, dtype=torch.bool).expand(b, t, t)
    for s in range(2, steps + 1):
        # inputs shifted by s-1 along the row, valid while inside the same conversation
        sh = s - 1
        same = torch.zeros(b, t, dtype=torch.bool)
        same[:, :-sh] = batch.segment[:, sh:] == batch.segment[:, :-sh]
        same &= batch.segment >= 0
        tok = torch.zeros_like(batch.tokens)
        tok[:, :-sh] = batch.tokens[:, sh:]
        tgt = torch.full_like(batch.target_id, -1)
        tgt[:, :-sh] = batch.target_id[:, sh:]
        prev_tgt = torch.full_like(batch.target_id, -2)
        prev_tgt[:, :-sh] = batch.target_id[:, sh - 1:-1] if sh > 1 else batch.target_id[:, :-sh]
        x = head.fc(torch.cat([base.embd[tok], pred], -1))
        q, k, v = head.qkv(x, batch.pos + sh)
        ks.append(k)
        vs.append(v)
        mask = torch.cat([batch.mask] + [eye] * (s - 1), -1)
        pred = head.finish(x, q, torch.cat(ks, 2), torch.cat(vs, 2), mask)
        if preds is not None:
            preds.append(pred)
        draft = draft_tokens(head, base, pred, full_vocab)
        ok = ok & same & (tok == prev_tgt) & (draft == tgt)
        counts.append(int(ok.sum()))
    return np.array(counts), int(valid.sum())


@torch.no_grad()
def validate(head: EagleHead, base: BaseWeights, store: FeatureStore, spans: list[tuple[int, int]],
             cfg: TrainConfig, *, chain_steps: int = 3, progress: bool = True) -> Validation:
    head.eval()
    rows = pack(spans, cfg.seq_len)
    reg = ce = acc = 0.0
    n = 0
    counts = np.zeros(chain_steps, np.int64)
    counts_full = np.zeros(chain_steps, np.int64)
    n_chain = 0
    for i in tqdm(range(0, len(rows), cfg.rows), desc="validate", disable=not progress):
        batch = make_batch(store, rows[i:i + cfg.rows], cfg.seq_len, cfg.loss_on)
        losses = compute_loss(head, base, batch, cfg, noise=False)
        reg += losses.regression * losses.n
        ce += losses.ce * losses.n
        acc += losses.accuracy * losses.n
        n += losses.n
        c, m = chain_accuracy(head, base, batch, chain_steps)
        counts += c
        n_chain += m
        if head.draft_vocab is not None:
            counts_full += chain_accuracy(head, base, batch, chain_steps, full_vocab=True)[0]
    n, n_chain = max(n, 1), max(n_chain, 1)
    full = (counts_full / n_chain).tolist() if head.draft_vocab is not None else None
    return Validation(reg / n, ce / n, acc / n, (counts / n_chain).tolist(), n, full)
