"""The EAGLE draft head and lossless tree speculative decoding (csrc/decode/specee-speculative.cpp) on the tiny model:
the native head against a PyTorch implementation of the same head, greedy speculative output against plain
greedy output (both tree kinds; a random head and a quickly trained one), the sampling distribution
(chi-square), a head in its own file, a reduced draft vocabulary, and bad input. SmolLM2 runs are marked slow."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specee
from specee import EagleParams, GenerateOptions
from conftest import rms_norm, rope
from specee import _core
from specee.convert.merge import merge_gguf
from specee._tools import tool_path
from test_convert_cli import eagle_state
from test_sampling import chi2_critical
from kv_probes import kv_cell_pos

# head logits against PyTorch: the runtime keeps the head's K/V in F16 (measured max abs error 0.004)
ATOL = 0.03
THETA = 10000.0
N_CTX = 512
PROMPTS = [np.random.default_rng(s).integers(0, 256, 6 + s).tolist() for s in range(3)]
TREES = [("eagle", EagleParams(choices="mc_sim_7b_63")),
         ("eagle", EagleParams(choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])), ("eagle", EagleParams()),
         ("eagle2", EagleParams()), ("eagle2", EagleParams(total_tokens=16, depth=5, topk=4)),
         ("eagle2", EagleParams(total_tokens=40, depth=6, topk=5))]
TREE_IDS = ["mc_sim_7b_63", "small-choices", "eagle-default", "eagle2-default", "eagle2-16", "eagle2-40"]


# ---- a PyTorch EAGLE-1 head (the reference, and trainable)


class EagleHead(torch.nn.Module):
    """fc(concat(embed(t), f)) + bias, one Llama decoder layer without input norm (rotate-half RoPE, Hugging
    Face's q/k row order), no final norm, logits through `lm_head` (the base model's, or a reduced one)."""

    def __init__(self, state: dict[str, torch.Tensor], cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.names = {k.replace(".", "_"): k for k in state}  # ParameterDict keys cannot hold dots
        self.w = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v.float().clone())
                                         for k, v in state.items()})
        self.cfg = cfg
        self.register_buffer("base_embed", embed.float())
        self.register_buffer("lm_head", lm_head.float())

    def state(self) -> dict[str, torch.Tensor]:
        """The weights under their published names."""
        return {self.names[k]: v.detach().clone() for k, v in self.w.items()}

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.cfg, self.w
        n, h = len(tokens), c["hidden_size"]
        n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = h // n_head
        embed = w["embed_tokens_weight"] if "embed_tokens_weight" in w else self.base_embed
        x = torch.cat([embed[tokens], feats], -1) @ w["fc_weight"].T + w["fc_bias"]
        pos = torch.arange(n)
        q = rope((x @ w["layers_0_self_attn_q_proj_weight"].T).view(n, n_head, hd).transpose(0, 1), pos, THETA)
        k = rope((x @ w["layers_0_self_attn_k_proj_weight"].T).view(n, n_kv, hd).transpose(0, 1), pos, THETA)
        v = (x @ w["layers_0_self_attn_v_proj_weight"].T).view(n, n_kv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(n_head // n_kv, 0), v.repeat_interleave(n_head // n_kv, 0)
        s = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        s = s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
        o = (s.softmax(-1) @ v).transpose(0, 1).reshape(n, n_head * hd)
        x = x + o @ w["layers_0_self_attn_o_proj_weight"].T
        y = rms_norm(x, w["layers_0_post_attention_layernorm_weight"], c["rms_norm_eps"])
        ffn = torch.nn.functional.silu(y @ w["layers_0_mlp_gate_proj_weight"].T) * (y @ w["layers_0_mlp_up_proj_weight"].T)
        x = x + ffn @ w["layers_0_mlp_down_proj_weight"].T
        return x @ self.lm_head.T, x


# ---- fixtures


@pytest.fixture(scope="module")
def cfg(tiny_hf_dir: Path) -> dict:
    return json.loads((tiny_hf_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def base_weights(tiny_hf) -> tuple[torch.Tensor, torch.Tensor]:
    return tiny_hf.model.embed_tokens.weight.detach(), tiny_hf.lm_head.weight.detach()


def save_published(state: dict[str, torch.Tensor], cfg: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(state, folder / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="module")
def random_state(cfg: dict) -> dict[str, torch.Tensor]:
    return eagle_state(cfg, seed=3)


@pytest.fixture(scope="module")
def random_gguf(tiny_gguf: Path, cfg: dict, random_state: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_published(random_state, cfg, tmp_path_factory.mktemp("eagle_random"))
    out = folder / "tiny-eagle.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder, eagle_type="f32", progress=False)
    return out


def training_pairs(tiny_gguf: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy continuations of PROMPTS with the target's features (final-norm outputs)."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)
    seqs = []
    for prompt in PROMPTS + [np.random.default_rng(10 + s).integers(0, 256, 8).tolist() for s in range(5)]:
        toks = prompt + m.generate_tokens(prompt, 56, temp=0)
        m.kv_clear()
        m.eval(toks, logits=False)
        seqs.append((torch.tensor(toks), torch.tensor(m.norm())))
    return seqs


@pytest.fixture(scope="module")
def trained_gguf(tiny_gguf: Path, cfg: dict, random_state: dict, base_weights,
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained for a few seconds on the tiny model's own greedy text: it predicts those continuations,
    so steps accept long paths."""
    torch.manual_seed(0)
    head = EagleHead(random_state, cfg, *base_weights)
    opt = torch.optim.Adam(head.parameters(), 1e-2)
    seqs = training_pairs(tiny_gguf)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(60):
            loss = 0.0
            for t, f in seqs:  # EAGLE's loss: the next feature (smooth L1) and 0.1 x the next token
                logits, out = head(t[1:-1], f[:-2])
                loss = loss + torch.nn.functional.smooth_l1_loss(out, f[1:-1]) + \
                    0.1 * torch.nn.functional.cross_entropy(logits, t[2:])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    folder = save_published(head.state(), cfg, tmp_path_factory.mktemp("eagle_trained"))
    out = folder / "tiny-eagle-trained.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder, eagle_type="f32", progress=False)
    return out


