"""specee-server as llama-server: its flags (one table: honoured, ignored, refused naming the flag), llama.cpp's
response shapes (/props, /slots, /metrics names, /completion fields, CORS, model aliases, logit_bias, n > 1, error
shapes), and a CI-sized subset of llama.cpp's own server tests (scripts/llama-server-tests.sh) when its source tree is
beside the repository. Servers bind 127.0.0.1 and are stopped by their fixtures; every loop is bounded."""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Iterator

import pytest

from specee.generate import GenerateOptions
from specee.server.app import make_parser, parse_args
from specee.server.flags import LLAMA_FLAGS, USES
from test_convert_cli import bpe_dir, bpe_gguf  # noqa: F401 (fixtures of chat_gguf: a tiny BPE Llama, its GGUF)
from test_server import TIMEOUT, Server, call, chat_gguf  # noqa: F401 (chat_gguf: a fixture)

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP = REPO.parent / "up" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
ARG_CPP = LLAMA_CPP / "common" / "arg.cpp"
SUITE = LLAMA_CPP / "tools" / "server" / "tests"

# ---- the flags ------------------------------------------------------------------------------------------

# what the llama.cpp server tests pass on every start (utils.py), and other routine flags of users' scripts
ROUTINE = ["--temp", "0.2", "--seed", "42", "--host", "127.0.0.1", "--offline", "--no-slots", "--no-jinja", "-n", "64",
           "-fa", "on", "-kvu", "--embedding", "--pooling", "mean", "-ub", "128", "-cb", "--no-ui", "--verbose",
           "--no-context-shift", "--cache-reuse", "256", "-ctk", "f16"]


def test_routine_llama_server_flags_are_accepted_and_sampling_ones_are_defaults() -> None:
    args = parse_args(ROUTINE)
    assert args.sampling == {"temp": 0.2, "seed": 42}
    assert args.n_predict == 64 and args.n_ubatch == 128
    assert args.llama["slots"] == "--no-slots" and "verbose" in args.llama


def test_the_ngram_and_draft_model_chain_lengths_are_one_flag_each() -> None:
    """--spec-ngram-mod-n-max: n-gram lookup's longest chain; --spec-draft-n-max: a draft model's (llama.cpp's
    names; the CLI spells them alike)."""
    from specee.server.request import request_params
    args = parse_args(["--spec-ngram-mod-n-max", "3", "--spec-draft-n-max", "5"])
    assert args.sampling == {"ngram.draft_max": 3, "draft.n_max": 5}
    params = request_params({"prompt": "x"}, "llama", "ngram", -1, args.sampling)
    assert params.options.ngram.draft_max == 3


@pytest.mark.parametrize("argv, named", [
    (["--spec-synth-len", "2"], "--spec-synth-len 2"),
    (["--mirostat", "2"], "--mirostat 2"),
    (["--presence-penalty", "0.5"], "--presence-penalty 0.5"),
    (["-hf", "org/model"], "-hf org/model"),
    (["-nocb"], "-nocb"),
    (["--tools", "all"], "--tools all"),
    (["--fim-qwen-7b-spec"], "--fim-qwen-7b-spec"),
])
def test_a_flag_that_would_change_behaviour_is_refused_naming_it(argv: list[str], named: str,
                                                                 capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert f"error: {named}: not supported by specee-server" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--presence-penalty", "0"], ["--pooling", "mean"], ["-ctk", "f16"],
                                  ["--typical", "1.0"], ["--reasoning-format", "none"]])
def test_a_refused_flag_with_a_value_that_changes_nothing_is_accepted(argv: list[str]) -> None:
    parse_args(argv)


