"""llama-cli (csrc/tools/specee-cli.cpp), the drop-in for upstream llama.cpp's llama-cli: every flag, the errors,
the timing lines that evaluation scripts parse, and conversation mode in a terminal (a pty).

Generation needs a real vocabulary, so those tests run SmolLM2 (marked slow); the tiny fixture model has none
and checks the error for that case."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import specee
from specee._tools import tool_path

# the lines SpecEE's evaluation scripts parse (its eval_on_*_dataset.py use the total-time one)
TOTAL_RE = re.compile(r"llama_perf_context_print:\s*total time\s*=\s*(\d+\.?\d*)\s*ms\s*/\s*(\d+)\s*tokens")
PROMPT_RE = re.compile(r"llama_perf_context_print: prompt eval time =\s+(\d+\.\d{2}) ms /\s+(\d+) tokens "
                       r"\(\s*(\S+) ms per token,\s+(\S+) tokens per second\)")
EVAL_RE = re.compile(r"llama_perf_context_print:        eval time =\s+(\d+\.\d{2}) ms /\s+(\d+) runs   "
                     r"\(\s*(\S+) ms per token,\s+(\S+) tokens per second\)")
LOAD_RE = re.compile(r"llama_perf_context_print:        load time =\s+(\d+\.\d{2}) ms\n")

FAST = ["-c", "256", "-t", "2"]  # small context, fixed threads: quick runs


@pytest.fixture(scope="module")
def cli() -> str:
    return str(tool_path("llama-cli"))


def run(cli: str, *args: str, stdin: str | None = None, env: dict | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs llama-cli with stdin not a terminal (so conversation mode stays off unless asked for)."""
    full_env = dict(os.environ)
    full_env.pop("SPECEE_DEFAULT_MODEL", None)
    full_env.pop("SPECEE_DEFAULT_DRAFT_HEAD", None)
    full_env.update(env or {})
    # a run cut short by -n may end inside a UTF-8 sequence, printed as it is
    return subprocess.run([cli, *args], input=stdin if stdin is not None else "", capture_output=True,
                          encoding="utf-8", errors="replace", env=full_env, timeout=timeout)


def perf(stderr: str) -> dict:
    """The numbers of the timing lines; fails when one is missing or malformed."""
    load, prompt, evals, total = (r.search(stderr) for r in (LOAD_RE, PROMPT_RE, EVAL_RE, TOTAL_RE))
    assert load and prompt and evals and total, f"timing lines missing from stderr:\n{stderr}"
    return dict(load_ms=float(load.group(1)), prompt_ms=float(prompt.group(1)), n_prompt=int(prompt.group(2)),
                eval_ms=float(evals.group(1)), n_eval=int(evals.group(2)), total_ms=float(total.group(1)),
                n_total=int(total.group(2)))


# ---- command line: help, unknown and malformed flags, files (no model loaded)


def help_flags(text: str) -> list[tuple[str, bool]]:
    """(flag, takes a value) for every flag the help lists: lines that start with flags, then an upper-case
    placeholder (FNAME, N, ...) when the flags take a value."""
    flags = []
    for line in text.splitlines():
        names, takes_value = [], False
        for word in line.split():
            if re.fullmatch(r"-{1,2}[a-zA-Z][\w-]*,?", word):
                names.append(word.rstrip(","))
            elif re.fullmatch(r"[A-Z][A-Z_]*(\S*)", word) and names:  # FNAME, N, TOKEN_ID(+/-)BIAS
                takes_value = True
                break
            else:
                break
        flags += [(name, takes_value) for name in names]
    return flags


