"""specee-server against hostile requests (issue 36, HTTP part): every malformed body is a 400 in OpenAI's error shape
on every endpoint (nesting, escaped lone surrogates, any decode error, values of the wrong shape or out of range),
large bodies are tokenized off the event loop (/health answers meanwhile), a request's token count without a limit of
its own gets the server's -n cap (/props shows it), chat roles are checked, and anything unforeseen is an
OpenAI-shaped 500. After every case the server answers a new client. Servers bind 127.0.0.1, every loop is bounded,
each fixture stops its server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from specee.server.request import MAX_BODY, MAX_DEPTH
from test_convert_cli import bpe_dir, bpe_gguf, eagle_state  # noqa: F401 (fixtures of chat_gguf)
from test_server import Reply, Server, call, chat_gguf  # noqa: F401 (chat_gguf: a fixture)

# each POST endpoint with a valid body of its own, which the cases below break
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/completion": {"prompt": "hi", "n_predict": 2},
    "/v1/embeddings": {"input": "hi"},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [5, 6]},
}
# the field of each endpoint's body that holds its text
TEXT_FIELD = {"/v1/completions": "prompt", "/completion": "prompt", "/v1/embeddings": "input", "/tokenize": "content"}


@pytest.fixture(scope="module")
def server(chat_gguf: Path) -> Iterator[Server]:  # noqa: F811
    s = Server(chat_gguf, "-np", "2", "-c", "512", "--mode", "plain", "-a", "tiny")
    yield s
    s.stop()


def assert_answers(server: Server) -> None:
    """The server still serves a new client: /health, and a short greedy completion."""
    assert call(server.port, "GET", "/health").json() == {"status": "ok"}
    r = call(server.port, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def assert_400(r: Reply, says: str = "", param: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"], err
    assert says in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_every_endpoints_own_body_is_served(server: Server) -> None:
    """The bodies the cases break are good ones: each endpoint answers 200 to its own."""
    for path, body in ENDPOINTS.items():
        r = call(server.port, "POST", path, body)
        assert r.status_code == 200, (path, r.text)


# ---- nesting


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path", ENDPOINTS)
def test_deep_nesting_is_a_400_on_every_endpoint(server: Server, path: str) -> None:
    """100,000 levels (Python's decoder gives up with RecursionError), the same under a field, and one level past
    MAX_DEPTH in a field nobody reads; MAX_DEPTH itself is served."""
    for raw in (nested(100_000), '{"x": ' + nested(5_000) + "}", json.dumps({**ENDPOINTS[path], "x": 0})[:-1] +
                ', "extra": ' + nested(MAX_DEPTH) + "}"):
        assert_400(call(server.port, "POST", path, raw=raw.encode()), "nests arrays and objects more than")
    ok = json.dumps({**ENDPOINTS[path]})[:-1] + ', "extra": ' + nested(MAX_DEPTH - 1) + "}"  # the body is level 1
    assert call(server.port, "POST", path, raw=ok.encode()).status_code == 200
    assert_answers(server)


def test_checking_a_body_costs_no_memory_per_value() -> None:
    """The check after the decoder walks containers level by level: a 4 MiB list of 2 million numbers, or of escaped
    surrogate pairs (whose strings are checked), costs at most 10 % over what the decoder itself allocates (a record per
    value cost 125 MB more than the decoder's 21 MB). Allocations counted by tracemalloc, not timed."""
    import tracemalloc

    from specee.server.request import parse_json

    for raw in (("[" + ",".join(["0"] * 2_000_000) + "]").encode(),
                ("[" + ",".join(['"\\ud83d\\ude00"'] * 270_000) + "]").encode()):
        assert len(raw) <= MAX_BODY
        peaks = []
        for decode in (json.loads, parse_json):
            tracemalloc.start()
            value = decode(raw)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            del value
        assert peaks[1] < 1.1 * peaks[0], peaks


def test_a_deep_value_of_the_wrong_type_is_named_briefly(server: Server) -> None:
    """A field's wrong value is shown in the message by its kind or its first 40 characters, never rendered whole (a
    4 MiB string was written out to be cut)."""
    deep = json.loads(nested(MAX_DEPTH - 1))
    err = assert_400(call(server.port, "POST", "/v1/completions", {"prompt": "hi", "temperature": deep}),
                     "'temperature' must be a number >= 0, not a list", "temperature")
    assert len(err["message"]) < 200
    err = assert_400(call(server.port, "POST", "/v1/completions", {"prompt": "hi", "mode": "x" * 100_000}),
                     "'mode' must be one of", "mode")
    assert len(err["message"]) < 300
    assert_answers(server)


# ---- lone surrogates


@pytest.mark.parametrize("path", ENDPOINTS)
def test_an_escaped_lone_surrogate_is_a_400_on_every_endpoint(server: Server, path: str) -> None:
    """Python's JSON decoder turns "\\ud800" into a str no UTF-8 encoder takes (it reached the tokenizer: a 500); it
    is refused with the body, wherever it stands: the text field, a chat message, a key, a field nobody reads."""
    body = json.dumps(ENDPOINTS[path])
    cases = [body[:-1] + ', "extra": "a\\ud800b"}', body[:-1] + ', "a\\udc80": 1}',
             body[:-1] + ', "extra": ["\\udfff"]}']
    if path in TEXT_FIELD:
        cases.append(json.dumps({**ENDPOINTS[path], TEXT_FIELD[path]: "PLACE"}).replace("PLACE", "x\\ud83d"))
    if path == "/v1/chat/completions":
        cases.append(body.replace('"hi"', '"hi \\ud83d"'))
    for raw in cases:
        assert_400(call(server.port, "POST", path, raw=raw.encode()), "lone surrogate")
    # a surrogate pair is one character, and served
    good = json.dumps({**ENDPOINTS[path], "extra": "x"}).replace('"x"', '"\\ud83d\\ude00"')
    assert call(server.port, "POST", path, raw=good.encode()).status_code == 200
    assert_answers(server)


# ---- any other decode error


@pytest.mark.parametrize("path", ENDPOINTS)
def test_any_decode_error_is_a_400_on_every_endpoint(server: Server, path: str) -> None:
    body = json.dumps(ENDPOINTS[path])
    cases = [
        b"",  # empty
        body.encode()[:-1],  # cut short
        b'{"prompt": "\xff\xfe"}',  # not UTF-8
        body.encode("utf-16"),  # JSON between systems is UTF-8 (RFC 8259); Python's decoder took UTF-16
        b"\xef\xbb\xbf" + body.encode(),  # a byte-order mark
        (body[:-1] + ', "extra": ' + "9" * 5000 + "}").encode(),  # an integer over Python's 4300 digits
        b"prompt=hi&max_tokens=2",  # a form
        b"\x00" * 64,
        (body[:-1] + ', "extra": NaN}').encode(),  # Python's decoder takes NaN and Infinity; JSON has neither
        (body[:-1] + ', "extra": [-Infinity]}').encode(),
    ]
    for raw in cases:
        err = assert_400(call(server.port, "POST", path, raw=raw))
        assert "not valid JSON" in err["message"], (raw[:20], err)
    for raw in (b"[1, 2]", b'"hi"', b"null", b"1e999"):  # JSON, but not an object
        assert_400(call(server.port, "POST", path, raw=raw))
    assert_answers(server)


def test_a_wrong_content_type_is_read_as_json_or_refused(server: Server) -> None:
    """As upstream does, the content type is not checked: a JSON body is served whatever it says, another is a 400."""
    body = ENDPOINTS["/v1/completions"]
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "bogus"):
        assert call(server.port, "POST", "/v1/completions", body, headers={"Content-Type": ctype}).status_code == 200
        assert_400(call(server.port, "POST", "/v1/completions", raw=b"prompt=hi", headers={"Content-Type": ctype}))
    assert_answers(server)


# ---- values of the wrong shape, numbers out of range


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [["a"]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2**40]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [["x"]]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "hi", "mode": ["plain"]}, "mode"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e400}, "temperature"),  # inf, written 1e400 below
    ("/v1/completions", {"prompt": "hi", "temperature": 101}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -2}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": -5}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": [1]}, "stream_options"),
    ("/completion", {"prompt": "hi", "n_predict": -2}, "n_predict"),
    ("/completion", {"prompt": "hi", "n_predict": "5"}, "n_predict"),
    ("/completion", {"prompt": "hi", "n_probs": 101}, "n_probs"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "hi"}]}, "messages"),
    ("/v1/embeddings", {"input": {"a": 1}}, "input"),
    ("/v1/embeddings", {"input": ["hi", None]}, "input"),  # ["hi", 5] is one prompt: llama.cpp's mixed ids and text
    ("/v1/embeddings", {"input": ["hi"] * 257}, "input"),
    ("/tokenize", {"content": ["hi"]}, "content"),
    ("/tokenize", {"content": "hi", "add_special": "yes"}, "add_special"),
    ("/detokenize", {"tokens": "5 6"}, "tokens"),
    ("/detokenize", {"tokens": [5, 2**40]}, "tokens"),
])
def test_a_value_of_the_wrong_shape_or_out_of_range_is_a_400(server: Server, path: str, body: dict,
                                                             param: str) -> None:
    raw = json.dumps(body).encode().replace(b"Infinity", b"1e400")  # a number JSON has, which Python reads as inf
    assert_400(call(server.port, "POST", path, raw=raw), param=param)
    assert_answers(server)


