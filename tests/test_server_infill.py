"""llama.cpp's /infill on specee-server (127.0.0.1, bounded): the FIM tokens a vocabulary has (keys, older keys, their
text), the prompt's layout (extra files with and without a file separator token, the context budget, --spm-infill)
against an expectation written here, /completion's answer whole and streamed, 400s for bad fields, 501 for a model
without FIM tokens; and, with SPECEE_UPSTREAM_BIN, the same prompt and greedy tokens as upstream llama-server on the
same file (an F16 V cache here, as upstream's)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import pytest

from specee.model import Model
from specee.server.infill import infill_prompt
from test_embed import copy_gguf
from test_server import Server, call, start_llama_server

# SmolLM2 has no FIM tokens of its own (its <reponame> is found by its text as the repository token, as llama.cpp
# finds it): these keys name three of its unused control tokens as prefix, suffix and middle
FIM_KEYS = {"tokenizer.ggml.fim_pre_token_id": 7, "tokenizer.ggml.fim_suf_token_id": 8,
            "tokenizer.ggml.fim_mid_token_id": 9}
PRE, SUF, MID, REP, SEP = "<gh_stars>", "<issue_start>", "<issue_comment>", "<reponame>", "<file_sep>"
REQUEST = {"input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
           "prompt": "    int n_threads = llama_", "input_suffix": "}\n"}
EXTRA = [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}]


@pytest.fixture(scope="module")
def fim_gguf(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_gguf(smollm2_path, tmp_path_factory.mktemp("infill") / "smollm2-fim.gguf", FIM_KEYS)


@pytest.fixture(scope="module")
def sep_gguf(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """With a file separator token too (<file_sep>, named by its key)."""
    return copy_gguf(smollm2_path, tmp_path_factory.mktemp("infill") / "smollm2-fim-sep.gguf",
                     {**FIM_KEYS, "tokenizer.ggml.fim_sep_token_id": 5})


@pytest.fixture(scope="module")
def tiny_gguf_no_fim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with a byte-level BPE vocabulary and no FIM token."""
    from fuzz_gguf import write_seed

    path = tmp_path_factory.mktemp("infill") / "bpe.gguf"
    write_seed(path, "bpe", gguf.GGMLQuantizationType.F32, parts=False, seed=1)
    return path


# ---- the FIM tokens


def test_smollm2_has_only_a_repository_token_found_by_its_text(smollm2_path: Path) -> None:
    m = Model(smollm2_path, n_ctx=64)
    assert m.fim_tokens == {"pre": -1, "suf": -1, "mid": -1, "pad": -1, "rep": 4, "sep": -1}
    assert m.detokenize([4], False, True) == REP and 4 in m.eog_tokens  # a repository token ends generation (as llama.cpp's)
    assert m.eog_tokens[0] == m.eos  # the others keep their order


def test_fim_tokens_from_keys_and_older_keys(smollm2_path: Path, tmp_path: Path) -> None:
    m = Model(copy_gguf(smollm2_path, tmp_path / "a.gguf", {**FIM_KEYS, "tokenizer.ggml.fim_sep_token_id": 5,
                                                             "tokenizer.ggml.fim_pad_token_id": 10}), n_ctx=64)
    assert m.fim_tokens == {"pre": 7, "suf": 8, "mid": 9, "pad": 10, "rep": 4, "sep": 5}
    assert {4, 5, 10} <= set(m.eog_tokens) and not {7, 8, 9} & set(m.eog_tokens)
    m = Model(copy_gguf(smollm2_path, tmp_path / "b.gguf", {"tokenizer.ggml.prefix_token_id": 11,
                                                             "tokenizer.ggml.suffix_token_id": 12,
                                                             "tokenizer.ggml.middle_token_id": 13,
                                                             "tokenizer.ggml.fim_pad_token_id": 10**6}), n_ctx=64)
    assert m.fim_tokens == {"pre": 11, "suf": 12, "mid": 13, "pad": -1, "rep": 4, "sep": -1}  # out of range: none


# ---- the layout


def test_layout_with_snippets(fim_gguf: Path) -> None:
    """No file separator: each extra file after the snippet line; the repository token and name first."""
    m = Model(fim_gguf, n_ctx=64)
    tok = lambda s: m.tokenize(s, add_special=False)  # noqa: E731
    ids = infill_prompt(m, tok("int main() {\n"), tok("}\n"), [("a.h", "int f();\n"), ("b.h", "int g();\n")],
                        tok("    return "), 2048, -1, 4096)
    assert m.detokenize(ids, False, True) == (f"{REP}myproject\n\n\n--- snippet ---\n\nint f();\n"
                                              f"\n\n--- snippet ---\n\nint g();\n"
                                              f"{PRE}int main() {{\n    return {SUF}}}\n{MID}")
    assert ids[0] == 4 and ids[-1] == 9 and ids.count(7) == ids.count(8) == 1


