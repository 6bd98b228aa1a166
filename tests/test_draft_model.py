"""A draft model as a drafter (mode draft, -md / Model(draft_model=...)): lossless in the Python API, the CLI and the
server's slots, refused with another vocabulary, its settings checked; synthetic acceptance rates (a benchmark aid)."""

from __future__ import annotations

import shutil
import subprocess
import re
from pathlib import Path

import pytest

import specee
from specee import DraftParams, Model, SpecEEError
from specee._tools import tool_path
from specee.convert.hf import convert_hf_to_gguf
from test_convert_cli import bpe_dir, bpe_gguf, save_tiny_llama, spm_dir  # noqa: F401 (fixtures: tiny Llamas)
from test_server import Server, call

PROMPTS = ["a b c a b c", "hello world, the", "x"]


@pytest.fixture(scope="module")
def target(bpe_gguf: Path) -> Path:  # noqa: F811
    """The draft model's target: the tiny BPE Llama."""
    return bpe_gguf


@pytest.fixture(scope="module")
def other(bpe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """Another tiny model with the target's tokenizer and its own random weights: its drafts are mostly rejected."""
    folder = tmp_path_factory.mktemp("draft_hf")
    for f in bpe_dir.iterdir():
        if "token" in f.name or f.name.startswith("special"):
            shutil.copy(f, folder / f.name)
    save_tiny_llama(folder, 320, seed=7)
    out = folder / "other-f32.gguf"
    convert_hf_to_gguf(folder, out, "f32")
    return out


@pytest.fixture(scope="module")
def models(target: Path, other: Path) -> dict[str, Model]:
    return {"self": Model(target, draft_model=target, n_ctx=256, n_threads=1),
            "other": Model(target, draft_model=other, n_ctx=256, n_threads=1)}


@pytest.mark.parametrize("draft", [DraftParams(), DraftParams(n_max=1), DraftParams(n_max=5, n_min=2),
                                   DraftParams(n_max=4, p_min=0.3)])
@pytest.mark.parametrize("which", ["self", "other"])
def test_greedy_draft_equals_plain(models: dict[str, Model], which: str, draft: DraftParams) -> None:
    m = models[which]
    for prompt in PROMPTS:
        tokens = m.tokenize(prompt)
        plain = m.generate_tokens(tokens, 24, temp=0, mode="plain", ignore_eos=True)
        drafted = m.generate_tokens(tokens, 24, temp=0, mode="draft", draft=draft, ignore_eos=True)
        assert drafted == plain
        st = m.last_stats
        assert st.n_accepted <= st.n_drafted
        if which == "self" and draft.p_min is None:  # the target drafting for itself: every draft is accepted
            assert st.n_drafted > 0 and st.n_accepted == st.n_drafted


def test_auto_drafts_with_a_draft_model(models: dict[str, Model]) -> None:
    m = models["self"]
    m.generate_tokens(m.tokenize("a b c"), 16, temp=0, ignore_eos=True)
    assert m.last_stats.mode == "draft" and m.last_stats.n_drafted > 0


@pytest.mark.parametrize("which", ["self", "other"])
def test_sampling_with_a_seed_gives_plain_decodings_tokens(models: dict[str, Model], which: str) -> None:
    """The target's token is drawn at each row as plain decoding draws it: the same seed, the same tokens."""
    m = models[which]
    for seed in (1, 2, 3):
        tokens = m.tokenize("hello world, the")
        plain = m.generate_tokens(tokens, 32, temp=0.9, seed=seed, mode="plain", ignore_eos=True)
        drafted = m.generate_tokens(tokens, 32, temp=0.9, seed=seed, mode="draft", ignore_eos=True)
        assert drafted == plain


def test_synthetic_rates(models: dict[str, Model]) -> None:
    m = models["other"]
    tokens = m.tokenize("a b c")
    plain = m.generate_tokens(tokens, 24, temp=0, mode="plain", ignore_eos=True)
    none = m.generate_tokens(tokens, 24, temp=0, mode="draft", ignore_eos=True,
                             draft=DraftParams(n_max=3, synth_rates=[0, 0, 0]))
    assert none == plain and m.last_stats.n_drafted > 0 and m.last_stats.n_accepted == 0
    m.generate_tokens(tokens, 24, temp=0, mode="draft", ignore_eos=True, draft=DraftParams(n_max=3, synth_rates=[1] * 3))
    all_st = m.last_stats
    assert all_st.n_drafted > 0 and all_st.n_accepted == all_st.n_drafted  # the other model's drafts, all taken
    runs = [m.generate_tokens(tokens, 24, temp=0.8, seed=5, mode="draft", ignore_eos=True,
                              draft=DraftParams(n_max=3, synth_rates=[0.8, 0.5, 0.2])) for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("draft, message", [
    (DraftParams(n_max=2, n_min=3), "min (3) must be at most max (2)"),
    (DraftParams(n_max=3, synth_rates=[1, 1]), "one rate per drafted token: 2 rates for draft max 3"),
])
def test_bad_settings_are_refused(models: dict[str, Model], draft: DraftParams, message: str) -> None:
    m = models["self"]
    with pytest.raises((ValueError, SpecEEError), match=re.escape(message)):
        m.generate_tokens(m.tokenize("a"), 4, mode="draft", draft=draft)


def test_values_are_checked_as_they_are_set() -> None:
    with pytest.raises(ValueError, match="non-increasing"):
        DraftParams(n_max=2, synth_rates=[0.5, 0.9])
    with pytest.raises(ValueError, match="draft.n_max"):
        DraftParams(n_max=0)


def test_mode_draft_needs_a_draft_model(target: Path) -> None:
    m = Model(target, n_ctx=64, n_threads=1)
    with pytest.raises((ValueError, SpecEEError), match="needs a draft model"):
        m.generate_tokens(m.tokenize("a"), 4, mode="draft")


def test_another_vocabulary_is_refused(target: Path, spm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    spm = tmp_path / "spm-f32.gguf"
    convert_hf_to_gguf(spm_dir, spm, "f32")  # 320 tokens too, other texts
    with pytest.raises(SpecEEError, match="must have the model's vocabulary"):
        Model(target, draft_model=spm, n_ctx=64)
    with pytest.raises(SpecEEError, match="has 49152 tokens, the model 320"):
        Model(target, draft_model=specee.default_model_path(), n_ctx=64)


def test_cli_greedy_draft_equals_plain(target: Path, other: Path) -> None:
    cli = str(tool_path("llama-cli"))
    common = ["-m", str(target), "-p", "a b c a b c", "-n", "24", "--temp", "0", "-no-cnv", "--ignore-eos", "-t", "1"]
    plain = subprocess.run([cli, *common, "--mode", "plain"], capture_output=True, text=True, errors="replace")
    assert plain.returncode == 0, plain.stderr
    for extra in (["-md", str(other)], ["-md", str(target), "--draft-max", "6"],
                  ["--model-draft", str(target), "--spec-type", "draft-simple", "--draft-min", "2"]):
        res = subprocess.run([cli, *common, *extra], capture_output=True, text=True, errors="replace")
        assert res.returncode == 0 and res.stdout == plain.stdout, res.stderr
        assert "speculative =" in res.stderr


def test_server_slots_draft_each_on_its_sequence(target: Path, other: Path) -> None:
    """Two slots with a draft model: each request's tokens are plain decoding's, timings carry draft_n."""
    s = Server(target, "-np", "2", "-c", "512", "-md", str(target), "--spec-draft-n-max", "4", "--temp", "0")
    try:
        body = {"prompt": "a b c a b c", "n_predict": 20, "ignore_eos": True, "return_tokens": True}
        plain = call(s.port, "POST", "/completion", {**body, "mode": "plain"}).json()
        replies = [call(s.port, "POST", "/completion", {**body, "prompt": p}) for p in ("a b c a b c", "hello world")]
        assert [r.status_code for r in replies] == [200, 200]
        first = replies[0].json()
        assert first["tokens"] == plain["tokens"] and first["mode"] == "draft"
        assert first["timings"]["draft_n"] > 0 and first["timings"]["draft_n_accepted"] == first["timings"]["draft_n"]
        assert "draft_n" not in plain["timings"]
        per_request = call(s.port, "POST", "/completion", {**body, "speculative.n_max": 2}).json()
        assert per_request["tokens"] == plain["tokens"]
    finally:
        s.stop()
