"""specee.autoee exit predictors (collect, train, select-layers, export): the PyTorch reference features against
a from-scratch numpy computation on hidden states read through the runtime, labels, the predictor's formula,
deterministic and resumable training, layer selection on synthetic statistics, export -> merge. The
collection's resume on SmolLM2 is marked slow."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import specee
from specee import _core
from specee import constants as C
from specee.autoee import collect as X
from specee.autoee import train as train_command
from specee.autoee import tree_passes
from specee.autoee.exit_features import (ExitPredictor, LmHead, layer_features, load_predictor_tensors,
                                         predictor_tensors, read_lm_head, scheduled_features)
from specee.autoee.export import export_predictors
from specee.autoee.select_layers import Costs, oracle_bounds, select_layers, simulate
from specee.autoee.sharegpt import read_sharegpt
from specee.autoee.train import Data, TrainConfig, fold_standardization, train
from specee.convert.merge import merge_gguf

from conftest import TINY
from test_convert_cli import eagle_state

K = 4


@pytest.fixture(scope="module")
def tiny_eagle(tiny_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("exit_eagle")
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(eagle_state(cfg, seed=5), folder / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="module")
def tiny_head(tiny_gguf: Path, tiny_eagle: Path) -> Path:
    out = tiny_eagle / "tiny-head.gguf"
    merge_gguf(tiny_gguf, out, eagle=tiny_eagle, eagle_type="f32", draft_head_only=True, progress=False)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ---- features and labels through the runtime


def test_features_and_labels_equal_a_from_scratch_computation(tiny_gguf: Path, tiny_head: Path, tiny_hf) -> None:
    m = specee.Model(tiny_gguf, n_ctx=128, n_batch=64, n_threads=1, draft_head=tiny_head)
    head = read_lm_head(tiny_gguf)
    w_norm = tiny_hf.model.norm.weight.detach().numpy().astype(np.float64)
    w_out = tiny_hf.lm_head.weight.detach().numpy().astype(np.float64)
    np.testing.assert_allclose(head.norm.numpy(), w_norm, atol=1e-6)
    np.testing.assert_allclose(head.weight.numpy(), w_out, atol=1e-6)
    prompt = np.random.default_rng(7).integers(3, TINY["vocab_size"], 9).tolist()
    rec = X.sequence_records(m, head, prompt, 12, K, None)
    G, P, L = len(rec["token"]), len(prompt), TINY["num_hidden_layers"]
    assert rec["features"].shape == (G, L, 3 * K) and rec["argmax"].shape == (G, L) and rec["cand"].shape == (G, K)
    assert (rec["pos"] == np.arange(P, P + G)).all()
    seq = prompt + rec["token"].tolist()
    # the greedy continuation: the full model's token at j is the input at j + 1
    assert (rec["final"][:-1] == rec["token"][1:]).all()

    # from scratch: one batch over the whole sequence, every layer's output read through the runtime
    m.kv_clear()
    logits = m.eval(seq, output="all", hidden_all=True)
    hidden = np.stack([m.hidden(il) for il in range(L)]).astype(np.float64)  # [L, N, H]
    normed = hidden / np.sqrt((hidden ** 2).mean(-1, keepdims=True) + 1e-5) * w_norm
    np.testing.assert_allclose(normed[-1], m.norm(), atol=1e-4)  # the final norm is the model's
    feats = m.norm()
    head_logits, _ = m.draft_head_eval(np.asarray(seq[1:], np.int32), feats[:-1])
    for g in range(G):
        j = P + g
        # candidates of position j: the head's output at pair j - 1 = (seq[j], f_{j-1}), top-4
        cand = np.argsort(-head_logits[j - 1])[:K]
        assert rec["cand"][g].tolist() == cand.tolist()
        assert rec["final"][g] == logits[j].argmax()
        p_prev = None
        for layer in range(L):
            c = normed[layer, j] @ w_out[cand].T
            p = softmax(c)
            want = np.concatenate([c, p, p if p_prev is None else p - p_prev])
            p_prev = p
            np.testing.assert_allclose(rec["features"][g, layer], want, atol=2e-3, rtol=1e-3)
            assert rec["argmax"][g, layer] == (normed[layer, j] @ w_out.T).argmax()
    assert (rec["argmax"][:, -1] == rec["final"]).all()  # the last layer's argmax is the model's token


def test_draft_head_chains_equal_one_chain_per_root(tiny_gguf: Path, tiny_head: Path) -> None:
    # every root's chain in one call == draft_head_eval over that root's pairs then its chain alone
    m = specee.Model(tiny_gguf, n_ctx=128, n_batch=8, n_threads=1, draft_head=tiny_head)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, TINY["vocab_size"], 21).astype(np.int32)
    feats = np.tanh(rng.standard_normal((21, TINY["hidden_size"]))).astype(np.float32)
    roots, depth = [0, 1, 4, 9, 10, 17], 3
    got = m.draft_head_chains(tokens, feats, roots, depth)
    assert got.shape == (len(roots), depth + 1, TINY["vocab_size"])
    for i, q in enumerate(roots):
        want, _ = m.draft_head_eval(tokens[:q + 1], feats[:q + 1], tokens[q + 1:q + 1 + depth])
        np.testing.assert_allclose(got[i], want[q:], atol=2e-3, rtol=1e-3)
    many = list(range(18))  # 18 chains: evaluated in groups of n_batch (8)
    np.testing.assert_allclose(m.draft_head_chains(tokens, feats, many, depth)[roots], got, atol=1e-5)
    with pytest.raises(specee.SpecEEError, match="roots must increase"):
        m.draft_head_chains(tokens, feats, [3, 3], depth)
    with pytest.raises(specee.SpecEEError, match="needs 0 <= root < 18"):
        m.draft_head_chains(tokens, feats, [18], depth)


def test_tree_data_adds_each_position_at_each_depth(tiny_gguf: Path, tiny_head: Path) -> None:
    m = specee.Model(tiny_gguf, n_ctx=128, n_batch=64, n_threads=1, draft_head=tiny_head)
    head = read_lm_head(tiny_gguf)
    prompt = np.random.default_rng(8).integers(3, TINY["vocab_size"], 7).tolist()
    one = X.sequence_records(m, head, prompt, 10, K, None)
    tree = X.sequence_records(m, head, prompt, 10, K, None, tree_depth=2)
    G, P = len(one["final"]), len(prompt)
    assert np.bincount(tree["depth"]).tolist() == [G, G - 1, G - 2]
    top = tree["depth"] == 0
    for key in X.ARRAYS:  # depth 0 is the single-token data
        np.testing.assert_array_equal(tree[key][top], one[key])
    seq = prompt + one["token"].tolist()
    m.kv_clear()
    m.eval(seq, logits=False)
    feats = m.norm()
    for d in (1, 2):
        rows = tree["depth"] == d
        for pos, cand in zip(tree["pos"][rows], tree["cand"][rows]):
            q = pos - d - 1  # the pair of the root pos - d
            logits, _ = m.draft_head_eval(seq[1:q + 2], feats[:q + 1], seq[q + 2:pos + 1])
            assert cand.tolist() == np.argsort(-logits[-1], kind="stable")[:K].tolist()
        # the labels are the sequence's: the same layer argmax and full-model token as at depth 0
        same = np.searchsorted(one["pos"], tree["pos"][rows])
        np.testing.assert_array_equal(tree["argmax"][rows], one["argmax"][same])
        np.testing.assert_array_equal(tree["final"][rows], one["final"][same])


def test_scheduled_features_take_p_prev_from_the_previous_scheduled_layer() -> None:
    g = torch.Generator().manual_seed(0)
    head = LmHead(1 + 0.1 * torch.randn(16, generator=g), 1e-5, torch.randn(50, 16, generator=g))
    hidden = torch.randn(6, 3, 16, generator=g)
    cand = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6], [0, 10, 20, 30]])
    got = scheduled_features(hidden, head, cand, [1, 4])
    h = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5) * head.norm
    c = torch.einsum("lnd,nkd->lnk", h, head.weight[cand])
    p = torch.softmax(c, -1)
    torch.testing.assert_close(got[0], torch.cat([c[1], p[1], p[1]], -1))  # first scheduled: the gap is p
    torch.testing.assert_close(got[1], torch.cat([c[4], p[4], p[4] - p[1]], -1))
    every = layer_features(hidden, head, cand)
    torch.testing.assert_close(every[4], torch.cat([c[4], p[4], p[4] - p[3]], -1))


def test_predictor_formula_and_gguf_names() -> None:
    torch.manual_seed(0)
    pred = ExitPredictor()
    x = torch.randn(5, 12)
    t = predictor_tensors({7: pred})
    assert {n: tuple(v.shape) for n, v in t.items()} == {
        C.PRED_UP % 7: (512, 12), C.PRED_UP_BIAS % 7: (512,), C.PRED_DOWN % 7: (1, 512), C.PRED_DOWN_BIAS % 7: (1,)}
    up, ub, down, db = (t[f % 7].double().numpy() for f in C.PRED_TENSOR_NAMES)
    want = 1 / (1 + np.exp(-(np.maximum(x.double().numpy() @ up.T + ub, 0) @ down.T + db)))[:, 0]
    np.testing.assert_allclose(pred(x).detach().numpy(), want, rtol=1e-5)
    again = load_predictor_tensors(t)[7]
    torch.testing.assert_close(again(x), pred(x))
    # standardization folded into the first layer gives the same output on raw features
    mean, std = torch.randn(12), torch.rand(12) + 0.5
    before = pred((x - mean) / std)
    fold_standardization(pred, mean, std)
    torch.testing.assert_close(pred(x), before, rtol=1e-5, atol=1e-6)


# ---- training


def synthetic_data(n: int = 3000, n_layer: int = 4, seed: int = 0) -> Data:
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, n_layer, 12, generator=g) * 3
    labels = feats[:, :, 0] > 0.5  # learnable from the first candidate logit
    in_cand = torch.ones(n, n_layer, dtype=torch.bool)
    val = torch.arange(n) % 5 == 0
    return Data(feats, labels, in_cand, val)


def fresh() -> dict:
    return {"layers": {}, "stats": {}}


def test_training_is_deterministic_resumable_and_learns(tmp_path: Path) -> None:
    data = synthetic_data()
    cfg = TrainConfig(epochs=12, seed=3)
    a = train(data, cfg, fresh(), tmp_path / "a.pt", progress=False)
    b = train(data, cfg, fresh(), None, progress=False)
    assert sorted(a["layers"]) == ["0", "1", "2"]  # not the last layer
    for layer in a["layers"]:
        for name, v in a["layers"][layer].items():
            assert torch.equal(v, b["layers"][layer][name])
    # an interrupted run (layer 0 done) continues to the same predictors
    part = {"layers": {"0": a["layers"]["0"]}, "stats": {"0": a["stats"]["0"]}}
    c = train(data, cfg, part, None, progress=False)
    for layer in a["layers"]:
        for name, v in a["layers"][layer].items():
            assert torch.equal(v, c["layers"][layer][name])
    assert torch.load(tmp_path / "a.pt", weights_only=True)["layers"].keys() == a["layers"].keys()
    s = a["stats"]["1"]["val"]
    assert s["precision"] > 0.8 and s["recall"] > 0.8 and s["n"] == int(data.val.sum())
    d = train(data, TrainConfig(epochs=12, seed=4), fresh(), None, progress=False)
    assert not torch.equal(d["layers"]["1"]["up.weight"], a["layers"]["1"]["up.weight"])


# ---- layer selection


def constant(fires: bool, n_features: int = 3 * K) -> ExitPredictor:
    pred = ExitPredictor(n_features)
    with torch.no_grad():
        pred.up.weight.zero_()
        pred.up.bias.zero_()
        pred.down.weight.zero_()
        pred.down.bias.fill_(20.0 if fires else -20.0)
    return pred


def test_layer_selection_on_synthetic_statistics() -> None:
    n, L = 1000, 6
    feats = torch.randn(n, L, 12)
    labels = torch.ones(n, L, dtype=torch.bool)
    labels[:100, 1] = False  # layer 1: 10 % of its exits are wrong
    in_cand = torch.ones(n, L, dtype=torch.bool)
    in_cand[:, 2] = False  # layer 2 fires but its argmax is never a candidate: a fruitless lm_head
    data = Data(feats, labels, in_cand, torch.ones(n, dtype=torch.bool))
    preds = {0: constant(False), 1: constant(True), 2: constant(True), 3: constant(True), 4: constant(True)}
    costs = Costs(n_layer=L, lm_head=2.0, check=0.1)
    out = simulate([2, 3], data, preds, costs, 0.5)
    assert out.exit_ratio == 1.0 and out.mean_exit_layer == 4 and out.error == 0 and out.fruitless == 1
    assert out.cost == pytest.approx(4 + 2.0 + 2 * 0.1 + 2.0)
    # layer 1 is cheapest but too often wrong; layer 2 never exits; 3 exits every token correctly
    layers, steps = select_layers(data, preds, costs, 0.5, max_error=0.02, min_gain=0.002)
    assert layers == [3] and steps[0]["cost"] == pytest.approx(L + 2.0)
    assert steps[-1]["cost"] == pytest.approx(4 + 2.0 + 0.1)
    layers, _ = select_layers(data, preds, costs, 0.5, max_error=0.2, min_gain=0.002)
    assert layers == [1]  # allowed 20 % errors: exit every token at layer 1
    # nothing helps when exits are never right
    data.labels[:] = False
    data.labels[:, L - 1] = True
    layers, steps = select_layers(data, preds, costs, 0.5, max_error=0.02, min_gain=0.002)
    assert layers == [] and len(steps) == 1


def test_oracle_bounds_on_hand_made_positions() -> None:
    L = 4
    # token 0: its argmax is right from layer 1 on, and a candidate; token 1: right from layer 0 on, never a
    # candidate; token 2: right only at the last layer; token 3: never right (a near-tie at the end)
    labels = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    in_cand = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    data = Data(torch.zeros(4, L, 12), labels, in_cand, torch.ones(4, dtype=torch.bool))
    rows = {r["bound"]: r for r in oracle_bounds(data, Costs(n_layer=L, lm_head=2.0, draft=1.0))}
    perfect = rows["perfect predictors"]
    assert perfect["mean_layers"] == pytest.approx((2 + 4 + 4 + 4) / 4) and perfect["exit_ratio"] == 0.25
    assert perfect["speedup"] == pytest.approx(6 / (3.5 + 2 + 1), abs=1e-4)
    both = rows["perfect predictors and candidates"]
    assert both["mean_layers"] == pytest.approx((2 + 1 + 4 + 4) / 4) and both["exit_ratio"] == 0.5
    free = rows["layers only (lm_head and head free)"]
    assert free["speedup"] == pytest.approx(4 / 2.75, abs=1e-4)


def test_tree_passes_replayed_on_hand_made_rows() -> None:
    # one sequence at positions 10..14, nodes at depth 0 and 1, 4 layers, 2 candidates (the first is the drafted
    # child); columns: position, depth, the model's token, candidates, argmax per layer, best candidate drafted
    rows = [(10, 0, 5, [5, 1], [0, 5, 5, 5], True),   # root 10: its draft 5 accepted
            (11, 0, 6, [2, 6], [6, 6, 6, 6], True),
            (11, 1, 6, [6, 4], [0, 4, 6, 6], True),   # ...its child: argmax 4 at layer 1, a wrong candidate
            (12, 0, 7, [3, 7], [7, 7, 7, 7], False),  # root 12: its draft 3 rejected
            (12, 1, 7, [7, 0], [7, 7, 7, 7], True),
            (13, 0, 8, [8, 2], [8, 8, 8, 8], True),   # root 13: its draft 8 accepted
            (13, 1, 8, [8, 0], [8, 8, 8, 8], True),
            (14, 0, 9, [9, 0], [9, 9, 9, 9], True),
            (14, 1, 9, [9, 0], [1, 1, 9, 9], True)]   # ...its child: not a candidate before layer 2
    features = np.zeros((len(rows), 4, 6), np.float32)
    features[:, :, 0] = np.asarray([r[5] for r in rows], np.float32)[:, None]  # c: the drafted one's largest
    features[:, :, 1] = 1 - features[:, :, 0]
    arrays = {"pos": np.asarray([r[0] for r in rows]), "depth": np.asarray([r[1] for r in rows]),
              "final": np.asarray([r[2] for r in rows]), "cand": np.asarray([r[3] for r in rows]),
              "argmax": np.asarray([r[4] for r in rows]), "prompt": np.zeros(len(rows), int), "features": features}
    assert tree_passes.passes(arrays, 1) == [[0, 2], [3], [5, 8]]
    out = tree_passes.replay(arrays, 1, [1], {1: constant(True, 6)}, k=2)
    assert (out.n_passes, out.tokens_per_pass) == (3, 5 / 3)
    # pass 1 exits at layer 1 with a wrong child token, pass 2 (its root alone) exits right, pass 3's child's
    # argmax is no candidate at layer 1: it runs every layer
    assert out.exit_ratio == 2 / 3 and out.exit_precision == 0.5 and out.mean_layers == (2 + 2 + 4) / 3
    # the bound: first layers where every row is right and a candidate: 2, 0, 2
    assert out.oracle_exit_ratio == 1 and out.oracle_mean_layers == (3 + 1 + 3) / 3
    assert tree_passes.replay(arrays, 1, [1], {1: constant(False, 6)}, k=2).exit_ratio == 0
    # root 12's best candidate at layer 1 now its rejected draft: the path reaches a node not in the data
    features[3, :, :2] = [1, 0]
    assert tree_passes.replay(arrays, 1, [1], {1: constant(True, 6)}, k=2).exit_ratio == 1 / 3


def test_question_files_and_that_training_refuses_them(tmp_path: Path) -> None:
    d = tmp_path / "bench" / "qa"
    d.mkdir(parents=True)
    (d / "question.jsonl").write_text("\n".join(json.dumps({"question_id": i, "turns": [f"q{i}", "again"]})
                                                for i in range(3)) + "\n\n")
    convs = list(X.read_question_files([str(tmp_path / "bench")], per_file=2))
    assert [c.messages for c in convs] == [[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}]]
    assert len(list(X.read_question_files([str(d / "question.jsonl")]))) == 3
    (d / "bad.jsonl").write_text(json.dumps({"question": "no turns"}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        list(X.read_question_files([str(d / "bad.jsonl")]))
    with pytest.raises(FileNotFoundError, match="--questions"):
        list(X.read_question_files([str(tmp_path / "missing")]))
    work = tmp_path / "work"
    X.open_store(work / "data", {"n_candidates": K, "questions": {"paths": ["bench"], "per_file": 2}})
    ap = argparse.ArgumentParser()
    train_command.add_arguments(ap)
    with pytest.raises(ValueError, match="evaluation prompts"):
        train_command.run(ap.parse_args(["--work-dir", str(work)]))


# ---- export -> merge


def test_export_then_merge(tiny_gguf: Path, tiny_eagle: Path, tmp_path: Path) -> None:
    data = synthetic_data(n=500, n_layer=TINY["num_hidden_layers"])
    ckpt = train(data, TrainConfig(epochs=1), fresh(), None, progress=False)
    preds = {int(k): ExitPredictor() for k in ckpt["layers"]}
    for k, p in preds.items():
        p.load_state_dict(ckpt["layers"][str(k)])
    weights, meta = export_predictors(preds, tmp_path / "preds", [1, 2], 0.5, K, {"note": "test"})
    settings = json.loads(meta.read_text())
    assert settings["format"] == "specee-predictors" and settings["exit_layers"] == [1, 2]
    with pytest.raises(ValueError, match="no trained predictor"):
        export_predictors(preds, tmp_path / "bad", [3], 0.5, K)
    out = tmp_path / "merged.gguf"
    merge_gguf(tiny_gguf, out, eagle=tiny_eagle, predictors=weights, eagle_type="f32", progress=False)
    r = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in r.tensors}
    for layer in (0, 1, 2):
        up = tensors[C.PRED_UP % layer]
        assert up.tensor_type == gguf.GGMLQuantizationType.F32 and list(up.shape) == [12, 512]  # ggml order
        np.testing.assert_array_equal(np.asarray(up.data).reshape(512, 12), preds[layer].up.weight.detach().numpy())
        assert list(tensors[C.PRED_DOWN % layer].shape) == [512, 1]
        assert list(tensors[C.PRED_DOWN_BIAS % layer].shape) == [1]
    assert C.PRED_UP % 3 not in tensors and C.EAGLE_FC in tensors
    assert r.fields[C.KEY_EXIT_LAYERS].contents() == [1, 2]
    assert r.fields[C.KEY_EXIT_THRESHOLD].contents() == pytest.approx(0.5)
    assert r.fields[C.KEY_EXIT_N_CANDIDATES].contents() == K
    specee.Model(out, n_ctx=32, n_threads=1)  # the runtime loads it


# ---- collection on SmolLM2


SHAREGPT = json.dumps([
    {"id": f"c{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]}
    for i, q in enumerate(["Name three colours.", "What is 2 + 2?", "Say hello in French.", "Count to five."])
])


@pytest.mark.slow
def test_collect_resumes_to_the_same_data(smollm2_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(SHAREGPT)
    head_path = X.head_gguf(specee.paths.default_eagle_head_path())
    model = specee.Model(smollm2_path, n_ctx=256, n_batch=256, n_threads=1, draft_head=head_path)
    lm = read_lm_head(smollm2_path)
    keep = X.Decontaminator.from_files([])
    config = {"n_candidates": K, "max_new": 6, "max_prompt": 200, "skip": 1, "model": "m"}

    def run(root: Path, max_tokens: int) -> X.ExitStore:
        store = X.open_store(root, config)
        return X.collect(model, lm, store, read_sharegpt(path), keep, "chatml", max_tokens=max_tokens,
                         deadline=None, draft_vocab=None, save_every=1, progress=False)

    whole = run(tmp_path / "a", 100)
    assert whole.n_done == 4 and whole.n_prompts == 3  # the first conversation skipped
    run(tmp_path / "b", 1)  # stops after one prompt
    part = X.open_store(tmp_path / "b")
    assert part.n_prompts == 1 and part.n_done == 2
    run(tmp_path / "b", 100)
    a, b = whole.load(), X.open_store(tmp_path / "b").load()
    assert sorted(set(a["prompt"].tolist())) == [1, 2, 3]
    for k in X.ARRAYS:
        np.testing.assert_array_equal(a[k], b[k])
    with pytest.raises(ValueError, match="other settings"):
        X.open_store(tmp_path / "b", {**config, "max_new": 7})
