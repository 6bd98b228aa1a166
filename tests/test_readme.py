"""Every command block of the README runs, with small limits, so a documented command that breaks fails here.

Each ```bash block runs in order in a folder laid out like the repository (autoee/ and ../shared linked), after
placeholders are given stand-ins (a tiny Hugging Face folder for MODEL_DIR, an EAGLE head and predictors for it, a
SpecEE-style eauto file, the default model for MODEL.gguf) and the limits are cut (tokens, prompts, repetitions,
training steps, the synthetic file's shape). The set-up commands are what CI runs before the tests (.ci/run).
Commands that need upstream llama.cpp (PATH/TO/...) run when SPECEE_UPSTREAM_BIN names the folder of its binaries
and are skipped otherwise; every other command must be covered by a rule below, so a new one cannot slip by."""

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

from specee.paths import default_model_path
from test_convert_cli import bpe_dir, eagle_state, make_eauto, predictor_state  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
SET_UP = ("./install.sh", "python3 -m pip install -r tests/requirements.txt", "python3 -m pytest -q -rs")


def readme_blocks() -> list[list[str]]:
    """The README's bash blocks as lists of commands (continuations joined, comments dropped, && split)."""
    text = (REPO / "README.md").read_text()
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        commands = []
        for line in body.replace("\\\n", " ").splitlines():
            if "#" in line:  # drop the comment, keep the quoting
                line = " ".join(t if t in ("&", "&&") else shlex.quote(t) for t in shlex.split(line, comments=True))
            commands += [c.strip() for c in line.split("&&") if c.strip()]
        blocks.append([c for c in commands if c not in SET_UP and not c.startswith("./install.sh")])
    return blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with FLAG's value replaced, or FLAG VALUE appended."""
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value]


def executable(name: str) -> str:
    """The interpreter running the tests, and the console scripts installed beside it (as a user runs them)."""
    if name in ("python", "python3"):
        return sys.executable
    script = Path(sys.executable).parent / name
    assert script.is_file(), f"{name} is not installed beside {sys.executable}"
    return str(script)


def limit(argv: list[str], work: Path) -> list[str]:
    """The same command with small limits."""
    prog = Path(argv[0]).name
    module = argv[2] if argv[:2] in (["python", "-m"], ["python3", "-m"]) else ""
    sub = argv[3] if module and len(argv) > 3 else ""
    if prog in ("specee-cli", "llama-cli"):
        return set_flag(argv, "-n", "8") if "--list-devices" not in argv else argv
    if prog == "specee-bench":
        return set_flag(set_flag(set_flag(argv, "-p", "8"), "-n", "4"), "-r", "1")
    if prog == "specee-rpc-server":
        return argv + ["--timeout", "600"]
    if module == "specee.convert" and sub == "synth":  # a few MiB instead of 3.6 GiB, same code
        small = ["--layers", "32", "--embd", "256", "--ff", "512", "--heads", "4", "--vocab", "512"]  # 32: replays
        return argv + small + (["--draft-vocab", "256"] if "--draft-head" in argv else [])
    if module == "specee.convert":
        return argv
    if module == "specee.autoee" and sub == "train-eagle":
        return argv + ["--max-tokens", "3000", "--max-len", "128", "--steps", "2", "--threads", "1",
                       "--work-dir", str(work / "train-eagle")]
    if module == "specee.bench.spec":  # at most one prompt of each set the command asks for
        out = set_flag(set_flag(argv, "-n", "8"), "-t", "1")
        for flag in ("--mt-bench", "--humaneval"):
            out = set_flag(out, flag, "0" if flag in argv and argv[argv.index(flag) + 1] == "0" else "1")
        return set_flag(out, "--rounds", "1") if "--rounds" in out else out
    if module == "specee.eval":
        return set_flag(set_flag(set_flag(argv, "--limit", "1"), "-n", "8"), "-t", "1")
    if module == "specee.bench.runtime":
        out = set_flag(set_flag(set_flag(argv, "-r", "1"), "-t", "1"), "--rounds", "1")
        for flag, value in (("-p", "8"), ("-n", "4")):
            out = set_flag(out, flag, value) if flag in out else out
        return out
    if argv[:2] in (["python", "tests/fuzz_gguf.py"], ["python3", "tests/fuzz_gguf.py"]):
        return set_flag(set_flag(argv, "--random", "100"), "--out", str(work / "fuzz"))
    if module == "specee.bench.cli":
        return set_flag(set_flag(set_flag(set_flag(argv, "-n", "8"), "--rounds", "1"), "-t", "1"), "--limit", "1")
    raise AssertionError(f"README command not covered by tests/test_readme.py: {shlex.join(argv)}")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, bpe_dir: Path) -> Path:  # noqa: F811
    """A folder laid out like the repository, with the README's placeholder files."""
    root = tmp_path_factory.mktemp("readme")
    work = root / "repo"
    work.mkdir()
    (work / "autoee").symlink_to(REPO / "autoee")
    (work / "tests").symlink_to(REPO / "tests")
    if SHARED.is_dir():
        (root / "shared").symlink_to(SHARED)
    (work / "MODEL_DIR").symlink_to(bpe_dir)
    cfg = json.loads((bpe_dir / "config.json").read_text())
    eagle = work / "EAGLE"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps(cfg))
    torch.save(eagle_state(cfg), eagle / "pytorch_model.bin")
    save_file(predictor_state([0, 1]), work / "preds.safetensors")
    for name in ("MODEL.gguf", "SmolLM2.gguf", "smollm2-f16.gguf", "smollm2-q8_0.gguf", "smollm2-q4_0.gguf"):
        (work / name).symlink_to(default_model_path())  # (the type in a name is not checked)
    return work