@pytest.fixture(scope="module")
def reduced_head(tiny_gguf: Path, cfg: dict, random_state: dict, tmp_path_factory: pytest.TempPathFactory):
    """A head with its own lm_head over 96 of the 256 tokens (own layout: GGUF names, q/k in HF order),
    written as a draft head file; returns (path, state, draft vocabulary, its lm_head)."""
    folder = tmp_path_factory.mktemp("eagle_reduced")
    vocab = sorted(np.random.default_rng(1).choice(256, 96, replace=False).tolist())
    lm = 0.3 * torch.randn(96, cfg["hidden_size"], generator=torch.Generator().manual_seed(2))
    names = {"fc.weight": "eagle.fc.weight", "fc.bias": "eagle.fc.bias",
             "layers.0.self_attn.q_proj.weight": "eagle.attn_q.weight",
             "layers.0.self_attn.k_proj.weight": "eagle.attn_k.weight",
             "layers.0.self_attn.v_proj.weight": "eagle.attn_v.weight",
             "layers.0.self_attn.o_proj.weight": "eagle.attn_output.weight",
             "layers.0.post_attention_layernorm.weight": "eagle.ffn_norm.weight",
             "layers.0.mlp.gate_proj.weight": "eagle.ffn_gate.weight",
             "layers.0.mlp.up_proj.weight": "eagle.ffn_up.weight",
             "layers.0.mlp.down_proj.weight": "eagle.ffn_down.weight"}
    tensors = {gg: random_state[hf].contiguous() for hf, gg in names.items()}
    tensors["eagle.output.weight"] = lm
    save_file(tensors, folder / "head.safetensors")
    (folder / "head.json").write_text(json.dumps({"format": "specee-eagle", "eagle_version": 1, "draft_vocab": vocab}))
    out = folder / "head-reduced.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder / "head.safetensors", eagle_type="f32", draft_head_only=True,
               progress=False)
    state = {k: v for k, v in random_state.items() if k != "embed_tokens.weight"}
    return out, state, vocab, lm