def test_help_lists_only_working_flags(cli: str, tmp_path: Path) -> None:
    res = run(cli, "--help")
    assert res.returncode == 0
    flags = dict(help_flags(res.stdout))
    expected = ["-m", "--model", "-p", "--prompt", "-f", "--file", "-n", "--n-predict", "-c", "--ctx-size", "-b",
                "--batch-size", "-ub", "--ubatch-size", "-t", "--threads", "-s", "--seed", "--temp",
                "--temperature", "--top-k",
                "--top_k", "--top-p", "--top_p", "--min-p", "--min_p", "--repeat-penalty", "--repeat-last-n", "-e",
                "--escape", "--no-escape", "-ngl", "--n-gpu-layers", "--gpu-layers", "-cnv", "--conversation",
                "-no-cnv", "--no-conversation", "-st", "--single-turn", "-sys", "--system-prompt",
                "--chat-template", "--verbose-prompt", "--no-display-prompt", "-sp", "--special", "-h", "--help",
                "-ctv", "--cache-type-v", "--mode", "--draft-head", "--eagle-choices", "--eagle_choices",
                "--eagle-total-tokens", "--eagle-depth", "--eagle-topk", "--eagle_dynamic_tree_max_top_k",
                "--eagle-replay", "--exit-threshold", "--exit-layers", "--no-exit-dynamic", "--exit-kv", "--exit-replay",
                "--exit-check",
                "-fa", "--flash-attn", "--ignore-eos", "--offload-order", "-ts", "--tensor-split", "-dev", "--device",
                "--list-devices", "--rpc", "-tb", "--threads-batch", "--no-mmap", "--ngram-n-min", "--ngram-n-max",
                "--ngram-draft-max", "--spec-ngram-mod-n-max", "--ngram-branches", "--no-ngram-adaptive", "--spec-type",
                "--ngram-cache",
                "--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file", "--grammar-type",
                "--no-jump-forward", "--no-grammar-overlap", "--grammar-limit", "-l", "--logit-bias",
                "-md", "--model-draft", "--spec-draft-model", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft",
                "--spec-draft-ngl", "--draft-n-max", "--draft-max", "--draft", "--draft-n", "--spec-draft-n-max", "--draft-n-min",
                "--draft-min", "--spec-draft-n-min", "--draft-p-min", "--spec-draft-p-min", "--draft-synth-rates",
                "--spec-synth-rates", "--lora", "--lora-scaled", "--lora-init-without-apply", "--kernels"]
    assert sorted(flags) == sorted(expected)
    assert run(cli, "-h").stdout == res.stdout
    # every listed flag is accepted: the run gets as far as opening the (missing) model
    values = {"-f": str(tmp_path / "prompt.txt"), "--file": str(tmp_path / "prompt.txt"), "--chat-template": "chatml",
              "--top-p": "0.5", "--top_p": "0.5", "--min-p": "0.1", "--min_p": "0.1", "--repeat-penalty": "1.1",
              "-ctv": "f32", "--cache-type-v": "f16", "--mode": "plain", "--draft-head": str(tmp_path / "head.gguf"),
              "--eagle-choices": "[[0]]", "--eagle_choices": "[[0], [1]]", "--exit-threshold": "0.5",
              "--exit-layers": "16,20", "--exit-kv": "fill", "--exit-replay": "3,4", "--eagle-replay": "3,1", "-fa": "on",
              "--flash-attn": "on", "--offload-order": "first", "-ts": "1,1", "--tensor-split": "3,1",
              "--spec-type": "ngram-simple", "--ngram-n-max": "4", "--grammar-file": str(tmp_path / "prompt.txt"),
              "-jf": str(tmp_path / "prompt.txt"), "--json-schema-file": str(tmp_path / "prompt.txt"),
              "--grammar-type": "gbnf", "-l": "15043+1", "--logit-bias": "2-inf,7+0.5", "--draft-p-min": "0.5",
              "--spec-draft-p-min": "0.5", "--lora-scaled": "adapter.gguf:0.5", "--kernels": "off",
              "--grammar-limit": "max_depth=32"}
    (tmp_path / "prompt.txt").write_text("hello\n")
    missing = str(tmp_path / "missing.gguf")
    for flag, takes_value in flags.items():
        if flag in ("-h", "--help", "-m", "--model", "--list-devices"):
            continue
        args = [flag, values.get(flag, "1")] if takes_value else [flag]
        res = run(cli, *args, "-m", missing)
        assert res.returncode == 1 and "cannot open model file" in res.stderr, (flag, res.stderr)


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown argument: --bogus"),
    (["-x", "1"], "unknown argument: -x"),
    (["positional"], "unknown argument: positional"),
    (["-p"], "-p needs a value"),
    (["-m", "m.gguf", "-n"], "-n needs a value"),
    (["-n", "ten"], "invalid value for -n: 'ten'"),
    (["-n", "-3"], "invalid value for -n"),
    (["-c", "1.5"], "invalid value for -c"),
    (["-c", "-1"], "invalid value for -c"),
    (["-b", "0"], "invalid value for -b"),
    (["-ub", "x"], "invalid value for -ub"),
    (["-t", ""], "invalid value for -t"),
    (["-s", "abc"], "invalid value for -s"),
    (["-s", "4294967296"], "invalid value for -s"),
    (["--temp", "hot"], "invalid value for --temp"),
    (["--top-k", "2.5"], "invalid value for --top-k"),
    (["--top-p", "0"], "invalid value for --top-p"),
    (["--top_p", "1.5"], "invalid value for --top_p"),
    (["--min-p", "-0.1"], "invalid value for --min-p"),
    (["--repeat-penalty", "0"], "invalid value for --repeat-penalty"),
    (["--repeat-penalty", "inf"], "invalid value for --repeat-penalty"),
    (["--repeat-last-n", "-2"], "invalid value for --repeat-last-n"),
    (["-ngl", "all"], "invalid value for -ngl"),
    (["--grammar-limit", "max_depth"], "invalid value for --grammar-limit: 'max_depth' (expected NAME=INTEGER)"),
    (["--grammar-limit", "max_depth=0"], "max_depth must be >= 1, not 0"),
    (["--grammar-limit", "max_nests=3"], "invalid value for --grammar-limit: 'max_nests=3'"),
    (["--chat-template", "alpaca", "-m", "m.gguf"], "unknown chat template 'alpaca'"),
    (["--draft-head", "default", "-m", "m.gguf"], "SPECEE_DEFAULT_DRAFT_HEAD is not set"),
])
def test_bad_flags(cli: str, args: list[str], message: str) -> None:
    res = run(cli, *args)
    assert res.returncode == 1
    assert message in res.stderr
    assert "llama_perf" not in res.stderr


