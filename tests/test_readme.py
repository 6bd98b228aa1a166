"""Every command block of the README and of docs/*.md runs, with small limits, so a documented command that breaks
fails here.

Each ```bash block runs in order in a folder laid out like the repository (autoee/ and tests/ linked), after
placeholders are given stand-ins (a tiny Hugging Face folder for MODEL_DIR and Llama-2-7b-chat-hf, an EAGLE head and
predictors for it, a PEFT LoRA adapter for PEFT_DIR, a SpecEE-style eauto file, the default model for MODEL.gguf and
SmolLM2.gguf, SpecEE's question files for questions/, small synthetic files) and the limits are cut (tokens,
prompts, repetitions, training steps, the synthetic file's shape). Blocks that are output samples are ```text and do
not run. The set-up commands are what CI runs before the tests (.ci/run). Commands that need upstream llama.cpp
(PATH/TO/...) run when SPECEE_UPSTREAM_BIN names the folder of its binaries and are skipped otherwise; blocks that
name questions/ are skipped where SpecEE's question files are absent; every other command must be covered by a rule
below, so a new one cannot slip by."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import load_hf
from specee._tools import free_port
from specee.paths import default_model_path
from test_convert_cli import bpe_dir, eagle_state, make_eauto, predictor_state, spm_dir  # noqa: F401 (fixtures)
from test_lora import write_peft

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
QUESTIONS = REPO.parent / "shared" / "data" / "specee-bench"  # SpecEE's question files, where this machine has them
SET_UP = ("./install.sh", "python3 -m pip install -r tests/requirements.txt", "python3 -m pytest -q -rs")
README_MAX_LINES = 350

SYNTH_SHAPE = ["--layers", "32", "--embd", "256", "--ff", "512", "--heads", "4", "--vocab", "512"]  # 32: replays


def bash_blocks(path: Path) -> list[list[str]]:
    """A markdown file's bash blocks as lists of commands (continuations joined, comments dropped, && split)."""
    blocks = []
    for body in re.findall(r"^ *```bash\n(.*?)^ *```", path.read_text(), re.S | re.M):
        commands = []
        for line in body.replace("\\\n", " ").splitlines():
            if "#" in line:  # drop the comment, keep the quoting
                line = " ".join(t if t in ("&", "&&") else shlex.quote(t) for t in shlex.split(line, comments=True))
            commands += [c.strip() for c in line.split("&&") if c.strip()]
        blocks.append([c for c in commands if c not in SET_UP and not c.startswith("./install.sh")])
    return blocks


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with FLAG's value replaced, or FLAG VALUE appended."""
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value]


def flag_value(argv: list[str], *flags: str) -> str | None:
    for flag in flags:
        if flag in argv[:-1]:
            return argv[argv.index(flag) + 1]
    return None


def executable(name: str) -> str:
    """The interpreter running the tests, and the console scripts installed beside it (as a user runs them);
    upstream's tools by their path."""
    if Path(name).is_absolute():
        return name
    if name in ("python", "python3"):
        return sys.executable
    script = Path(sys.executable).parent / name
    assert script.is_file(), f"{name} is not installed beside {sys.executable}"
    return str(script)


def python_module(argv: list[str]) -> tuple[str, str]:
    """(module, subcommand) of `python -m MODULE [SUB]`, benchmarks by their new name; ("", "") otherwise."""
    if argv[:2] not in (["python", "-m"], ["python3", "-m"]) or len(argv) < 3:
        return "", ""
    return argv[2], argv[3] if len(argv) > 3 else ""


def autoee_work_dir(argv: list[str], work: Path) -> list[str]:
    """The exit predictors' work dir inside the test's folder (never the user's cache); commands that name the
    same --work-dir share it, as they do for a user."""
    name = Path(flag_value(argv, "--work-dir") or "default").name
    return set_flag(argv, "--work-dir", str(work / "autoee-work" / name))


def bench_limits(argv: list[str]) -> list[str]:
    """specee-bench and llama-bench: a few tokens, one repetition."""
    out = set_flag(set_flag(set_flag(argv, "-p", "8"), "-n", "4"), "-r", "1")
    return set_flag(out, "-d", "8") if "-d" in out else out