def plain_and_spec(model: specee.Model, prompt: list[int], n: int, mode: str, eagle: EagleParams | None = None,
                   **kw) -> tuple[list[int], list[int]]:
    """Plain, then speculative greedy output; the second call keeps the prompt's cached prefix (prefix reuse must
    not change a token either)."""
    plain = model.generate_tokens(prompt, n, mode="plain", temp=0, **kw)
    spec = model.generate_tokens(prompt, n, mode=mode, temp=0, eagle=eagle or EagleParams(), **kw)
    return plain, spec


# ---- loading


def test_head_is_found_in_merged_and_separate_files(tiny_gguf: Path, random_gguf: Path, reduced_head) -> None:
    assert not specee.Model(tiny_gguf, n_ctx=64).has_eagle
    m = specee.Model(random_gguf, n_ctx=64)
    assert m.has_eagle and m._model.eagle_n_vocab == 256 and m._model.eagle_draft_vocab is None
    assert m.desc == specee.Model(tiny_gguf, n_ctx=64).desc  # the head is not counted in the model's size
    r = specee.Model(tiny_gguf, n_ctx=64, draft_head=reduced_head[0])
    assert r.has_eagle and r._model.eagle_n_vocab == 96 and r._model.eagle_draft_vocab == reduced_head[2]


def test_a_draft_head_file_merges_again(tiny_gguf: Path, reduced_head, tmp_path: Path) -> None:
    """merge --eagle HEAD.gguf (how the shipped head + predictors file is made): the same tensors and keys."""
    again = tmp_path / "again.gguf"
    merge_gguf(tiny_gguf, again, eagle=reduced_head[0], eagle_type="f32", draft_head_only=True, progress=False)
    a, b = gguf.GGUFReader(reduced_head[0]), gguf.GGUFReader(again)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and np.array_equal(np.asarray(x.data), np.asarray(y.data)), x.name
    vocab = b.fields["specee.eagle.draft_vocab"]
    assert [int(vocab.parts[i][0]) for i in vocab.data] == reduced_head[2]
    r = specee.Model(tiny_gguf, n_ctx=64, draft_head=again)
    assert r.has_eagle and r._model.eagle_draft_vocab == reduced_head[2]
    with pytest.raises(ValueError, match="no eagle"):
        merge_gguf(tiny_gguf, tmp_path / "x.gguf", eagle=tiny_gguf, draft_head_only=True, progress=False)


# ---- the draft graph against PyTorch


def head_inputs(cfg: dict, n: int = 20) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(7)
    feats = rng.standard_normal((n, cfg["hidden_size"])).astype(np.float32)
    return rng.integers(0, 256, n).tolist(), feats


def test_draft_head_matches_pytorch(random_gguf: Path, cfg: dict, random_state: dict, base_weights) -> None:
    m = specee.Model(random_gguf, n_ctx=N_CTX, n_threads=1)
    tokens, feats = head_inputs(cfg)
    logits, out = m.draft_head_eval(tokens, feats)
    with torch.no_grad():
        want_logits, want_out = EagleHead(random_state, cfg, *base_weights)(torch.tensor(tokens), torch.tensor(feats))
    assert np.abs(out - want_out.numpy()).max() < ATOL
    err = np.abs(logits - want_logits.numpy()).max()
    assert err < ATOL, f"max abs error {err:.3g} (logit std {want_logits.std():.2f})"


def test_reduced_draft_vocabulary_matches_pytorch(tiny_gguf: Path, reduced_head, cfg: dict, base_weights) -> None:
    path, state, vocab, lm = reduced_head
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, draft_head=path)
    tokens, feats = head_inputs(cfg)
    logits, _ = m.draft_head_eval(tokens, feats)
    with torch.no_grad():
        want, _ = EagleHead(state, cfg, base_weights[0], lm)(torch.tensor(tokens), torch.tensor(feats))
    assert logits.shape == (len(tokens), len(vocab))
    assert np.abs(logits - want.numpy()).max() < ATOL


