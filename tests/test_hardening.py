"""Hostile metadata, memory asked for by header fields, resource limits and small API edges (issue 18): each gives
a clear error (SpecEEError in Python; exit status 1 and one "error:" line from llama-cli), never a crash, garbage or a
machine-sized allocation."""

from __future__ import annotations

import functools
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

import specee
from specee import _core
from specee._tools import tool_path
from specee.convert.retype import Field

from fuzz_gguf import parse, serialize, slots_of, write_seed
from test_bad_input import edited_copy
from kv_probes import kv_cell_pos

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def cli() -> str:
    return str(tool_path("llama-cli"))


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with a SentencePiece vocabulary (the fuzzer's seed), for the runs that tokenize."""
    path = tmp_path_factory.mktemp("vocab") / "spm.gguf"
    write_seed(path, "spm", Q.F32, parts=False, seed=0)
    return path


@pytest.fixture(scope="module")
def bpe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / "bpe.gguf"
    write_seed(path, "bpe", Q.Q4_0, parts=False, seed=1)
    return path


# runs a command (argv[2:]) in a child of its own and writes that child's peak resident memory (KiB) to the file
# descriptor argv[1]: Linux keeps a process's peak across exec, so a child forked by pytest would report pytest's
PEAK_RSS = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
os.write(int(sys.argv[1]), str(usage.ru_maxrss).encode())
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_cli(cli: str, *args: str, stdin: str = "") -> tuple[subprocess.CompletedProcess, float, int]:
    """The run, its seconds and its peak resident memory in bytes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEE_DEFAULT")}
    r, w = os.pipe()
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", PEAK_RSS, str(w), cli, *args], input=stdin, capture_output=True,
                         encoding="utf-8", errors="replace", env=env, pass_fds=(w,), timeout=120)
    seconds = time.monotonic() - t0
    os.close(w)
    with os.fdopen(r) as f:
        rss = int(f.read()) * 1024
    return res, seconds, rss


def error_line(res: subprocess.CompletedProcess) -> str:
    """The one error line of a failed run (exit status 1, no crash)."""
    assert res.returncode == 1, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    return errors[0]


# ---- hyperparameters: the issue's cases, at load, in Python and in the CLI

BAD_METADATA = [
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), V.FLOAT32, "layer_norm_rms_epsilon = nan"),
    ("llama.attention.layer_norm_rms_epsilon", float("-inf"), V.FLOAT32, "layer_norm_rms_epsilon = -inf"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, V.FLOAT32, "layer_norm_rms_epsilon = -1"),
    ("llama.rope.freq_base", 0.0, V.FLOAT32, "freq_base = 0"),
    ("llama.rope.freq_base", float("nan"), V.FLOAT32, "freq_base = nan"),
    ("llama.rope.freq_base", -10000.0, V.FLOAT32, "freq_base = -10000"),
    ("llama.block_count", 1, V.UINT32, "llama.block_count = 1 does not match the file's blk"),
    ("llama.block_count", 3, V.UINT32, "llama.block_count = 3 does not match the file's blk"),  # 3 of 4 layers
    ("llama.block_count", -1, V.INT32, "llama.block_count = -1 is out of range"),
    ("llama.block_count", 50_000_000, V.UINT32, "llama.block_count = 50000000 is out of range"),
    ("llama.context_length", 0xFFFFFFFF, V.UINT32, "llama.context_length = 4294967295 is out of range"),
    ("llama.attention.head_count", 0, V.UINT32, "head_count = 0 is out of range"),
    ("llama.embedding_length", 2**31, V.UINT64, "embedding_length = 2147483648 is out of range"),
]


@pytest.fixture(scope="module")
def bad_files(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("bad_meta")
    return [edited_copy(tiny_gguf, folder / f"bad{i}.gguf", fields={key: Field(value, vtype)})
            for i, (key, value, vtype, _) in enumerate(BAD_METADATA)]


@pytest.mark.parametrize("case", range(len(BAD_METADATA)), ids=[f"{k}={v}" for k, v, _, _ in BAD_METADATA])
def test_bad_hyperparameter_python(bad_files: list[Path], case: int) -> None:
    with pytest.raises(specee.SpecEEError) as err:
        specee.Model(bad_files[case], n_ctx=64, n_threads=1)
    assert BAD_METADATA[case][3] in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", [0, 3, 7, 8, 10], ids=["eps-nan", "freq-0", "blocks-3", "blocks-minus-1", "ctx-max"])
def test_bad_hyperparameter_cli(cli: str, bad_files: list[Path], case: int) -> None:
    res, _, _ = run_cli(cli, "-m", str(bad_files[case]), "-p", "x", "-n", "1", "-t", "1")
    line = error_line(res)
    assert BAD_METADATA[case][3] in line and "bad_alloc" not in res.stderr


@pytest.mark.parametrize("key,value", [("llama.rope.scaling.factor", float("nan")), ("llama.rope.scaling.factor", 0.0),
                                       ("llama.rope.scale_linear", -2.0)])
def test_bad_rope_scaling(tiny_gguf: Path, tmp_path: Path, key: str, value: float) -> None:
    fields = {"llama.rope.scaling.type": Field("linear", V.STRING), key: Field(value, V.FLOAT32)}
    path = edited_copy(tiny_gguf, tmp_path / "rope.gguf", fields=fields)
    with pytest.raises(specee.SpecEEError, match=key.replace(".", r"\.")):
        specee.Model(path, n_ctx=64, n_threads=1)


def test_good_rope_scaling_loads(tiny_gguf: Path, tmp_path: Path) -> None:
    fields = {"llama.rope.scaling.type": Field("linear", V.STRING), "llama.rope.scaling.factor": Field(2.0, V.FLOAT32)}
    m = specee.Model(edited_copy(tiny_gguf, tmp_path / "rope.gguf", fields=fields), n_ctx=64, n_threads=1)
    assert np.isfinite(m.eval([1, 2, 3])).all()


def retyped(src: Path, dst: Path, name: str, qtype: Q) -> Path:
    """src with one F32 tensor stored as another type (its data converted), a consistent file otherwise."""
    p = parse(src)
    for i, (tname, data, ne, _) in enumerate(p.tensors):
        if tname == name:
            values = data.astype(np.float32)
            p.tensors[i] = (tname, values.astype(np.int32) if qtype == Q.I32 else gguf.quants.quantize(values, qtype),
                            ne, qtype)
    dst.write_bytes(serialize(p, dst.with_suffix(".tmp")))
    return dst


@pytest.mark.parametrize("name,qtype,match", [
    ("blk.0.attn_norm.weight", Q.F16, "a vector .* must be F32"),
    ("output_norm.weight", Q.I32, "a vector .* must be F32"),
    ("blk.1.ffn_up.weight", Q.I32, "has type i32, which has no matrix kernels"),
    ("token_embd.weight", Q.I32, "has type i32, which has no matrix kernels"),
])
def test_tensor_types_checked(vocab_gguf: Path, tmp_path: Path, name: str, qtype: Q, match: str) -> None:
    """Types ggml cannot compute with where the tensor is used (found by the fuzzer: SIGSEGV / SIGABRT at the first
    evaluation) are refused at load."""
    with pytest.raises(specee.SpecEEError, match=match):
        specee.Model(retyped(vocab_gguf, tmp_path / "t.gguf", name, qtype), n_ctx=64, n_threads=1)


def test_special_token_ids_outside_the_vocabulary(bpe_gguf: Path, tmp_path: Path, capfd) -> None:
    """Out-of-range BOS / EOS / EOT ids: a warning each, and the model has no such token (never an index past the
    vocabulary); tokenizing and generating still work."""
    fields = {"tokenizer.ggml.eos_token_id": Field(100000, V.UINT32),
              "tokenizer.ggml.eot_token_id": Field(2**31 - 1, V.UINT32),
              "tokenizer.ggml.bos_token_id": Field(-5, V.INT32)}
    p = parse(bpe_gguf)
    p.fields = [f for f in p.fields if f[0] not in fields] + [(k, f.value, f.type, None) for k, f in fields.items()]
    path = tmp_path / "ids.gguf"
    path.write_bytes(serialize(p, tmp_path / "ids.tmp"))
    m = specee.Model(path, n_ctx=64, n_threads=1)
    err = capfd.readouterr().err
    for key, value in (("eos", 100000), ("eot", 2**31 - 1), ("bos", -5)):
        assert f"tokenizer.ggml.{key}_token_id = {value} is not a token id" in err
    assert m.bos == -1 and m.eos == -1
    assert all(0 <= t < m.n_vocab for t in m.eog_tokens)
    tokens = m.tokenize("hello world")
    assert len(m.generate_tokens(tokens, 3, temp=0.0, ignore_eos=True)) == 3


# ---- GGUF errors carry ggml's reason


def patched(src: Path, dst: Path, edits: list[tuple[int, bytes]]) -> Path:
    data = bytearray(src.read_bytes())
    for off, b in edits:
        data[off:off + len(b)] = b
    dst.write_bytes(bytes(data))
    return dst


def test_gguf_reason_duplicate_tensor_name(tiny_gguf: Path, tmp_path: Path) -> None:
    r = gguf.GGUFReader(str(tiny_gguf))
    q, k = (next(t for t in r.tensors if t.name == n) for n in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"))
    name_off = k.field.offset + 8  # the name after its u64 length
    path = patched(tiny_gguf, tmp_path / "dup.bin", [(name_off, q.name.encode())])
    with pytest.raises(specee.SpecEEError, match="corrupt or truncated GGUF file .*duplicate tensor name "
                                                 "'blk.0.attn_q.weight'"):
        specee.Model(path, n_ctx=64, n_threads=1)


def test_gguf_reason_bad_type_and_version(tiny_gguf: Path, tmp_path: Path) -> None:
    slots, _ = slots_of(tiny_gguf)
    slot = next(s for s in slots if s.what == "output_norm.weight type")
    path = patched(tiny_gguf, tmp_path / "type.bin", [(slot.offset, struct.pack("<I", 99))])
    with pytest.raises(specee.SpecEEError, match="tensor 'output_norm.weight' has invalid ggml type 99"):
        specee.Model(path, n_ctx=64, n_threads=1)
    path = patched(tiny_gguf, tmp_path / "version.bin", [(4, struct.pack("<I", 0))])
    with pytest.raises(specee.SpecEEError, match="bad GGUF version: 0"):
        specee.Model(path, n_ctx=64, n_threads=1)


def test_gguf_reason_in_cli(cli: str, tiny_gguf: Path, tmp_path: Path) -> None:
    slots, _ = slots_of(tiny_gguf)
    slot = next(s for s in slots if s.what == "blk.1.ffn_up.weight offset")
    path = patched(tiny_gguf, tmp_path / "offset.bin", [(slot.offset, struct.pack("<Q", 2**40))])
    res, _, _ = run_cli(cli, "-m", str(path), "-p", "x")
    assert "tensor 'blk.1.ffn_up.weight' has offset 1099511627776" in error_line(res)


# ---- memory: the default context, the KV cache size, contexts that do not fit


def test_default_context_is_capped(tiny_gguf: Path, tmp_path: Path) -> None:
    path = edited_copy(tiny_gguf, tmp_path / "long.gguf", fields={"llama.context_length": Field(1 << 20, V.UINT32)})
    m = specee.Model(path, n_threads=1)
    assert m.n_ctx_train == 1 << 20 and m.n_ctx == 4096
    kv_per_cell = 4 * (32 * 2 + 32 * 4)  # 4 layers, K f16 and V f32 rows of 2 KV heads x 16
    assert m.kv_nbytes == 4096 * kv_per_cell
    assert specee.Model(path, n_ctx=8192, n_threads=1).n_ctx == 8192  # more when asked for
    assert specee.Model(tiny_gguf, n_threads=1).n_ctx == 512  # a smaller training context as it is


def test_cli_prints_the_kv_cache_size(cli: str, vocab_gguf: Path) -> None:
    res, _, _ = run_cli(cli, "-m", str(vocab_gguf), "-p", "hello", "-n", "2", "-c", "256", "-t", "1", "-no-cnv")
    assert res.returncode == 0, res.stderr
    kv = 2 * 256 * (16 * 2 + 16 * 4)  # 2 layers, K f16 and V f32 rows of 2 KV heads x 8
    assert f"load: KV cache: size = {kv / 2**20:.2f} MiB (256 cells, 2 layers, K f16, V f32)" in res.stderr


def test_context_larger_than_memory_refused(tiny_gguf: Path) -> None:
    with pytest.raises(specee.SpecEEError, match=r"KV cache of \d+ MiB for n_ctx=2147483647 .* exceeds the "
                                                 r"available memory of CPU, \d+ MiB"):
        specee.Model(tiny_gguf, n_ctx=2**31 - 1, n_threads=1)
    with pytest.raises(ValueError, match="n_ctx"):
        specee.Model(tiny_gguf, n_ctx=2**32, n_threads=1)


@pytest.mark.parametrize("case,args", [
    ("ctx-0xffffffff", ["-c", "0"]),
    ("blocks-5e7", ["-c", "0"]),
    ("c-2e9", ["-c", "2000000000"]),
])
def test_memory_cases_fail_fast_and_small(cli: str, tiny_gguf: Path, bad_files: list[Path], case: str,
                                         args: list[str]) -> None:
    """What once took gigabytes (context_length 0xffffffff: 6 GB in 17 s; block_count 5e7: 3.4 GB; -c 1e6 and more:
    > 6 GB) fails within seconds and under 1 GB of resident memory."""
    model = {"ctx-0xffffffff": bad_files[10], "blocks-5e7": bad_files[9], "c-2e9": tiny_gguf}[case]
    res, seconds, rss = run_cli(cli, "-m", str(model), "-p", "x", "-t", "1", *args)
    line = error_line(res)
    assert seconds < 10 and rss < 1 << 30, (seconds, rss)
    if case == "c-2e9":
        assert "KV cache of 1464844 MiB for n_ctx=2000000000" in line and "exceeds the available memory" in line


def test_prompt_file_limits(cli: str, vocab_gguf: Path, tmp_path: Path) -> None:
    res, _, _ = run_cli(cli, "-m", str(vocab_gguf), "-f", str(tmp_path))
    assert "'" + str(tmp_path) + "'" in error_line(res) and "it is a directory" in res.stderr
    res, seconds, rss = run_cli(cli, "-m", str(vocab_gguf), "-f", "/dev/zero")
    assert "larger than 64 MiB" in error_line(res) and seconds < 10 and rss < 512 << 20
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse
    assert "larger than 64 MiB" in error_line(run_cli(cli, "-m", str(vocab_gguf), "-f", str(big))[0])
    res, _, _ = run_cli(cli, "-m", str(vocab_gguf), "-f", "/dev/stdin", "-n", "1", "-t", "1", "-no-cnv",
                        stdin="hello the world\n")  # a pipe is read too, up to the limit
    assert res.returncode == 0 and "hello the world" in res.stdout, res.stderr


# ---- threads


def test_threads_clamped(cli: str, vocab_gguf: Path, tiny_gguf: Path) -> None:
    """Threads are at most the CPUs this process may use (more wait on each other at every step): the limit follows the
    affinity mask, forced to one CPU in the child processes here, so the check does not depend on the machine."""
    assert _core.max_threads() == min(512, len(os.sched_getaffinity(0)))
    one_cpu = functools.partial(os.sched_setaffinity, 0, {min(os.sched_getaffinity(0))})
    code = ("import warnings, specee\nfrom specee import _core\nwith warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    m = specee.Model({str(tiny_gguf)!r}, n_ctx=64, n_threads=4, n_threads_batch=3)\n"
            "print(_core.max_threads(), m.n_threads, '|'.join(str(x.message) for x in w))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=one_cpu, timeout=120)
    assert res.returncode == 0, res.stderr
    limit, n_threads, warned = res.stdout.strip().split(" ", 2)
    assert (limit, n_threads) == ("1", "1") and "4 threads are more than the 1 CPU(s)" in warned, res.stdout
    argv = [cli, "-m", str(vocab_gguf), "-p", "hello", "-n", "2", "-c", "64", "-t", "4", "-no-cnv"]
    res = subprocess.run(argv, capture_output=True, text=True, errors="replace", preexec_fn=one_cpu, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "warning: -t 4 is more threads than the 1 CPU this process may use: using 1" in res.stderr


# ---- command line


def test_model_path_is_a_directory(cli: str, tmp_path: Path) -> None:
    line = error_line(run_cli(cli, "-m", str(tmp_path), "-p", "x")[0])
    assert "is a directory, not a GGUF model file" in line
    with pytest.raises(IsADirectoryError, match="is a directory"):
        specee.Model(tmp_path)


def test_empty_draft_head_refused(cli: str, vocab_gguf: Path) -> None:
    line = error_line(run_cli(cli, "-m", str(vocab_gguf), "-p", "x", "--draft-head", "")[0])
    assert "invalid value for --draft-head: ''" in line


# ---- the Python API's edges


@pytest.fixture
def tiny(tiny_gguf: Path) -> specee.Model:
    return specee.Model(tiny_gguf, n_ctx=64, n_threads=1)


def test_before_any_evaluation(tiny: specee.Model) -> None:
    for call in (tiny.norm, tiny.hidden):
        with pytest.raises(specee.SpecEEError, match="nothing has been evaluated yet"):
            call()


@pytest.mark.parametrize("layer", [-5, -2, 4, 1000])
def test_hidden_layer_out_of_range(tiny: specee.Model, layer: int) -> None:
    tiny.eval([1, 2, 3])
    with pytest.raises(specee.SpecEEError, match=f"layer {layer} is out of range: -1 .* or 0..3"):
        tiny.hidden(layer)
    assert tiny.hidden(-1).shape == (3, 64)


def test_position_overflow(tiny: specee.Model) -> None:
    tiny.eval([1, 2, 3])
    tiny.eval([4], pos=[2**31 - 1])
    with pytest.raises(specee.SpecEEError, match="position overflow"):
        tiny.eval([5])  # would be position 2**31
    positions = [kv_cell_pos(tiny, c) for c in range(tiny.n_ctx)]  # -1: a free cell
    assert sorted(p for p in positions if p != -1) == [0, 1, 2, 2**31 - 1] and min(positions) == -1
    out = tiny.generate_tokens([1, 2, 3], 2, temp=0.0)  # once crashed on that cache (a negative vector size)
    assert len(out) == 2


def test_seed_minus_one_is_random(tiny: specee.Model) -> None:
    seeds = set()
    for _ in range(3):
        tiny.generate_tokens([1, 2], 1, seed=-1, temp=1.0)
        seeds.add(tiny._gen.seed)
    assert len(seeds) == 3  # random seeds (equal ones: p ~ 1e-9)
    tiny.generate_tokens([1, 2], 1, seed=7, temp=1.0)
    assert tiny._gen.seed == 7
    with pytest.raises(ValueError, match="seed must be"):
        tiny.generate_tokens([1, 2], 1, seed=2**32)
    assert _core.Sampler(seed=-1).sample(np.zeros(4, np.float32)) in range(4)


@pytest.mark.slow
@pytest.mark.parametrize("n_layer", [1, 29])
def test_block_count_below_smollm2_layers(smollm2_path: Path, tmp_path: Path, n_layer: int) -> None:
    """The issue's case: SmolLM2 (30 layers) with block_count 1 or 29 loaded and generated garbage."""
    slot = next(s for s in slots_of(smollm2_path)[0] if s.what == "llama.block_count[0]")
    path = patched(smollm2_path, tmp_path / "blocks.gguf", [(slot.offset, struct.pack(slot.fmt, n_layer))])
    with pytest.raises(specee.SpecEEError, match=f"tensor 'blk.{n_layer}.attn_norm.weight' .* is not one of layers "
                                                 f"0..{n_layer - 1}: llama.block_count = {n_layer} does not match"):
        specee.Model(path, n_ctx=64, n_threads=1)
