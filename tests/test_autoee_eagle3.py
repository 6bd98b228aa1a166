"""train-eagle --eagle-version 3: the store's EAGLE-3 features against the runtime's, the training-time test
(its steps against drafting one token at a time; loss and top-1 on a learnable toy store), the trained head
exported through `convert merge` into a draft head file that the runtime loads and runs as PyTorch does, greedy
EAGLE-2 with it, and the refusals. The tiny model of conftest.py; SmolLM2 runs are marked slow."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import specee
from specee.autoee import eagle_features as EF
from specee.autoee import eagle_trainer as T
from specee.autoee import train_eagle
from specee.autoee.eagle_export import export_head
from specee.autoee.eagle_features import collect, create_store, extract_layers, open_store
from specee.autoee.eagle_head import BaseWeights, Eagle3Head, causal_mask, read_base
from specee.autoee.sharegpt import Conversation
from specee.convert.merge import merge_gguf
from test_eagle import PROMPTS, plain_and_spec

LAYERS = [0, 1, 3]  # the tiny model has 4 layers: too few for EAGLE's default
# Native head against PyTorch, as test_eagle3.py: the head's KV cache is F16 (measured max abs error 4e-4 there)
ATOL = 0.01


def v3_head_file(tiny_gguf: Path, head: Eagle3Head, folder: Path) -> Path:
    """The head exported in this project's layout (F16 matrices) and merged into a draft head file."""
    weights, _ = export_head(head, folder / "head")
    out = folder / "head.gguf"
    merge_gguf(tiny_gguf, out, eagle=weights, draft_head_only=True, progress=False)
    return out


def random_head(tiny_gguf: Path, vocab: list[int], seed: int = 0) -> Eagle3Head:
    cfg, _ = read_base(str(tiny_gguf))
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, vocab, LAYERS)
    with torch.no_grad():
        for norm in (head.attn_norm, head.hidden_norm, head.ffn_norm, head.output_norm):
            norm.weight.copy_(1.0 + 0.3 * torch.randn_like(norm.weight))
    return head.eval()


# ---- features


@pytest.mark.parametrize("n_batch", [64, 8])
def test_collection_writes_the_runtimes_features(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 n_batch: int) -> None:
    """What the collection stores as features3 is what the runtime gives an EAGLE-3 head with those layers
    (Model.features() after an eval), per conversation and across batches of n_batch; final-norm features too."""
    rng = np.random.default_rng(0)
    convs = {f"c{k}": rng.integers(0, 256, 20 + 7 * k).tolist() for k in range(3)}
    # the tiny model has no tokenizer: a conversation "renders" to its stored token ids
    monkeypatch.setattr(EF, "render", lambda model, template, conv, n: (convs[conv.id], [1] * len(convs[conv.id])))
    plain = specee.Model(tiny_gguf, n_ctx=64, n_batch=n_batch, n_threads=1)
    store = create_store(tmp_path / "features", 200, 64, LAYERS)
    collect(plain, iter([Conversation(k, []) for k in convs]), store, template="", max_len=64, progress=False)
    store = open_store(tmp_path / "features")
    assert store.feature_layers == LAYERS and store.features3.shape == (200, 192)
    head = v3_head_file(tiny_gguf, random_head(tiny_gguf, list(range(256))), tmp_path)
    m = specee.Model(tiny_gguf, n_ctx=64, n_batch=n_batch, n_threads=1, draft_head=head)
    for (s, e), tokens in zip(store.spans(), convs.values()):
        m.kv_clear()
        want = []
        for i in range(0, len(tokens), n_batch):
            m.eval(tokens[i:i + n_batch], output="all")
            want.append(m.features())
        np.testing.assert_array_equal(store.features3[s:e], np.concatenate(want).astype(np.float16))
        feats, argmax, feats3 = extract_layers(plain, tokens, LAYERS)
        np.testing.assert_array_equal(store.features[s:e], feats.astype(np.float16))
        assert (store.targets[s:e] == argmax).all()


def test_store_without_features3_serves_eagle1_only(tiny_gguf: Path, tmp_path: Path) -> None:
    store = toy_store(tmp_path, tiny_base(tiny_gguf), with_features3=False)
    assert store.features3 is None and store.feature_layers is None
    cfg = T.TrainConfig(seq_len=64, rows=2, eagle_version=3)
    with pytest.raises(ValueError, match="no EAGLE-3 features"):
        T.batch_of(store, T.pack(store.spans(), 64), cfg)
    T.batch_of(store, T.pack(store.spans(), 64), T.TrainConfig(seq_len=64, rows=2))  # EAGLE-1: fine
    with pytest.raises(ValueError, match="3 distinct layers"):
        create_store(tmp_path / "bad", 10, 64, [3, 1, 0])


# ---- a learnable toy store


