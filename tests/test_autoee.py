"""specee.autoee train-eagle: ShareGPT parsing, features through the runtime, the PyTorch EAGLE head against
the Hugging Face decoder layer, training steps, resumable checkpoints, export -> merge round trips."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import specee
from specee import constants as C
from specee.autoee import eagle_trainer as T
from specee.autoee.eagle_export import export_head
from specee.autoee.eagle_features import Decontaminator, collect, create_store, extract, open_store, regenerate, render
from specee.autoee.eagle_head import BaseWeights, EagleHead, HeadConfig, causal_mask, read_base
from specee.autoee.sharegpt import conversation, iter_json_array, read_sharegpt
from specee.convert.draft_head import base_model, load_eagle
from specee.convert.hf import permute
from specee.convert.merge import merge_gguf
from specee.convert.output import read_fields
from specee.paths import default_eagle_head_path

from conftest import TINY

# ---- ShareGPT

SHAREGPT = """[
  {"id": "a_0", "conversations": [{"from": "human", "value": "Hi [there]"}, {"from": "gpt", "value": "Hello \\"you\\""}]},
  {"id": "b_0", "conversations": [{"from": "gpt", "value": "lead"}, {"from": "human", "value": "Q"},
                                  {"from": "gpt", "value": "A"}, {"from": "human", "value": "dangling"}]},
  {"id": "c_0", "conversations": [{"from": "human", "value": "only a question"}]},
  {"id": "d_0", "conversations": [{"from": "human", "value": "Write a function that sums a list"},
                                  {"from": "gpt", "value": "def f(x): return sum(x)"}]},
  {"id": "e_0", "conversations": [{"from": "human", "value": "cut off in the mid"""


def test_truncated_sharegpt_is_read_up_to_the_cut(tmp_path: Path) -> None:
    chunks = [SHAREGPT[i:i + 7] for i in range(0, len(SHAREGPT), 7)]  # elements span many chunks
    items = list(iter_json_array(iter(chunks)))
    assert [it["id"] for it in items] == ["a_0", "b_0", "c_0", "d_0"]
    path = tmp_path / "sharegpt.json"
    path.write_text(SHAREGPT)
    convs = list(read_sharegpt(path))
    assert [c.id for c in convs] == ["a_0", "b_0", "d_0"]  # c_0 has no answer
    assert convs[0].messages == [{"role": "user", "content": "Hi [there]"},
                                 {"role": "assistant", "content": 'Hello "you"'}]
    # a leading assistant turn and a trailing user turn are dropped
    assert [m["content"] for m in convs[1].messages] == ["Q", "A"]
    assert conversation({"conversations": [{"from": "robot", "value": "x"}]}) is None
    assert list(iter_json_array(iter(['[{"a": 1}, {"b": 2}]', "\n"]))) == [{"a": 1}, {"b": 2}]


def test_evaluation_prompts_are_kept_out(tmp_path: Path) -> None:
    evals = tmp_path / "question.jsonl"
    evals.write_text(json.dumps({"question_id": 1, "turns": ["Write a function that sums a list", "more"]}) + "\n")
    path = tmp_path / "sharegpt.json"
    path.write_text(SHAREGPT)
    keep = Decontaminator.from_files([evals], n_chars=24)
    assert [c.id for c in read_sharegpt(path) if keep.is_clean(c)] == ["a_0", "b_0"]


# ---- features


def test_features_are_the_final_norm_output(tiny_gguf: Path, tiny_hf) -> None:
    model = specee.Model(tiny_gguf, n_ctx=64, n_batch=8, n_threads=2)
    tokens = list(range(3, 23))  # 20 tokens: three batches of n_batch 8
    feats, argmax = extract(model, tokens)
    assert feats.shape == (20, TINY["hidden_size"]) and argmax.shape == (20,)
    with torch.no_grad():
        out = tiny_hf(torch.tensor([tokens]), output_hidden_states=True)
    want = out.hidden_states[-1][0].numpy()  # HF's last hidden state is after the final norm
    np.testing.assert_allclose(feats, want, atol=0.02, rtol=0)  # F16 KV cache: measured max error 0.007
    assert (argmax == out.logits[0].argmax(-1).numpy()).mean() > 0.9


@pytest.mark.slow
def test_collect_renders_chat_and_resumes(smollm2_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(SHAREGPT)
    model = specee.Model(smollm2_path, n_ctx=128, n_batch=128, n_threads=2)
    template = model.chat_template()
    convs = list(read_sharegpt(path))
    tokens, flags = render(model, template, convs[1], 1000)
    text = specee.chat_apply_template(template, convs[1].messages, False)
    assert tokens == model.tokenize(text, add_special=True, parse_special=True)
    assert model.detokenize([t for t, f in zip(tokens, flags) if f], unparse_special=True) == \
        "<|im_start|>assistant\nA<|im_end|>\n"
    n_a, n_b = (len(render(model, template, c, 64)[0]) for c in convs[:2])
    store = create_store(tmp_path / "features", n_a + n_b + 8, model.n_embd)  # d_0 does not fit
    collect(model, iter(convs[:1]), store, template=template, max_len=64, progress=False)
    collect(model, iter(convs), store, template=template, max_len=64, progress=False)  # resumes after a_0
    again = open_store(tmp_path / "features")
    assert again.n_done == 2 and again.offsets == [0, n_a] and again.n_tokens == n_a + n_b
    (s0, e0), _ = again.spans()
    feats, argmax = extract(model, list(again.tokens[s0:e0]))
    np.testing.assert_allclose(again.features[s0:e0], feats.astype(np.float16))
    assert (again.targets[s0:e0] == argmax).all()



@pytest.mark.slow
def test_regenerate_uses_the_targets_greedy_reply(smollm2_path: Path, tmp_path: Path) -> None:
    model = specee.Model(smollm2_path, n_ctx=128, n_batch=128, n_threads=1)
    conv = conversation({"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                           {"from": "gpt", "value": "hello there"}, {"from": "human", "value": "x"},
                                           {"from": "gpt", "value": "y"}]})
    tokens, flags = regenerate(model, "chatml", conv, 64, 12, min_new=4)
    prompt = model.prompt_tokens(conv.messages[:2], "chatml")
    reply = model.generate_tokens(prompt, 12, temp=0)
    assert tokens[:len(prompt)] == prompt and flags == [0] * len(prompt) + [1] * (len(tokens) - len(prompt))
    assert tokens[len(prompt):len(prompt) + len(reply)] == reply
    assert regenerate(model, "chatml", conv, len(prompt) + 3, 12, min_new=4) == ([], [])  # no room for a reply
    store = create_store(tmp_path / "features", 256, model.n_embd)
    collect(model, iter([conv]), store, template="chatml", max_len=128, progress=False, regenerate_tokens=40)
    again = open_store(tmp_path / "features")
    want, _ = regenerate(model, "chatml", conv, 128, 40)
    assert again.generated == [0] and list(again.tokens[:again.n_tokens]) == want

# ---- the PyTorch head

H, FF, NH, NKV, V = 64, 96, 4, 2, 128


def tiny_head_config() -> HeadConfig:
    return HeadConfig(n_embd=H, n_ff=FF, n_head=NH, n_head_kv=NKV, head_dim=H // NH, rope_theta=10000.0,
                      rms_eps=1e-5, n_vocab=V)


def tiny_base(seed: int = 0) -> BaseWeights:
    g = torch.Generator().manual_seed(seed)
    embd = torch.randn(V, H, generator=g)
    return BaseWeights(embd, 0.2 * torch.randn(V, H, generator=g))


def test_head_layer_equals_the_hf_decoder_layer_without_input_norm() -> None:
    torch.manual_seed(0)
    cfg = tiny_head_config()
    head = EagleHead(cfg).eval()
    with torch.no_grad():
        head.ffn_norm.weight.uniform_(0.5, 1.5)
    hf_cfg = LlamaConfig(hidden_size=H, intermediate_size=FF, num_attention_heads=NH, num_key_value_heads=NKV,
                         rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps, attn_implementation="eager")
    layer = LlamaDecoderLayer(hf_cfg, 0).eval()
    layer.input_layernorm = torch.nn.Identity()
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
    with torch.no_grad():
        for hf_name, ours in names.items():
            layer.get_submodule(hf_name).weight.copy_(getattr(head, ours).weight)
    emb, feat = torch.randn(1, 12, H), torch.randn(1, 12, H)
    pos = torch.arange(12)[None]
    with torch.no_grad():
        got = head(emb, feat, pos, causal_mask(torch.zeros(1, 12, dtype=torch.long)))
        x = head.fc(torch.cat([emb, feat], -1))
        cos_sin = LlamaRotaryEmbedding(hf_cfg)(x, pos)
        out = layer(x, attention_mask=torch.full((12, 12), float("-inf")).triu(1)[None, None],
                    position_ids=pos, position_embeddings=cos_sin)
        want = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def toy_store(tmp_path: Path, n_conv: int = 6, length: int = 20, seed: int = 0):
    """A feature store of random conversations whose features follow from the tokens (learnable)."""
    rng = np.random.default_rng(seed)
    proj = rng.standard_normal((V, H)).astype(np.float32)
    store = create_store(tmp_path / "features", n_conv * length, H)
    for k in range(n_conv):
        a, b = k * length, (k + 1) * length
        tokens = rng.integers(0, V, length)
        store.tokens[a:b] = tokens
        store.features[a:b] = np.tanh(proj[tokens] + 0.5 * np.roll(proj[tokens], 1, 0))
        store.targets[a:b] = rng.integers(0, V, length)
        store.assistant[a:b] = rng.integers(0, 2, length)
        store.offsets.append(a)
    store.n_tokens = n_conv * length
    store.save_state()
    return open_store(tmp_path / "features")


def test_training_steps_reduce_the_loss(tmp_path: Path) -> None:
    store = toy_store(tmp_path)
    base = tiny_base()
    cfg = T.TrainConfig(steps=30, lr=3e-3, warmup=2, seq_len=64, rows=2, noise=0.0)
    torch.manual_seed(0)
    head = EagleHead(tiny_head_config())
    opt = T.make_optimizer(head, cfg)
    batch = T.make_batch(store, T.pack(store.spans(), cfg.seq_len)[:2], cfg.seq_len, cfg.loss_on)
    first = T.compute_loss(head, base, batch, cfg, noise=False).total.item()
    for step in range(30):
        T.train_step(head, opt, base, batch, cfg, step)
    assert T.compute_loss(head, base, batch, cfg, noise=False).total.item() < 0.7 * first


def test_pairs_and_masks_of_a_packed_batch(tmp_path: Path) -> None:
    store = toy_store(tmp_path, n_conv=3, length=10)
    rows = T.pack(store.spans(), 20)
    assert rows == [[(0, 10), (10, 20)], [(20, 30)]]  # 9 pairs each: two fit a row of 20
    batch = T.make_batch(store, rows, 20, "all")
    assert batch.tokens[0, :9].tolist() == store.tokens[1:10].tolist()
    np.testing.assert_array_equal(batch.target_feat[0, 9:18].numpy(), store.features[11:20].astype(np.float32))
    assert batch.pos[0, 9].item() == 0 and batch.weight[0, 18:].sum() == 0 and batch.weight[1, 9:].sum() == 0
    assert batch.mask[0, 10, 9] and not batch.mask[0, 10, 8] and not batch.mask[0, 9, 10]


def test_chain_step_one_is_the_teacher_forced_accuracy(tmp_path: Path) -> None:
    store = toy_store(tmp_path)
    base = tiny_base()
    cfg = T.TrainConfig(seq_len=64, rows=2)
    torch.manual_seed(1)
    head = EagleHead(tiny_head_config(), draft_vocab=list(range(0, V, 2)))
    # targets the head predicts often, so that the counts are not all zero
    batch = T.make_batch(store, T.pack(store.spans(), 64), 64, "all")
    with torch.no_grad():
        pred = head(base.embd[batch.tokens], batch.feat, batch.pos, batch.mask)
        batch.target_id = T.draft_tokens(head, base, pred)
    counts, n = T.chain_accuracy(head, base, batch, 3)
    losses = T.compute_loss(head, base, batch, cfg, noise=False)
    assert counts[0] == n == losses.n and losses.accuracy == 1.0
    assert counts[0] >= counts[1] >= counts[2]


def test_chain_steps_equal_drafting_one_token_at_a_time(tmp_path: Path) -> None:
    """Step s at position j equals the head run on [true inputs 0..j, then its own chain] as a plain sequence."""
    store = toy_store(tmp_path, n_conv=2, length=16)
    base = tiny_base()
    torch.manual_seed(2)
    head = EagleHead(tiny_head_config()).eval()
    batch = T.make_batch(store, T.pack(store.spans(), 32), 32, "all")  # row 0: pairs 0..14 and 15..29
    preds: list[torch.Tensor] = []
    T.chain_accuracy(head, base, batch, 3, preds=preds)
    j = 6
    with torch.no_grad():
        emb, feat = list(base.embd[batch.tokens[0, :j + 1]]), list(batch.feat[0, :j + 1])
        for s in (2, 3):
            emb.append(base.embd[batch.tokens[0, j + s - 1]])
            feat.append(preds[s - 2][0, j])
            n = len(emb)
            out = head(torch.stack(emb)[None], torch.stack(feat)[None], torch.arange(n)[None],
                       causal_mask(torch.zeros(1, n, dtype=torch.long)))
            torch.testing.assert_close(out[0, -1], preds[s - 1][0, j], atol=1e-5, rtol=1e-4)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    store = toy_store(tmp_path)
    base = tiny_base()
    cfg = T.TrainConfig(steps=6, lr=1e-3, warmup=2, seq_len=32, rows=2, seed=3)

    def fresh() -> tuple[EagleHead, torch.optim.Optimizer]:
        torch.manual_seed(cfg.seed)
        head = EagleHead(tiny_head_config())
        return head, T.make_optimizer(head, cfg)

    head, opt = fresh()
    T.train(head, opt, base, store, store.spans(), cfg, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    half = T.TrainConfig(**{**cfg.__dict__, "steps": 3})
    head2, opt2 = fresh()
    T.train(head2, opt2, base, store, store.spans(), half, checkpoint=ckpt, save_every=3, progress=False)
    state = T.load_checkpoint(ckpt)
    head3, opt3 = fresh()
    head3.load_state_dict(state["head"])
    opt3.load_state_dict(state["optimizer"])
    assert state["step"] == 3
    T.train(head3, opt3, base, store, store.spans(), cfg, start_step=3, progress=False)
    for (name, a), b in zip(head.state_dict().items(), head3.state_dict().values()):
        assert torch.equal(a, b), name


# ---- export -> merge


def test_export_merges_into_the_base_and_as_a_draft_head_file(tiny_gguf: Path, tmp_path: Path) -> None:
    cfg, base = read_base(str(tiny_gguf))
    assert (cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_vocab) == (64, 4, 2, 256)
    torch.manual_seed(0)
    head = EagleHead(cfg, draft_vocab=[5, 9, 200])
    weights, meta = export_head(head, tmp_path / "head", {"note": "test"})
    assert json.loads(meta.read_text())["draft_vocab"] == [5, 9, 200]
    saved = load_file(weights)
    assert set(saved) == set(C.EAGLE_TENSOR_NAMES) - {C.EAGLE_TOKEN_EMBD} - set(C.EAGLE3_ONLY)
    reader = gguf.GGUFReader(tiny_gguf)
    loaded = load_eagle(weights, base_model(read_fields(reader), reader, tiny_gguf))
    assert loaded.draft_vocab == [5, 9, 200] and loaded.n_ff == cfg.n_ff
    np.testing.assert_array_equal(loaded.tensors[C.EAGLE_ATTN_K],
                                  permute(head.attn_k.weight.detach().half(), cfg.n_head, cfg.n_head_kv).float().numpy())

    merged, alone = tmp_path / "merged.gguf", tmp_path / "head.gguf"
    merge_gguf(tiny_gguf, merged, eagle=weights, progress=False)
    merge_gguf(tiny_gguf, alone, eagle=weights, draft_head_only=True, progress=False)
    merged_t = {t.name: t for t in gguf.GGUFReader(merged).tensors}
    alone_r = gguf.GGUFReader(alone)
    alone_t = {t.name: t for t in alone_r.tensors}
    assert set(alone_t) == {n for n in merged_t if n.startswith("eagle.")} == set(saved)
    for name, t in alone_t.items():
        np.testing.assert_array_equal(t.data, merged_t[name].data)
    keys = {k for k in alone_r.fields if not k.startswith("GGUF.")}
    assert keys == {"general.architecture", C.KEY_EAGLE_VERSION, C.KEY_EAGLE_FEED_FORWARD_LENGTH,
                    C.KEY_EAGLE_DRAFT_VOCAB}
    assert alone_t[C.EAGLE_FC].tensor_type == gguf.GGMLQuantizationType.F16
    assert alone_t[C.EAGLE_FFN_NORM].tensor_type == gguf.GGMLQuantizationType.F32
    # the base model still loads from the merged file
    specee.Model(merged, n_ctx=32, n_threads=2).eval([1, 2, 3])

    full, _ = export_head(head, tmp_path / "full.safetensors", with_output=False)
    assert C.EAGLE_OUTPUT not in load_file(full) and "draft_vocab" not in json.loads(full.with_suffix(".json")
                                                                                        .read_text())


def test_draft_head_only_needs_an_eagle_head(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="draft-head-only"):
        merge_gguf(tiny_gguf, tmp_path / "x.gguf", predictors=tmp_path / "p.safetensors", draft_head_only=True)


# ---- the shipped head


@pytest.mark.slow
def test_the_shipped_head_fits_the_default_model(smollm2_path: Path, tmp_path: Path) -> None:
    path = Path(default_eagle_head_path())
    info = json.loads(path.with_suffix(".json").read_text())
    assert info["format"] == "specee-eagle" and info["base_model"] == smollm2_path.name
    assert info["validation"]["top1_accuracy"] > 0.3 and info["validation"]["n_positions"] > 5000
    reader = gguf.GGUFReader(smollm2_path)
    load_eagle(path, base_model(read_fields(reader), reader, smollm2_path))
    head_gguf = path.with_suffix(".gguf")
    assert {t.name for t in gguf.GGUFReader(head_gguf).tensors} == set(load_file(path))
    vocab = gguf.GGUFReader(path.with_name(path.stem + "-vocab8192.gguf"))
    assert len(vocab.fields[C.KEY_EAGLE_DRAFT_VOCAB].data) == 8192
