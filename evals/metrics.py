"""Quality metrics: task scores (GSM8K final number, HumanEval pass@1, QA reference match, ROUGE-L), agreement
with plain greedy decoding, and early-exit statistics. Pure functions on text and token lists; HumanEval's
generated code runs in `sandbox.run_python`, never in this process."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Sequence

from specee.eval.datasets import Sample
from specee.eval.sandbox import run_python

# ---- GSM8K: the final number -------------------------------------------------------------------

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*[:=]?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.I)
BOXED = re.compile(r"\\boxed\{\s*\$?(-?\d[\d,]*(?:\.\d+)?)")


def to_number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The answer a solution ends with: after GSM8K's '####' when present, else the last 'the answer is N' or
    \\boxed{N}, else the last number in the text."""
    if "####" in text:
        found = NUMBER.findall(text.rsplit("####", 1)[1])
        return to_number(found[0]) if found else None
    for pattern in (BOXED, ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return to_number(found[-1])
    found = NUMBER.findall(text)
    return to_number(found[-1]) if found else None


def gsm8k_correct(output: str, reference: str) -> bool:
    want, got = final_number(reference), final_number(output)
    return want is not None and got is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))


# ---- QA: reference match -----------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


# a chosen (capital) letter: "answer is B", "Answer: (B)", "(B)", or "B." / "B)" / "B:" / "B" alone opening a line
CHOICE = re.compile(r"[Aa]nswer\s*(?:is)?\s*[:\-]?\s*\(?([A-Z])\b|\(([A-Z])\)|^\s*([A-Z])\s*(?:[.):]|$)", re.M)


def chosen_label(output: str, labels: Sequence[str]) -> str | None:
    for m in CHOICE.finditer(output):
        label = next(g for g in m.groups() if g)
        if label in labels:
            return label
    return None


def qa_match(output: str, references: Sequence[str], choices: dict[str, str] | None = None,
             answer_key: str | None = None) -> bool:
    """Open questions: a normalized reference answer occurs in the normalized output. Multiple choice: the
    label the output picks is the key; without a label, the output names the right choice's text and no
    other's."""
    if choices and answer_key:
        label = chosen_label(output, list(choices))
        if label is not None:
            return label == answer_key
        out = f" {normalize_answer(output)} "
        named = {k for k, v in choices.items() if normalize_answer(v) and f" {normalize_answer(v)} " in out}
        return named == {answer_key}
    out = f" {normalize_answer(output)} "
    return any(normalize_answer(r) and f" {normalize_answer(r)} " in out for r in references)


# ---- summaries: ROUGE-L ------------------------------------------------------------------------
# Written here rather than taken from `rouge-score`: it is the longest common subsequence of word tokens
# (20 lines), and rouge-score brings nltk and absl along. Tokens as rouge-score makes them without a
# stemmer: lower case, runs of [a-z0-9].


def rouge_tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (beta 1) of the candidate against the reference."""
    c, r = rouge_tokens(candidate), rouge_tokens(reference)
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)


# ---- HumanEval: pass@1 -------------------------------------------------------------------------

FENCE = re.compile(r"```[ \t]*[\w+-]*[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(output: str, entry_point: str) -> str:
    """The code of a chat reply: the fenced block that defines the function (else the first block); without
    fences, the text from the line defining the function (else all of it)."""
    blocks = FENCE.findall(output)
    if blocks:
        return next((b for b in blocks if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", b)), blocks[0])
    m = re.search(rf"^[ \t]*def\s+{re.escape(entry_point)}\s*\(", output, re.M)
    return output[m.start():] if m else output


def humaneval_program(output: str, code_prompt: str, test: str, entry_point: str) -> str:
    """The program that tests a completion: the problem's prompt (imports, helpers, the stub) then the reply's
    code (a whole function replaces the stub; anything else continues its body), the tests and check()."""
    code = extract_code(output, entry_point)
    if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", code):
        body = code_prompt + "\n" + code
    else:
        body = code_prompt + code
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


def humaneval_passed(output: str, sample: Sample, timeout: float = 10.0, unsafe_exec: bool = False) -> bool:
    program = humaneval_program(output, sample.code_prompt or "", sample.test or "", sample.entry_point or "")
    return run_python(program, timeout, unsafe_exec=unsafe_exec).passed


# ---- one score per sample ----------------------------------------------------------------------

SCORE_NAMES = {"gsm8k": "accuracy", "humaneval": "pass@1", "qa": "match", "sum": "rouge_l"}


def task_score(sample: Sample, output: str, timeout: float = 10.0, unsafe_exec: bool = False) -> float | None:
    """The dataset's task score of the reply to the first turn, None where the dataset has none (alpaca,
    mt-bench) or the sample lacks what scoring needs (a reference, HumanEval's tests)."""
    name = sample.dataset
    if name == "gsm8k" and sample.reference:
        return float(gsm8k_correct(output, sample.reference[0]))
    if name == "humaneval" and sample.test and sample.entry_point:
        return float(humaneval_passed(output, sample, timeout, unsafe_exec))
    if name == "qa" and (sample.reference or sample.answer_key):
        return float(qa_match(output, sample.reference, sample.choices, sample.answer_key))
    if name == "sum" and sample.reference:
        return rouge_l(output, sample.reference[0])
    return None


# ---- agreement with plain greedy ---------------------------------------------------------------


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens until the first difference (the common prefix length; the whole length when equal)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(turns: Sequence[Sequence[int]], plain_turns: Sequence[Sequence[int]]) -> tuple[bool, int]:
    """(identical, tokens until the first divergence) over a conversation's turns: a later turn counts only
    when every earlier one was identical (its prompt holds the earlier replies)."""
    n = 0
    for a, b in zip(turns, plain_turns):
        k = first_divergence(a, b)
        n += k
        if list(a) != list(b):
            return False, n
    return len(turns) == len(plain_turns), n


# ---- early exit --------------------------------------------------------------------------------


@dataclass
class ExitStats:
    mean_layers_run: float  # layers evaluated per token (n_layer for a token that did not exit)
    exit_ratio: float  # tokens that exited early / tokens
    exit_precision: float | None  # exited tokens equal to the full model's token / exited tokens


def exit_stats(layers_run: Sequence[int], n_layer: int, exit_correct: Sequence[bool] | None = None) -> ExitStats:
    """layers_run: layers evaluated for each token (n_layer: no exit); exit_correct: per token, whether it
    equals the full model's token (read for the exited tokens only)."""
    if not layers_run:
        return ExitStats(float("nan"), float("nan"), None)
    exited = [i for i, l in enumerate(layers_run) if l < n_layer]
    precision = None
    if exit_correct is not None and exited:
        precision = sum(bool(exit_correct[i]) for i in exited) / len(exited)
    return ExitStats(sum(layers_run) / len(layers_run), len(exited) / len(layers_run), precision)