def test_head_in_its_own_file_equals_the_merged_one(tiny_gguf: Path, random_gguf: Path, cfg: dict,
                                                    tmp_path: Path) -> None:
    draft_head = tmp_path / "head.gguf"
    merge_gguf(tiny_gguf, draft_head, eagle=random_gguf.parent, eagle_type="f32", draft_head_only=True, progress=False)
    assert draft_head.stat().st_size < tiny_gguf.stat().st_size
    tokens, feats = head_inputs(cfg)
    merged = specee.Model(random_gguf, n_ctx=64, n_threads=1).draft_head_eval(tokens, feats)
    separate = specee.Model(tiny_gguf, n_ctx=64, n_threads=1, draft_head=draft_head).draft_head_eval(tokens, feats)
    np.testing.assert_array_equal(merged[0], separate[0])


# ---- greedy: speculative output == plain output


@pytest.mark.parametrize("mode,eagle", TREES, ids=TREE_IDS)
@pytest.mark.parametrize("head", ["random", "trained"])
def test_greedy_speculative_equals_plain(mode: str, eagle: EagleParams, head: str,
                                         request: pytest.FixtureRequest) -> None:
    """Any head is lossless. With an F32 V cache a token's logits do not depend on the batch it is in, so the
    outputs are equal token for token (and the tree's K/V are kept in position order, in the first cells)."""
    path = request.getfixturevalue(f"{head}_gguf")
    m = specee.Model(path, n_ctx=N_CTX, n_threads=1, type_v="f32")
    steps = tokens = 0
    for prompt in PROMPTS:
        plain, spec = plain_and_spec(m, prompt, 48, mode, eagle)
        assert spec == plain
        st = m.last_stats  # each step returns its accepted drafts and one token of the target's own
        steps += st.n_steps
        tokens += sum(st.step_tokens)
        assert len(st.step_tokens) == st.n_steps
        assert sum(st.step_tokens) - st.n_steps <= st.n_accepted <= sum(st.step_tokens) - st.n_steps + 1  # (a cut)
    if head == "trained":  # the trained head predicts these continuations: long accepted paths (at most 2 per
        default = eagle == EagleParams()  # step with the default trees of one draft token)
        assert tokens / steps > (1.5 if default else 2.0)


DEFAULT_TREE_PROBE = """
import sys, specee
m = specee.Model(sys.argv[1], n_ctx=128, n_threads=1, kernels=sys.argv[2])
for mode in ("eagle", "eagle2"):
    m.generate_tokens([1, 2, 3, 4], 24, mode=mode, temp=0)
    st = m.last_stats
    print(mode, st.n_drafted, st.n_steps)
print("batched" if "default EAGLE tree: three draft tokens" in m.placement else "mapped")
"""


def test_default_tree_follows_the_cost_of_a_pass(trained_gguf: Path, tmp_path: Path) -> None:
    """Three draft tokens per step where the CPU's layer matrices are in ggml's repacked layout (a pass of 4 costs
    about what a pass of 2 does: Q4_0 with kernels off), one elsewhere: mapped (SPECEE_NO_REPACK) or in this
    runtime's eight-row layout (Q4_0 under the kernels, where a pass of 4 costs 1.2-1.7 single passes)."""
    from specee.convert.quantize import quantize_gguf

    q4 = tmp_path / "tiny-q4_0.gguf"
    quantize_gguf(trained_gguf, q4, "q4_0", progress=False)
    seen = set()
    for env, kernels in (({}, "off"), ({"SPECEE_NO_REPACK": "1"}, "off"), ({}, "auto")):
        out = subprocess.run([sys.executable, "-c", DEFAULT_TREE_PROBE, str(q4), kernels], capture_output=True,
                             text=True, env={**os.environ, **env}, timeout=120, check=True).stdout.split("\n")
        layout = out[2]
        seen.add(layout)
        for line in out[:2]:  # (steps near the token limit draft fewer)
            drafted, steps = map(int, line.split()[1:])
            assert steps > 0 and (2 * steps < drafted <= 3 * steps if layout == "batched" else drafted <= steps)
    assert "mapped" in seen
    if _core.kernels_auto_path() != "off":  # ggml repacks Q4_0 into its 8x8 layout with AVX2, as auto's path needs
        assert "batched" in seen


