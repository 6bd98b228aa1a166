"""python -m specee.autoee regenerate: batched greedy replies in PyTorch equal one-at-a-time greedy decoding, an
interrupted run resumes without duplicating or losing a reply, feature collection takes the stored replies, the
runtime comparison finds the first difference, and bad input ends with one clear error. Tiny models only."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import specee
from specee.autoee import regenerate as R
from specee.autoee.__main__ import main as autoee_main
from specee.autoee.eagle_features import collect, create_store, open_store, reply_prompt
from specee.autoee.sharegpt import read_sharegpt
from test_convert_cli import bpe_dir, bpe_gguf  # noqa: F401 (fixtures: a tiny BPE Llama with a chat template, its GGUF)

WORDS = "the quick brown fox jumps over lazy dog hello world this is a tiny corpus for testing numbers".split()


@pytest.fixture(scope="module")
def chat_gguf(bpe_gguf: Path) -> Path:  # noqa: F811
    """The tiny BPE Llama, whose chat template renders the conversations."""
    return bpe_gguf


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """13 conversations with first user turns of 3 to 27 words (one with a system message); the last one's is too
    long to leave room for a reply at --max-len 128."""
    rng = np.random.default_rng(0)
    items = []
    for i in range(12):
        turns = [{"from": "human", "value": " ".join(rng.choice(WORDS, 3 + 2 * i))},
                 {"from": "gpt", "value": "an answer"}]
        if i == 5:
            turns.insert(0, {"from": "system", "value": "be brief"})
        items.append({"id": f"c{i}", "conversations": turns})
    items.append({"id": "long", "conversations": [{"from": "human", "value": " ".join(rng.choice(WORDS, 200))},
                                                  {"from": "gpt", "value": "x"}]})
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(items))
    return path


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eog: set[int]) -> list[int]:
    """Greedy decoding without a cache: the whole sequence again for every token."""
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new and not (out and out[-1] in eog):
            out.append(int(model(torch.as_tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def test_batched_greedy_equals_one_at_a_time(chat_gguf: Path, data: Path) -> None:
    target = R.load_target(chat_gguf, torch.float32)
    runtime = specee.Model(chat_gguf, n_ctx=128, n_threads=1)
    template = runtime.chat_template()
    prompts = [reply_prompt(runtime, template, c) for c in list(read_sharegpt(data))[:8]]
    budgets = [12, 9, 12, 5, 12, 12, 7, 12]
    free = [reference_greedy(target, p, n, set()) for p, n in zip(prompts, budgets)]
    # an end-of-generation token that ends some replies early and not others
    eog = next({t} for t in free[0][1:] if sum(t in r for r in free) < len(free))
    want = [reference_greedy(target, p, n, eog) for p, n in zip(prompts, budgets)]
    assert len({len(p) for p in prompts}) > 4  # left padding happens
    assert any(r[-1] in eog for r in want) and any(len(r) == n for r, n in zip(want, budgets))
    assert R.greedy_batch(target, prompts, budgets, eog) == want
    assert R.greedy_batch(target, prompts, budgets, eog, slots=3) == want  # slots taken by the next prompt
    assert [R.greedy_batch(target, [p], [n], eog)[0] for p, n in zip(prompts, budgets)] == want


def args_for(chat_gguf: Path, data: Path, work: Path, *extra: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    R.add_arguments(ap)
    return ap.parse_args(["-m", str(chat_gguf), "--data", str(data), "--work-dir", str(work), "--dtype", "f32",
                          "--batch-size", "2", "--max-new", "10", "--max-len", "128", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def uninterrupted(chat_gguf: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("replies")
    R.run(args_for(chat_gguf, data, work))
    return work


@pytest.mark.parametrize("how", ["between replies", "while appending"])
def test_an_interrupted_run_resumes_without_duplicates_or_losses(how: str, chat_gguf: Path, data: Path,
                                                                 uninterrupted: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    full = R.read_replies(uninterrupted)
    assert sorted(full) == list(range(12))  # every conversation but the long one
    assert all(r["prompt_tokens"] and r["reply_tokens"] for r in full.values())
    append = R.append_records
    calls = []

    def interrupting(path: Path, records: list[dict]) -> None:
        calls.append(len(records))
        if len(calls) == 4:
            if how == "while appending":  # half a line
                line = json.dumps(records[0]) + "\n"
                with open(path, "a") as f:
                    f.write(line[:len(line) // 2])
            raise KeyboardInterrupt
        append(path, records)

    with mock.patch.object(R, "append_records", interrupting):
        with pytest.raises(SystemExit, match="run the same command again to continue"):
            R.run(args_for(chat_gguf, data, tmp_path))
    kept = R.read_replies(tmp_path)
    assert len(kept) == 3 and all(kept[i] == full[i] for i in kept)
    assert json.loads((tmp_path / R.STATE).read_text())["n_done"] == min(set(range(13)) - set(kept))
    R.run(args_for(chat_gguf, data, tmp_path))
    lines = (tmp_path / R.REPLIES).read_text().splitlines()
    assert len(lines) == 12 and sorted(json.loads(line)["index"] for line in lines) == list(range(12))
    assert R.read_replies(tmp_path) == full
    capsys.readouterr()
    R.run(args_for(chat_gguf, data, tmp_path))  # all done: nothing more
    assert len((tmp_path / R.REPLIES).read_text().splitlines()) == 12
    assert capsys.readouterr().out.startswith("0 replies, 0 tokens")


def test_collection_takes_the_stored_replies(chat_gguf: Path, data: Path, uninterrupted: Path,
                                             tmp_path: Path) -> None:
    model = specee.Model(chat_gguf, n_ctx=128, n_threads=1)
    template = model.chat_template()
    convs = list(read_sharegpt(data))
    replies = R.open_replies(uninterrupted)
    partial = R.Replies({i: r for i, r in replies.records.items() if i < 5}, 5)  # a run that got as far as 5
    store = create_store(tmp_path / "features", 4096, model.n_embd)
    collect(model, iter(convs), store, template=template, max_len=128, min_len=4, progress=False, replies=partial)
    assert open_store(tmp_path / "features").n_done == 5  # stops where the replies end, for a later call
    collect(model, iter(convs), store, template=template, max_len=128, min_len=4, progress=False, replies=replies)
    store = open_store(tmp_path / "features")
    assert store.n_done == 13 and store.generated == list(range(12))
    for (s, e), i in zip(store.spans(), range(12)):
        r = replies.records[i]
        assert list(store.tokens[s:e]) == r["prompt_tokens"] + r["reply_tokens"]
        assert list(store.assistant[s:e]) == [0] * len(r["prompt_tokens"]) + [1] * len(r["reply_tokens"])
    wrong = R.Replies({0: {**replies.records[0], "id": "another"}}, 1)
    with pytest.raises(ValueError, match="another data file"):
        collect(model, iter(convs), create_store(tmp_path / "f2", 512, model.n_embd), template=template,
                max_len=128, progress=False, replies=wrong)
    other = R.Replies({0: {**replies.records[0], "prompt_tokens": replies.records[0]["prompt_tokens"][1:]}}, 1)
    with pytest.raises(ValueError, match="another model or chat template"):
        collect(model, iter(convs), create_store(tmp_path / "f3", 512, model.n_embd), template=template,
                max_len=128, progress=False, replies=other)


def test_runtime_comparison_finds_the_first_difference(chat_gguf: Path, uninterrupted: Path) -> None:
    runtime = specee.Model(chat_gguf, n_ctx=128, n_threads=1)
    # the runtime's own replies (PyTorch's take the other token at a near-tie here: margin 0.0016, error 0.002)
    records = []
    for r in (R.read_replies(uninterrupted)[i] for i in range(4)):
        reply = runtime.generate_tokens(r["prompt_tokens"], 10, temp=0)
        records.append({**r, "reply_tokens": reply + [runtime.eog_tokens[0]] * (len(reply) < 10)})
    assert R.compare_with_runtime(runtime, records, 128, 10) == R.Comparison([None] * 4, 40, 40)
    changed = [{**r, "reply_tokens": r["reply_tokens"][:3] + [(r["reply_tokens"][3] + 1) % 320]
                + r["reply_tokens"][4:]} for r in records]
    cmp = R.compare_with_runtime(runtime, changed, 128, 10)
    assert cmp.firsts == [3] * 4 and cmp.positions == 40 and cmp.agree <= 36  # position 3, and what follows it
    cut = [{**r, "reply_tokens": r["reply_tokens"][:5] + [runtime.eog_tokens[0]]} for r in records]
    assert R.compare_with_runtime(runtime, cut, 128, 10) == R.Comparison([5] * 4, 20, 24)  # an early end too


def cli(*argv: str) -> str:
    """`python -m specee.autoee regenerate ARGV` in this process: its error message ("" on success)."""
    with mock.patch.object(sys, "argv", ["specee.autoee", "regenerate", *argv]):
        try:
            autoee_main()
        except SystemExit as e:
            return str(e.code or "")
    return ""


def test_bad_input_gives_one_clear_error(chat_gguf: Path, data: Path, uninterrupted: Path, tmp_path: Path) -> None:
    common = ["--work-dir", str(tmp_path / "w"), "--threads", "1"]
    assert cli("-m", str(tmp_path / "missing.gguf"), "--data", str(data), *common) == \
        f"error: model file not found: {tmp_path / 'missing.gguf'}"
    assert cli("-m", str(chat_gguf), "--data", str(tmp_path / "none.json"), *common) == \
        f"error: data file not found: {tmp_path / 'none.json'}"
    for name, text in (("empty.json", "[]"), ("nothing.json", '[{"id": "a", "conversations": []}]')):
        (tmp_path / name).write_text(text)
        msg = cli("-m", str(chat_gguf), "--data", str(tmp_path / name), *common)
        assert msg.startswith(f"error: {tmp_path / name}: no usable conversations") and "\n" not in msg
    msg = cli("-m", str(chat_gguf), "--data", str(data), "--batch-size", "0", *common)
    assert msg.startswith("error: --batch-size")
    msg = cli("-m", str(chat_gguf), "--data", str(data), "--work-dir", str(uninterrupted), "--max-new", "11",
              "--max-len", "128", "--dtype", "f32")
    assert msg.startswith(f"error: {uninterrupted} holds replies made with other settings") and "max_new" in msg
    broken = tmp_path / "broken"
    broken.mkdir()
    lines = (uninterrupted / R.REPLIES).read_text().splitlines(keepends=True)
    (broken / R.REPLIES).write_text(lines[0] + "{not json\n" + lines[1])
    with pytest.raises(ValueError, match="line 2 is not a reply record"):
        R.read_replies(broken)
    (broken / R.REPLIES).write_text(lines[0] + lines[0])
    with pytest.raises(ValueError, match="answered twice"):
        R.read_replies(broken)
    with pytest.raises(FileNotFoundError, match="no replies"):
        R.open_replies(tmp_path / "nowhere")


def test_torch_features_equal_the_runtimes(chat_gguf: Path, uninterrupted: Path, tmp_path: Path) -> None:
    """train-eagle --features torch: PyTorch's forward of the same GGUF gives the runtime's features (F32 file: within
    the runtime's F16 K cache's rounding) and argmax, for every stored reply, in order, resuming where it stopped."""
    from specee.autoee.torch_features import collect_torch, forward_features

    target = R.load_target(chat_gguf, torch.float32)
    runtime = specee.Model(chat_gguf, n_ctx=128, n_threads=1)
    replies = R.open_replies(uninterrupted)
    r = replies.records[3]
    tokens = r["prompt_tokens"] + r["reply_tokens"]
    assert target.config.num_hidden_layers == 2  # the last layer's output is not a feature layer (it comes normed)
    with pytest.raises(ValueError, match="each must be below the last layer"):
        forward_features(target, tokens, [1])
    norm, feats3, argmax = forward_features(target, tokens, [0, 0])
    logits = runtime.eval(tokens, output="all")
    assert np.abs(norm - runtime.norm()).max() < 2e-2 and (argmax == logits.argmax(-1)).mean() > 0.95
    runtime.kv_clear()
    runtime.eval(tokens, hidden_all=True, logits=False)
    assert np.abs(feats3 - np.concatenate([runtime.hidden(0), runtime.hidden(0)], -1)).max() < 2e-2

    partial = R.Replies({i: rec for i, rec in replies.records.items() if i < 5}, 5)
    store = create_store(tmp_path / "features", 4096, runtime.n_embd)
    feats3_store = np.lib.format.open_memmap(tmp_path / "features3.npy", "w+", np.float16, (4096, 2 * runtime.n_embd))
    early = R.Replies({i: rec for i, rec in replies.records.items() if i < 5 or i == 7}, 5)  # 7 ended before 5, 6
    collect_torch(target, early, store, max_len=128, features3=feats3_store, layers=[0, 0], progress=False)
    assert store.n_done == 5 and len(store.offsets) == 5  # 7 waits until every conversation before it is done
    collect_torch(target, replies, store, max_len=128, features3=feats3_store, layers=[0, 0], progress=False)
    assert store.n_done == replies.n_done and store.generated == list(range(12))
    for (s, e), i in zip(store.spans(), range(12)):
        rec = replies.records[i]
        assert list(store.tokens[s:e]) == (rec["prompt_tokens"] + rec["reply_tokens"])[:128]
        n, ids = e - s, list(store.tokens[s:e])
        norm_i, f3_i, arg_i = forward_features(target, ids, [0, 0])
        assert np.array_equal(store.features[s:e], norm_i.astype(np.float16)) and np.array_equal(store.targets[s:e],
                                                                                                   arg_i)
        assert np.array_equal(feats3_store[s:e], f3_i.astype(np.float16)) and n == len(ids)


def test_train_eagle_collects_torch_features_of_the_replies(chat_gguf: Path, uninterrupted: Path,
                                                            tmp_path: Path) -> None:
    base = ["train-eagle", "-m", str(chat_gguf), "--collect-only", "--work-dir", str(tmp_path), "--max-len", "128",
            "--threads", "1", "--no-features3", "--features", "torch"]
    with mock.patch.object(sys, "argv", ["specee.autoee", *base]):
        with pytest.raises(SystemExit, match="give --replies DIR"):
            autoee_main()
    with mock.patch.object(sys, "argv", ["specee.autoee", *base, "--replies", str(uninterrupted)]):
        autoee_main()
    store = open_store(tmp_path / "features")
    replies = R.open_replies(uninterrupted)
    assert store.generated == list(range(12)) and store.n_done == replies.n_done
    s, e = store.spans()[2]
    assert list(store.tokens[s:e]) == replies.records[2]["prompt_tokens"] + replies.records[2]["reply_tokens"]
