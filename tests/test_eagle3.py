"""EAGLE-3 draft heads on the tiny model: a random head written in EAGLE-3's published layout and converted, the
native head against the PyTorch reference (autoee.eagle_head.Eagle3Head) for committed pairs and for draft steps fed
the head's own output, the features the target pass captures against its hidden states, greedy speculative output
against plain output (both tree kinds; a random head and a quickly trained one), the sampling distribution, the
converter's refusals, a draft head file through the CLI with early exit. SmolLM2 runs are marked slow."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specee
from specee import EagleParams, ExitParams
from specee import constants as C
from specee._tools import tool_path
from specee.autoee.eagle_head import Eagle3Head, causal_mask, read_base
from specee.convert.merge import merge_gguf
from test_devices import rpc_server  # noqa: F401 (a fixture: a specee-rpc-server on 127.0.0.1)
from test_eagle import (PROMPTS, TREE_IDS, TREES, check_sampling_distribution, cli_speculative_equals_plain,
                        plain_and_spec)

# Native head against PyTorch: the head's own KV cache holds K and V in F16 (the weights are F32 here), so the
# outputs differ by F16 rounding of K/V carried through attention (measured: max abs error 4e-4 on outputs and
# logits of std ~1); 0.01 leaves room for other CPUs' kernels and still fails on any wrong tensor or wiring.
ATOL = 0.01
N_CTX = 512
# the tiny model has 4 layers, too few for EAGLE's default (inputs of layers 2, L//2, L-3): the checkpoint names
# the inputs of layers 1, 2 and 4 (eagle_aux_hidden_state_layer_ids), that is the outputs of layers 0, 1 and 3
AUX_IDS = [1, 2, 4]
FEATURE_LAYERS = [0, 1, 3]
N_FF = 96  # the head's own feed-forward length (the base model's is 160)


# ---- a random EAGLE-3 checkpoint in the published layout


def make_head(tiny_gguf: Path, draft_vocab: list[int], seed: int) -> Eagle3Head:
    cfg, _ = read_base(str(tiny_gguf))
    torch.manual_seed(seed)
    head = Eagle3Head(dataclasses.replace(cfg, n_ff=N_FF), draft_vocab, FEATURE_LAYERS)
    with torch.no_grad():  # norms away from 1, so that a missing or swapped norm shows
        for norm in (head.attn_norm, head.hidden_norm, head.ffn_norm, head.output_norm):
            norm.weight.copy_(1.0 + 0.3 * torch.randn_like(norm.weight))
    return head.eval()


def published_state(head: Eagle3Head, n_vocab: int) -> dict[str, torch.Tensor]:
    """The head's weights under EAGLE-3's published names (written out here, not taken from the converter's table,
    so that a wrong entry there shows), with d2t and t2d."""
    ids = torch.tensor(head.draft_vocab, dtype=torch.int64)
    t2d = torch.zeros(n_vocab, dtype=torch.bool)
    t2d[ids] = True
    w = {
        "fc.weight": head.fc.weight,
        "midlayer.input_layernorm.weight": head.attn_norm.weight,
        "midlayer.hidden_norm.weight": head.hidden_norm.weight,
        "midlayer.self_attn.q_proj.weight": head.attn_q.weight,
        "midlayer.self_attn.k_proj.weight": head.attn_k.weight,
        "midlayer.self_attn.v_proj.weight": head.attn_v.weight,
        "midlayer.self_attn.o_proj.weight": head.attn_output.weight,
        "midlayer.post_attention_layernorm.weight": head.ffn_norm.weight,
        "midlayer.mlp.gate_proj.weight": head.ffn_gate.weight,
        "midlayer.mlp.up_proj.weight": head.ffn_up.weight,
        "midlayer.mlp.down_proj.weight": head.ffn_down.weight,
        "norm.weight": head.output_norm.weight,
        "lm_head.weight": head.output.weight,
    }
    state = {k: v.detach().clone().contiguous() for k, v in w.items()}
    state["d2t"] = ids - torch.arange(len(ids))
    state["t2d"] = t2d
    return state


def published_config(head: Eagle3Head, aux_ids: list[int] | None = AUX_IDS) -> dict:
    c = head.cfg
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": c.n_embd, "intermediate_size": c.n_ff,
           "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head_kv, "num_hidden_layers": 1,
           "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta, "vocab_size": c.n_vocab,
           "draft_vocab_size": len(head.draft_vocab)}
    if aux_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
    return cfg


def save_eagle3(state: dict[str, torch.Tensor], cfg: dict, folder: Path, bin_file: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if bin_file:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, folder / "model.safetensors")
    return folder


REDUCED_VOCAB = sorted(np.random.default_rng(1).choice(256, 96, replace=False).tolist())


@pytest.fixture(scope="module")
def random_head(tiny_gguf: Path) -> Eagle3Head:
    return make_head(tiny_gguf, REDUCED_VOCAB, seed=3)


@pytest.fixture(scope="module")
def random_gguf(tiny_gguf: Path, random_head: Eagle3Head, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_eagle3(published_state(random_head, 256), published_config(random_head),
                         tmp_path_factory.mktemp("eagle3_random"))
    out = folder / "tiny-eagle3.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder, eagle_type="f32", progress=False)
    return out


def target_features(tiny_hf, llama_forward, tokens: list[int]) -> np.ndarray:
    """[n, 3H]: the outputs of FEATURE_LAYERS, low to high, from the PyTorch forward of the target."""
    _, hiddens = llama_forward(tiny_hf, tokens)
    return np.concatenate([hiddens[il] for il in FEATURE_LAYERS], -1)


@pytest.fixture(scope="module")
def trained_gguf(tiny_gguf: Path, tiny_hf, llama_forward, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head over the whole vocabulary trained for a few seconds on the tiny model's own greedy text with the
    target's features (from the PyTorch forward): its first draft token is mostly right, so steps accept."""
    head = make_head(tiny_gguf, list(range(256)), seed=4).train()
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)
    embed = tiny_hf.model.embed_tokens.weight.detach()
    seqs = []
    for prompt in PROMPTS + [np.random.default_rng(10 + s).integers(0, 256, 8).tolist() for s in range(5)]:
        toks = prompt + m.generate_tokens(prompt, 56, temp=0)
        seqs.append((torch.tensor(toks), torch.tensor(target_features(tiny_hf, llama_forward, toks))))
    opt = torch.optim.Adam(head.parameters(), 1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(60):
            loss = 0.0
            for t, f in seqs:  # pair i = (f_i, t_{i+1}) predicts t_{i+2}
                n = len(t) - 2
                pos = torch.arange(n)[None]
                out = head(embed[t[1:-1]][None], f[:-2][None], pos, causal_mask(torch.zeros(1, n)))
                loss = loss + torch.nn.functional.cross_entropy(head.logits(out[0]), t[2:])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    head.eval()
    folder = save_eagle3(published_state(head, 256), published_config(head), tmp_path_factory.mktemp("eagle3_trained"),
                         bin_file=True)
    out = folder / "tiny-eagle3-trained.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder, eagle_type="f32", progress=False)
    return out


# ---- loading and the converter


def test_the_head_is_read_as_eagle3(tiny_gguf: Path, random_gguf: Path, tmp_path: Path) -> None:
    m = specee.Model(random_gguf, n_ctx=64)
    assert m.has_eagle and m._model.eagle_version == 3 and m._model.eagle_feature_layers == FEATURE_LAYERS
    assert m._model.eagle_n_feature == 3 * 64 and m._model.eagle_draft_vocab == REDUCED_VOCAB
    head_file = tmp_path / "head.gguf"  # a draft head file: the same head next to the plain base file
    merge_gguf(tiny_gguf, head_file, eagle=random_gguf, eagle_type="f32", draft_head_only=True, progress=False)
    alone = specee.Model(tiny_gguf, n_ctx=64, draft_head=head_file)
    assert alone._model.eagle_version == 3 and alone._model.eagle_feature_layers == FEATURE_LAYERS


def test_inspect_says_eagle3(random_gguf: Path) -> None:
    from specee.convert.inspect import inspect_gguf

    out = inspect_gguf(random_gguf, tensors=False)
    assert "draft head       yes: EAGLE-3 head, uses the base model's token embedding, draft vocabulary of 96" in out
    assert "features: outputs of layers [0, 1, 3]" in out


def mutate(state: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**state, name: value}


def bad_checkpoints(state: dict[str, torch.Tensor]) -> list[tuple[str, dict[str, torch.Tensor], str]]:
    d2t_far = state["d2t"].clone()
    d2t_far[5] = 1000
    return [
        ("fc-2h", mutate(state, "fc.weight", torch.zeros(64, 128)),
         r"eagle.fc.weight \(fc.weight\) has shape \[64, 128\], expected \[64, 192\]"),
        ("q-h", mutate(state, "midlayer.self_attn.q_proj.weight", torch.zeros(64, 64)),
         r"eagle.attn_q.weight \(midlayer.self_attn.q_proj.weight\) has shape \[64, 64\], expected \[64, 128\]"),
        ("lm_head-rows", mutate(state, "lm_head.weight", torch.zeros(90, 64)),
         r"lm_head.weight has 90 rows but d2t maps 96 draft tokens"),
        ("d2t-range", mutate(state, "d2t", d2t_far), r"d2t maps draft token 5 to target id \d+, outside the base "
         r"vocabulary \[0, 256\)"),
        ("t2d", mutate(state, "t2d", torch.ones(256, dtype=torch.bool)), r"t2d marks 256 target tokens"),
        ("hidden-128", {**{k: torch.zeros(128, *v.shape[1:]) if v.ndim == 2 and k.startswith("fc") else v
                           for k, v in state.items()}},
         r"its hidden size is 128 \(fc.weight \[128, 192\]\) but the base model's llama.embedding_length is 64"),
        ("fc-bias", mutate(state, "fc.bias", torch.zeros(64)), r"unexpected tensor 'fc.bias' for an EAGLE-3 head"),
    ]


@pytest.mark.parametrize("case", range(7), ids=["fc-2h", "q-h", "lm_head-rows", "d2t-range", "t2d", "hidden-128",
                                                 "fc-bias"])
def test_converter_refuses_misshaped_checkpoints(case: int, tiny_gguf: Path, random_head: Eagle3Head,
                                                 tmp_path: Path) -> None:
    name, state, msg = bad_checkpoints(published_state(random_head, 256))[case]
    folder = save_eagle3(state, published_config(random_head), tmp_path / name)
    with pytest.raises(ValueError, match=msg):
        merge_gguf(tiny_gguf, tmp_path / "out.gguf", eagle=folder, progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_converter_feature_layers(tiny_gguf: Path, random_head: Eagle3Head, tmp_path: Path) -> None:
    """Without eagle_aux_hidden_state_layer_ids a 4-layer target has no EAGLE default; --eagle-feature-layers gives
    them (outputs, 0-based); the input of layer 0 and layers past the model are refused."""
    state = published_state(random_head, 256)
    folder = save_eagle3(state, published_config(random_head, aux_ids=None), tmp_path / "noaux")
    with pytest.raises(ValueError, match="a 4-layer target has no EAGLE-3 default feature layers"):
        merge_gguf(tiny_gguf, tmp_path / "out.gguf", eagle=folder, progress=False)
    out = tmp_path / "given.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder, feature_layers=[1, 2, 3], draft_head_only=True, progress=False)
    assert specee.Model(tiny_gguf, n_ctx=64, draft_head=out).eagle_feature_layers == [1, 2, 3]
    with pytest.raises(ValueError, match=r"feature layers \[1, 2, 4\]: expected 3 layers of the base model's 0..3"):
        merge_gguf(tiny_gguf, out, eagle=folder, feature_layers=[1, 2, 4], progress=False)
    zero = save_eagle3(state, published_config(random_head, aux_ids=[0, 2, 3]), tmp_path / "zero")
    with pytest.raises(ValueError, match="takes the input of layer 0"):
        merge_gguf(tiny_gguf, out, eagle=zero, progress=False)
    from specee.convert.draft_head import eagle3_default_layers
    assert eagle3_default_layers(32) == [1, 15, 28] and eagle3_default_layers(30) == [1, 14, 26]


def test_runtime_refuses_a_bad_head_file(tiny_gguf: Path, random_gguf: Path, tmp_path: Path) -> None:
    """A version-3 file without its feature layers, or with a layer past the model, is refused by the loader."""
    import gguf

    reader = gguf.GGUFReader(random_gguf)
    for bad_layers, msg in ((None, "has no specee.eagle.feature_layers"), ([0, 1, 9], "lists layer 9")):
        w = gguf.GGUFWriter(tmp_path / "bad.gguf", "llama")
        w.add_uint32(C.KEY_EAGLE_VERSION, 3)
        vocab = reader.fields[C.KEY_EAGLE_DRAFT_VOCAB]
        w.add_array(C.KEY_EAGLE_DRAFT_VOCAB, [int(vocab.parts[i][0]) for i in vocab.data])
        if bad_layers is not None:
            w.add_array(C.KEY_EAGLE_FEATURE_LAYERS, bad_layers)
        for t in reader.tensors:
            if t.name.startswith("eagle."):
                w.add_tensor(t.name, np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)]))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(specee.SpecEEError, match=msg):
            specee.Model(tiny_gguf, n_ctx=64, draft_head=tmp_path / "bad.gguf")


