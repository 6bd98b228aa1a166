"""python -m specee.bench.grammar: its summary of samples (medians, shares, jump-forward's speedup), its tables, its
command line's refusals, and a whole library run on SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specee.bench import grammar as bench_grammar
from specee.bench.grammar import RUNS, Sample, summarize


def samples_of(case: str, decode_ms: list[float]) -> list[Sample]:
    """One round: the four runs of RUNS with the given decode times; 40 tokens each, the schema's runs 10 ms of masks
    (after the pass) and 1 ms (during it), jump-forward 30 tokens forced in 12 passes."""
    out = []
    for (run, _), ms in zip(RUNS, decode_ms):
        jump = run == RUNS[3][0]
        mask = 0.0 if run == RUNS[0][0] else 10.0 if run == RUNS[1][0] else 1.0
        out.append(Sample(run, case, "{}", 40, 12 if jump else 40, 30 if jump else 0, ms, mask))
    return out


def test_summarize_takes_medians_and_ratios() -> None:
    samples = (samples_of("a", [400, 500, 420, 200]) + samples_of("a", [400, 1000, 440, 220])
               + samples_of("a", [400, 600, 460, 400]) + samples_of("b", [1, 1, 1, 1]))
    s = summarize(samples, "a")
    assert s["unconstrained_tps"] == pytest.approx(100.0)
    assert s["sync_tps"] == pytest.approx(1e3 * 40 / 600)
    assert s["mask_share_sync"] == pytest.approx(10 / 600)
    assert s["mask_share_overlap"] == pytest.approx(1 / 440)
    assert s["mask_ms_per_token"] == pytest.approx(0.25)
    assert s["forced_share"] == pytest.approx(0.75)
    assert s["passes_per_token"] == pytest.approx(0.3)
    assert s["jump_speedup"] == pytest.approx(440 / 220)  # median without over median with
    with pytest.raises(ValueError, match="no samples of .* for case 'c'"):
        summarize(samples, "c")


def test_tables() -> None:
    s = summarize(samples_of("order", [400, 500, 420, 210]), "order")
    table = bench_grammar.library_table({"order": s}).splitlines()
    assert len(table) == 3 and table[2].startswith("| order | 100.0 | 80.0 / 95.2 | 2.0% / 0.2% | 0.250 |")
    assert table[2].endswith("| 75% | 0.30 | 2.00x |")
    rows = bench_grammar.servers_table([("config", 30.0, 20.0, 50.0, 40.0, "3/3, 2/3")]).splitlines()
    assert rows[2] == "| config | 30.0 | 20.0 | 1.50x | 50.0 | 40.0 | 1.25x | 3/3, 2/3 |"
    assert bench_grammar.is_json('{"a":1}') and not bench_grammar.is_json('{"a":')


@pytest.mark.parametrize("argv,message", [
    (["--cases", "order,nope"], "--cases: unknown nope"),
    (["--cases", ","], "--cases: unknown (none given)"),
    (["--rounds", "0"], "--rounds and --max-tokens must be at least 1"),
    (["--llama-server", "/nonexistent/llama-server"], "is not an executable"),
    (["--modes", "eagle2,early-exit"], "--modes: unknown early-exit"),
])
def test_command_line_refusals(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_grammar.parse_args(argv)
    assert message in capsys.readouterr().err


def test_command_line_defaults() -> None:
    args = bench_grammar.parse_args(["--cases", "person,order"])
    assert args.cases == ["person", "order"] and args.rounds >= 1 and args.llama_server is None
    assert args.modes == []
    assert bench_grammar.parse_args(["--modes", "auto,ngram"]).modes == ["auto", "ngram"]
    assert "plain" not in bench_grammar.SPECULATIVE and "eagle2" in bench_grammar.SPECULATIVE


@pytest.mark.slow
def test_whole_library_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One round on one case: the table's row, every run's sample written, the schema's greedy texts equal (the
    bench refuses otherwise), the forced tokens counted."""
    out_json = tmp_path / "samples.json"
    rc = bench_grammar.main(["--cases", "config", "--rounds", "1", "--max-tokens", "24", "-t", "1", "--json",
                             str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| config |" in out and "load average at the end" in out
    samples = json.loads(out_json.read_text())
    assert [s["run"] for s in samples] == [r for r, _ in RUNS]
    assert samples[0]["n_decoded"] == 23  # unconstrained: ignore-EOS, max tokens (the first from the prompt pass)
    assert len({s["text"] for s in samples[1:]}) == 1
    assert samples[3]["n_accepted"] > 0 and samples[3]["n_steps"] < samples[3]["n_decoded"]
    assert samples[1]["t_mask_ms"] > 0


@pytest.mark.slow
def test_modes_run(capsys: pytest.CaptureFixture[str]) -> None:
    """(e) on one case: plain and eagle2, jump-forward off and on, every text plain decoding's (the bench refuses
    otherwise); the rows name the mode and jump-forward, plain without it is the 1.00x baseline."""
    rc = bench_grammar.main(["--cases", "person", "--rounds", "1", "--max-tokens", "24", "-t", "1",
                             "--modes", "eagle2"])
    assert rc == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| person | ")]
    modes = [(r.split(" | ")[1], r.split(" | ")[2]) for r in rows if r.split(" | ")[2] in ("on", "off")]
    assert modes == [("plain", "off"), ("plain", "on"), ("eagle2", "off"), ("eagle2", "on")]
    assert " | plain | off | " in rows[-4] and "| 1.00x |" in rows[-4]
