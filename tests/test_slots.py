"""Several sequences in one KV cache and the parallel slots that batch them (csrc/serve/specee-slots.cpp): a token sees
only its own sequence, a batched run gives each sequence the tokens it gets alone, requests join and leave between
passes, removal frees cells, speculative requests stay what they are alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import specee
from specee import EagleParams, ExitParams
from test_early_exit import merged, predictors, with_head  # noqa: F401 (fixtures: a tiny model with exit predictors)
from test_eagle import cfg, random_gguf, random_state  # noqa: F401 (fixtures: a tiny model with an EAGLE-1 head)
from test_lookup import repetitive
from kv_probes import kv_batch_cells

N_CTX = 512
PROMPTS = [np.random.default_rng(20 + s).integers(0, 256, 4 + 3 * s).tolist() for s in range(4)]


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> specee.Model:
    return specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)


def alone(m: specee.Model, prompt: list[int], n: int, **options) -> list[int]:
    m.kv_clear()
    return m.generate_tokens(prompt, n, **options)


# ---- sequences in the KV cache


def test_a_batch_of_two_sequences_equals_each_alone(tiny: specee.Model) -> None:
    a, b = PROMPTS[1], PROMPTS[2]
    tiny.kv_clear()
    ref_a = tiny.eval(a, output="all")
    tiny.kv_clear()
    ref_b = tiny.eval(b, output="all")
    tiny.kv_clear()
    both = tiny.eval(a + b, output="all", seq_id=[1] * len(a) + [2] * len(b))  # positions continue per sequence
    np.testing.assert_allclose(both[: len(a)], ref_a, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(both[len(a):], ref_b, rtol=1e-4, atol=1e-4)
    assert tiny.kv_seq_pos_max(1) == len(a) - 1 and tiny.kv_seq_pos_max(2) == len(b) - 1
    assert tiny.kv_seq_pos_max(0) == -1
    # the next token of each sequence, in one batch, sees its own sequence only
    nxt = tiny.eval([5, 7], output="all", seq_id=[1, 2])
    tiny.kv_clear()
    tiny.eval(a)
    ref = tiny.eval([5])
    np.testing.assert_allclose(nxt[0], ref[0], rtol=1e-4, atol=1e-4)
    tiny.kv_clear()


def test_sequence_removal_frees_cells_and_copies_share_them(tiny: specee.Model) -> None:
    tiny.kv_clear()
    tiny.eval(PROMPTS[3], seq_id=[1] * len(PROMPTS[3]))
    n = len(PROMPTS[3])
    assert tiny.kv_n_used == n and tiny.kv_seq_n_cells(1) == n
    assert tiny.kv_seq_copy(1, 2, 0, 4) == 4  # a shared prefix: no new cells
    assert tiny.kv_n_used == n and tiny.kv_seq_n_cells(2) == 4
    assert tiny.kv_seq_remove(1) == n
    assert tiny.kv_n_used == 4  # the shared cells stay for sequence 2
    assert tiny.kv_seq_remove(2) == 4 and tiny.kv_n_used == 0
    with pytest.raises(specee.SpecEEError):
        tiny.kv_seq_copy(1, 64)
    with pytest.raises(specee.SpecEEError):
        tiny.eval([1, 2], seq_id=[0, 64])


def test_a_sequence_in_cells_out_of_order_gives_what_it_gives_alone(tiny: specee.Model) -> None:
    """Cells another sequence freed are taken by later positions: attention still sums the sequence's cells in
    position order, so the logits are those of the sequence alone, bit for bit."""
    a, b = PROMPTS[3], PROMPTS[2][:4]
    tiny.kv_clear()
    tiny.eval(a)
    want = tiny.eval(b, output="all")
    tiny.kv_clear()
    tiny.eval(PROMPTS[1], seq_id=[2] * len(PROMPTS[1]))  # the lowest cells
    tiny.eval(a, seq_id=[1] * len(a))
    fill = N_CTX - len(PROMPTS[1]) - len(a)
    tiny.eval([7] * fill, seq_id=[3] * fill)  # every cell above: no room for sequence 1 there
    tiny.kv_seq_remove(2)
    got = tiny.eval(b, output="all", seq_id=[1] * len(b))  # into the freed, lower cells
    assert max(kv_batch_cells(tiny)) < len(PROMPTS[1])
    np.testing.assert_array_equal(got, want)
    tiny.kv_clear()


def test_a_shared_prefix_gives_the_same_continuation(tiny: specee.Model) -> None:
    p = PROMPTS[3]
    tiny.kv_clear()
    tiny.eval(p[:6], seq_id=[1] * 6)
    tiny.kv_seq_copy(1, 2)
    out = tiny.eval(p[6:] + p[6:], output="all", seq_id=[1] * (len(p) - 6) + [2] * (len(p) - 6))
    k = len(p) - 6
    np.testing.assert_allclose(out[:k], out[k:], rtol=1e-5, atol=1e-5)
    tiny.kv_clear()


# ---- parallel slots


def test_batched_greedy_equals_alone(tiny: specee.Model) -> None:
    want = [alone(tiny, p, 20, temp=0, mode="plain") for p in PROMPTS]
    tiny.kv_clear()
    assert tiny.generate_batch(PROMPTS, 20, temp=0, mode="plain") == want


def test_slots_after_a_generation_that_filled_the_context(tiny: specee.Model) -> None:
    """A generation that ran to the end of the context leaves its cells to be reused as the next call's prefix; slots
    made afterwards share out every cell, so they take those back instead of overflowing, and give what each prompt
    gives alone."""
    tiny.kv_clear()
    filled = tiny.generate_tokens(PROMPTS[0], -1, temp=0, mode="plain", ignore_eos=True)
    assert len(PROMPTS[0]) + len(filled) >= N_CTX and tiny.kv_seq_pos_max(0) >= N_CTX - 2  # the last one unevaluated
    got = tiny.generate_batch(PROMPTS[1:3], 6, temp=0, mode="plain")
    assert got == [alone(tiny, p, 6, temp=0, mode="plain") for p in PROMPTS[1:3]]


def test_chunked_prefill_and_joining_between_passes(tiny: specee.Model) -> None:
    want = [alone(tiny, p, 12, temp=0, mode="plain") for p in PROMPTS]
    tiny.kv_clear()
    slots = tiny.slots(3, n_chunk=3)  # prompts join over several passes while others decode
    got: dict[int, list[int]] = {}
    first = slots.submit(PROMPTS[0], 12, temp=0, mode="plain")
    for _ in range(4):
        slots.step()
    second = slots.submit(PROMPTS[3], 12, temp=0, mode="plain")
    third = slots.submit(PROMPTS[1], 12, temp=0, mode="plain")
    assert slots.submit(PROMPTS[2], 12, temp=0) is None  # every slot holds a request
    ids = {first: 0, second: 3, third: 1}
    for _ in range(100):
        for slot, i in ids.items():
            got.setdefault(i, []).extend(slots.read(slot).tokens)
        if slots.step() == 0:
            break
    for slot, i in ids.items():
        res = slots.read(slot)
        got[i].extend(res.tokens)
        assert res.finish == "length"
        assert got[i] == want[i]
    for slot in ids:
        slots.release(slot)
    assert slots.n_busy == 0


def test_a_request_can_leave_mid_way_and_its_slot_is_reused(tiny: specee.Model) -> None:
    want = alone(tiny, PROMPTS[2], 10, temp=0, mode="plain")
    tiny.kv_clear()
    slots = tiny.slots(2)
    a = slots.submit(PROMPTS[0], 50, temp=0, mode="plain")
    b = slots.submit(PROMPTS[2], 10, temp=0, mode="plain")
    for _ in range(3):
        slots.step()
    slots.release(a)  # a client gone: the slot is free at once
    assert slots.n_busy == 1
    c = slots.submit(PROMPTS[1], 5, temp=0, mode="plain")
    assert c == a
    for _ in range(50):
        if slots.step() == 0:
            break
    res = slots.read(b)
    assert res.tokens == want and res.finish == "length"
    assert slots.read(c).finish == "length"
    assert slots.totals()["n_cancelled"] == 1


def test_request_output_is_read_in_order(tiny: specee.Model) -> None:
    want = alone(tiny, PROMPTS[2], 10, temp=0, mode="plain")
    tiny.kv_clear()
    slots = tiny.slots(2)
    a = slots.submit(PROMPTS[0], 50, temp=0, mode="plain")
    b = slots.submit(PROMPTS[2], 10, temp=0, mode="plain")
    got: list[int] = []
    for step in range(50):
        got += slots.read(b).tokens
        if step == 3:
            slots.release(a)
        if slots.step() == 0:
            break
    res = slots.read(b)
    assert got + res.tokens == want and res.finish == "length"


def test_a_follow_up_prefills_only_its_new_tokens(tiny: specee.Model) -> None:
    tiny.kv_clear()
    slots = tiny.slots(2)
    s = slots.submit(PROMPTS[3], 4, temp=0, mode="plain")
    for _ in range(20):
        if slots.step() == 0:
            break
    turn = PROMPTS[3] + slots.read(s).tokens
    slots.release(s)
    s2 = slots.submit(turn + [9, 10, 11], 4, temp=0, mode="plain")
    assert s2 == s  # the slot that holds the conversation
    for _ in range(20):
        if slots.step() == 0:
            break
    st = slots.stats(s2)
    assert st["n_reused"] >= len(PROMPTS[3])
    assert st["n_prompt"] == len(turn) + 3 - st["n_reused"]


def test_a_prefix_another_slot_holds_is_shared_not_evaluated(tiny: specee.Model) -> None:
    system = np.random.default_rng(5).integers(0, 256, 30).tolist()
    want = alone(tiny, system + [1, 2, 3], 6, temp=0, mode="plain")
    tiny.kv_clear()
    slots = tiny.slots(2)
    a = slots.submit(system + [9, 9], 4, temp=0, mode="plain")
    for _ in range(20):
        if slots.step() == 0:
            break
    used = tiny.kv_n_used
    b = slots.submit(system + [1, 2, 3], 6, temp=0, mode="plain")  # slot a still holds its request
    assert b != a
    for _ in range(20):
        if slots.step() == 0:
            break
    assert slots.read(b).tokens == want
    st = slots.stats(b)
    assert st["n_reused"] == len(system)  # all of it (at least the last two prompt tokens are evaluated)
    assert st["n_prompt"] == len(system) + 3 - st["n_reused"]
    assert tiny.kv_n_used < used + len(system)  # the prefix is stored once
    slots.release(a)
    slots.release(b)


def test_log_probabilities_per_token(tiny: specee.Model) -> None:
    """n_probs: each token's log-softmax of its step's logits and the n most likely, batched as alone; none asked,
    none given; a speculative mode refuses them."""
    prompt = PROMPTS[1]
    want = alone(tiny, prompt, 6, temp=0, mode="plain")
    tiny.kv_clear()
    logits = tiny.eval(prompt + want[:-1], output="all")[len(prompt) - 1:]
    tiny.kv_clear()
    slots = tiny.slots(2)
    a = slots.submit(prompt, 6, n_probs=3, temp=0, mode="plain")
    b = slots.submit(PROMPTS[2], 6, temp=0, mode="plain")  # beside it, without
    for _ in range(50):
        if slots.step() == 0:
            break
    ra, rb = slots.read(a), slots.read(b)
    assert ra.tokens == want and len(ra.logprobs) == 6 and rb.logprobs == []
    for tok, row, ref in zip(ra.tokens, ra.logprobs, logits):
        lsm = ref - (ref.max() + np.log(np.exp(ref - ref.max()).sum()))
        assert row[0][0] == tok == row[1][0] == int(np.argmax(ref)) and len(row) == 4  # greedy: the top one
        assert all(abs(lp - lsm[t]) < 1e-3 for t, lp in row)
        assert [t for t, _ in row[1:]] == [int(i) for i in np.argsort(-ref, kind="stable")[:3]]
    slots.release(a)
    slots.release(b)
    with pytest.raises(specee.SpecEEError, match="at most 100"):
        slots.submit(prompt, 2, n_probs=101, temp=0)


def test_post_sampling_probabilities(tiny: specee.Model) -> None:
    """set_post_sampling_probs (llama.cpp's post_sampling_probs): each token with the distribution it was drawn from,
    after top-k / top-p / min-p and temperature (recomputed here from its step's logits), fewer alternatives than
    asked where fewer were kept; a greedy draw's token certain and alone; another request beside them unchanged."""
    prompt, temp = PROMPTS[1], 0.7
    tiny.kv_clear()
    slots = tiny.slots(3)
    a = slots.submit(prompt, 6, n_probs=5, temp=temp, top_k=3, top_p=1.0, min_p=0.0, seed=5, mode="plain")
    slots.set_post_sampling_probs(a)
    g = slots.submit(PROMPTS[2], 4, n_probs=2, temp=0, mode="plain")
    slots.set_post_sampling_probs(g)
    m = slots.submit(PROMPTS[3], 4, n_probs=2, temp=0, mode="plain")  # the model's, as before
    for _ in range(50):
        if slots.step() == 0:
            break
    ra, rg, rm = slots.read(a), slots.read(g), slots.read(m)
    for s in (a, g, m):
        slots.release(s)
    tiny.kv_clear()
    logits = tiny.eval(prompt + ra.tokens[:-1], output="all")[len(prompt) - 1:]
    assert len(ra.tokens) == len(ra.logprobs) == 6
    for tok, row, ref in zip(ra.tokens, ra.logprobs, logits):
        kept = [int(i) for i in np.argsort(-ref, kind="stable")[:3]]
        z = ref[kept] / temp
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        assert [t for t, _ in row[1:]] == kept  # the 3 kept of the 5 asked, most likely first
        assert np.allclose(np.exp([lp for _, lp in row[1:]]), p, atol=1e-4)
        assert row[0][0] == tok and tok in kept and abs(np.exp(row[0][1]) - p[kept.index(tok)]) < 1e-4
    assert rg.tokens and all(row == [(t, 0.0), (t, 0.0)] for t, row in zip(rg.tokens, rg.logprobs))
    assert all(len(row) == 3 and row[0][1] < 0.0 for row in rm.logprobs)  # log-softmax: below 0, 2 alternatives
    with pytest.raises(specee.SpecEEError, match="no request on slot"):
        slots.set_post_sampling_probs(a)


def test_bad_requests(tiny: specee.Model) -> None:
    slots = tiny.slots(4)
    assert slots.n_ctx_slot == N_CTX // 4
    with pytest.raises(specee.SpecEEError, match="more than fit a slot"):
        slots.submit([1] * (N_CTX // 4), 4)
    with pytest.raises(specee.SpecEEError, match="empty prompt"):
        slots.submit([], 4)
    with pytest.raises(specee.SpecEEError, match="out of range"):
        slots.submit([1, 999], 4)
    with pytest.raises(specee.SpecEEError):
        tiny.slots(0)
    assert slots.n_busy == 0


def test_embeddings_between_passes_equal_the_model_s(tiny: specee.Model) -> None:
    slots = tiny.slots(2)
    toks = PROMPTS[3]
    vec = slots.embed(toks)
    tiny.kv_clear()
    tiny.eval(toks, logits=False)
    np.testing.assert_allclose(vec, tiny.norm().mean(axis=0), rtol=1e-4, atol=1e-5)


def test_model_embed_is_the_mean_final_norm_output_on_a_sequence_of_its_own(bpe_f32_gguf: Path) -> None:
    """Model.embed, one runtime call for a text or a list: the mean of the final-norm rows the text's own evaluation
    gives (in chunks of n_batch), to the bit, unit length when normalize; the model's cache is kept unless its cells
    must make room; an empty text and one longer than the context are refused."""
    m = specee.Model(bpe_f32_gguf, n_ctx=64, n_batch=8, n_threads=1)
    texts = ["Hello world, a text of more than eight tokens", "x"]
    want = []
    for text in texts:
        m.kv_clear()
        toks, rows = m.tokenize(text), []
        for i in range(0, len(toks), m.n_batch):
            m.eval(toks[i : i + m.n_batch], logits=False)
            rows.append(m.norm())
        want.append(np.concatenate(rows).mean(axis=0))
    assert len(m.tokenize(texts[0])) > m.n_batch
    np.testing.assert_array_equal(m.embed(texts[0], normalize=False), want[0])
    unit = np.stack([w / np.linalg.norm(w) for w in want])
    np.testing.assert_allclose(m.embed(texts[0]), unit[0], rtol=1e-6, atol=1e-7)
    both = m.embed(texts)
    assert both.shape == (2, m.n_embd) and both.dtype == np.float32
    np.testing.assert_allclose(both, unit, rtol=1e-6, atol=1e-7)

    m.kv_clear()
    m.generate("Hello", 4, temp=0, mode="plain")
    used = m.kv_n_used
    np.testing.assert_array_equal(m.embed(texts), both)  # beside the model's sequence: the same
    assert m.kv_n_used == used and m.kv_seq_n_cells(63) == 0
    m.generate("Hello world", 64, temp=0, mode="plain", ignore_eos=True)
    assert m.last_stats.stop_reason == "context"
    np.testing.assert_array_equal(m.embed(texts), both)  # a full cache: the model's sequence made room
    with pytest.raises(ValueError, match="cannot embed empty text"):
        m.embed("")
    with pytest.raises(specee.SpecEEError, match="text 1: the text has 200 tokens, more than fit the context of 64"):
        m.embed(["a", "x " * 100])


def test_eagle_and_early_exit_requests_equal_alone(random_gguf: Path, with_head: Path) -> None:  # noqa: F811
    m = specee.Model(random_gguf, n_ctx=N_CTX, n_threads=1)
    eagle = dict(temp=0, mode="eagle2", eagle=EagleParams(total_tokens=6, depth=3, topk=2))
    want_plain = [alone(m, p, 16, temp=0, mode="plain") for p in PROMPTS[:3]]
    want_eagle = [alone(m, p, 16, **eagle) for p in PROMPTS[:3]]
    assert want_eagle == want_plain  # lossless
    m.kv_clear()
    slots = m.slots(3)
    ids = [slots.submit(PROMPTS[0], 16, **eagle), slots.submit(PROMPTS[1], 16, temp=0, mode="plain"),
           slots.submit(PROMPTS[2], 16, **eagle)]
    assert slots.mode(ids[0]) == "eagle2" and slots.mode(ids[1]) == "plain"
    for _ in range(100):
        if slots.step() == 0:
            break
    assert [slots.read(s).tokens for s in ids] == want_plain
    assert slots.stats(ids[0])["n_drafted"] > 0

    e = specee.Model(with_head, n_ctx=N_CTX, n_threads=1)
    ee = dict(temp=0, mode="early-exit", exit=ExitParams(replay=[1, 3, 2]))
    want_exit = [alone(e, p, 12, **ee) for p in PROMPTS[:2]]
    want_plain = alone(e, PROMPTS[2], 12, temp=0, mode="plain")
    e.kv_clear()
    slots = e.slots(3)
    ids = [slots.submit(PROMPTS[0], 12, **ee), slots.submit(PROMPTS[2], 12, temp=0, mode="plain"),
           slots.submit(PROMPTS[1], 12, **ee)]
    for _ in range(100):
        if slots.step() == 0:
            break
    assert slots.read(ids[0]).tokens == want_exit[0]
    assert slots.read(ids[1]).tokens == want_plain
    assert slots.read(ids[2]).tokens == want_exit[1]


def test_eagle_trees_of_several_requests_share_one_pass(random_gguf: Path) -> None:  # noqa: F811
    """EAGLE requests' trees are blocks of the shared pass (each with its own tree mask) beside plain tokens and a
    prompt being prefilled: every request gets what it gets alone (greedy EAGLE-1 and EAGLE-2 trees, and EAGLE-2
    sampling with a fixed seed: the same draws in the same order), and the passes are shared, not one per request."""
    m = specee.Model(random_gguf, n_ctx=N_CTX, n_threads=1)
    requests = [(PROMPTS[0], dict(temp=0, mode="eagle2", eagle=EagleParams(total_tokens=6, depth=3, topk=2))),
                (PROMPTS[1], dict(temp=0, mode="eagle", eagle=EagleParams(choices="[[0], [1], [0, 0]]"))),
                (PROMPTS[2], dict(temp=0.9, seed=11, mode="eagle2",
                                  eagle=EagleParams(total_tokens=4, depth=2, topk=2))),
                (PROMPTS[3], dict(temp=0, mode="plain"))]
    want = [alone(m, p, 20, **o) for p, o in requests]
    long_prompt = np.random.default_rng(9).integers(0, 256, 60).tolist()
    want_late = alone(m, long_prompt, 8, temp=0, mode="plain")
    m.kv_clear()
    slots = m.slots(5, n_chunk=16)  # the late prompt takes several passes beside the trees
    ids = [slots.submit(p, 20, **o) for p, o in requests]
    late = None
    for step in range(200):
        if step == 2:
            late = slots.submit(long_prompt, 8, temp=0, mode="plain")
        if slots.step() == 0 and late is not None:
            break
    assert [slots.read(i).tokens for i in ids] == want
    assert slots.read(late).tokens == want_late
    steps = sum(slots.stats(i)["n_steps"] for i in ids[:3])
    assert all(slots.stats(i)["n_drafted"] > 0 for i in ids[:3])
    assert slots.totals()["n_passes"] < steps  # three requests' trees, fewer passes than their steps


@pytest.mark.slow
def test_smollm2_batched_greedy_equals_alone(smollm2_path: Path) -> None:
    m = specee.Model(smollm2_path, n_ctx=2048, n_threads=1)
    prompts = [m.tokenize(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time",
                                       "List three colors:")]
    want = [alone(m, p, 24, temp=0, mode="plain") for p in prompts]
    m.kv_clear()
    assert m.generate_batch(prompts, 24, temp=0, mode="plain") == want


def test_ngram_drafts_of_several_requests_share_one_pass(tiny: specee.Model) -> None:
    """N-gram lookup requests' drafts (a chain and branches) are blocks of the shared pass beside plain tokens, an
    EAGLE-less auto request and a prompt being prefilled, their prefill in the shared pass too: each gets what it
    gets alone, which is plain decoding's (greedy), and the passes are shared. adaptive=False: the drafts do not
    depend on this machine's pass cost (the tiny F32 model's near-ties between a 1-row and a many-row pass: these
    prompts were checked to have none, as test_lookup's greedy test's)."""
    from specee import NgramParams

    ngram = [NgramParams(adaptive=False), NgramParams(n_min=1, n_max=3, draft_max=5, branches=3, adaptive=False),
             NgramParams(n_min=1, n_max=1, draft_max=1, adaptive=False)]
    requests = [(repetitive(tiny.n_vocab, s), dict(temp=0, mode="ngram", ngram=ngram[s], ignore_eos=True))
                for s in range(3)]
    requests.append((PROMPTS[3], dict(temp=0, mode="plain", ignore_eos=True)))
    want = [alone(tiny, p, 24, **o) for p, o in requests]
    assert want[:3] == [alone(tiny, p, 24, temp=0, mode="plain", ignore_eos=True) for p, _ in requests[:3]]
    long_prompt = repetitive(tiny.n_vocab, 5, 60)
    want_late = alone(tiny, long_prompt, 8, temp=0, mode="plain", ignore_eos=True)
    tiny.kv_clear()
    slots = tiny.slots(5, n_chunk=16)
    ids = [slots.submit(p, 24, **o) for p, o in requests]
    late = None
    for step in range(300):
        if step == 3:
            late = slots.submit(long_prompt, 8, temp=0, mode="ngram", ignore_eos=True, ngram=ngram[0])
        if slots.step() == 0 and late is not None:
            break
    assert [slots.read(i).tokens for i in ids] == want
    assert slots.read(late).tokens == want_late
    assert [slots.mode(i) for i in ids] == ["ngram"] * 3 + ["plain"]
    steps = sum(slots.stats(i)["n_steps"] for i in ids + [late])
    assert sum(slots.stats(i)["n_drafted"] for i in ids[:3]) > 0
    assert slots.totals()["n_passes"] < steps  # five requests' steps (and two prefills), fewer passes: shared


def test_auto_in_slots_may_pick_ngram(tiny: specee.Model) -> None:
    """A model without a draft head: auto resolves to ngram, and its steps run in the shared pass (no auto->plain rule
    any longer); its output is plain decoding's."""
    prompt = repetitive(tiny.n_vocab, 1)
    want = alone(tiny, prompt, 16, temp=0, mode="plain", ignore_eos=True)
    tiny.kv_clear()
    slots = tiny.slots(2)
    a = slots.submit(prompt, 16, temp=0, ignore_eos=True)
    b = slots.submit(PROMPTS[2], 16, temp=0, mode="plain", ignore_eos=True)
    for _ in range(100):
        if slots.step() == 0:
            break
    assert slots.mode(a) == "ngram"
    assert slots.read(a).tokens == want
    assert len(slots.read(b).tokens) == 16
    slots.release(a)
    slots.release(b)
    c = slots.submit(prompt, 4, n_probs=2, temp=0, ignore_eos=True)  # log-probabilities: auto decodes plainly
    for _ in range(100):
        if slots.step() == 0:
            break
    assert slots.mode(c) == "plain" and slots.read(c).tokens == want[:4]


@pytest.mark.slow
def test_smollm2_batched_ngram_equals_alone(smollm2_path: Path) -> None:
    """SmolLM2: n-gram lookup requests batched in the shared pass (drafting regardless of the pass cost) give what
    they give alone, which is plain decoding's."""
    from specee import NgramParams

    m = specee.Model(smollm2_path, n_ctx=2048, n_threads=1)
    texts = ("The cat sat on the mat. The cat sat on the mat. The cat sat on the",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
             "Once upon a time", "one two three four one two three four one two")
    prompts = [m.tokenize(t) for t in texts]
    opts = dict(temp=0, mode="ngram", ngram=NgramParams(adaptive=False))
    want = [alone(m, p, 24, temp=0, mode="plain") for p in prompts]
    assert [alone(m, p, 24, **opts) for p in prompts] == want
    m.kv_clear()
    slots = m.slots(4)
    ids = [slots.submit(p, 24, **opts) for p in prompts]
    for _ in range(200):
        if slots.step() == 0:
            break
    assert [slots.read(i).tokens for i in ids] == want
    assert sum(slots.stats(i)["n_accepted"] for i in ids) > 0
    assert slots.totals()["n_passes"] < sum(slots.stats(i)["n_steps"] for i in ids)