def limit(argv: list[str], work: Path) -> list[str]:
    """The same command with small limits."""
    prog = Path(argv[0]).name
    module, sub = python_module(argv)
    if prog in ("specee-cli", "llama-cli"):
        return set_flag(argv, "-n", "8") if "--list-devices" not in argv else argv
    if prog in ("specee-bench", "llama-bench"):
        return bench_limits(argv)
    if prog == "specee-rpc-server":
        return argv + ["--timeout", "600"]
    if module == "specee.convert" and sub == "synth":  # a few MiB instead of 3.6 GiB, same code
        return argv + SYNTH_SHAPE + (["--draft-vocab", "256"] if "--draft-head" in argv else [])
    if module == "specee.convert":
        return argv
    if module == "specee.autoee" and sub == "regenerate":  # two replies of a few tokens
        out = set_flag(set_flag(set_flag(argv, "--limit", "2"), "--max-new", "4"), "--batch-size", "2")
        out = set_flag(out, "--compare-runtime", "1") if "--compare-runtime" in out else out
        return autoee_work_dir(set_flag(out, "--threads", "1"), work)
    if module == "specee.autoee" and sub == "train-eagle":
        replies = flag_value(argv, "--replies")  # what `regenerate --work-dir` wrote, in the test's folder
        out = argv + ["--max-tokens", "3000", "--max-len", "128", "--steps", "2", "--threads", "1",
                      "--work-dir", str(work / ("train-eagle-replies" if replies else "train-eagle"))]
        return set_flag(out, "--replies", str(work / "autoee-work" / Path(replies).name)) if replies else out
    if module == "specee.autoee" and sub == "collect":
        rows = 24 * (1 + int(flag_value(argv, "--tree-depth") or 0))  # a position is a row per depth
        out = set_flag(set_flag(set_flag(argv, "--max-new", "8"), "--max-tokens", str(rows)), "--threads", "1")
        out = set_flag(out, "--questions-per-file", "1") if "--questions" in out else out
        return autoee_work_dir(out, work)
    if module == "specee.autoee" and sub == "train":
        return autoee_work_dir(set_flag(set_flag(argv, "--epochs", "1"), "--threads", "1"), work)
    if module == "specee.autoee" and sub in ("select-layers", "export"):
        return autoee_work_dir(set_flag(argv, "--threads", "1"), work)
    if module == "specee.bench.spec":  # at most one prompt of each set the command asks for
        out = set_flag(set_flag(argv, "-n", "8"), "-t", "1")
        for flag in ("--mt-bench", "--humaneval"):
            out = set_flag(out, flag, "0" if flag in argv and argv[argv.index(flag) + 1] == "0" else "1")
        return set_flag(out, "--rounds", "1") if "--rounds" in out else out
    if module == "specee.eval":
        return set_flag(set_flag(set_flag(argv, "--limit", "1"), "-n", "8"), "-t", "1")
    if module == "specee.bench.modes":  # one round of a few tokens, at most one MT-Bench prompt
        out = set_flag(set_flag(set_flag(argv, "-n", "4"), "-t", "1"), "--rounds", "1")
        return set_flag(out, "--mt-bench", "0" if flag_value(argv, "--mt-bench") == "0" else "1")
    if module == "specee.bench.runtime":
        out = set_flag(set_flag(set_flag(argv, "-r", "1"), "-t", "1"), "--rounds", "1")
        for flag, value in (("-p", "8"), ("-n", "4")):
            out = set_flag(out, flag, value) if flag in out else out
        return out
    if argv[:2] in (["python", "tests/fuzz_gguf.py"], ["python3", "tests/fuzz_gguf.py"]):
        return set_flag(set_flag(argv, "--random", "100"), "--out", str(work / "fuzz"))
    if argv[:2] in (["python", "tests/fuzz_rpc.py"], ["python3", "tests/fuzz_rpc.py"]):
        return set_flag(set_flag(argv, "--messages", "200"), "--out", str(work / "fuzz-rpc"))
    if argv[:2] in (["python", "tests/fuzz_lora.py"], ["python3", "tests/fuzz_lora.py"]):  # 50 random inputs
        out = set_flag(set_flag(argv, "--random", "50"), "--out", str(work / "fuzz-lora"))
        return out if "--no-boundary" in out else [*out, "--no-boundary"]
    if argv[:2] in (["python", "tests/fuzz_grammar.py"], ["python3", "tests/fuzz_grammar.py"]):
        return set_flag(set_flag(argv, "--cases", "20"), "--out", str(work / "fuzz-grammar"))
    if module == "specee.bench.lookup":  # one prompt a dataset (code-edit: two), a few tokens, SpecEE's questions
        if not (work / "questions").exists():
            pytest.skip(f"SpecEE's question files are absent ({QUESTIONS})")
        out = set_flag(set_flag(set_flag(argv, "-n", "8"), "-t", "1"), "--rounds", "1")
        return set_flag(set_flag(out, "--per-category", "1"), "--data-dir", str(work / "questions"))
    if module == "specee.bench.lookup_bound":  # one summary and two code edits, a few tokens, one round
        if not (work / "questions").exists():
            pytest.skip(f"SpecEE's question files are absent ({QUESTIONS})")
        out = set_flag(set_flag(set_flag(argv, "-n", "8"), "-t", "1"), "--rounds", "1")
        return set_flag(set_flag(out, "--per-category", "1"), "--data-dir", str(work / "questions"))
    if module == "specee.bench.filetype":  # two short texts, one type
        return set_flag(set_flag(set_flag(argv, "--texts", "2"), "--tokens", "32"), "--types", "q8_0")
    if module == "specee.bench.load":  # one round at -t 1 beside one busy process, a few tokens
        out = set_flag(set_flag(set_flag(argv, "-n", "4"), "--rounds", "1"), "--threads", "1")
        return set_flag(set_flag(out, "--load", "1"), "--load-limit", "120")
    if module == "specee.bench.cli":
        return set_flag(set_flag(set_flag(set_flag(argv, "-n", "8"), "--rounds", "1"), "-t", "1"), "--limit", "1")
    if module == "specee.bench.grammar":  # one round of one case, a few tokens
        out = set_flag(set_flag(set_flag(argv, "--max-tokens", "16"), "--rounds", "1"), "-t", "1")
        return set_flag(out, "--cases", "person")
    raise AssertionError(f"command not covered by tests/test_readme.py: {shlex.join(argv)}")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, bpe_dir: Path, spm_dir: Path) -> Path:  # noqa: F811
    """A folder laid out like the repository, with the docs' placeholder files."""
    work = tmp_path_factory.mktemp("readme") / "repo"
    work.mkdir()
    (work / "autoee").symlink_to(REPO / "autoee")
    (work / "tests").symlink_to(REPO / "tests")
    if QUESTIONS.is_dir():
        (work / "questions").symlink_to(QUESTIONS)
    (work / "MODEL_DIR").symlink_to(bpe_dir)
    (work / "Llama-2-7b-chat-hf").symlink_to(spm_dir)  # SentencePiece, as Llama 2's
    cfg = json.loads((bpe_dir / "config.json").read_text())
    eagle = work / "EAGLE"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps(cfg))
    torch.save(eagle_state(cfg), eagle / "pytorch_model.bin")
    (work / "EAGLE-llama2-chat-7B").symlink_to(eagle)
    save_file(predictor_state([0, 1]), work / "preds.safetensors")
    (work / "specee-predictors.safetensors").symlink_to(work / "preds.safetensors")
    write_peft(work / "PEFT_DIR", load_hf(bpe_dir), rank=4, alpha=8.0, seed=1)
    for name in ("MODEL.gguf", "SmolLM2.gguf", "smollm2-f16.gguf", "smollm2-q8_0.gguf", "smollm2-q4_0.gguf",
                 Path(default_model_path()).name):
        (work / name).symlink_to(default_model_path())  # (the type in a name is not checked)
    (work / "smollm2-135m-specee.gguf").symlink_to(REPO / "autoee/weights/smollm2-135m-specee.gguf")
    return work