# ---- the head against PyTorch


def reference_chain(head: Eagle3Head, embed: torch.Tensor, tokens: list[int], feats: np.ndarray,
                    drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and logits of the committed pairs (fc of the target features), then of each draft step fed the
    previous row's own output (no fc), every row seeing the earlier ones."""
    with torch.no_grad():
        toks = list(tokens)
        hidden = head.fc(torch.tensor(feats))  # [n, H]: the committed rows' layer inputs
        n = len(toks)
        out = head(embed[toks][None], hidden[None], torch.arange(n)[None], causal_mask(torch.zeros(1, n)))[0]
        for t in drafts:
            toks.append(t)
            hidden = torch.cat([hidden, out[-1:]])
            n += 1
            step = head(embed[toks][None], hidden[None], torch.arange(n)[None], causal_mask(torch.zeros(1, n)))[0]
            out = torch.cat([out, step[-1:]])
        return out, head.logits(out)


def test_draft_head_matches_pytorch(random_gguf: Path, random_head: Eagle3Head, tiny_hf) -> None:
    m = specee.Model(random_gguf, n_ctx=N_CTX, n_threads=1)
    rng = np.random.default_rng(7)
    tokens, drafts = rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, 4).tolist()
    feats = rng.standard_normal((20, 3 * 64)).astype(np.float32)
    logits, out = m.draft_head_eval(tokens, feats, drafts)
    assert logits.shape == (24, 96) and out.shape == (24, 64)
    want_out, want_logits = reference_chain(random_head, tiny_hf.model.embed_tokens.weight.detach(), tokens, feats,
                                            drafts)
    for rows, what in ((slice(0, 20), "committed pairs (3H features, fc)"), (slice(20, 24), "draft steps (own output)")):
        err_out = np.abs(out[rows] - want_out[rows].numpy()).max()
        err_logits = np.abs(logits[rows] - want_logits[rows].numpy()).max()
        assert err_out < ATOL and err_logits < ATOL, f"{what}: max abs error {err_out:.3g} / {err_logits:.3g}"
    with pytest.raises(ValueError, match=r"features must be \[n_tokens, 192\]"):
        m.draft_head_eval(tokens, feats[:, :64])