def test_greedy_with_cut_steps_and_repeat_penalty(trained_gguf: Path) -> None:
    """max_tokens ending inside a step, and a repetition penalty (judged with each accepted token in the
    history, as plain decoding does)."""
    m = specee.Model(trained_gguf, n_ctx=N_CTX, n_threads=1, type_v="f32")
    for n in (1, 2, 7, 23):
        assert m.generate_tokens(PROMPTS[0], n, temp=0, mode="eagle2") == m.generate_tokens(PROMPTS[0], n, temp=0)
    plain, spec = plain_and_spec(m, PROMPTS[1], 48, "eagle", repeat_penalty=1.5)
    assert spec == plain


def test_context_fills_up(trained_gguf: Path) -> None:
    """Near the end of the context the tree shrinks to the free cells; generation stops when it is full."""
    m = specee.Model(trained_gguf, n_ctx=40, n_threads=1, type_v="f32")
    plain, spec = plain_and_spec(m, PROMPTS[2], 100, "eagle", TREES[1][1])
    assert spec == plain and m.last_stats.stop_reason == "context"


@pytest.mark.parametrize("mode,eagle", [("eagle", EagleParams(choices="[[0], [1], [0, 0], [0, 0, 0]]")),
                                        ("eagle2", EagleParams(total_tokens=6, depth=3, topk=2))])
def test_replayed_acceptance_forces_the_tokens_per_step(random_gguf: Path, mode: str, eagle: EagleParams) -> None:
    """--eagle-replay: step i accepts replay[i % n] drafted tokens (at most the tree's depth) whatever the target
    says, with a random head whose drafts the target would reject; the KV cache stays one cell per token; the line
    that says the output is meaningless comes with it."""
    m = specee.Model(random_gguf, n_ctx=N_CTX, n_threads=1, type_v="f32")
    prompt, n = PROMPTS[0], 40
    eagle.replay = [2, 0, 5, 1]  # 5 is more than the depth (3): the whole best path
    out = m.generate_tokens(prompt, n, temp=0, mode=mode, ignore_eos=True, eagle=eagle)
    s = m.last_stats
    accepted = [2, 0, 3, 1]  # per step: the replay, capped by the depth; each step also emits the target's token
    want, left = [], n - 1  # the first token comes from the prompt's pass; the last step is cut to what is left
    while left > 0:
        want.append(min(accepted[len(want) % 4] + 1, left))
        left -= want[-1]
    assert len(out) == n and s.step_tokens == want, (s.step_tokens, want)
    assert s.n_accepted == sum(min(t - 1, accepted[i % 4]) for i, t in enumerate(want))  # a cut step drafts t - 1
    assert "output text is meaningless" in s.mode_why
    assert sum(kv_cell_pos(m, c) >= 0 for c in range(m.n_ctx)) == len(prompt) + n - 1
    m.kv_clear()
    eagle.replay = None
    assert m.generate_tokens(prompt, n, temp=0, mode=mode, ignore_eos=True, eagle=eagle) == \
        m.generate_tokens(prompt, n, temp=0, mode="plain", ignore_eos=True)
    assert m.last_stats.mode_why == ""
    with pytest.raises(ValueError, match="eagle.replay must be comma-separated counts"):
        EagleParams(replay=[1, -1])


# ---- sampling: the target's distribution


def target_probs(m: specee.Model, tokens: list[int], sampler: _core.Sampler) -> np.ndarray:
    m.kv_clear()
    return sampler.probs(m.eval(tokens)[-1]).astype(np.float64)


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token the target gives probability 0"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("mode", ["eagle", "eagle2"])
def test_sampling_keeps_the_target_distribution(mode: str, trained_gguf: Path) -> None:
    check_sampling_distribution(trained_gguf, mode)