def run_tool(argv: list[str], work: Path) -> None:
    r = subprocess.run([executable(argv[0]), *argv[1:]], cwd=work, capture_output=True, text=True, errors="replace",
                       stdin=subprocess.DEVNULL, timeout=900)
    assert r.returncode == 0, f"{shlex.join(argv)}\n--- stderr:\n{r.stderr[-3000:]}\n--- stdout:\n{r.stdout[-2000:]}"


def merged_stand_in(work: Path) -> Path:
    """A tiny merged file (base model + EAGLE head + predictors), made once."""
    merged = work / ".stand-in" / "merged.gguf"
    if not merged.exists():
        merged.parent.mkdir(exist_ok=True)
        base = merged.parent / "base.gguf"
        run_tool(["python", "-m", "specee.convert", "hf", "MODEL_DIR", "-o", str(base), "--outtype", "f16"], work)
        run_tool(["python", "-m", "specee.convert", "merge", str(base), "-o", str(merged), "--eagle", "EAGLE",
                  "--predictors", "preds.safetensors"], work)
    return merged


def synth_stand_in(work: Path, name: str, head: bool) -> None:
    """A small synthetic file (or draft head file for it)."""
    argv = ["python", "-m", "specee.convert", "synth", "-o", name, "--type", "q4_0"] + (["--draft-head"] if head else [])
    run_tool(limit(argv, work), work)