# ---- the features the target pass captures


@pytest.mark.parametrize("n_batch", [512, 8])
def test_captured_features_are_the_target_hidden_states(random_gguf: Path, tiny_hf, llama_forward,
                                                        n_batch: int) -> None:
    """Every token's [3H] feature: the outputs of the feature layers from the same pass (bit for bit), and the
    PyTorch forward's hidden states there (the runtime's K cache is F16: measured max abs error 0.022 on states of
    magnitude ~3, so 0.06); prompts longer than n_batch go through in chunks joined."""
    m = specee.Model(random_gguf, n_ctx=N_CTX, n_threads=1, n_batch=n_batch)
    tokens = np.random.default_rng(3).integers(0, 256, 21).tolist()
    m.eval(tokens)
    feats = m.features()
    assert feats.shape == (21, 192)
    np.testing.assert_allclose(feats, target_features(tiny_hf, llama_forward, tokens), atol=0.06)
    if n_batch == 512:
        m.kv_clear()
        m.eval(tokens, hidden_all=True)
        np.testing.assert_array_equal(m.features(), np.concatenate([m.hidden(il) for il in FEATURE_LAYERS], -1))
        m.kv_clear()
        m.eval(tokens, layers=(0, 2))
        with pytest.raises(specee.SpecEEError, match="did not reach every feature layer"):
            m.features()