def test_missing_model_file(cli: str, tmp_path: Path) -> None:
    res = run(cli, "-m", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert res.returncode == 1
    assert f"cannot open model file '{tmp_path / 'nope.gguf'}'" in res.stderr


def test_no_model(cli: str) -> None:
    res = run(cli, "-p", "hi")
    assert res.returncode == 1
    assert "no model given" in res.stderr and "SPECEE_DEFAULT_MODEL" in res.stderr


def test_not_a_model(cli: str, tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a model at all\n" * 10)
    res = run(cli, "-m", str(path), "-p", "hi")
    assert res.returncode == 1
    assert "failed to load the model" in res.stderr


def test_missing_prompt_file(cli: str, tmp_path: Path) -> None:
    res = run(cli, "-f", str(tmp_path / "none.txt"))
    assert res.returncode == 1
    assert "invalid value for -f" in res.stderr and "a readable prompt file" in res.stderr


def test_model_without_vocabulary(cli: str, tiny_gguf: Path) -> None:
    """The tiny fixture GGUF has token ids only: a clear error, not a crash."""
    res = run(cli, "-m", str(tiny_gguf), "-p", "hello", "-n", "4", "-ngl", "0", *FAST)
    assert res.returncode == 1
    assert "error:" in res.stderr and "tokenize" in res.stderr


# ---- generation with SmolLM2


@pytest.mark.slow
def test_completion_and_timings(cli: str, smollm2_path: Path) -> None:
    prompt = "The capital of France is"
    res = run(cli, "-m", str(smollm2_path), "-p", prompt, "-n", "12", "--temp", "0", "--top-k", "0", "-s", "8",
              "-e", "-ub", "1024", *FAST)  # the flags of SpecEE's own evaluation scripts
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(prompt)
    assert len(res.stdout) > len(prompt) + 4
    p = perf(res.stderr)
    assert p["n_prompt"] == 5  # "The capital of France is" in SmolLM2's vocabulary, no BOS (add_bos_token false)
    assert p["n_eval"] == 11  # the 12th token is sampled but not evaluated
    assert p["n_total"] == p["n_prompt"] + p["n_eval"]
    assert p["total_ms"] >= p["prompt_ms"] + p["eval_ms"]
    assert p["load_ms"] > 0
    assert TOTAL_RE.search(res.stderr)
    assert re.search(r"llama_perf_sampler_print:    sampling time =\s+\d+\.\d{2} ms /\s+12 runs", res.stderr)


@pytest.mark.slow
def test_greedy_is_deterministic_and_batching_agnostic(cli: str, smollm2_path: Path) -> None:
    """Same output with the prompt prefilled in one graph or in chunks of 2 tokens (-b, -ub)."""
    args = ["-m", str(smollm2_path), "-p", "Here is a list of fruits: apple, banana,", "-n", "10", "--temp", "0"]
    a = run(cli, *args, *FAST)
    b = run(cli, *args, "--ctx-size", "256", "--threads", "2", "--batch-size", "3", "--ubatch-size", "2")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout
    pa, pb = perf(a.stderr), perf(b.stderr)
    assert pa["n_total"] == pb["n_total"]


@pytest.mark.slow
def test_seeded_sampling_reproducible(cli: str, smollm2_path: Path) -> None:
    base = ["--model", str(smollm2_path), "--prompt", "Once upon a time", "--n-predict", "16", "--temp", "1.0",
            "--repeat-penalty", "1.1", "--repeat-last-n", "32", *FAST]
    a = run(cli, *base, "--seed", "42", "--top-k", "30", "--top-p", "0.9", "--min-p", "0.02")
    b = run(cli, *base, "-s", "42", "--top_k", "30", "--top_p", "0.9", "--min_p", "0.02")  # underscore spellings
    c = run(cli, *base, "-s", "43", "--top_k", "30", "--top_p", "0.9", "--min_p", "0.02")
    assert a.returncode == 0 and b.returncode == 0 and c.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout
    assert "sampler seed: 42" in a.stderr


@pytest.mark.slow
def test_escapes_prompt_file_and_display(cli: str, smollm2_path: Path, tmp_path: Path) -> None:
    m = ["-m", str(smollm2_path), "-n", "1", "--temp", "0", *FAST]
    escaped = run(cli, *m, "-p", r"line one\nline two\t\\x", "--escape")
    assert escaped.returncode == 0
    assert escaped.stdout.startswith("line one\nline two\t\\x")
    raw = run(cli, *m, "-p", r"line one\nline two", "--no-escape")
    assert raw.stdout.startswith(r"line one\nline two")

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("A prompt from a file\n")
    from_file = run(cli, *m, "-f", str(prompt), "--verbose-prompt")
    assert from_file.returncode == 0
    assert from_file.stdout.startswith("A prompt from a file")
    assert not from_file.stdout.startswith("A prompt from a file\n")  # one trailing newline dropped
    assert "main: prompt: 'A prompt from a file'" in from_file.stderr
    assert re.search(r"number of tokens in prompt = \d+\n\s+\d+ -> 'A'", from_file.stderr)

    hidden = run(cli, *m, "--file", str(prompt), "--no-display-prompt")
    assert hidden.returncode == 0
    assert "A prompt from a file" not in hidden.stdout


@pytest.mark.slow
def test_gpu_layers_without_a_device_stay_on_the_cpu(cli: str, smollm2_path: Path) -> None:
    for flag in ("-ngl", "--n-gpu-layers", "--gpu-layers"):
        res = run(cli, "-m", str(smollm2_path), "-p", "Hi", "-n", "1", flag, "16", *FAST)
        assert res.returncode == 0
        assert res.stderr.count("note: -ngl 16: no device to offload to") == 1
        assert "load: CPU: layers 0-29, output" in res.stderr


@pytest.mark.slow
def test_until_context_full(cli: str, smollm2_path: Path) -> None:
    """-n -1 stops at an end-of-generation token or when the context is full."""
    res = run(cli, "-m", str(smollm2_path), "-p", "Count: 1 2 3", "-n", "-1", "--temp", "0", "-c", "24", "-t", "2")
    assert res.returncode == 0
    p = perf(res.stderr)
    assert p["n_total"] <= 24
    assert "context full" in res.stderr or "[end of text]" in res.stdout


@pytest.mark.slow
def test_prompt_longer_than_context(cli: str, smollm2_path: Path) -> None:
    res = run(cli, "-m", str(smollm2_path), "-p", "word " * 100, "-c", "32", "-n", "4")
    assert res.returncode == 1
    assert re.search(r"the prompt has \d+ tokens, which does not fit the context of 32", res.stderr)
    assert "llama_perf" not in res.stderr


@pytest.mark.slow
def test_default_model_from_environment(cli: str, smollm2_path: Path) -> None:
    res = run(cli, "-p", "Hi", "-n", "2", *FAST, env={"SPECEE_DEFAULT_MODEL": str(smollm2_path)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Hi")


@pytest.mark.slow
def test_console_script_sets_default_model(smollm2_path: Path) -> None:
    script = shutil.which("specee-cli")
    if script is None:
        pytest.skip("the specee-cli console script is not on PATH")
    env = {k: v for k, v in os.environ.items() if k != "SPECEE_DEFAULT_MODEL"}
    res = subprocess.run([script, "-p", "Hi", "-n", "2", *FAST], input="", capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Hi")
    assert TOTAL_RE.search(res.stderr)


@pytest.mark.slow
def test_console_script_default_draft_head_and_flash_attn_flag(smollm2_path: Path) -> None:
    """--draft-head default --mode early-exit: the shipped head + exit predictors, so greedy decoding exits early (the
    perf lines say so); -fa on/off is accepted like upstream's (off with a warning: attention is always flash)."""
    script = shutil.which("specee-cli")
    if script is None:
        pytest.skip("the specee-cli console script is not on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEE_DEFAULT")}
    res = subprocess.run([script, "-p", "The capital of France is", "-n", "16", "--temp", "0", "--draft-head",
                          "default", "--mode", "early-exit", "-fa", "on", *FAST], input="", capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert re.search(r"early exit =\s+\d+ tokens, exit ratio [0-9.]+, mean layers run [0-9.]+ of 30", res.stderr)
    assert "exit histogram = layers run:tokens" in res.stderr and "mode early-exit (SpecEE): lossy" in res.stderr
    plain = subprocess.run([script, "-p", "The capital of France is", "-n", "4", "--temp", "0", "-fa", "off", *FAST],
                           input="", capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert "warning: -fa off is ignored" in plain.stderr and "early exit" not in plain.stderr


@pytest.mark.slow
def test_ignore_eos_runs_to_n_with_and_without_speculation(cli: str, smollm2_path: Path) -> None:
    """A reply that ends after ~23 tokens goes on to -n with --ignore-eos (as upstream: end-of-generation
    tokens get a -inf logit); speculative greedy output with the same flag equals plain greedy output."""
    from specee.bench.spec import default_head

    base = ["-m", str(smollm2_path), "-p", "Say hi.", "-cnv", "-st", "--temp", "0", "-n", "40", "-ctv", "f32", *FAST]
    ends = run(cli, *base)
    assert ends.returncode == 0 and perf(ends.stderr)["n_eval"] < 39, ends.stderr
    plain = run(cli, *base, "--ignore-eos")
    assert plain.returncode == 0 and perf(plain.stderr)["n_eval"] == 39, plain.stderr
    assert plain.stdout.startswith(ends.stdout.rstrip("\n")[:40])
    for tree in (["--mode", "eagle2"], ["--mode", "eagle", "--eagle-choices", "[[0], [1], [0, 0]]"]):
        spec = run(cli, *base, "--ignore-eos", "--draft-head", default_head(), *tree)
        assert spec.returncode == 0 and spec.stdout == plain.stdout, (tree, spec.stderr[-500:])


@pytest.mark.slow
def test_conversation_from_stdin(cli: str, smollm2_path: Path) -> None:
    """-cnv reads user lines from stdin (here a pipe), answers each, and ends at end of input. The second turn
    evaluates only what the cache lacks: the end-of-turn token the reply stopped at and the new user turn."""
    res = run(cli, "-m", str(smollm2_path), "-cnv", "-sys", "Answer in one short sentence.", "-n", "24", "--temp",
              "0", "--verbose-prompt", *FAST, stdin="What is the capital of France?\nAnd of Italy?\n")
    assert res.returncode == 0, res.stderr
    turns = res.stdout.split("\n> ")
    assert len(turns) == 4, res.stdout  # banner, two answers, then end of input
    assert "Paris" in turns[1] and "Rome" in turns[2]
    assert turns[3].startswith("EOF by user")
    assert "chat template: smollm2" in res.stderr
    sizes = [int(n) for n in re.findall(r"number of tokens in prompt = (\d+)", res.stderr)]
    assert len(sizes) == 2
    second = res.stderr.split("main: prompt: 'And of Italy?'")[1]
    assert re.match(r"\nmain: number of tokens in prompt = 15\n\s+2 -> '<\|im_end\|>'\n\s+198 -> '\n'\n\s+1 -> "
                    r"'<\|im_start\|>'\n\s+4093 -> 'user'", second), second
    assert perf(res.stderr)["n_prompt"] == sum(sizes)


@pytest.mark.slow
def test_conversation_prompt_single_turn(cli: str, smollm2_path: Path) -> None:
    """-p pre-starts the conversation; -st answers it and exits without reading stdin."""
    res = run(cli, "-m", str(smollm2_path), "--conversation", "--single-turn", "-p", "Say hello.", "-n", "16",
              "--temp", "0", *FAST, stdin="this line is never read\n")
    assert res.returncode == 0, res.stderr
    assert "\n> " not in res.stdout
    # the echoed prompt is the rendered template with special tokens hidden, as upstream prints it
    assert res.stdout.startswith("system\nYou are a helpful AI assistant named SmolLM")
    assert "user\nSay hello.\nassistant\n" in res.stdout


@pytest.mark.slow
def test_single_turn_from_stdin_and_chat_template(cli: str, smollm2_path: Path) -> None:
    res = run(cli, "-m", str(smollm2_path), "-cnv", "-st", "--chat-template", "chatml", "-n", "16", "--temp", "0",
              *FAST, stdin="Hi!\nsecond line is not read\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\n> ") == 1
    assert "EOF by user" not in res.stdout
    assert "chat template: chatml" in res.stderr


@pytest.mark.slow
def test_special_tokens_shown(cli: str, smollm2_path: Path) -> None:
    args = ["-m", str(smollm2_path), "-cnv", "-st", "--chat-template", "chatml", "-p", "Hi!", "-n", "1", "--temp", "0",
            *FAST]
    shown = run(cli, *args, "--special")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    hidden = run(cli, *args)
    assert hidden.stdout.startswith("user\nHi!\nassistant\n")


@pytest.mark.slow
def test_no_conversation(cli: str, smollm2_path: Path) -> None:
    res = run(cli, "-m", str(smollm2_path), "-no-cnv", "--no-conversation", "-p", "Hi", "-n", "2", *FAST)
    assert res.returncode == 0
    assert res.stdout.startswith("Hi")
    assert "conversation mode" not in res.stderr


# ---- conversation in a terminal


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """A program on a pseudo-terminal of its own (pty, from the standard library): it is the session leader and
    the terminal its controlling one, so Ctrl-C typed there is a SIGINT from the terminal, as for a user."""

    def __init__(self, argv: list[str], stderr: Path) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: stderr to the file, then the program
            try:
                err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(err, 2)
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.out = b""
        self.status: int | None = None

    def read(self) -> None:
        while select.select([self.fd], [], [], 0)[0]:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # the program is gone (EIO)
                chunk = b""
            if not chunk:
                break
            self.out += chunk

    def screen(self) -> str:
        """Everything shown so far, without colours and carriage returns."""
        self.read()
        return ANSI.sub("", self.out.decode(errors="replace")).replace("\r", "")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_for(self, predicate, timeout: float) -> str:
        deadline = time.time() + timeout
        while True:
            screen = self.screen()
            if predicate(screen) or time.time() > deadline:
                return screen
            time.sleep(0.2)

    def wait_exit(self, timeout: float) -> int | None:
        deadline = time.time() + timeout
        while self.status is None and time.time() < deadline:
            self.read()
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            time.sleep(0.2)
        return self.status

    def close(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.mark.slow
def test_conversation_in_terminal(cli: str, smollm2_path: Path, tmp_path: Path) -> None:
    """In a terminal, with a model that has a chat template, conversation mode is on by default: a '> ' prompt,
    a reply to what the user types, a second turn on the same cache; Ctrl-C during a reply stops it and the
    conversation goes on; Ctrl-C at the prompt ends it, with the timings."""
    err = tmp_path / "stderr.txt"
    term = Terminal([cli, "-m", str(smollm2_path), "-n", "400", "--temp", "0", "-c", "2048", "-t", "1"], err)
    try:
        screen = term.wait_for(lambda s: s.rstrip().endswith(">"), 120)
        assert screen.rstrip().endswith(">"), screen
        term.type("What is the capital of France?\n")
        screen = term.wait_for(lambda s: s.count("\n> ") >= 2 and s.rstrip().endswith(">"), 300)
        reply = screen.split("What is the capital of France?", 1)[1].rsplit("\n> ", 1)[0]
        # the reply is the model's greedy answer to that turn (what the Python API gives for it)
        want = specee.Model(smollm2_path, n_ctx=2048, n_threads=1).generate(
            [{"role": "user", "content": "What is the capital of France?"}], 400, temp=0)
        assert " ".join(reply.split()) == " ".join(want.split()), screen
        # a long reply, stopped by Ctrl-C: the prompt comes back at once
        term.type("Write a very long story about a dragon and a knight.\n")
        # (the line must have been read before Ctrl-C: a terminal's SIGINT discards the input not yet read)
        term.wait_for(lambda s: len(s.partition("dragon and a knight.")[2].strip()) > 40, 120)
        term.type("\x03")
        screen = term.wait_for(lambda s: s.count("\n> ") >= 3 and s.rstrip().endswith(">"), 60)
        story = screen.split("dragon and a knight.", 1)[1].rsplit("\n> ", 1)[0]
        assert screen.rstrip().endswith(">") and len(story.split()) < 300, screen
        term.type("And what is the capital of Germany?\n")
        screen = term.wait_for(lambda s: s.count("\n> ") >= 4 and s.rstrip().endswith(">"), 300)
        reply = screen.split("capital of Germany?", 1)[1].rsplit("\n> ", 1)[0]
        assert sum(c.isalpha() for c in reply) >= 3, screen  # the conversation goes on, on the same cache
        term.type("\x03")  # at the prompt: the end
        assert term.wait_exit(60) == 0, term.screen()
        stderr = err.read_text()
        assert "enabling conversation mode" in stderr
        p = perf(stderr)
        assert p["n_prompt"] > 0 and p["n_eval"] > 0
    finally:
        term.close()
