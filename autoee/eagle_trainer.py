"""Training and validation of EAGLE-1 and EAGLE-3 heads on stored features (see eagle_features.py).

EAGLE-1: each training pair at position i of a conversation: input (token t_{i+1}, feature f_i), output the
predicted f_{i+1}. Loss = SmoothL1(pred, f_{i+1}) + ce_weight * CE(logits(pred), softmax(lm_head(f_{i+1})))
as EAGLE-1 does (the target's distribution as soft labels), over assistant tokens by default, with uniform
noise on the input features.

EAGLE-3 (the training-time test): step 1 feeds (t_{i+1}, fc(three target layers' outputs at i)); step s = 2..K
feeds row i the head's own output of step s-1 with the data's token t_{i+s} at position i+s-1, attending to the
step-1 keys up to i and to its own earlier steps, as drafting a chain does (`unroll`, shared with the chain
estimate). Loss = sum over steps of ttt_decay^(s-1) * CE against the target's distribution at the drafted
position (softmax of the base lm_head's draft-vocabulary rows on f_{i+s}), where the target's argmax lies in
the draft vocabulary, as EAGLE-3 does; no feature regression, no noise; the head's own lm_head is trained.
(EAGLE-3's code keeps every step at position i; here the positions are the ones drafting uses.)

Conversations are packed into rows of seq_len pairs with a block-causal mask. The batch sequence and the noise
are functions of (seed, step), so a resumed run continues exactly.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specee.autoee.eagle_features import FeatureStore
from specee.autoee.eagle_head import BaseWeights, Eagle3Head, EagleHead, HeadConfig, causal_mask

Head = EagleHead | Eagle3Head


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
    eagle_version: int = 1  # 3: an Eagle3Head trained with the training-time test (needs the store's features3)
    ttt_steps: int = 7  # EAGLE-3: unrolled draft steps per training pair (EAGLE-3's 7)
    ttt_decay: float = 0.8  # EAGLE-3: weight of step s is ttt_decay^(s-1)
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
    feat: torch.Tensor  # [B, T, H] f_i (input; EAGLE-1)
    target_feat: torch.Tensor  # [B, T, H] f_{i+1}
    target_id: torch.Tensor  # [B, T] the target's argmax after f_{i+1}
    weight: torch.Tensor  # [B, T] 1 where the loss counts
    pos: torch.Tensor  # [B, T]
    segment: torch.Tensor  # [B, T] conversation index within the row (-1: padding)
    feat3: torch.Tensor | None = None  # [B, T, 3H] the feature layers' outputs at i (input; EAGLE-3)
    mask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.mask = causal_mask(self.segment)


def make_batch(store: FeatureStore, rows: list[list[tuple[int, int]]], seq_len: int, loss_on: str,
               with_features3: bool = False) -> Batch:
    b, h = len(rows), store.n_embd
    feat3 = np.zeros((b, seq_len, 3 * h), np.float32) if with_features3 else None
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
            if feat3 is not None:
                feat3[r, sl] = store.features3[s:e - 1]
            target_feat[r, sl] = f[1:]
            target_id[r, sl] = store.targets[s + 1:e]
            weight[r, sl] = store.assistant[s + 1:e] if loss_on == "assistant" else 1.0
            pos[r, sl] = np.arange(n)
            segment[r, sl] = k
            at += n
    t = torch.from_numpy
    return Batch(t(tokens), t(feat), t(target_feat), t(target_id), t(weight), t(pos), t(segment),
                 None if feat3 is None else t(feat3))


def batch_of(store: FeatureStore, rows: list[list[tuple[int, int]]], cfg: TrainConfig) -> Batch:
    """The batch of packed rows with the inputs the config's head version takes."""
    if cfg.eagle_version == 3 and store.features3 is None:
        raise ValueError(f"{store.root}: the store has no EAGLE-3 features (features3.npy; it was collected without "
                         "them): collect again into a new work dir to train an EAGLE-3 head")
    return make_batch(store, rows, cfg.seq_len, cfg.loss_on, with_features3=cfg.eagle_version == 3)


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
    ce: float  # EAGLE-3: of step 1
    accuracy: float  # teacher-forced top-1: draft argmax == target argmax
    n: int
    step_accuracy: list[float] | None = None  # EAGLE-3: top-1 of each training-time-test step


def target_logits(head: Head, base: BaseWeights, feat: torch.Tensor) -> torch.Tensor:
    """The target's logits from its features, over the draft vocabulary when the head has one."""
    if head.draft_vocab is not None:
        return feat @ base.lm_head[head.draft_vocab_ids].T
    return feat @ base.lm_head.T


