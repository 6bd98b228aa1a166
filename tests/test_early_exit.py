"""SpecEE early exit in the runtime (csrc/decode/specee-early-exit.cpp over csrc/decode/specee-exit.cpp) on the tiny
model: predictors loaded from a merged GGUF, the native features and predictor against a PyTorch reference on the same
weights and hidden states, the decode loop (never exiting equals plain decoding; every exit's token and the KV
masking of the skipped layers against an explicit masked forward)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specee
from specee import ExitParams, GenerateOptions
from specee import _core
from specee import constants as C
from specee.convert.merge import merge_gguf
from test_convert_cli import eagle_state
from test_eagle import save_published
from kv_probes import kv_cell_pos, kv_cell_valid

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
def with_head(tiny_gguf: Path, tiny_hf_dir: Path, predictors: dict[str, torch.Tensor],
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a random EAGLE head and the predictors, static exit layers 0-2."""
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    d = tmp_path_factory.mktemp("exit_head")
    folder = save_published(eagle_state(cfg, seed=3), cfg, d / "head")
    save_file(predictors, d / "pred.safetensors")
    (d / "pred.json").write_text(json.dumps({"format": "specee-predictors", "exit_layers": PRED_LAYERS}))
    out = d / "tiny-eagle-exit.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder, eagle_type="f32", predictors=d / "pred.safetensors", progress=False)
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
    """SpecEE's 12 features of one layer's output h: [c, softmax(c), softmax(c) - p_prev]. (An independent
    re-statement; autoee/exit_features.py is the training side's version, compared in the next test.)"""
    h = h.double()
    hn = h * torch.rsqrt(h.pow(2).mean() + eps) * norm_w.double()
    c = lm_head.double()[cand] @ hn
    p = torch.softmax(c, dim=0)
    d = p if p_prev is None else p - p_prev.double()  # SpecEE's prob_gap: p itself at the first check
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

    # the training side's reference (autoee/exit_features.py) on the same hidden states
    from specee.autoee.exit_features import ExitPredictor, read_lm_head, scheduled_features

    hidden = torch.from_numpy(np.stack([m.hidden(il)[-1:] for il in range(m.n_layer)]))  # [L, 1, n_embd]
    ref = scheduled_features(hidden, read_lm_head(merged), torch.tensor([cand]), PRED_LAYERS)[:, 0]
    p_prev_native = None
    for i, il in enumerate(PRED_LAYERS):
        feat, p_prev_native = core.exit_features(m.hidden(il)[-1], np.array(cand, dtype=np.int32), p_prev_native)
        np.testing.assert_allclose(feat, ref[i].numpy(), atol=1e-4)
        pred = ExitPredictor()
        pred.load_state_dict({k.split(".pred.")[1]: v for k, v in predictors.items() if k.startswith(f"blk.{il}.")})
        with torch.no_grad():
            assert core.exit_predict(il, feat) == pytest.approx(float(pred(ref[i])), abs=1e-5)


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


# ---- the decode loop

PROMPTS = [np.random.default_rng(s).integers(0, 256, 5 + 2 * s).tolist() for s in range(3)]


def exit_decode(model: specee.Model, prompt: list[int], n: int, schedule: list[int] | None = None,
                **exit_kw) -> tuple[list[int], list[int], dict]:
    """Greedy early-exit decoding through the generator, n tokens whatever they are: (tokens, exit layer of each
    evaluated token, stats). `schedule`: a replayed exit layer per step (-1: none, all layers run)."""
    replay = [model.n_layer - 1 if x < 0 else x for x in schedule] if schedule else None
    model.kv_clear()
    gen = _core.Generator(model._ctx, GenerateOptions(mode="early-exit", temp=0, exit=ExitParams(replay=replay,
                                                                                                  **exit_kw)))
    gen.start(prompt)
    out, layers = [], []
    for i in range(n):
        toks, runs = gen.next(1)
        out += toks
        if i > 0:  # the first token comes from the prompt's pass
            layers += [r - 1 for r in runs]
    return out, layers, gen.stats()