def check_sampling_distribution(path: Path, mode: str, draft_head: Path | None = None) -> None:
    """The first two tokens of a speculative step over many seeds against the target's distributions (after
    the sampler's top-k and temperature): the first token's, and the second's given the most frequent first
    one. The trained head's q is sharper than p, so drafts are both accepted and rejected."""
    m = specee.Model(path, n_ctx=N_CTX, n_threads=1, type_v="f32", draft_head=draft_head)
    eagle = EagleParams(choices="[[0], [1], [2], [0, 0], [0, 1], [1, 0]]") if mode == "eagle" else \
        EagleParams(total_tokens=8, depth=3, topk=3)
    gen = _core.Generator(m._ctx, GenerateOptions(mode=mode, temp=0, eagle=eagle))
    prompt = PROMPTS[0]
    n_runs, top_k, temp = 2500, 6, 1.5
    first = []
    pairs: dict[int, list[int]] = {}
    for seed in range(n_runs):
        gen.set_params(GenerateOptions(mode=mode, temp=0, eagle=eagle))
        gen.start(prompt)
        root = gen.next(1)[0][0]  # the first token, greedy: the same every run
        gen.set_params(GenerateOptions(mode=mode, temp=temp, top_k=top_k, top_p=1.0, min_p=0.0, seed=seed,
                                       eagle=eagle))  # the step samples
        out = gen.next(2)[0]
        first.append(out[0])
        if len(out) == 2:
            pairs.setdefault(out[0], []).append(out[1])
    st = gen.stats()
    assert 0 < st["n_accepted"] < n_runs  # both outcomes happen

    sampler = _core.Sampler(temp, top_k, 1.0, 0.0, 1.0, 64, 0)
    p1 = target_probs(m, prompt + [root], sampler)
    stat, dof = chi2_stat(np.bincount(first, minlength=256), p1)
    assert stat < chi2_critical(dof), f"first token: chi2 {stat:.1f} with {dof} dof"

    x, seconds = max(pairs.items(), key=lambda kv: len(kv[1]))
    assert len(seconds) > 200
    p2 = target_probs(m, prompt + [root, x], sampler)
    stat, dof = chi2_stat(np.bincount(seconds, minlength=256), p2)
    assert stat < chi2_critical(dof), f"second token after {x}: chi2 {stat:.1f} with {dof} dof"


def test_sampler_probs_is_the_sampled_distribution() -> None:
    logits = np.array([2.0, 1.6, 1.2, 0.9, 0.5, 0.2, -0.1, -0.6], dtype=np.float32)
    p = _core.Sampler(0.7, 4, 1.0, 0.0, 1.0, 64, 0).probs(logits)
    e = np.exp((logits[:4] - logits[0]) / 0.7)
    np.testing.assert_allclose(p, np.concatenate([e / e.sum(), np.zeros(4)]), rtol=1e-6)
    greedy = _core.Sampler(0.0).probs(logits)
    assert greedy[0] == 1.0 and greedy.sum() == 1.0


# ---- bad input


@pytest.mark.parametrize("choices,msg", [
    ("[[0], [1]", "expected ',' or ']'"),
    ("[[0], [x]]", "expected a child rank"),
    ("[]", "no paths"),
    ("[[0], []]", "empty path"),
    ("[[0], [0, 0], [1, 0]]", "has no parent [1]"),
    ("[[0], [2]]", "needs its earlier sibling [1]"),
    ("[[0], [0]]", "listed twice"),
    ("mc_sim_7b_64", "expected '['"),
])
def test_bad_choices_are_refused(choices: str, msg: str, random_gguf: Path) -> None:
    with pytest.raises(specee.SpecEEError, match="bad EAGLE choices") as e:
        _core.eagle_check_choices(choices)
    assert msg in str(e.value)
    m = specee.Model(random_gguf, n_ctx=64)
    with pytest.raises(ValueError, match="bad EAGLE choices"):  # an option's value: checked as it is set
        m.generate_tokens(PROMPTS[0], 4, temp=0, mode="eagle", eagle=EagleParams(choices=choices))