def stand_ins(argv: list[str], work: Path) -> None:
    """Files a command reads that earlier commands of its block make from other files."""
    if "SpecEE-7b-chat-hf.gguf" in argv and not (work / "SpecEE-7b-chat-hf.gguf").exists():
        make_eauto(work / "specee.gguf", work / "SpecEE-7b-chat-hf.gguf")
    if "STAGE1.gguf" in " ".join(argv) and not (work / "STAGE1.gguf").exists():
        (work / "STAGE1.gguf").symlink_to(REPO / "autoee/weights/smollm2-135m-eagle-vocab8192.gguf")


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
            argv = limit(shlex.split(command), work)
            stand_ins(argv, work)
            argv = [executable(argv[0]), *argv[1:]]
            if background:
                servers.append(subprocess.Popen(argv, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
                for _ in range(100):  # until it listens
                    try:
                        socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                        break
                    except OSError:
                        assert servers[-1].poll() is None, servers[-1].stderr.read().decode()
                        time.sleep(0.1)
                continue
            r = subprocess.run(argv, cwd=work, capture_output=True, text=True, errors="replace",
                               stdin=subprocess.DEVNULL, timeout=900)
            assert r.returncode == 0, f"{command}\n--- stderr:\n{r.stderr[-3000:]}\n--- stdout:\n{r.stdout[-2000:]}"
    finally:
        for p in servers:
            if p.poll() is None:
                p.kill()
                p.wait()


BLOCKS = [(i, b) for i, b in enumerate(readme_blocks()) if b]  # (the set-up block of the tests has no other command)


def test_the_readme_has_its_set_up_commands() -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert blocks[0].startswith("./install.sh && specee-cli ") and blocks[1].strip() == " && ".join(SET_UP[1:])
    assert sum(len(b) for _, b in BLOCKS) > 20  # the parser found the other commands


@pytest.mark.slow
@pytest.mark.parametrize("commands", [b for _, b in BLOCKS], ids=[f"{i}-{b[0].split()[0]}" for i, b in BLOCKS])
def test_readme_block(commands: list[str], work: Path) -> None:
    if "../shared" in " ".join(commands) and not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent")
    run_block(commands, work)