def check_against_masked_forward(tiny_hf, prompt: list[int], out: list[int], layers: list[int],
                                 llama_forward) -> int:
    """Every emitted token is the argmax at its producer's exit layer of a forward whose masks hide layer il
    of every token that exited before il (its K/V there was never computed). Returns the exits checked."""
    n_layer = tiny_hf.config.num_hidden_layers
    seq = prompt + out[:-1]  # the evaluated tokens; out[k + 1] comes from evaluating out[k]
    exit_of = [n_layer - 1] * len(prompt) + layers
    n = len(seq)
    masks = []
    for il in range(n_layer):
        m = np.tril(np.ones((n, n), dtype=bool))
        for j in range(n):
            if exit_of[j] < il:
                m[:, j] = False
                m[j, j] = True
        masks.append(m)
    _, hiddens = llama_forward(tiny_hf, seq, masks=masks)
    for k, layer in enumerate(layers):
        q = len(prompt) + k
        h = torch.from_numpy(hiddens[layer][q])
        with torch.no_grad():  # the model's own final norm and lm_head (Gemma's norm scales by 1 + weight)
            logits = tiny_hf.lm_head(tiny_hf.model.norm(h))
        want = int(torch.argmax(logits))
        got = out[k + 1]
        # equal, or a floating-point near-tie between the runtime (F32 weights, F16 K cache) and PyTorch
        assert got == want or float(logits[want] - logits[got]) < 0.02, (k, layer, got, want)
    return sum(layer < n_layer - 1 for layer in layers)


def test_never_exiting_equals_plain_decoding(with_head: Path) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    for prompt in PROMPTS:
        plain = [int(t) for t in m.generate_tokens(prompt, 24, mode="plain", temp=0)]
        ee, layers, st = exit_decode(m, prompt, 24, threshold=1.0)
        assert ee == plain
        assert layers == [m.n_layer - 1] * 23
        assert st["n_exits"] == 0 and st["n_checks"] == 23 * len(PRED_LAYERS) and st["n_fired"] == 0


def test_forced_exits_mask_the_skipped_layers(with_head: Path, tiny_hf, llama_forward) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    schedule = [0, -1, 1, 2, -1, 0, 0, 2]
    for prompt in PROMPTS:
        out, layers, st = exit_decode(m, prompt, 20, threshold=1.0, schedule=schedule)
        want = [(schedule[i % len(schedule)] if schedule[i % len(schedule)] >= 0 else m.n_layer - 1) for i in range(19)]
        assert layers == want
        assert st["n_exits"] == sum(layer < m.n_layer - 1 for layer in want)
        # the cache: each generated token's cell is valid exactly up to its exit layer
        cells = {kv_cell_pos(m, c): c for c in range(m.n_ctx) if kv_cell_pos(m, c) >= 0}
        for k, layer in enumerate(want):
            cell = cells[len(prompt) + k]
            assert [kv_cell_valid(m, cell, il) for il in range(m.n_layer)] == [il <= layer for il in range(m.n_layer)]
        assert check_against_masked_forward(tiny_hf, prompt, out, layers, llama_forward) == st["n_exits"]


def test_predictor_exits_match_the_masked_forward(with_head: Path, tiny_hf, llama_forward) -> None:
    """Threshold 0: every check fires; a token exits where the layer's argmax is one of the candidates."""
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    for prompt in PROMPTS:
        out, layers, st = exit_decode(m, prompt, 24, threshold=0.0)
        assert st["n_fired"] == st["n_checks"] > 0
        assert st["n_exits"] + st["n_rejected"] >= 1
        check_against_masked_forward(tiny_hf, prompt, out, layers, llama_forward)