def stand_ins(argv: list[str], work: Path) -> None:
    """Files a command reads that other blocks (or the fixture) make; a command's own output is left alone."""
    out = flag_value(argv, "-o", "--out")
    words = {w for a in argv if a != out for w in re.split(r"[\s=]", a)}  # --config "NAME=ARGS" names files too
    for name in (n for n in STAND_INS if n in words and not (work / n).exists()):
        if name == "SpecEE-7b-chat-hf.gguf":
            make_eauto(merged_stand_in(work), work / name)
        elif name == "SpecEE-7b.gguf":
            (work / name).symlink_to(merged_stand_in(work))
        elif name.startswith("synth-7b-q4_0"):
            synth_stand_in(work, name, head=name.endswith("-head.gguf"))
        elif name == "STAGE1.gguf":
            (work / name).symlink_to(REPO / "autoee/weights/smollm2-135m-eagle-vocab8192.gguf")
        elif name == "smollm2-135m-eagle-exit.gguf":  # a draft head file of a head and the shipped predictors
            (work / name).symlink_to(REPO / "autoee/weights/smollm2-135m-specee.gguf")
        elif name == "smollm2-135m-exit.safetensors":  # what `autoee export -o smollm2-135m-exit` writes
            for suffix in (".safetensors", ".json"):
                (work / name).with_suffix(suffix).symlink_to(REPO / f"autoee/weights/smollm2-135m-exit{suffix}")


STAND_INS = ("SpecEE-7b-chat-hf.gguf", "SpecEE-7b.gguf", "synth-7b-q4_0.gguf", "synth-7b-q4_0-head.gguf",
             "STAGE1.gguf", "smollm2-135m-eagle-exit.gguf", "smollm2-135m-exit.safetensors")


def check_outputs(argv: list[str]) -> None:
    """No command writes into the repository's autoee/ (the shipped weights) through the test's link to it."""
    out = flag_value(argv, "-o", "--out")
    assert not (out and Path(out).parts[:1] == ("autoee",)), f"a documented command writes into autoee/: {argv}"


def skip_without_data(argv: list[str], work: Path) -> None:
    if any(a == "questions" or a.startswith("questions/") for a in argv) and not (work / "questions").exists():
        pytest.skip(f"SpecEE's question files are absent ({QUESTIONS})")
    module, _ = python_module(argv)
    if module == "specee.eval" and {"all", "humaneval"} & set(argv) and "--unsafe-exec" not in argv:
        from specee.eval import sandbox

        if reason := sandbox.sandbox_error():
            pytest.skip(f"humaneval needs its sandbox: {reason}")


