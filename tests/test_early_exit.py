"""SpecEE exit predictors in the runtime: loading from a merged GGUF, and the native features and predictor
against a PyTorch reference on the same weights and hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specee
from specee import _core
from specee import constants as C
from specee.convert.merge import merge_gguf

N_CAND = 4
HIDDEN = 512
PRED_LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def predictors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for il in PRED_LAYERS:
        out[f"blk.{il}.pred.up.weight"] = torch.randn(HIDDEN, 3 * N_CAND, generator=g) * 0.3
        out[f"blk.{il}.pred.up.bias"] = torch.randn(HIDDEN, generator=g) * 0.1
        out[f"blk.{il}.pred.down.weight"] = torch.randn(1, HIDDEN, generator=g) * 0.1
        out[f"blk.{il}.pred.down.bias"] = torch.randn(1, generator=g) * 0.1
    return out


@pytest.fixture(scope="module")
def merged(tiny_gguf: Path, predictors: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("exit")
    save_file(predictors, d / "pred.safetensors")
    (d / "pred.json").write_text(json.dumps({"format": "specee-predictors", "n_candidates": N_CAND,
                                             "exit_layers": [1, 2], "threshold": 0.75}))
    out = d / "tiny-exit.gguf"
    merge_gguf(tiny_gguf, out, predictors=d / "pred.safetensors", progress=False)
    return out


def reference_features(h: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor, eps: float,
                       cand: list[int], p_prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecEE's 12 features of one layer's output h: [c, softmax(c), softmax(c) - p_prev]."""
    h = h.double()
    hn = h * torch.rsqrt(h.pow(2).mean() + eps) * norm_w.double()
    c = lm_head.double()[cand] @ hn
    p = torch.softmax(c, dim=0)
    d = torch.zeros_like(p) if p_prev is None else p - p_prev.double()
    return torch.cat([c, p, d]), p


def reference_predict(w: dict[str, torch.Tensor], il: int, feat: torch.Tensor) -> float:
    up = torch.nn.Linear(3 * N_CAND, HIDDEN).double()
    down = torch.nn.Linear(HIDDEN, 1).double()
    with torch.no_grad():
        up.weight.copy_(w[f"blk.{il}.pred.up.weight"])
        up.bias.copy_(w[f"blk.{il}.pred.up.bias"])
        down.weight.copy_(w[f"blk.{il}.pred.down.weight"])
        down.bias.copy_(w[f"blk.{il}.pred.down.bias"])
        return float(torch.sigmoid(down(torch.relu(up(feat.double())))))


def test_pred_tensor_names_mirror_the_core_table() -> None:
    assert list(C.PRED_TENSOR_NAMES) == list(_core.arch_pred_tensor_names())


def test_settings_and_predictors_are_read(merged: Path, tiny_gguf: Path) -> None:
    m = specee.Model(str(merged), n_ctx=64)
    core = m._model
    assert core.exit_n_pred == len(PRED_LAYERS)
    assert [core.exit_has_pred(i) for i in range(m.n_layer)] == [i in PRED_LAYERS for i in range(m.n_layer)]
    assert core.exit_layers == [1, 2]
    assert core.exit_threshold == pytest.approx(0.75)
    assert core.exit_n_candidates == N_CAND
    plain = specee.Model(str(tiny_gguf), n_ctx=64)
    assert plain._model.exit_n_pred == 0 and plain._model.exit_layers == []
    assert m.n_params == plain.n_params  # predictors are not counted as model parameters


def test_features_and_predictor_match_pytorch(merged: Path, predictors: dict[str, torch.Tensor]) -> None:
    m = specee.Model(str(merged), n_ctx=64)
    core = m._model
    reader = gguf.GGUFReader(str(merged))
    tensors = {t.name: t for t in reader.tensors}
    norm_w = torch.from_numpy(np.array(tensors["output_norm.weight"].data, dtype=np.float32))
    head_t = tensors.get("output.weight") or tensors["token_embd.weight"]
    lm_head = torch.from_numpy(np.array(head_t.data, dtype=np.float32).reshape(m.n_vocab, m.n_embd))
    eps = float(reader.fields["llama.attention.layer_norm_rms_epsilon"].parts[-1][0])

    tokens = [1, 5, 9, 3, 7]
    m.eval(tokens, layers=(0, m.n_layer), hidden_all=True)
    cand = [3, 11, 0, 42]
    p_prev_native = p_prev_ref = None
    worst_feat = worst_prob = 0.0
    for il in PRED_LAYERS:
        h = m.hidden(il)[-1]  # the last token's output of layer il
        feat, p = core.exit_features(h, np.array(cand, dtype=np.int32), p_prev_native)
        ref, p_ref = reference_features(torch.from_numpy(h.copy()), norm_w, lm_head, eps, cand, p_prev_ref)
        worst_feat = max(worst_feat, float(np.abs(feat - ref.numpy()).max()))
        prob = core.exit_predict(il, feat)
        worst_prob = max(worst_prob, abs(prob - reference_predict(predictors, il, ref)))
        p_prev_native, p_prev_ref = p, p_ref
    assert worst_feat < 1e-4
    assert worst_prob < 1e-5


def test_bad_calls_are_refused(merged: Path) -> None:
    m = specee.Model(str(merged), n_ctx=64)
    core = m._model
    h = np.zeros(m.n_embd, dtype=np.float32)
    with pytest.raises(specee.SpecEEError, match="outside the vocabulary"):
        core.exit_features(h, np.array([0, 1, 2, m.n_vocab], dtype=np.int32))
    with pytest.raises(ValueError, match="n_embd"):
        core.exit_features(h[:-1], np.array([0, 1, 2, 3], dtype=np.int32))
    with pytest.raises(specee.SpecEEError, match="layer 3 has no exit predictor"):
        core.exit_predict(3, np.zeros(3 * N_CAND, dtype=np.float32))


def test_exit_layers_without_a_predictor_are_refused(merged: Path, tmp_path: Path) -> None:
    """A file whose specee.exit.layers names a layer without predictor tensors: a clear load error."""
    reader = gguf.GGUFReader(str(merged))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        if f.name == C.KEY_EXIT_LAYERS:
            w.add_array(f.name, [1, 3])
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            vals = [f.parts[i].tobytes().decode() if sub == gguf.GGUFValueType.STRING else f.parts[i][0].item()
                    for i in f.data]
            w.add_key_value(f.name, vals, vt, sub_type=sub)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(f.name, f.parts[-1].tobytes().decode(), vt)
        else:
            w.add_key_value(f.name, f.parts[-1][0].item(), vt)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(x) for x in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(specee.SpecEEError, match="lists layer 3, which has no predictor"):
        specee.Model(str(tmp_path / "bad.gguf"), n_ctx=64)