def to_target_ids(head: Head, draft_argmax: torch.Tensor, full_vocab: bool = False) -> torch.Tensor:
    return head.draft_vocab_ids[draft_argmax] if head.draft_vocab is not None and not full_vocab else draft_argmax


def head_logits(head: Head, base: BaseWeights, out: torch.Tensor, full_vocab: bool = False) -> torch.Tensor:
    """Draft logits of the head's outputs (an EAGLE-3 head has only its own draft-vocabulary lm_head)."""
    if isinstance(head, Eagle3Head):
        if full_vocab:
            raise ValueError("an EAGLE-3 head drafts over its own lm_head only (no full-vocabulary variant)")
        return head.logits(out)
    return head.logits(out, base, full_vocab)


def draft_tokens(head: Head, base: BaseWeights, pred: torch.Tensor, full_vocab: bool = False) -> torch.Tensor:
    """The draft's argmax as target token ids."""
    return to_target_ids(head, head_logits(head, base, pred, full_vocab).argmax(-1), full_vocab)


def has_full_vocab_variant(head: Head) -> bool:
    """An EAGLE-1 head with a draft vocabulary also runs with the base lm_head over the full vocabulary."""
    return isinstance(head, EagleHead) and head.draft_vocab is not None


def compute_loss(head: Head, base: BaseWeights, batch: Batch, cfg: TrainConfig, noise: bool) -> Losses:
    if isinstance(head, Eagle3Head):
        return ttt_loss(head, base, batch, cfg)
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


def shifted(x: torch.Tensor, sh: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, i + sh] at row position i ([B, T, ..]), `fill` past the row's end."""
    if sh == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-sh] = x[:, sh:]
    return out


def same_segment(segment: torch.Tensor, sh: int) -> torch.Tensor:
    """[B, T]: position i + sh is in the same (non-padding) conversation as i."""
    return (shifted(segment, sh, -1) == segment) & (segment >= 0)


def unroll(head: Head, base: BaseWeights, batch: Batch, steps: int, first: torch.Tensor) -> Iterator[torch.Tensor]:
    """The head's outputs [B, T, H] of draft steps s = 1..steps. Step 1: the pairs (t_{i+1}, `first`_i) (the
    target's features), causal. Step s: row i fed its own output of step s-1 with the data's token t_{i+s} at
    position i+s-1, attending to the step-1 inputs up to i and to its own chain (identity blocks): exactly the
    draft's KV cache when it drafts a chain after position i. Rows past a conversation's end are garbage (mask
    them with `same_segment`)."""
    x, a = head.step_inputs(base.embd[batch.tokens], first)
    q, k, v = head.qkv(a, batch.pos)
    out = head.finish(x, q, k, v, batch.mask)
    yield out
    b, t = batch.tokens.shape
    ks, vs = [k], [v]
    eye = torch.eye(t, dtype=torch.bool).expand(b, t, t)
    for s in range(2, steps + 1):
        x, a = head.step_inputs(base.embd[shifted(batch.tokens, s - 1)], out)
        q, k, v = head.qkv(a, batch.pos + s - 1)
        ks.append(k)
        vs.append(v)
        mask = torch.cat([batch.mask] + [eye] * (s - 1), -1)
        out = head.finish(x, q, torch.cat(ks, 2), torch.cat(vs, 2), mask)
        yield out


def ttt_loss(head: Eagle3Head, base: BaseWeights, batch: Batch, cfg: TrainConfig) -> Losses:
    """EAGLE-3's training-time test over cfg.ttt_steps steps (module docstring)."""
    with torch.no_grad():  # the target's distribution where the loss may count (row `at[b, i]` of `soft`)
        counts = batch.weight > 0
        soft = torch.softmax(target_logits(head, base, batch.target_feat[counts]), -1)  # [N, V_draft]
        at = torch.zeros_like(batch.tokens)
        at[counts] = torch.arange(soft.shape[0])
        in_vocab = torch.zeros(base.lm_head.shape[0], dtype=torch.bool)
        in_vocab[head.draft_vocab_ids] = True
        weight = batch.weight * in_vocab[batch.target_id]  # the loss counts where the target's token is draftable
    n_ce, n_acc = max(float(weight.sum()), 1.0), max(float(batch.weight.sum()), 1.0)
    total, ces, accs = torch.zeros(()), [], []
    for s, out in enumerate(unroll(head, base, batch, cfg.ttt_steps, batch.feat3), 1):
        sh = s - 1
        counted = shifted(batch.weight, sh) * same_segment(batch.segment, sh)
        bi, ti = counted.nonzero(as_tuple=True)
        logits = head.logits(out[bi, ti])
        w = shifted(weight, sh)[bi, ti] * counted[bi, ti]
        ce = -(soft[at[bi, ti + sh]] * torch.log_softmax(logits, -1)).sum(-1).mul(w).sum() / n_ce
        total = total + cfg.ttt_decay ** sh * ce
        ces.append(ce.item())
        with torch.no_grad():
            hit = to_target_ids(head, logits.argmax(-1)) == batch.target_id[bi, ti + sh]
            accs.append(float((hit.float() * counted[bi, ti]).sum() / n_acc))
    return Losses(total, 0.0, ces[0], accs[0], int((batch.weight > 0).sum()), accs)