def tiny_base(tiny_gguf: Path) -> BaseWeights:
    return read_base(str(tiny_gguf))[1]


def toy_store(tmp_path: Path, base: BaseWeights, n_conv: int = 8, length: int = 24, seed: int = 0,
              with_features3: bool = True):
    """Random conversations whose features follow from the tokens: f_i from t_i and t_{i-1}, the three layers'
    outputs from t_i (so step 1, which sees t_{i+1} and layers of i, can tell f_{i+1}); targets = the base
    lm_head's argmax on f."""
    rng = np.random.default_rng(seed)
    h = base.embd.shape[1]
    proj = rng.standard_normal((256, h)).astype(np.float32)
    proj3 = rng.standard_normal((256, 3 * h)).astype(np.float32)
    store = create_store(tmp_path / "features", n_conv * length, h, LAYERS if with_features3 else None)
    for k in range(n_conv):
        a, b = k * length, (k + 1) * length
        tokens = rng.integers(0, 256, length)
        feats = np.tanh(proj[tokens] + 0.5 * np.roll(proj[tokens], 1, 0))
        store.tokens[a:b] = tokens
        store.features[a:b] = feats
        if with_features3:
            store.features3[a:b] = np.tanh(proj3[tokens])
        store.targets[a:b] = (torch.from_numpy(feats) @ base.lm_head.T).argmax(-1).numpy()
        store.assistant[a:b] = 1
        store.offsets.append(a)
    store.n_tokens = n_conv * length
    store.save_state()
    return open_store(tmp_path / "features")


# ---- the training-time test


def test_ttt_steps_equal_drafting_one_token_at_a_time(tiny_gguf: Path, tmp_path: Path) -> None:
    """Step s at position j of the unrolled training equals the head run on [the pairs 0..j with the target's
    features, then its own chain] as a plain sequence (which test_eagle3.py checks against the runtime)."""
    base = tiny_base(tiny_gguf)
    store = toy_store(tmp_path, base, n_conv=2, length=16)
    head = random_head(tiny_gguf, list(range(0, 256, 2)), seed=2)
    batch = T.make_batch(store, T.pack(store.spans(), 32), 32, "all", with_features3=True)
    outs = list(T.unroll(head, base, batch, 3, batch.feat3))
    j = 6
    with torch.no_grad():
        hidden = list(head.fc(batch.feat3[0, :j + 1]))
        toks = list(batch.tokens[0, :j + 1])
        for s in (2, 3):
            toks.append(batch.tokens[0, j + s - 1])
            hidden.append(outs[s - 2][0, j])
            n = len(toks)
            out = head(base.embd[torch.stack(toks)][None], torch.stack(hidden)[None], torch.arange(n)[None],
                       causal_mask(torch.zeros(1, n, dtype=torch.long)))
            torch.testing.assert_close(out[0, -1], outs[s - 1][0, j], atol=1e-5, rtol=1e-4)


def test_ttt_loss_decreases_and_top1_rises(tiny_gguf: Path, tmp_path: Path) -> None:
    base = tiny_base(tiny_gguf)
    store = toy_store(tmp_path, base)
    cfg = T.TrainConfig(steps=40, lr=3e-3, warmup=2, seq_len=96, rows=2, noise=0.0, draft_vocab=200,
                        train_draft_lm_head=True, eagle_version=3, ttt_steps=3, loss_on="all")
    vocab = T.draft_vocabulary(store, store.spans(), cfg.draft_vocab)
    head = Eagle3Head(read_base(str(tiny_gguf))[0], vocab, LAYERS)
    with torch.no_grad():
        head.output.weight.copy_(base.lm_head[vocab])
    opt = T.make_optimizer(head, cfg)
    batch = T.batch_of(store, T.pack(store.spans(), cfg.seq_len)[:2], cfg)
    first = T.compute_loss(head, base, batch, cfg, noise=False)
    assert len(first.step_accuracy) == 3
    for step in range(cfg.steps):
        T.train_step(head, opt, base, batch, cfg, step)
    last = T.compute_loss(head, base, batch, cfg, noise=False)
    # soft labels: the CE keeps the soft labels' entropy, so it falls less than top-1 rises
    assert last.total.item() < 0.9 * first.total.item()
    assert all(b > a + 0.1 for a, b in zip(first.step_accuracy, last.step_accuracy)), (first, last)
    assert last.accuracy > first.accuracy + 0.3
    counts, n = T.chain_accuracy(head, base, batch, 3)
    assert counts[0] / n == pytest.approx(last.accuracy) and counts[0] >= counts[1] >= counts[2]


# ---- train-eagle --eagle-version 3 end to end, export, the runtime


