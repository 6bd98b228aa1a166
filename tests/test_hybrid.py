"""Mode ngram+eagle2, hybrid trees (csrc/decode/specee-hybrid.cpp): n-gram lookup's chain grafted onto the EAGLE-2
head's tree, verified in one pass; lookup alone (the head skipped) where it is confident. Greedy output equals plain
decoding's (tiny fixtures with a trained and a random head; SmolLM2 with its shipped head over the evaluation datasets'
prompts, slow); sampling keeps the target's distribution where the root has both the head's children and a lookup point
node (chi-square, as tests/test_eagle.py); the lookup-only steps are seen by their size (a head step verifies its whole
tree). The tiny random model does not copy its context, so lookup's drafts are accepted there only by sampling or by a
replayed acceptance; SmolLM2 copies repeated text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import specee
from specee import MODES, _core
from specee.bench.code_edit import code_edit_messages
from specee.generate import EagleParams, GenerateOptions, NgramParams
from specee.paths import default_draft_head_path
from test_eagle import (PROMPTS, base_weights, cfg, random_gguf, random_state,  # noqa: F401 (fixtures)
                        trained_gguf)
from conftest import CHEAP_PASSES, SERIAL_PASSES, force_pass_costs
from test_lookup import (assert_first_two_tokens_follow_the_target, assert_greedy_equals_plain_over_the_datasets,
                         find_prompt, repetitive)

N_CTX = 512
MODE = "ngram+eagle2"
TREE = EagleParams(total_tokens=6, depth=3, topk=3)  # a head step verifies 6 drafted tokens (and lookup's on top)


def test_one_mode_row() -> None:
    row = MODES[MODE]
    assert row.needs_head and row.tree and row.lossless and not row.exits and not row.shared_pass
    assert set(row.reads) == {"eagle2_tree", "ngram"}
    assert GenerateOptions(mode=MODE, eagle=TREE, ngram=NgramParams(draft_max=3)).mode == MODE


# prompts where eagle2 itself equals plain decoding on these fixtures: test_lookup.repetitive(4) puts the tiny trained
# model at a near tie (top-2 logits 6e-5 apart) where a pass of two tokens and a pass of one round differently
SEEDS = (0, 1, 2, 3, 5)


@pytest.mark.parametrize("head", ["trained", "random"])
@pytest.mark.parametrize("eagle,ngram", [
    (EagleParams(), NgramParams()),
    (TREE, NgramParams(adaptive=False)),
    (EagleParams(total_tokens=2, depth=2, topk=1), NgramParams(n_min=1, n_max=3, draft_max=5, branches=3,
                                                               adaptive=False)),
])
def test_greedy_output_equals_plain(head: str, eagle: EagleParams, ngram: NgramParams,
                                    request: pytest.FixtureRequest) -> None:
    # ngram_cache=0: each call on its own sequence (with the cache, the earlier calls of a prompt, plain ones too, are
    # drafted from, and the hybrid's steps are no longer eagle2's plus lookup's)
    m = specee.Model(request.getfixturevalue(f"{head}_gguf"), n_ctx=N_CTX, n_threads=1, ngram_cache=0)
    drafted = grafted = 0
    for prompt in [repetitive(m.n_vocab, s) for s in SEEDS] + PROMPTS:
        plain = m.generate_tokens(prompt, 40, temp=0, mode="plain", ignore_eos=True)
        m.generate_tokens(prompt, 40, temp=0, mode="eagle2", eagle=eagle, ignore_eos=True)
        head_only = m.last_stats.n_drafted
        out = m.generate_tokens(prompt, 40, temp=0, mode=MODE, eagle=eagle, ngram=ngram, ignore_eos=True)
        assert out == plain, prompt
        st = m.last_stats
        assert st.mode == MODE and st.n_decoded == len(out) - 1 and "ngram+eagle2: lookup's chain" in st.mode_why
        drafted += st.n_drafted
        grafted += st.n_drafted - head_only
    assert grafted > 0  # lookup's drafts were verified beside the head's


def step_sizes(gen: _core.Generator, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """The tokens of n steps after the first token, and each step's drafted tokens."""
    gen.start(prompt)
    out = list(gen.next(1)[0])
    sizes = []
    for _ in range(n):
        before = gen.stats()["n_drafted"]
        out += gen.next(64)[0]
        sizes.append(gen.stats()["n_drafted"] - before)
    return out, sizes


def test_no_match_verifies_the_heads_tree(trained_gguf: Path) -> None:
    """Without a match lookup adds nothing: each step verifies the head's tree of 6 as mode eagle2 does. (Confident
    lookup steps, which skip the head, need a model that copies its context: SmolLM2's test below.)"""
    m = specee.Model(trained_gguf, n_ctx=N_CTX, n_threads=1)
    ngram = NgramParams(n_min=2, n_max=2, draft_max=3, adaptive=False)
    gen = _core.Generator(m._ctx, GenerateOptions(mode=MODE, temp=0, eagle=TREE, ngram=ngram, ignore_eos=True))
    out, sizes = step_sizes(gen, list(range(1, 40)), 3)
    assert len(set(zip(out, out[1:]))) == len(out) - 1  # no pair of tokens came twice: no match
    assert sizes == [6, 6, 6] and m.kv_pos_max + 1 == m.kv_n_used