def test_layout_with_file_separators_and_spm(sep_gguf: Path) -> None:
    m = Model(sep_gguf, n_ctx=64)
    tok = lambda s: m.tokenize(s, add_special=False)  # noqa: E731
    args = (tok("x = 1\n"), tok("print(x)\n"), [("util.py", "def f(): pass\n")], tok("y"), 2048, -1, 4096)
    files = f"{REP}myproject\n{SEP}util.py\ndef f(): pass\n{SEP}filename\n"
    assert m.detokenize(infill_prompt(m, *args), False, True) == f"{files}{PRE}x = 1\ny{SUF}print(x)\n{MID}"
    assert m.detokenize(infill_prompt(m, *args, spm=True), False, True) == f"{files}{SUF}print(x)\n{PRE}x = 1\ny{MID}"


def test_layout_shares_the_context_as_upstream(fim_gguf: Path) -> None:
    """n_batch 16: the prefix's last 12 tokens, the suffix's first 16/4 - (2 + 1 prompt token) = 1; the extra part's
    last n_ctx - n_batch - 2 n_predict tokens (none when that is not positive)."""
    m = Model(fim_gguf, n_ctx=64)
    tok = lambda s: m.tokenize(s, add_special=False)  # noqa: E731
    prefix, suffix, prompt, text = list(range(100, 130)), list(range(200, 230)), [300], "alpha beta gamma " * 10
    head = [4, *tok("myproject\n")]
    files = head + tok("\n\n--- snippet ---\n\n") + tok(text)
    assert len(files) > 40 - 16 - 2 * 4
    ids = infill_prompt(m, prefix, suffix, [("f", text)], prompt, 16, 4, 40)
    assert ids == [*files[-(40 - 16 - 2 * 4):], 7, *prefix[-12:], 300, 8, 200, 9]
    assert infill_prompt(m, prefix, suffix, [], prompt, 16, -1, 16) == [*head[-2:], 7, *prefix[-12:], 300, 8, 200, 9]
    prompt = list(range(500, 505))  # no room for the suffix
    assert infill_prompt(m, prefix, suffix, [], prompt, 16, 100, 16) == [7, *prefix[-12:], *prompt, 8, 9]


# ---- the endpoint


@pytest.fixture(scope="module")
def server(fim_gguf: Path) -> Iterator[Server]:
    s = Server(fim_gguf, "-np", "1", "-c", "4096", "-ctv", "f16")
    yield s
    s.stop()


def infill(port: int, body: dict) -> Any:
    r = call(port, "POST", "/infill", body)
    assert r.status_code == 200, r.text
    return r.json()