def test_presets_and_sizes() -> None:
    assert _core.eagle_check_choices("mc_sim_7b_63") == 63
    assert _core.eagle_check_choices(" [[0],[1] ,[0,0]] ") == 3


def test_bad_settings_are_refused(tiny_gguf: Path, random_gguf: Path, tmp_path: Path) -> None:
    m = specee.Model(random_gguf, n_ctx=64)
    with pytest.raises(ValueError, match="mode must be one of"):
        m.generate_tokens(PROMPTS[0], 4, mode="eagle3")
    with pytest.raises(TypeError, match="eagle_topk"):
        m.generate_tokens(PROMPTS[0], 4, eagle_topk=4)
    with pytest.raises(specee.SpecEEError, match="set the EAGLE-2 tree, but the mode is plain"):
        m.generate_tokens(PROMPTS[0], 4, mode="plain", eagle=EagleParams(topk=4))
    with pytest.raises(specee.SpecEEError, match="set the EAGLE-1 tree, but the mode is eagle2"):
        m.generate_tokens(PROMPTS[0], 4, mode="eagle2", eagle=EagleParams(choices="[[0]]"))
    with pytest.raises(ValueError, match="topk must be >= 1"):
        m.generate_tokens(PROMPTS[0], 4, mode="eagle2", eagle=EagleParams(topk=0))
    with pytest.raises(specee.SpecEEError, match="more than fit in one verification batch"):
        specee.Model(random_gguf, n_ctx=64, n_batch=32).generate_tokens(PROMPTS[0], 4, mode="eagle",
                                                                        eagle=EagleParams(choices="mc_sim_7b_63"))
    with pytest.raises(specee.SpecEEError, match="needs an EAGLE draft head"):
        specee.Model(tiny_gguf, n_ctx=64).generate_tokens(PROMPTS[0], 4, mode="eagle2")
    with pytest.raises(specee.SpecEEError, match="holds no EAGLE head"):
        specee.Model(tiny_gguf, n_ctx=64, draft_head=tiny_gguf)
    with pytest.raises(ValueError, match="type_v"):
        specee.Model(tiny_gguf, type_v="q8_0")


def test_head_for_another_model_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "head128.gguf"
    w = gguf.GGUFWriter(bad, "llama")
    w.add_uint32("specee.eagle.version", 1)
    for name, shape in [("eagle.fc.weight", (128, 256)), ("eagle.fc.bias", (128,))]:
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(specee.SpecEEError, match="does not fit the model .*'eagle.fc.weight' has the wrong shape"):
        specee.Model(tiny_gguf, n_ctx=64, draft_head=bad)