def run_block(commands: list[str], work: Path) -> None:
    upstream = os.environ.get("SPECEE_UPSTREAM_BIN")
    port = str(free_port())
    servers: list[subprocess.Popen] = []
    try:
        for command in commands:
            background = command.endswith("&")
            command = command.rstrip("&").strip().replace("50052", port)
            if command == "kill %1":
                for p in servers:
                    p.send_signal(signal.SIGINT)
                    assert p.wait(10) is not None
                continue
            if "PATH/TO/" in command:
                if not upstream:
                    pytest.skip(f"needs upstream llama.cpp (set SPECEE_UPSTREAM_BIN=DIR): {command[:60]}...")
                command = command.replace("PATH/TO/", upstream.rstrip("/") + "/")
                for path in re.findall(re.escape(upstream.rstrip("/")) + r"/[\w.-]+", command):
                    if not Path(path).exists():
                        pytest.skip(f"needs {path} (SPECEE_UPSTREAM_BIN names a folder without it)")
            argv = limit(shlex.split(command), work)
            check_outputs(argv)
            skip_without_data(argv, work)
            stand_ins(argv, work)
            if background:
                servers.append(subprocess.Popen([executable(argv[0]), *argv[1:]], cwd=work, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE))
                for _ in range(100):  # until it listens
                    try:
                        socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                        break
                    except OSError:
                        assert servers[-1].poll() is None, servers[-1].stderr.read().decode()
                        time.sleep(0.1)
                continue
            run_tool(argv, work)
    finally:
        for p in servers:
            if p.poll() is None:
                p.kill()
                p.wait()


def doc_name(path: Path) -> str:
    return path.stem if path.parent == REPO else f"docs-{path.stem}"


def block_name(path: Path, i: int, commands: list[str]) -> str:
    argv = shlex.split(commands[0])
    module, sub = python_module(argv)
    what = f"{argv[2]}{'-' + sub if module in ('specee.convert', 'specee.autoee') else ''}" if module else argv[0]
    what = Path(argv[1]).name if what in ("python", "python3") else what
    return f"{doc_name(path)}-{i}-{what}"


BLOCKS = [(block_name(p, i, b), b) for p in DOCS for i, b in enumerate(bash_blocks(p)) if b]
# (the README's set-up block of the tests has no other command)


def test_the_readme_has_its_set_up_commands() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]  # as .ci/run reads them
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks[0].startswith("./install.sh && specee-cli ") and blocks[1].strip() == " && ".join(SET_UP[1:])
    assert sum(len(b) for name, b in BLOCKS if name.startswith("README")) > 10  # the parser found the others
    assert sum(len(b) for name, b in BLOCKS if name.startswith("docs-")) > 20


def test_the_readme_is_a_guide() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; measurements belong in docs/"


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=[doc_name(p) for p in DOCS])
def test_the_docs_links_resolve_inside_the_repo(path: Path) -> None:
    text = path.read_text()
    assert "../shared" not in text, f"{path.name} names a path outside the repository"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.is_file() and REPO in dest.parents, f"{path.name}: the link {target} leads nowhere in the repo"
        if anchor:
            anchors = {heading_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
            assert anchor in anchors, f"{path.name}: {dest.name} has no heading for #{anchor}"


@pytest.mark.slow
@pytest.mark.parametrize("commands", [b for _, b in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_readme_block(commands: list[str], work: Path) -> None:
    run_block(commands, work)


def test_the_server_command_and_client_snippets_work() -> None:
    """The README's specee-server command (a ```sh block: it does not end), started on a free port, and the `openai`
    snippets of the README and docs/server.md run against it as written."""
    section = (REPO / "README.md").read_text().split("### Server", 1)[1].split("\n### ", 1)[0]
    command = re.search(r"```sh\n(.*?)```", section, re.S).group(1).split("#")[0].strip()
    snippets = [re.search(r"```python\n(.*?)```", text, re.S).group(1)
                for text in (section, (REPO / "docs" / "server.md").read_text())]
    port = str(free_port())
    argv = shlex.split(command.replace("8080", port)) + ["-t", "1", "-c", "1024"]
    assert argv[0] == "specee-server"
    server = subprocess.Popen([executable(argv[0]), *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):  # 30 s at most, until it listens
            try:
                socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
                time.sleep(0.1)
        for code in snippets:
            r = subprocess.run([sys.executable, "-c", code.replace("8080", port)], capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=15)
