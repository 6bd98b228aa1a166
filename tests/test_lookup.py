"""Mode ngram (csrc/decode/specee-lookup.cpp): drafts copied from earlier in the sequence, verified as an EAGLE tree.
Greedy output equals plain decoding's; sampling keeps the target's distribution (chi-square, as tests/test_eagle.py);
the CLI takes it under llama.cpp's --spec-type; the slots run it; SmolLM2 over the evaluation datasets' prompts is
slow."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import specee
from specee import _core
from specee._tools import tool_path
from specee.generate import GenerateOptions, NgramParams
from conftest import CHEAP_PASSES, SERIAL_PASSES, force_pass_costs
from test_convert_cli import bpe_dir, bpe_gguf  # noqa: F401 (fixtures: a tiny Llama with a BPE tokenizer, its GGUF)
from test_eagle import chi2_stat, target_probs
from test_sampling import chi2_critical

N_CTX = 512
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specee-bench"


def repetitive(n_vocab: int, seed: int, n: int = 48) -> list[int]:
    """A prompt that repeats a few phrases, so that lookups find matches."""
    rng = np.random.default_rng(seed)
    phrases = [list(rng.integers(1, n_vocab, size=int(rng.integers(3, 7)))) for _ in range(3)]
    out: list[int] = []
    while len(out) < n:
        out += phrases[int(rng.integers(0, 3))]
    return [int(t) for t in out[:n]]


def assert_first_two_tokens_follow_the_target(m: specee.Model, prompt: list[int], root: int, first: list[int],
                                               pairs: dict[int, list[int]], temp: float, top_k: int) -> None:
    """Chi-square: the first tokens drawn after root, and the second after the most frequent first, against the
    target's own distributions under the same sampler."""
    sampler = _core.Sampler(temp, top_k, 1.0, 0.0, 1.0, 64, 0)
    p1 = target_probs(m, prompt + [root], sampler)
    stat, dof = chi2_stat(np.bincount(first, minlength=m.n_vocab), p1)
    assert stat < chi2_critical(dof), f"first token: chi2 {stat:.1f} with {dof} dof"
    x, seconds = max(pairs.items(), key=lambda kv: len(kv[1]))
    assert len(seconds) > 200
    p2 = target_probs(m, prompt + [root, x], sampler)
    stat, dof = chi2_stat(np.bincount(seconds, minlength=m.n_vocab), p2)
    assert stat < chi2_critical(dof), f"second token after {x}: chi2 {stat:.1f} with {dof} dof"


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> specee.Model:
    # ngram_cache=0: these tests are about the sequence's own lookups, each call alone (the cross-request cache has
    # tests of its own below). With the cache on, the module's earlier calls would add drafts where seed 4 of
    # test_greedy_output_equals_plain has a near-tie (top two logits 5.8e-5 apart at its 20th token): the tiny F32
    # model's 1-row and many-row passes differ by ~1e-5, enough to flip it; SmolLM2's tests below are the real check.
    return specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, ngram_cache=0)


# adaptive=False: the drafts do not depend on this machine's pass cost
@pytest.mark.parametrize("ngram", [NgramParams(adaptive=False), NgramParams(n_min=1, n_max=3, draft_max=5, branches=3,
                                                                            adaptive=False),
                                   NgramParams(n_min=1, n_max=1, draft_max=1, adaptive=False)])