# ---- optimisation and checkpoints


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(head: Head, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in head.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def train_step(head: Head, opt: torch.optim.Optimizer, base: BaseWeights, batch: Batch, cfg: TrainConfig,
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


def save_checkpoint(path: Path, head: Head, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                    history: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "config": asdict(cfg),
                "head_config": asdict(head.cfg), "draft_vocab": head.draft_vocab,
                "feature_layers": getattr(head, "feature_layers", None), "history": history}, tmp)
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
    return batch_of(store, cache["rows"][k * cfg.rows:(k + 1) * cfg.rows], cfg)


def train(head: Head, opt: torch.optim.Optimizer, base: BaseWeights, store: FeatureStore,
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
                        **({"step_accuracy": losses.step_accuracy} if losses.step_accuracy else {}),
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
def chain_accuracy(head: Head, base: BaseWeights, batch: Batch, steps: int, full_vocab: bool = False,
                   preds: list[torch.Tensor] | None = None) -> tuple[np.ndarray, int]:
    """Counts of positions whose first k drafted tokens all match the target's argmax, k = 1..steps.

    Step s at position j drafts from (t_{j+s}, the head's output of step s-1) at position j+s-1 and attends to
    the true-feature inputs up to j plus its own chain (`unroll`: exactly the draft's KV cache when drafting a
    chain). Counted only where the data's tokens along the chain equal the target's argmax (so the context is
    the one greedy decoding would have). `preds`, when given, receives each step's outputs."""
    head.eval()
    first = batch.feat3 if isinstance(head, Eagle3Head) else batch.feat
    ok = batch.weight > 0
    counts = []
    for s, out in enumerate(unroll(head, base, batch, steps, first), 1):
        if preds is not None:
            preds.append(out)
        sh = s - 1
        draft = draft_tokens(head, base, out, full_vocab)
        ok = ok & (draft == shifted(batch.target_id, sh, -1))
        if sh:  # the chain's token t_{j+s} is the target's argmax of the step before, in the same conversation
            chain = shifted(batch.tokens, sh) == shifted(batch.target_id, sh - 1, -2)
            ok = ok & same_segment(batch.segment, sh) & chain
        counts.append(int(ok.sum()))
    return np.array(counts), int((batch.weight > 0).sum())


@torch.no_grad()
def validate(head: Head, base: BaseWeights, store: FeatureStore, spans: list[tuple[int, int]],
             cfg: TrainConfig, *, chain_steps: int = 3, progress: bool = True) -> Validation:
    head.eval()
    rows = pack(spans, cfg.seq_len)
    reg = ce = acc = 0.0
    n = 0
    counts = np.zeros(chain_steps, np.int64)
    counts_full = np.zeros(chain_steps, np.int64)
    n_chain = 0
    for i in tqdm(range(0, len(rows), cfg.rows), desc="validate", disable=not progress):
        batch = batch_of(store, rows[i:i + cfg.rows], cfg)
        losses = compute_loss(head, base, batch, replace(cfg, ttt_steps=1), noise=False)  # EAGLE-3: step 1's CE
        reg += losses.regression * losses.n
        ce += losses.ce * losses.n
        acc += losses.accuracy * losses.n
        n += losses.n
        c, m = chain_accuracy(head, base, batch, chain_steps)
        counts += c
        n_chain += m
        if has_full_vocab_variant(head):
            counts_full += chain_accuracy(head, base, batch, chain_steps, full_vocab=True)[0]
    n, n_chain = max(n, 1), max(n_chain, 1)
    full = (counts_full / n_chain).tolist() if has_full_vocab_variant(head) else None
    return Validation(reg / n, ce / n, acc / n, (counts / n_chain).tolist(), n, full)
