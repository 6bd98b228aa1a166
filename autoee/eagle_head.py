"""The EAGLE draft heads in PyTorch, for training and as the runtime's reference.

EagleHead (EAGLE-1): x = fc(concat(embed(t_{i+1}), f_i)) (with bias), then one Llama decoder layer without its
input RMSNorm (self-attention with the base model's RoPE and GQA, then post-attention RMSNorm and SwiGLU MLP),
no final norm. It predicts f_{i+1}; logits come from the frozen base lm_head, or from an own lm_head over a
reduced draft vocabulary (EAGLE-3 style).

Eagle3Head (EAGLE-3): the feature is the target's hidden states after three layers (low, middle, high)
concatenated [3H] and fused by fc (no bias), or, at later draft steps, the head's own output [H] (no fc). The
decoder layer's attention reads concat(attn_norm(embed(t)), hidden_norm(x)) [2H]; the residual is x itself;
post-attention RMSNorm and SwiGLU MLP follow; logits are output(output_norm(.)) over the draft vocabulary.
forward() takes either width, so a training-time-test loop can feed the head its own outputs.

q and k weights are kept in Hugging Face's row order (rotate-half RoPE); `specee.convert merge` permutes
them for GGML's RoPE, as it does for published heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specee import constants as C


@dataclass
class HeadConfig:
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    n_vocab: int


@dataclass
class BaseWeights:
    """The frozen parts of the target model the head uses: token embedding and lm_head, [n_vocab, n_embd]."""

    embd: torch.Tensor
    lm_head: torch.Tensor


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_base(path: str) -> tuple[HeadConfig, BaseWeights]:
    """The head's configuration (the base model's layer shapes) and the dequantized embedding / lm_head."""
    reader = gguf.GGUFReader(path)
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch not in C.FAMILIES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (one of {', '.join(C.FAMILIES)})")

    def get(key: str, default=None):
        value = _field(reader, key.format(arch=arch))
        if value is None and default is None:
            raise ValueError(f"{path}: metadata key {key.format(arch=arch)} is missing")
        return value if value is not None else default

    n_embd, n_head = int(get(C.KEY_EMBEDDING_LENGTH)), int(get(C.KEY_HEAD_COUNT))
    tensors = {t.name: t for t in reader.tensors}

    def dequant(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    embd = dequant(C.TOKEN_EMBD)
    lm_head = dequant(C.OUTPUT) if C.OUTPUT in tensors else embd
    cfg = HeadConfig(
        n_embd=n_embd,
        n_ff=int(get(C.KEY_FEED_FORWARD_LENGTH)),
        n_head=n_head,
        n_head_kv=int(get(C.KEY_HEAD_COUNT_KV, n_head)),
        head_dim=int(get(C.KEY_KEY_LENGTH, n_embd // n_head)),
        rope_theta=float(get(C.KEY_ROPE_FREQ_BASE, 10000.0)),
        rms_eps=float(get(C.KEY_LAYER_NORM_RMS_EPS, 1e-5)),
        n_vocab=embd.shape[0],
    )
    return cfg, BaseWeights(embd, lm_head)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face order). x [B, n_head, T, head_dim], pos [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(0, half, dtype=torch.float32) / half)
    ang = pos[:, None, :, None].float() * inv_freq  # [B, 1, T, half]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig, draft_vocab: list[int] | None = None, train_output: bool = False) -> None:
        super().__init__()
        h, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.attn_q = nn.Linear(h, q_dim, bias=False)
        self.attn_k = nn.Linear(h, kv_dim, bias=False)
        self.attn_v = nn.Linear(h, kv_dim, bias=False)
        self.attn_output = nn.Linear(q_dim, h, bias=False)
        self.ffn_norm = RMSNorm(h, cfg.rms_eps)
        self.ffn_gate = nn.Linear(h, cfg.n_ff, bias=False)
        self.ffn_up = nn.Linear(h, cfg.n_ff, bias=False)
        self.ffn_down = nn.Linear(cfg.n_ff, h, bias=False)
        # own lm_head over a reduced draft vocabulary (row r predicts target token draft_vocab[r])
        self.draft_vocab = draft_vocab
        self.output = nn.Linear(h, len(draft_vocab), bias=False) if draft_vocab is not None else None
        if self.output is not None:
            self.output.weight.requires_grad_(train_output)
        ids = torch.tensor(draft_vocab if draft_vocab is not None else [], dtype=torch.long)
        self.register_buffer("draft_vocab_ids", ids, persistent=False)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, n_head, T, d], k and v [B, n_head_kv, T, d] of inputs x [B, T, H] at positions pos [B, T]."""
        cfg, (b, t, _) = self.cfg, x.shape
        q = self.attn_q(x).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = self.attn_k(x).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        v = self.attn_v(x).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        return rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta), v

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after q/k/v: attention under mask [B, T, S] (True = attend), MLP."""
        rep = self.cfg.n_head // self.cfg.n_head_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        h = x + self.attn_output(a.transpose(1, 2).flatten(2))
        n = self.ffn_norm(h)
        return h + self.ffn_down(F.silu(self.ffn_gate(n)) * self.ffn_up(n))

    def step_inputs(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's residual input and its attention input (here the same) from embeddings and features."""
        x = self.fc(torch.cat([emb, feat], -1))
        return x, x

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Predicted features [B, T, H] from token embeddings and features [B, T, H], positions [B, T] and an
        attention mask [B, T, T] (True = attend; causal within each packed sequence)."""
        x, a = self.step_inputs(emb, feat)
        q, k, v = self.qkv(a, pos)
        return self.finish(x, q, k, v, mask)

    def logits(self, pred: torch.Tensor, base: BaseWeights, full_vocab: bool = False) -> torch.Tensor:
        """Draft logits: over the draft vocabulary with an own lm_head (unless full_vocab), else over the
        full vocabulary through the base lm_head."""
        return self.output(pred) if self.output is not None and not full_vocab else pred @ base.lm_head.T


class Eagle3Head(nn.Module):
    """An EAGLE-3 head for a base model of shape `cfg`: the tensors under this project's GGUF names (attn_norm is
    EAGLE's midlayer.input_layernorm, output_norm its norm, output its lm_head); draft_vocab[r] is the target
    token of output row r; feature_layers the target layers whose outputs (0-based) form the feature."""

    def __init__(self, cfg: HeadConfig, draft_vocab: list[int], feature_layers: list[int]) -> None:
        super().__init__()
        h, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        if len(feature_layers) != 3:
            raise ValueError(f"an EAGLE-3 head takes 3 feature layers, not {list(feature_layers)}")
        self.cfg = cfg
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_eps)
        self.attn_q = nn.Linear(2 * h, q_dim, bias=False)
        self.attn_k = nn.Linear(2 * h, kv_dim, bias=False)
        self.attn_v = nn.Linear(2 * h, kv_dim, bias=False)
        self.attn_output = nn.Linear(q_dim, h, bias=False)
        self.ffn_norm = RMSNorm(h, cfg.rms_eps)
        self.ffn_gate = nn.Linear(h, cfg.n_ff, bias=False)
        self.ffn_up = nn.Linear(h, cfg.n_ff, bias=False)
        self.ffn_down = nn.Linear(cfg.n_ff, h, bias=False)
        self.output_norm = RMSNorm(h, cfg.rms_eps)
        self.output = nn.Linear(h, len(draft_vocab), bias=False)
        self.draft_vocab = list(draft_vocab)
        self.feature_layers = list(feature_layers)
        self.register_buffer("draft_vocab_ids", torch.tensor(self.draft_vocab, dtype=torch.long), persistent=False)

    # the attention's projections and the layer after them are EAGLE-1's, on a 2H input
    qkv = EagleHead.qkv
    finish = EagleHead.finish

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input x [.., H]: fc of the target's features [.., 3H], or the head's own outputs as they are."""
        h = self.cfg.n_embd
        if hidden.shape[-1] == 3 * h:
            return self.fc(hidden)
        if hidden.shape[-1] != h:
            raise ValueError(f"hidden must be [.., {3 * h}] (target features) or [.., {h}] (own outputs), "
                             f"not [.., {hidden.shape[-1]}]")
        return hidden

    def step_inputs(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's residual input x [.., H] and its attention input concat(norm(emb), norm(x)) [.., 2H]."""
        x = self.project(hidden)
        return x, torch.cat([self.attn_norm(emb), self.hidden_norm(x)], -1)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The head's outputs before its final norm [B, T, H] (fed back at the next draft step) from token
        embeddings [B, T, H], features [B, T, 3H] or own outputs [B, T, H], positions [B, T] and an attention mask
        [B, T, T] (True = attend)."""
        x, a = self.step_inputs(emb, hidden)
        q, k, v = self.qkv(a, pos)
        return self.finish(x, q, k, v, mask)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary [.., len(draft_vocab)] of outputs h [.., H]."""
        return self.output(self.output_norm(h))


def causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, T, T] mask of packed sequences: token i attends j when j <= i within the same segment."""
    t = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    return same & torch.ones(t, t, dtype=torch.bool).tril()