def test_greedy_output_equals_plain(tiny: specee.Model, ngram: NgramParams) -> None:
    drafted = 0
    for seed in range(6):
        prompt = repetitive(tiny.n_vocab, seed)
        plain = tiny.generate_tokens(prompt, 40, temp=0, mode="plain", ignore_eos=True)
        out = tiny.generate_tokens(prompt, 40, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
        assert out == plain, seed
        st = tiny.last_stats
        assert st.mode == "ngram" and st.n_decoded == len(out) - 1
        drafted += st.n_drafted
    # drafts were verified (a random model rarely continues as before: its drafts are mostly rejected; the accepted
    # path is SmolLM2's test below and the sampling test's)
    assert drafted > 0


def test_no_match_is_a_plain_step(tiny: specee.Model) -> None:
    prompt = list(range(1, 30))  # no token repeats: nothing to look up until the output repeats something
    out = tiny.generate_tokens(prompt, 2, temp=0, mode="ngram", ngram=NgramParams(n_min=2), ignore_eos=True)
    assert out == tiny.generate_tokens(prompt, 2, temp=0, mode="plain", ignore_eos=True)
    tiny.generate_tokens(prompt, 2, temp=0, mode="ngram", ngram=NgramParams(n_min=2, adaptive=False), ignore_eos=True)
    assert tiny.last_stats.n_drafted == 0 and tiny.last_stats.n_steps == 1


def test_ngram_settings_need_mode_ngram(tiny: specee.Model) -> None:
    with pytest.raises(specee.SpecEEError, match="n-gram settings are given, but the mode is plain"):
        tiny.generate_tokens([1, 2, 3], 2, temp=0, mode="plain", ngram=NgramParams(draft_max=3))
    with pytest.raises(ValueError, match="ngram.n_min must be"):
        NgramParams(n_min=0)
    with pytest.raises(specee.SpecEEError, match=r"n_min \(4\) must be at most n_max \(2\)"):
        tiny.generate_tokens([1, 2, 3], 2, temp=0, mode="ngram", ngram=NgramParams(n_min=4, n_max=2))
    # each value is checked as it is set, the pair by the generator: n_min above the default n_max is fine
    GenerateOptions(mode="ngram", ngram=NgramParams(n_min=8, n_max=16))


def find_prompt(m: specee.Model, top_k: int) -> tuple[list[int], int]:
    """A prompt whose greedy next token r stood earlier in it, followed by one of the target's top_k tokens after r:
    mode ngram (n_min 1) then drafts a token the target may accept or reject. Made by putting [r, t] before a random
    prompt and keeping it where r stays the greedy token."""
    rng = np.random.default_rng(5)
    for _ in range(500):
        base = [int(x) for x in rng.integers(1, m.n_vocab, size=20)]
        m.kv_clear()
        r = int(np.argmax(m.eval(base)[-1]))
        m.kv_clear()
        t = int(np.argsort(m.eval(base + [r])[-1])[::-1][1])  # the second most likely: both outcomes happen
        prompt = [r, t] + base
        if r in base:
            continue  # r's only earlier place is the one made here
        m.kv_clear()
        if int(np.argmax(m.eval(prompt)[-1])) != r:
            continue
        m.kv_clear()
        if t in np.argsort(m.eval(prompt + [r])[-1])[::-1][:top_k]:
            return prompt, r
    raise AssertionError("no prompt found")


def test_sampling_keeps_the_target_distribution(tiny_gguf: Path) -> None:
    """The first two tokens of a lookup step over many seeds against the target's distributions (after top-k and
    temperature), as the EAGLE test does: a draft is a point mass, accepted with the target's probability."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)
    n_runs, top_k, temp = 2500, 6, 1.5
    prompt, root = find_prompt(m, top_k)
    ngram = NgramParams(n_min=1, n_max=1, draft_max=2, adaptive=False)
    gen = _core.Generator(m._ctx, GenerateOptions(mode="ngram", temp=0, ngram=ngram))
    first, pairs = [], {}
    for seed in range(n_runs):
        gen.set_params(GenerateOptions(mode="ngram", temp=0, ngram=ngram))
        gen.start(prompt)
        assert gen.next(1)[0][0] == root  # the first token, greedy
        gen.set_params(GenerateOptions(mode="ngram", temp=temp, top_k=top_k, top_p=1.0, min_p=0.0, seed=seed,
                                       ngram=ngram))
        out = gen.next(2)[0]
        first.append(out[0])
        if len(out) == 2:
            pairs.setdefault(out[0], []).append(out[1])
    st = gen.stats()
    assert 0 < st["n_accepted"] < st["n_drafted"]  # both outcomes happen

    assert_first_two_tokens_follow_the_target(m, prompt, root, first, pairs, temp, top_k)


def test_slots_run_ngram_requests_as_alone(tiny: specee.Model) -> None:
    prompts = [repetitive(tiny.n_vocab, s) for s in range(3)]
    alone = [tiny.generate_tokens(p, 24, temp=0, mode="ngram", ignore_eos=True) for p in prompts]
    batched = tiny.generate_batch(prompts, 24, temp=0, mode="ngram", ignore_eos=True)
    assert batched == alone == [tiny.generate_tokens(p, 24, temp=0, mode="plain", ignore_eos=True) for p in prompts]



def test_cli_spec_type(bpe_gguf: Path) -> None:
    cli = str(tool_path("llama-cli"))
    common = ["-m", str(bpe_gguf), "-p", "a b c a b c a b", "-n", "24", "--temp", "0", "-no-cnv", "--ignore-eos",
              "-t", "1"]
    plain = subprocess.run([cli, *common, "--mode", "plain"], capture_output=True)
    for extra in (["--mode", "ngram"], ["--spec-type", "ngram-simple", "--spec-ngram-mod-n-max", "4"],
                  ["--mode", "ngram", "--ngram-cache", "0"]):
        res = subprocess.run([cli, *common, *extra], capture_output=True, text=True, errors="replace")
        assert res.returncode == 0 and res.stdout == plain.stdout.decode(errors="replace"), res.stderr
        assert "speculative =" in res.stderr
    bad = subprocess.run([cli, *common, "--spec-type", "draft-eagle3"], capture_output=True, text=True)
    assert bad.returncode == 1 and "invalid value for --spec-type" in bad.stderr
    bad = subprocess.run([cli, *common, "--ngram-cache", "-5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "ngram-cache" in bad.stderr


def dataset_prompts(name: str, n: int) -> list[str]:
    path = DATA / name / "question.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared beside the repository)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def assert_greedy_equals_plain_over_the_datasets(m: specee.Model, mode: str) -> None:
    """Every dataset's first two prompts in the chat template, 32 tokens: `mode`'s output is plain decoding's, and it
    drafted somewhere."""
    drafted = 0
    for name in ("alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum"):
        for text in dataset_prompts(name, 2):
            tokens = m.prompt_tokens([{"role": "user", "content": text}])
            if len(tokens) > 1900:
                continue
            plain = m.generate_tokens(tokens, 32, temp=0, mode="plain")
            assert m.generate_tokens(tokens, 32, temp=0, mode=mode) == plain, (name, text[:60])
            drafted += m.last_stats.n_drafted
    assert drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("passes", ["cheap", "serial"])
def test_smollm2_drafts_are_accepted_on_repeated_text(smollm2_path: Path, passes: str) -> None:
    """Adaptive lookup drafts as far as the (forced) pass costs say it pays: on repeated text with cheap passes its
    drafts are accepted; where every row costs a pass of its own, no draft pays and every step is a plain one. The
    output is plain decoding's either way."""
    with specee.Model(smollm2_path, n_ctx=512, n_threads=2) as m:
        force_pass_costs(m, CHEAP_PASSES if passes == "cheap" else SERIAL_PASSES)
        tokens = m.tokenize("The cat sat on the mat. The cat sat on the mat. The cat sat on the")
        plain = m.generate_tokens(tokens, 24, temp=0, mode="plain")
        assert m.generate_tokens(tokens, 24, temp=0, mode="ngram") == plain
        st = m.last_stats
        if passes == "cheap":
            assert st.n_accepted > 0 and st.n_steps < len(plain) - 1 and max(st.step_tokens) > 1
        else:
            assert st.n_drafted == 0 and st.n_steps == len(plain) - 1
        assert "ngram: a pass of 2" in st.mode_why and "given for this context" in st.mode_why


@pytest.mark.slow
def test_smollm2_greedy_equals_plain_over_the_datasets(smollm2_path: Path) -> None:
    """Every dataset's first prompts in the chat template, 32 tokens: mode ngram's output is plain decoding's."""
    with specee.Model(smollm2_path, n_ctx=2048, n_threads=2) as m:
        assert_greedy_equals_plain_over_the_datasets(m, "ngram")


# ---- the cross-request n-gram cache (csrc/base/specee-ngram-cache.cpp)


def test_a_repeated_request_drafts_from_the_cache_and_equals_plain(tiny_gguf: Path) -> None:
    """The same prompt twice in one Model: the second call's lookups find the first call's prompt and output in the
    context's cache (a random prompt has no n-gram of its own to match), its drafts are accepted, and its output is
    plain decoding's. adaptive=False: the drafts do not depend on this machine's pass cost."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)
    ngram = NgramParams(adaptive=False)
    drafted = accepted = 0
    for seed in range(3):
        prompt = [int(t) for t in np.random.default_rng(100 + seed).permutation(m.n_vocab)[:24]]  # no repeats
        plain = m.generate_tokens(prompt, 24, temp=0, mode="plain", ignore_eos=True)
        first = m.generate_tokens(prompt, 24, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
        assert m.last_stats.n_cache_drafted <= m.last_stats.n_drafted
        second = m.generate_tokens(prompt, 24, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
        st = m.last_stats
        assert first == second == plain, seed
        assert st.n_cache_drafted > 0 and st.n_cache_accepted <= st.n_cache_drafted
        assert st.n_cache_accepted <= st.n_accepted and st.n_cache_drafted <= st.n_drafted
        drafted += st.n_cache_drafted
        accepted += st.n_cache_accepted
    # the earlier output, copied: most of it is accepted (a rejection is a near-tie of the tiny F32 model between a
    # 1-row and a many-row pass, or a branch of the same n-gram's other continuation)
    assert accepted > drafted // 2
    info = m.ngram_cache_info()
    assert info["capacity"] == 65536 and 0 < info["n_tokens"] <= info["capacity"] and info["n_docs"] >= 3


def test_the_cache_stays_bounded_under_many_requests(tiny_gguf: Path) -> None:
    """Many requests through a small cache: the tokens kept never pass the option, the index stays within 4 entries a
    token, the oldest requests go first, and lookups keep giving plain decoding's output."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, ngram_cache=200)
    rng = np.random.default_rng(7)
    ngram = NgramParams(n_min=1, n_max=4, adaptive=False)
    sizes = []
    for k in range(40):
        prompt = [int(t) for t in rng.integers(1, m.n_vocab, int(rng.integers(10, 60)))]
        out = m.generate_tokens(prompt, 12, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
        if k % 8 == 0:
            assert out == m.generate_tokens(prompt, 12, temp=0, mode="plain", ignore_eos=True)
        info = m.ngram_cache_info()
        assert info["n_tokens"] <= 200 and info["n_entries"] <= 4 * info["n_tokens"]
        sizes.append(info["n_tokens"])
    info = m.ngram_cache_info()
    assert info["n_added"] >= 39 and info["n_docs"] < info["n_added"]  # evicted
    assert max(sizes) > 100  # it filled up
    # a request longer than the whole cache keeps its last tokens
    m.generate_tokens(list(range(1, 250)), 4, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
    m.generate_tokens([1, 2, 3], 2, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)  # commits the long one
    assert m.ngram_cache_info()["n_tokens"] <= 200
    m.ngram_cache_clear()
    assert m.ngram_cache_info()["n_tokens"] == 0
    m.generate_tokens([4, 5, 6], 2, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
    assert m.ngram_cache_info()["n_tokens"] == 0  # the call before the clear is not added after it
    with pytest.raises(ValueError, match="ngram_cache"):
        specee.Model(tiny_gguf, n_ctx=64, ngram_cache=-1)


def test_cache_off_gives_the_old_behaviour(tiny_gguf: Path) -> None:
    """ngram_cache=0: a repeated request drafts exactly what its first run drafted (its own sequence only), and no
    draft is counted as the cache's."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, ngram_cache=0)
    ngram = NgramParams(adaptive=False)
    for seed in range(3):
        prompt = repetitive(m.n_vocab, seed)
        runs = []
        for _ in range(2):
            out = m.generate_tokens(prompt, 24, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
            st = m.last_stats
            runs.append((out, st.n_drafted, st.n_accepted, st.n_steps))
            assert st.n_cache_drafted == 0 and st.n_cache_accepted == 0
        assert runs[0] == runs[1]
    assert m.ngram_cache_info() == dict(capacity=0, n_tokens=0, n_entries=0, n_docs=0, n_added=0)


def test_slots_share_the_cache_across_requests(tiny_gguf: Path) -> None:
    """On the slots (the server's path), a finished lookup request's tokens go to the context's cache, and later
    requests with the same prompt on either slot draft them, their output still plain decoding's."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)
    prompt = [int(t) for t in np.random.default_rng(3).permutation(m.n_vocab)[:20]]
    want = m.generate_tokens(prompt, 20, temp=0, mode="plain", ignore_eos=True)
    m.ngram_cache_clear()
    m.kv_clear()
    slots = m.slots(2)
    opts = dict(temp=0, mode="ngram", ngram=NgramParams(adaptive=False), ignore_eos=True)
    a = slots.submit(prompt, 20, **opts)
    for _ in range(100):
        if slots.step() == 0:
            break
    assert slots.read(a).tokens == want and slots.stats(a)["n_cache_drafted"] == 0
    assert m.ngram_cache_info()["n_docs"] == 1  # committed where the request ended
    slots.release(a)
    # the same prompt twice more, at once: one on a's slot (its cached prefix), one on the other slot (prefilled)
    ids = [slots.submit(prompt, 20, **opts), slots.submit(prompt, 20, **opts)]
    assert sorted(ids) == [0, 1]
    for _ in range(100):
        if slots.step() == 0:
            break
    for i in ids:
        assert slots.read(i).tokens == want
        assert slots.stats(i)["n_cache_drafted"] > 0 and slots.stats(i)["n_cache_accepted"] > 0


def test_plain_requests_feed_the_cache(tiny_gguf: Path) -> None:
    """Every request joins the cache when it ends, whatever its mode: a plain call's prompt and output are drafted by
    a later ngram call of the same prompt (a random prompt has no n-gram of its own to match), whose output stays
    plain decoding's; on the slots a plain request joins where it ends. With the cache off nothing joins."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)
    ngram = NgramParams(adaptive=False)
    prompt = [int(t) for t in np.random.default_rng(11).permutation(m.n_vocab)[:24]]
    plain = m.generate_tokens(prompt, 24, temp=0, mode="plain", ignore_eos=True)
    assert m.ngram_cache_info()["n_docs"] == 0  # it joins when the next call starts
    again = m.generate_tokens(prompt, 24, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
    st = m.last_stats
    assert again == plain
    assert m.ngram_cache_info()["n_docs"] == 1 and m.ngram_cache_info()["n_tokens"] == len(prompt) + len(plain)
    assert st.n_cache_drafted > 0 and st.n_cache_accepted > 0

    m.ngram_cache_clear()
    m.kv_clear()
    other = [int(t) for t in np.random.default_rng(12).permutation(m.n_vocab)[:20]]
    with m.slots(2) as slots:
        a = slots.submit(other, 20, temp=0, mode="plain", ignore_eos=True)
        for _ in range(100):
            if slots.step() == 0:
                break
        want = slots.read(a).tokens
        assert m.ngram_cache_info()["n_docs"] == 1  # where it ended
        slots.release(a)
        b = slots.submit(other, 20, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
        for _ in range(100):
            if slots.step() == 0:
                break
        assert slots.read(b).tokens == want
        assert slots.stats(b)["n_cache_drafted"] > 0 and slots.stats(b)["n_cache_accepted"] > 0

    off = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, ngram_cache=0)
    for _ in range(2):
        off.generate_tokens(prompt, 8, temp=0, mode="plain", ignore_eos=True)
    assert off.ngram_cache_info()["n_added"] == 0


# ---- the chain length in the slots' shared pass: a row's marginal cost in the batch

# a pass of n tokens in single passes, forced on the context: dear for a sequence alone (2 tokens cost 3 single
# passes), nearly flat from 2 to 9 rows, dear again past 9; linear between the sizes the lookup times (2^k + 1), so
# its table is this
PASS_COST = ([1, 2, 3, 5, 9, 17, 33, 65], [1.0, 3.0, 3.5, 4.0, 4.4, 9.0, 17.0, 33.0])


def pass_cost(n: int) -> float:
    return float(np.interp(n, *PASS_COST))


def chain_length(a: float, l_max: int, n_rows: int = 1, n_tokens: float = 1.0, margin: float = 1.1) -> int:
    """The lookup's rule, written out: of L = 0..l_max drafted rows, each right with probability a, the L that gives
    the pass the most tokens per cost, (n_tokens - 1 + 1 + a + ... + a^L) / c(n_rows + L), over not drafting's
    n_tokens / c(n_rows); 0 unless it beats that by the margin."""
    base = n_tokens / pass_cost(n_rows)
    best, best_l, tokens, ak = margin, 0, 1.0, 1.0
    for n in range(1, l_max + 1):
        ak *= a
        tokens += ak
        rate = (n_tokens - 1 + tokens) / pass_cost(n_rows + n) / base
        if rate > best:
            best, best_l = rate, n
    return best_l


def first_draft(tiny_gguf: Path, prompt: list[int], ngram: NgramParams, n_plain: int) -> int:
    """The draft rows of an ngram request's first decoding step on 4 slots, beside n_plain plain requests decoding in
    the same pass, with the forced pass costs."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, ngram_cache=0)
    for n in range(2, 65):
        m._ctx.set_pass_cost(n, pass_cost(n))
    with m.slots(4) as slots:
        for k in range(n_plain):
            slots.submit([5 + k, 6, 7], 32, temp=0, mode="plain", ignore_eos=True)
        i = slots.submit(prompt, 32, temp=0, mode="ngram", ngram=ngram, ignore_eos=True)
        slots.step()  # every prefill, in one pass
        assert slots.stats(i)["n_drafted"] == 0
        slots.step()  # the plain requests' tokens and the ngram request's tree
        return int(slots.stats(i)["n_drafted"])


def test_the_chain_length_in_a_batch_follows_a_row_s_marginal_cost(tiny_gguf: Path) -> None:
    """With forced pass costs where a sequence alone loses by drafting and a batch of 4 rows gains: the same request
    drafts nothing alone and, beside 3 plain requests, the length the rule's figures give (acceptance 0.8: lookup's
    prior, nothing observed yet)."""
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, ngram_cache=0)

    def echo(seed: int) -> list[int]:
        """p, the model's next token x after p, a few other tokens, p again: where the model says x again, the first
        step's lookup matches (p's end, x) and drafts what followed x."""
        rng = np.random.default_rng(seed)
        p = [int(t) for t in rng.integers(1, m.n_vocab, 12)]
        x = m.generate_tokens(p, 1, temp=0, mode="plain", ignore_eos=True)[0]
        return p + [x] + [int(t) for t in rng.integers(1, m.n_vocab, 10)] + p

    prompt = next(p for p in map(echo, range(40)) if first_draft(tiny_gguf, p, NgramParams(adaptive=False), 0) > 0)
    available = first_draft(tiny_gguf, prompt, NgramParams(adaptive=False), 0)  # the whole chain the match gives
    assert chain_length(0.8, available) == 0
    want = chain_length(0.8, available, n_rows=4, n_tokens=4.0)
    assert 0 < want < available  # the rule, not the chain's end, stops it
    assert first_draft(tiny_gguf, prompt, NgramParams(), 0) == 0
    assert first_draft(tiny_gguf, prompt, NgramParams(), 3) == want
    with pytest.raises(ValueError, match="at least one single pass"):
        m._ctx.set_pass_cost(4, 0.5)
    with pytest.raises(ValueError, match="2 to n_batch"):
        m._ctx.set_pass_cost(1, 1.0)


@pytest.mark.slow
def test_smollm2_repeated_request_drafts_from_the_cache(smollm2_path: Path) -> None:
    with specee.Model(smollm2_path, n_ctx=1024, n_threads=2) as m:
        tokens = m.prompt_tokens([{"role": "user", "content": "Write a short poem about the sea."}])
        plain = m.generate_tokens(tokens, 32, temp=0, mode="plain")
        ngram = NgramParams(adaptive=False)
        assert m.generate_tokens(tokens, 32, temp=0, mode="ngram", ngram=ngram) == plain
        assert m.generate_tokens(tokens, 32, temp=0, mode="ngram", ngram=ngram) == plain
        st = m.last_stats
        assert st.n_cache_accepted > 0 and st.n_steps < len(plain) - 1


def test_the_exit_measurement_replays_the_lookup_rule() -> None:
    """bench/exit_lookup.py's lookup (for the early-exit measurement, docs/lookup.md): the longest match of 4..2 tokens
    gives the candidate, confident once matches of 4 have been right (acceptance >= 0.85 over the prior 0.8)."""
    from specee.bench.exit_lookup import lookup_candidates

    seq = [1, 2, 3, 4, 5] * 4 + [1, 2, 3, 4, 9]
    out = lookup_candidates(seq, 6)
    assert len(out) == len(seq) - 6
    assert out[0] == (-1, 0, False)  # [5, 1] has not occurred before
    assert out[1] == (3, 2, False) and out[2] == (4, 3, False) and out[3] == (5, 4, False)  # prior 0.8: not confident
    assert out[4] == (1, 4, True)  # the match of 4 was right once: (1 + 1.6) / (1 + 2) > 0.85
    assert out[-1] == (5, 4, True) and seq[-1] == 9  # confident, and wrong


def test_the_lookup_bound_s_oracle_drafts_the_best_earlier_continuation() -> None:
    """bench/lookup_bound.py: at each step, of every earlier place of the last n_min tokens, the continuation that
    matches the most tokens to come (seen so far only, at most draft_max); a step emits those plus one."""
    from specee.bench.lookup_bound import oracle_steps

    prompt = [1, 2, 3, 4, 1, 2, 5, 6, 7]
    # after the first reply token 1 (from the prompt's pass) the key (7, 1) never occurred: a plain step emits 2; then
    # the key (1, 2) stood at 0 (continuation 3, 4, 1, 2, 5, ...) and at 4 (5, 6, 7, 1, 2, ...): the reply's 5, 6, 7,
    # 9 takes 3 of the latter's, then the bonus 9; then (7, 9) is new: plain steps
    reply = [1, 2, 5, 6, 7, 9, 8, 8]
    steps = oracle_steps(prompt, reply, n_min=2, draft_max=8)
    assert steps == [0, 3, 0, 0]
    assert sum(a + 1 for a in steps) == len(reply) - 1
    assert oracle_steps(prompt, reply, n_min=2, draft_max=2) == [0, 2, 0, 0, 0]  # capped: 5, 6 then 7 as the bonus
    # the continuation is only what the sequence holds so far: a repeat of the reply's own tokens drafts as they arrive
    assert oracle_steps([], [4, 4, 4, 4, 4, 4], n_min=1, draft_max=8) == [0, 1, 1]