# ---- chat roles


def test_chat_roles_must_be_known(server: Server) -> None:
    for role in ("wizard", "", "USER"):
        body = {"messages": [{"role": role, "content": "hi"}], "max_tokens": 2}
        err = assert_400(call(server.port, "POST", "/v1/chat/completions", body), param="messages")
        assert "system, developer, user, assistant, tool" in err["message"]
    body = {"messages": [{"role": 5, "content": "hi"}], "max_tokens": 2}
    assert "system, developer, user, assistant, tool" in assert_400(call(
        server.port, "POST", "/v1/chat/completions", body), param="messages")["message"]
    for role in ("system", "developer", "tool"):
        body = {"messages": [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_tokens": 2}
        assert call(server.port, "POST", "/v1/chat/completions", body).status_code == 200
    assert_answers(server)


# ---- headers


def test_huge_headers_are_refused_and_the_server_lives(server: Server) -> None:
    """A 200 KB header (uvicorn's parser stops at 16 KiB: a 400, or the connection closed while the client still
    sends), 1,000 headers, a bad Content-Length."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
            answer = s.recv(64)
        except (ConnectionResetError, BrokenPipeError):
            answer = b""
        assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer
    many = {f"X-H{i}": "v" for i in range(1000)}  # 11 KB of headers: served
    assert call(server.port, "GET", "/health", headers=many).status_code == 200
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{"prompt": "hi"}')
        assert s.recv(64).startswith(b"HTTP/1.1 400")
    assert_answers(server)


# ---- the event loop


def test_health_answers_while_a_4_mib_word_is_tokenized(server: Server) -> None:
    """One 4 MiB body of a single word to /tokenize (and to /v1/completions and to chat, which tokenize it and then
    refuse it as longer than the slot): /health keeps answering while it is worked on, each within a second
    (tokenizing ran on the event loop and stalled /health for 9-31 s; chat's tokenizer call held the GIL). Bounded:
    at most 2,000 polls of /health per body."""
    word = "ab" * ((MAX_BODY - 128) // 2)
    chat = {"messages": [{"role": "user", "content": word}], "max_tokens": 1}
    for path, body in (("/tokenize", {"content": word}), ("/v1/completions", {"prompt": word, "max_tokens": 1}),
                       ("/v1/chat/completions", chat)):
        raw = json.dumps(body).encode()
        assert len(raw) <= MAX_BODY
        done: dict[str, Reply] = {}
        big = threading.Thread(target=lambda: done.setdefault("r", call(server.port, "POST", path, raw=raw)))
        big.start()
        waits = []
        for _ in range(2000):
            if not big.is_alive():
                break
            t0 = time.perf_counter()
            assert call(server.port, "GET", "/health").status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.005)
        big.join(timeout=120)
        r = done["r"]
        if path == "/tokenize":
            assert r.status_code == 200 and len(r.json()["tokens"]) >= len(word) // 16
        else:
            err = r.json()["error"]  # tokenized, then refused in llama.cpp's shape
            assert r.status_code == 400 and err["type"] == "exceed_context_size_error", r.text
            assert "more than the context allows" in err["message"] and err["n_prompt_tokens"] > err["n_ctx"], err
        assert len(waits) >= 3, waits  # the word took long enough to poll beside it
        assert max(waits) < 1.0, max(waits)
    assert_answers(server)


# ---- the generation cap


@pytest.fixture(scope="module")
def capped(chat_gguf: Path) -> Iterator[Server]:  # noqa: F811
    s = Server(chat_gguf, "-np", "2", "-c", "512", "--mode", "plain", "-n", "5")
    yield s
    s.stop()


def completion_tokens(server: Server, path: str, body: dict) -> tuple[int, str]:
    r = call(server.port, "POST", path, {**body, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    if path == "/completion":
        return out["tokens_predicted"], out["stop_type"]
    return out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]


def test_no_limit_of_its_own_gets_the_servers_n_predict(capped: Server) -> None:
    """-n 5: a request with max_tokens null, absent or -1 generates 5 tokens, one asking for more or fewer gets those
    (llama-server's rule: a request's own limit wins); /props says so."""
    props = call(capped.port, "GET", "/props").json()
    assert props["default_generation_settings"]["n_predict"] == 5
    assert props["default_generation_settings"]["params"]["n_predict"] == 5
    assert props["default_generation_settings"]["n_ctx"] == 256 and props["total_slots"] == 2
    prompt = [5, 6, 7]
    for path, key in (("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                      ("/completion", "n_predict")):
        body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": prompt}
        length = "limit" if path == "/completion" else "length"
        for value, want in ((None, 5), (-1, 5), (100, 100), (3, 3)):
            assert completion_tokens(capped, path, {**body, key: value}) == (want, length), (path, value)
        assert completion_tokens(capped, path, body) == (5, length)
    assert_answers(capped)


def test_without_a_cap_the_slot_is_the_limit(server: Server) -> None:
    """No -n: /props says -1, and a request with no limit of its own runs until its slot (-c 512 over -np 2) is
    full, its prompt included."""
    props = call(server.port, "GET", "/props").json()
    assert props["default_generation_settings"]["n_predict"] == -1
    n_ctx = props["default_generation_settings"]["n_ctx"]
    assert n_ctx == 256
    for value in (None, -1):
        n, finish = completion_tokens(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": value})
        assert finish == "length" and n_ctx - 3 - 8 <= n <= n_ctx - 3 + 1, n  # the last token needs no cell
    assert_answers(server)


def test_the_cap_flag_is_checked() -> None:
    from specee.server import parse_args

    assert parse_args([]).n_predict == -1 and parse_args(["-n", "64"]).n_predict == 64
    assert parse_args(["--n-predict", "0"]).n_predict == 0
    with pytest.raises(SystemExit):
        parse_args(["-n", "-2"])


# ---- whatever else fails


def test_an_unforeseen_failure_is_an_openai_shaped_500() -> None:
    """The guard in front of the routes turns any exception before the response began into OpenAI's error shape
    (status 500, type server_error) instead of a bare 'Internal Server Error'; one after it began is left to the
    server (the connection ends)."""
    from specee.server.app import Guard

    async def failing(scope: dict, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async def late(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")

    class State:
        api_key = None
        cors_origins = ["*"]

    def run(app: Any) -> list[dict]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        asyncio.run(Guard(app, State())(scope, receive, send))
        return sent

    sent = run(failing)
    assert sent[0]["status"] == 500
    err = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert err == {"message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": 500}
    with pytest.raises(RuntimeError):
        run(late)

    async def gone(scope: dict, receive: Any, send: Any) -> None:
        from starlette.requests import ClientDisconnect

        raise ClientDisconnect()

    assert run(gone) == []  # a client gone while its body was read: nobody to answer, nothing logged


def test_a_client_gone_in_the_middle_of_its_body(server: Server) -> None:
    """A body announced at 1 MB, 100 bytes sent, then the connection closed: nothing to answer, and the server
    serves the next client."""
    for path in ENDPOINTS:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n".encode() + b"{" * 100)
    assert_answers(server)
