"""python -m specee.bench.cli: timing-line parsing (specee.perf, both upstream formats), prompt files, a whole run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specee.bench import cli as bench_cli
from specee.bench.perf import parse_perf
from specee._tools import tool_path

UPSTREAM = """\
0.00.753.988 I common_perf_print:        load time =     422.59 ms
0.00.753.990 I common_perf_print: prompt eval time =      49.74 ms /    12 tokens (    4.14 ms per token,   241.25 tokens per second)
0.00.753.992 I common_perf_print:        eval time =     142.06 ms /     8 runs   (   17.76 ms per token,    56.31 tokens per second)
0.00.753.993 I common_perf_print:       total time =     144.34 ms /     9 tokens
"""
OLDER = """\
llama_perf_context_print:        load time =      80.00 ms
llama_perf_context_print: prompt eval time =      10.50 ms /     5 tokens (    2.10 ms per token,   476.19 tokens per second)
llama_perf_context_print:        eval time =    1000.00 ms /    50 runs   (   20.00 ms per token,    50.00 tokens per second)
llama_perf_context_print:       total time =    1012.00 ms /    55 tokens
"""


def test_parse_perf_both_formats() -> None:
    assert parse_perf(UPSTREAM) == (49.74, 12, 142.06, 8)
    assert parse_perf(OLDER) == (10.5, 5, 1000.0, 50)
    with pytest.raises(ValueError, match="eval time"):
        parse_perf("load time = 1 ms\n")


def test_read_prompts(tmp_path: Path) -> None:
    q = tmp_path / "question.jsonl"
    q.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"q{i}", "second"]}) for i in range(5)) + "\n")
    assert bench_cli.read_prompts(str(q), 3) == ["q0", "q1", "q2"]
    t = tmp_path / "prompts.txt"
    t.write_text("one\\ntwo\n\nthree\n")
    assert bench_cli.read_prompts(str(t), 0) == ["one\ntwo", "three"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: not an MT-Bench question line"):
        bench_cli.read_prompts(str(bad), 0)
    with pytest.raises(SystemExit, match="not found"):
        bench_cli.read_prompts(str(tmp_path / "missing.jsonl"), 0)


@pytest.mark.slow
def test_whole_run_against_itself(smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both sides are this runtime's llama-cli (generation needs a real vocabulary): identical texts, counted
    tokens."""
    cli = str(tool_path("llama-cli"))
    out_json = tmp_path / "samples.json"
    rc = bench_cli.main(["-m", str(smollm2_path), "--llama-cli", cli, "--specee-cli", cli, "-p", "Once upon a time",
                         "-n", "6", "--rounds", "2", "--llama-cli-args", "", "--explain", "--json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| Once upon a time | 5 |" in out  # 6 generated: the first comes from the prompt pass, 5 eval runs
    assert "| yes |" in out
    assert "1 of 1 continuations identical" in out
    samples = json.loads(out_json.read_text())
    assert len(samples) == 4 and all(s["eval_runs"] == 5 and s["prompt_tokens"] > 0 for s in samples)