def test_a_bad_sampling_default_is_refused_at_start(capsys: pytest.CaptureFixture) -> None:
    for argv in (["--top-p", "2"], ["--temp", "warm"], ["-l", "5x"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "logit_bias" in capsys.readouterr().err


def test_the_table_is_well_formed() -> None:
    """Each row a known use; sampling rows name a GenerateOptions field, server rows their setting; no spelling in
    two rows; every spelling reaches the parser (none shadowed by the server's own flags)."""
    options = {f.name for f in fields(GenerateOptions)}
    seen: set[str] = set()
    for row in LLAMA_FLAGS:
        assert row.use in USES, row
        # a sampling row names a field, or a setting of a group ("draft.n_max": DraftParams' n_max)
        assert row.use != "sampling" or (row.dest or "").split(".")[0] in options, row
        assert row.use != "server" or row.dest, row
        assert row.use == "refused" or not row.neutral, row
        assert not seen & set(row.flags), row
        seen |= set(row.flags)
    assert seen <= set(make_parser()._option_string_actions)


def server_flags_of(arg_cpp: str) -> set[str]:
    """The flags llama-server takes, read off upstream's common/arg.cpp: an option's spellings (and its negations)
    where its examples include the server or are the common ones and it does not exclude the server."""
    out: set[str] = set()
    for block in arg_cpp.split("add_opt(common_arg(")[1:]:
        head = re.match(r"\s*\{([^}]*)\}\s*,\s*(\{([^}]*)\}\s*,)?", block)
        if head is None:
            continue
        examples = re.search(r"\.set_examples\(\{([^}]*)\}\)", block)
        excludes = re.search(r"\.set_excludes\(\{([^}]*)\}\)", block)
        used = examples is None or re.search(r"LLAMA_EXAMPLE_(COMMON|SERVER)\b", examples.group(1))
        if used and not (excludes and "LLAMA_EXAMPLE_SERVER" in excludes.group(1)):
            out |= set(re.findall(r'"(-[^"]+)"', head.group(1) + (head.group(3) or "")))
    return out


@pytest.mark.skipif(not ARG_CPP.exists(), reason=f"upstream llama.cpp's source is not at {ARG_CPP}")
def test_every_flag_llama_server_takes_is_known() -> None:
    upstream = server_flags_of(ARG_CPP.read_text())
    assert len(upstream) > 200  # the reader found the table
    known = set(make_parser()._option_string_actions)
    assert sorted(upstream - known) == []


def test_logit_bias_is_a_generation_option() -> None:
    assert GenerateOptions(logit_bias={5: -math.inf, 7: 1.5}).logit_bias == "5-inf,7+1.5"
    with pytest.raises(ValueError, match="logit_bias"):
        GenerateOptions(logit_bias="5x")


def test_logit_bias_steers_generation_in_every_lossless_mode(chat_gguf: Path) -> None:  # noqa: F811
    """The runtime's option, not the server's: a ban moves the greedy token, a large bias forces one, in plain
    decoding and under EAGLE's verification (the draft head's proposals are not biased, the target's draws are)."""
    from specee.model import Model
    m = Model(chat_gguf, n_ctx=128, n_threads=1)
    prompt = [5, 6, 7]
    first = m.generate_tokens(prompt, 1, temp=0, mode="plain")[0]
    for mode in ("plain", "eagle"):
        assert m.generate_tokens(prompt, 1, temp=0, mode=mode, logit_bias={first: -math.inf})[0] != first
        assert m.generate_tokens(prompt, 4, temp=0, mode=mode, logit_bias={42: 1e4}) == [42] * 4


# ---- the server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(chat_gguf: Path) -> Iterator[Server]:  # noqa: F811
    s = Server(chat_gguf, "-np", "2", "-c", "256", "--mode", "plain", "--metrics", "--api-key", "k", "--temp", "0",
               "--seed", "42", "--cors-origins", "localhost", "-a", "tiny,alias", "--tags", "t1,t2", "--no-jinja")
    yield s
    s.stop()


KEY = {"Authorization": "Bearer k"}


def post(server: Server, path: str, body: dict) -> dict:
    r = call(server.port, "POST", path, body, headers=KEY)
    assert r.status_code == 200, r.text
    return r.json()


def test_cors_preflight_is_answered_before_the_api_key(server: Server) -> None:
    for origin, allowed in (("http://localhost:3000", True), ("http://[::1]", True), ("http://evil.com", False),
                            ("http://localhost.evil.com", False)):
        r = call(server.port, "OPTIONS", "/completion", headers={"Origin": origin,
                                                                  "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200
        assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)
        assert "POST" in r.headers["access-control-allow-methods"]
    r = call(server.port, "GET", "/props", headers={"Origin": "http://localhost:3000", **KEY})
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert call(server.port, "GET", "/props", headers={"Origin": "http://localhost:3000"}).status_code == 401


def test_props_slots_and_models_are_llama_servers(server: Server) -> None:
    props = call(server.port, "GET", "/props", headers=KEY).json()
    assert props["model_path"].endswith(".gguf") and props["total_slots"] == 2
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 128 and settings["params"]["seed"] == 42 and settings["params"]["temperature"] == 0
    slots = call(server.port, "GET", "/slots", headers=KEY).json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 128 and s["is_processing"] is False
                                                       for s in slots)
    model = call(server.port, "GET", "/v1/models", headers=KEY).json()["data"][0]
    assert model["id"] == "alias" and model["aliases"] == ["alias", "tiny"] and model["tags"] == ["t1", "t2"]


def test_metrics_have_llama_cpps_names_and_the_start_time_header(server: Server) -> None:
    out = post(server, "/completion", {"prompt": [5, 6, 7], "n_predict": 4})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.request("GET", "/metrics", headers=KEY)
        r = conn.getresponse()
        text, names = r.read().decode(), [k for k, _ in r.getheaders()]
    finally:
        conn.close()
    assert "Process-Start-Time-Unix" in names  # as llama-server spells it
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    for name in ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total", "requests_processing"):
        assert f"# TYPE llamacpp:{name} " in text
    assert values["llamacpp:tokens_predicted_total"] >= out["timings"]["predicted_n"] == out["tokens_predicted"] > 0
    assert values["llamacpp:n_decode_total"] > 0


def test_completion_has_llama_cpps_fields(server: Server) -> None:
    out = post(server, "/completion", {"prompt": [5, 6, 7], "n_predict": 4, "return_tokens": True})
    assert len(out["tokens"]) == out["tokens_predicted"] == out["timings"]["predicted_n"]
    assert out["generation_settings"]["seed"] == 42 and out["generation_settings"]["n_predict"] == 4
    assert isinstance(out["has_new_line"], bool) and out["truncated"] is False
    picked = post(server, "/completion", {"prompt": [5, 6, 7], "n_predict": 4,
                                          "response_fields": ["content", "generation_settings/n_predict"]})
    assert picked == {"content": out["content"], "generation_settings/n_predict": 4}
    both = call(server.port, "POST", "/completion", {"prompt": [[5, 6, 7], {"prompt_string": "hello"}],
                                                     "n_predict": 4}, headers=KEY).json()
    assert [b["index"] for b in both] == [0, 1] and both[0]["content"] == out["content"]
    r = call(server.port, "POST", "/completion", {"prompt": {"prompt_string": "hi", "multimodal_data": ["x"]}},
             headers=KEY)
    assert r.status_code == 400 and "multimodal" in r.json()["error"]["message"]


def test_streamed_chunks_start_with_content(server: Server) -> None:
    """llama.cpp's /completion stream: every chunk before the last holds a piece and its tokens; chat's first
    chunk is the role with content null."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.request("POST", "/completion", body=json.dumps({"prompt": [5, 6, 7], "n_predict": 4, "stream": True}),
                     headers={"Content-Type": "application/json", **KEY})
        chunks = [json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines()
                  if line.startswith("data: ")]
    finally:
        conn.close()
    assert chunks[-1]["stop"] is True
    assert all(c["content"] and c["tokens"] for c in chunks[:-1]) and len(chunks) > 1
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **KEY})
        first = next(json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines()
                     if line.startswith("data: "))
    finally:
        conn.close()
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert first["system_fingerprint"].startswith("b")


def test_logit_bias_bans_and_is_echoed(server: Server) -> None:
    plain = post(server, "/completion", {"prompt": [5, 6, 7], "n_predict": 1, "return_tokens": True})
    banned = plain["tokens"][0]
    for bias in ([[banned, False]], {str(banned): -100}):  # llama.cpp's pairs (false: banned), OpenAI's object
        out = post(server, "/completion", {"prompt": [5, 6, 7], "n_predict": 1, "return_tokens": True,
                                           "logit_bias": bias})
        assert out["tokens"][0] != banned
    out = post(server, "/completion", {"prompt": [5, 6, 7], "n_predict": 1, "logit_bias": [[banned, False]],
                                       "ignore_eos": True})
    assert {"token": banned, "bias": None} in out["generation_settings"]["logit_bias"]
    r = call(server.port, "POST", "/completion", {"prompt": [5], "logit_bias": [[10**9, 1]]}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_n_choices_and_the_context_error_shape(server: Server) -> None:
    out = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                "n": 3})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in out["choices"]}) == 1  # temp 0: the same choice three times
    r = call(server.port, "POST", "/completion", {"prompt": [5] * 200}, headers=KEY)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (200, 128)


def test_chat_input_tokens_and_verbose(server: Server) -> None:
    chat = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "hi"}]}
    n = post(server, "/chat/completions/input_tokens", chat)["input_tokens"]
    out = post(server, "/v1/chat/completions", {**chat, "max_tokens": 1, "verbose": True})
    assert n == out["usage"]["prompt_tokens"] > 2 and "Book" in out["__verbose"]["prompt"]
    assert "__verbose" not in post(server, "/v1/chat/completions", {**chat, "max_tokens": 1})


def test_no_slots_is_a_501(chat_gguf: Path) -> None:  # noqa: F811
    s = Server(chat_gguf, "-np", "1", "-c", "128", "--no-slots")
    try:
        r = call(s.port, "GET", "/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    finally:
        s.stop()


# ---- llama.cpp's own server tests -----------------------------------------------------------------------

# a CI-sized subset: one or more tests of each area this server answers as llama-server does
SUBSET = [
    "unit/test_basic.py::test_server_props", "unit/test_basic.py::test_server_slots",
    "unit/test_basic.py::test_server_model_aliases_and_tags", "unit/test_tokenize.py::test_tokenize_with_pieces",
    "unit/test_security.py::test_cors_options", "unit/test_security.py::test_incorrect_api_key",
    "unit/test_metrics.py::test_metrics_prometheus_format", "unit/test_completion.py::test_n_probs_stream",
    "unit/test_completion.py::test_completion_response_fields[I believe the meaning of life is-8-response_fields0]",
    "unit/test_ignore_eos.py",
    "unit/test_chat_completion.py::test_chat_completions_multiple_choices",
    "unit/test_compat_gcp.py", "unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry",
    "unit/test_metrics.py::test_metrics_timings_on_prompt_progress",
    "unit/test_slot_save.py::test_slot_save_restore_text_only_on_multimodal",
    "unit/test_embedding.py::test_embedding_single", "unit/test_rerank.py::test_rerank_tei_top_n",
]


@pytest.mark.slow
@pytest.mark.upstream
@pytest.mark.skipif(not (SUITE / "utils.py").exists(), reason=f"llama.cpp's server tests are not at {SUITE}")
def test_llama_cpp_server_tests_subset(smollm2_path: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "WORK_DIR": str(tmp_path / "suite"),
           "SPECEE_MODEL": str(smollm2_path), "LLAMA_SERVER_TESTS": str(SUITE), "PORT": str(18080 + os.getpid() % 1000)}
    out = subprocess.run(["bash", str(REPO / "scripts" / "llama-server-tests.sh"), "specee", *SUBSET], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped, of (\d+)", out.stdout)
    assert counts, out.stdout
    passed, failed, _, total = map(int, counts.groups())
    assert failed == 0 and passed > 0 and total >= len(SUBSET), out.stdout
