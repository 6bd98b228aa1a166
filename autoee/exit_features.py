"""SpecEE exit features and predictors: the PyTorch reference.

At a layer l of a decoded token, with the EAGLE head's top-k candidates for that position (k = 4):

    h    = RMSNorm_final(h_l)                       the model's final norm on the layer's output  [n_embd]
    c    = lm_head[cand] . h                        candidate logits, in the head's rank order    [k]
    p    = softmax(c)                                                                              [k]
    feat = [c, p, p - p_prev]                                                                      [3k]

p_prev is p at the previously *evaluated* layer of the same token: the previous layer when features are
computed at every layer (training data), the previous scheduled layer at run time. At the first such layer
there is no previous p and the third group is p itself (p_prev = 0), as SpecEE does in both its data
collection and its decoder (`prob_gap = draft_prob` when `last_prob is None`).

The predictor of layer l: sigmoid(down(relu(up(feat)))), up = Linear(3k, 512), down = Linear(512, 1); it fires
above the threshold (0.5). The label of (token, layer): argmax(lm_head(h)) == the full model's token.
The native runtime is tested against `exit_features` / `scheduled_features` and `ExitPredictor` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn as nn

from specee import constants as C

N_CANDIDATES = 4
HIDDEN = 512
THRESHOLD = 0.5


@dataclass
class LmHead:
    """What the features need from the target model: the final norm and the lm_head (dequantized, float32)."""

    norm: torch.Tensor  # [n_embd] output_norm.weight
    eps: float
    weight: torch.Tensor  # [n_vocab, n_embd] output.weight, or token_embd.weight when tied

    @property
    def n_vocab(self) -> int:
        return self.weight.shape[0]


def read_lm_head(path: str | Path) -> LmHead:
    """The final norm and lm_head of a GGUF (any family), dequantized to float32 with the `gguf` package."""
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def dequant(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else C.ARCH
    field = reader.fields.get(C.KEY_LAYER_NORM_RMS_EPS.format(arch=arch))
    eps = float(field.contents()) if field is not None else 1e-5
    weight = dequant(C.OUTPUT if C.OUTPUT in tensors else C.TOKEN_EMBD)
    return LmHead(dequant(C.OUTPUT_NORM), eps, weight)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


# ---- features


def candidate_logits(hidden: torch.Tensor, head: LmHead, cand: torch.Tensor) -> torch.Tensor:
    """Candidate logits [..., n, k] of hidden states [..., n, n_embd] (before the final norm) for the
    candidates cand [n, k] of each token."""
    h = rms_norm(hidden.float(), head.norm, head.eps)
    rows = head.weight[cand.long()]  # [n, k, n_embd]
    return torch.einsum("...nd,nkd->...nk", h, rows)


def exit_features(c: torch.Tensor, p_prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [..., 3k] = [c, p, p - p_prev] of candidate logits c [..., k], and p (the next p_prev).
    p_prev None: the first evaluated layer of the token, the third group is p itself."""
    p = torch.softmax(c, dim=-1)
    gap = p if p_prev is None else p - p_prev
    return torch.cat([c, p, gap], dim=-1), p


def layer_features(hidden: torch.Tensor, head: LmHead, cand: torch.Tensor) -> torch.Tensor:
    """Features at every layer (training data): hidden [L, n, n_embd] after layers 0..L-1, cand [n, k]
    -> [L, n, 3k], p_prev from the layer before (none at layer 0)."""
    return scheduled_features(hidden, head, cand, list(range(hidden.shape[0])))


def scheduled_features(hidden: torch.Tensor, head: LmHead, cand: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """Features at the given layers only, in that order, as the decoder computes them: p_prev from the
    previous layer of the list (none at its first). hidden [L, n, n_embd] -> [len(layers), n, 3k]."""
    c = candidate_logits(hidden[layers], head, cand)
    out, p_prev = [], None
    for i in range(len(layers)):
        f, p_prev = exit_features(c[i], p_prev)
        out.append(f)
    return torch.stack(out)


def layer_argmax(hidden: torch.Tensor, head: LmHead, chunk: int = 64) -> torch.Tensor:
    """argmax(lm_head(norm(h_l))) [L, n] of hidden [L, n, n_embd] (full vocabulary, float32)."""
    L, n, _ = hidden.shape
    flat = rms_norm(hidden.reshape(L * n, -1).float(), head.norm, head.eps)
    out = torch.empty(L * n, dtype=torch.int64)
    for i in range(0, L * n, chunk):
        out[i:i + chunk] = (flat[i:i + chunk] @ head.weight.T).argmax(-1)
    return out.reshape(L, n)


# ---- predictor


class ExitPredictor(nn.Module):
    """One layer's predictor: sigmoid(down(relu(up(features)))). Parameter names are the GGUF names without
    `blk.N.pred.` (up.weight [512, 3k], up.bias [512], down.weight [1, 512], down.bias [1])."""

    def __init__(self, n_features: int = 3 * N_CANDIDATES, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(n_features, hidden)
        self.down = nn.Linear(hidden, 1)

    def logit(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).squeeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(x))


def predictor_tensors(predictors: dict[int, ExitPredictor]) -> dict[str, torch.Tensor]:
    """The predictors under their GGUF names (blk.N.pred.*), float32."""
    names = {"up.weight": C.PRED_UP, "up.bias": C.PRED_UP_BIAS, "down.weight": C.PRED_DOWN,
             "down.bias": C.PRED_DOWN_BIAS}
    return {names[k] % layer: v.detach().float().contiguous()
            for layer, pred in sorted(predictors.items()) for k, v in pred.state_dict().items()}


def load_predictor_tensors(tensors: dict[str, torch.Tensor]) -> dict[int, ExitPredictor]:
    """Predictors from blk.N.pred.* tensors (the inverse of predictor_tensors)."""
    layers = sorted({int(name.split(".")[1]) for name in tensors})
    out = {}
    for layer in layers:
        up = tensors[C.PRED_UP % layer]
        pred = ExitPredictor(up.shape[1], up.shape[0])
        pred.load_state_dict({"up.weight": up, "up.bias": tensors[C.PRED_UP_BIAS % layer],
                              "down.weight": tensors[C.PRED_DOWN % layer],
                              "down.bias": tensors[C.PRED_DOWN_BIAS % layer]})
        out[layer] = pred
    return out
