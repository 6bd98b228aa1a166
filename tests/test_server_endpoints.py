"""specee-server's endpoints and fields beside llama-server's: OpenAI's Responses API (/v1/responses, streamed too,
and its input_tokens), Vertex AI's predict route (AIP_MODE=PREDICTION), a slot's cache saved, restored and erased
(--slot-save-path, POST /slots/{id}, file names checked), id_slot, return_progress and timings_per_token in streams, a
request's n_predict over -n (llama-server's rule), --kv-unified, json_object's schema, and the chat and Anthropic
inputs llama-server answers its own way. Servers bind 127.0.0.1 and are stopped by their fixtures; every loop is
bounded."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path
from typing import Iterator

import pytest
from openai import OpenAI

from test_convert_cli import bpe_dir, bpe_gguf  # noqa: F401 (fixtures of chat_gguf: a tiny BPE Llama, its GGUF)
from test_server import TIMEOUT, Server, call, chat_gguf  # noqa: F401 (chat_gguf: a fixture)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(chat_gguf: Path, saved: Path) -> Iterator[Server]:  # noqa: F811
    s = Server(chat_gguf, "-np", "2", "-c", "256", "-b", "8", "--mode", "plain", "--temp", "0", "--seed", "42",
               "-n", "4", "--slot-save-path", str(saved / "dir"))
    yield s
    s.stop()


def post(server: Server, path: str, body: dict) -> dict:
    r = call(server.port, "POST", path, body)
    assert r.status_code == 200, r.text
    return r.json()


def events(server: Server, path: str, body: dict) -> list[dict]:
    """A stream's data objects, read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