@pytest.fixture(scope="module")
def trained(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A head trained by the CLI on a toy store (its work dir) and exported: (work dir, OUT)."""
    work = tmp_path_factory.mktemp("eagle3_train")
    toy_store(work, tiny_base(tiny_gguf))
    out = work / "out" / "tiny-eagle3"
    args = ["-m", str(tiny_gguf), "--work-dir", str(work), "--skip-collect", "--eagle-version", "3", "--steps", "30",
            "--ttt-steps", "3", "--draft-vocab", "200", "--seq-len", "96", "--rows", "2", "--lr", "3e-3",
            "--warmup", "2", "--loss-on", "all", "--val-percent", "25", "--threads", "1", "-o", str(out), "--head-gguf"]
    run_cli(args)
    return work, out


def run_cli(args: list[str]) -> None:
    ap = train_eagle.argparse.ArgumentParser()
    train_eagle.add_arguments(ap)
    train_eagle.run(ap.parse_args(args))


def test_export_records_and_loads_as_eagle3(tiny_gguf: Path, trained: tuple[Path, Path]) -> None:
    work, out = trained
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["eagle_version"] == 3 and info["feature_layers"] == LAYERS and len(info["draft_vocab"]) == 200
    assert info["training"]["eagle_version"] == 3 and info["training"]["ttt_steps"] == 3
    val = info["validation"]
    assert set(val) >= {"top1_accuracy", "chain_acceptance", "ce", "n_positions"} and "regression_loss" not in val
    assert len(val["chain_acceptance"]) == 3
    m = specee.Model(tiny_gguf, n_ctx=128, n_threads=1, draft_head=out.with_suffix(".gguf"))
    assert m._model.eagle_version == 3 and m._model.eagle_feature_layers == LAYERS
    assert m._model.eagle_draft_vocab == info["draft_vocab"]


def trained_head(tiny_gguf: Path, work: Path) -> Eagle3Head:
    """The checkpoint's head with its matrices rounded to F16, as exported."""
    state = T.load_checkpoint(work / "checkpoint.pt")
    head = Eagle3Head(read_base(str(tiny_gguf))[0], state["draft_vocab"], state["feature_layers"])
    head.load_state_dict(state["head"])
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim > 1:
                p.copy_(p.half().float())
    return head.eval()


def test_runtime_draft_logits_equal_pytorch(tiny_gguf: Path, trained: tuple[Path, Path]) -> None:
    """The exported head in the runtime (committed pairs with 3H features, then draft steps fed its own output)
    against the PyTorch head on the same inputs, within ATOL."""
    work, out = trained
    head = trained_head(tiny_gguf, work)
    base = tiny_base(tiny_gguf)
    m = specee.Model(tiny_gguf, n_ctx=128, n_threads=1, draft_head=out.with_suffix(".gguf"))
    rng = np.random.default_rng(5)
    tokens, drafts = rng.integers(0, 256, 17).tolist(), rng.integers(0, 256, 3).tolist()
    feats = np.tanh(rng.standard_normal((17, 192))).astype(np.float32)
    logits, outs = m.draft_head_eval(tokens, feats, drafts)
    with torch.no_grad():
        hidden = list(head.fc(torch.from_numpy(feats)))
        toks = list(tokens)
        want = []
        for t in [None] + drafts:
            if t is not None:
                toks.append(t)
                hidden.append(want[-1][-1])
            n = len(toks)
            want.append(head(base.embd[toks][None], torch.stack(hidden)[None], torch.arange(n)[None],
                             causal_mask(torch.zeros(1, n, dtype=torch.long)))[0])
        want_out = torch.cat([want[0]] + [w[-1:] for w in want[1:]])
        want_logits = head.logits(want_out)
    assert np.abs(outs - want_out.numpy()).max() < ATOL
    assert np.abs(logits - want_logits.numpy()).max() < ATOL


def test_greedy_eagle2_with_the_trained_head_equals_plain(tiny_gguf: Path, trained: tuple[Path, Path]) -> None:
    m = specee.Model(tiny_gguf, n_ctx=256, n_threads=1, type_v="f32", draft_head=trained[1].with_suffix(".gguf"))
    for prompt in PROMPTS:
        plain, spec = plain_and_spec(m, prompt, 32, "eagle2")
        assert spec == plain


def test_eagle3_training_needs_features3(tiny_gguf: Path, tmp_path: Path) -> None:
    toy_store(tmp_path, tiny_base(tiny_gguf), with_features3=False)
    with pytest.raises(ValueError, match="no EAGLE-3 features"):
        run_cli(["-m", str(tiny_gguf), "--work-dir", str(tmp_path), "--skip-collect", "--eagle-version", "3",
                 "--steps", "1", "--threads", "1"])
    with pytest.raises(ValueError, match="--ttt-steps is for EAGLE-3"):
        run_cli(["-m", str(tiny_gguf), "--work-dir", str(tmp_path), "--skip-collect", "--ttt-steps", "3"])
