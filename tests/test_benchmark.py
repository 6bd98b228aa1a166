"""python -m specee.bench.runtime: its tables and its RPC servers, with specee-bench standing in for llama-bench (a
wrapper that drops llama-bench's -ub), so the test needs no upstream build; the comparison itself is the
one in docs/benchmarks.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specee._tools import tool_path


def rpc_servers_running() -> int:
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            n += b"specee-rpc-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            pass
    return n


def fake_llama_bench(tmp_path: Path) -> Path:
    exe = tmp_path / "llama-bench"
    exe.write_text(f"""#!{sys.executable}
import os, sys
argv = sys.argv[1:]
if "-ub" in argv:
    i = argv.index("-ub")
    del argv[i:i + 2]
os.execv({str(tool_path('specee-bench'))!r}, ["specee-bench", *argv])
""")
    exe.chmod(0o755)
    return exe


def benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specee.bench.runtime", *args], capture_output=True, text=True,
                          timeout=300)


def test_pass_cost_table(tiny_gguf: Path, tmp_path: Path) -> None:
    r = benchmark("-m", str(tiny_gguf), "--pass-cost", "4,2", "-n", "2", "-r", "1", "-t", "1",
                  "--llama-bench", str(fake_llama_bench(tmp_path)))
    assert r.returncode == 0, r.stderr
    rows = re.findall(r"^\| tiny-f32\.gguf \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (.*) \|$",
                      r.stdout, re.M)
    assert [int(n) for n, *_ in rows] == [1, 2, 4]  # 1 is added, the sizes sorted
    assert rows[0][3:5] == ("1.00", "1.00")
    marked = [int(n) for n, *_, mark in rows if "draft token" in mark]
    assert len(marked) == 1 and marked[0] in (2, 4)
    assert re.search(r"^\| tiny-f32\.gguf \| tg2 \|", r.stdout, re.M)


def test_rpc_local_starts_and_stops_a_server_per_tool(tiny_gguf: Path, tmp_path: Path) -> None:
    before = rpc_servers_running()
    r = benchmark("-m", str(tiny_gguf), "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-ngl", "0,2", "--rpc-local",
                  "--llama-bench", str(fake_llama_bench(tmp_path)),
                  "--rpc-server", str(tool_path("specee-rpc-server")))
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\| tiny-f32\.gguf \| tg2 ngl0 \|", r.stdout, re.M)
    assert re.search(r"^\| tiny-f32\.gguf \| tg2 ngl2 \|", r.stdout, re.M)
    assert "each tool to its own RPC server on 127.0.0.1" in r.stdout
    assert rpc_servers_running() == before


def test_bad_flags(tiny_gguf: Path) -> None:
    for args, msg in ((["--rpc-local"], "--rpc-local offloads -ngl layers: give -ngl"),
                      (["-ngl", "x"], "expected comma-separated integers"),
                      (["--pass-cost", "0"], "--pass-cost sizes must be >= 1")):
        r = benchmark("-m", str(tiny_gguf), *args)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_acceptance_per_drafted_position() -> None:
    """bench.spec acceptance: P(drafted token j accepted | 1..j-1 accepted) from the tokens each step returned."""
    from specee.bench.spec import parse_tree, position_acceptance

    # steps returning 1 (nothing accepted), 2 (one draft), 3 (two drafts): 4 steps reach position 1, 3 accept it;
    # 3 reach position 2, 1 accepts it; 1 reaches position 3, none accepts it; none reaches position 4 (nan)
    acc = position_acceptance([1, 2, 2, 3], 4)
    assert acc[:3] == [0.75, 1 / 3, 0.0] and acc[3] != acc[3]
    assert position_acceptance([], 1)[0] != position_acceptance([], 1)[0]
    assert parse_tree("4/3/2").total_tokens == 4
    with pytest.raises(SystemExit, match="is not TOTAL/DEPTH/TOPK"):
        parse_tree("4/3")


@pytest.mark.slow
def test_acceptance_command_checks_identity(smollm2_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "specee.bench.spec", "acceptance", "--mt-bench", "1", "--humaneval", "1",
                          "-n", "12", "-t", "1", "--trees", "1/1/1,3/2/2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"MT-Bench: the head on the plain greedy replies \(\d+ positions, teacher-forced\): top-1 "
                     r"[0-9.]+, top-4 [0-9.]+", run.stdout)
    assert "| HumanEval | 3/2/2 |" in run.stdout and run.stdout.count("| 1 of 1 |") == 4


def test_specee_bench_defaults_to_llama_benchs_f16_v_cache(tiny_gguf: Path) -> None:
    # llama-bench's default V cache is F16: specee-bench's default table must measure the same thing
    def type_v(*args: str) -> str:
        out = subprocess.run([str(tool_path("specee-bench")), "-m", str(tiny_gguf), "-p", "0", "-n", "1", "-r", "1",
                              "-t", "1", "--no-warmup", "-o", "json", *args], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        return re.search(r'"type_v": "(\w+)"', out).group(1)

    assert type_v() == "f16"
    assert type_v("-ctv", "f32") == "f32"