def test_exit_decoding_refuses_bad_use(with_head: Path, tiny_gguf: Path) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    gen = _core.Generator(m._ctx, GenerateOptions(mode="early-exit", temp=0))
    with pytest.raises(specee.SpecEEError, match="call specee_generator_start first"):
        gen.next(1)
    with pytest.raises(specee.SpecEEError, match="replayed exit layer 9"):
        gen.set_params(GenerateOptions(mode="early-exit", temp=0, exit=ExitParams(replay=[9])))
    with pytest.raises(specee.SpecEEError, match="greedily"):
        gen.set_params(GenerateOptions(mode="early-exit", temp=0.8))
    with pytest.raises(ValueError, match="kv must be 'mask' or 'fill'"):
        ExitParams(kv="drop")


def test_python_api(with_head: Path, tiny_gguf: Path) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    prompt = PROMPTS[0]
    plain = m.generate_tokens(prompt, 16, mode="plain", temp=0)
    assert m.generate_tokens(prompt, 16, temp=0, mode="early-exit", exit=ExitParams(threshold=1.0)) == plain
    st = m.last_stats
    assert st.mode == "early-exit" and st.layers_run == [m.n_layer] * 15
    assert st.exit_ratio == 0.0 and st.mean_layers_run == m.n_layer
    out = m.generate_tokens(prompt, 16, temp=0, exit=ExitParams(threshold=0.0, layers=[1]))  # auto: early exit
    assert m.last_stats.mode == "early-exit"
    ref, layers, _ = exit_decode(m, prompt, 16, threshold=0.0, layers=[1], dynamic=True)
    assert out == ref[:len(out)] and m.last_stats.layers_run == [x + 1 for x in layers][:len(m.last_stats.layers_run)]
    assert set(layers) <= {1, m.n_layer - 1}
    with pytest.raises(specee.SpecEEError, match="greedily"):
        m.generate_tokens(prompt, 4, temp=0.7, mode="early-exit")
    with pytest.raises(specee.SpecEEError, match="exit settings are given, but the mode is plain"):
        m.generate_tokens(prompt, 4, temp=0, mode="plain", exit=ExitParams(threshold=0.5))
    with pytest.raises(specee.SpecEEError, match="needs an EAGLE draft head"):
        specee.Model(str(tiny_gguf), n_ctx=64).generate_tokens(prompt, 4, temp=0, mode="early-exit")


