"""The one generator (csrc/decode/specee-generate.cpp) behind the CLI and Python: every mode gives the same tokens
through both, speculative greedy output equals plain greedy output with default settings, the perf lines count generated
tokens, a second chat turn evaluates only its new tokens, a stale iterator raises, an interrupt is reported, one
Model serves several threads, and named intermediates are read through the scheduler's callback."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import specee
from specee import EagleParams, ExitParams
from specee._tools import tool_path
from specee.paths import default_draft_head_path

PROMPTS = ["The capital of France is", "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
           "Three things to pack for a hike:"]
# (CLI flags, Python options) of each mode; sampling runs seeded
MODES = [
    ("plain", ["--mode", "plain"], dict(mode="plain")),
    ("eagle", ["--mode", "eagle", "--eagle-choices", "[[0], [1], [0, 0]]"],
     dict(mode="eagle", eagle=EagleParams(choices="[[0], [1], [0, 0]]"))),
    ("eagle2", ["--mode", "eagle2", "--eagle-total-tokens", "4", "--eagle-depth", "3", "--eagle-topk", "2"],
     dict(mode="eagle2", eagle=EagleParams(total_tokens=4, depth=3, topk=2))),
    ("early-exit", ["--mode", "early-exit"], dict(mode="early-exit")),
    ("tree-exit", ["--mode", "tree-exit", "--eagle-total-tokens", "4", "--eagle-depth", "3", "--eagle-topk", "2"],
     dict(mode="tree-exit", eagle=EagleParams(total_tokens=4, depth=3, topk=2))),
]
SAMPLING = [("greedy", ["--temp", "0"], dict(temp=0)),
            ("seeded", ["--temp", "0.8", "-s", "5"], dict(temp=0.8, seed=5))]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEE_DEFAULT")}
    return subprocess.run([str(tool_path("llama-cli")), *args], capture_output=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> specee.Model:
    return specee.Model(smollm2_path, n_ctx=512, n_threads=1, draft_head="default")


# early exit and tree exit decode greedily only
CASES = [(m, s) for m in MODES for s in SAMPLING if not (m[0] in ("early-exit", "tree-exit") and s[0] == "seeded")]


@pytest.mark.slow
@pytest.mark.parametrize("mode,sampling", CASES, ids=[f"{m[0]}-{s[0]}" for m, s in CASES])
def test_cli_and_python_give_the_same_tokens(mode, sampling, model: specee.Model, smollm2_path: Path) -> None:
    (mode, flags, options), (_, sflags, soptions) = mode, sampling
    for prompt in PROMPTS:
        run = cli("-m", str(smollm2_path), "--draft-head", default_draft_head_path(), "-p", prompt, "-n", "24",
                  "-c", "512", "-t", "1", "-no-cnv", "--no-display-prompt", *flags, *sflags)
        assert run.returncode == 0, run.stderr.decode()[-800:]
        model.kv_clear()
        tokens = model.generate_tokens(model.tokenize(prompt), 24, **options, **soptions)
        assert model.last_stats.mode == mode
        want = b"".join(model.token_to_piece(t) for t in tokens)
        got = run.stdout.removesuffix(b"\n\n").removesuffix(b" [end of text]\n")  # the CLI's own endings
        assert got == want, (prompt, got, want)


@pytest.mark.slow
def test_speculative_greedy_equals_plain_with_default_settings(smollm2_path: Path) -> None:
    """"Lossless" as a user checks it: the same command with and without the default head, greedy."""
    base = ["-m", str(smollm2_path), "-n", "48", "-c", "512", "-t", "1", "-no-cnv", "--no-display-prompt",
            "--temp", "0"]
    for prompt in PROMPTS:
        plain = cli(*base, "-p", prompt)
        for mode in ("eagle", "eagle2"):
            spec = cli(*base, "-p", prompt, "--draft-head", default_draft_head_path(), "--mode", mode)
            assert spec.returncode == 0 and spec.stdout == plain.stdout, (prompt, mode)


@pytest.mark.slow
def test_perf_lines_of_a_speculative_run_count_tokens(smollm2_path: Path) -> None:
    """-n 40 with --ignore-eos prints 40 tokens: 'eval time' counts the 39 decoded after the first (as upstream's
    runs), and the speculative line the steps that produced them."""
    run = cli("-m", str(smollm2_path), "--draft-head", default_draft_head_path(), "--mode", "eagle2", "-p",
              PROMPTS[0], "-n", "40", "--ignore-eos", "--temp", "0", "-c", "512", "-t", "1", "-no-cnv")
    err = run.stderr.decode()
    assert run.returncode == 0, err
    runs = re.search(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs\s+\(\s*([\d.]+) ms per token,\s+([\d.]+) tokens", err)
    steps = re.search(r"speculative =\s+(\d+) steps,\s+([\d.]+) mean accepted tokens per step", err)
    sampled = re.search(r"sampling time =\s+[\d.]+ ms /\s+(\d+) runs", err)
    total = re.search(r"total time =\s+[\d.]+ ms /\s+(\d+) tokens", err)
    prompt = re.search(r"prompt eval time =\s+[\d.]+ ms /\s+(\d+) tokens", err)
    assert runs and steps and sampled and total and prompt, err
    assert int(runs.group(2)) == 39 and int(sampled.group(1)) == 40
    assert int(total.group(1)) == int(prompt.group(1)) + 39
    n_steps, mean = int(steps.group(1)), float(steps.group(2))
    assert 0 < n_steps <= 39 and abs(n_steps * mean - 39) < 0.01 * n_steps + 0.01
    ms, per_token, tps = float(runs.group(1)), float(runs.group(3)), float(runs.group(4))
    assert abs(per_token - ms / 39) < 0.01 and abs(tps - 39e3 / ms) < 0.01 * tps
    assert "inf" not in err and "nan" not in err


@pytest.mark.slow
def test_a_second_chat_turn_evaluates_only_its_new_tokens(model: specee.Model) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    model.kv_clear()
    first = model.generate(chat, 24, mode="plain", temp=0)
    n_first = model.last_stats.n_prompt
    assert model.last_stats.n_reused == 0
    chat += [{"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    model.generate(chat, 24, mode="plain", temp=0)
    st = model.last_stats
    assert st.n_reused > n_first and st.n_prompt < 20, st  # the reply and the first turn were kept
    again = specee.Model(model.path, n_ctx=512, n_threads=1).generate(chat, 24, mode="plain", temp=0)
    assert model.generate(chat, 24, mode="plain", temp=0) == again  # reuse changes no token


@pytest.mark.slow
def test_stale_iterators_raise_and_interrupts_are_reported(model: specee.Model) -> None:
    it = model.stream(PROMPTS[0], 16, temp=0)
    next(it)
    model.generate(PROMPTS[1], 4, temp=0)
    with pytest.raises(RuntimeError, match="superseded"):
        list(it)

    # Ctrl-C arrives in the generator's frame (during a native step): the run says so
    from specee.generate import GenerateOptions, GenerationStats

    stats = GenerationStats()
    with pytest.raises(KeyboardInterrupt):
        gen = model._token_stream(model.tokenize(PROMPTS[0]), 16, GenerateOptions(temp=0, mode="plain"), stats)
        for i, _ in enumerate(gen):
            if i == 2:
                gen.throw(KeyboardInterrupt)
    assert stats.stop_reason == "interrupted" and stats.n_generated == 3


@pytest.mark.slow
def test_one_model_from_many_threads(smollm2_path: Path) -> None:
    """Four threads generate on one Model at once: no crash, and each gets the tokens a serial run gets."""
    m = specee.Model(smollm2_path, n_ctx=512, n_threads=1, draft_head="default")
    jobs = [(PROMPTS[i % 3], mode) for i, mode in enumerate(["plain", "eagle2", "early-exit", "plain"])]
    serial = [m.generate(p, 16, temp=0, mode=mode) for p, mode in jobs]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                results[i] = m.generate(jobs[i][0], 16, temp=0, mode=jobs[i][1])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and [results[i] for i in range(len(jobs))] == serial


def test_named_intermediates_are_captured(tiny_gguf: Path) -> None:
    """Model.eval(capture=...) reads graph nodes by name through the scheduler's eval callback: l_out-il equals
    the hidden state that layer ranges give, result_norm the final-norm output."""
    m = specee.Model(tiny_gguf, n_ctx=64, n_threads=1)
    tokens = [5, 17, 42, 7, 99]
    m.eval(tokens, output="all", capture=["l_out-1", "result_norm", "attn_norm-0"])
    assert set(m.captured) == {"l_out-1", "result_norm", "attn_norm-0"}
    np.testing.assert_array_equal(m.captured["result_norm"], m.norm())
    assert m.captured["attn_norm-0"].shape == (len(tokens), m.n_embd)
    m.kv_clear()
    m.eval(tokens, output="all", capture=["l_out-1"])
    layer1 = m.captured["l_out-1"]
    m.kv_clear()
    m.eval(tokens, layers=(0, 2), output="all")
    np.testing.assert_allclose(layer1, m.hidden(), rtol=0, atol=1e-6)
    m.eval(tokens[:1], capture=[])  # nothing asked: nothing kept
    assert m.captured == {}
    with pytest.raises(specee.SpecEEError, match="was not captured"):
        m._ctx.get_capture("l_out-1")