def test_features_need_an_eagle3_head(tiny_gguf: Path) -> None:
    m = specee.Model(tiny_gguf, n_ctx=64)
    m.eval([1, 2, 3])
    with pytest.raises(specee.SpecEEError, match="no EAGLE-3 draft head"):
        m.features()


# ---- greedy: speculative output == plain output


@pytest.mark.parametrize("mode,eagle", TREES, ids=TREE_IDS)
@pytest.mark.parametrize("head", ["random", "trained"])
def test_greedy_speculative_equals_plain(mode: str, eagle: EagleParams, head: str,
                                         request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{head}_gguf")
    m = specee.Model(path, n_ctx=N_CTX, n_threads=1, type_v="f32")
    steps = tokens = 0
    for prompt in PROMPTS + [np.random.default_rng(20).integers(0, 256, 30).tolist()]:
        plain, spec = plain_and_spec(m, prompt, 48, mode, eagle)
        assert spec == plain
        steps += m.last_stats.n_steps
        tokens += sum(m.last_stats.step_tokens)
    if head == "trained":  # the features reach the head as it was trained on them: steps accept drafts
        assert tokens / steps > 1.3, f"{tokens / steps:.2f} tokens per step"


@pytest.mark.parametrize("mode", ["eagle", "eagle2"])
def test_sampling_keeps_the_target_distribution(mode: str, trained_gguf: Path) -> None:
    check_sampling_distribution(trained_gguf, mode)


@pytest.mark.parametrize("order", ["first", "last"])
def test_features_and_trees_on_a_split(trained_gguf: Path, rpc_server: str, order: str,  # noqa: F811
                                       request: pytest.FixtureRequest) -> None:
    """Half the layers on another device (ggml RPC on loopback): the feature layers live on both devices; the
    captured features are the CPU's, and greedy trees give plain output with the CPU's accepted drafts."""
    cpu = specee.Model(trained_gguf, n_ctx=N_CTX, n_threads=1, type_v="f32", n_gpu_layers=0)
    m = specee.Model(trained_gguf, n_ctx=N_CTX, n_threads=1, type_v="f32", n_gpu_layers=2, offload_order=order,
                     rpc_servers=[rpc_server])
    request.addfinalizer(m.close)
    assert "RPC" in m.placement and "CPU" in m.placement
    tokens = np.random.default_rng(5).integers(0, 256, 17).tolist()
    cpu.eval(tokens)
    m.eval(tokens)
    np.testing.assert_allclose(m.features(), cpu.features(), rtol=0, atol=1e-4)
    for mode in ("eagle", "eagle2"):
        for model in (cpu, m):
            model.kv_clear()
        plain, spec = plain_and_spec(m, PROMPTS[0], 32, mode)
        assert spec == plain
        steps = m.last_stats.n_steps
        assert plain_and_spec(cpu, PROMPTS[0], 32, mode)[1] == spec and cpu.last_stats.n_steps == steps


# ---- early exit with an EAGLE-3 head, through the CLI


def random_predictors(layers: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for il in layers:
        out[f"blk.{il}.pred.up.weight"] = torch.randn(32, 12, generator=g) * 0.3
        out[f"blk.{il}.pred.up.bias"] = torch.randn(32, generator=g) * 0.1
        out[f"blk.{il}.pred.down.weight"] = torch.randn(1, 32, generator=g) * 0.1
        out[f"blk.{il}.pred.down.bias"] = torch.full((1,), 5.0)  # fires on every check
    return out


def test_draft_head_file_with_early_exit(tiny_gguf: Path, trained_gguf: Path, tmp_path: Path) -> None:
    """A v3 draft head file with exit predictors, loaded next to the base file: early exit runs with the head's
    candidates (its top-4 mapped to target ids; the trained head's are right often enough that tokens exit), tokens
    exit before the last feature layer (3), whose output the exit layer's then stands in for; greedy EAGLE-2 with
    the same file equals plain decoding. (The CLI needs a vocabulary: SmolLM2, below.)"""
    save_file(random_predictors([0, 1, 2]), tmp_path / "pred.safetensors")
    head = tmp_path / "head3.gguf"
    merge_gguf(tiny_gguf, head, eagle=trained_gguf, predictors=tmp_path / "pred.safetensors", eagle_type="f32",
               draft_head_only=True, progress=False)
    m = specee.Model(tiny_gguf, n_ctx=256, n_threads=1, type_v="f32", draft_head=head)
    assert m._model.eagle_version == 3 and m._model.exit_n_pred == 3
    m.generate_tokens(PROMPTS[0], 24, temp=0, mode="early-exit", exit=ExitParams(layers=[0, 1, 2]))
    st = m.last_stats
    assert st.n_generated == 24 and st.n_exits > 0
    plain, spec = plain_and_spec(m, PROMPTS[1], 32, "eagle2")
    assert spec == plain
    # checked exits with an EAGLE-3 head: the waiting tokens' feature layers past their exit run later; the output is
    # plain decoding's
    for prompt in PROMPTS:
        m.kv_clear()
        plain = m.generate_tokens(prompt, 24, temp=0, mode="plain")
        m.kv_clear()
        checked = m.generate_tokens(prompt, 24, temp=0, mode="early-exit",
                                    exit=ExitParams(layers=[0, 1, 2], check=True))
        assert checked == plain and m.last_stats.n_exits > 0


# ---- SmolLM2 with a random head (slow)


@pytest.mark.slow
def test_cli_speculative_equals_plain_on_smollm2(smollm2_path: Path, tmp_path: Path) -> None:
    """A random EAGLE-3 head over SmolLM2's 30 layers (EAGLE's default feature layers: outputs of 1, 14, 26) and a
    reduced draft vocabulary, with exit predictors, in a draft head file given to llama-cli with --draft-head:
    greedy EAGLE-1 and EAGLE-2 trees equal plain decoding, and early exit runs."""
    from specee.autoee.eagle_head import HeadConfig

    cfg = HeadConfig(n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5,
                     n_vocab=49152)
    torch.manual_seed(1)
    vocab = sorted(np.random.default_rng(2).choice(49152, 4096, replace=False).tolist())
    head = Eagle3Head(cfg, vocab, [1, 14, 26])
    folder = save_eagle3(published_state(head, 49152), published_config(head, aux_ids=None), tmp_path / "head")
    save_file(random_predictors(list(range(8, 28))), tmp_path / "pred.safetensors")
    out = tmp_path / "head.gguf"
    merge_gguf(smollm2_path, out, eagle=folder, predictors=tmp_path / "pred.safetensors", draft_head_only=True,
               progress=False)
    assert specee.Model(smollm2_path, n_ctx=64, draft_head=out)._model.eagle_feature_layers == [1, 14, 26]
    cli_speculative_equals_plain(smollm2_path, out)
    common = ["-m", str(smollm2_path), "-p", "The capital of France is", "-n", "24", "--temp", "0", "-no-cnv",
              "-c", "256", "-t", "2", "-ctv", "f32"]
    ee = subprocess.run([str(tool_path("llama-cli")), *common, "--draft-head", str(out), "--mode", "early-exit"],
                        capture_output=True, text=True, timeout=300)
    assert ee.returncode == 0, ee.stderr
    assert "mode early-exit (SpecEE): lossy" in ee.stderr and "exit histogram = layers run:tokens" in ee.stderr