def test_head_and_predictors_in_a_file_of_their_own(tiny_gguf: Path, tiny_hf_dir: Path, with_head: Path,
                                                    predictors: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """merge --draft-head-only with --predictors: loaded next to the plain base file, it behaves as the merged file."""
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    folder = save_published(eagle_state(cfg, seed=3), cfg, tmp_path / "head")
    save_file(predictors, tmp_path / "pred.safetensors")
    (tmp_path / "pred.json").write_text(json.dumps({"format": "specee-predictors", "exit_layers": [0, 2]}))
    parts = tmp_path / "parts.gguf"
    merge_gguf(tiny_gguf, parts, eagle=folder, eagle_type="f32", predictors=tmp_path / "pred.safetensors",
               draft_head_only=True, progress=False)
    alone = specee.Model(str(tiny_gguf), n_ctx=128, n_threads=1, draft_head=str(parts))
    assert alone._model.exit_n_pred == len(PRED_LAYERS) and alone._model.exit_layers == [0, 2]
    merged = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    kw = dict(temp=0, mode="early-exit", exit=ExitParams(threshold=0.0, layers=[0, 2]))
    assert alone.generate_tokens(PROMPTS[1], 12, **kw) == merged.generate_tokens(PROMPTS[1], 12, **kw)
    assert alone.last_stats.layers_run == merged.last_stats.layers_run


def test_a_draft_head_file_says_what_of_the_models_own_it_replaces(
        tiny_gguf: Path, tiny_hf_dir: Path, with_head: Path, merged: Path, predictors: dict[str, torch.Tensor],
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A draft head file over a model with its own head and predictors: one note says what it replaces, with how many
    layers, first in Model.placement (llama-cli prints it as "load: note: ...") and on stderr when the library logs.
    Over a model with nothing of its own to replace: no note."""
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    folder = save_published(eagle_state(cfg, seed=5), cfg, tmp_path / "head")
    save_file({k: v for k, v in predictors.items() if k.startswith("blk.1.")}, tmp_path / "pred.safetensors")
    (tmp_path / "pred.json").write_text(json.dumps({"format": "specee-predictors", "exit_layers": [1]}))
    with_pred, head_alone = tmp_path / "with-pred.gguf", tmp_path / "head-alone.gguf"
    merge_gguf(tiny_gguf, with_pred, eagle=folder, eagle_type="f32", predictors=tmp_path / "pred.safetensors",
               draft_head_only=True, progress=False)
    merge_gguf(tiny_gguf, head_alone, eagle=folder, eagle_type="f32", draft_head_only=True, progress=False)

    m = specee.Model(str(with_head), n_ctx=64, draft_head=str(with_pred))
    assert m.placement.startswith(f"note: draft head file {with_pred}: replaces the model's EAGLE head and its exit "
                                  "predictors (3 layers) with the file's (1 layer)\n"), m.placement
    assert m._model.exit_n_pred == 1
    m = specee.Model(str(with_head), n_ctx=64, draft_head=str(head_alone))
    assert m.placement.startswith(f"note: draft head file {head_alone}: replaces the model's EAGLE head; keeps its exit "
                                  "predictors (3 layers): the file has none\n"), m.placement
    assert m._model.exit_n_pred == len(PRED_LAYERS)
    m = specee.Model(str(merged), n_ctx=64)  # predictors, no head of its own
    m._model.load_eagle(str(with_pred))
    assert m.placement.startswith(f"note: draft head file {with_pred}: replaces the model's exit predictors "
                                  "(3 layers) with the file's (1 layer)\n"), m.placement
    assert "note:" not in specee.Model(str(tiny_gguf), n_ctx=64, draft_head=str(with_pred)).placement

    capfd.readouterr()
    specee.Model(str(with_head), n_ctx=64, draft_head=str(with_pred))
    assert "draft head file" not in capfd.readouterr().err  # the library's logging is off by default
    _core.set_verbose(True)
    try:
        specee.Model(str(with_head), n_ctx=64, draft_head=str(with_pred))
    finally:
        _core.set_verbose(False)
    assert f"specee: note: draft head file {with_pred}: replaces the model's EAGLE head" in capfd.readouterr().err
    # the tiny model has no tokenizer: llama-cli stops at the prompt, after printing the load lines
    r = run_cli("-m", str(with_head), "--draft-head", str(with_pred), "-p", "hi", "-n", "1", "-no-cnv", "-t", "1")
    assert "no tokenizer" in r.stderr, r.stderr
    assert f"load: note: draft head file {with_pred}: replaces the model's EAGLE head and its" in r.stderr


def forward_with_filled_kv(hf, tokens: list[int], exit_of: list[int]) -> list[np.ndarray]:
    """A forward in which token j's K/V in every layer after its exit layer come from its output at the exit
    layer (that layer's attn_norm and K/V projections); hidden states after each layer."""
    from conftest import rms_norm, rope

    cfg = hf.config
    n, n_head, n_kv = len(tokens), cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // n_head
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    eps, pos = cfg.rms_norm_eps, torch.arange(n)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    hiddens, frozen = [], [None] * n
    with torch.no_grad():
        x = hf.model.embed_tokens.weight[torch.as_tensor(tokens)]
        for il, layer in enumerate(hf.model.layers):
            att = layer.self_attn
            src = torch.stack([frozen[j] if exit_of[j] < il else x[j] for j in range(n)])
            h, hk = rms_norm(x, layer.input_layernorm.weight, eps), rms_norm(src, layer.input_layernorm.weight, eps)
            q = rope((h @ att.q_proj.weight.T).view(n, n_head, hd).transpose(0, 1), pos, theta)
            k = rope((hk @ att.k_proj.weight.T).view(n, n_kv, hd).transpose(0, 1), pos, theta)
            v = (hk @ att.v_proj.weight.T).view(n, n_kv, hd).transpose(0, 1)
            k, v = k.repeat_interleave(n_head // n_kv, 0), v.repeat_interleave(n_head // n_kv, 0)
            s = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~causal[None], float("-inf"))
            x = x + (s.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ att.o_proj.weight.T
            h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
            x = x + (torch.nn.functional.silu(h @ layer.mlp.gate_proj.weight.T) * (h @ layer.mlp.up_proj.weight.T)) \
                @ layer.mlp.down_proj.weight.T
            for j in range(n):
                if exit_of[j] == il:
                    frozen[j] = x[j].clone()
            hiddens.append(x.numpy().copy())
    return hiddens


def test_filled_kv_matches_a_forward_with_filled_kv(with_head: Path, tiny_hf) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    schedule = [0, -1, 1, 2, -1, 0, 0, 2]
    eps = tiny_hf.config.rms_norm_eps
    norm_w, lm_head = tiny_hf.model.norm.weight.detach(), tiny_hf.lm_head.weight.detach()
    for prompt in PROMPTS:
        out, layers, st = exit_decode(m, prompt, 20, threshold=1.0, schedule=schedule, kv="fill")
        assert st["n_exits"] > 0 and st["t_fill_ms"] > 0
        cells = [c for c in range(m.n_ctx) if kv_cell_pos(m, c) >= 0]
        assert all(kv_cell_valid(m, c, il) for c in cells for il in range(m.n_layer))  # nothing masked
        seq = prompt + out[:-1]
        hiddens = forward_with_filled_kv(tiny_hf, seq, [m.n_layer - 1] * len(prompt) + layers)
        for k, layer in enumerate(layers):
            h = torch.from_numpy(hiddens[layer][len(prompt) + k])
            logits = (h * torch.rsqrt(h.pow(2).mean() + eps) * norm_w) @ lm_head.T
            want, got = int(torch.argmax(logits)), out[k + 1]
            assert got == want or float(logits[want] - logits[got]) < 0.02, (k, layer, got, want)


# ---- the CLI on SmolLM2 with the shipped head and predictors


@pytest.fixture(scope="module")
def smollm2_parts(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specee.paths import default_eagle_head_path

    head = Path(default_eagle_head_path())
    preds = head.parent / "smollm2-135m-exit.safetensors"
    out = tmp_path_factory.mktemp("parts") / "smollm2-parts.gguf"
    merge_gguf(smollm2_path, out, eagle=head, predictors=preds, draft_head_only=True, progress=False)
    return out


def run_cli(*args: str) -> "subprocess.CompletedProcess[str]":
    import subprocess

    from specee._tools import tool_path

    return subprocess.run([str(tool_path("llama-cli")), *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_cli_early_exit(smollm2_path: Path, smollm2_parts: Path) -> None:
    base = ["-m", str(smollm2_path), "--draft-head", str(smollm2_parts), "-p", "The capital of France is", "-n", "24",
            "-t", "1", "-no-cnv", "--temp", "0"]
    # auto: not early exit, whose predictors' .json (merged as specee.exit.speedup) says they lose on this model
    speedup = float(gguf.GGUFReader(smollm2_parts).fields[C.KEY_EXIT_SPEEDUP].contents())
    assert speedup < 1.0
    auto = run_cli(*base)
    assert auto.returncode == 0 and "auto: " in auto.stderr and \
        f"not early exit: its predictors expect {speedup:.2f}x plain" in auto.stderr and \
        "early exit =" not in auto.stderr, auto.stderr
    on = run_cli(*base, "--mode", "early-exit")
    assert on.returncode == 0, on.stderr
    assert "early exit =    23 tokens" in on.stderr and "exit histogram = layers run:tokens" in on.stderr
    assert "mode early-exit (SpecEE): lossy" in on.stderr
    hist = on.stderr.split("exit histogram = layers run:tokens")[1].splitlines()[0].split()
    assert sum(int(h.split(":")[1]) for h in hist) == 23  # decoded tokens, as "early exit = 23 tokens" (not the prompt's)
    off = run_cli(*base, "--mode", "plain")
    assert off.returncode == 0 and "early exit" not in off.stderr
    never = run_cli(*base, "--exit-threshold", "1", "--exit-kv", "fill", "--exit-layers", "16,20")
    assert never.returncode == 0 and never.stdout == off.stdout  # never exiting is plain decoding
    assert "exit ratio 0.000" in never.stderr
    for bad, msg in [(["--exit-threshold", "2"], "expected a number in [0, 1]"),
                     (["--exit-layers", "29"], "exit layer 29 has no exit predictor"),
                     (["--exit-layers", "3,x"], "comma-separated"),
                     (["--exit-kv", "drop"], "mask or fill"),
                     (["--mode", "early-exit", "--temp", "0.7"], "decodes greedily"),
                     (["--mode", "eagle2", "--exit-threshold", "0.5"], "exit settings are given, but the mode is eagle2")]:
        r = run_cli(*base, *bad)
        assert r.returncode != 0 and msg in r.stderr, (bad, r.stderr[-300:])
    plain_model = run_cli("-m", str(smollm2_path), "-p", "hi", "-n", "2", "--mode", "early-exit", "-no-cnv", "--temp", "0")
    assert plain_model.returncode != 0 and "needs an EAGLE draft head" in plain_model.stderr


def test_the_default_draft_head_is_the_shipped_head_and_predictors(smollm2_path: Path) -> None:
    """draft_head="default" (the README's main run): the shipped head with its 8192-token draft vocabulary and
    the shipped predictors, with the exit settings recorded beside them, and it decodes with early exit (asked for:
    auto passes it over, its predictors' file saying 0.85x plain, tests/test_auto_mode.py)."""
    import json

    from specee.paths import default_draft_head_path

    weights = Path(default_draft_head_path()).parent
    settings = json.loads((weights / "smollm2-135m-exit.json").read_text())
    m = specee.Model(smollm2_path, n_ctx=256, n_threads=1, draft_head="default")
    assert m.has_eagle and m._model.eagle_n_vocab == 8192
    assert m._model.exit_layers == settings["exit_layers"] and m._model.exit_n_pred == 29
    out = m.generate("The capital of France is", max_tokens=8, temp=0, mode="early-exit")
    assert out.strip() and m.last_stats.n_generated == 8 and m.last_stats.mode == "early-exit"
    assert len(m.last_stats.layers_run) == 7  # one per decode step (the first token comes from the prompt pass)


@pytest.mark.parametrize("ftype", ["q4_1", "q4_0"])
def test_exit_features_read_the_lm_head_of_an_owned_copy(merged: Path, tmp_path: Path, ftype: str) -> None:
    """The exit predictors' features read the file's lm_head again (csrc/decode/specee-exit.cpp). A Q4_1 or Q4_0
    lm_head goes to the kernels' eight-row layout, and the loader hands back the pages it was copied from: a mapping's
    fault back in, but a --no-mmap copy's would read as zeros, so the loader keeps those: the features (the candidates'
    logits first) are the same from the copy as from the mapping, and not zeros."""
    from specee.convert.quantize import quantize_gguf

    path = tmp_path / f"exit-{ftype}.gguf"
    quantize_gguf(merged, path, ftype, progress=False)
    feats = []
    for use_mmap in (True, False):
        m = specee.Model(str(path), n_ctx=64, n_threads=1, use_mmap=use_mmap)
        if _core.kernels_auto_path() != "off":
            assert "eight-row layout" in m.placement, m.placement
        m.eval([1, 5, 9, 3, 7], layers=(0, m.n_layer), hidden_all=True)
        feats.append(m._model.exit_features(m.hidden(1)[-1], np.array([3, 11, 0, 42], dtype=np.int32), None)[0])
        m.close()
    assert np.abs(feats[0][:N_CAND]).min() > 0
    np.testing.assert_array_equal(feats[0], feats[1])