def test_sampling_keeps_the_target_distribution(trained_gguf: Path) -> None:
    """The root's children: the head's two draws from q and lookup's point node (when the head did not draw the same
    token), lookup's chain going on under either. The first two tokens of a step over many seeds against the target's
    distributions (after top-k and temperature)."""
    m = specee.Model(trained_gguf, n_ctx=N_CTX, n_threads=1, type_v="f32")
    n_runs, top_k, temp = 2500, 6, 1.5
    prompt, root = find_prompt(m, top_k)
    ngram = NgramParams(n_min=1, n_max=1, draft_max=2, adaptive=False)  # not confident at first: the head runs
    eagle = EagleParams(total_tokens=2, depth=1, topk=2)
    greedy = GenerateOptions(mode=MODE, temp=0, eagle=eagle, ngram=ngram)
    gen = _core.Generator(m._ctx, greedy)
    first, pairs = [], {}
    for seed in range(n_runs):
        gen.set_params(greedy)
        gen.start(prompt)
        assert gen.next(1)[0][0] == root  # the first token, greedy
        gen.set_params(GenerateOptions(mode=MODE, temp=temp, top_k=top_k, top_p=1.0, min_p=0.0, seed=seed,
                                       eagle=eagle, ngram=ngram))
        out = gen.next(4)[0]  # room for 4 tokens: 3 drafted (n_max - 1)
        first.append(out[0])
        if len(out) >= 2:
            pairs.setdefault(out[0], []).append(out[1])
    st = gen.stats()
    # every step verified the head's 2 and at least one point node (lookup's 2 tokens, one of them maybe the head's)
    assert st["n_drafted"] >= 3 * n_runs and 0 < st["n_accepted"] < st["n_drafted"]

    assert_first_two_tokens_follow_the_target(m, prompt, root, first, pairs, temp, top_k)


def test_settings_and_refusals(tiny_gguf: Path, random_gguf: Path) -> None:
    with pytest.raises(specee.SpecEEError, match="mode ngram\\+eagle2 needs an EAGLE draft head"):
        specee.Model(tiny_gguf, n_ctx=64).generate_tokens([1, 2, 3], 2, temp=0, mode=MODE)
    m = specee.Model(random_gguf, n_ctx=64)
    with pytest.raises(specee.SpecEEError, match="eagle choices set the EAGLE-1 tree, but the mode is ngram\\+eagle2"):
        m.generate_tokens([1, 2, 3], 2, temp=0, mode=MODE, eagle=EagleParams(choices="[[0]]"))
    with pytest.raises(specee.SpecEEError, match=r"n_min \(4\) must be at most n_max \(2\)"):
        m.generate_tokens([1, 2, 3], 2, temp=0, mode=MODE, ngram=NgramParams(n_min=4, n_max=2))


def test_slots_run_it_alone(random_gguf: Path) -> None:
    """The slots run a hybrid request alone (its passes are its own), as it runs outside them."""
    m = specee.Model(random_gguf, n_ctx=N_CTX, n_threads=1)
    prompts = [repetitive(m.n_vocab, s) for s in (0, 1)]
    plain = [m.generate_tokens(p, 16, temp=0, mode="plain", ignore_eos=True) for p in prompts]
    assert m.generate_batch(prompts, 16, temp=0, mode=MODE, ignore_eos=True) == plain


# ---- SmolLM2 with its shipped draft head (slow)


@pytest.mark.slow
@pytest.mark.parametrize("passes", ["cheap", "serial"])
def test_smollm2_copied_code(smollm2_path: Path, passes: str) -> None:
    """A code edit, which the model answers by copying the given function; the pass costs forced (the chain length and
    the confident steps follow from them, not from this machine's load). Where passes are cheap, lookup's chain pays
    on top of the head's tree, its drafts are accepted, and confident steps run without the head (fewer rows than its
    tree of 6); where every row costs a pass of its own, no chain pays for itself alone, so lookup is never confident
    and the head runs at every step (its tree of 6, and lookup's chain grafted where it beats the tree's own rate). The
    output is plain decoding's either way."""
    with specee.Model(smollm2_path, n_ctx=1024, n_threads=2, draft_head=default_draft_head_path()) as m:
        force_pass_costs(m, CHEAP_PASSES if passes == "cheap" else SERIAL_PASSES)
        tokens = m.prompt_tokens(code_edit_messages()[0])
        plain = m.generate_tokens(tokens, 48, temp=0, mode="plain")
        gen = _core.Generator(m._ctx, GenerateOptions(mode=MODE, temp=0, eagle=TREE, ngram=NgramParams(draft_max=4)))
        out, sizes = step_sizes(gen, tokens, 16)
        assert out == plain[:len(out)] and len(out) > 17
        if passes == "cheap":
            assert gen.stats()["n_accepted"] > 0 and any(0 < s <= 4 for s in sizes) and max(sizes) >= 6, sizes
        else:
            assert min(sizes) >= 6, sizes
        assert m.generate_tokens(tokens, 48, temp=0, mode=MODE) == plain
        if passes == "cheap":
            assert m.last_stats.n_steps < len(plain) - 1


@pytest.mark.slow
def test_smollm2_greedy_equals_plain_over_the_datasets(smollm2_path: Path) -> None:
    """Every dataset's first prompts in the chat template, 32 tokens: the hybrid's output is plain decoding's."""
    with specee.Model(smollm2_path, n_ctx=2048, n_threads=2, draft_head=default_draft_head_path()) as m:
        assert_greedy_equals_plain_over_the_datasets(m, MODE)