def test_responses_answer_as_chat_does(server: Server) -> None:
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6})["choices"][0]["message"]
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    res = client.responses.create(model="x", input=CHAT, max_output_tokens=6)
    assert res.id.startswith("resp_") and res.output[0].id.startswith("msg_")
    assert res.output_text == chat["content"] and res.usage.output_tokens <= 6
    # instructions are the system message; a string input the user's
    alt = post(server, "/v1/responses", {"instructions": "Book", "input": "What is the best book",
                                         "max_output_tokens": 6})
    assert alt["output"][0]["content"][0]["text"] == chat["content"]
    stream = events(server, "/responses", {"input": CHAT, "max_output_tokens": 6, "timings_per_token": True})
    kinds = [e["type"] for e in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e for e in stream if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == chat["content"] == stream[-1]["response"]["output"][0]["content"][
        0]["text"]
    assert all("timings" in e for e in deltas) and "timings" in stream[-1]
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    for bad, param in (({"input": []}, "input"), ({"input": [{"type": "image"}]}, "input"),
                       ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id")):
        r = call(server.port, "POST", "/v1/responses", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_responses_input_tokens_count_the_chat_prompt(server: Server) -> None:
    chat = post(server, "/chat/completions/input_tokens", {"messages": [{"role": "system", "content": "Book"},
                                                                        {"role": "user", "content": "Hi there"}]})
    for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
        assert post(server, path, {"instructions": "Book", "input": "Hi there"}) == chat
    user = post(server, "/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "Hi there"}]})
    assert post(server, "/v1/responses/input_tokens", {"input": "Hi there"}) == user != chat
    r = call(server.port, "POST", "/v1/responses/input_tokens", {"input": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_a_request_n_predict_is_taken_over_the_servers(server: Server) -> None:
    assert post(server, "/completion", {"prompt": [5, 6, 7], "ignore_eos": True})["tokens_predicted"] == 4  # -n
    out = post(server, "/completion", {"prompt": [5, 6, 7], "n_predict": 9, "ignore_eos": True})
    assert out["tokens_predicted"] == 9 == out["generation_settings"]["n_predict"]  # larger than -n 4


def test_completion_prompt_shows_special_tokens_text(server: Server) -> None:
    # as llama-server's: the `prompt` echoed is the prompt's text with its special tokens' text
    text = "<|im_start|>user\nHi<|im_end|>\n"
    assert post(server, "/completion", {"prompt": text, "n_predict": 1})["prompt"] == text


def test_progress_and_timings_in_streams(server: Server) -> None:
    prompt = list(range(60, 80))  # 20 tokens no slot holds yet, prefilled 8 a pass (-b 8)
    chunks = events(server, "/completion", {"prompt": prompt, "n_predict": 2, "return_progress": True,
                                            "timings_per_token": True, "id_slot": 1})
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert [p["processed"] for p in progress] == [0, 8, 16, 20]
    assert all(p["total"] == 20 and p["cache"] == 0 for p in progress)
    ms = [c["timings"]["prompt_ms"] for c in chunks if "prompt_progress" in c]
    assert ms[0] == 0.0 and ms == sorted(ms) and ms[-1] > 0
    assert chunks[-1]["id_slot"] == 1
    # again on the same slot: its cache held all but the last two tokens
    again = events(server, "/completion", {"prompt": prompt, "n_predict": 2, "return_progress": True, "id_slot": 1})
    progress = [c["prompt_progress"] for c in again if "prompt_progress" in c]
    assert progress[0]["cache"] == progress[0]["processed"] == 18 and progress[-1]["processed"] == 20
    assert not any("prompt_progress" in c for c in events(server, "/completion", {"prompt": prompt, "n_predict": 2}))
    # chat's progress chunks: llama.cpp's role delta, a last one with the whole prompt
    chat = events(server, "/chat/completions", {"messages": [{"role": "user", "content": "A test " * 8}],
                                                "max_tokens": 2, "return_progress": True})
    marked = [c for c in chat if "prompt_progress" in c]
    assert len(marked) >= 2 and marked[-1]["prompt_progress"]["processed"] == marked[-1]["prompt_progress"]["total"]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in marked)
    r = call(server.port, "POST", "/completion", {"prompt": prompt, "id_slot": 5})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


def test_a_slot_is_saved_restored_and_erased(server: Server, saved: Path) -> None:
    prompt = list(range(30, 50))
    first = post(server, "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": 1, "ignore_eos": True})
    out = post(server, "/slots/1?action=save", {"filename": "one.bin"})
    assert out["n_saved"] == 23 and out["n_written"] == (saved / "dir" / "one.bin").stat().st_size
    assert post(server, "/slots/0?action=restore", {"filename": "one.bin"})["n_restored"] == 23
    again = post(server, "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": 0, "ignore_eos": True})
    assert again["content"] == first["content"] and again["timings"]["cache_n"] == 18
    assert post(server, "/slots/0?action=erase", {})["n_erased"] >= 23
    for name in ("../one.bin", "/etc/passwd", "..", "a/b", "", 5):
        r = call(server.port, "POST", "/slots/0?action=save", {"filename": name})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename"
    assert sorted(p.name for p in (saved / "dir").iterdir()) == ["one.bin"]
    for path, body, status in (("/slots/0?action=restore", {"filename": "missing.bin"}, 400),
                               ("/slots/0?action=fly", {}, 400), ("/slots/9?action=erase", {}, 400)):
        assert call(server.port, "POST", path, body).status_code == status


def test_slot_actions_need_a_save_path(chat_gguf: Path) -> None:  # noqa: F811
    s = Server(chat_gguf, "-np", "1", "-c", "64")
    try:
        r = call(s.port, "POST", "/slots/0?action=erase", {})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_inputs_llama_server_answers_its_own_way(server: Server) -> None:
    two = CHAT + [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    r = call(server.port, "POST", "/v1/chat/completions", {"messages": two})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    out = post(server, "/v1/messages", {"model": "x", "max_tokens": 2, "messages": []})
    assert out["type"] == "message" and out["usage"]["input_tokens"] > 0
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    r = call(server.port, "POST", "/v1/messages", {"model": "x", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 500 and "image input is not supported" in r.json()["error"]["message"]
    fmt = {"type": "json_object", "schema": {"const": "42"}}
    out = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "response_format": fmt})
    assert out["choices"][0]["message"]["content"] == '"42"'
    r = call(server.port, "POST", "/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_object", "schema": 123}})
    assert r.status_code == 400


def test_gcp_predict_dispatches_each_instance(chat_gguf: Path) -> None:  # noqa: F811
    saved = dict(os.environ)
    os.environ.update(AIP_MODE="PREDICTION", AIP_HEALTH_ROUTE="ready")
    try:
        s = Server(chat_gguf, "-np", "2", "-c", "256", "--temp", "0", "--mode", "plain")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        chat = {"messages": CHAT, "max_tokens": 3}
        direct = call(s.port, "POST", "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
        out = call(s.port, "POST", "/predict", {"instances": [
            {"@requestFormat": "chatCompletions", **chat, "stream": True},
            {"@requestFormat": "/tokenize", "content": "hello"},
            {"@requestFormat": "nothing"}, "not an object"]})
        assert out.status_code == 200
        chat_out, tok, unknown, bad = out.json()["predictions"]
        assert chat_out["choices"][0]["message"]["content"] == direct  # not streamed
        assert tok["tokens"] and unknown["error"]["code"] == 400 and bad["error"]["code"] == 400
        assert call(s.port, "GET", "/ready").status_code == 200
        assert call(s.port, "POST", "/predict", {"instances": 1}).status_code == 400
    finally:
        s.stop()


def test_kv_unified_lets_one_request_use_the_whole_context(chat_gguf: Path) -> None:  # noqa: F811
    s = Server(chat_gguf, "-np", "4", "-c", "128", "--temp", "0", "--mode", "plain", "-kvu")
    try:
        out = post(s, "/completion", {"prompt": [5, 6, 7], "n_predict": 60, "ignore_eos": True})
        assert out["tokens_predicted"] == 60  # more than -c / -np = 32
    finally:
        s.stop()
