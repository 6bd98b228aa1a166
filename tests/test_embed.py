"""Embeddings and reranking: the library's pooling table (none, mean, cls, last, rank), Model.embed and Slots.embed
against the final-norm rows of the text's own evaluation, the file's {arch}.pooling_type as the default, a reranker's
classifier head; specee-server's --pooling and --reranking (/v1/embeddings, /embeddings, /rerank in Jina's
and TEI's shapes, their 400s); and, when SPECEE_UPSTREAM_BIN names upstream llama.cpp's binaries, the same embeddings
and scores as its llama-server on SmolLM2. Every server runs on 127.0.0.1 and is stopped by its test."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import pytest

import specee
from specee import _core
from specee.pooling import POOLINGS
from test_server import Server, call, start_llama_server

TEXTS = ["Hello world, a text of more than eight tokens", "x y"]


def copy_gguf(src: Path, dst: Path, keys: dict[str, int] | None = None,
              tensors: dict[str, np.ndarray] | None = None) -> Path:
    """src (tensors of any type) with uint32 keys and F32 tensors added."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.get_field("general.architecture").contents()))
    for field in r.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        w.add_key_value(field.name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for key, value in (keys or {}).items():
        w.add_uint32(key, value)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, data in (tensors or {}).items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def model(bpe_f32_gguf: Path) -> Iterator[specee.Model]:
    with specee.Model(bpe_f32_gguf, n_ctx=128, n_batch=8, n_threads=1) as m:
        yield m


def rows_of(m: specee.Model, text: str) -> np.ndarray:
    """The text's final-norm rows [n_tokens, n_embd], evaluated alone (in chunks of n_batch)."""
    m.kv_clear()
    toks, rows = m.tokenize(text), []
    for i in range(0, len(toks), m.n_batch):
        m.eval(toks[i : i + m.n_batch], logits=False)
        rows.append(m.norm())
    m.kv_clear()
    return np.concatenate(rows)


# ---- the library


def test_the_pooling_table_is_llama_cpp_s_numbering() -> None:
    """The table's order is the GGUF key's numbers (llama.cpp's enum llama_pooling_type); only pooled vectors are
    normalised."""
    assert list(POOLINGS) == [p["name"] for p in _core.poolings()] == ["none", "mean", "cls", "last", "rank"]
    assert [n for n, p in POOLINGS.items() if p.normalized] == ["mean", "cls", "last"]


def test_each_pooling_pools_the_text_s_own_final_norm_rows(model: specee.Model) -> None:
    rows = rows_of(model, TEXTS[0])
    assert len(rows) > model.n_batch
    want = {"none": rows, "mean": rows.mean(axis=0), "cls": rows[0], "last": rows[-1], "rank": rows[-1][:1]}
    for name, w in want.items():
        np.testing.assert_array_equal(model.embed(TEXTS[0], normalize=False, pooling=name), w, err_msg=name)
        got = model.embed(TEXTS[0], pooling=name)  # normalize: pooled vectors only
        np.testing.assert_allclose(got, w / np.linalg.norm(w) if POOLINGS[name].normalized else w, rtol=1e-6,
                                   atol=1e-7, err_msg=name)
    assert model.embed(TEXTS, pooling="last").shape == (2, model.n_embd)
    assert model.embed(TEXTS, pooling="rank").shape == (2, 1)
    parts = model.embed(TEXTS, pooling="none")
    assert [p.shape for p in parts] == [(len(model.tokenize(t)), model.n_embd) for t in TEXTS]
    np.testing.assert_array_equal(parts[0], rows)
    with pytest.raises(ValueError, match="unknown pooling 'max': expected one of none, mean, cls, last, rank"):
        model.embed("x", pooling="max")


def test_the_slots_pool_as_the_model_does(model: specee.Model) -> None:
    slots = model.slots(2)
    toks = model.tokenize(TEXTS[0])
    for name in POOLINGS:
        np.testing.assert_allclose(slots.embed(toks, name), model.embed(TEXTS[0], normalize=False, pooling=name),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="unknown pooling"):
        slots.embed(toks, "max")
    with pytest.raises(specee.SpecEEError, match="empty text"):
        slots.embed([], "last")


def test_the_file_s_pooling_type_is_the_default(bpe_f32_gguf: Path, model: specee.Model, tmp_path: Path) -> None:
    assert model.pooling == "mean"
    np.testing.assert_array_equal(model.embed(TEXTS[0]), model.embed(TEXTS[0], pooling="mean"))
    with specee.Model(copy_gguf(bpe_f32_gguf, tmp_path / "last.gguf", {"llama.pooling_type": 3}), n_ctx=64,
                      n_threads=1) as m:
        assert m.pooling == "last"
        np.testing.assert_array_equal(m.embed(TEXTS), m.embed(TEXTS, pooling="last"))
        np.testing.assert_array_equal(m.slots(1).embed(m.tokenize(TEXTS[0])),
                                      m.embed(TEXTS[0], normalize=False, pooling="last"))
    with pytest.raises(specee.SpecEEError, match=r"llama.pooling_type = 9 is out of range"):
        specee.Model(copy_gguf(bpe_f32_gguf, tmp_path / "bad.gguf", {"llama.pooling_type": 9}), n_ctx=64, n_threads=1)


def test_rank_pooling_runs_the_file_s_classifier_head(bpe_f32_gguf: Path, model: specee.Model, tmp_path: Path) -> None:
    """A reranker's head as llama.cpp's build_pooling runs it: tanh(cls h + b), then cls.output [labels] (+ b), on the
    last token's final-norm row h; cls.output alone is a projection of h. Other poolings do not read it."""
    n, rng = model.n_embd, np.random.default_rng(0)
    h = rows_of(model, TEXTS[0])[-1].astype(np.float64)
    w, b, w_out, b_out = (rng.standard_normal(s).astype(np.float32) for s in ((n, n), (n,), (2, n), (2,)))
    heads = {"both": ({"cls.weight": w, "cls.bias": b, "cls.output.weight": w_out, "cls.output.bias": b_out},
                      w_out @ np.tanh(w @ h + b) + b_out),
             "out": ({"cls.output.weight": w_out[:1]}, w_out[:1] @ h)}
    for name, (tensors, want) in heads.items():
        with specee.Model(copy_gguf(bpe_f32_gguf, tmp_path / f"{name}.gguf", tensors=tensors), n_ctx=64,
                          n_threads=1) as m:
            np.testing.assert_allclose(m.embed(TEXTS[0], pooling="rank"), want, rtol=1e-4, atol=1e-4, err_msg=name)
            np.testing.assert_allclose(m.slots(1).embed(m.tokenize(TEXTS[0]), "rank"), want, rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(m.embed("x", pooling="mean"), model.embed("x", pooling="mean"))
    with pytest.raises(specee.SpecEEError, match="classifier bias without its weight"):
        specee.Model(copy_gguf(bpe_f32_gguf, tmp_path / "bias.gguf", tensors={"cls.bias": b}), n_ctx=64, n_threads=1)


# ---- specee-server


def rank_scores(m: specee.Model, query: str, docs: list[str]) -> list[float]:
    """Each document's rank score as llama.cpp's server lays out the pair for a vocabulary without EOS or SEP to add
    (SmolLM2, the fuzzer's BPE): the query's tokens (BOS as the vocabulary asks), then the document's."""
    slots = m.slots(1)
    return [float(slots.embed(m.tokenize(query) + m.tokenize(d, add_special=False), "rank")[0]) for d in docs]


def post(server: Server, path: str, body: Any) -> tuple[int, Any]:
    r = call(server.port, "POST", path, body)
    return r.status_code, r.json()


@pytest.fixture
def started(bpe_f32_gguf: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def start(*args: str) -> Server:
        servers.append(Server(bpe_f32_gguf, "-np", "2", "-c", "256", *args))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_server_pools_as_the_model(started: Any, model: specee.Model) -> None:
    s = started("--pooling", "last")
    want = model.embed(TEXTS, pooling="last")
    status, body = post(s, "/v1/embeddings", {"input": TEXTS})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1]
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, rtol=1e-5, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(len(model.tokenize(t)) for t in TEXTS)
    status, body = post(s, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert status == 200 and body["data"][0]["encoding_format"] == "base64"
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4"), want[0],
                               rtol=1e-5, atol=1e-6)
    assert post(s, "/v1/embeddings", {"input": "x", "encoding_format": "int8"})[0] == 400
    raw = model.embed(TEXTS[0], normalize=False, pooling="last").astype(np.float64)
    for p, scaled in ((-1, raw), (0, raw * 32760 / np.abs(raw).max()), (1, raw / np.abs(raw).sum()),
                      (3, raw / (np.abs(raw) ** 3).sum() ** (1 / 3))):
        status, body = post(s, "/v1/embeddings", {"input": TEXTS[0], "embd_normalize": p})
        assert status == 200
        np.testing.assert_allclose(body["data"][0]["embedding"], scaled, rtol=1e-4, atol=1e-4, err_msg=str(p))
    assert post(s, "/v1/embeddings", {"input": "x", "embd_normalize": -2})[0] == 400
    status, body = post(s, "/embeddings", {"content": TEXTS[1]})  # llama.cpp's shape: one row per pooled text
    assert status == 200 and body[0]["index"] == 0
    np.testing.assert_allclose(body[0]["embedding"], want[1:], rtol=1e-5, atol=1e-6)
    status, body = post(s, "/rerank", {"query": "a", "documents": ["b"]})
    assert status == 501 and "--reranking" in body["error"]["message"]


def test_server_pooling_none_gives_every_row_at_slash_embeddings(started: Any, model: specee.Model) -> None:
    s = started("--pooling", "none")
    status, body = post(s, "/v1/embeddings", {"input": TEXTS[0]})
    assert status == 400 and "not OAI compatible" in body["error"]["message"]
    status, body = post(s, "/embeddings", {"input": TEXTS[0]})
    assert status == 200
    np.testing.assert_allclose(body[0]["embedding"], rows_of(model, TEXTS[0]), rtol=1e-5, atol=1e-6)


def test_server_reranks(started: Any, bpe_f32_gguf: Path, model: specee.Model) -> None:
    s = started("--reranking")
    query, docs = "hello", ["world wide", "x", "a longer document than the others"]
    scores = rank_scores(model, query, docs)
    assert len({round(x, 4) for x in scores}) == len(docs)  # distinct: the order below means something
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    status, body = post(s, "/v1/rerank", {"query": query, "documents": docs})
    assert status == 200 and body["object"] == "list"
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [scores[i] for i in order],
                               rtol=1e-4, atol=1e-5)
    n = sum(len(model.tokenize(query)) + len(model.tokenize(d, add_special=False)) for d in docs)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    status, body = post(s, "/rerank", {"query": query, "texts": docs, "top_n": 2, "return_text": True})
    assert status == 200 and [(r["index"], r["text"]) for r in body] == [(i, docs[i]) for i in order[:2]]
    assert set(body[0]) == {"index", "score", "text"}
    for bad in ({"query": query, "documents": []}, {"query": query, "documents": None}, {"query": query},
                {"query": query, "documents": [1, 2]}, {"documents": ["a"]}, {"query": 5, "documents": ["a"]},
                {"query": query, "documents": ["a"], "top_n": -1}, {"query": query, "documents": ["a"], "top_n": "2"}):
        status, body = post(s, "/reranking", bad)
        assert status == 400 and "error" in body, bad
    assert post(s, "/v1/embeddings", {"input": "x"})[0] == 400  # a scoring server embeds nothing


def test_server_flags_pooling_and_normalize(bpe_f32_gguf: Path) -> None:
    from specee.server import parse_args

    args = parse_args(["--pooling", "cls", "--embd-normalize", "1"])
    assert (args.pooling, args.embd_normalize) == ("cls", 1)
    assert (parse_args([]).pooling, parse_args([]).embd_normalize) == (None, 2)  # None: the model's own
    assert parse_args(["--pooling", "none", "--rerank"]).pooling == "rank"
    for argv, message in ((["--pooling", "max"], "--pooling max: expected one of none, mean, cls, last, rank"),
                          (["--embd-normalize", "x"], "--embd-normalize x: expected an integer >= -1")):
        r = subprocess.run([sys.executable, "-m", "specee.server", "-m", str(bpe_f32_gguf), *argv],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr


# ---- upstream llama.cpp's llama-server on SmolLM2


@pytest.fixture
def upstream_server(smollm2_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen] = []
    yield lambda *args: start_llama_server(procs, smollm2_path, "-c", "512", *args)
    for p in procs:
        p.terminate()
        p.wait(timeout=15)


def test_the_same_embeddings_and_scores_as_upstream(upstream_server: Any, smollm2_path: Path) -> None:
    """llama-server --pooling last and --reranking on SmolLM2 against Model.embed with an F16 V cache (upstream's):
    cosine > 0.999 for every text, the same score for each document. One document per /rerank request: upstream
    batches a request's documents in one pass and then reads each one's score at the wrong place for a model without
    a classifier head (SmolLM2: the three scores of three documents are the first three elements of one document's
    row), so only its single-document scores are each document's own."""
    texts = ["I believe the meaning of life is", "hello world", "Paris est une grande ville"]
    port = upstream_server("--embedding", "--pooling", "last")
    up = [d["embedding"] for d in call(port, "POST", "/v1/embeddings", {"input": texts}).json()["data"]]
    with specee.Model(smollm2_path, n_ctx=512, n_threads=1, type_v="f16") as m:
        ours = m.embed(texts, pooling="last")
        scores = rank_scores(m, "Machine learning is", texts)
    for a, b in zip(up, ours):
        assert float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999
    port = upstream_server("--reranking")
    up_scores = [call(port, "POST", "/rerank", {"query": "Machine learning is", "documents": [d]}).json()["results"][0]
                 ["relevance_score"] for d in texts]
    np.testing.assert_allclose(up_scores, scores, rtol=1e-3, atol=1e-3)
