"""Samplers (csrc/decode/specee-sampling.cpp): greedy, reproducible seeded draws, and the empirical distribution of
each sampler on fixed logits against its definition (chi-square goodness of fit)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specee import _core

LOGITS = np.array([2.0, 1.6, 1.2, 0.9, 0.5, 0.2, -0.1, -0.6, -1.0, -1.5], dtype=np.float32)
N_DRAWS = 20000
ALPHA = 1e-3  # the draws use fixed seeds, so a pass or a failure is reproducible, not flaky


# ---- reference definitions (llama.cpp's common chain: penalties, top-k, top-p, min-p, temperature, draw)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - np.max(x))
    return e / e.sum()


def reference_probs(logits: np.ndarray, temp: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
    """The distribution the chain draws from; zero outside the tokens the filters keep."""
    logits = logits.astype(np.float64)
    keep = np.ones(len(logits), dtype=bool)
    order = np.argsort(-logits, kind="stable")
    if 0 < top_k < len(logits):
        keep[:] = False
        keep[order[:top_k]] = True
    if top_p < 1.0:
        p = np.where(keep, softmax(np.where(keep, logits, -np.inf)), 0.0)
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, top_p) + 1)  # smallest prefix with cumulative probability >= top_p
        nucleus = np.zeros(len(logits), dtype=bool)
        nucleus[order[:n_keep]] = True
        keep &= nucleus
    if min_p > 0.0:
        keep &= logits >= logits[keep].max() + math.log(min_p)
    return np.where(keep, softmax(np.where(keep, logits / temp, -np.inf)), 0.0)


def penalised(logits: np.ndarray, history: list[int], penalty: float, last_n: int) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    window = history[-last_n:] if last_n > 0 else history
    for t in set(window):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


# ---- chi-square


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """Upper alpha quantile of chi-square: scipy when installed, else the Wilson-Hilferty approximation
    (z = 3.0902 for alpha = 1e-3; within 1% of the exact value for dof >= 3)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        assert alpha == 1e-3
        z = 3.0902
        return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return float(chi2.ppf(1 - alpha, dof))


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    """No draws outside the support, and a chi-square test over the support (bins with expected count < 5
    are pooled)."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, f"drew tokens the sampler must exclude: {np.nonzero(counts * (probs == 0))}"
    support = np.nonzero(probs)[0]
    obs, exp = counts[support].astype(np.float64), probs[support] * n
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    if len(exp) < 2:
        assert obs.sum() == n
        return
    stat = float(((obs - exp) ** 2 / exp).sum())
    crit = chi2_critical(len(exp) - 1)
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f} (dof {len(exp) - 1}): {obs} vs {exp.round(1)}"


def draw_counts(sampler: _core.Sampler, logits: np.ndarray, n: int = N_DRAWS) -> np.ndarray:
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(n):
        counts[sampler.sample(logits)] += 1
    return counts


def make(temp: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
         repeat_last_n: int = 64, seed: int | None = 1234) -> _core.Sampler:
    return _core.Sampler(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                         repeat_last_n=repeat_last_n, seed=seed)


# ---- tests


def test_greedy_is_argmax() -> None:
    rng = np.random.default_rng(0)
    for temp in (0.0, -1.0):
        s = make(temp=temp, top_k=40, top_p=0.9, min_p=0.1)
        for _ in range(50):
            logits = rng.normal(size=1000).astype(np.float32)
            assert s.sample(logits) == int(np.argmax(logits))


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0, 3.0], dtype=np.float32)
    assert make(temp=0.0).sample(logits) == 1


def test_same_seed_same_tokens() -> None:
    rng = np.random.default_rng(1)
    rows = [rng.normal(scale=2.0, size=5000).astype(np.float32) for _ in range(200)]
    params = dict(temp=0.9, top_k=50, top_p=0.95, min_p=0.02, repeat_penalty=1.1)

    def run(seed: int) -> list[int]:
        s = make(seed=seed, **params)
        out = []
        for row in rows:
            t = s.sample(row)
            s.accept(t)
            out.append(t)
        return out

    a, b, c = run(42), run(42), run(43)
    assert a == b
    assert a != c


def test_reset_restarts_the_sequence() -> None:
    s = make(temp=1.0, seed=7)
    first = [s.sample(LOGITS) for _ in range(100)]
    s.reset()
    assert [s.sample(LOGITS) for _ in range(100)] == first


def test_random_seed_differs() -> None:
    a, b = make(temp=1.0, seed=None), make(temp=1.0, seed=None)
    assert [a.sample(LOGITS) for _ in range(64)] != [b.sample(LOGITS) for _ in range(64)]


@pytest.mark.parametrize("temp", [0.5, 1.0, 1.7])
def test_temperature_softmax(temp: float) -> None:
    assert_matches(draw_counts(make(temp=temp), LOGITS), reference_probs(LOGITS, temp=temp))


@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_top_k_renormalised(top_k: int) -> None:
    assert_matches(draw_counts(make(top_k=top_k), LOGITS), reference_probs(LOGITS, top_k=top_k))


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p_nucleus(top_p: float) -> None:
    assert_matches(draw_counts(make(top_p=top_p), LOGITS), reference_probs(LOGITS, top_p=top_p))


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p(min_p: float) -> None:
    assert_matches(draw_counts(make(min_p=min_p), LOGITS), reference_probs(LOGITS, min_p=min_p))


def test_chain_order() -> None:
    """top-k, then top-p on the renormalised survivors, then min-p, then temperature."""
    kw = dict(temp=1.4, top_k=5, top_p=0.9, min_p=0.35)
    probs = reference_probs(LOGITS, **kw)
    # each filter matters here and the order changes the result: top-p alone keeps 6 tokens, top-p over the
    # renormalised top 5 keeps 4, min-p then keeps 3 (with the temperature applied first, 4 would be left)
    assert (reference_probs(LOGITS, top_p=0.9) > 0).sum() == 6
    assert (reference_probs(LOGITS, top_k=5, top_p=0.9) > 0).sum() == 4
    assert (probs > 0).sum() == 3
    assert (reference_probs(LOGITS / 1.4, top_k=5, top_p=0.9, min_p=0.35) > 0).sum() == 4
    assert_matches(draw_counts(make(**kw), LOGITS), probs)


def test_top_p_large_vocabulary() -> None:
    """A nucleus of more than the first 256 sorted tokens (the sampler sorts lazily): bins of 100 ranks."""
    rng = np.random.default_rng(3)
    logits = rng.normal(scale=0.3, size=4000).astype(np.float32)
    probs = reference_probs(logits, top_p=0.5)
    assert (probs > 0).sum() > 1000
    counts = draw_counts(make(top_p=0.5), logits, n=30000)
    order = np.argsort(-logits, kind="stable")
    bins = np.arange(len(logits)) // 100
    assert counts[probs == 0].sum() == 0
    assert_matches(np.bincount(bins, counts[order]), np.bincount(bins, probs[order]))


def test_repetition_penalty_greedy() -> None:
    logits = np.array([3.0, 2.9, -0.5, -0.6, 1.0], dtype=np.float32)
    s = make(temp=0.0, repeat_penalty=1.5, repeat_last_n=4)
    assert s.sample(logits) == 0
    s.accept(0)  # 3.0 / 1.5 = 2.0 < 2.9
    assert s.sample(logits) == 1
    s.accept(1)  # 2.9 / 1.5 = 1.93 < 2.0
    assert s.sample(logits) == 0
    for t in (2, 3, 4, 2):  # tokens 0 and 1 leave the window of 4
        s.accept(t)
    assert s.sample(logits) == 0


def test_repetition_penalty_negative_logits_multiply() -> None:
    # -0.5 * 2 = -1.0 falls below -0.6: the penalised token loses to the unpenalised one
    logits = np.array([-0.5, -0.6], dtype=np.float32)
    s = make(temp=0.0, repeat_penalty=2.0)
    assert s.sample(logits) == 0
    s.accept(0)
    assert s.sample(logits) == 1


def test_repetition_penalty_distribution() -> None:
    history = [0, 0, 2, 7, 9, 5]
    s = make(temp=1.0, repeat_penalty=1.8, repeat_last_n=4)  # window: 2, 7, 9, 5
    for t in history:
        s.accept(t)
    probs = reference_probs(penalised(LOGITS, history, 1.8, 4))
    assert_matches(draw_counts(s, LOGITS), probs)


def test_repeat_last_n_whole_history() -> None:
    s = make(temp=0.0, repeat_penalty=10.0, repeat_last_n=-1)
    logits = np.array([5.0, 4.0, 3.0], dtype=np.float32)
    s.accept(0)
    for _ in range(500):
        s.accept(2)
    assert s.sample(logits) == 1  # token 0 stays penalised however long ago it was seen


@pytest.mark.parametrize("kw", [dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=1.5),
                                dict(repeat_penalty=0.0), dict(repeat_penalty=float("inf")),
                                dict(repeat_last_n=-2), dict(temp=float("nan"))])
def test_bad_params(kw: dict) -> None:
    with pytest.raises(_core.SpecEEError):
        make(**kw)


def test_bad_logits() -> None:
    s = make()
    with pytest.raises(_core.SpecEEError, match="NaN"):
        s.sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(_core.SpecEEError, match="-inf"):
        s.sample(np.full(4, -np.inf, dtype=np.float32))
    with pytest.raises(_core.SpecEEError):
        s.sample(np.zeros(0, dtype=np.float32))
    with pytest.raises(ValueError):
        s.sample(np.zeros((2, 3), dtype=np.float32))


def test_logit_bias_bans_and_boosts() -> None:
    """--ignore-eos: a -inf bias takes a token out of greedy and sampled draws; a finite bias is added to the
    logit before the chain; setting a token again replaces its bias."""
    logits = np.array([1.0, 3.0, 2.0, 0.5], dtype=np.float32)
    s = _core.Sampler(temp=0.0)
    s.set_logit_bias(1, -math.inf)
    assert s.sample(logits) == 2
    s.set_logit_bias(3, 2.0)  # 0.5 + 2 > 2
    assert s.sample(logits) == 3
    s.set_logit_bias(1, 0.0)  # replaced: no longer banned
    assert s.sample(logits) == 1
    t = _core.Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    t.set_logit_bias(1, -math.inf)
    p = np.asarray(t.probs(logits))
    want = np.exp(logits - logits.max())
    want[1] = 0.0
    assert p[1] == 0.0 and np.allclose(p, want / want.sum(), atol=1e-6)
    assert all(t.sample(logits) != 1 for _ in range(200))
    t.set_logit_bias(7, -math.inf)  # beyond the logits: the draw fails with a message
    with pytest.raises(Exception, match="logit bias for token 7"):
        t.sample(logits)
    with pytest.raises(Exception, match="negative token"):
        t.set_logit_bias(-1, 1.0)