def test_cli_refuses_bad_choices() -> None:
    r = subprocess.run([str(tool_path("llama-cli")), "--eagle-choices", "[[0], [2]]"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "needs its earlier sibling [1]" in r.stderr


# ---- SmolLM2 with a random head (slow)


@pytest.fixture(scope="module")
def smollm2_head(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
               vocab_size=49152)
    state = {k: v for k, v in eagle_state(cfg, seed=1).items() if k != "embed_tokens.weight"}
    folder = save_published(state, cfg, tmp_path_factory.mktemp("smollm2_head"))
    out = folder / "head.gguf"
    merge_gguf(smollm2_path, out, eagle=folder, draft_head_only=True, progress=False)
    return out


def cli_speculative_equals_plain(model: Path, head: Path) -> list[str]:
    """specee-cli with the draft head file in modes eagle and eagle2 prints plain decoding's text (greedy, 24 tokens);
    their stderr."""
    cli = str(tool_path("llama-cli"))
    common = ["-m", str(model), "-p", "The capital of France is", "-n", "24", "--temp", "0", "-no-cnv",
              "-c", "256", "-t", "2", "-ctv", "f32"]
    plain = subprocess.run([cli, *common, "--mode", "plain"], capture_output=True, text=True, timeout=300)
    errs = []
    for mode in ("eagle", "eagle2"):
        spec = subprocess.run([cli, *common, "--draft-head", str(head), "--mode", mode], capture_output=True,
                              text=True, timeout=300)
        assert spec.returncode == 0, spec.stderr
        assert spec.stdout == plain.stdout
        errs.append(spec.stderr)
    return errs


@pytest.mark.slow
def test_cli_speculative_equals_plain_on_smollm2(smollm2_path: Path, smollm2_head: Path) -> None:
    errs = cli_speculative_equals_plain(smollm2_path, smollm2_head)
    assert all("mean accepted tokens per step" in err for err in errs)


def test_one_v_cache_rule_for_every_model(tiny_gguf: Path, random_gguf: Path) -> None:
    # lossless by default: the V cache is F32 with or without a head (a token's logits do not depend on its batch)
    assert specee.Model(tiny_gguf, n_ctx=64).type_v == "f32"
    assert specee.Model(random_gguf, n_ctx=64).type_v == "f32"
    assert specee.Model(random_gguf, n_ctx=64, type_v="f16").type_v == "f16"


# ---- the MT-Bench / HumanEval harness (python -m specee.bench.spec)


def test_bench_spec_prompts_and_parsing() -> None:
    from specee.bench import spec as B

    mt = B.mt_bench_prompts("chatml")
    he = B.humaneval_prompts()
    assert len(mt) == 80 and len(he) == 164
    assert mt[0].text.startswith("<|im_start|>user\n") and mt[0].text.endswith("<|im_start|>assistant\n")
    assert he[0].name == "humaneval/HumanEval/0" and he[0].text.startswith("from typing import List")
    assert [p.name for p in B.pick(he, 4)] == [he[0].name, he[41].name, he[82].name, he[123].name]
    line = ("llama_perf_context_print:      speculative =    52 steps,   1.43 mean accepted tokens per step "
            "(22 of 832 draft tokens accepted; draft 123.00 ms, verify 456.50 ms)")
    m = B.SPEC_RE.search(line)
    assert m and m.group(1) == "52" and m.group(2) == "1.43" and m.group(6) == "456.50"


@pytest.mark.slow
def test_greedy_identity_on_mt_bench_and_humaneval_subset(capsys: pytest.CaptureFixture) -> None:
    # the shipped head on the default model, default settings (V cache chosen by the runtime); the full sets:
    # python -m specee.bench.spec identity
    from specee.bench import spec as B

    # one thread: ggml's spinning thread pool stalls when the machine is shared
    assert B.main(["identity", "--mt-bench", "3", "--humaneval", "3", "-n", "32", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "eagle: 6 of 6 identical" in out and "eagle2: 6 of 6 identical" in out and "V cache f32" in out
    assert "eagle mc_sim_7b_63: 6 of 6 identical" in out and "eagle2 16/5/4: 6 of 6 identical" in out


@pytest.mark.slow
def test_ignore_eos_with_and_without_speculation(smollm2_path: Path) -> None:
    """ignore_eos=True: a reply that ends early goes on to max_tokens; speculative greedy output still equals
    plain greedy output, and sampling with speculation never emits an end-of-generation token either."""
    from specee.bench.spec import default_head

    m = specee.Model(smollm2_path, n_ctx=256, n_threads=1, draft_head=default_head())
    msgs = [{"role": "user", "content": "Say hi."}]
    m.generate(msgs, 40, temp=0, mode="plain")
    assert m.last_stats.stop_reason == "eog" and m.last_stats.n_generated < 40
    plain = m.generate_tokens(m.tokenize("Once upon a time"), 40, temp=0, mode="plain", ignore_eos=True)
    assert len(plain) == 40 and not any(m.is_eog(t) for t in plain)
    text = m.generate(msgs, 40, temp=0, mode="plain", ignore_eos=True)
    assert m.last_stats.n_generated == 40 and m.last_stats.stop_reason == "length"
    assert m.generate(msgs, 40, temp=0, ignore_eos=True, mode="eagle2") == text
    m.generate(msgs, 40, temp=0.8, seed=5, ignore_eos=True, mode="eagle2")
    assert m.last_stats.n_generated == 40 and not any(m.is_eog(t) for t in m.last_stats.tokens)
