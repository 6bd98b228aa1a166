"""EAGLE training features computed by PyTorch over the target's stored replies (`train-eagle --replies DIR
--features torch`), instead of by the runtime (eagle_features.py `collect`).

Why: on the default Q4_1 file the runtime has no batched kernel on x86 (ggml 0.20.2), so collecting features costs
about what decoding does: 81 tokens/s on one thread of this machine, against 486 for PyTorch's forward of the
same GGUF dequantized to bf16 (regenerate.py `load_target`), both measured 2026-11-25 while other jobs ran. The
head does not see the difference: on the plain greedy replies to 10 MT-Bench prompts, the shipped head's top-1 is
0.345 with the runtime's features and 0.350 / 0.347 with PyTorch's bf16 / f32 features (cosine 0.9993 / 0.9995;
docs/speculative.md). The targets are PyTorch's argmax, which is the runtime's at ~98 % of positions
(docs/training.md).

Each stored reply becomes one conversation of the store: its prompt (not trained on with --loss-on assistant) and
its reply, cut at max_len, in the order of the conversations' indices; the collection resumes after the store's
last one and stops where the replies are final (their work dir's n_done).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm import tqdm

from specee.autoee.eagle_features import FeatureStore, Replies


@torch.no_grad()
def forward_features(target, tokens: list[int], layers: list[int] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence through the target: the final-norm output [n, H] (EAGLE-1's feature), the outputs of `layers`
    side by side [n, len(layers) H] (EAGLE-3's; [n, 0] without layers) and the next-token argmax [n], float32."""
    if any(not 0 <= i < target.config.num_hidden_layers - 1 for i in layers):
        raise ValueError(f"feature layers {list(layers)}: each must be below the last layer, "
                         f"{target.config.num_hidden_layers - 1} (transformers gives the last one normed)")
    out = target(torch.tensor([tokens]), output_hidden_states=True)
    hidden = out.hidden_states  # [0]: embeddings, [i + 1]: the output of layer i, [-1]: after the final norm
    norm = hidden[-1][0].float().numpy()
    picked = [hidden[i + 1][0].float() for i in layers]
    feats3 = torch.cat(picked, -1).numpy() if picked else np.zeros((len(tokens), 0), np.float32)
    return norm, feats3, out.logits[0].float().argmax(-1).numpy().astype(np.int32)


def collect_torch(target, replies: Replies, store: FeatureStore, *, max_len: int, features3: np.ndarray | None = None,
                  layers: list[int] = (), deadline: float | None = None, save_every: int = 50,
                  progress: bool = True) -> FeatureStore:
    """Append the stored replies after the store's last conversation until the store is full, the replies end or
    time.time() passes `deadline`; `features3` (the store's [cap, len(layers) H] array) receives the layers'
    outputs when given."""
    # only below the replies' n_done is every conversation answered or skipped for good (a batched run finishes
    # replies out of order): the rest waits for a later call
    todo = [i for i in sorted(replies.records) if store.n_done <= i < replies.n_done]
    bar = tqdm(total=store.capacity, initial=store.n_tokens, unit="tok", desc="features (torch)", disable=not progress,
               smoothing=0.05)
    since_save, finished = 0, True
    for index in todo:
        if deadline is not None and time.time() > deadline:
            finished = False
            break
        record = replies.records[index]
        tokens = (record["prompt_tokens"] + record["reply_tokens"])[:max_len]
        n = len(tokens)
        if store.n_tokens + n > store.capacity:
            finished = False
            break
        norm, feats3, argmax = forward_features(target, tokens, layers)
        a, b = store.n_tokens, store.n_tokens + n
        n_prompt = min(len(record["prompt_tokens"]), n)
        store.tokens[a:b] = tokens
        store.features[a:b] = norm.astype(np.float16)
        if features3 is not None:
            features3[a:b] = feats3.astype(np.float16)
        store.targets[a:b] = argmax
        store.assistant[a:b] = [0] * n_prompt + [1] * (n - n_prompt)
        store.generated.append(len(store.offsets))
        store.offsets.append(a)
        store.n_tokens, store.n_done = b, index + 1
        bar.update(n)
        since_save += 1
        if since_save >= save_every:
            if features3 is not None:
                features3.flush()
            store.save_state()
            since_save = 0
    if finished:
        store.n_done = max(store.n_done, replies.n_done)  # every reply up to where they end is in the store
    if features3 is not None:
        features3.flush()
    store.save_state()
    bar.close()
    return store