def events(port: int, body: dict) -> list[dict]:
    r = call(port, "POST", "/infill", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_infill_answers_as_completion(server: Server, fim_gguf: Path) -> None:
    m = Model(fim_gguf, n_ctx=64)
    tok = lambda s: m.tokenize(s, add_special=False)  # noqa: E731
    want = infill_prompt(m, tok(REQUEST["input_prefix"]), tok(REQUEST["input_suffix"]),
                         [(e["filename"], e["text"]) for e in EXTRA], tok(REQUEST["prompt"]), 2048, -1, 4096)
    out = infill(server.port, {**REQUEST, "input_extra": EXTRA, "n_predict": 8, "temperature": 0,
                               "return_tokens": True, "n_probs": 2})
    assert out["tokens_evaluated"] == len(want) and out["prompt"] == m.detokenize(want, False, True)
    assert out["prompt"].startswith(REP + "myproject\n") and out["prompt"].endswith(MID)
    assert out["tokens_predicted"] == len(out["tokens"]) == len(out["completion_probabilities"]) == 8
    assert out["content"] == m.detokenize(out["tokens"]) and out["stop_type"] == "limit"
    # the same prompt given to /completion as token ids: the same greedy tokens
    same = call(server.port, "POST", "/completion", {"prompt": want, "n_predict": 8, "temperature": 0,
                                                     "return_tokens": True}).json()
    assert same["tokens"] == out["tokens"]
    # streamed: the same pieces, a last chunk that stops
    chunks = events(server.port, {**REQUEST, "input_extra": EXTRA, "n_predict": 8, "temperature": 0})
    assert "".join(c["content"] for c in chunks) == out["content"] and chunks[-1]["stop"] is True
    assert not any(c["stop"] for c in chunks[:-1]) and chunks[-1]["tokens_evaluated"] == len(want)


@pytest.mark.parametrize("body, param", [
    ({**REQUEST, "input_extra": [{}]}, "input_extra"),
    ({**REQUEST, "input_extra": [{"filename": "ok"}]}, "input_extra"),
    ({**REQUEST, "input_extra": [{"filename": 123}]}, "input_extra"),
    ({**REQUEST, "input_extra": [{"filename": 123, "text": "abc"}]}, "input_extra"),
    ({**REQUEST, "input_extra": [{"filename": 123, "text": 456}]}, "input_extra"),
    ({**REQUEST, "input_extra": {"filename": "a", "text": "b"}}, "input_extra"),
    ({**REQUEST, "input_extra": ["text"]}, "input_extra"),
    ({"input_prefix": "a"}, "input_suffix"),
    ({"input_suffix": "a"}, "input_prefix"),
    ({**REQUEST, "input_prefix": 5}, "input_prefix"),
    ({**REQUEST, "input_suffix": [1, 10**7]}, "input_suffix"),
    ({**REQUEST, "prompt": [1, 2]}, "prompt"),
    ({**REQUEST, "n_predict": "8"}, "n_predict"),
])
def test_bad_fields_are_400(server: Server, body: dict, param: str) -> None:
    r = call(server.port, "POST", "/infill", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param


def test_mixed_prefix_and_no_prompt(server: Server, fim_gguf: Path) -> None:
    """input_prefix as token ids and text (llama.cpp's mixed prompt), no prompt: the prefix's tokens as given."""
    m = Model(fim_gguf, n_ctx=64)
    out = infill(server.port, {"input_prefix": [28, "x = "], "input_suffix": "", "n_predict": 0})
    assert out["prompt"] == f"{REP}myproject\n{PRE}{m.detokenize([28])}x = {SUF}{MID}"


def test_no_fim_tokens_is_501(tiny_gguf_no_fim: Path) -> None:
    s = Server(tiny_gguf_no_fim, "-c", "256")
    try:
        r = call(s.port, "POST", "/infill", REQUEST)
        assert r.status_code == 501, r.text
        error = r.json()["error"]
        assert error["type"] == "not_supported_error" and "prefix, suffix or middle token" in error["message"]
        assert call(s.port, "POST", "/infill", {"bad": 1}).status_code == 501  # whatever the body
    finally:
        s.stop()


def test_spm_infill_and_batch_flags(fim_gguf: Path) -> None:
    """--spm-infill: the suffix first; -c 512 < -b 2048 leaves no room for the repository part, -b 64 does, and
    keeps the prefix's last 48 tokens, the suffix's first 16 - (2 + 1)."""
    body = {"input_prefix": " a" * 60, "input_suffix": " b" * 20, "prompt": "c", "n_predict": 0}
    for flags, want in ((["-c", "512"], f"{SUF}{' b' * 20}{PRE}{' a' * 60}c{MID}"),
                        (["-c", "512", "-b", "64"], f"{REP}myproject\n{SUF}{' b' * 13}{PRE}{' a' * 48}c{MID}")):
        s = Server(fim_gguf, "-np", "1", "--spm-infill", *flags)
        try:
            assert infill(s.port, body)["prompt"] == want, flags
        finally:
            s.stop()


# ---- upstream llama-server on the same file


@pytest.fixture(scope="module")
def upstream() -> Iterator[Any]:
    """start(model, *flags): upstream llama-server on 127.0.0.1 (one slot of 4096 tokens), its port (one server per
    model and flags, kept for the module); all stopped at the end."""
    procs: list[subprocess.Popen] = []
    ports: dict[tuple, int] = {}

    def start(model: Path, *args: str) -> int:
        if (model, *args) not in ports:
            ports[(model, *args)] = start_llama_server(procs, model, "-np", "1", "-c", "4096", *args)
        return ports[(model, *args)]

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=15)


FIELDS = ("prompt", "tokens_evaluated", "tokens", "content")


@pytest.fixture(scope="module")
def twin(fim_gguf: Path) -> Iterator[Server]:
    """A server for the comparisons alone: both servers reuse the cached prefix of the request before, and a prefix
    evaluated in other batches can turn a near-tie, so both see the same requests in the same order."""
    s = Server(fim_gguf, "-np", "1", "-c", "4096", "-ctv", "f16")
    yield s
    s.stop()


@pytest.mark.upstream
@pytest.mark.parametrize("body", [REQUEST, {**REQUEST, "input_extra": EXTRA},
                                  {**REQUEST, "input_extra": [{"text": "x"}, *EXTRA], "prompt": ""}])
def test_the_same_prompt_and_tokens_as_upstream(upstream: Any, twin: Server, fim_gguf: Path, body: dict) -> None:
    port = upstream(fim_gguf)
    request = {**body, "n_predict": 16, "temperature": 0, "return_tokens": True}
    ours, theirs = infill(twin.port, request), infill(port, request)
    assert {k: ours[k] for k in FIELDS} == {k: theirs[k] for k in FIELDS}
    streamed = events(port, request)
    assert "".join(c["content"] for c in events(twin.port, request)) == "".join(c["content"] for c in streamed)


@pytest.mark.upstream
def test_file_separators_and_spm_as_upstream(upstream: Any, sep_gguf: Path) -> None:
    port = upstream(sep_gguf, "--spm-infill")
    ours = Server(sep_gguf, "-np", "1", "-c", "4096", "-ctv", "f16", "--spm-infill")
    try:
        request = {**REQUEST, "input_extra": [{"text": "x"}, *EXTRA], "n_predict": 16, "temperature": 0,
                   "return_tokens": True}
        mine, theirs = infill(ours.port, request), infill(port, request)
        assert {k: mine[k] for k in FIELDS} == {k: theirs[k] for k in FIELDS}
        assert mine["prompt"].count(SEP) == 3 and mine["prompt"].index(SUF) < mine["prompt"].index(PRE)
    finally:
        ours.stop()
